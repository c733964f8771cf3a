"""S06 one-way isolation (docs/scenarios.md), in the simulator.

12 ranks + 2 spares at 1 % loss, training 1 s steps. At t = 30 s one rank loses one direction of
its network: ``deaf`` (it can send but receives nothing) or ``mute`` (it receives but every send
is lost). Must hold: only that rank is convicted and replaced; no healthy member is removed. The
job model also gives the training stall; the invariants hold throughout.

Why it holds: the one-way member hears no ack from anyone (deaf: acks never reach it; mute: its
pings never arrive), so it suspects itself within ``self_suspect_after_s`` and accuses nobody,
while its observers' rounds fail and convict it. Measured (seeds 0-3): convicted 2.5-2.6 s after
the fault, known dead by every live member within milliseconds more; training stalled ~7.6 s
(detection + ``replace_s`` = 5 s + the redone step).
"""

from __future__ import annotations

import pytest

from sims.cluster import Cluster
from sims.faults import FaultInjector
from sims.invariants import InvariantChecker
from sims.jobmodel import TrainingJob
from sims.network import LinkModel
from sims.recorder import DetectionRecorder

FAULT_AT_S, HORIZON_S, REPLACE_S = 30.0, 90.0, 5.0


@pytest.mark.parametrize("direction", ["deaf", "mute"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_s06_only_the_one_way_rank_is_replaced(seed: int, direction: str) -> None:
    cluster = Cluster(14, spares=2, seed=seed, link=LinkModel(loss=0.01), keep_events=False)
    recorder = DetectionRecorder(cluster)
    checker = InvariantChecker(cluster, recorder)
    job = TrainingJob(cluster, step_time_s=1.0, replace_s=REPLACE_S, jitter=0.05)
    faults = FaultInjector(cluster, recorder)
    ranks = cluster.configuration.ranks
    victim = cluster.by_id[ranks[cluster.rng.randrange(len(ranks))]]
    faults.one_way(victim, FAULT_AT_S, direction)
    cluster.run(HORIZON_S)

    assert recorder.false_removals == {}  # no healthy member convicted
    assert not any(sm.core.removed for sm in cluster.members if sm is not victim)
    record = recorder.faults[victim.id]
    assert set(record.dead_known) == set(recorder.live_ids())  # everyone knows it dead
    assert [(r.rank, r.old, r.reason) for r in job.replacements] == [
        (ranks.index(victim.id), victim.id, "dead")]
    assert victim.core.self_suspected  # it knew it was the one cut off...
    assert victim.core.counters["alerts_raised"] == 0  # ...and accused nobody
    # Detection within the protocol's own bound, and training resumed after the replacement.
    assert record.first_dead is not None and record.first_dead - FAULT_AT_S < 2.0 + 0.5 + 6.0
    [(_, _, stall_s)] = job.stalls(faults.log)
    assert stall_s is not None and REPLACE_S < stall_s < REPLACE_S + 2.0 + 0.5 + 6.0 + 1.5
    assert checker.violations == []
    assert checker.check_end() == []
