"""The straggler rule, exactly: compute > factor x the others' median for N consecutive steps."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpass_p2p.core.straggler import StragglerDetector, StragglerFlag, _median_without

HEALTHY = {1: 1.0, 2: 1.02, 3: 0.98, 4: 1.01}


def step_times(slow_s: float) -> dict[int, float]:
    return {**HEALTHY, 9: slow_s}


def test_flags_after_exactly_n_consecutive_slow_steps() -> None:
    det = StragglerDetector(factor=1.5, steps=3)
    assert det.observe(0, step_times(1.6)) == ()
    assert det.observe(1, step_times(1.6)) == ()
    [flag] = det.observe(2, step_times(1.6))
    assert flag == StragglerFlag(
        9, 2, pytest.approx(1.6 / 1.005),
        "compute 1.600 s > 1.5 x others' median 1.005 s for 3 consecutive steps")
    assert det.observe(3, step_times(1.6)) == ()  # flagged once per slow run
    assert det.flagged.keys() == {9}


def test_one_normal_step_restarts_the_count_and_clears_the_flag() -> None:
    det = StragglerDetector(factor=1.5, steps=3)
    for step in range(2):
        det.observe(step, step_times(2.0))
    det.observe(2, step_times(1.2))
    assert det.streak(9) == 0
    assert det.observe(3, step_times(2.0)) == ()
    assert det.observe(4, step_times(2.0)) == ()
    assert [f.step for f in det.observe(5, step_times(2.0))] == [5]
    det.observe(6, step_times(1.0))
    assert det.flagged == {}
    for step in range(7, 9):
        assert det.observe(step, step_times(2.0)) == ()
    assert [f.step for f in det.observe(9, step_times(2.0))] == [9]  # flagged again


def test_exactly_factor_times_the_median_is_not_slow() -> None:
    det = StragglerDetector(factor=1.5, steps=1)
    assert det.observe(0, {1: 1.0, 2: 1.0, 3: 1.5}) == ()
    assert [f.member for f in det.observe(1, {1: 1.0, 2: 1.0, 3: 1.5001})] == [3]


def test_a_member_missing_from_a_step_is_forgotten() -> None:
    det = StragglerDetector(factor=1.5, steps=2)
    det.observe(0, step_times(3.0))
    det.observe(1, HEALTHY)  # rank 9's member left the world
    assert det.streak(9) == 0
    assert det.observe(2, step_times(3.0)) == ()


def test_two_ranks_compare_with_each_other_and_one_rank_decides_nothing() -> None:
    det = StragglerDetector(factor=1.5, steps=1)
    assert det.observe(0, {1: 5.0}) == ()
    assert [f.member for f in det.observe(1, {1: 1.0, 2: 2.0})] == [2]
    assert det.observe(2, {1: 0.0, 2: 0.0}) == ()  # a zero median decides nothing


def test_flags_come_in_member_order() -> None:
    det = StragglerDetector(factor=1.5, steps=1)
    times = {7: 3.0, 1: 1.0, 2: 1.0, 3: 1.0, 5: 3.0, 4: 1.0}
    assert [f.member for f in det.observe(0, times)] == [5, 7]


def test_bad_parameters_are_local_misuse() -> None:
    with pytest.raises(ValueError):
        StragglerDetector(factor=1.0)
    with pytest.raises(ValueError):
        StragglerDetector(steps=0)


@given(st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=2, max_size=40), st.data())
def test_median_without_matches_the_definition(values: list[float], data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(values) - 1))
    others = values[:i] + values[i + 1:]
    assert _median_without(sorted(values), values[i]) == statistics.median(others)
