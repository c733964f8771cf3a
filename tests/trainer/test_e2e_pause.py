"""A rank paused past its lease (SIGSTOP), end to end: real processes under the launcher.

* Still paused when the job completes. The rank is replaced once and the job completes
  without it; no exit told the launcher that a rank changed hands, but the spare's exit 0 did.
  Must hold: the same final state as the fault-free run, and the launcher ends the paused
  member at once instead of waiting for it as a rank (that wait lasts until it is killed).
* Its waking decides the change. Three ranks and a spare; in the same step rank 0 is killed
  and rank 1 paused for 15 s: two of four members cannot decide anything, so the change that
  gives rank 0 to the spare is decided only when rank 1 wakes, and rank 1 may still be fenced
  at the next commit (its lease comes back with its first answered probe). Must hold: the
  job trains on and ends with the fault-free run's state; its veto must not leave every rank
  waiting for a change that never comes (600 s).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from examples.main_job import Run, run_job
from tests.trainer.settings import ARGS
from torchpass_p2p.trainer.timeline import recoveries

STEPS = 57
SHORT = 30


def faulted(run: Run, kind: str) -> list[str]:
    return [r["member"] for r in run.events if r["event"] == "fault" and r["kind"] == kind]


def same_state(clean: Run, faulty: Run, nproc: int, steps: int, *, survivor: int) -> None:
    """Every rank's final state is the fault-free run's; so is the loss curve as rank
    ``survivor`` (a member that ran every step) saw it."""
    assert len(clean.finals) == len(faulty.finals) == nproc
    assert [r["rank"] for r in faulty.finals] == list(range(nproc))
    assert all(r["steps"] == steps for r in clean.finals + faulty.finals)
    assert len({r["fingerprint"] for r in clean.finals + faulty.finals}) == 1
    assert clean.finals[survivor]["losses"] == faulty.finals[survivor]["losses"]
    assert sorted(map(int, faulty.finals[survivor]["losses"])) == list(range(steps))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_paused_past_the_end_of_the_job_is_not_waited_for(
        tmp_path: Path, clean_run: Callable[..., Run]) -> None:
    faulty = run_job(tmp_path, nproc=4, spares=1, steps=STEPS,
                     faults="stop@30:commit:rank=1:90", script_args=ARGS, timeout_s=120)
    assert faulty.code == 0, faulty.diagnosis()
    [fault] = recoveries(faulty.events)
    assert (fault.kind, fault.rank, fault.step, fault.steps_lost) == ("stop", 1, 30, 0)
    (paused,) = faulted(faulty, "stop")
    changes = {r["config_id"]: r["removed"] for r in faulty.events if r["event"] == "change"}
    assert changes == {1: [paused]}
    assert "idle: 1 stopped by a signal, stopping them now" in faulty.output, faulty.diagnosis()
    assert f"({paused}) exited with signal SIGTERM" in faulty.output, faulty.diagnosis()
    same_state(clean_run(STEPS), faulty, 4, STEPS, survivor=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_paused_rank_whose_waking_decides_the_change_trains_on(
        tmp_path: Path, clean_run: Callable[..., Run]) -> None:
    faulty = run_job(tmp_path, nproc=3, spares=1, steps=SHORT,
                     faults="kill@12:grad:rank=0,stop@12:grad:rank=1:15", script_args=ARGS,
                     timeout_s=120)
    assert faulty.code == 0, faulty.diagnosis()
    timelines = recoveries(faulty.events)  # in the order the faults fired: either first
    assert sorted((f.kind, f.step, f.steps_lost) for f in timelines) == [
        ("kill", 12, 0), ("stop", 12, 0)]
    changes = {r["config_id"]: r["removed"] for r in faulty.events if r["event"] == "change"}
    assert changes == {1: faulted(faulty, "kill")}  # the paused rank is kept
    for veto in (r for r in faulty.events if r["event"] == "commit_vetoed"):
        assert (veto["step"], veto["config_id"]) == (12, 1)
    same_state(clean_run(SHORT, nproc=3), faulty, 3, SHORT, survivor=2)
