"""The invariant checker: each rule catches a fabricated violation, and real runs break none.

Fabricated events go through the same listener interface the cluster uses (``listener(sm,
event)``), so the checker cannot tell them from real ones.
"""

from __future__ import annotations

import pytest

from sims.cluster import Cluster, SimMember
from sims.faults import FaultInjector
from sims.invariants import InvariantChecker
from sims.network import LinkModel
from sims.recorder import DetectionRecorder
from sims.scenario import run_scenario, scenario_from_mapping
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.messages import Cut
from torchpass_p2p.core.plan import Policy, next_configuration


def rules(checker: InvariantChecker) -> set[str]:
    return {v[1:v.index("]")] for v in checker.violations}


@pytest.fixture
def fleet() -> tuple[Cluster, InvariantChecker]:
    cluster = Cluster(12, seed=1)
    return cluster, InvariantChecker(cluster)


def feed(cluster: Cluster, sm: SimMember, event: ev.Event) -> None:
    for listener in cluster.listeners:
        listener(sm, event)


def subject_and_observers(cluster: Cluster) -> tuple[SimMember, list[SimMember], SimMember]:
    """A subject, its observers, and a member that observes it not."""
    subject = cluster.members[0]
    observers = [cluster.by_id[m] for m in cluster.configuration.observers_of(subject.id)]
    outsider = next(sm for sm in cluster.members[1:] if sm not in observers)
    return subject, observers, outsider


def decided_without(cluster: Cluster, member: SimMember, at: float) -> ev.ConfigurationDecided:
    """The decision event of the configuration after 0 that drops ``member``."""
    config, plan, _ = next_configuration(cluster.configuration, Cut(removed=(member.id,)),
                                         policy=Policy.WAIT)
    return ev.ConfigurationDecided(at, config, 0, len(cluster.configuration), plan)


def accuse(cluster: Cluster, subject: SimMember, observers: list[SimMember], at: float,
           inc: int = 0) -> None:
    """Each observer raises its own alert; the first one then holds all of them."""
    for obs in observers:
        feed(cluster, obs, ev.MemberSuspected(at, subject.id, inc, obs.id))
        feed(cluster, obs, ev.AlertRaised(at, obs.id, subject.id, inc))
    first = observers[0]
    for obs in observers[1:]:
        feed(cluster, first, ev.AlertRaised(at, obs.id, subject.id, inc))


# ---------------------------------------------------------------- a lawful sequence passes


def test_lawful_conviction_removal_and_refutation_pass(fleet) -> None:
    cluster, checker = fleet
    subject, observers, outsider = subject_and_observers(cluster)
    accuse(cluster, subject, observers[:3], at=1.0)
    confirmer = observers[0]
    feed(cluster, confirmer, ev.MemberDead(2.0, subject.id, 0, confirmer.id))
    feed(cluster, outsider, ev.MemberDead(2.1, subject.id, 0, confirmer.id))
    feed(cluster, subject, decided_without(cluster, subject, 2.2))
    feed(cluster, subject, ev.SelfRemoved(2.2, 0))
    other = cluster.members[5]
    other_obs = cluster.by_id[cluster.configuration.observers_of(other.id)[0]]
    feed(cluster, other_obs, ev.MemberSuspected(3.0, other.id, 0, other_obs.id))
    feed(cluster, other_obs, ev.AlertRaised(3.0, other_obs.id, other.id, 0))
    other.core.incarnation = 1  # what the real core does as it refutes
    feed(cluster, other, ev.SelfRefuted(3.1, 1))
    feed(cluster, other_obs, ev.MemberAlive(3.2, other.id, 1))
    assert checker.violations == []
    assert checker.events == 3 * 2 + 2 + 4 + 2 + 2


# ---------------------------------------------------------------- each rule catches its violation


def test_crashed_or_blocked_member_must_be_silent(fleet) -> None:
    cluster, checker = fleet
    crashed, blocked = cluster.members[1], cluster.members[2]
    cluster.crash(crashed)
    feed(cluster, crashed, ev.SelfSuspected(0.0))
    cluster.block(blocked, 3.0)
    feed(cluster, blocked, ev.SelfSuspected(0.0))
    assert checker.count == 2
    assert rules(checker) == {"silent-when-crashed"}
    assert "#1 crashed" in checker.violations[0]
    assert "#2 blocked until 3.000" in checker.violations[1]


def test_removed_member_must_be_silent(fleet) -> None:
    cluster, checker = fleet
    subject, observers, _ = subject_and_observers(cluster)
    accuse(cluster, subject, observers[:3], at=1.0)
    feed(cluster, observers[0], ev.MemberDead(2.0, subject.id, 0, observers[0].id))
    feed(cluster, subject, decided_without(cluster, subject, 2.5))
    feed(cluster, subject, ev.SelfRemoved(2.5, 0))
    assert checker.ok
    feed(cluster, subject, ev.SelfSuspected(3.0))
    assert rules(checker) == {"silent-after-removal"}


def test_refutation_raises_incarnation_by_exactly_one(fleet) -> None:
    cluster, checker = fleet
    subject, observers, _ = subject_and_observers(cluster)
    accuse(cluster, subject, observers[:1], at=1.0)
    subject.core.incarnation = 2
    feed(cluster, subject, ev.SelfRefuted(1.1, 2))  # skipped incarnation 1
    assert rules(checker) == {"refute-by-one", "refute-real-alert"}
    assert "refuted from incarnation 0 to 2" in checker.violations[0]


def test_refutation_must_answer_a_real_alert(fleet) -> None:
    cluster, checker = fleet
    member = cluster.members[3]
    member.core.incarnation = 1
    feed(cluster, member, ev.SelfRefuted(1.0, 1))
    assert rules(checker) == {"refute-real-alert"}


def test_only_the_owner_mints_incarnations(fleet) -> None:
    cluster, checker = fleet
    feed(cluster, cluster.members[1], ev.MemberAlive(1.0, cluster.members[2].id, 5))
    assert rules(checker) == {"minted-by-owner"}
    assert "above its own 0" in checker.violations[0]


def test_view_never_goes_back(fleet) -> None:
    cluster, checker = fleet
    holder, subject = cluster.members[1], cluster.members[2]
    subject.core.incarnation = 3
    feed(cluster, holder, ev.MemberAlive(1.0, subject.id, 2))
    feed(cluster, holder, ev.MemberAlive(1.1, subject.id, 2))  # not news
    feed(cluster, holder, ev.MemberAlive(1.2, subject.id, 1))  # older
    assert checker.count == 2
    assert rules(checker) == {"view-monotone"}


def test_dead_stays_dead_until_a_newer_incarnation_and_left_is_final(fleet) -> None:
    cluster, checker = fleet
    subject, observers, outsider = subject_and_observers(cluster)
    accuse(cluster, subject, observers[:3], at=1.0)
    confirmer = observers[0]
    feed(cluster, confirmer, ev.MemberDead(2.0, subject.id, 0, confirmer.id))
    assert checker.ok
    feed(cluster, confirmer, ev.MemberSuspected(2.5, subject.id, 0, observers[1].id))
    assert rules(checker) == {"dead-until-newer"}
    subject.core.incarnation = 1
    subject.core.left = True
    feed(cluster, outsider, ev.MemberLeft(3.0, subject.id, 1))
    feed(cluster, outsider, ev.MemberAlive(3.1, subject.id, 1))
    assert checker.count == 2
    assert "after it had left" in checker.violations[-1]


def test_alert_only_within_a_suspicion_and_once(fleet) -> None:
    cluster, checker = fleet
    subject, observers, outsider = subject_and_observers(cluster)
    obs = observers[0]
    feed(cluster, obs, ev.AlertRaised(1.0, obs.id, subject.id, 0))  # no MemberSuspected first
    assert rules(checker) == {"alert-in-suspicion"}
    feed(cluster, obs, ev.AlertRaised(1.1, obs.id, subject.id, 0))
    assert checker.count == 3  # outside a suspicion again, and twice
    assert checker.violations[-1].endswith("twice")


def test_alert_from_a_non_observer_is_caught(fleet) -> None:
    cluster, checker = fleet
    subject, _, outsider = subject_and_observers(cluster)
    feed(cluster, outsider, ev.MemberSuspected(1.0, subject.id, 0, outsider.id))
    feed(cluster, outsider, ev.AlertRaised(1.0, outsider.id, subject.id, 0))
    assert rules(checker) == {"alert-by-observer"}


def test_alert_that_its_observer_never_raised_is_caught(fleet) -> None:
    cluster, checker = fleet
    subject, observers, outsider = subject_and_observers(cluster)
    feed(cluster, outsider, ev.MemberSuspected(1.0, subject.id, 0, observers[0].id))
    feed(cluster, outsider, ev.AlertRaised(1.0, observers[0].id, subject.id, 0))
    assert rules(checker) == {"alert-has-origin"}


def test_single_accuser_cannot_convict(fleet) -> None:
    cluster, checker = fleet
    subject, observers, _ = subject_and_observers(cluster)
    accuse(cluster, subject, observers[:1], at=1.0)
    feed(cluster, observers[0], ev.MemberDead(9.0, subject.id, 0, observers[0].id))
    assert rules(checker) == {"quorum"}
    assert "holding alerts from 1 observers" in checker.violations[0]
    assert "needs 3" in checker.violations[0]


def test_conviction_before_the_suspicion_timeout_is_caught(fleet) -> None:
    cluster, checker = fleet
    subject, observers, outsider = subject_and_observers(cluster)
    accuse(cluster, subject, observers[:3], at=1.0)
    feed(cluster, observers[0], ev.MemberDead(1.5, subject.id, 0, observers[0].id))
    assert rules(checker) == {"suspicion-timeout"}
    assert "0.500 s after suspecting it; needs 1.0 s (observer)" in checker.violations[0]


def test_non_observer_convicts_only_after_the_longest_timeout(fleet) -> None:
    cluster, checker = fleet
    subject, observers, outsider = subject_and_observers(cluster)
    accuse(cluster, subject, observers[:3], at=1.0)
    feed(cluster, outsider, ev.MemberSuspected(1.0, subject.id, 0, observers[0].id))
    for obs in observers[:3]:
        feed(cluster, outsider, ev.AlertRaised(1.0, obs.id, subject.id, 0))
    feed(cluster, outsider, ev.MemberDead(3.0, subject.id, 0, outsider.id))
    assert rules(checker) == {"suspicion-timeout"}
    assert "needs 6.0 s (not an observer)" in checker.violations[0]


def test_dead_without_its_confirmers_conviction_is_caught(fleet) -> None:
    cluster, checker = fleet
    subject, observers, outsider = subject_and_observers(cluster)
    feed(cluster, outsider, ev.MemberDead(1.0, subject.id, 0, observers[0].id))
    assert rules(checker) == {"dead-has-origin"}


def test_self_removal_without_a_decision_is_caught(fleet) -> None:
    cluster, checker = fleet
    feed(cluster, cluster.members[4], ev.SelfRemoved(1.0, 0))
    assert rules(checker) == {"removed-by-decision"}


def test_left_names_a_member_that_left(fleet) -> None:
    cluster, checker = fleet
    feed(cluster, cluster.members[1], ev.MemberLeft(1.0, cluster.members[2].id, 0))
    assert rules(checker) == {"left-by-self"}


def test_violations_are_bounded_but_counted() -> None:
    cluster = Cluster(6, seed=2)
    checker = InvariantChecker(cluster, max_kept=3)
    cluster.crash(cluster.members[0])
    for i in range(10):
        feed(cluster, cluster.members[0], ev.SelfSuspected(float(i)))
    assert checker.count == 10
    assert len(checker.violations) == 3


# ---------------------------------------------------------------- check_end


def test_check_end_catches_a_crash_not_yet_known_everywhere() -> None:
    cluster = Cluster(16, seed=4, link=LinkModel(loss=0.01))
    checker = InvariantChecker(cluster)
    victim = cluster.members[5]
    cluster.at(5.0, lambda: cluster.crash(victim))
    cluster.run(5.5)
    found = checker.check_end()
    assert found and {v[1:v.index("]")] for v in found} == {"complete"}
    assert "still holds crashed #5 as ALIVE@0" in found[0]
    cluster.run(30.0)
    assert checker.check_end() == []
    assert checker.count == 15  # every live member, once, from the first check


def test_check_end_catches_views_that_disagree() -> None:
    cluster = Cluster(16, seed=5, link=LinkModel(loss=0.01))
    checker = InvariantChecker(cluster)
    busy = cluster.members[3]
    cluster.at(5.0, lambda: cluster.block(busy, 2.2))  # suspected, then refutes as it wakes
    refuted: list[float] = []
    cluster.listeners.append(
        lambda sm, e: refuted.append(e.at) if type(e) is ev.SelfRefuted else None)
    while not refuted:
        cluster.run(cluster.now + 0.0001)  # stop the moment it refutes: nobody knows yet
    found = checker.check_end()
    assert any(v.startswith("[agree]") and "#3: ALIVE@1 vs SUSPECT@0" in v for v in found), found
    cluster.run(40.0)
    assert checker.check_end() == []


# ---------------------------------------------------------------- real runs break no invariant


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_real_faults_break_no_invariant(seed: int) -> None:
    """Crash, hang, one-way, long pauses (3 s: convicted, then refuted: the zombie path),
    gray loss and a graceful leave, all in one 32-member run at 2 % loss."""
    cluster = Cluster(32, spares=4, seed=seed, link=LinkModel(loss=0.02))
    recorder = DetectionRecorder(cluster)
    checker = InvariantChecker(cluster, recorder)
    faults = FaultInjector(cluster, recorder)
    m = cluster.members
    faults.crash(m[0], 5.0)
    faults.hang(m[1], 8.0)
    faults.one_way(m[2], 11.0, "deaf")
    faults.one_way(m[3], 14.0, "mute")
    faults.busy(m[4], 5.0, 40.0, (2.0, 3.2), 0.5)
    faults.gray(m[5], 5.0, 0.3)
    faults.clog(m[6], 20.0, 1.0)
    cluster.at(25.0, lambda: cluster.leave(m[7]))
    cluster.at(40.0, lambda: cluster.network.member_loss.clear())
    cluster.run(90.0)
    assert checker.violations == []
    assert checker.events > 1_500
    # The run did exercise the paths the rules guard.
    kinds = {type(e) for sm in m for e in sm.events}
    assert {ev.MemberDead, ev.SelfRefuted, ev.MemberLeft, ev.SelfSuspected} <= kinds
    assert checker.check_end() == []


def test_partition_that_heals_converges() -> None:
    cluster = Cluster(24, seed=3, link=LinkModel(loss=0.01))
    checker = InvariantChecker(cluster)
    side_a = [sm.id for sm in cluster.members[:12]]
    side_b = [sm.id for sm in cluster.members[12:]]
    cluster.at(5.0, lambda: cluster.network.partition(side_a, side_b))
    cluster.at(6.2, cluster.network.heal)
    cluster.run(60.0)
    assert checker.violations == []
    assert checker.check_end() == []


def _first_decision_s(seed: int, victim: int, crash_at: float) -> float:
    """When the first member decides a configuration in a bare 10-member cluster (2 spares,
    no loss) where member ``victim`` crashes at ``crash_at``: the same trace a scenario with
    those settings runs (the injector and the selector draw from ``cluster.rng`` only after
    every member's and the network's generator were seeded)."""
    cluster = Cluster(10, spares=2, seed=seed)
    decided: list[float] = []
    cluster.listeners.append(
        lambda sm, e: decided.append(e.at) if type(e) is ev.ConfigurationDecided else None)
    cluster.at(crash_at, lambda: cluster.crash(cluster.members[victim]))
    while not decided:
        cluster.run(cluster.now + 1.0)
    return min(decided)


@pytest.mark.parametrize("seed", range(1, 21))
def test_check_end_reports_members_in_different_configurations(seed: int) -> None:
    """A plain crash stopped just after the first decision, with check_convergence: a member
    in configuration 1 no longer holds the crashed member, and asking it about that member must
    not raise KeyError; the disagreement is reported as a finding."""
    at = _first_decision_s(seed, 3, 2.0)
    data = {"name": "first_decision", "members": 10, "spares": 2, "seed": seed,
            "virtual_s": at, "count_bytes": False, "check_convergence": True,
            "faults": [{"kind": "crash", "member": 3, "at": 2.0}]}
    result = run_scenario(scenario_from_mapping(data))
    found = result["invariant_examples"]
    assert result["decisions"] == 1
    assert {v[1:v.index("]")] for v in found} <= {"agree", "complete"}, found
    outside = ("configuration 1 vs 0; #3: not in its configuration vs",
               "configuration 0 vs 1; #3: DEAD@0 vs not in its configuration")
    assert any(v.startswith("[agree]") and any(text in v for text in outside)
               for v in found), found
    settled = run_scenario(scenario_from_mapping(dict(data, virtual_s=at + 10.0)))
    assert settled["invariant_violations"] == 0, settled["invariant_examples"]
