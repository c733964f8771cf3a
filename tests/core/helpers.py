"""Test utilities for the sans-IO membership core: a seeded fleet on a hand-advanced clock.

A :class:`Fleet` builds N :class:`Member` objects over one shared :class:`Configuration` with the
fixed ids ``1..N`` and one seeded ``random.Random`` per member, and plays the host for all of them:
it pulls ``messages_to_send()``, delivers each datagram with zero latency unless the test's
fault filter drops it, and calls ``handle_timer`` exactly at ``next_deadline()``. Everything it
delivers is appended to ``trace`` as ``(now, src, dst, message)``, so two fleets built with the same
seed and driven by the same script can be compared exactly (golden-trace style).

Tests that need to see every datagram step members by hand instead and use :func:`drain`,
:func:`events` and :func:`deliver`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable

from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.membership import Member
from torchpass_p2p.core.messages import MemberId, Message
from torchpass_p2p.core.params import Params

Datagram = tuple[MemberId, Message]
TraceEntry = tuple[float, MemberId, MemberId, Message]

QUIET = Params(sync_interval_s=1_000.0)
"""Defaults, except that anti-entropy waits ~1,000 s: a test about probing or suspicion then sees
no Digest unless it asks for one. Every other value is ``Params()``'s."""


def member_rng(seed: int, member: MemberId) -> random.Random:
    """The rng a fleet gives ``member``: a pure function of (seed, member id)."""
    return random.Random(seed * 1_000_003 + member)


def make_member(
    member: MemberId,
    config: Configuration,
    *,
    params: Params = QUIET,
    seed: int = 0,
    now: float = 0.0,
) -> Member:
    return Member(member, config, params=params, rng=member_rng(seed, member), now=now)


def drain(member: Member) -> list[Datagram]:
    """Every datagram ``member`` has queued, oldest first."""
    return member.messages_to_send()


def events(member: Member) -> list:
    """Every event ``member`` has queued, oldest first."""
    out = []
    while (event := member.next_event()) is not None:
        out.append(event)
    return out


def deliver(now: float, src: Member, dst: Member, datagrams: Iterable[Datagram]) -> int:
    """Hand ``dst`` every datagram of ``datagrams`` addressed to it, as sent by ``src``.

    Returns how many were delivered; datagrams for other members are skipped.
    """
    count = 0
    for dest, message in datagrams:
        if dest == dst.id:
            dst.receive(now, src.id, message)
            count += 1
    return count


def step_alone(member: Member, until: float) -> list[tuple[float, list[Datagram]]]:
    """Fire ``member``'s timer exactly at each of its deadlines up to ``until`` while nobody
    answers (every datagram it sends is lost). Returns ``(time, datagrams sent)`` per firing."""
    steps = []
    while (due := member.next_deadline()) <= until:
        member.handle_timer(due)
        steps.append((due, member.messages_to_send()))
    return steps


def of_type(datagrams: Iterable[Datagram], kind: type) -> list[Datagram]:
    return [(dest, msg) for dest, msg in datagrams if type(msg) is kind]


class Fleet:
    """N members over one configuration, a zero-latency network, and one hand-advanced clock.

    Args:
        n: members; their ids are ``1..n``.
        params: shared by every member.
        seed: member ``i`` draws from ``random.Random(seed * 1_000_003 + i)``.
        start: the clock's starting value in seconds.
        observers: K, the configuration's observer rings.

    Faults: ``down`` members neither receive nor run timers (a crash); ``drop`` is called as
    ``drop(src, dst, message)`` for every datagram and drops it when it returns True.
    """

    def __init__(
        self,
        n: int = 8,
        *,
        params: Params = QUIET,
        seed: int = 0,
        start: float = 0.0,
        observers: int = 10,
    ) -> None:
        self.params = params
        self.now = start
        self.config = Configuration(0, range(1, n + 1), observers=observers)
        self.members: dict[MemberId, Member] = {
            i: make_member(i, self.config, params=params, seed=seed, now=start)
            for i in range(1, n + 1)
        }
        self.down: set[MemberId] = set()
        self.drop: Callable[[MemberId, MemberId, Message], bool] = lambda src, dst, msg: False
        self.trace: list[TraceEntry] = []
        self.dropped: list[TraceEntry] = []

    def __getitem__(self, member: MemberId) -> Member:
        return self.members[member]

    def isolate(self, member: MemberId) -> None:
        """Lose every datagram to or from ``member`` (it keeps running: a cut cable)."""
        previous = self.drop
        self.drop = lambda src, dst, msg: member in (src, dst) or previous(src, dst, msg)

    def flush(self) -> None:
        """Deliver datagrams at ``now`` until no member has any left (replies included)."""
        while True:
            moved = False
            for src, member in self.members.items():
                if src in self.down:
                    member.messages_to_send()
                    continue
                for dst, message in member.messages_to_send():
                    moved = True
                    entry = (self.now, src, dst, message)
                    if dst in self.down or self.drop(src, dst, message):
                        self.dropped.append(entry)
                        continue
                    self.trace.append(entry)
                    self.members[dst].receive(self.now, src, message)
            if not moved:
                return

    def next_deadline(self) -> float:
        live = [m.next_deadline() for i, m in self.members.items() if i not in self.down]
        return min(live, default=math.inf)

    def run_until(self, end: float) -> None:
        """Advance the clock to ``end``, firing each live member's timer exactly at its deadline
        (in id order on ties) and delivering everything sent on the way."""
        self.flush()
        while True:
            due = self.next_deadline()
            if due > end:
                break
            self.now = max(self.now, due)
            for i, member in self.members.items():
                if i not in self.down and member.next_deadline() <= self.now:
                    member.handle_timer(self.now)
            self.flush()
        self.now = end

    def events(self, member: MemberId) -> list:
        return events(self.members[member])
