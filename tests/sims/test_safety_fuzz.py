"""Agreement safety under seeded faults (issue 4): the CI-sized part of benchmarks/safety_fuzz.py.

The long run (at least 10,000 seeds, 8..24 members, 40 + 20 virtual seconds each) is
``python -m benchmarks.safety_fuzz --seeds 10000 --jobs 2``. Here: 300 seeds of the same
:func:`sims.safety_runs.safety_run` on smaller clusters (8..14 members) and a shorter window
(24 + 14 virtual seconds), in 30 tests of 10 seeds, so a failing batch names its seeds; then a few
deterministic cases the fuzzer only hits by chance.
"""

from __future__ import annotations

import pytest

from sims.cluster import Cluster, SimMember
from sims.invariants import InvariantChecker
from sims.safety import SafetyChecker
from sims.safety_runs import FAULT_KINDS, SafetyResult, _Cut, _Decision, _SafetyRun, safety_run
from torchpass_p2p.core import MemberId
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.agreement import fast_quorum

CI_MEMBERS = (8, 14)
CI_WINDOW_S = 24.0
CI_SETTLE_S = 14.0
BATCHES = 30
BATCH_SEEDS = 10

def _ci_run(seed: int) -> SafetyResult:
    return safety_run(seed, members_range=CI_MEMBERS, fault_window_s=CI_WINDOW_S,
                      settle_s=CI_SETTLE_S)


def _describe(r: SafetyResult) -> str:
    return (f"seed {r.seed} ({r.members} members, {r.spares} spares, loss {r.loss}, dup "
            f"{r.duplicate}): {r.safety_violations} safety, {r.invariant_violations} invariant "
            f"violations\n  " + "\n  ".join(r.violations[:5]) + "\n  faults:\n    "
            + "\n    ".join(r.faults))


@pytest.mark.parametrize("batch", range(BATCHES))
def test_safety_over_seeds(batch: int) -> None:
    seeds = range(batch * BATCH_SEEDS, (batch + 1) * BATCH_SEEDS)
    bad = []
    for seed in seeds:
        r = _ci_run(seed)
        assert r.seed == seed
        if r.safety_violations != 0 or r.invariant_violations != 0:
            bad.append(_describe(r))
    assert not bad, "\n".join(bad)


def test_a_suspicion_is_judged_by_the_rings_of_the_new_configuration() -> None:
    """Seed 24 of the long run (10 members): #5 begins suspecting crashed #0 in configuration 2,
    where #0 has 2 observers; in configuration 4 it has 3 (#1, #5, #9). A suspicion carried
    across the change is judged by the new rings: Member._rebase_suspicion drops alerts from
    former observers and re-derives the timeout, so #5 cannot convict #0 on 2 alerts under the
    old observer count and timer. The CI seeds 34, 63, 84, 126 and 181 take the same path."""
    r = safety_run(24)
    assert r.safety_violations == 0
    assert r.invariant_violations == 0, r.violations


def test_an_alert_from_a_former_observer_never_reaches_its_subject_seed_1165() -> None:
    """Seed 1165 of the long run: a probe round that outlives a configuration change fails,
    and its own observer's _merge_alert rejects its alert (it is no longer an observer). Rounds
    to former subjects are dropped at the change, and an alert goes out only if its observer
    accepted it: else the subject would refute an alert nobody raised."""
    r = safety_run(1165)
    assert r.safety_violations == 0
    assert r.invariant_violations == 0, r.violations


@pytest.mark.parametrize("seed", [5724, 6327])
def test_verdicts_taken_without_a_majority_remove_nobody_after_the_heal(seed: int) -> None:
    """Seeds of the long run where a partition's minority convicted members of the majority
    it could not reach, then, back among the majority (kept in the next configuration, or
    learning it), proposed removing them: 6 healthy members were removed in seed 5724, and the
    rest crashed later, leaving nobody. A verdict taken while its member counted fewer than a
    majority reachable grounds no cut of that member's (``Member._judge_verdict``), and goes to its
    subject once the member reaches a majority again, so the subject refutes it."""
    r = safety_run(seed)
    assert (r.safety_violations, r.invariant_violations) == (0, 0), r.violations
    assert not r.majority_lost
    assert r.converged and r.final_config_ids, _describe(r)


@pytest.mark.parametrize("seed", [2595, 2775])
def test_verdicts_about_members_a_majority_kept_remove_nobody(seed: int) -> None:
    """Seeds of the long run where members of a partition's minority took verdicts about the
    majority while their views still counted a majority reachable (a member of the other side
    that none of theirs observes stays unsuspected), so the verdicts were not marked as taken
    without one, and their gossip ran out before the heal. In seed 2775 (23 members, 12|11)
    one of them, kept by the majority's next configurations, coordinated a classic round
    removing 7 healthy members of 13 (acceptors accept a coordinator's value, their own
    removal included); the rest crashed later, leaving nobody. In seed 2595 (11 members, 6|5)
    a minority member held every other member dead, so it neither probed nor synced with
    anyone and never learned the change that removed it. A change that keeps a member held
    dead sends it the verdict, which it refutes (``Member._send_kept_verdicts``); a view that
    counts fewer than a majority reachable syncs with any member (``Member._start_sync``) and
    proposes nothing as a coordinator (``Reconfiguration._view_holds_majority``)."""
    r = safety_run(seed)
    assert (r.safety_violations, r.invariant_violations) == (0, 0), r.violations
    assert not r.majority_lost
    assert r.converged and r.final_config_ids, _describe(r)


def test_a_seed_replays_exactly() -> None:
    a = safety_run(3, members_range=CI_MEMBERS, fault_window_s=CI_WINDOW_S, settle_s=CI_SETTLE_S)
    b = safety_run(3, members_range=CI_MEMBERS, fault_window_s=CI_WINDOW_S, settle_s=CI_SETTLE_S)
    assert (a.faults, a.decisions, a.events, a.final_config_ids) == (
        b.faults, b.decisions, b.events, b.final_config_ids)
    assert a.faults  # something happened


def test_every_fault_kind_fires() -> None:
    seen: set[str] = set()
    for seed in range(8):  # whether a vote-timed crash fires in a run depends on the seed
        r = safety_run(seed, members=12, kinds=FAULT_KINDS, fault_window_s=30.0, settle_s=10.0)
        assert r.ok, _describe(r)
        seen.update(f.split()[1] for f in r.faults)
        if (seen & {"crash_at_first_vote", "crash_at_first_decision"}
                and "crash_promoted_spare" in seen and len(seen) >= 9):
            break
    assert {"crash_many", "crash_rank_holder", "crash_before_agreement", "halves", "one_way",
            "flap", "heal_all"} <= seen
    assert seen & {"crash_at_first_vote", "crash_at_first_decision"}
    assert "crash_promoted_spare" in seen


def test_minority_check_catches_a_lone_decision() -> None:
    """The [minority-decided] rule itself: a decision made only on a minority side is flagged,
    the same decision also made off that side is not."""
    run = _SafetyRun(0, 8, CI_MEMBERS, CI_WINDOW_S, CI_SETTLE_S, ("halves",))
    ids = [sm.id for sm in run.cluster.members]
    run.cuts.append(_Cut(1.0, (frozenset(ids[:3]), frozenset(ids[3:])), (True, False), 5.0))
    plan = object.__new__(type("P", (), {"hash": 7, "removed": (), "joined": ()}))
    run.watch.decisions.append(_Decision(ids[0], 2.0, 1, plan))  # type: ignore[arg-type]
    assert [v.split()[0] for v in run.check_sides()] == ["[minority-decided]"]
    run.watch.decisions.append(_Decision(ids[5], 9.0, 1, plan))  # type: ignore[arg-type]
    assert run.check_sides() == []


def test_minority_check_allows_learning_during_a_cut_what_was_decided_before_it() -> None:
    """Seed 8725 of the 10,000-seed run: a member decided config 3 before a cut, the member it
    removes learned it during the cut on the same side; the rule flagged that until it looked
    at when the decision was first made."""
    run = _SafetyRun(0, 8, CI_MEMBERS, CI_WINDOW_S, CI_SETTLE_S, ("halves",))
    ids = [sm.id for sm in run.cluster.members]
    run.cuts.append(_Cut(1.0, (frozenset(ids[:3]), frozenset(ids[3:])), (True, False), 5.0))
    plan = object.__new__(type("P", (), {"hash": 7, "removed": (), "joined": ()}))
    run.watch.decisions.append(_Decision(ids[1], 0.5, 1, plan))  # type: ignore[arg-type]
    run.watch.decisions.append(_Decision(ids[0], 2.0, 1, plan))  # type: ignore[arg-type]
    assert run.check_sides() == []
    assert safety_run(8725).safety_violations == 0


# ---------------------------------------------------------------------- deterministic cases


def _decisions(cluster: Cluster) -> list[tuple[SimMember, ev.ConfigurationDecided]]:
    out: list[tuple[SimMember, ev.ConfigurationDecided]] = []

    def on(sm: SimMember, event: ev.Event) -> None:
        if isinstance(event, ev.ConfigurationDecided):
            out.append((sm, event))

    cluster.listeners.append(on)
    return out


def _ten_crashes(members: int, seed: int) -> tuple[Cluster, SafetyChecker, list[MemberId]]:
    cluster = Cluster(members, spares=10, seed=seed, keep_events=False)
    safety = SafetyChecker(cluster)
    invariants = InvariantChecker(cluster)
    victims = cluster.rng.sample(cluster.members, 10)
    for i, sm in enumerate(victims):
        cluster.at(5.0 + 0.001 * i, lambda sm=sm: cluster.crash(sm))
    cluster.run(25.0)
    assert safety.ok, safety.violations
    assert invariants.ok, invariants.violations
    return cluster, safety, [sm.id for sm in victims]


def _assert_one_change_removing(cluster: Cluster, safety: SafetyChecker,
                                victims: list[MemberId]) -> None:
    assert list(safety.first_round) == [1], safety.first_round
    live = cluster.live()
    assert {sm.core.configuration.config_id for sm in live} == {1}
    plan = live[0].core.plan
    assert plan is not None and sorted(plan.removed) == sorted(victims)


def test_ten_simultaneous_crashes_in_32_are_one_change() -> None:
    """Ten crashes within 10 ms in 32 members: one decision removes all ten. It cannot be the
    fast path: 22 survivors are fewer than the fast quorum of 32 (25, Rapid's
    N - floor((N - 1) / 4) tolerates 7 missing votes), so a classic round decides. Seed 0; some
    seeds split the ten into two changes (cut detection settles on 8 before the last 2 reach L
    alerts on some members), which is allowed."""
    assert fast_quorum(32) == 25
    cluster, safety, victims = _ten_crashes(32, seed=0)
    _assert_one_change_removing(cluster, safety, victims)
    assert safety.first_round[1] >= 1  # classic
    assert safety.fast_path_fraction() == 0.0


def test_ten_simultaneous_crashes_in_48_are_one_fast_change() -> None:
    """With 48 members the 38 survivors reach the fast quorum (37): one fast decision."""
    assert fast_quorum(48) == 37
    cluster, safety, victims = _ten_crashes(48, seed=0)
    _assert_one_change_removing(cluster, safety, victims)
    assert safety.first_round[1] == 0
    assert safety.fast_path_fraction() == 1.0


def test_partition_4_6_only_the_majority_decides() -> None:
    """10 members cut 4 | 6 for 20 s: the 6 side (a majority, not a fast quorum) decides
    configurations without the 4; the 4 side decides nothing while cut."""
    cluster = Cluster(10, spares=2, seed=0, keep_events=False)
    safety = SafetyChecker(cluster)
    invariants = InvariantChecker(cluster)
    decided = _decisions(cluster)
    small, big = cluster.members[:4], cluster.members[4:]
    cut_at, heal_at = 5.0, 25.0
    cluster.at(cut_at, lambda: cluster.network.partition([sm.id for sm in small],
                                                         [sm.id for sm in big]))
    cluster.run(heal_at)
    assert not [(sm.index, e.at) for sm, e in decided if sm in small]
    by_big = [e for sm, e in decided if sm in big]
    assert by_big
    assert all(e.round >= 1 for e in by_big)  # 6 of 10 is below the fast quorum (8)
    newest = max(by_big, key=lambda e: e.configuration.config_id).configuration
    assert not any(sm.id in newest for sm in small)
    assert all(sm.core.configuration == newest for sm in big)
    cluster.network.heal()
    cluster.run(heal_at + 40.0)
    assert safety.ok, safety.violations
    assert invariants.ok, invariants.violations
    assert all(sm.core.removed for sm in small)  # each learned it lost, after the heal


def test_spare_crashing_as_it_is_promoted_is_replaced_by_the_next_spare() -> None:
    cluster = Cluster(12, spares=3, seed=0, keep_events=False)
    safety = SafetyChecker(cluster)
    invariants = InvariantChecker(cluster)
    start = cluster.configuration
    victim = next(sm for sm in cluster.members if start.rank_of(sm.id) is not None)
    rank = start.rank_of(victim.id)
    assigned: list[tuple[SimMember, ev.RankAssigned]] = []

    def on(sm: SimMember, event: ev.Event) -> None:
        if isinstance(event, ev.RankAssigned):
            assigned.append((sm, event))
            if len(assigned) == 1:  # crash it once its events are drained
                cluster.at(cluster.now, lambda: cluster.crash(sm))

    cluster.listeners.append(on)
    cluster.at(5.0, lambda: cluster.crash(victim))
    cluster.run(30.0)
    assert safety.ok, safety.violations
    assert invariants.ok, invariants.violations
    assert [(e.rank, e.config_id) for _, e in assigned] == [(rank, 1), (rank, 2)]
    first, second = assigned[0][0], assigned[1][0]
    assert first.id in start.spares and second.id in start.spares and first is not second
    live = cluster.live()
    assert {sm.core.configuration.config_id for sm in live} == {2}
    final = live[0].core.configuration
    assert final.ranks[rank] == second.id
    assert first.id not in final and victim.id not in final
