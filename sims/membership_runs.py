"""Ready-made membership experiments shared by the tests, the demo and the reports.

Each function builds a seeded cluster, injects one kind of fault, runs it on the virtual clock and
returns plain numbers, so a test asserts on them and a report aggregates them over seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchpass_p2p.core import Params

from .cluster import Cluster
from .faults import FaultInjector
from .network import LinkModel
from .recorder import DetectionRecorder, FaultRecord


@dataclass(frozen=True, slots=True)
class CrashResult:
    members: int
    seed: int
    detect_first_s: float | None
    """Crash -> the first live member confirmed it dead (virtual seconds)."""
    detect_all_s: float | None
    """Crash -> every live member knew it dead; None if some never did."""
    knew: int
    live: int
    false_removals: int
    record: FaultRecord


def crash_run(
    members: int,
    seed: int,
    *,
    loss: float = 0.01,
    crash_at_s: float = 20.0,
    horizon_s: float = 40.0,
    params: Params | None = None,
    sealed: bool = False,
) -> CrashResult:
    """Crash one member at ``crash_at_s`` and run until ``horizon_s``."""
    cluster = Cluster(members, seed=seed, params=params, link=LinkModel(loss=loss), sealed=sealed,
                      keep_events=False)
    recorder = DetectionRecorder(cluster)
    victim = cluster.members[cluster.rng.randrange(members)]

    def crash() -> None:
        recorder.fault(victim)
        cluster.crash(victim)

    cluster.at(crash_at_s, crash)
    cluster.run(horizon_s)
    rec = recorder.faults[victim.id]
    live = recorder.live_ids()
    return CrashResult(
        members=members,
        seed=seed,
        detect_first_s=None if rec.first_dead is None else rec.first_dead - rec.at,
        detect_all_s=rec.all_know_s(live),
        knew=sum(1 for m in live if m in rec.dead_known),
        live=len(live),
        false_removals=len(recorder.false_removals),
        record=rec,
    )


@dataclass(frozen=True, slots=True)
class BusyResult:
    members: int
    seed: int
    false_removals: int
    suspicions: int
    refutations: int
    stalls: int
    blocks: int


def busy_run(
    members: int,
    seed: int,
    *,
    busy: int = 1,
    loss: float = 0.01,
    block_s: float = 2.0,
    period_s: float = 10.0,
    horizon_s: float = 600.0,
    params: Params | None = None,
) -> BusyResult:
    """``busy`` members have their loop blocked for ``block_s`` every ``period_s`` (first block at
    a seeded random phase); nobody crashes, so every conviction is a false removal."""
    cluster = Cluster(members, seed=seed, params=params, link=LinkModel(loss=loss),
                      keep_events=False)
    recorder = DetectionRecorder(cluster)
    victims = cluster.rng.sample(cluster.members, busy)
    faults = FaultInjector(cluster, recorder)
    for sm in victims:
        first = 1.0 + cluster.rng.random() * period_s
        for k in range(math.ceil((horizon_s - first) / period_s)):
            faults.pause(sm, first + k * period_s, block_s)
    cluster.run(horizon_s)
    blocks = sum(1 for _, kind, _ in faults.log if kind == "pause")
    return BusyResult(
        members=members,
        seed=seed,
        false_removals=len(recorder.false_removals),
        suspicions=recorder.suspicions,
        refutations=recorder.refutations,
        stalls=sum(sm.core.counters["stalls"] for sm in victims),
        blocks=blocks,
    )

