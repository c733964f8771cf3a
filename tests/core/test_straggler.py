"""The straggler rule, exactly: a lag behind the first arrival above
max(min_lag_s, (factor - 1) x the others' median compute) at hits of the last window steps."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpass_p2p.core.straggler import (
    Arrival,
    StragglerCleared,
    StragglerDetector,
    StragglerNamed,
    _median_without,
)

DATA = Path(__file__).with_name("data")
MEMBERS = (0xA, 0xB, 0xC, 0xD)
COLLECTIVE_S = 0.0078125


def step(late_s: dict[int, float], compute_s: float = 0.25) -> dict[int, Arrival]:
    """Four ranks that open the step together and work ``compute_s``; ``late_s[m]`` more for
    member ``m``. Each waits from its arrival until the last arrival plus the collective."""
    arrive = {m: compute_s + late_s.get(m, 0.0) for m in MEMBERS}
    end = max(arrive.values()) + COLLECTIVE_S
    return {m: Arrival(rank, arrive[m], end - arrive[m]) for rank, m in enumerate(MEMBERS)}


SLOW = {0xC: 0.5}
FAST: dict[int, float] = {}


def test_named_at_the_hits_th_slow_step_with_its_lag() -> None:
    det = StragglerDetector(window=4, hits=3)
    assert det.observe(0, step(SLOW)) == ()
    assert det.observe(1, step(FAST)) == ()
    assert det.observe(2, step(SLOW)) == ()
    assert det.slow_steps(0xC) == 2
    assert det.observe(3, step(SLOW)) == (StragglerNamed(
        0xC, 2, 3, 0.5,
        "arrived 0.500 s after the first rank (median) at 3 of its last 4 steps; "
        "threshold 0.125 s"),)
    assert det.observe(4, step(SLOW)) == ()  # named once
    assert det.named.keys() == {0xC}
    assert all(det.slow_steps(m) == 0 for m in (0xA, 0xB, 0xD))


def test_cleared_only_at_window_minus_hits_slow_steps_then_named_again() -> None:
    det = StragglerDetector(window=4, hits=3)
    for k in range(3):
        det.observe(k, step(SLOW))
    assert det.named.keys() == {0xC}
    assert det.observe(3, step(FAST)) == ()  # 3 of 4 slow: still named
    assert det.observe(4, step(FAST)) == ()  # 2 of 4
    assert det.observe(5, step(FAST)) == (
        StragglerCleared(0xC, 2, 5, "slow at 1 of its last 4 steps"),)
    assert det.named == {}
    assert det.observe(6, step(SLOW)) == ()
    assert det.observe(7, step(SLOW)) == ()
    assert [v.step for v in det.observe(8, step(SLOW))] == [8]  # 3 of 4 again


def test_a_lag_at_the_threshold_is_not_slow_and_the_floor_holds_for_short_steps() -> None:
    det = StragglerDetector(window=1, hits=1)
    # (factor - 1) x median compute of the others = 0.5 x 0.25 = 0.125 s
    assert det.observe(0, step({0xC: 0.125})) == ()
    assert [v.member for v in det.observe(1, step({0xC: 0.1251}))] == [0xC]
    short = StragglerDetector(window=1, hits=1, min_lag_s=0.05)
    # 0.5 x 0.01 s = 5 ms: the floor of 50 ms decides
    assert short.observe(0, step({0xC: 0.05}, compute_s=0.01)) == ()
    assert [v.member for v in short.observe(1, step({0xC: 0.0501}, compute_s=0.01))] == [0xC]


def test_lags_are_durations_only_so_host_clocks_may_differ() -> None:
    """Each rank's figures are differences of its own clock's readings: shifting one host's
    clock by hours changes no input, and the lags are the true arrival offsets."""
    offsets = {0xA: 0.0, 0xB: 3600.0, 0xC: -7.5, 0xD: 1e6}  # each host's clock error
    truth = {0xA: 0.0, 0xB: 0.125, 0xC: 0.5, 0xD: 0.0625}  # true arrival after the first
    opened, end = 10.0, 10.0 + 0.25 + 0.5 + COLLECTIVE_S
    arrivals = {}
    for rank, m in enumerate(MEMBERS):
        read = offsets[m]  # what this host's clock adds to every reading
        arrived = (opened + 0.25 + truth[m]) + read
        arrivals[m] = Arrival(rank, arrived - (opened + read), (end + read) - arrived)
    lags = StragglerDetector().lags(arrivals)
    assert lags == pytest.approx(truth, abs=1e-6)


def test_a_member_missing_from_a_step_is_forgotten_and_cleared() -> None:
    det = StragglerDetector(window=2, hits=2)
    det.observe(0, step(SLOW))
    det.observe(1, step(SLOW))
    assert det.named.keys() == {0xC}
    without = {m: a for m, a in step(FAST).items() if m != 0xC}
    assert det.observe(2, without) == (StragglerCleared(0xC, 2, 2, "left the world"),)
    assert det.slow_steps(0xC) == 0
    assert det.observe(3, step(SLOW)) == ()  # starts over


def test_reset_clears_every_named_member_in_order() -> None:
    det = StragglerDetector(window=1, hits=1)
    det.observe(0, step({0xD: 0.5, 0xB: 0.5}))
    assert det.reset(1, "new group") == (StragglerCleared(0xB, 1, 1, "new group"),
                                         StragglerCleared(0xD, 3, 1, "new group"))
    assert det.named == {} and det.slow_steps(0xB) == 0


def test_one_rank_decides_nothing() -> None:
    det = StragglerDetector(window=1, hits=1)
    assert det.observe(0, {0xA: Arrival(0, 0.25, 0.0)}) == ()


def test_bad_parameters_are_local_misuse() -> None:
    for kwargs in ({"factor": 1.0}, {"min_lag_s": -0.1}, {"window": 0},
                   {"window": 10, "hits": 5}, {"window": 10, "hits": 11}):
        with pytest.raises(ValueError):
            StragglerDetector(**kwargs)  # type: ignore[arg-type]


def noisy_step(rng: random.Random, n: int, late_s: dict[int, float]) -> dict[int, Arrival]:
    """``n`` ranks of a healthy job on shared cores: 30 ms of work each, +-20 % jitter, and
    at 2 % of (rank, step) a pause of 10-40 ms (a garbage collection, a descheduled thread);
    ``late_s[r]`` more for rank ``r``. Collective completions spread by up to 1 ms."""
    arrive = []
    for r in range(n):
        t = 0.030 * rng.uniform(0.8, 1.2) + late_s.get(r, 0.0)
        if rng.random() < 0.02:
            t += rng.uniform(0.010, 0.040)
        arrive.append(t)
    end = max(arrive) + 0.002
    return {r: Arrival(r, arrive[r], end + rng.uniform(0.0, 0.001) - arrive[r])
            for r in range(n)}


@pytest.mark.parametrize("seed", range(10))
def test_nobody_is_named_in_1000_noisy_fault_free_steps(seed: int) -> None:
    rng = random.Random(seed)
    det = StragglerDetector()
    verdicts = [v for k in range(1000) for v in det.observe(k, noisy_step(rng, 4, {}))]
    assert verdicts == []


@pytest.mark.parametrize("seed", range(10))
def test_a_rank_200_ms_late_every_step_is_named_within_8_steps(seed: int) -> None:
    rng = random.Random(seed)
    det = StragglerDetector()
    for k in range(20):
        verdicts = det.observe(k, noisy_step(rng, 4, {1: 0.2}))
        if verdicts:
            break
    [named] = verdicts
    assert isinstance(named, StragglerNamed)
    assert (named.member, named.rank, named.step) == (1, 1, 7)
    assert named.lag_s == pytest.approx(0.2, abs=0.015)


def replay(name: str, det: StragglerDetector) -> list[object]:
    """Feed a recorded run's figures (``tests/core/data``) to ``det``; its verdicts."""
    steps = json.loads((DATA / name).read_text())["steps"]
    return [v for k, figures in enumerate(steps)
            for v in det.observe(k, {r: Arrival(r, c, w) for r, (c, w) in enumerate(figures)})]


def test_a_recorded_fault_free_run_of_1000_steps_names_nobody() -> None:
    assert replay("arrivals_fault_free.json", StragglerDetector()) == []
    # The floor is what holds it: at 40 ms the rule names a rank that was merely descheduled
    # for a while on the shared cores (docs/stragglers.md).
    assert [(v.rank, v.step) for v in replay("arrivals_fault_free.json",
                                             StragglerDetector(min_lag_s=0.03))] == [
        (2, 133), (2, 142)]


def test_a_recorded_rank_sleeping_200_ms_before_each_backward_is_named_at_step_7() -> None:
    [named] = replay("arrivals_rank1_sleeps.json", StragglerDetector())
    assert isinstance(named, StragglerNamed)
    assert (named.member, named.rank, named.step) == (1, 1, 7)
    assert named.lag_s == pytest.approx(0.2054, abs=1e-4)


@given(st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=2, max_size=40), st.data())
def test_median_without_matches_the_definition(values: list[float], data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(values) - 1))
    others = values[:i] + values[i + 1:]
    assert _median_without(sorted(values), values[i]) == statistics.median(others)
