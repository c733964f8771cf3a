"""Protocol messages of the membership core: plain frozen values, no behaviour.

Two kinds of value live here:

* **updates** (:class:`Alive`, :class:`Alert`, :class:`Dead`, :class:`Left`) are the facts that
  gossip spreads. They ride piggyback on every datagram and in :class:`Gossip` pushes.
* **messages** (:class:`Ping`, :class:`PingReq`, :class:`Ack`, :class:`Nack`, :class:`Gossip`,
  :class:`Digest`, :class:`SyncState`) are what one datagram carries. The sender is not a field:
  it comes from the authenticated datagram header (or, in the simulator, from the envelope).

Member ids are unsigned 64-bit integers drawn fresh for every process start and never reused
(docs/design.md section 2), so a restarted process is a new member. Incarnations are unsigned 32-bit
(SWIM section 4.2: a member raises its own incarnation to refute a suspicion of itself).

They are values: nothing mutates one after construction (they are shared between the outbox, the
gossip queue and the codec's cache). They are not ``frozen``, and spell out ``__init__``, only
for speed: a frozen dataclass costs four times as much to build in CPython (0.9 us against 0.23
us here), and mypyc (scripts/build-native compiles this module) builds a frozen or generated-
``__init__`` dataclass through the Python-level ``__init__`` that ``dataclasses`` generates,
while a written-out one becomes a native constructor. The decoder and the simulator build
millions. Compiled, a constructor also checks its arguments' types (``TypeError``: an ``int``
field given a ``str``); in pure Python the encoder rejects such a message (``ValueError``).
Equality and ``repr`` come from ``dataclass``.

The wire codec (:mod:`torchpass_p2p.core.codec`) maps each class to a type tag; the tags below
are part of the wire format and never change meaning within a protocol version.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TypeAlias

MemberId: TypeAlias = int
"""A member's id: unsigned 64-bit, random per process start (docs/design.md section 2)."""

MAX_MEMBER_ID = (1 << 64) - 1
MAX_INCARNATION = (1 << 32) - 1
MAX_SEQ = (1 << 32) - 1


def format_member_id(member: MemberId) -> str:
    """The 16-hex-digit spelling used in logs, status pages and configuration files."""
    return f"{member:016x}"


class MemberState(IntEnum):
    """A member's liveness as one member believes it.

    Order matters: for the same incarnation a later state overrides an earlier one
    (SWIM section 4.2; memberlist's ``aliveNode``/``suspectNode``/``deadNode`` precedence).
    """

    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


# --- updates: the facts gossip spreads -------------------------------------------------------


@dataclass(slots=True, init=False)
class Alive:
    """``member`` is alive at ``incarnation``. A higher incarnation refutes every older alert."""

    member: MemberId
    incarnation: int

    def __init__(self, member: MemberId, incarnation: int) -> None:
        self.member = member
        self.incarnation = incarnation


@dataclass(slots=True, init=False)
class Alert:
    """``observer`` failed to reach ``subject`` (at the subject's ``incarnation``) for M rounds.

    Only an observer assigned to the subject by the configuration's rings may raise one; alerts
    from anyone else are dropped (Rapid, ATC'18, section 4.1: K observers per subject).

    ``silent``: the observer raised it because the subject's process stopped answering its
    pulse responder, a native thread that answers while the process runs at all, even with its
    event loop blocked (``agent/pulse_wire.py``). A subject that all the observers its removal
    needs find silent is not merely stalled, so it is owed no refutation window (scenario S01
    is about stalled loops; docs/design.md section 4).
    """

    observer: MemberId
    subject: MemberId
    incarnation: int
    silent: bool

    def __init__(self, observer: MemberId, subject: MemberId, incarnation: int,
                 silent: bool = False) -> None:
        self.observer = observer
        self.subject = subject
        self.incarnation = incarnation
        self.silent = silent


@dataclass(slots=True, init=False)
class Dead:
    """``member`` at ``incarnation`` was confirmed dead by ``confirmer`` after its suspicion
    timed out with enough independent alerts. Final for that member id."""

    member: MemberId
    incarnation: int
    confirmer: MemberId

    def __init__(self, member: MemberId, incarnation: int, confirmer: MemberId) -> None:
        self.member = member
        self.incarnation = incarnation
        self.confirmer = confirmer


@dataclass(slots=True, init=False)
class Left:
    """``member`` left on its own (graceful shutdown or drain). Final for that member id."""

    member: MemberId
    incarnation: int

    def __init__(self, member: MemberId, incarnation: int) -> None:
        self.member = member
        self.incarnation = incarnation


Update: TypeAlias = Alive | Alert | Dead | Left


# --- messages: what one datagram carries ----------------------------------------------------


@dataclass(slots=True, init=False)
class Ping:
    """Direct probe. The receiver answers ``Ack(seq)`` to the sender.

    ``seq`` is the prober's own counter (uint32). ``updates`` are piggybacked gossip.
    """

    seq: int
    updates: tuple[Update, ...] = ()

    def __init__(self, seq: int, updates: tuple[Update, ...] = ()) -> None:
        self.seq = seq
        self.updates = updates


@dataclass(slots=True, init=False)
class PingReq:
    """Indirect probe (SWIM section 3.1): ask the receiver to ping ``target`` and relay
    ``Ack(seq)`` back, or ``Nack(seq)`` if the target stays silent (Lifeguard section IV-A)."""

    seq: int
    target: MemberId
    updates: tuple[Update, ...] = ()

    def __init__(self, seq: int, target: MemberId, updates: tuple[Update, ...] = ()) -> None:
        self.seq = seq
        self.target = target
        self.updates = updates


@dataclass(slots=True, init=False)
class Ack:
    """Answer to ``Ping(seq)``, direct from the target or relayed by a ``PingReq`` helper."""

    seq: int
    updates: tuple[Update, ...] = ()

    def __init__(self, seq: int, updates: tuple[Update, ...] = ()) -> None:
        self.seq = seq
        self.updates = updates


@dataclass(slots=True, init=False)
class Nack:
    """A relay reports that ``target`` did not answer its ping in time (Lifeguard section IV-A):
    proof that the path prober -> relay works, so a missing nack counts against the prober."""

    seq: int
    target: MemberId

    def __init__(self, seq: int, target: MemberId) -> None:
        self.seq = seq
        self.target = target


@dataclass(slots=True, init=False)
class Gossip:
    """A push of updates to a few random members (eager on news, then periodic)."""

    updates: tuple[Update, ...]

    def __init__(self, updates: tuple[Update, ...]) -> None:
        self.updates = updates


@dataclass(slots=True, init=False)
class Digest:
    """Anti-entropy opener: a 64-bit order-independent hash of the sender's membership view for
    ``config_id`` and the number of entries it covers. The receiver answers with
    ``SyncState`` pages only when its own digest differs."""

    config_id: int
    digest: int
    entries: int

    def __init__(self, config_id: int, digest: int, entries: int) -> None:
        self.config_id = config_id
        self.digest = digest
        self.entries = entries


@dataclass(slots=True, init=False)
class SyncState:
    """One page of a membership view: every non-default entry (``Alive`` with incarnation > 0,
    ``Dead``, ``Left``). ``reply`` asks the receiver to send its own pages back."""

    config_id: int
    page: int
    pages: int
    entries: tuple[Update, ...]
    reply: bool = False

    def __init__(self, config_id: int, page: int, pages: int, entries: tuple[Update, ...],
                 reply: bool = False) -> None:
        self.config_id = config_id
        self.page = page
        self.pages = pages
        self.entries = entries
        self.reply = reply




# --- agreement: cuts, votes and the classic round (Rapid section 5, Fast Paxos) --------------


@dataclass(frozen=True, slots=True)
class Topology:
    """Where a member runs, for the spare-to-rank affinity of the plan (docs/design.md section 5).

    ``host`` names the machine; ``domain`` the NVLink (or PCIe switch) domain within or across
    hosts. Empty strings mean unknown and match nothing.
    """

    host: str = ""
    domain: str = ""


@dataclass(frozen=True, slots=True)
class Joiner:
    """A process asking to join as a spare: its fresh member id, datagram address and topology."""

    member: MemberId
    host: str
    port: int
    topology: Topology = Topology()


@dataclass(frozen=True, slots=True)
class Cut:
    """One configuration change, decided as a whole (Rapid section 4.2): members removed and
    spares admitted. Both tuples are sorted by member id, so equal cuts are equal values."""

    removed: tuple[MemberId, ...] = ()
    joined: tuple[Joiner, ...] = ()


@dataclass(slots=True, init=False)
class Vote:
    """The senders' knowledge of who voted ``cut`` in ``round`` of ``config_id``'s agreement.

    ``bits`` is one segment of a bitmap over the configuration's sorted member tuple: bit ``i``
    of byte ``j`` of segment ``s`` stands for member ``(s * SEGMENT_BYTES + j) * 8 + i``.
    Receivers OR segments together; a bitmap with a quorum of bits (fast quorum for round 0,
    majority for classic rounds) is the decision's certificate, checkable by anyone.
    ``max_step`` is the highest training step any voter in this bitmap reported committed (-1
    when none), the roll-forward input of docs/design.md section 6.
    """

    config_id: int
    round: int
    cut: Cut
    segment: int
    bits: bytes
    max_step: int = -1

    def __init__(self, config_id: int, round: int, cut: Cut, segment: int, bits: bytes,
                 max_step: int = -1) -> None:
        self.config_id = config_id
        self.round = round
        self.cut = cut
        self.segment = segment
        self.bits = bits
        self.max_step = max_step


@dataclass(slots=True, init=False)
class Prepare:
    """Classic round phase 1a: the sender coordinates ``round`` of ``config_id``'s agreement."""

    config_id: int
    round: int

    def __init__(self, config_id: int, round: int) -> None:
        self.config_id = config_id
        self.round = round


@dataclass(slots=True, init=False)
class Promise:
    """Classic round phase 1b: the sender promised ``round`` and last voted ``cut`` in
    ``voted_round`` (-1 and no cut when it never voted)."""

    config_id: int
    round: int
    voted_round: int
    cut: Cut | None

    def __init__(self, config_id: int, round: int, voted_round: int, cut: Cut | None) -> None:
        self.config_id = config_id
        self.round = round
        self.voted_round = voted_round
        self.cut = cut


@dataclass(slots=True, init=False)
class Accept:
    """Classic round phase 2a: the coordinator of ``round`` asks everyone to vote ``cut``.
    Acceptors answer with their bit in a :class:`Vote` for that round, on the gossip path."""

    config_id: int
    round: int
    cut: Cut

    def __init__(self, config_id: int, round: int, cut: Cut) -> None:
        self.config_id = config_id
        self.round = round
        self.cut = cut


@dataclass(slots=True, init=False)
class Join:
    """A process outside the configuration asks the receiver to sponsor it as a new spare."""

    joiner: Joiner
    config_id: int

    def __init__(self, joiner: Joiner, config_id: int) -> None:
        self.joiner = joiner
        self.config_id = config_id


@dataclass(slots=True, init=False)
class Progress:
    """Who of ``config_id``'s members reported their last committed training step, and the
    highest such step (docs/design.md section 6). Bits and segments as in :class:`Vote`; receivers
    OR the bits and take the max. Complete once every surviving rank holder's bit is set."""

    config_id: int
    segment: int
    bits: bytes
    max_step: int = -1

    def __init__(self, config_id: int, segment: int, bits: bytes, max_step: int = -1) -> None:
        self.config_id = config_id
        self.segment = segment
        self.bits = bits
        self.max_step = max_step


Message: TypeAlias = (Ping | PingReq | Ack | Nack | Gossip | Digest | SyncState | Vote | Prepare
                      | Promise | Accept | Join | Progress)
