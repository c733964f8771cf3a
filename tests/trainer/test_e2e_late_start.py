"""A rank whose process starts late, on a loaded host, is not removed: its peers probe it from
their own start, and the launcher's record of when it started each child gives it a start-up
grace (``Params.start_grace_s``). Three ranks, no spare (a removed rank could not be replaced:
the job would wait for a spare), 2 CPU-bound processes beside them on the 2 cores; rank 1's
script runs 3 s after both others' agents are up (``late_start.py``).

Without that grace, a fault-free run on a host with load average 14-19 can start rank 1's
process 2.9 s after rank 0's: rank 1 is alerted 1.55 s and marked dead 2.55 s into the others'
probing, before its script runs, then removed (exit 3), and the job waits for a spare.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from examples.main_job import SCRIPT, launch
from tests.trainer.late_start import LATE_S
from tests.trainer.settings import ARGS

LATE_START = Path(__file__).with_name("late_start.py")
STEPS = 20


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_rank_whose_process_starts_3_s_late_under_load_is_not_removed(tmp_path: Path) -> None:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        run = launch(tmp_path, LATE_START,
                     (str(SCRIPT), "--out", str(tmp_path / "out"), "--log-dir",
                      str(tmp_path / "logs"), "--steps", str(STEPS), *ARGS),
                     nproc=3, spares=0, timeout_s=300)
    finally:
        for p in burners:
            p.kill()
            p.wait()
    assert run.code == 0, run.diagnosis()
    # The scenario: rank 1's agent started at least LATE_S after both others' (``late_start``).
    starts = {r["rank"]: r["t"] for r in run.events if r["event"] == "start"}
    assert sorted(starts) == [0, 1, 2]
    assert starts[1] - max(starts[0], starts[2]) >= LATE_S
    # No configuration change: nobody removed, every rank trained every step in configuration 0.
    assert [r for r in run.events if r["event"] in ("change", "removed", "fenced")] == []
    assert {r["config_id"] for r in run.events if "config_id" in r} == {0}
    assert len(run.finals) == 3 and all(r["steps"] == STEPS for r in run.finals)
    assert len({r["fingerprint"] for r in run.finals}) == 1
