"""Pulses in the simulator (sims/cluster.py ``pulse=True``): every member runs the agent's pulse
tracker against its subjects over the virtual network.

Must hold, over seeds: a stopped (SIGSTOP) rank is removed in well under a second, against the
3.1 s floor a stalled loop is owed without pulses (``Params.refutation_window_s``); scenario S01
(busy members, loops blocked up to 3 s) still removes nobody, and nobody even finds a busy
member silent; a one-way isolated rank (S06) is the only one replaced, and its own silent
subjects (it hears no pong) are withheld, so it accuses nobody. Times are virtual.
"""

from __future__ import annotations

import pytest

from sims.cluster import Cluster, SimMember
from sims.faults import FaultInjector
from sims.invariants import InvariantChecker
from sims.network import LinkModel
from sims.recorder import DetectionRecorder
from tests.sims.test_s01_busy_members import (
    CI_HORIZON_S,
    SCENARIO_CHUNK_S,
    assert_s01_holds,
    run_s01,
)
from torchpass_p2p.core.params import Params

FAULT_AT_S = 10.0
FLOOR_S = Params().round_timeout_s + Params().probe_interval_s + Params().refutation_window_s


def stopped_rank(seed: int, *, pulse: bool) -> tuple[Cluster, SimMember, DetectionRecorder,
                                                      InvariantChecker]:
    """16 ranks + 2 spares at 1 % loss; one rank SIGSTOPped at 10 s for 20 s, run to 40 s."""
    cluster = Cluster(18, spares=2, seed=seed, link=LinkModel(loss=0.01), keep_events=False,
                      pulse=pulse)
    recorder = DetectionRecorder(cluster)
    checker = InvariantChecker(cluster, recorder)
    ranks = cluster.configuration.ranks
    victim = cluster.by_id[ranks[cluster.rng.randrange(len(ranks))]]
    FaultInjector(cluster, recorder).stop(victim, FAULT_AT_S, 20.0)
    cluster.run(40.0)
    return cluster, victim, recorder, checker


@pytest.mark.parametrize("seed", range(6))
def test_a_stopped_rank_is_removed_in_under_a_second_with_pulses(seed: int) -> None:
    cluster, victim, recorder, checker = stopped_rank(seed, pulse=True)
    decided = recorder.faults[victim.id].all_decided_s(recorder.live_ids())
    # Three missed 0.1 s pings (0.3-0.4 s), silent alerts, exit_settle_s (0.2 s), a fast round.
    assert decided is not None and decided < 1.0
    assert victim.core.removed  # it learned so on waking (S03), and exactly one change ran
    assert {sm.core.configuration.config_id for sm in cluster.live()} == {1}
    assert recorder.false_removals == {}
    observers = cluster.configuration.observers_of(victim.id)
    assert sum(cluster.by_id[o].core.counters["silences_reported"] for o in observers) >= 1
    assert checker.violations == [] and checker.check_end() == []


@pytest.mark.parametrize("seed", range(3))
def test_without_pulses_the_same_stop_waits_out_the_refutation_window(seed: int) -> None:
    cluster, victim, recorder, checker = stopped_rank(seed, pulse=False)
    decided = recorder.faults[victim.id].all_decided_s(recorder.live_ids())
    assert decided is not None and decided >= FLOOR_S
    assert all(sm.core.counters["silences_reported"] == 0 for sm in cluster.members)
    assert checker.violations == []


@pytest.mark.parametrize("seed", [0, 1])
def test_s01_busy_members_with_pulses_nobody_is_removed_or_found_silent(seed: int) -> None:
    result = run_s01(seed, CI_HORIZON_S, SCENARIO_CHUNK_S, pulse=True)
    assert_s01_holds(result)
    assert result.convictions  # the blocks are long enough to reach the verdicts...
    members = result.busy + result.healthy
    assert sum(sm.core.counters["silences_reported"] for sm in members) == 0  # ...not silence
    assert all(sm.pulse is not None and sm.pulse.counters["pongs"] > 0 for sm in members)


@pytest.mark.parametrize("direction", ["deaf", "mute"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_s06_with_pulses_only_the_one_way_rank_is_replaced_and_it_accuses_nobody(
        seed: int, direction: str) -> None:
    cluster = Cluster(14, spares=2, seed=seed, link=LinkModel(loss=0.01), keep_events=False,
                      pulse=True)
    recorder = DetectionRecorder(cluster)
    checker = InvariantChecker(cluster, recorder)
    ranks = cluster.configuration.ranks
    victim = cluster.by_id[ranks[cluster.rng.randrange(len(ranks))]]
    FaultInjector(cluster, recorder).one_way(victim, 30.0, direction)
    cluster.run(60.0)
    assert recorder.false_removals == {}
    assert not any(sm.core.removed for sm in cluster.members if sm is not victim)
    decided = recorder.faults[victim.id].all_decided_s(recorder.live_ids())
    assert decided is not None and decided < 1.0
    assert victim.core.counters["alerts_raised"] == 0
    assert victim.core.counters["silences_reported"] == 0
    # It heard no pong from anyone (deaf: none arrive; mute: its pings never leave): every
    # silence it saw was withheld, for its probes to judge (and they suspect itself).
    assert victim.pulse is not None and victim.pulse.counters["silences_withheld"] > 0
    assert checker.violations == [] and checker.check_end() == []
