"""Agreement on one change of configuration: Fast Paxos with votes spread as bitmaps.

Theory of operation
-------------------
Every configuration ``c`` gets exactly one successor, decided by the members of ``c`` without a
coordinator (docs/design.md section 5; Rapid, Suresh et al., ATC 2018, section 5; Lamport, "Fast
Paxos", Distributed Computing 19(2), 2006). One :class:`Consensus` object holds one member's side of
the decision for one configuration; the membership core owns it, feeds it messages and pulls output.

Fast round (round 0). When a member's cut detector settles on a cut it votes for it once. A vote
is one bit in a bitmap over the configuration's sorted member tuple, keyed by (round, cut). Members
OR the bitmaps they receive into their own and push changed segments on the gossip path, so N
votes cost O(N log N) bits in total instead of N^2 messages. A cut whose bitmap holds a fast quorum
``N - floor((N - 1) / 4)`` of bits is decided (Rapid section 5: the fast quorum of Fast Paxos with
at most a quarter of the members faulty).

Classic rounds (round r >= 1). Without a decision by a deadline, members start classic rounds after
jittered, deterministic delays. Round numbers ``attempt * N + index + 1`` are unique per
coordinator and tell everyone who coordinates a round. Phase 1 (``Prepare``/``Promise``) goes
straight to and from the coordinator, which sends its ``Prepare`` again to members whose promise is
missing (:data:`PREPARE_RESENDS`). The value rule is Fast Paxos's: with fast-round votes among a
quorum ``Q`` of promises, a cut voted by at least ``|Q| - F`` of them (``F = N - fast quorum``) may
have been decided and must be proposed again; at most one cut can qualify because ``|Q| > 2F``;
otherwise the coordinator proposes its own view as of its ``Accept``
(:meth:`Consensus.update_fallback`). Phase 2 (``Accept``) goes to everyone; acceptors answer with
their bit in a :class:`Vote` for that round, on the gossip path, and a majority of bits decides. A
member whose ``Accept`` was lost accepts when a vote of that round carrying the coordinator's own
bit reaches it: the coordinator sets that bit only for the cut it sent.

No empty change. The empty cut is never voted, accepted nor decided, in any round: a change that
changes nothing still costs every member a new configuration (events, progress reports, a plan)
and holds up the real change behind it. A coordinator free to propose but whose view holds no
change (something still unstable, or the suspicion behind the stale votes refuted) *holds* its
round, a quorum of promises in hand, and sends its ``Accept`` once its view has a change. Votes
left over from a refuted suspicion then stay until the next real change, which a classic round
decides.

Certificates. A decided bitmap is the decision's certificate: anyone holding the configuration can
count its bits. Lagging members catch up from a peer's log of recent certificates.

Safety needs only that a member votes at most once in round 0, never accepts a round below its
promise, and that a quorum is counted over the members of ``c``: a side without a majority of
``c`` can never decide, and neither can two different cuts reach a quorum in the same round.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from typing import Final

from .configuration import Configuration
from .errors import LocalProtocolError
from .messages import Accept, Cut, MemberId, Message, Prepare, Progress, Promise, Vote

SEGMENT_BITS = 2048
"""Members per bitmap segment: 256 bytes, so a segment, a cut and the header fit one 1,400-byte
datagram; 16,384 members need 8 segments. Must equal ``codec.SEGMENT_BYTES * 8``."""

SEGMENT_MASK: Final = (1 << SEGMENT_BITS) - 1
"""The bits of one segment, at segment 0."""

FAST_ROUND = 0
PREPARE_RESENDS = 2
"""Times a coordinator sends its ``Prepare`` again (every ``Params.vote_resend_s``) to members
whose promise is missing."""


def fast_quorum(members: int) -> int:
    """Votes that decide in round 0: ``N - floor((N - 1) / 4)`` (Rapid section 5)."""
    return members - (members - 1) // 4


def classic_quorum(members: int) -> int:
    """Votes (or promises) that decide in a classic round: a strict majority, ``floor(N/2) + 1``."""
    return members // 2 + 1


def coordinator_index(round_: int, members: int) -> int:
    """Index, in the sorted member tuple, of the coordinator of classic ``round_`` (>= 1)."""
    return (round_ - 1) % members


def cut_key(cut: Cut) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A total order on cuts, for deterministic tie-breaks."""
    return cut.removed, tuple(j.member for j in cut.joined)


def bitmap_segments(bits: int, members: int, only: int = -1) -> list[tuple[int, bytes]]:
    """Split a bitmap over ``members`` into (segment, little-endian bytes) pairs.

    ``only`` is a bitmask of the segments wanted (default: all). Trailing zero bytes are trimmed,
    so a 10-member configuration sends 2 bytes.
    """
    out = []
    mask = SEGMENT_MASK
    for seg in range((members + SEGMENT_BITS - 1) // SEGMENT_BITS):
        if not only >> seg & 1:
            continue
        part = bits >> (seg * SEGMENT_BITS) & mask
        out.append((seg, part.to_bytes((part.bit_length() + 7) // 8, "little")))
    return out


@dataclass(slots=True)
class Tally:
    """Known votes for one (round, cut), or known progress reports: a bitmap over members.

    ``dirty`` is a bitmask of segments changed since they were last pushed.
    """

    bits: int = 0
    max_step: int = -1
    dirty: int = 0

    def merge(self, segment: int, bits: int, max_step: int) -> bool:
        """OR in ``bits`` (already shifted to its place); returns whether anything was new."""
        # One OR and a compare: at 16k members a bitmap is 2 KiB, and every vote and progress
        # message merges one (the complement and AND this replaces cost two more copies).
        merged = self.bits | bits
        changed = False
        if merged != self.bits:
            self.bits = merged
            changed = True
        if max_step > self.max_step:
            self.max_step = max_step
            changed = True
        if changed:
            self.dirty |= 1 << segment
        return changed

    @property
    def count(self) -> int:
        return self.bits.bit_count()


@dataclass(frozen=True, slots=True)
class Certificate:
    """Proof that ``cut`` was decided for ``config_id`` in ``round``: a bitmap with a quorum of
    votes (fast quorum for round 0, majority otherwise) over the configuration's members.

    ``max_step`` is the highest committed step reported by its voters (-1 if none).
    """

    config_id: int
    round: int
    cut: Cut
    bits: int
    max_step: int

    @property
    def fast(self) -> bool:
        return self.round == FAST_ROUND

    def votes(self, members: int) -> list[Vote]:
        """The certificate as gossip messages, one per segment."""
        return [Vote(self.config_id, self.round, self.cut, seg, data, self.max_step)
                for seg, data in bitmap_segments(self.bits, members)]

    def valid_for(self, config: Configuration) -> bool:
        """Whether the bitmap holds a quorum of ``config``'s members for its round."""
        n = len(config)
        need = fast_quorum(n) if self.round == FAST_ROUND else classic_quorum(n)
        return (self.config_id == config.config_id and self.bits >> n == 0
                and self.bits.bit_count() >= need)


class Consensus:
    """One member's side of the agreement on ``config``'s successor.

    Args:
        config: the configuration whose change is being agreed on.
        me: this member's id, a member of ``config``; None for a process that is not a member
            (a joiner), which only gathers certificates and never votes.
        dropped: where to count dropped input (the owning member's counters, so the counts
            outlive this configuration); a fresh Counter by default.

    Raises:
        ValueError: ``me`` is not a member of ``config``.

    Output is pulled: :attr:`outbox` holds direct messages (``Prepare``/``Promise``/``Accept``),
    :meth:`dirty_votes` the vote segments to gossip, :attr:`decision` the certificate once known.
    Invalid input from peers is dropped and counted in :attr:`dropped`; nothing here raises on it.
    """

    def __init__(self, config: Configuration, me: MemberId | None, *,
                 dropped: Counter[str] | None = None) -> None:
        self.config = config
        self.config_id = config.config_id
        self.n = len(config)
        self.me = me
        self.index = -1 if me is None else _index(config, me)
        self.promised = FAST_ROUND
        """Highest round promised (Paxos rnd)."""
        self.voted_round = -1
        """Round of this member's last vote (Paxos vrnd); -1 before any."""
        self.voted_cut: Cut | None = None
        self.tallies: dict[tuple[int, Cut], Tally] = {}
        self.decision: Certificate | None = None
        self.outbox: list[tuple[MemberId, Message]] = []
        self.dropped: Counter[str] = Counter() if dropped is None else dropped
        self.coordinating = 0
        """The classic round this member coordinates now (0: none)."""
        self._promises: dict[MemberId, tuple[int, Cut | None]] = {}
        self._accept_sent = False
        self._prepare_resends = 0
        self._fallback: Cut | None = None

    # ------------------------------------------------------------------ fast round

    def vote_fast(self, cut: Cut, step: int) -> bool:
        """Vote ``cut`` in round 0 with this member's last committed ``step``. At most once, and
        never after promising a classic round. Returns whether the vote was cast.

        Raises:
            LocalProtocolError: ``cut`` is empty (there is nothing to vote for).
        """
        if not cut.removed and not cut.joined:
            raise LocalProtocolError("an empty cut is never voted in the fast round")
        if self.voted_round >= 0 or self.promised > FAST_ROUND or self.index < 0:
            return False
        self.voted_round = FAST_ROUND
        self.voted_cut = cut
        self._add(FAST_ROUND, cut, 1 << self.index, step)
        return True

    def merge_vote(self, vote: Vote) -> bool:
        """OR a gossiped vote segment into the tally; returns whether it was news."""
        first = vote.segment * SEGMENT_BITS
        if first >= self.n:
            self.dropped["vote_segment_out_of_range"] += 1
            return False
        bits = int.from_bytes(vote.bits, "little")
        if bits >> min(SEGMENT_BITS, self.n - first):
            self.dropped["vote_bits_out_of_range"] += 1
            return False
        if not vote.cut.removed and not vote.cut.joined:
            self.dropped["vote_invalid"] += 1  # no round ever decides the empty cut
            return False
        news = self._add(vote.round, vote.cut, bits << first, vote.max_step, vote.segment)
        if (news and vote.round > FAST_ROUND and vote.round >= self.promised
                and self.voted_round < vote.round and self.index >= 0
                and (bits << first) >> coordinator_index(vote.round, self.n) & 1):
            # The coordinator's own bit: it sent Accept(round, cut) to everyone, and ours was
            # lost. Accept as if it had arrived; otherwise one lost datagram leaves a
            # configuration with no spare acceptor a vote short until the next attempt.
            self._accept(vote.round, vote.cut)
        return news

    def dirty_votes(self) -> list[Vote]:
        """Segments changed since the last call, as gossip messages; clears the marks."""
        out = []
        for (round_, cut), tally in self.tallies.items():
            if tally.dirty:
                for seg, data in bitmap_segments(tally.bits, self.n, tally.dirty):
                    out.append(Vote(self.config_id, round_, cut, seg, data, tally.max_step))
                tally.dirty = 0
        return out

    def all_votes(self) -> list[Vote]:
        """Every tally, every segment (anti-entropy for a peer that may have missed pushes)."""
        return [Vote(self.config_id, round_, cut, seg, data, tally.max_step)
                for (round_, cut), tally in self.tallies.items()
                for seg, data in bitmap_segments(tally.bits, self.n)]

    @property
    def active(self) -> bool:
        """Whether anyone (this member included) has voted or prepared for this change."""
        return bool(self.tallies) or self.promised > FAST_ROUND

    # ------------------------------------------------------------------ classic rounds

    def prepare(self, attempt: int, fallback: Cut | None) -> int:
        """Coordinate a classic round: the first of ours above every promise, at ``attempt`` or
        later. ``fallback`` is proposed if no promised vote binds the round's value; while it
        is None or the empty cut, such a round holds (see :meth:`update_fallback`). Returns
        the round.

        Raises:
            LocalProtocolError: this process is not a member of the configuration.
        """
        if self.me is None:
            raise LocalProtocolError("only a member of the configuration coordinates")
        round_ = attempt * self.n + self.index + 1
        while round_ <= self.promised:
            round_ += self.n
        self.promised = round_
        self.coordinating = round_
        self._promises = {self.me: (self.voted_round, self.voted_cut)}
        self._accept_sent = False
        self._prepare_resends = 0
        self._fallback = fallback
        prepare = Prepare(self.config_id, round_)
        for member in self.config.members:
            if member != self.me:
                self.outbox.append((member, prepare))
        self._maybe_accept()
        return round_

    def update_fallback(self, cut: Cut | None) -> None:
        """The coordinator's current view (None or the empty cut: no change), proposed instead
        of the one given to :meth:`prepare` if no promised vote binds the round's value; no
        effect once the ``Accept`` went out or when not coordinating. A round that a quorum
        promised but that held for want of a change sends its ``Accept`` now (to
        :attr:`outbox`) if ``cut`` is one."""
        if self.coordinating and not self._accept_sent:
            self._fallback = cut
            self._maybe_accept()

    @property
    def holding(self) -> bool:
        """Whether this member coordinates a round that a quorum promised, free to propose
        but with no change to propose (:meth:`choose` is None): it waits for its view."""
        return (bool(self.coordinating) and not self._accept_sent
                and len(self._promises) >= classic_quorum(self.n))

    def resend_prepare(self) -> None:
        """Coordinator, before its ``Accept``: ``Prepare`` again to members whose promise has
        not arrived (a lost ``Prepare`` or ``Promise`` would stall the round until the next
        attempt; a member promises the same round again). At most :data:`PREPARE_RESENDS`
        times per round, so a coordinator that cannot reach a majority does not keep the
        others' own classic rounds postponed."""
        if not self.coordinating or self._accept_sent or self._prepare_resends >= PREPARE_RESENDS:
            return
        self._prepare_resends += 1
        prepare = Prepare(self.config_id, self.coordinating)
        for member in self.config.members:
            if member != self.me and member not in self._promises:
                self.outbox.append((member, prepare))

    def on_prepare(self, sender: MemberId, msg: Prepare) -> None:
        if msg.round < 1 or self.config.members[coordinator_index(msg.round, self.n)] != sender:
            self.dropped["prepare_invalid"] += 1
            return
        if msg.round < self.promised:
            self.dropped["prepare_stale"] += 1
            return
        self.promised = msg.round
        if self.coordinating and self.coordinating < msg.round:
            self.coordinating = 0  # a higher round supersedes ours
        if self.index < 0:
            return
        self.outbox.append((sender, Promise(self.config_id, msg.round, self.voted_round,
                                            self.voted_cut)))

    def on_promise(self, sender: MemberId, msg: Promise) -> None:
        if msg.round != self.coordinating or sender not in self.config:
            self.dropped["promise_stale"] += 1
            return
        if (msg.voted_round >= msg.round or (msg.voted_round >= 0) != (msg.cut is not None)
                or (msg.cut is not None and not msg.cut.removed and not msg.cut.joined)):
            self.dropped["promise_invalid"] += 1  # nobody votes the empty cut
            return
        self._promises[sender] = (msg.voted_round, msg.cut)
        self._maybe_accept()

    def on_accept(self, sender: MemberId, msg: Accept) -> None:
        if (msg.round < 1 or self.config.members[coordinator_index(msg.round, self.n)] != sender
                or (not msg.cut.removed and not msg.cut.joined)):
            self.dropped["accept_invalid"] += 1
            return
        self._accept(msg.round, msg.cut)

    def choose(self) -> Cut | None:
        """The Fast Paxos value rule over the promises gathered (see the module docstring).

        A cut that may have been decided must be proposed again; when none may have been, the
        coordinator is free and proposes its own current view (``fallback``). None when that
        view holds no change: the round holds rather than decide the empty cut, so a refuted
        suspicion neither removes a live member nor costs a configuration change.
        """
        voted = [(r, c) for r, c in self._promises.values() if r >= 0 and c is not None]
        fallback = self._fallback
        if fallback is not None and not fallback.removed and not fallback.joined:
            fallback = None
        if not voted:
            return fallback
        top = max(r for r, _ in voted)
        cuts = Counter(c for r, c in voted if r == top)
        if top > FAST_ROUND:
            return next(iter(cuts))  # one coordinator, one value per classic round
        # A cut decided in round 0 appears in at least |Q| - F promises, more than any other cut
        # can (|Q| > 2F). Ties break by cut_key.
        best, count = min(cuts.items(), key=lambda kv: (-kv[1], cut_key(kv[0])))
        need = len(self._promises) - (self.n - fast_quorum(self.n))
        return best if count >= need else fallback

    def _maybe_accept(self) -> None:
        if self._accept_sent or len(self._promises) < classic_quorum(self.n):
            return
        cut = self.choose()
        if cut is None:
            return  # holding: update_fallback sends the Accept once there is a change
        self._accept_sent = True
        accept = Accept(self.config_id, self.coordinating, cut)
        for member in self.config.members:
            if member != self.me:
                self.outbox.append((member, accept))
        self._accept(self.coordinating, cut)

    def _accept(self, round_: int, cut: Cut) -> None:
        if self.index < 0:
            return
        if round_ < self.promised or self.voted_round >= round_:
            self.dropped["accept_stale"] += 1
            return
        self.promised = round_
        self.voted_round = round_
        self.voted_cut = cut
        self._add(round_, cut, 1 << self.index, -1)

    # ------------------------------------------------------------------ tallies

    def _add(self, round_: int, cut: Cut, bits: int, step: int, segment: int = -1) -> bool:
        key = (round_, cut)
        tally = self.tallies.get(key)
        if tally is None:
            tally = self.tallies[key] = Tally()
        if segment < 0:
            segment = (bits.bit_length() - 1) // SEGMENT_BITS
        if not tally.merge(segment, bits, step):
            return False
        if self.decision is None:
            need = fast_quorum(self.n) if round_ == FAST_ROUND else classic_quorum(self.n)
            if tally.count >= need:
                self.decision = Certificate(self.config_id, round_, cut, tally.bits,
                                            tally.max_step)
        return True


def progress_messages(config_id: int, tally: Tally, members: int, only: int = -1) -> list[Progress]:
    """A progress tally as gossip messages (all segments, or those in the bitmask ``only``)."""
    return [Progress(config_id, seg, data, tally.max_step)
            for seg, data in bitmap_segments(tally.bits, members, only)]


def _index(config: Configuration, member: MemberId) -> int:
    members = config.members
    i = bisect_left(members, member)
    if i == len(members) or members[i] != member:
        raise ValueError("me is not a member of the configuration")
    return i
