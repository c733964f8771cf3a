"""Fault injection: what real clusters do to processes and links, on the virtual clock.

Every method schedules its fault at virtual time ``at`` (seconds) through the cluster's engine, so
a scenario is a list of calls made before :meth:`Cluster.run`. Faults that should end in the
member's removal (crash, hang, host loss) are marked on the recorder as *expected*; any other
conviction the recorder sees is a false removal.

=================  ============================================================================
fault              what the member's peers observe
=================  ============================================================================
crash              nothing, ever again (process gone, host up or down)
hang               the process runs but its network is deaf and mute (a wedged NIC or driver)
pause              nothing for ``duration_s``, then everything at once (SIGSTOP, a long GC)
busy               pauses of ``chunk_s`` taking ``duty`` of the time (a thread holding the GIL,
                   a synchronous CUDA or NVML call; scenario S01)
gray               heavy random loss on that member's datagrams only
one_way            it can send but not receive (``deaf``) or receive but not send (``mute``)
clog               all its links drop everything for ``duration_s``
delay              everything it sends (or only its acks) arrives ``delay_s`` late, for
                   ``duration_s`` (an egress queue, a slow send path)
restart            a crash, then a new process under a new member id ``after_s`` later that
                   joins as a spare; its first ``lost_joins`` Join datagrams are lost
partition          every link between two sides is cut until ``heal_at``; the members it names
                   as expected removed are faults from the cut on
host_failure       every member of one host crashes at once (correlated failure)
arrivals           crashes drawn as a Poisson process from a per-GPU-hour failure rate
=================  ============================================================================
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from torchpass_p2p.core import MemberId

from .cluster import Cluster, SimMember
from .recorder import DetectionRecorder


class FaultInjector:
    """Schedules faults on ``cluster``; ``recorder`` learns which removals are expected."""

    def __init__(self, cluster: Cluster, recorder: DetectionRecorder | None = None) -> None:
        self.cluster = cluster
        self.recorder = recorder
        self.rng = random.Random(cluster.rng.getrandbits(64))
        self.log: list[tuple[float, str, int]] = []
        self._delay_window: dict[MemberId, int] = {}  # member -> its latest delay's number

    def _note(self, kind: str, sm: SimMember, expected_removal: bool) -> None:
        self.log.append((self.cluster.now, kind, sm.index))
        if expected_removal and self.recorder is not None:
            self.recorder.fault(sm)

    def delay(self, sm: SimMember, at: float, duration_s: float, delay_s: float, *,
              acks_only: bool = False, expected_removal: bool = False) -> None:
        """From ``at`` to ``at + duration_s``, every datagram ``sm`` sends (with ``acks_only``,
        every ack: ``Ack`` and pulse answers) arrives ``delay_s`` seconds later than the link
        alone would deliver it (:meth:`Cluster.delay_sends`)."""
        cluster = self.cluster

        def start() -> None:
            self._note("delay_acks" if acks_only else "delay", sm, expected_removal)
            cluster.delay_sends(sm, delay_s, acks_only=acks_only)
            window = self._delay_window[sm.id] = self._delay_window.get(sm.id, 0) + 1

            def end() -> None:
                if self._delay_window[sm.id] == window:  # else a later window took over
                    cluster.delay_sends(sm, 0.0)
            cluster.at(at + duration_s, end)
        cluster.at(at, start)

    def restart(self, sm: SimMember, at: float, after_s: float, *,
                lost_joins: int = 0) -> None:
        """Crash ``sm`` at ``at`` (an expected removal) and start a new process ``after_s``
        seconds later, under a new member id, that asks to join as a spare
        (:meth:`Cluster.spawn_joiner`, through the first member by index that is neither
        crashed, removed, left nor joining). The network loses its first ``lost_joins`` Join
        datagrams. The recorder learns the pair, so the run reports when the new process was
        admitted. With no live member left to ask, no process starts (logged as
        ``restart_skipped``)."""
        self.crash(sm, at)
        cluster = self.cluster

        def start() -> None:
            via = next((m for m in cluster.members if not (
                m.crashed or m.core.removed or m.core.left or m.core.joining is not None)),
                None)
            if via is None:
                self.log.append((cluster.now, "restart_skipped", sm.index))
                return
            new = cluster.spawn_joiner(via, lost_joins=lost_joins)
            self.log.append((cluster.now, "restart", new.index))
            if self.recorder is not None:
                self.recorder.restarted(new, at)
        cluster.at(at + after_s, start)

    def crash(self, sm: SimMember, at: float) -> None:
        def fire() -> None:
            self._note("crash", sm, True)
            self.cluster.crash(sm)
        self.cluster.at(at, fire)

    def hang(self, sm: SimMember, at: float) -> None:
        net = self.cluster.network

        def fire() -> None:
            self._note("hang", sm, True)
            net.deaf.add(sm.id)
            net.mute.add(sm.id)
        self.cluster.at(at, fire)

    def pause(self, sm: SimMember, at: float, duration_s: float) -> None:
        def fire() -> None:
            self._note("pause", sm, False)
            self.cluster.block(sm, duration_s)
        self.cluster.at(at, fire)

    def stop(self, sm: SimMember, at: float, duration_s: float,
             expected_removal: bool = True) -> None:
        """SIGSTOP ``sm`` at ``at`` and SIGCONT it ``duration_s`` later: like :meth:`pause`, and
        its pulse responder is silent too (the whole process is frozen)."""
        def fire() -> None:
            self._note("stop", sm, expected_removal)
            self.cluster.block(sm, duration_s, frozen=True)
        self.cluster.at(at, fire)

    def busy(self, sm: SimMember, start: float, until: float, chunk_s: tuple[float, float],
             duty: float) -> None:
        """Block ``sm`` in chunks drawn uniformly from ``chunk_s`` (seconds) so that about
        ``duty`` of the time between ``start`` and ``until`` is spent blocked."""
        if not 0 < duty < 1:
            raise ValueError("duty must be in (0, 1)")
        t = start
        while t < until:
            chunk = self.rng.uniform(*chunk_s)
            self.pause(sm, t, chunk)
            # Mean gap chosen so blocked / (blocked + free) == duty.
            gap = chunk * (1 - duty) / duty
            t += chunk + self.rng.uniform(0.5 * gap, 1.5 * gap)

    def gray(self, sm: SimMember, at: float, loss: float, expected_removal: bool = False) -> None:
        def fire() -> None:
            self._note("gray", sm, expected_removal)
            self.cluster.network.member_loss[sm.id] = loss
        self.cluster.at(at, fire)

    def one_way(self, sm: SimMember, at: float, direction: str) -> None:
        """``direction``: ``"deaf"`` (sends, never receives) or ``"mute"`` (the reverse)."""
        if direction not in ("deaf", "mute"):
            raise ValueError("direction must be 'deaf' or 'mute'")
        rules = getattr(self.cluster.network, direction)

        def fire() -> None:
            self._note(f"one_way_{direction}", sm, True)
            rules.add(sm.id)
        self.cluster.at(at, fire)

    def clog(self, sm: SimMember, at: float, duration_s: float) -> None:
        net = self.cluster.network

        def start() -> None:
            self._note("clog", sm, False)
            net.clogged.add(sm.id)
        self.cluster.at(at, start)
        self.cluster.at(at + duration_s, lambda: net.clogged.discard(sm.id))

    def partition(self, side_a: Sequence[SimMember], side_b: Sequence[SimMember], at: float,
                  heal_at: float | None = None,
                  expected_removed: Sequence[SimMember] = ()) -> None:
        """Cut every link between ``side_a`` and ``side_b`` at ``at``, until ``heal_at``.
        ``expected_removed`` members are faults from ``at`` on: their removal is a detection,
        not a false removal, and their own verdicts about others, reached while cut off, are
        not false removals either (:meth:`DetectionRecorder.fault` with ``cut_off``).

        Raises:
            ValueError: a member of ``expected_removed`` is on neither side.
        """
        net = self.cluster.network
        a = [sm.id for sm in side_a]
        b = [sm.id for sm in side_b]
        outside = [sm.index for sm in expected_removed if sm.id not in a and sm.id not in b]
        if outside:
            raise ValueError(f"members {outside} are expected removed by a partition that "
                             f"leaves them on neither side")

        def cut() -> None:
            self.log.append((self.cluster.now, "partition", len(a)))
            for sm in expected_removed:
                self.log.append((self.cluster.now, "partition_removal", sm.index))
                if self.recorder is not None:
                    self.recorder.fault(sm, cut_off=True)
            net.partition(a, b)
        self.cluster.at(at, cut)
        if heal_at is not None:
            def heal() -> None:
                for x in a:
                    for y in b:
                        net.cut.discard((x, y))
                        net.cut.discard((y, x))
            self.cluster.at(heal_at, heal)

    def host_failure(self, host: int, at: float, gpus_per_host: int = 8) -> list[SimMember]:
        """Crash every member on ``host`` (members ``host*gpus_per_host ..`` in index order)."""
        victims = self.cluster.members[host * gpus_per_host:(host + 1) * gpus_per_host]
        for sm in victims:
            self.crash(sm, at)
        return victims

    def arrivals(self, rate_per_gpu_hour: float, start: float, until: float) -> int:
        """Crash members at the times of a Poisson process with the fleet's total rate
        (``rate_per_gpu_hour`` * members / 3600 per second). Returns how many were scheduled.
        Rates come from sims/fleetmodel/data/failure_rates.json (e.g. Llama 3: 1.973e-5 per
        GPU-hour)."""
        members = list(self.cluster.members)
        total_per_s = rate_per_gpu_hour * len(members) / 3600.0
        if total_per_s <= 0:
            return 0
        t, count = start, 0
        while True:
            t += -math.log(1.0 - self.rng.random()) / total_per_s
            if t >= until or not members:
                return count
            victim = members.pop(self.rng.randrange(len(members)))
            self.crash(victim, t)
            count += 1
