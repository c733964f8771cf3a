"""The training-step model: barrier steps, stalls, replacement after conviction, slowdown ramps."""

from __future__ import annotations

import pytest

from sims.cluster import Cluster
from sims.faults import FaultInjector
from sims.jobmodel import TrainingJob
from sims.network import LinkModel
from sims.recorder import DetectionRecorder
from sims.safety import SafetyChecker


def test_without_faults_every_step_takes_the_step_time() -> None:
    cluster = Cluster(10, spares=2, seed=1)
    job = TrainingJob(cluster, step_time_s=0.5, allreduce_s=0.1)
    cluster.run(30.001)
    assert job.step == 50  # 30 s / 0.6 s
    assert [r.ended_at for r in job.history[:3]] == pytest.approx([0.6, 1.2, 1.8])
    assert all(r.compute_s == (0.5,) * 8 for r in job.history)
    assert job.replacements == [] and job.flags == []


def test_a_crashed_rank_stalls_until_a_decided_configuration_gives_its_rank_to_a_spare() -> None:
    cluster = Cluster(12, spares=2, seed=2, link=LinkModel(loss=0.01), keep_events=False)
    recorder = DetectionRecorder(cluster)
    safety = SafetyChecker(cluster)
    job = TrainingJob(cluster, step_time_s=1.0, replace_s=4.0)
    faults = FaultInjector(cluster, recorder)
    victim = cluster.by_id[cluster.configuration.ranks[3]]
    faults.crash(victim, 20.5)
    cluster.run(60.0)
    [move] = job.replacements
    assert (move.rank, move.old, move.reason) == (3, victim.id, "dead")
    assert move.new in cluster.configuration.spares and move.config_id == 1
    assert move.decided_at == safety.decided_at[1]  # the first member to decide left the group
    # The new world trains replace_s after its last rank holder installed configuration 1.
    held = max(recorder.faults[victim.id].decided[m] for m in job.world if m is not None)
    assert move.ready_at is not None
    assert held <= move.ready_at - 4.0 <= held + job.poll_s
    # No step completes between the crash and the replacement; then 1 s steps again.
    ends = job.completions()
    assert not any(20.5 < t < move.ready_at for t in ends)
    assert next(t for t in ends if t > 20.5) == pytest.approx(move.ready_at + 1.0)
    [(at, label, stall_s)] = job.stalls(faults.log)
    assert (at, label) == (20.5, f"crash {victim.index}")
    assert stall_s == pytest.approx(move.ready_at + 1.0 - 20.5 - 1.0)


def test_a_short_clog_delays_the_all_reduce_without_a_replacement() -> None:
    cluster = Cluster(12, spares=2, seed=3, keep_events=False)
    job = TrainingJob(cluster, step_time_s=1.0, poll_s=0.01)
    faults = FaultInjector(cluster)
    faults.clog(cluster.by_id[cluster.configuration.ranks[0]], 10.5, 0.8)  # shorter than any alert
    cluster.run(20.0)
    assert job.replacements == []
    ends = job.completions()
    late = next(t for t in ends if t > 10.5)
    assert late == pytest.approx(11.3, abs=0.011)  # the step ending at 11 waits for the clog
    assert job.stalls(faults.log)[0][2] == pytest.approx(0.0, abs=1e-9)  # within one step


def test_no_spare_left_means_the_job_waits() -> None:
    cluster = Cluster(9, spares=1, seed=4, keep_events=False)
    job = TrainingJob(cluster, step_time_s=1.0, replace_s=1.0)
    faults = FaultInjector(cluster)
    faults.crash(cluster.by_id[cluster.configuration.ranks[0]], 10.2)
    faults.crash(cluster.by_id[cluster.configuration.ranks[1]], 30.2)
    cluster.run(60.0)
    assert [r.new is None for r in job.replacements] == [False, True]
    assert job.completions()[-1] < 30.2 + 1.0
    assert job.stalls(faults.log)[1][2] is None


def test_slowdown_ramps_linearly_then_holds() -> None:
    cluster = Cluster(6, spares=1, seed=5, keep_events=False)
    job = TrainingJob(cluster, step_time_s=1.0)
    sm = cluster.members[0]
    job.slow(sm, 10.0, factor=3.0, ramp_s=100.0)
    assert [job.slowdown(sm.id, t) for t in (0.0, 10.0, 60.0, 110.0, 500.0)] == [
        1.0, 1.0, 2.0, 3.0, 3.0]
    assert job.slowdown(cluster.members[1].id, 60.0) == 1.0


def test_same_seed_same_steps() -> None:
    def steps(seed: int) -> list[tuple[float, ...]]:
        cluster = Cluster(8, spares=1, seed=seed, keep_events=False)
        job = TrainingJob(cluster, step_time_s=1.0, jitter=0.2)
        cluster.run(20.0)
        return [r.compute_s for r in job.history]

    assert steps(1) == steps(1)
    assert steps(1) != steps(2)


def test_unknown_policy_is_local_misuse() -> None:
    with pytest.raises(ValueError):
        TrainingJob(Cluster(4, seed=0), step_time_s=1.0, policy="shrink")
