"""When rank 0 saves: the interval's forms, Young's formula, and the schedule's decisions."""

from __future__ import annotations

import math

import pytest

from torchpass_p2p.checkpoint import CheckpointSettings, Every, Schedule, young_interval_s


@pytest.mark.parametrize(("text", "every"), [
    ("auto", Every()), ("AUTO", Every()), ("200", Every(steps=200)), ("1", Every(steps=1)),
    ("90s", Every(seconds=90.0)), ("15m", Every(seconds=900.0)), ("2h", Every(seconds=7200.0)),
    ("0.5s", Every(seconds=0.5)),
])
def test_every_parses_steps_seconds_and_auto(text: str, every: Every) -> None:
    assert Every.parse(text) == every
    assert Every.parse(str(every)) == every  # what the launcher hands its children


@pytest.mark.parametrize("text", ["0", "0s", "1.5", "-3", "10x", "", "s", "ten"])
def test_every_refuses_anything_else(text: str) -> None:
    with pytest.raises(ValueError):
        Every.parse(text)


def test_young_interval_is_the_square_root_of_twice_cost_times_mtbf() -> None:
    assert young_interval_s(0.5, 3600.0) == 60.0
    assert young_interval_s(0.05, 86400.0) == math.sqrt(8640.0)
    assert young_interval_s(0.0, 10.0) == 0.0
    with pytest.raises(ValueError):
        young_interval_s(1.0, 0.0)


def test_steps_are_due_on_multiples_after_the_start_only() -> None:
    s = Schedule(Every(steps=10), 86400.0, start_step=20, now=0.0)
    due = [k for k in range(0, 61) if s.due(k, now=0.0)]
    assert due == [30, 40, 50, 60]  # never the start step: it is on disk already
    s.started(40, now=1.0)
    assert not s.due(40, now=2.0) and s.due(50, now=2.0)


def test_seconds_are_due_once_the_interval_passed_since_the_last_save() -> None:
    s = Schedule(Every(seconds=30.0), 86400.0, start_step=0, now=100.0)
    assert not s.due(5, now=129.9) and s.due(5, now=130.0)
    s.started(5, now=130.0)
    assert not s.due(9, now=159.0) and s.due(9, now=160.0)


def test_auto_saves_at_the_first_boundary_then_at_youngs_interval() -> None:
    s = Schedule(Every(), 3600.0, start_step=7, now=0.0)
    assert not s.due(7, now=0.0) and s.due(8, now=0.0)
    s.started(8, now=1.0)
    assert s.measured(stage_s=0.5, save_s=2.0) == 60.0
    assert s.measured(stage_s=9.0, save_s=9.0) is None  # measured once
    assert not s.due(50, now=60.9) and s.due(50, now=61.0)


def test_auto_never_saves_more_often_than_a_save_takes() -> None:
    s = Schedule(Every(), 100.0, start_step=0, now=0.0)
    s.started(1, now=0.0)
    assert s.measured(stage_s=0.0005, save_s=3.0) == 3.0  # Young: sqrt(0.1) = 0.32 s


def test_fixed_intervals_are_not_changed_by_the_measurement() -> None:
    s = Schedule(Every(steps=5), 100.0, start_step=0, now=0.0)
    assert s.measured(stage_s=1.0, save_s=1.0) is None and s.interval_s is None


def test_settings_travel_through_the_environment() -> None:
    settings = CheckpointSettings("/ckpt", "run-7", Every(seconds=90.0), keep=2, mtbf_s=3600.0,
                                  resume_step=120)
    assert CheckpointSettings.from_env(settings.to_env()) == settings
    fresh = CheckpointSettings("/ckpt", "run-7")
    assert CheckpointSettings.from_env(fresh.to_env()) == fresh
    assert "TORCHPASS_RESUME_STEP" not in fresh.to_env()
    assert CheckpointSettings.from_env({}) is None
    with pytest.raises(ValueError, match="TORCHPASS_CHECKPOINT"):
        CheckpointSettings.from_env({"TORCHPASS_CHECKPOINT_DIR": "/c",
                                     "TORCHPASS_CHECKPOINT_EVERY": "often"})
    with pytest.raises(ValueError, match="keep"):
        CheckpointSettings("/c", "r", keep=0)
