"""The virtual network: latency, loss, duplication, reordering, partitions and clogging.

A :class:`Network` decides, for one datagram from ``src`` to ``dst`` sent at ``now``, at which
times it arrives: none (lost, partitioned, clogged), once, or 1 + ``duplicate_copies`` times
(duplicated). Reordering falls out of per-datagram latency jitter. All randomness comes from the
``random.Random`` it is given, so a seed fixes every delivery.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from torchpass_p2p.core.messages import MemberId


@dataclass(slots=True)
class LinkModel:
    """Latency and loss of a link, in seconds and probabilities.

    Latency is ``base_latency_s`` plus an exponential jitter with mean ``jitter_s``; jitter larger
    than the gap between two datagrams reorders them. A datagram that is not lost is duplicated
    with probability ``duplicate``: it then arrives ``duplicate_copies`` extra times, each copy
    with its own latency draw (a switch or a retransmitting NIC may repeat a frame more than
    once).
    """

    base_latency_s: float = 0.0005
    jitter_s: float = 0.0002
    loss: float = 0.0
    duplicate: float = 0.0
    duplicate_copies: int = 1
    """Extra arrivals of a duplicated datagram (>= 1). Copies past the first come from
    :meth:`Network.extra_copies`, drawn only when this is above 1, so runs with the default
    draw exactly what they drew before it existed (same seed, same trace)."""
    bandwidth_bytes_per_s: float = 12.5e9
    """Bulk-transfer bandwidth (100 Gb/s), used by the job model for state transfers."""


@dataclass(slots=True)
class Network:
    """Every link follows ``link`` unless a member-specific rule overrides it.

    Rules, all keyed by member id:
        * ``cut``: directed pairs (src, dst) that drop everything (one-way partitions are one
          direction only; :meth:`partition` adds both directions between two groups).
        * ``deaf``: members that receive nothing; ``mute``: members whose sends are all lost.
        * ``member_loss``: extra loss on every datagram to or from that member (gray failure).
        * ``clogged``: members whose links drop everything (a switch port gone bad).
    """

    rng: random.Random
    link: LinkModel = field(default_factory=LinkModel)
    cut: set[tuple[MemberId, MemberId]] = field(default_factory=set)
    deaf: set[MemberId] = field(default_factory=set)
    mute: set[MemberId] = field(default_factory=set)
    clogged: set[MemberId] = field(default_factory=set)
    member_loss: dict[MemberId, float] = field(default_factory=dict)
    dropped: int = 0
    _random: Callable[[], float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # ``rng.random`` bound once: a plain call per draw instead of a method lookup.
        self._random = self.rng.random

    def delays(self, src: MemberId, dst: MemberId) -> tuple[float, ...]:
        """Arrival delays (seconds after sending) of one datagram; ``()`` when it is lost."""
        first, second = self.arrivals(src, dst)
        if first < 0:
            return ()
        if second < 0:
            return (first,)
        return (first, second, *self.extra_copies())

    def arrivals(self, src: MemberId, dst: MemberId) -> tuple[float, float]:
        """:meth:`delays` as a fixed pair, -1.0 standing for no arrival: (-1, -1) lost,
        (d, -1) delivered once, (d1, d2) duplicated. The compiled build returns the pair
        unboxed; the simulator calls this once per datagram."""
        if self._blocked(src, dst):
            self.dropped += 1
            return -1.0, -1.0
        link = self.link
        draw = self._random
        loss = link.loss
        if self.member_loss:
            loss = 1 - (1 - loss) * (1 - self.member_loss.get(src, 0.0)) * (
                1 - self.member_loss.get(dst, 0.0))
        if loss and draw() < loss:
            self.dropped += 1
            return -1.0, -1.0
        # random.expovariate(1 / jitter_s), inlined: the same arithmetic on the same draw (so
        # the same trace) without a Python-level call per datagram.
        rate = 1 / link.jitter_s
        first = link.base_latency_s + -math.log(1.0 - draw()) / rate
        if link.duplicate and draw() < link.duplicate:
            return first, link.base_latency_s + -math.log(1.0 - draw()) / rate
        return first, -1.0

    def extra_copies(self) -> list[float]:
        """Delays of the copies of a duplicated datagram past the one :meth:`arrivals` gives
        (``duplicate_copies - 1`` of them; none by default). Call right after
        :meth:`arrivals` returned a second arrival."""
        link = self.link
        if link.duplicate_copies <= 1:
            return []
        rate = 1 / link.jitter_s
        draw = self._random
        return [link.base_latency_s + -math.log(1.0 - draw()) / rate
                for _ in range(link.duplicate_copies - 1)]

    def _blocked(self, src: MemberId, dst: MemberId) -> bool:
        if not (self.cut or self.deaf or self.mute or self.clogged):
            return False
        return (src in self.mute or dst in self.deaf or src in self.clogged
                or dst in self.clogged or (src, dst) in self.cut)

    def partition(self, side_a: list[MemberId], side_b: list[MemberId]) -> None:
        """Cut every link between the two sides, both directions."""
        for a in side_a:
            for b in side_b:
                self.cut.add((a, b))
                self.cut.add((b, a))

    def heal(self) -> None:
        """Remove every partition, deaf, mute and clog rule (member loss stays)."""
        self.cut.clear()
        self.deaf.clear()
        self.mute.clear()
        self.clogged.clear()
