"""The agreement side of one member: from its view of the cluster to an installed configuration.

Why one module of this size: cut proposal, votes, the classic round, certificates and joins
are one state machine over one configuration; :mod:`.cut`, :mod:`.agreement` and :mod:`.plan`
hold the parts that are pure functions of it.

Theory of operation
-------------------
Sans-IO, like :mod:`.membership`, whose :class:`~.membership.Member` creates one
:class:`Reconfiguration` and drives it: the member owns the view, the clock, the random
generator, the outbox and the events; this object owns what changes the configuration: the
configuration itself (:attr:`Reconfiguration.configuration`), the agreement, the plan, the
joiners, fencing, and the flag that asks for cut detection (:attr:`Reconfiguration.cut_dirty`).

The seam. Everything this object takes from its member is handed to its constructor, as
aioquic hands its recovery a few values and callbacks, and it touches no other attribute of
the member:

- read-only facts, through the :class:`Membership` protocol (public on the member): ``id`` and
  ``params`` (read once), ``joining``, ``removed``, ``left``, ``self_suspected``,
  ``in_contact``, ``reachable``, ``view_digest()`` and ``suspected()`` (the alerts it holds);
- the member's tables, shared by reference: ``view`` (read only) and ``accused_at`` (when each
  member was first heard accused; this side records one it finds in a cut without an entry);
- the member's ``counts``, its random generator ``rng``, and three outputs: ``send`` (its
  outbox), ``emit`` (its events) and ``sample`` (random live peers, drawn from ``rng``);
- three notifications back: ``on_installed`` (a decided configuration, after
  :attr:`Reconfiguration.configuration` is set to it, so the two stay equal), ``on_removed``
  and ``on_admitted`` (a joiner's admission).

In the other direction the member calls only this object's public methods and attributes, and
sets ``cut_dirty`` whenever its view changes; at the end of ``receive``, ``handle_timer`` and
the evidence reports it runs :meth:`Reconfiguration.consider_cut` if the flag is set (a change
made by another input, such as ``leave``, is detected at the next of those). The hot paths
(every vote and agreement message) use the values and bound methods stored at construction;
the protocol is read on cold paths only, for through it the compiled build (mypyc compiles
both modules as one group) makes a generic attribute lookup.

Removing a member and promoting a spare are decided, never assumed (docs/design.md section 5). A
:class:`~.messages.Dead` verdict is evidence for the cut detector (:mod:`.cut`), not a removal.
Whenever the member's view changes it asks for a cut (:meth:`Reconfiguration.consider_cut`);
once the proposal has been stable for ``cut_settle_s`` (and every accused member had
``refutation_window_s`` to refute), the member votes in the fast round of
:class:`~.agreement.Consensus`; vote bitmaps ride the gossip path; a quorum decides. Without a
decision a member starts a classic round after ``classic_timeout_s`` plus a jitter. Every member
computes the next configuration and plan (:func:`~.plan.next_configuration`, memoised in a
:data:`Transitions` table several members may share) and installs it. A member learns it was
removed only from a decided configuration.

Catch-up. Members behind catch up from a peer's log of certificates: on any agreement message
from an older configuration, and through the anti-entropy digest, which carries ``config_id``.
Joins. A process outside the configuration sends :class:`~.messages.Join` to its seeds until a
decided configuration holds it; members flood each join when they first hear it and again
whenever the joiner asks again, and learn joiners from any vote or ``Accept`` that names them,
so all propose the same cut (a flood after a mass crash goes half to dead members).
Classic rounds run only to decide a change: a member whose view holds none when its round falls
due defers it until it has one (votes left by a refuted suspicion cost no traffic), and a
coordinator never proposes the empty cut (:mod:`.agreement`).
Progress. After a decision the surviving rank holders gossip their last committed step
(:class:`~.messages.Progress`) until the plan's ``resume_step`` is fixed.
Fencing. A member that believes less than a majority reachable for ``lease_s`` raises
``QuorumLost`` and sets ``fenced`` until that changes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Final, Protocol

from . import events as ev
from .agreement import (
    SEGMENT_BITS,
    SEGMENT_MASK,
    Certificate,
    Consensus,
    Tally,
    classic_quorum,
    fast_quorum,
    progress_messages,
)
from .configuration import Configuration
from .cut import Suspected, propose_cut
from .hashing import mix_triple
from .messages import (
    Accept,
    Cut,
    Digest,
    Join,
    Joiner,
    MemberId,
    MemberState,
    Message,
    Prepare,
    Progress,
    Promise,
    Vote,
)
from .params import Params
from .plan import Plan, Policy, next_configuration, with_resume_step

if TYPE_CHECKING:
    from collections import Counter
    from random import Random

# Final: the compiled build reads these from C statics, not the module dict, on every use.
ALIVE: Final = MemberState.ALIVE
DEAD: Final = MemberState.DEAD
LEFT: Final = MemberState.LEFT
_INF: Final = math.inf
_MAX_FUTURE: Final = 64  # messages held for a configuration this member has not reached yet
_CATCHUP_GAP_S: Final = 0.2  # at most one catch-up reply per peer this often
_CATCHUP_GRACE_S: Final = 1.0  # stale votes right after our decision get no certificate
AgreementMessage = Vote | Prepare | Promise | Accept | Progress


class Transition:
    """A decided change worked out once: the next configuration, its plan, and the plan with
    each ``resume_step`` seen (keyed by the max committed step)."""

    __slots__ = ("configuration", "plan", "ready", "survivors")

    def __init__(self, old: Configuration, configuration: Configuration, plan: Plan) -> None:
        self.configuration = configuration
        self.plan = plan
        self.ready: dict[int, Plan] = {}
        # Bitmap over the new configuration's members that held a rank in the old one: the
        # members whose last committed step the plan waits for.
        survivors = 0
        for i, member in enumerate(configuration.members):
            if old.rank_of(member) is not None:
                survivors |= 1 << i
        self.survivors = survivors


Transitions = dict[tuple[Configuration, Cut, Policy], Transition]


class Membership(Protocol):
    """What the agreement side reads from its member, all of it public on
    :class:`~.membership.Member` and read-only here (but :meth:`send_isolated_verdicts`, which
    asks the member to send its subjects the verdicts it took without a majority). Read on
    cold paths only (cut detection, timers, fencing): through a Protocol the compiled build
    makes a generic attribute lookup."""

    @property
    def id(self) -> MemberId: ...
    @property
    def params(self) -> Params: ...
    @property
    def joining(self) -> Joiner | None: ...
    @property
    def removed(self) -> bool: ...
    @property
    def left(self) -> bool: ...
    @property
    def self_suspected(self) -> bool: ...
    @property
    def in_contact(self) -> bool: ...
    @property
    def reachable(self) -> int: ...
    def view_digest(self) -> tuple[int, int]: ...
    def suspected(self) -> dict[MemberId, Suspected]: ...
    def isolated_verdicts(self) -> Collection[MemberId]: ...
    def send_isolated_verdicts(self) -> None: ...


class Reconfiguration:
    """The agreement state of one :class:`~.membership.Member`, created by it. Everything it
    takes from the member comes in here (module docstring, "The seam"); it touches nothing else.

    Args:
        member: the facts it reads (:class:`Membership`); ``id`` and ``params`` are read once.
        configuration: the configuration the member starts in.
        send: queues one datagram to a member (the member's outbox, bounded there).
        emit: queues one event for the host (bounded there).
        sample: up to ``count`` distinct random members that are not this one nor dead or gone,
            drawn from the member's random generator.
        counts: the member's counters, incremented here under their names.
        rng: the member's random generator (the only source of randomness).
        view: the member's view, (state, incarnation) by member; absent means alive at
            incarnation 0. Read only.
        accused_at: when the member first heard each member accused (seconds); a member found
            in a cut without an entry is recorded at ``now`` here.
        on_installed: called with a decided configuration that holds the member or that the
            member, a joiner, catches up through; after it the member probes and gossips
            within it.
        on_removed: called with ``now`` when a decided configuration left the member out.
        on_admitted: called with ``now`` and the ``config_id`` that admitted the member, a
            joiner.
        policy, joining, seeds, transitions: as for :class:`~.membership.Member`.
        now: the current time in seconds.
    """

    def __init__(
        self,
        member: Membership,
        configuration: Configuration,
        *,
        send: Callable[[MemberId, Message], None],
        emit: Callable[[ev.Event], None],
        sample: Callable[[int], list[MemberId]],
        counts: Counter[str],
        rng: Random,
        view: dict[MemberId, tuple[MemberState, int]],
        accused_at: dict[MemberId, float],
        on_installed: Callable[[Configuration], None],
        on_removed: Callable[[float], None],
        on_admitted: Callable[[float, int], None],
        policy: Policy,
        joining: Joiner | None,
        seeds: tuple[MemberId, ...],
        transitions: Transitions | None,
        now: float,
    ) -> None:
        params = member.params
        self._member = member
        # Constant for the member's lifetime, so read once: the hot paths (every vote, every
        # agreement message) use these attributes, not the Protocol.
        self._id = member.id
        self._params = params
        self._send = send
        self._emit = emit
        self._sample = sample
        self._counts = counts
        self._rng = rng
        self._view = view
        self._accused_at = accused_at
        self._on_installed = on_installed
        self._on_removed = on_removed
        self._on_admitted = on_admitted
        self.configuration = configuration
        """The configuration last installed: this object decides every change of it."""
        self.cut_dirty = False
        """The member's view changed since the last cut detection: the member sets it,
        :meth:`consider_cut` clears it, and the member runs that before returning."""
        self.policy = Policy(policy)
        self._seeds = seeds
        self._transitions: Transitions = {} if transitions is None else transitions
        self._transition: Transition | None = None
        self._join_at = now if joining is not None else _INF
        self.last_committed_step = -1
        """Set by the host (:meth:`~.membership.Member.report_progress`); voted and reported
        for the plan."""
        self.fenced = False
        """True while :class:`~.events.QuorumLost` holds: the host must not train."""
        self.plan: Plan | None = None
        """The plan of the last decided change; ``resume_step`` is set once it is ready."""
        self._certificates: deque[tuple[Certificate, int]] = deque(
            maxlen=params.certificate_log)  # (certificate, members of its configuration)
        self.joiners: dict[MemberId, Joiner] = {}
        self._future: deque[tuple[MemberId, AgreementMessage]] = deque(maxlen=_MAX_FUTURE)
        self._decided_at = -_INF
        self._catchup_sent: dict[MemberId, float] = {}  # peer -> when we sent certificates
        self._digest_sent: dict[MemberId, float] = {}  # peer -> when we nudged it with a digest
        self._proposal: Cut | None = None
        self._vote_at = _INF  # when _proposal is ripe to vote for (settled, windows over)
        self._settle_at = _INF  # when to run cut detection again
        self._classic_at = _INF
        self._classic_deferred = False  # a classic round fell due with nothing to propose
        self._classic_attempt = 0
        self._vote_push_at = _INF
        self._last_vote_push = -_INF
        self._vote_resend_at = _INF
        self._lease_at = _INF
        self._progress: Tally | None = None
        self._survivors = 0  # bitmap of the members whose progress the plan waits for
        self.consensus = Consensus(configuration, None if joining else member.id,
                                   dropped=counts)

    # ------------------------------------------------------------------ timers

    def due_at(self) -> float:
        """The earliest of this layer's deadlines (seconds); ``inf`` if none."""
        # Plain compares, no tuple: this runs on every next_deadline() (boxing five floats
        # into a tuple there cost the compiled simulator a third of its speed).
        t = self._settle_at
        if self._classic_at < t:
            t = self._classic_at
        if self._vote_push_at < t:
            t = self._vote_push_at
        if self._vote_resend_at < t:
            t = self._vote_resend_at
        if self._lease_at < t:
            t = self._lease_at
        if self._join_at < t:
            t = self._join_at
        return t

    def handle_timer(self, now: float) -> None:
        """Run whatever of this layer is due at ``now``."""
        m = self._member
        if m.joining is not None:
            if now >= self._join_at:
                self._join_at = now + self._params.join_retry_s
                seed = self._seeds[int(self._rng.random() * len(self._seeds))]
                self._send(seed, Join(m.joining, self.configuration.config_id))
            return
        if now >= self._settle_at:
            self.consider_cut(now)
        if now >= self._classic_at:
            self._start_classic(now)
        if now >= self._vote_push_at:
            self._push_votes(now)
        if now >= self._vote_resend_at:
            self._vote_resend_at = _INF
            self._resend(now)
        if now >= self._lease_at:
            self._lease_at = _INF
            self.fenced = True
            config = self.configuration
            n = len(config)
            self._emit(ev.QuorumLost(now, config.config_id, n, m.reachable, classic_quorum(n)))

    def postpone(self, until: float) -> None:
        """The member's loop stalled: a vote or a classic round that fell due meanwhile waits
        until ``until``, for the refutation that voids the cut may be in the backlog."""
        self._settle_at = max(self._settle_at, until) if self._settle_at < _INF else _INF
        self._vote_at = max(self._vote_at, until) if self._vote_at < _INF else _INF
        if self._classic_at < until:
            self._classic_at = until

    # ------------------------------------------------------------------ cut proposal and votes

    def consider_cut(self, now: float) -> None:
        """Re-run cut detection; vote once the proposal has been stable for ``cut_settle_s``."""
        m = self._member
        self.cut_dirty = False
        if m.joining is not None or m.removed:
            return
        self.check_lease(now)
        p = self._params
        isolated = m.isolated_verdicts()
        gone = [member for member, (state, _) in self._view.items()
                if state >= DEAD and member != self._id and member not in isolated]
        if m.left:
            gone.append(self._id)
        suspected = m.suspected()
        proposal = propose_cut(
            self.configuration, gone=gone, suspected=suspected, joiners=self.joiners.values(),
            now=now, high=p.alerts_to_remove, low=p.min_alerts_to_confirm,
            min_window_s=p.suspicion_min_s)
        consensus = self.consensus
        self._offer(now, proposal.cut)
        if self.consensus is not consensus:
            return  # the round we held decided: the proposal was for the old configuration
        # A subject that only waits for its refutation window becomes stable at recheck_at
        # without any new message, so look again then (also after voting for a cut of joiners
        # only, which does not wait for it).
        if proposal.cut is None:
            self._proposal = None
            self._vote_at = _INF
            self._settle_at = proposal.recheck_at
            return
        if proposal.cut != self._proposal:
            self._proposal = proposal.cut
            self._vote_at = self._ripe_at(now, proposal.cut, proposal.silenced)
            self._settle_at = min(self._vote_at, proposal.recheck_at)
            return
        if now < self._vote_at:
            self._settle_at = min(self._vote_at, proposal.recheck_at)
            return
        self._vote_at = _INF
        self._settle_at = proposal.recheck_at
        if m.self_suspected:
            return  # cut off ourselves: our view of the others is not evidence
        if consensus.vote_fast(proposal.cut, self.last_committed_step):
            self._counts["votes_cast"] += 1
            if self._leads_classic_now(proposal.cut):
                self._classic_at = now
            self._after_consensus_input(now)

    def _offer(self, now: float, cut: Cut | None) -> None:
        """``cut`` (None: no change) is our view now. A classic round we coordinate proposes
        it, as of its ``Accept``, not of its ``Prepare``: promises may come much later (a
        healed partition), and a view from before would remove members that have refuted
        since. A round that held for want of a change sends its ``Accept`` now; one deferred
        for the same reason (:meth:`_start_classic`) starts after this member's jitter. A view
        that counts fewer than a majority reachable offers no change
        (:meth:`_view_holds_majority`)."""
        consensus = self.consensus
        if cut is not None and not self._view_holds_majority():
            cut = None
        consensus.update_fallback(cut)
        if consensus.outbox or consensus.decision is not None:
            self._after_consensus_input(now)
        if cut is not None and self._classic_deferred and self.consensus is consensus:
            self._classic_deferred = False
            self._classic_at = min(self._classic_at, now + self._classic_jitter())

    def _view_holds_majority(self) -> bool:
        """Whether this member's view counts a majority of its configuration reachable: members
        it holds suspected or convicted are not, members that left are (they take part until
        a decision removes them). A coordinator whose view does not proposes none of it: its
        round needs a quorum of promises, and if one comes, some promiser is alive that the
        view holds dead (verdicts from the minority side of a healed partition, not refuted
        yet), while acceptors accept a coordinator's value whatever their own views, their
        own removal included. A view that is right (a majority is gone) gets no quorum of
        promises anyway."""
        need = classic_quorum(len(self.configuration))
        reachable = self._member.reachable
        if reachable >= need:
            return True  # the usual case: no scan of the view
        for member, (state, _) in self._view.items():
            if state == LEFT and member != self._id:
                reachable += 1
        return reachable >= need

    def _classic_jitter(self) -> float:
        """This member's share of ``classic_spread_s`` for the current attempt (seconds): a
        hash of (config_id, attempt, member), so coordinators rarely collide and every run
        with the same seed draws the same."""
        u = mix_triple(self.configuration.config_id, self._classic_attempt, self._id) / 2.0**64
        return u * self._params.classic_spread_s

    def _accused(self, cut: Cut) -> list[MemberId]:
        """The members ``cut`` removes that neither left nor exited (nor are we): only an
        accusation, which a stalled member may still refute."""
        return [member for member in cut.removed
                if self._view.get(member, (ALIVE, 0))[0] != LEFT and member != self._id]

    def _leads_classic_now(self, cut: Cut) -> bool:
        """Whether we start a classic round as soon as we have voted for ``cut``, instead of
        after ``classic_timeout_s``: the cut accuses nobody (it only admits joiners, or removes
        members that left or exited: nothing to refute, so nothing to wait for) and the members
        it keeps that our view holds alive cannot make a fast quorum (Rapid section 5: round 0
        needs ``N - floor((N - 1) / 4)`` votes; two exits of six, say, or joiners admitted
        while a third of the configuration is suspected after a mass crash), so waiting for
        the fast round only costs time. Only the first of those members leads (every voter
        with our view computes the same one), so coordinators do not collide; the others keep
        their timeout in case it is dead too. A cut with an accusation keeps the timeout: the
        safety fuzz removed members that had refuted after a short partition healed, when it
        started at once."""
        if self._accused(cut):
            return False
        config, view = self.configuration, self._view
        removed = set(cut.removed)
        kept = [member for member in config.members if member not in removed
                and (member == self._id or view.get(member, (ALIVE, 0))[0] == ALIVE)]
        return len(kept) < fast_quorum(len(config)) and bool(kept) and kept[0] == self._id

    def _ripe_at(self, now: float, cut: Cut, silenced: tuple[MemberId, ...] = ()) -> float:
        """When we may vote for ``cut``: it settled for ``cut_settle_s`` (``exit_settle_s`` if
        it only removes members that left, exited or went silent), and every member it removes
        that did not leave had ``refutation_window_s`` since we first heard it accused
        (docs/design.md section 4: a stalled member must get to refute first), unless its observers
        found its whole process silent (``silenced``, from :func:`propose_cut`; see
        ``Member.report_silent``: a stalled loop still answers pulses, so there is nobody to
        wait for)."""
        window = self._params.refutation_window_s
        owed = [member for member in self._accused(cut) if member not in silenced]
        certain = not owed and not cut.joined
        ripe = now + (self._params.exit_settle_s if certain else self._params.cut_settle_s)
        for member in owed:
            since = self._accused_at.setdefault(member, now)
            if since + window > ripe:
                ripe = since + window
        return ripe

    def receive(self, now: float, sender: MemberId, msg: AgreementMessage) -> None:
        """Handle one agreement message (votes, classic rounds, progress) from ``sender``."""
        cid = self.configuration.config_id
        if msg.config_id < cid:
            self._counts["agreement_behind_peer"] += 1
            # Right after a decision the others are milliseconds behind and about to decide
            # from the bits already spreading: a certificate to each would cost 8 segments per
            # peer at 16k members. Only a peer still behind after the grace gets one.
            if now - self._decided_at >= _CATCHUP_GRACE_S or msg.config_id < cid - 1:
                self.send_certificates(now, sender, msg.config_id)
            return
        if msg.config_id > cid:
            # We missed a decision: keep the message for later and ask the sender to catch us
            # up (it answers an older digest with its certificates).
            self._counts["agreement_ahead_peer"] += 1
            self._future.append((sender, msg))
            self.send_digest_to(now, sender)
            return
        consensus = self.consensus
        if isinstance(msg, Vote):
            if msg.cut.joined:
                self._learn_joiners(msg.cut)
            if consensus.merge_vote(msg):
                self._after_consensus_input(now)
        elif isinstance(msg, Progress):
            self._merge_progress(now, sender, msg)
        elif sender not in self.configuration:
            self._counts["dropped_stranger_agreement"] += 1
        elif isinstance(msg, Prepare):
            consensus.on_prepare(sender, msg)
            # Someone coordinates: give its round time before starting our own.
            self._classic_at = max(self._classic_at if self._classic_at < _INF else 0.0,
                                   now + 2 * self._params.classic_timeout_s)
            self._after_consensus_input(now)
        elif isinstance(msg, Promise):
            consensus.on_promise(sender, msg)
            self._after_consensus_input(now)
        else:
            if msg.cut.joined:
                self._learn_joiners(msg.cut)
            consensus.on_accept(sender, msg)
            self._after_consensus_input(now)

    def _after_consensus_input(self, now: float) -> None:
        consensus = self.consensus
        for dest, message in consensus.outbox:
            self._send(dest, message)
        consensus.outbox.clear()
        if consensus.decision is not None:
            self._decide(now, consensus.decision)
            return
        if consensus.active:
            if self._classic_at == _INF and not self._classic_deferred:
                self._classic_at = now + self._params.classic_timeout_s + self._classic_jitter()
            if self._vote_resend_at == _INF:
                self._vote_resend_at = now + self._params.vote_resend_s
        self._schedule_vote_push(now)

    def _schedule_vote_push(self, now: float) -> None:
        if self._vote_push_at == _INF:
            interval = self._params.vote_push_interval_s
            self._vote_push_at = max(now, self._last_vote_push + interval)

    def _push_votes(self, now: float) -> None:
        self._vote_push_at = _INF
        self._last_vote_push = now
        votes = self.consensus.dirty_votes()
        if votes:
            for peer in self._sample(self._params.gossip_fanout):
                for vote in votes:
                    self._send(peer, vote)
        progress = self._progress
        if progress is not None and progress.dirty:
            # One peer per push while the tally grows (a push per change still spreads it
            # epidemically, a third of the bytes of votes); once it is complete here (the plan
            # is ready), the last bits go to gossip_fanout peers: with one, a 6-member job often
            # left a member without them until the next resend, 0.5 s later, and the new group
            # waited for that member.
            ready = self.plan is not None and self.plan.resume_step is not None
            config = self.configuration
            reports = progress_messages(config.config_id, progress, len(config), progress.dirty)
            progress.dirty = 0
            for peer in self._sample(self._params.gossip_fanout if ready else 1):
                for report in reports:
                    self._send(peer, report)

    def _resend(self, now: float) -> None:
        """Anti-entropy for lost pushes: while undecided, all our vote tallies (and, as a
        coordinator still gathering promises, our ``Prepare`` to the members that did not
        promise), and while the plan waits for reports, our progress tally, to one random peer
        every ``vote_resend_s``."""
        consensus, progress = self.consensus, self._progress
        undecided = consensus.active and consensus.decision is None
        waiting = progress is not None and self.plan is not None and self.plan.resume_step is None
        if not (undecided or waiting):
            return
        self._vote_resend_at = now + self._params.vote_resend_s
        peers = self._sample(1)
        if not peers:
            return
        if undecided:
            for vote in consensus.all_votes():
                self._send(peers[0], vote)
            consensus.resend_prepare()
            for dest, message in consensus.outbox:
                self._send(dest, message)
            consensus.outbox.clear()
        if waiting and progress is not None:
            config = self.configuration
            for report in progress_messages(config.config_id, progress, len(config)):
                self._send(peers[0], report)

    def _start_classic(self, now: float) -> None:
        consensus = self.consensus
        self._classic_at = _INF
        if consensus.decision is not None or consensus.index < 0:
            return
        if self._proposal is None or not self._view_holds_majority():
            # Nothing of our own to propose (or a view we may not propose:
            # _view_holds_majority): a round of ours could only hold (the empty cut is
            # never decided; agreement.py), or hold already. A value some voters may have
            # decided is proposed by whichever member has a change to propose, for its round
            # reaches the same promises. Start once our view has one (_offer); no Prepare
            # traffic meanwhile, nor after a refuted suspicion left stale votes.
            self._classic_deferred = True
            return
        consensus.prepare(self._classic_attempt, self._proposal)
        self._classic_attempt += 1
        self._counts["classic_rounds_started"] += 1
        self._after_consensus_input(now)
        self._classic_at = now + 2 * self._params.classic_timeout_s  # retry if it stalls

    # ------------------------------------------------------------------ decision

    def _decide(self, now: float, cert: Certificate) -> None:
        """Install the decided successor of the current configuration."""
        m = self._member
        old = self.configuration
        key = (old, cert.cut, self.policy)
        transition = self._transitions.get(key)
        if transition is None:
            new, plan, _reason = next_configuration(old, cert.cut, policy=self.policy)
            if len(self._transitions) >= 4 * self._params.certificate_log:
                self._transitions.clear()  # a bound: a miss only recomputes
            transition = self._transitions[key] = Transition(old, new, plan)
        self._transition = transition
        new, plan = transition.configuration, transition.plan
        self._certificates.append((cert, len(old)))
        self._decided_at = now
        self._counts["decisions_fast" if cert.fast else "decisions_classic"] += 1
        # Push the certificate so that members still counting learn it from us.
        for peer in self._sample(self._params.gossip_fanout):
            for vote in cert.votes(len(old)):
                self._send(peer, vote)
        was_rank = old.rank_of(self._id)
        # A joiner learns its admission from the members that will probe it.
        for joiner in cert.cut.joined:
            if joiner.member in new and self._id in new.observers_of(joiner.member):
                for vote in cert.votes(len(old)):
                    self._send(joiner.member, vote)
        self.configuration = new
        self._on_installed(new)
        for member in [j for j in self.joiners if j in new]:
            del self.joiners[member]
        self._catchup_sent.clear()
        self._digest_sent.clear()
        self.consensus = Consensus(new, self._id if self._id in new else None, dropped=self._counts)
        self._proposal = None
        self._vote_at = self._settle_at = self._classic_at = _INF
        self._vote_push_at = self._vote_resend_at = _INF
        self._classic_attempt = 0
        self._classic_deferred = False
        self.plan = plan
        self._emit(ev.ConfigurationDecided(now, new, cert.round, cert.bits.bit_count(), plan))
        if self._id not in new and m.joining is not None:
            self._replay_future(now)  # a joiner catching up: not admitted yet, keep asking
            return
        if self._id not in new:
            self._on_removed(now)
            return
        if m.joining is not None:
            self._join_at = _INF
            self._on_admitted(now, new.config_id)
        rank = new.rank_of(self._id)
        if rank is not None and was_rank is None:
            self._emit(ev.RankAssigned(now, new.config_id, rank))
        if plan.action == "stop":
            self._emit(ev.JobStopped(now, new.config_id, plan.vacant))
        elif plan.vacant:
            self._emit(ev.WaitingForSpare(now, new.config_id, plan.vacant))
        # The plan waits for the last committed step of every rank holder that survived.
        self._survivors = transition.survivors
        self._progress = Tally()
        self._vote_resend_at = now + self._params.vote_resend_s
        if was_rank is not None:
            index = self.consensus.index
            self._progress.merge(index // SEGMENT_BITS, 1 << index, self.last_committed_step)
            self._schedule_vote_push(now)
        self._check_plan(now)
        self._replay_future(now)

    def _replay_future(self, now: float) -> None:
        m = self._member
        future = list(self._future)
        self._future.clear()
        for sender, message in future:
            if not m.removed:
                self.receive(now, sender, message)

    # ------------------------------------------------------------------ progress and the plan

    def _merge_progress(self, now: float, sender: MemberId, msg: Progress) -> None:
        progress = self._progress
        if progress is None:
            return
        n = len(self.configuration)
        first = msg.segment * SEGMENT_BITS
        bits = int.from_bytes(msg.bits, "little")
        if first >= n or bits >> min(SEGMENT_BITS, n - first):
            self._counts["dropped_invalid_progress"] += 1
            return
        # Compared within the segment: masking and complementing the whole bitmap (2 KiB at 16k
        # members) for every report cost three copies of it.
        if (progress.bits >> first) & SEGMENT_MASK & ~bits:
            # The sender knows less of this segment than we do (push-pull, as anti-entropy):
            # answer with ours, so a member whose pushes found nobody still completes.
            if self._once_per_gap(self._catchup_sent, sender, now):
                for report in progress_messages(self.configuration.config_id, progress, n,
                                                1 << msg.segment):
                    self._send(sender, report)
        if progress.merge(msg.segment, bits << first, msg.max_step):
            self._schedule_vote_push(now)
            self._check_plan(now)

    def _check_plan(self, now: float) -> None:
        plan, progress = self.plan, self._progress
        if plan is None or progress is None or plan.resume_step is not None:
            return
        if progress.bits & self._survivors == self._survivors:
            ready = self._transition.ready if self._transition else {}
            found = ready.get(progress.max_step)
            if found is None:
                found = ready[progress.max_step] = with_resume_step(plan, progress.max_step)
            self.plan = found
            self._emit(ev.PlanReady(now, found))

    # ------------------------------------------------------------------ catch-up

    def send_certificates(self, now: float, dest: MemberId, since: int) -> None:
        """Catch ``dest`` up from configuration ``since``: our certificates from there on."""
        if not self._once_per_gap(self._catchup_sent, dest, now):
            return
        sent = 0
        for cert, members in self._certificates:
            if cert.config_id >= since and sent < 4:
                for vote in cert.votes(members):
                    self._send(dest, vote)
                sent += 1
        if sent:
            self._counts["catchups_sent"] += 1
        else:
            self._counts["catchup_unavailable"] += 1

    def _once_per_gap(self, sent: dict[MemberId, float], peer: MemberId, now: float) -> bool:
        """Whether ``peer`` may get another catch-up reply now (one per ``_CATCHUP_GAP_S``);
        if so, records it. The table is a bound, not a cache: clearing it only allows a
        resend."""
        if now - sent.get(peer, -_INF) < _CATCHUP_GAP_S:
            return False
        if len(sent) > 4 * self._params.max_pending_joins:
            sent.clear()
        sent[peer] = now
        return True

    def send_digest_to(self, now: float, dest: MemberId) -> None:
        """Our digest carries our ``config_id``: whichever of us is behind learns it (the one
        ahead answers an older digest with certificates). At most once per peer per gap."""
        if not self._once_per_gap(self._digest_sent, dest, now):
            return
        m = self._member
        digest, entries = m.view_digest()
        self._send(dest, Digest(self.configuration.config_id, digest, entries))

    # ------------------------------------------------------------------ joins

    def on_join(self, now: float, sender: MemberId, msg: Join) -> None:
        m = self._member
        joiner = msg.joiner
        if sender == joiner.member and msg.config_id < self.configuration.config_id:
            self.send_certificates(now, sender, msg.config_id)
        if joiner.member in self.configuration or m.joining is not None:
            return
        if joiner.member in self.joiners:
            if sender == joiner.member:
                # The joiner asks again (every join_retry_s until admitted): flood it again,
                # for a flood that went partly to members that are dead but not yet convicted
                # (half of them, after a mass crash) missed members, and a member that does not
                # know a joiner proposes a different cut.
                self._flood_join(joiner)
            return
        if len(self.joiners) >= self._params.max_pending_joins:
            self._counts["dropped_join_overflow"] += 1
            return
        self.joiners[joiner.member] = joiner
        self.cut_dirty = True
        # Flood it at once, so that every member proposes the same cut.
        self._flood_join(joiner)

    def _learn_joiners(self, cut: Cut) -> None:
        """The joiners of a cut proposed for our configuration (a vote or an ``Accept``) are
        asking to join, as much as if their ``Join`` had reached us: votes reach every member,
        a ``Join`` flood may not (half its targets may be dead but not yet convicted), and a
        member that misses a joiner proposes another cut and, as a coordinator, admits it one
        change later."""
        for joiner in cut.joined:
            if joiner.member in self.configuration or joiner.member in self.joiners:
                continue
            if len(self.joiners) >= self._params.max_pending_joins:
                self._counts["dropped_join_overflow"] += 1
                return
            self.joiners[joiner.member] = joiner
            self.cut_dirty = True

    def _flood_join(self, joiner: Joiner) -> None:
        for peer in self._sample(self._params.gossip_fanout):
            self._send(peer, Join(joiner, self.configuration.config_id))

    # ------------------------------------------------------------------ fencing

    def check_lease(self, now: float) -> None:
        """Fencing (docs/design.md section 5): a member that believes fewer than a majority of its
        configuration reachable for ``lease_s`` must stop training until that changes: its
        view holds too many members suspect or worse, or too few of its neighbours were heard
        from lately. Runs when either changes; the lease itself is a deadline, not a poll."""
        m = self._member
        n = len(self.configuration)
        ok = (not m.self_suspected and m.in_contact
              and m.reachable >= classic_quorum(n))
        if ok:
            self._lease_at = _INF
            m.send_isolated_verdicts()
            if self.fenced:
                self.fenced = False
                self._emit(ev.QuorumRegained(now, self.configuration.config_id))
        elif self._lease_at == _INF and not self.fenced:
            self._lease_at = now + self._params.lease_s
