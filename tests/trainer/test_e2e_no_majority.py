"""A survivor left without a majority, end to end: real processes under the launcher (issue 32,
item 3).

Three ranks, no spare. At step ``FAULT_STEP`` ranks 1 and 2 SIGSTOP themselves in the middle of
the gradient reduction, for longer than the run: nothing exits, and rank 0, alone of three, can
decide nothing (a majority is 2). Its agent is fenced once both peers are suspected and its
lease is over; its collective never completes. Must hold: after its give-up time (10 s here,
600 s by default) rank 0 stops with ``EXIT_STOPPED`` and one line that says how many of the
configuration are left, the majority needed and that the job stops; the launcher says the same
in one line, ends the paused ranks and exits ``EXIT_STOPPED``. The survivor must not wait in
its collective for the backend's 30-minute timeout and then exit ``EXIT_REMOVED`` ("no new
configuration ... after a collective failure"), which the launcher reads as a member to
respawn.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from examples.main_job import run_job
from tests.trainer.settings import ARGS
from torchpass_p2p.launch.outcome import EXIT_STOPPED

STEPS = 30
FAULT_STEP = 8
GIVE_UP_S = 10
PAUSE_S = 100
FAULTS = f"stop@{FAULT_STEP}:grad:rank=1:{PAUSE_S},stop@{FAULT_STEP}:grad:rank=2:{PAUSE_S}"
LOST = ("no majority of configuration 0 is left: 1 of its 3 members is reachable and a "
        "majority is 2")
STOPS = "the job stops: resume it from its last checkpoint"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_survivor_without_a_majority_says_so_and_stops_the_job(tmp_path: Path) -> None:
    run = run_job(tmp_path, nproc=3, spares=0, steps=STEPS, faults=FAULTS,
                  script_args=(*ARGS, "--give-up-s", str(GIVE_UP_S)), timeout_s=120)
    assert run.code == EXIT_STOPPED, run.diagnosis()
    events = run.events
    ranks = {r["member"]: r["rank"] for r in events if r["event"] == "start"}
    (survivor,) = [m for m, rank in ranks.items() if rank == 0]
    # The survivor's one line (the library's, from inside char_lm's step) and its exit code.
    line = (f"torchpass_p2p: member {survivor}: {LOST}; fenced for {GIVE_UP_S} s, {STOPS}; "
            f"exit code {EXIT_STOPPED}")
    assert line in run.output, run.diagnosis()
    assert f"rank 0 ({survivor}) exited with {EXIT_STOPPED}" in run.output, run.diagnosis()
    assert [(r["member"], r["reason"]) for r in events if r["event"] == "gave_up"] == [
        (survivor, f"{LOST}; fenced for {GIVE_UP_S} s, {STOPS}")]
    # The launcher's line, and its exit code says so too.
    assert re.search(rf"rank 0 \({survivor}\) stopped the job: {LOST}; {STOPS}; waiting up "
                     r"to 3.0 s for the rest", run.output), run.diagnosis()
    assert f"exit code 5: {LOST}; {STOPS}" in run.output, run.diagnosis()
    assert run.output.count("exited with signal SIGTERM") == 2, run.diagnosis()
    # Nothing was decided and no final state written.
    assert not [r for r in events if r["event"] in ("change", "job_stopped")]
    assert run.finals == []
