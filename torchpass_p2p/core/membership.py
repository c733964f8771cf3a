"""The membership state machine of one member: SWIM probing with Lifeguard and Rapid observers.

Why one module of this size: probing, evidence, suspicion, refutation, contact and the view
are one state machine over one view and one clock; the agreement lives apart
(:mod:`.reconfiguration`, through the narrow :class:`~.reconfiguration.Membership` seam).

Theory of operation
-------------------
Sans-IO (docs/design.md section 3). The host feeds in datagrams (:meth:`Member.receive`) and timer
expiries (:meth:`Member.handle_timer`), always with ``now`` in seconds; it pulls datagrams
(:meth:`Member.messages_to_send`) and events (:meth:`Member.next_event`) and re-arms one timer at
:meth:`Member.next_deadline`. Randomness comes only from the injected ``random.Random``, and every
iteration that can reach the output runs over insertion-ordered dicts or sorted tuples, so the same
seed and the same inputs give the same trace.

Probing. The configuration's K rings (:mod:`.configuration`) give each member up to K subjects. It
pings them round-robin, one every ``probe_interval / len(subjects)``, so each subject is probed by
each of its observers once per interval. A round is a direct ``Ping``; without an ``Ack`` by
``probe_timeout`` the observer asks ``indirect_probes`` random relays with ``PingReq``; relays
answer with the target's ``Ack`` or a ``Nack``. No ack by ``round_timeout`` fails the round.

Evidence. An observer raises an :class:`Alert` only after M consecutive failed rounds of its edge
(Rapid). Detection is about edges: a round that only a relay's ack saved proves the subject's
process runs, not that this edge works, so it leaves the count as it was instead of clearing it
(a subject that only one peer reaches must still be removed); it does not add to it either, for
a busy member's backlog often answers a relay first. Only a word straight from the subject
clears the count. A member whose own timer fired late (its loop stalled) voids
its open rounds instead of counting them, and one that heard no ack from anyone for
``self_suspect_after_s`` suspects itself and accuses nobody. All probe timings are stretched by
Lifeguard's local health multiplier.

Start-up grace. A member of the configuration this member started in that it has not heard from
yet is accused by nobody until ``start_grace_s`` after its process was started (``started``: what
the host was told, e.g. by the launcher that started it): its training script may still be
importing torch. Failed rounds against it, its pulse's silence and reports that it is unreachable
count for nothing meanwhile; its first word ends its grace, and so does the deadline, so a member
that never starts is convicted ``start_grace_s`` later than one that stopped.

Suspicion. The first alert about a subject starts a suspicion whose timeout shrinks with each
independent alert (Lifeguard section IV-B). On expiry, with at least L distinct observers' alerts
(no single accuser convicts), the member confirms :class:`Dead` and spreads it. The subject refutes
an alert or a verdict for its current incarnation by raising its incarnation, once it has heard
straight from an accusing observer within ``probe_interval_s``, or from half its neighbours
within two (at once, or when it next does): a refutation proves the process alive, not the
accuser's edge, so a subject its accusers cannot reach lets their evidence stand. A stalled
member hears its observers' pings as it wakes and refutes as before. A refutation relayed by a
third party clears suspicions but not an observer's count of failed rounds: its edge still
fails, and it alerts about the new incarnation on its next failed round.

Dissemination. New updates are pushed at once to ``gossip_fanout`` random members, then piggybacked
on every datagram (fewest-sent first) until each was sent ``lambda * ceil(log10(N + 1))`` times.
Every ``sync_interval`` a member sends one random peer a digest of its view; on mismatch the peer
answers with its view in pages and asks for ours. The peer is one the view holds alive, unless
the view counts fewer than a majority reachable: then any member of the configuration, for the
view may be the thing that is wrong. A decided configuration that keeps members the view holds
dead sends each of them its verdict, which it refutes if alive.

Agreement. A :class:`Dead` verdict is evidence, not a removal: a member that hears one about
itself refutes it like an alert. Whenever the view changes, the member's
:class:`~.reconfiguration.Reconfiguration` re-runs cut detection, votes, decides and installs the
next configuration (its module tells how); a member learns it was removed only from a decided
configuration.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Final

from . import events as ev
from .agreement import Consensus, classic_quorum
from .configuration import Configuration
from .cut import Suspected
from .errors import LocalProtocolError
from .hashing import mix_triple
from .messages import (
    Accept,
    Ack,
    Alert,
    Alive,
    Dead,
    Digest,
    Gossip,
    Join,
    Joiner,
    Left,
    MemberId,
    MemberState,
    Message,
    Nack,
    Ping,
    PingReq,
    Prepare,
    Progress,
    Promise,
    SyncState,
    Update,
    Vote,
)
from .params import Params
from .plan import Plan, Policy
from .reconfiguration import Reconfiguration, Transitions

if TYPE_CHECKING:
    from random import Random

# Final: the compiled build reads these from C statics, not the module dict, on every use.
ALIVE: Final = MemberState.ALIVE
SUSPECT: Final = MemberState.SUSPECT
DEAD: Final = MemberState.DEAD
LEFT: Final = MemberState.LEFT
_INF: Final = math.inf
_SEQ_MOD: Final = 1 << 32
# The classes the hot paths test with ``type(x) is``, read from C statics in the compiled build.
_PING: Final = Ping
_ACK: Final = Ack
_PING_REQ: Final = PingReq
_NACK: Final = Nack
_GOSSIP: Final = Gossip
_ALIVE: Final = Alive
_ALERT: Final = Alert
_DEAD: Final = Dead


# The four records below are plain classes, not dataclasses: mypyc builds a dataclass through
# the Python-level ``__init__`` that ``dataclasses`` generates (about 10x slower than a native
# constructor), and a round, a relay or a pending update is built for almost every datagram.


class _Round:
    """One open probe round of this member (as observer) against ``subject``."""

    __slots__ = ("subject", "started_at", "indirect_at", "fails_at", "indirect_sent", "relays",
                 "nacked")

    def __init__(self, subject: MemberId, started_at: float, indirect_at: float,
                 fails_at: float) -> None:
        self.subject = subject
        self.started_at = started_at
        self.indirect_at = indirect_at
        self.fails_at = fails_at
        self.indirect_sent = False
        self.relays: tuple[MemberId, ...] = ()
        self.nacked: dict[MemberId, None] = {}


class _Relay:
    """A ping this member sends on behalf of ``origin`` (who asked with ``PingReq``)."""

    __slots__ = ("origin", "origin_seq", "target", "nack_at")

    def __init__(self, origin: MemberId, origin_seq: int, target: MemberId,
                 nack_at: float) -> None:
        self.origin = origin
        self.origin_seq = origin_seq
        self.target = target
        self.nack_at = nack_at


class _Suspicion:
    """Alerts about one subject at one incarnation, and when they convict."""

    __slots__ = ("incarnation", "started_at", "expected", "observers", "silent", "deadline",
                 "heard_since")

    def __init__(self, incarnation: int, started_at: float, expected: int, *,
                 heard_since: float = 0.0) -> None:
        self.incarnation = incarnation
        self.started_at = started_at
        self.expected = expected
        self.observers: dict[MemberId, None] = {}  # insertion-ordered set
        self.silent: dict[MemberId, None] = {}  # observers whose alert was silent (Alert.silent)
        self.deadline = _INF
        self.heard_since = heard_since  # an ack from the subject after this postpones conviction


class _Pending:
    """An update waiting to be piggybacked under ``key`` in the queue; ``order`` keeps ties
    deterministic."""

    __slots__ = ("update", "transmits", "order", "key")

    def __init__(self, update: Update, transmits: int, order: int,
                 key: tuple[int, int, int]) -> None:
        self.update = update
        self.transmits = transmits
        self.order = order
        self.key = key


def _by_send_rank(queue: Collection[_Pending], limit: int) -> list[_Pending]:
    """The first ``limit`` of ``queue``, fewest-sent first, then oldest.

    Queues hold a handful of updates, so an insertion sort of native compares beats calling a
    key function per item; long queues take ``sorted``.
    """
    out: list[_Pending] = []
    for p in queue:
        transmits, order = p.transmits, p.order
        i = len(out)
        while i > 0:
            q = out[i - 1]
            if q.transmits < transmits or (q.transmits == transmits and q.order < order):
                break
            i -= 1
        out.insert(i, p)
        if len(out) > 16:
            return sorted(queue, key=_send_rank)[:limit]
    return out[:limit]


def _send_rank(p: _Pending) -> tuple[int, int]:
    return p.transmits, p.order


class Member:
    """One member's view of the cluster and its side of the protocol.

    Args:
        member_id: this member's id (uint64, fresh per process start).
        configuration: the configuration this member starts in; must contain ``member_id``.
        params: protocol parameters.
        rng: the only source of randomness (relay and gossip targets, sync jitter).
        now: the current time in seconds (monotonic).
        policy: what a decided change does with a rank no spare is left for (docs/design.md section
        5).
        joining: this process is not in ``configuration`` and asks to join it as a spare; it
            sends its :class:`Join` to ``seeds`` in turn until a decided configuration holds it.
        seeds: members of ``configuration`` to ask, with ``joining``.
        transitions: a memo of :func:`~.plan.next_configuration` results that several members
            in one process may share (the simulator does: 16k members then build one
            configuration and its rings per change, not 16k). The function is pure, so sharing
            changes no result. None: a private memo.
        started: when each member of ``configuration`` had its process started (seconds, this
            member's clock; the launcher's record), for the start-up grace (module docstring):
            a member missing here counts as started at ``now``, one said to start later too,
            so no grace ends past ``now + params.start_grace_s``. None: no grace (a joiner, or
            a host that starts every member itself before any probes, as the simulator does).

    Raises:
        ValueError: ``member_id`` is not in ``configuration`` (or is, with ``joining``), or
            ``joining`` comes without seeds or names another member id.
    """

    def __init__(
        self,
        member_id: MemberId,
        configuration: Configuration,
        *,
        params: Params,
        rng: Random,
        now: float,
        policy: Policy = Policy.WAIT,
        joining: Joiner | None = None,
        seeds: tuple[MemberId, ...] = (),
        transitions: Transitions | None = None,
        started: Mapping[MemberId, float] | None = None,
    ) -> None:
        if joining is None and member_id not in configuration:
            raise ValueError("member_id is not part of the configuration")
        if joining is not None and (member_id in configuration or joining.member != member_id
                                    or not seeds):
            raise ValueError("a joiner needs its own id, outside the configuration, and seeds")
        self.id = member_id
        self.params = params
        self.incarnation = 0
        self.health = 0
        """Lifeguard's local health multiplier, 0 (healthy) .. ``params.max_health_multiplier``."""
        self._counts: Counter[str] = Counter()
        self._sent = 0  # hot counters kept as plain ints; see the counters property
        self._received = 0
        self._probes = 0
        self._probe_acks = 0
        self.removed = False
        self.left = False
        self.self_suspected = False
        self._rng = rng
        self._now = now
        self._view: dict[MemberId, tuple[MemberState, int]] = {}
        self._digest = 0
        self._digest_entries = 0
        self._confirmers: dict[MemberId, MemberId] = {}  # dead member -> who convicted it
        self._suspicions: dict[MemberId, _Suspicion] = {}
        self._rounds: dict[int, _Round] = {}
        self._relays: dict[int, _Relay] = {}
        self._failed_rounds: dict[MemberId, int] = {}
        self._last_ack_from: dict[MemberId, float] = {}
        self._alerted: dict[MemberId, int] = {}  # subject -> incarnation we alerted about
        # Our observers whose accusation of us (alert, or verdict they confirmed) waits for a
        # direct word from them before we refute it -> the incarnation they accused.
        self._accusers: dict[MemberId, int] = {}  # keyed by our observers only: bounded
        self._seq = 0
        self._last_ack_at = now
        self._answered_at = now  # like _last_ack_at, but a stall does not refresh it
        self._queue: dict[tuple[int, int, int], _Pending] = {}
        self._queue_order = 0
        self._outbox: deque[tuple[MemberId, Message]] = deque()
        self._events: deque[ev.Event] = deque()
        self._gossip_at = _INF
        self._sync_at = now + params.sync_interval_s * (0.5 + rng.random())
        self._probe_cursor = 0
        self._next_probe_at = now + params.probe_interval_s * rng.random()
        self.joining = joining
        self._unreachable = 0  # members of the configuration our view holds suspect or worse
        self._accused_at: dict[MemberId, float] = {}  # first alert or verdict we heard of
        # Verdicts (member -> incarnation) we took while we counted fewer than a majority of
        # our configuration reachable: no ground for a cut of ours (_judge_verdict); True once sent
        # to their subject after we reached a majority again.
        self._isolated_verdicts: dict[MemberId, bool] = {}
        self._heard: dict[MemberId, float] = {}  # neighbour -> when it last sent us anything
        self._in_contact = True  # heard from at least half our neighbours lately
        self._heard_none = False  # no neighbour heard from lately, at the last contact check
        # Member -> end of its start-up grace (seconds): not heard from since it was started.
        self._awaiting: dict[MemberId, float] = {}
        # The agreement layer (cut proposal, votes, decisions, joins, progress, fencing) gets
        # what it needs from this member here and nothing else (reconfiguration.py, "The
        # seam"). Created before the configuration is installed: installing it marks the cut
        # dirty, a flag the agreement layer holds.
        self._reconf = Reconfiguration(
            self, configuration, send=self._send, emit=self._emit, sample=self._sample_members,
            counts=self._counts, rng=rng, view=self._view, accused_at=self._accused_at,
            on_installed=self._set_configuration, on_removed=self._on_removed,
            on_admitted=self._on_admitted, policy=policy, joining=joining, seeds=seeds,
            transitions=transitions, now=now)
        self._set_configuration(configuration)
        if started is not None and joining is None:
            grace = params.start_grace_s
            for m in configuration.members:
                until = min(started.get(m, now), now) + grace
                if m != member_id and until > now:
                    self._awaiting[m] = until
        self._reconf.cut_dirty = False

    # ------------------------------------------------------------------ public: inputs

    def receive(self, now: float, sender: MemberId, message: Message) -> None:
        """Handle one authenticated message from ``sender``.

        Invalid content from a peer is dropped and counted in ``counters``; it never raises.
        """
        self._advance(now)
        if self.removed:
            self._counts["dropped_after_removal"] += 1
            return
        self._received += 1
        if self._awaiting:
            self._awaiting.pop(sender, None)  # it has started: no grace from now on
        heard = self._heard  # keyed by our neighbours only: any word from one is contact
        if sender in heard:
            heard[sender] = now
            self._heard_none = False
            # Any word from a subject is a sign of life: failed rounds against it are no longer
            # consecutive (else a member whose loop stalls twice in a row is accused early).
            if self._failed_rounds:
                self._failed_rounds.pop(sender, None)
            if self._accusers and (sender in self._accusers or self._reached_by_most(now)):
                # An accuser reaches us (its edge works), or most of our neighbours do (we
                # are not cut off): our refutation now counts.
                self._refute(now, max(self._accusers.values()))
        if self.joining is not None:
            if isinstance(message, Vote) or isinstance(message, Progress):
                self._reconf.receive(now, sender, message)
            elif isinstance(message, Ping):
                # A configuration we have not caught up with yet admitted us, and its members
                # probe us: answer, so they do not convict us before its certificate arrives.
                self._send(sender, Ack(message.seq, ()))
            else:
                self._counts["dropped_while_joining"] += 1
            return
        # Exact classes first, most frequent first: messages are plain Python classes (see
        # scripts/native_build.py), so in the compiled build isinstance is a generic call (and a
        # miss walks the class's __instancecheck__), where ``type(m) is`` a Final alias is one
        # pointer compare. No message class is subclassed, so the two tests agree.
        if type(message) is _PING:
            self._apply_from(now, sender, message.updates)
            if not (self.left or self.removed):
                self._send(sender, Ack(message.seq, self._piggyback()))
        elif type(message) is _ACK:
            if message.updates:
                self._apply_from(now, sender, message.updates)
            self._on_ack(now, sender, message.seq)
        elif type(message) is _PING_REQ:
            if message.updates:
                self._apply_from(now, sender, message.updates)
            self._on_ping_req(now, sender, message)
        elif type(message) is _NACK:
            rnd = self._rounds.get(message.seq)
            if rnd is not None and rnd.subject == message.target and sender in rnd.relays:
                rnd.nacked[sender] = None
                self._heard_back(now)
        elif type(message) is _GOSSIP:
            if message.updates:
                self._apply_from(now, sender, message.updates)
        elif isinstance(message, Digest):
            self._on_digest(sender, message)
        elif isinstance(message, SyncState):
            self._on_sync_state(now, sender, message)
        elif isinstance(message, Vote) or isinstance(message, Progress):
            self._reconf.receive(now, sender, message)
        elif (isinstance(message, Prepare) or isinstance(message, Promise)
              or isinstance(message, Accept)):
            self._reconf.receive(now, sender, message)
        elif isinstance(message, Join):
            self._reconf.on_join(now, sender, message)
        else:  # pragma: no cover - the codec only yields known types
            self._counts["dropped_unknown_message"] += 1
        if self._reconf.cut_dirty:
            self._reconf.consider_cut(now)

    def handle_timer(self, now: float) -> None:
        """Run everything due at ``now``. Call it when ``now >= next_deadline()``.

        Any call (this one or :meth:`receive`) that comes more than ``stall_tolerance_s`` after
        the deadline means this member's own loop stalled: its open probe rounds are voided
        rather than failed (docs/design.md section 4).
        """
        self._advance(now)
        if self.removed:
            return
        reconf = self._reconf
        if now >= reconf.due_at():
            reconf.handle_timer(now)
        if self.joining is not None:
            return
        self._expire_rounds(now)
        self._expire_relays(now)
        self._expire_suspicions(now)
        if now >= self._next_probe_at and not self.left:
            self._probe(now)
        if now >= self._gossip_at:
            self._gossip(now)
        if now >= self._sync_at:
            self._start_sync(now)
        if self._reconf.cut_dirty:
            self._reconf.consider_cut(now)

    def report_send_error(self, now: float, dest: MemberId) -> None:
        """The host failed to send to ``dest`` (e.g. "network unreachable"). Counts as a failed
        probe of this member's own health, and fails an open round to ``dest`` at once, so a
        member whose sends all fail ends up suspecting itself (scenario S07)."""
        self._advance(now)
        self._counts["send_errors"] += 1
        failed = [seq for seq, rnd in self._rounds.items() if rnd.subject == dest]
        if not failed:
            self._adjust_health(+1)
        for seq in failed:
            self._round_failed(now, self._rounds.pop(seq), missed_nacks=0)  # +1 health each

    def report_unreachable(self, now: float, subject: MemberId) -> bool:
        """Fast evidence (docs/design.md section 4): the host saw ``subject`` fail: a connection it
        reset, a collective error naming it, its process exiting under the local launcher.

        An observer of ``subject`` alerts at once instead of after ``failed_rounds_to_alert``
        failed probe rounds; any other member probes ``subject`` now. Nothing else is skipped:
        the alert still needs the other observers (cut detection) and a decision, and a live
        subject refutes it. Returns True when this call raised an alert.
        """
        self._advance(now)
        if (self.removed or self.left or self.joining is not None or subject == self.id
                or subject not in self._config):
            return False
        self._counts["evidence_reported"] += 1
        if self._awaiting and self._starting(now, subject):
            self._counts["evidence_in_start_grace"] += 1
            return False
        if subject in self._subjects:
            raised = self._raise_alert(now, subject)
            if raised and self._reconf.cut_dirty:
                self._reconf.consider_cut(now)
            return raised
        if all(rnd.subject != subject for rnd in self._rounds.values()):
            self._start_round(now, subject)
        return False

    def report_started(self, now: float, members: Sequence[MemberId | None]) -> None:
        """``members`` (a rank map: None for a vacant rank) run: each took part in a collective
        this member completed (a commit needs every rank's vote). Their start-up grace ends,
        as a word from each would end it: a rank that trained with the others and then stopped
        is no longer "still importing torch", however early in the job it stopped. Called at
        every commit, so it costs nothing once no grace is left."""
        if not self._awaiting:
            return
        self._advance(now)
        for m in members:
            if m is not None:
                self._awaiting.pop(m, None)

    def report_silent(self, now: float, subject: MemberId) -> bool:
        """Evidence from below the protocol: ``subject``'s pulse responder, a native thread
        that answers while its process runs at all (``agent/pulse_wire.py``), stopped answering
        this member. Its process is stopped, frozen, gone or cut off; a process whose event loop
        is merely blocked (scenario S01) still answers.

        An observer of ``subject`` raises a silent :class:`Alert` at once, instead of after
        ``failed_rounds_to_alert`` failed rounds. When every alert the removal needs is silent,
        voters skip the refutation windows a stalled member is owed (``Params.
        refutation_window_s``, ``suspicion_min_s``) and settle for ``exit_settle_s``; the
        removal still needs those alerts from distinct observers and a decision. Ignored (and
        counted) while this member suspects itself: then the silence may be ours. Returns True
        when this call raised an alert.
        """
        self._advance(now)
        if (self.removed or self.left or self.joining is not None or subject == self.id
                or subject not in self._subjects):
            return False
        self._counts["silences_reported"] += 1
        if self._awaiting and self._starting(now, subject):
            self._counts["evidence_in_start_grace"] += 1
            return False
        if self.self_suspected or self._isolated(now):
            self._counts["silences_ignored_isolated"] += 1
            return False
        raised = self._raise_alert(now, subject, silent=True)
        if raised and self._reconf.cut_dirty:
            self._reconf.consider_cut(now)
        return raised

    def report_exited(self, now: float, subject: MemberId) -> bool:
        """Certain evidence: ``subject``'s process exited; its parent, the launcher on its host,
        reaped it. Unlike a silence, an exit cannot be refuted, so this member announces
        :class:`Left` on the subject's behalf: it joins the next cut without the refutation
        window a stalled member is owed (docs/design.md section 4), and the removal is still decided
        by agreement. Returns True when the announcement is news here.
        """
        self._advance(now)
        if (self.removed or self.left or self.joining is not None or subject == self.id
                or subject not in self._config):
            return False
        self._counts["exits_reported"] += 1
        _, incarnation = self._view.get(subject, (ALIVE, 0))
        if not self._merge(now, Left(subject, incarnation)):
            return False
        self._enqueue(Left(subject, incarnation))
        if self._reconf.cut_dirty:
            self._reconf.consider_cut(now)
        return True

    def leave(self, now: float) -> None:
        """Leave gracefully: announce :class:`Left` and stop probing. Idempotent."""
        self._advance(now)
        if self.left or self.removed:
            return
        self.left = True
        self._rounds.clear()
        self._accusers.clear()
        self._learn(now, Left(self.id, self.incarnation))

    # ------------------------------------------------------------------ public: outputs

    def next_deadline(self) -> float:
        """The earliest time (seconds) at which :meth:`handle_timer` has work; ``inf`` if none.

        Never earlier than the ``now`` of the last call: work that an input made due in the past
        is due at once, not late.
        """
        if self.removed:
            return _INF
        t = self._reconf.due_at()
        if self.joining is not None:
            return t if t > self._now else self._now
        if self._gossip_at < t:
            t = self._gossip_at
        if self._sync_at < t:
            t = self._sync_at
        if not self.left and self._next_probe_at < t:
            t = self._next_probe_at
        for rnd in self._rounds.values():
            d = rnd.fails_at if rnd.indirect_sent else rnd.indirect_at
            if d < t:
                t = d
        for relay in self._relays.values():
            if relay.nack_at < t:
                t = relay.nack_at
        for susp in self._suspicions.values():
            if susp.deadline < t:
                t = susp.deadline
        return t if t > self._now else self._now

    def messages_to_send(self) -> list[tuple[MemberId, Message]]:
        """Pull every queued (destination, message) pair, oldest first."""
        outbox = self._outbox
        if not outbox:
            return []
        if len(outbox) == 1:  # the usual case (a ping, an ack): no copy, no clear
            return [outbox.popleft()]
        out = list(outbox)
        outbox.clear()
        return out

    def next_event(self) -> ev.Event | None:
        """Pull the oldest pending event, or None."""
        return self._events.popleft() if self._events else None

    # ------------------------------------------------------------------ public: queries

    @property
    def counters(self) -> Counter[str]:
        """Everything this member counted: datagrams sent and received, probes, acks, failed
        rounds, alerts raised, refutations, stalls, drops by reason. A snapshot (a new Counter)."""
        counts = Counter(self._counts)
        for name, value in (("sent", self._sent), ("received", self._received),
                            ("probes", self._probes), ("probe_acks", self._probe_acks)):
            if value:
                counts[name] = value
        return counts

    @property
    def configuration(self) -> Configuration:
        return self._config

    def state_of(self, member: MemberId) -> tuple[MemberState, int]:
        """(state, incarnation) of ``member`` as this member believes it.

        Raises:
            KeyError: ``member`` is not in the configuration.
        """
        if member not in self._config:
            raise KeyError(member)
        return self._view.get(member, (ALIVE, 0))

    @property
    def last_ack_at(self) -> float:
        """When a probe of this member's was last acknowledged (seconds). Acks to rounds a
        stall voided do not count, so after a long pause this stays old until a fresh probe
        is answered: the host's lease on training can rest on it (docs/design.md section 5)."""
        return self._answered_at

    @property
    def subjects(self) -> tuple[MemberId, ...]:
        """The members this member observes (probes) in the current configuration: the ones
        whose pulses it should watch (:meth:`report_silent`)."""
        return self._subjects

    def silent_alerts_about(self, subject: MemberId) -> tuple[MemberId, ...]:
        """Observers whose silent alerts (:meth:`report_silent`) about ``subject``'s current
        incarnation this member holds."""
        susp = self._suspicions.get(subject)
        return tuple(susp.silent) if susp else ()

    def alerts_about(self, subject: MemberId) -> tuple[MemberId, ...]:
        """Observers whose alerts about ``subject``'s current incarnation this member holds."""
        susp = self._suspicions.get(subject)
        return tuple(susp.observers) if susp else ()

    def suspected(self) -> dict[MemberId, Suspected]:
        """The alerts this member holds, by subject, as cut detection reads them
        (:func:`~.cut.propose_cut`)."""
        return {subject: Suspected(tuple(susp.observers), susp.started_at, len(susp.silent))
                for subject, susp in self._suspicions.items()}

    @property
    def in_contact(self) -> bool:
        """Whether this member heard from at least half its neighbours lately: one of the
        conditions of its lease (docs/agreement.md: ``QuorumLost``)."""
        return self._in_contact

    def view_digest(self) -> tuple[int, int]:
        """(digest, entries): the order-independent 64-bit hash anti-entropy compares."""
        return self._digest, self._digest_entries

    # ------------------------------------------------------------------ public: agreement

    def report_progress(self, step: int) -> None:
        """The host's training loop completed the commit of ``step`` (docs/design.md section 6). The
        latest value goes into this member's vote and its progress report after a decision."""
        self._reconf.last_committed_step = step

    @property
    def last_committed_step(self) -> int:
        """Set by the host (:meth:`report_progress`); voted and reported for the plan."""
        return self._reconf.last_committed_step

    @property
    def policy(self) -> Policy:
        """What a decided change does with a rank no spare is left for."""
        return self._reconf.policy

    @property
    def fenced(self) -> bool:
        """True while :class:`~.events.QuorumLost` holds: the host must not train."""
        return self._reconf.fenced

    @property
    def reachable(self) -> int:
        """Members of the configuration this member believes reachable, itself included: the
        configuration's size less those its view holds suspected, convicted or gone; 1 while
        it suspects itself (no ack nor nack from anyone: it reaches nobody, and accuses
        nobody, so its view alone would count everyone); 1 too while none of its neighbours
        was heard from in the last contact window (:attr:`in_contact`): a loop that keeps
        stalling voids the probe rounds that would accuse them, and the silence it would
        suspect itself for. Below a majority (``agreement.classic_quorum``) for
        ``Params.lease_s``, the member is fenced (:class:`~.events.QuorumLost` carries the
        count)."""
        if self.self_suspected or self._heard_none:
            return 1
        return len(self._config) - self._unreachable

    @property
    def plan(self) -> Plan | None:
        """The plan of the last decided change; ``resume_step`` is set once it is ready."""
        return self._reconf.plan

    @property
    def _consensus(self) -> Consensus:
        """The agreement of the current configuration (read by sims/safety_runs.py's checker)."""
        return self._reconf.consensus

    # ------------------------------------------------------------------ probing

    def _set_configuration(self, config: Configuration) -> None:
        self._config = config
        self._subjects = config.subjects_of(self.id) if self.id in config else ()
        observers = config.observers_of(self.id) if self.id in config else ()
        # Keyed by our neighbours (subjects and observers). A new neighbour gets one lease to
        # be heard from before it counts as silent.
        self._heard = {m: self._heard.get(m, self._now) for m in (*self._subjects, *observers)}
        self._accusers = {o: inc for o, inc in self._accusers.items() if o in observers}
        self._transmit_limit = self.params.transmit_limit(len(config))
        self._min_alerts = self.params.min_alerts_to_confirm
        # Forget everyone the configuration no longer holds; keep what we know of the others.
        for member in [m for m in self._view if m not in config]:
            self._set_view(member, ALIVE, 0)
        for table in (self._suspicions, self._last_ack_from, self._alerted, self._confirmers,
                      self._accused_at, self._awaiting, self._isolated_verdicts):
            for member in [m for m in table if m not in config]:
                del table[member]
        subjects = set(self._subjects)
        self._rounds = {seq: r for seq, r in self._rounds.items() if r.subject in subjects}
        self._failed_rounds = {m: n for m, n in self._failed_rounds.items() if m in subjects}
        for subject in list(self._suspicions):
            self._rebase_suspicion(subject)
        for key in [k for k, p in self._queue.items() if _about(p.update) not in config]:
            del self._queue[key]
        if self.id in config and self.joining is None:
            self._send_kept_verdicts()
        self._reconf.cut_dirty = True

    def _send_kept_verdicts(self) -> None:
        """A decided configuration keeps members our view holds dead: each such verdict goes to
        its subject, which refutes it if it is alive. A verdict taken on the minority side of a
        partition can look taken with a majority (a view counts reachable every member of the
        other side that none of its own side observes), and its gossip ran out before the heal;
        unrefuted, it would ground a cut removing a healthy member, or mute this member (it
        neither probes nor samples a member it holds dead). A subject that is dead costs one
        datagram per holder and change."""
        for member, (state, inc) in self._view.items():
            if state == DEAD and member != self.id:
                self._send(member, Gossip((Dead(member, inc,
                                                self._confirmers.get(member, self.id)),)))

    def _scaled(self, seconds: float) -> float:
        return seconds * (self.health + 1)

    def _probe(self, now: float) -> None:
        subjects = self._subjects
        slot = self._scaled(self.params.probe_interval_s) / max(1, len(subjects))
        self._next_probe_at = now + slot
        if subjects and self._probe_cursor % len(subjects) == 0:
            self._check_contact(now)
        for _ in range(len(subjects)):
            subject = subjects[self._probe_cursor % len(subjects)]
            self._probe_cursor += 1
            if self._view.get(subject, (ALIVE, 0))[0] < DEAD:
                self._start_round(now, subject)
                return

    def _start_round(self, now: float, subject: MemberId) -> None:
        p = self.params
        seq = self._next_seq()
        indirect_at = now + self._scaled(p.probe_timeout_s)
        self._rounds[seq] = _Round(subject, now, indirect_at, now + self._scaled(p.round_timeout_s))
        self._probes += 1
        self._send(subject, Ping(seq, self._piggyback(about=subject)))

    def _heard_back(self, now: float) -> None:
        # An ack, or a relay's nack for our round: either way a peer heard us and we heard it,
        # so we are not the one cut off. Nacks matter when most of our subjects died together:
        # then the one live subject's acks come only once per (health-stretched) probe cycle,
        # and without them we would suspect ourselves and never accuse the dead (Lifeguard
        # section IV-A uses nacks the same way, for local health).
        self._last_ack_at = now
        if self.self_suspected:
            self.self_suspected = False
            self._reconf.cut_dirty = True

    def _on_ack(self, now: float, sender: MemberId, seq: int) -> None:
        self._heard_back(now)
        rnd = self._rounds.pop(seq, None)
        if rnd is not None:
            self._answered_at = now
            self._probe_acks += 1
            self._adjust_health(-1)  # we reached the subject, or a relay that reached it
            if sender == rnd.subject:
                # (receive() has cleared the edge's failed rounds: any word from it does.)
                self._last_ack_from[rnd.subject] = now
            else:
                # Saved by a relay: the subject's process answers, but not over our edge. The
                # edge's failed rounds stay counted (neither cleared nor added to).
                self._counts["probe_rounds_relayed"] += 1
            return
        relay = self._relays.pop(seq, None)
        if relay is not None:
            self._send(relay.origin, Ack(relay.origin_seq, self._piggyback()))

    def _on_ping_req(self, now: float, sender: MemberId, msg: PingReq) -> None:
        if (msg.target == self.id or msg.target not in self._config or self.left
                or self.removed):
            self._counts["dropped_ping_req"] += 1
            return
        p = self.params
        seq = self._next_seq()
        # Nack before the origin's round ends (Lifeguard sends it at 80 % of the probe timeout).
        nack_at = now + 0.8 * (p.round_timeout_s - p.probe_timeout_s)
        self._relays[seq] = _Relay(sender, msg.seq, msg.target, nack_at)
        self._send(msg.target, Ping(seq, self._piggyback(about=msg.target)))

    def _expire_rounds(self, now: float) -> None:
        p = self.params
        for seq, rnd in list(self._rounds.items()):
            if not rnd.indirect_sent and now >= rnd.indirect_at:
                relays = self._sample_members(p.indirect_probes, exclude=rnd.subject)
                rnd.indirect_sent = True
                rnd.relays = tuple(relays)
                for relay in relays:
                    self._send(relay, PingReq(seq, rnd.subject, self._piggyback(about=rnd.subject)))
            if now >= rnd.fails_at:
                del self._rounds[seq]
                self._round_failed(now, rnd, missed_nacks=len(rnd.relays) - len(rnd.nacked))

    def _round_failed(self, now: float, rnd: _Round, missed_nacks: int) -> None:
        if self._awaiting and self._starting(now, rnd.subject):
            # Says nothing of the subject (it may not run yet) nor of us: no count, no health.
            self._counts["rounds_in_start_grace"] += 1
            return
        # memberlist's awareness rule (Lifeguard IV-A): with relays, only missing nacks count
        # against us (relays that nacked saw the subject silent too); without relays, +1.
        self._counts["probe_rounds_failed"] += 1
        self._adjust_health(missed_nacks if rnd.relays else 1)
        # A relay's nack in this round proves we reach peers that cannot reach the subject
        # either: the failure is the subject's. Without this, once health stretches a round to
        # seconds, its nacks are older than ``self_suspect_after_s`` when it ends, and a member
        # whose subjects died together silences itself for as long as they stay dead.
        if not rnd.nacked and self._isolated(now):
            if not self.self_suspected:
                self.self_suspected = True
                self._reconf.cut_dirty = True
                self._counts["self_suspected"] += 1
                self._emit(ev.SelfSuspected(now))
            return
        subject = rnd.subject
        fails = self._failed_rounds.get(subject, 0) + 1
        self._failed_rounds[subject] = fails
        if fails >= self.params.failed_rounds_to_alert:
            self._raise_alert(now, subject)

    def _raise_alert(self, now: float, subject: MemberId, *, silent: bool = False) -> bool:
        state, inc = self._view.get(subject, (ALIVE, 0))
        if state >= DEAD or self._alerted.get(subject) == inc:
            return False
        self._alerted[subject] = inc
        self._counts["alerts_raised"] += 1
        alert = Alert(self.id, subject, inc, silent)
        if not self._merge(now, alert):
            return False  # no longer one of its observers (the configuration changed meanwhile)
        self._enqueue(alert)
        # Tell the subject straight away so it can refute if it is alive (memberlist does the
        # same with suspect messages).
        self._send(subject, Gossip((alert,)))
        return True

    def _starting(self, now: float, member: MemberId) -> bool:
        """Whether ``member`` is in its start-up grace: not heard from yet, and its grace has
        not ended (an ended one is forgotten)."""
        until = self._awaiting.get(member)
        if until is None:
            return False
        if now < until:
            return True
        del self._awaiting[member]
        return False

    def _isolated(self, now: float) -> bool:
        # Not stretched by local health: health rises precisely while we are cut off, and a
        # stretched window would let an isolated member keep accusing.
        return (len(self._subjects) >= 2
                and now - self._last_ack_at >= self.params.self_suspect_after_s)

    def _expire_relays(self, now: float) -> None:
        for seq, relay in list(self._relays.items()):
            if now >= relay.nack_at:
                del self._relays[seq]
                self._send(relay.origin, Nack(relay.origin_seq, relay.target))

    def _on_stall(self, now: float, late_s: float) -> None:
        self._counts["stalls"] += 1
        self._counts["rounds_voided"] += len(self._rounds)
        self._rounds.clear()
        self._failed_rounds.clear()
        self._last_ack_at = now  # the silence was ours; do not suspect ourselves for it
        # A suspicion that ran out while we were stalled must not convict before we have read
        # the backlog: the subject's refutation may be waiting in our socket.
        grace = now + self.params.round_timeout_s
        for susp in self._suspicions.values():
            if susp.deadline < grace:
                susp.deadline = grace
        # Likewise a vote or a classic round that fell due while we were stalled.
        self._reconf.postpone(grace)
        self._adjust_health(+1)
        self._next_probe_at = min(self._next_probe_at, now)

    def _adjust_health(self, delta: int) -> None:
        self.health = min(self.params.max_health_multiplier, max(0, self.health + delta))

    # ------------------------------------------------------------------ suspicion

    def _expire_suspicions(self, now: float) -> None:
        for subject, susp in list(self._suspicions.items()):
            if now < susp.deadline:
                continue
            if self._last_ack_from.get(subject, -_INF) > susp.heard_since:
                # We heard the subject answer since the suspicion began (or since we last
                # postponed): it is alive and its refutation is on its way. Wait one more
                # interval; if it falls silent meanwhile, we convict then.
                susp.heard_since = now
                susp.deadline = now + self._scaled(self.params.probe_interval_s)
                self._counts["convictions_postponed"] += 1
            elif len(susp.observers) >= min(self._min_alerts, susp.expected):
                self._learn(now, Dead(subject, susp.incarnation, self.id))
            else:
                susp.deadline = _INF  # wait for more independent alerts

    def _rebase_suspicion(self, subject: MemberId) -> None:
        """After a configuration change, judge a running suspicion by the new rings: only
        alerts from the subject's current observers count, and its timeout is the one that
        applies to this member now (no single accuser convicts, across changes too)."""
        susp = self._suspicions[subject]
        observers = set(self._config.observers_of(subject))
        for observer in [o for o in susp.observers if o not in observers]:
            del susp.observers[observer]
            susp.silent.pop(observer, None)
        if not susp.observers:
            del self._suspicions[subject]
            self._set_view(subject, ALIVE, susp.incarnation)  # back to unsuspected
            return
        susp.expected = len(observers)
        self._set_deadline(subject, susp)

    def _set_deadline(self, subject: MemberId, susp: _Suspicion) -> None:
        if subject in self._subjects:
            timeout = self.params.suspicion_timeout_s(len(susp.observers) - 1, susp.expected - 1)
        else:
            # Only observers convict on the Lifeguard timer: they are the ones the subject
            # refutes to directly, and they can hear it answer. Everyone else waits for their
            # Dead and convicts on its own only as a fallback, at the longest timeout.
            timeout = self.params.suspicion_max_s
        susp.deadline = susp.started_at + timeout

    def _suspect(self, now: float, alert: Alert) -> bool:
        subject, inc = alert.subject, alert.incarnation
        susp = self._suspicions.get(subject)
        if susp is None or susp.incarnation != inc:
            expected = len(self._config.observers_of(subject))
            susp = self._suspicions[subject] = _Suspicion(inc, now, expected, heard_since=now)
            self._accused_at.setdefault(subject, now)
            self._set_view(subject, SUSPECT, inc)
            self._emit(ev.MemberSuspected(now, subject, inc, alert.observer))
        elif alert.observer in susp.observers:
            return False
        susp.observers[alert.observer] = None
        if alert.silent:
            susp.silent[alert.observer] = None
        self._reconf.cut_dirty = True
        self._set_deadline(subject, susp)
        self._emit(ev.AlertRaised(now, alert.observer, subject, inc))
        return True

    # ------------------------------------------------------------------ updates

    def _apply_from(self, now: float, sender: MemberId, updates: tuple[Update, ...]) -> None:
        if sender in self._config:
            if updates:
                self._apply_all(now, updates)
            return
        # A member that a configuration we hold removed (or one never in it) gossips a stale
        # world: its verdicts must not touch ours. Our digest tells it that it is behind; it
        # asks for our certificates and learns its removal.
        self._reconf.send_digest_to(now, sender)
        if updates:
            self._counts["dropped_stranger_updates"] += 1

    def _apply_all(self, now: float, updates: tuple[Update, ...]) -> None:
        for update in updates:
            if self.removed:
                return  # the Dead about us came earlier in this batch: we are silent now
            self._learn(now, update)

    def _learn(self, now: float, update: Update) -> None:
        """Merge one update; if it is news, queue it for dissemination and push it now."""
        if self._merge(now, update):
            self._enqueue(update)

    def _merge(self, now: float, update: Update) -> bool:
        if isinstance(update, _ALERT):  # isinstance: mypy narrows the other branch
            return self._merge_alert(now, update)
        member, inc = update.member, update.incarnation
        if member not in self._config:
            self._counts["dropped_unknown_member"] += 1
            return False
        if member == self.id:
            return self._merge_about_self(now, update)
        state, known = self._view.get(member, (ALIVE, 0))
        if type(update) is _ALIVE:
            # A higher incarnation beats a stale conviction (memberlist's precedence), so views
            # converge even where a refutation arrived after a Dead; Left is final.
            if inc <= known or state == LEFT:
                return False
            self._suspicions.pop(member, None)
            self._accused_at.pop(member, None)
            # A refutation proves the subject's process alive, not that our edge to it works:
            # the failed rounds of our edge stay counted (a refutation straight from the subject
            # cleared them in receive()), and we alert about the new incarnation on the next.
            self._set_view(member, ALIVE, inc)
            self._emit(ev.MemberAlive(now, member, inc))
            return True
        if state >= DEAD or inc < known:
            return False
        self._suspicions.pop(member, None)
        if type(update) is _DEAD:
            self._judge_verdict(member)
            self._accused_at.setdefault(member, now)
            self._set_view(member, DEAD, inc)
            self._confirmers[member] = update.confirmer
            self._emit(ev.MemberDead(now, member, inc, update.confirmer))
        else:
            self._set_view(member, LEFT, inc)
            self._emit(ev.MemberLeft(now, member, inc))
        self._rounds = {seq: r for seq, r in self._rounds.items() if r.subject != member}
        return True

    def _judge_verdict(self, member: MemberId) -> None:
        """Before a verdict about ``member`` enters the view: one taken while this member
        counts fewer than a majority of its configuration reachable (the minority side of a
        partition convicts the majority it cannot reach, and so does a member cut off) grounds
        none of its cuts (:meth:`isolated_verdicts`): back among a majority, it would propose
        removing members the majority kept. It stays in the view until a newer incarnation
        (a verdict ends only so), and goes to its subject once this member reaches a majority
        again (:meth:`send_isolated_verdicts`), so that the subject refutes it."""
        if self._reconf.fenced or self.reachable < classic_quorum(len(self._config)):
            self._isolated_verdicts[member] = False
        else:
            self._isolated_verdicts.pop(member, None)

    def isolated_verdicts(self) -> Collection[MemberId]:
        """Members whose verdict in the view this member took while it reached no majority."""
        return self._isolated_verdicts.keys()

    def send_isolated_verdicts(self) -> None:
        """This member reaches a majority again: each verdict it took without one goes to its
        subject, once (gossip about it may have run out while they could not talk)."""
        for member, sent in list(self._isolated_verdicts.items()):
            state, inc = self._view.get(member, (ALIVE, 0))
            if state != DEAD:
                del self._isolated_verdicts[member]  # refuted, or gone by a configuration
            elif not sent:
                self._isolated_verdicts[member] = True
                self._send(member, Gossip((Dead(member, inc,
                                                self._confirmers.get(member, self.id)),)))

    def _merge_about_self(self, now: float, update: Alive | Dead | Left) -> bool:
        if isinstance(update, Left):
            # Only we can leave; our own Left is news exactly once.
            if not self.left or self._view.get(self.id, (ALIVE, 0))[0] == LEFT:
                if not self.left:
                    self._counts["dropped_forged_left"] += 1
                return False
            self._set_view(self.id, LEFT, self.incarnation)
            return True
        if isinstance(update, Dead) and not self.left:
            # A verdict is evidence, not a removal: only a decided configuration removes us.
            if update.incarnation >= self.incarnation:
                self._accused(now, update.confirmer, update.incarnation, verdict=True)
            else:
                # A conviction of an incarnation we already refuted: repeat the refutation.
                self._enqueue(Alive(self.id, self.incarnation))
        return False

    def _merge_alert(self, now: float, alert: Alert) -> bool:
        subject, inc = alert.subject, alert.incarnation
        susp = self._suspicions.get(subject)
        if susp is not None and susp.incarnation == inc and alert.observer in susp.observers:
            # A repeat of an alert already counted (most piggybacked alerts are): it passed the
            # checks below when first merged, and a suspicion only exists while its subject is
            # another member, not dead or gone, at this incarnation. The answer is False as below.
            return False
        config = self._config
        if subject not in config or alert.observer not in config.observers_of(subject):
            # Only assigned observers may accuse (Rapid); anything else is noise or hostile.
            self._counts["dropped_invalid_alert"] += 1
            return False
        if subject == self.id:
            if inc >= self.incarnation and not self.left:
                self._accused(now, alert.observer, inc)
            return False
        view = self._view.get(subject)  # None: alive at incarnation 0
        if view is not None and (view[0] >= DEAD or inc < view[1]):
            return False
        return self._suspect(now, alert)

    def _accused(self, now: float, accuser: MemberId, inc: int, *, verdict: bool = False) -> None:
        """``accuser`` accused our incarnation ``inc`` (>= ours): with an alert, or as the
        confirmer of a :class:`Dead` verdict (``verdict``). Refute at once if an accusing
        observer reached us within ``probe_interval_s`` or most neighbours did
        (:meth:`_reached_by_most`); else wait until then (receive()). A refutation proves our
        process alive, not that the accusers' edges work; edges that do not (we are cut off
        from most of our neighbours, reachable through a third party) must be allowed to
        convict us (Rapid section 4: a member is removed when H of its K observers' edges
        fail)."""
        observers = self._config.observers_of(self.id)
        if accuser in observers:
            self._accusers[accuser] = inc
        elif verdict and not self._accusers:
            # A verdict from a member that is no observer of ours, and no alert named anyone
            # whose edge we could check: nothing to wait for.
            self._refute(now, inc)
            return
        window = now - self.params.probe_interval_s
        heard = self._heard
        if (any(heard.get(o, -_INF) >= window for o in self._accusers)
                or self._reached_by_most(now)):
            self._refute(now, max(inc, max(self._accusers.values())))
        else:
            self._counts["refutations_deferred"] += 1

    def _reached_by_most(self, now: float) -> bool:
        """Whether at least half our neighbours (subjects and observers) sent us anything in
        the last two probe intervals: our edges work, though an accuser's last ping may be
        older than one (its probing stretched by its health, a verdict that came late). A
        member cut off from all but one or two peers is not; a stalled one is as it reads its
        backlog."""
        window = now - 2 * self.params.probe_interval_s
        heard = sum(1 for t in self._heard.values() if t >= window)
        return 2 * heard >= len(self._heard)

    def _refute(self, now: float, accused_incarnation: int) -> None:
        self._accusers.clear()  # every accusation we know of is of this incarnation or older
        self.incarnation = accused_incarnation + 1
        self._counts["refutations"] += 1
        self._adjust_health(+1)  # Lifeguard IV-A: having to refute is a sign of our own trouble
        self._emit(ev.SelfRefuted(now, self.incarnation))
        self._set_view(self.id, ALIVE, self.incarnation)
        alive = Alive(self.id, self.incarnation)
        self._enqueue(alive)
        # Tell our observers directly: they are the ones whose timers convict us.
        for observer in self._config.observers_of(self.id):
            self._send(observer, Gossip((alive,)))

    def _set_view(self, member: MemberId, state: MemberState, inc: int) -> None:
        self._reconf.cut_dirty = True
        old = self._view.get(member)
        if member != self.id:
            self._unreachable += (state != ALIVE) - (old is not None and old[0] != ALIVE)
        if old is not None and _in_digest(*old):
            self._digest ^= _entry_hash(member, *old)
            self._digest_entries -= 1
        if state == ALIVE and inc == 0:
            self._view.pop(member, None)
            return
        self._view[member] = (state, inc)
        if _in_digest(state, inc):
            self._digest ^= _entry_hash(member, state, inc)
            self._digest_entries += 1

    # ------------------------------------------------------------------ dissemination

    def _enqueue(self, update: Update) -> None:
        key: tuple[int, int, int]
        if isinstance(update, _ALERT):  # isinstance: mypy narrows the other branch
            key = (1, update.observer, update.subject)
        else:
            key = (0, update.member, 0)
            # A newer fact about a member makes its queued alerts moot.
            for k in [k for k, p in self._queue.items()
                      if k[0] == 1 and k[2] == update.member]:
                del self._queue[k]
        self._queue_order += 1
        self._queue[key] = _Pending(update, 0, self._queue_order, key)
        self._gossip_at = self._now  # push news at once

    def _piggyback(self, about: MemberId | None = None) -> tuple[Update, ...]:
        queue = self._queue
        if not queue:
            return ()
        limit = self.params.max_piggyback
        picked = _by_send_rank(queue.values(), limit)
        if about is not None:
            # Make sure a subject hears the alerts about itself first: it is the one who refutes.
            urgent = [p for p in queue.values() if p.key[0] == 1 and p.key[2] == about]
            if urgent:
                picked = (urgent + [p for p in picked
                                    if not (p.key[0] == 1 and p.key[2] == about)])[:limit]
        out = []
        for pending in picked:
            pending.transmits += 1
            if pending.transmits >= self._transmit_limit:
                del queue[pending.key]
            out.append(pending.update)
        return tuple(out)

    def _gossip(self, now: float) -> None:
        if not self._queue:
            self._gossip_at = _INF
            return
        self._gossip_at = now + self.params.gossip_interval_s
        for target in self._sample_members(self.params.gossip_fanout):
            updates = self._piggyback()
            if not updates:
                break
            self._send(target, Gossip(updates))

    # ------------------------------------------------------------------ contact

    def _check_contact(self, now: float) -> None:
        """Once per probe interval: did at least half our neighbours (subjects and observers,
        pseudo-random samples of the configuration) send us anything in the last half lease?
        A member on the minority side of a partition hears from about the minority's share."""
        window = now - self.params.lease_s / 2
        heard = sum(1 for t in self._heard.values() if t >= window)
        self._heard_none = heard == 0 and bool(self._heard)
        in_contact = 2 * heard >= len(self._heard)
        if in_contact != self._in_contact:
            self._in_contact = in_contact
            self._reconf.check_lease(now)

    # ------------------------------------------------------------------ decided changes

    def _on_removed(self, now: float) -> None:
        """A decided configuration left us out: fall silent (the agreement layer calls this)."""
        self.removed = True
        self._rounds.clear()
        self._relays.clear()
        self._emit(ev.SelfRemoved(now, self.incarnation))

    def _on_admitted(self, now: float, config_id: int) -> None:
        """A decided configuration admitted us, a joiner: start probing at once."""
        self.joining = None
        self._next_probe_at = now
        self._emit(ev.Joined(now, config_id))

    # ------------------------------------------------------------------ anti-entropy

    def _start_sync(self, now: float) -> None:
        self._sync_at = now + self.params.sync_interval_s * (0.5 + self._rng.random())
        if self.reachable < classic_quorum(len(self._config)):
            # Our view counts fewer than a majority reachable: it may be wrong, not the
            # cluster (verdicts from the minority side of a healed partition, or decisions we
            # missed that removed us), and we neither probe nor sample members we hold dead.
            # Any member of the configuration may be the one to tell us: its view, or its
            # certificates if it is ahead (one datagram per sync interval).
            peers = self._sample_any()
        else:
            peers = self._sample_members(1)
        if peers:
            digest, entries = self.view_digest()
            self._send(peers[0], Digest(self._config.config_id, digest, entries))

    def _on_digest(self, sender: MemberId, msg: Digest) -> None:
        cid = self._config.config_id
        if msg.config_id < cid:
            self._reconf.send_certificates(self._now, sender, msg.config_id)
            return
        if msg.config_id > cid:
            # We are behind: answer with our digest, so the sender sends its certificates.
            self._reconf.send_digest_to(self._now, sender)
            return
        if (msg.digest, msg.entries) != self.view_digest():
            self._counts["sync_mismatches"] += 1
            self._send_view(sender, reply=True)

    def _on_sync_state(self, now: float, sender: MemberId, msg: SyncState) -> None:
        if msg.config_id != self._config.config_id:
            self._counts["dropped_other_config"] += 1
            return
        for entry in msg.entries:
            if not isinstance(entry, Alert):
                self._learn(now, entry)
        if msg.reply and msg.page == msg.pages - 1:
            self._send_view(sender, reply=False)

    def _send_view(self, dest: MemberId, reply: bool) -> None:
        entries: list[Update] = []
        for member, (state, inc) in sorted(self._view.items()):
            if not _in_digest(state, inc):
                continue
            if state <= SUSPECT:
                entries.append(Alive(member, inc))
            elif state == DEAD:
                entries.append(Dead(member, inc, self._confirmers.get(member, self.id)))
            else:
                entries.append(Left(member, inc))
        size = self.params.sync_page_entries
        pages = max(1, math.ceil(len(entries) / size))
        cid = self._config.config_id
        for page in range(pages):
            chunk = tuple(entries[page * size:(page + 1) * size])
            self._send(dest, SyncState(cid, page, pages, chunk, reply))

    # ------------------------------------------------------------------ plumbing

    def _sample_members(self, count: int, exclude: MemberId | None = None) -> list[MemberId]:
        """Up to ``count`` distinct random members that are not us, ``exclude``, dead or gone.
        Rejection sampling over the shared member tuple: no per-member copy of the membership."""
        members = self._config.members
        n = len(members)
        draw = self._rng.random  # int(random() * n), not randrange(n): one C call per draw
        picked: list[MemberId] = []
        for _ in range(4 * count + 8):
            if len(picked) == count:
                break
            m = members[int(draw() * n)]
            if m == self.id or m == exclude or m in picked:
                continue
            view = self._view.get(m)  # None: alive at incarnation 0
            if view is not None and view[0] >= DEAD:
                continue
            picked.append(m)
        return picked

    def _sample_any(self) -> list[MemberId]:
        """One random member of the configuration that is not us, whatever our view holds of
        it; none if we are alone."""
        members = self._config.members
        n = len(members)
        draw = self._rng.random
        for _ in range(8):
            m = members[int(draw() * n)]
            if m != self.id:
                return [m]
        return []

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) % _SEQ_MOD
        return self._seq

    def _send(self, dest: MemberId, message: Message) -> None:
        if len(self._outbox) >= self.params.max_outbox:
            self._outbox.popleft()
            self._counts["outbox_dropped"] += 1
        self._outbox.append((dest, message))
        self._sent += 1

    def _emit(self, event: ev.Event) -> None:
        if len(self._events) >= self.params.max_events:
            self._events.popleft()
            self._counts["events_dropped"] += 1
        self._events.append(event)

    def _advance(self, now: float) -> None:
        if now < self._now:
            raise LocalProtocolError(f"time went backwards: {now} < {self._now}")
        tolerance = self.params.stall_tolerance_s
        # next_deadline() is never before the last input, so lateness <= now - self._now:
        # only a gap longer than the tolerance can hide a stall (skips the scan on busy paths).
        if now - self._now > tolerance:
            due = self.next_deadline()
            if now - due > tolerance:
                self._now = now
                self._on_stall(now, now - due)
        self._now = now


def _about(update: Update) -> MemberId:
    return update.subject if isinstance(update, Alert) else update.member


def _in_digest(state: MemberState, inc: int) -> bool:
    """Whether a view entry differs from the default (alive at incarnation 0) for anti-entropy;
    a suspicion is local and transient, so SUSPECT counts as ALIVE."""
    return inc > 0 or state >= DEAD


def _entry_hash(member: MemberId, state: MemberState, inc: int) -> int:
    # SUSPECT is a transient local state; two members agree on a view when they agree on
    # incarnations and on who is dead or gone, so it hashes like ALIVE.
    return mix_triple(member, ALIVE if state == SUSPECT else int(state), inc)
