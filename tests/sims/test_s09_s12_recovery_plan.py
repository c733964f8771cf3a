"""S09 same plan for everyone and S12 two at once (docs/scenarios.md), the parts that
run in the simulator: which configuration, which plan, which step. The multi-process halves (real
collectives, no hang) belong to the runtime's end-to-end tests.

S09: 4 ranks + 2 spares; a rank leaves gracefully while a late spare joins. Must hold: every
member of the new configuration enters the same recovery plan (same plan hash).

S12: 8 ranks + 2 spares; kill a rank and, within 100 ms, the member it would pull state from.
Must hold: one or two configuration changes, both ranks replaced, same step (the plan's
``resume_step`` is the step the job was computing: nothing committed is lost or repeated twice).
"""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from sims.cluster import Cluster, SimMember
from sims.invariants import InvariantChecker
from sims.jobmodel import TrainingJob
from sims.network import LinkModel
from sims.recorder import DetectionRecorder
from sims.safety import SafetyChecker
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.messages import Cut
from torchpass_p2p.core.plan import Policy, next_configuration


def ready_plans(cluster: Cluster) -> dict[int, dict[int, ev.PlanReady]]:
    """config_id -> member index -> its PlanReady, filled as the run goes."""
    plans: dict[int, dict[int, ev.PlanReady]] = {}

    def on_event(sm: SimMember, event: ev.Event) -> None:
        if isinstance(event, ev.PlanReady):
            plans.setdefault(event.plan.config_id, {})[sm.index] = event

    cluster.listeners.append(on_event)
    return plans


@pytest.mark.parametrize("seed", range(4))
def test_s09_a_leave_and_a_late_join_give_everyone_the_same_plan(seed: int) -> None:
    cluster = Cluster(6, spares=2, seed=seed, link=LinkModel(loss=0.01), keep_events=False)
    safety = SafetyChecker(cluster)
    checker = InvariantChecker(cluster)
    plans = ready_plans(cluster)
    leaver = cluster.by_id[cluster.configuration.ranks[1]]
    joiners: list[SimMember] = []
    cluster.at(10.0, lambda: cluster.leave(leaver))
    cluster.at(10.02, lambda: joiners.append(cluster.spawn_joiner(cluster.members[0])))
    cluster.run(30.0)
    [joiner] = joiners
    final = cluster.members[0].core.configuration
    assert leaver.core.removed and leaver.id not in final
    assert joiner.core.joining is None and joiner.id in final
    assert final.ranks[1] in cluster.configuration.spares  # a spare took the leaver's rank
    live = [sm for sm in cluster.members if not sm.core.removed]
    for cid in range(1, final.config_id + 1):
        holders = {sm.index for sm in live if cid >= cluster.started_in.get(sm.id, 0) + 1
                   and sm.id in safety.configurations[cid]}
        got = plans.get(cid, {})
        assert holders <= set(got), (cid, holders, set(got))  # every member entered it...
        assert len({e.plan.hash for e in got.values()}) == 1  # ...and the same one
    assert safety.violations == [] and checker.violations == []


@pytest.mark.parametrize("seed", range(4))
def test_s12_a_rank_and_its_first_state_source_die_within_100_ms(seed: int) -> None:
    cluster = Cluster(10, spares=2, seed=seed, link=LinkModel(loss=0.01), keep_events=False)
    recorder = DetectionRecorder(cluster)
    safety = SafetyChecker(cluster)
    checker = InvariantChecker(cluster, recorder)
    job = TrainingJob(cluster, step_time_s=1.0, replace_s=2.0)
    plans = ready_plans(cluster)
    config = cluster.configuration
    victim = cluster.by_id[config.ranks[2]]
    _, would_be, _ = next_configuration(config, Cut(removed=(victim.id,)), policy=Policy.WAIT)
    [(_, sources)] = would_be.sources
    source = cluster.by_id[sources[0]]
    crash_at = 20.3
    step_at_crash: list[int] = []

    def crash(sm: SimMember) -> None:
        recorder.fault(sm)
        cluster.crash(sm)

    cluster.at(crash_at, lambda: step_at_crash.append(job.step))
    cluster.at(crash_at, lambda: crash(victim))
    cluster.at(crash_at + 0.1, lambda: crash(source))
    cluster.run(60.0)

    changes = sorted(safety.configurations)[1:]
    assert 1 <= len(changes) <= 2
    final = safety.configurations[changes[-1]]
    assert victim.id not in final and source.id not in final
    assert set(final.ranks) == (set(config.ranks) - {victim.id, source.id}) | set(config.spares)
    # Same step: the step in flight at the crash is redone, nothing committed is lost.
    resume = {e.plan.resume_step for by_member in plans.values() for e in by_member.values()}
    assert resume == {step_at_crash[0]}
    assert job.step > step_at_crash[0] + 20  # and training went on
    assert safety.violations == [] and checker.violations == []


@pytest.mark.parametrize("seed", range(12))
def test_s12_at_the_e2e_size_two_members_that_observe_each_other(seed: int) -> None:
    """4 ranks + 2 spares (the end-to-end test's sizes): a subject has 2 to 4 observers, and the
    two ranks that die at once observe each other, so neither can collect L explicit alerts,
    and the survivors whose subjects both died hear acks only rarely. Both must still be
    removed within 10 s, in one or two changes, and replaced by the two spares."""
    cluster = Cluster(6, spares=2, seed=seed, link=LinkModel(loss=0.01), keep_events=False)
    safety = SafetyChecker(cluster)
    checker = InvariantChecker(cluster)
    config = cluster.configuration
    a, b = next((a, b) for i, a in enumerate(config.ranks) for b in config.ranks[i + 1:]
                if a in config.observers_of(b) and b in config.observers_of(a))
    for member in (a, b):
        cluster.at(20.0, lambda sm=cluster.by_id[member]: cluster.crash(sm))
    cluster.run(30.0)
    assert 1 <= len(safety.configurations) - 1 <= 2
    final = safety.configurations[max(safety.configurations)]
    assert a not in final and b not in final
    assert set(final.ranks) == (set(config.ranks) - {a, b}) | set(config.spares)
    assert safety.violations == [] and checker.violations == []


def test_s12_at_the_e2e_size_any_two_ranks_over_200_seeds() -> None:
    """Any two of the 4 ranks crash together at 1 % loss, with no exit reported by a launcher
    (detection alone): within 10 s both are removed and the two spares hold their ranks, in
    every one of 200 seeds. Seeds 56, 85, 128 and 186 failed before three fixes: a survivor whose
    subjects both died suspected itself (its stretched rounds' nacks had aged past
    ``self_suspect_after_s``), and a lost ``Accept`` or ``Promise`` left a classic round of 4
    live members out of 6 one vote short until the next attempt. With 4 piggybacks per update
    (memberlist's count below 10 members), 3 seeds of 1,000 also lost an alert."""
    slow = []
    for seed in range(200):
        cluster = Cluster(6, spares=2, seed=seed, link=LinkModel(loss=0.01), keep_events=False)
        safety = SafetyChecker(cluster)
        checker = InvariantChecker(cluster)
        config = cluster.configuration
        a, b = random.Random(seed).sample(list(config.ranks), 2)
        for member in (a, b):
            cluster.at(20.0, lambda sm=cluster.by_id[member], c=cluster: c.crash(sm))
        cluster.run(30.0)
        final = safety.configurations[max(safety.configurations)]
        if (set(final.ranks) != (set(config.ranks) - {a, b}) | set(config.spares)
                or {sm.core.configuration.config_id for sm in cluster.live()}
                != {final.config_id}):
            slow.append(seed)
        assert safety.violations == [] and checker.violations == []
    assert slow == []


def test_s12_at_the_e2e_size_two_exits_reported_by_launchers_are_one_fast_change() -> None:
    """Any two of the 4 ranks are killed up to 0.1 s apart, on hosts of two members each, and
    each victim's launcher reports the exit to its live sibling (``report_exited``), as the
    launcher does. Over 100 seeds at 0 and 1 % loss, every run where both exits are reported
    ends in exactly one configuration change that removes both, decided 0.35 s after the first
    kill at the median and within 1 s in every run (virtual time). Before ``exit_settle_s`` and
    the early classic round: 2.36 s at the median, 3.2 s at most, for four
    voters of six can never make the fast quorum (5), so the change waited
    ``classic_timeout_s`` plus its spread."""
    decided_after = []
    for seed, loss in itertools.product(range(100), (0.0, 0.01)):
        cluster = Cluster(6, spares=2, seed=seed, link=LinkModel(loss=loss), keep_events=False)
        safety = SafetyChecker(cluster)
        checker = InvariantChecker(cluster)
        config = cluster.configuration
        rng = random.Random(seed)
        order = list(config.members)
        rng.shuffle(order)
        host = {member: i // 2 for i, member in enumerate(order)}
        victims = rng.sample([r for r in config.ranks if r is not None], 2)
        if host[victims[0]] == host[victims[1]]:
            victims[1] = next(r for r in config.ranks
                              if r is not None and host[r] != host[victims[0]])
        for k, victim in enumerate(victims):
            at = 20.0 + k * rng.uniform(0.0, 0.1)
            cluster.at(at, lambda sm=cluster.by_id[victim], c=cluster: c.crash(sm))
            (sibling,) = [m for m in config.members if host[m] == host[victim] and m != victim]
            cluster.at(at + rng.uniform(0.005, 0.05),
                       lambda c=cluster, sm=cluster.by_id[sibling], v=victim:
                       c.report_exited(sm, v))
        cluster.run(30.0)
        assert sorted(safety.configurations) == [0, 1], (seed, loss)
        final = safety.configurations[1]
        assert set(final.ranks) == (set(config.ranks) - set(victims)) | set(config.spares)
        assert {sm.core.configuration.config_id for sm in cluster.live()} == {1}
        assert safety.violations == [] and checker.violations == []
        decided_after.append(safety.decided_at[1] - 20.0)
    # A lost vote or Prepare (1 % loss) waits for the next resend, vote_resend_s later.
    assert statistics.median(decided_after) < 0.35 and max(decided_after) < 1.0, \
        (statistics.median(decided_after), sorted(decided_after)[-5:])


@pytest.mark.parametrize("seed", range(4))
def test_every_rank_dying_at_once_stops_the_job_instead_of_waiting_for_a_spare(
        seed: int) -> None:
    # 2 ranks + 3 spares: the spares are a majority and decide, but no survivor holds the
    # state (plan rule 3). Every one of them learns that the job stops; none is promoted, and
    # none is told to wait for a spare (there are spares: it is the state that is gone).
    cluster = Cluster(5, spares=3, seed=seed, link=LinkModel(loss=0.01), keep_events=False)
    safety = SafetyChecker(cluster)
    seen: dict[int, list[ev.Event]] = {}

    def on_event(sm: SimMember, event: ev.Event) -> None:
        if isinstance(event, (ev.JobStopped, ev.WaitingForSpare, ev.RankAssigned)):
            seen.setdefault(sm.index, []).append(event)

    cluster.listeners.append(on_event)
    plans = ready_plans(cluster)
    ranks = [cluster.by_id[m] for m in cluster.configuration.ranks]
    for sm in ranks:
        cluster.at(10.0, lambda sm=sm: cluster.crash(sm))
    cluster.run(30.0)
    spares = [sm for sm in cluster.members if sm not in ranks]
    assert len(spares) == 3
    for sm in spares:
        [stopped] = seen[sm.index]
        assert isinstance(stopped, ev.JobStopped)
        assert (stopped.config_id, stopped.vacant) == (1, (0, 1))
        plan = plans[1][sm.index].plan
        assert (plan.action, plan.assignments, plan.resume_step) == ("stop", (), 0)
    assert safety.violations == []
