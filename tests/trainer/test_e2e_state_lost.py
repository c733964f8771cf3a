"""A change that nobody can fill stops the job; it does not hang.

Two ranks and three spares. Both ranks SIGKILL themselves in the middle of step ``FAULT_STEP``.
The spares are a majority and decide the change, but no survivor holds the state (data
parallel: every rank is gone), so the plan stops the job (:mod:`torchpass_p2p.core.plan` rule
3). Must hold: every spare learns it from the agreement, logs ``job_stopped`` and exits with
``EXIT_STOPPED``; nobody is promoted, nothing trains, no final state is written; the launcher
exits ``EXIT_STOPPED`` too and says why. Reported as waiting for a spare instead, the
configuration would leave the spares waiting for a rank never given, and the job hung until
killed.

With fewer spares than ranks (two ranks, one spare) the spare alone is no majority: no
configuration can be decided again, not even a stop. Must hold: the spare is fenced, the
launcher sees that a majority of configuration 0 exited, stops the spare and exits
``EXIT_STOPPED`` saying so, and that the job stops (resume it from its last checkpoint).
Otherwise the spare waits for a rank forever, and the launch with it.

The same under policy ``stop`` (rule 5) with no spare at all: three ranks, rank 2 killed; the
two survivors stop (exit ``EXIT_STOPPED``) instead of waiting 600 s for a spare.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.main_job import run_job
from tests.trainer.settings import ARGS
from torchpass_p2p.launch.outcome import EXIT_STOPPED

STEPS = 30
FAULT_STEP = 12
FAULTS = f"kill@{FAULT_STEP}:grad:rank=0,kill@{FAULT_STEP}:grad:rank=1"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_rank_dying_at_once_stops_the_job(tmp_path: Path) -> None:
    run = run_job(tmp_path, nproc=2, spares=3, steps=STEPS, faults=FAULTS, script_args=ARGS,
                  timeout_s=120)
    assert run.code == EXIT_STOPPED, run.diagnosis()
    assert "exit code 5: a member stopped the job: the agreement" in run.output, run.diagnosis()
    events = run.events
    spares = {r["member"] for r in events if r["event"] == "start" and r["role"] == "spare"}
    assert len(spares) == 3
    stopped = [r for r in events if r["event"] == "job_stopped"]
    assert sorted(r["member"] for r in stopped) == sorted(spares)
    assert {(r["config_id"], tuple(r["vacant"])) for r in stopped} == {(1, (0, 1))}
    for member in spares:
        assert f"spare ({member}) exited with {EXIT_STOPPED}" in run.output, run.diagnosis()
    assert not [r for r in events if r["event"] in ("fetch_started", "joined")
                and r.get("config_id", 0) > 0]
    assert run.finals == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_spare_left_without_a_majority_is_stopped_by_the_launcher(tmp_path: Path) -> None:
    run = run_job(tmp_path, nproc=2, spares=1, steps=STEPS, faults=FAULTS, script_args=ARGS,
                  timeout_s=120)
    assert run.code == EXIT_STOPPED, run.diagnosis()
    lost = ("no majority of configuration 0 is left: 2 of its 3 members exited and a majority "
            "is 2; the job stops: resume it from its last checkpoint")
    assert f"exit code 5: {lost}" in run.output, run.diagnosis()
    events = run.events
    (spare,) = {r["member"] for r in events if r["event"] == "start" and r["role"] == "spare"}
    # The launcher concludes only from answers that are all fenced (roles.majority_lost), so
    # the line above proves the spare's agent fenced in configuration 0. Its trainer logs that
    # at its next wait slice (up to 1 s later), which the launcher's SIGTERM may precede.
    assert [(r["member"], r["config_id"]) for r in events if r["event"] == "fenced"] in (
        [], [(spare, 0)])
    assert run.output.count("exited with signal SIGKILL") == 2, run.diagnosis()  # both ranks
    assert f"spare ({spare}) exited with signal SIGTERM" in run.output, run.diagnosis()
    assert not [r for r in events if r["event"] in ("change", "job_stopped", "fetch_started")]
    assert run.finals == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_spare_left_under_policy_stop_stops_the_survivors(tmp_path: Path) -> None:
    run = run_job(tmp_path, nproc=3, spares=0, steps=STEPS,
                  faults=f"kill@{FAULT_STEP}:grad:rank=2", script_args=ARGS, timeout_s=120,
                  settings={"TORCHPASS_POLICY": "stop"})
    assert run.code == EXIT_STOPPED, run.diagnosis()
    assert "exit code 5: a member stopped the job: the agreement" in run.output, run.diagnosis()
    events = run.events
    ranks = {r["member"]: r["rank"] for r in events if r["event"] == "start"}
    survivors = {m for m, rank in ranks.items() if rank != 2}
    stopped = [r for r in events if r["event"] == "job_stopped"]
    assert sorted(r["member"] for r in stopped) == sorted(survivors)
    assert {(r["config_id"], tuple(r["vacant"]), r["step"]) for r in stopped} == {
        (1, (2,), FAULT_STEP)}
    for member in survivors:
        assert f"({member}) exited with {EXIT_STOPPED}" in run.output, run.diagnosis()
    assert run.finals == []
