"""The last holder of the state dies right after serving it: the promoted spare's copy is then
the only one left, and the next plan must resume from it.

Two ranks and two spares. Rank 1 SIGKILLs itself in the middle of step ``FAULT_STEP``; spare A
fetches the state of ``FAULT_STEP`` from rank 0, which SIGKILLs itself right after serving it
(``kill@S:serve:rank=0:0.02``; the state is one chunk). Must hold: A's vote carries the steps
its state holds (as a commit would), so the plan of the second change resumes at
``FAULT_STEP``, not at step 0, and spare B fetches from A; no step is lost; the end state is
bitwise equal to a fault-free two-rank run. Before the fix A voted "nothing committed", the
plan resumed at 0, nobody held that state, and the job hung.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.main_job import run_job
from tests.trainer.settings import ARGS
from torchpass_p2p.trainer.timeline import recoveries

STEPS = 24
FAULT_STEP = 16
FAULTS = f"kill@{FAULT_STEP}:grad:rank=1,kill@{FAULT_STEP}:serve:rank=0:0.02"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_spare_holding_the_only_copy_is_the_next_source(tmp_path: Path) -> None:
    clean = run_job(tmp_path / "clean", nproc=2, spares=1, steps=STEPS, script_args=ARGS,
                    timeout_s=200)
    assert clean.code == 0, clean.diagnosis()
    faulty = run_job(tmp_path / "faults", nproc=2, spares=2, steps=STEPS, faults=FAULTS,
                     script_args=ARGS, timeout_s=200)
    assert faulty.code == 0, faulty.diagnosis()
    events = faulty.events
    fetched = [r for r in events if r["event"] == "state_fetched"]
    assert [(r["config_id"], r["step"]) for r in fetched] == [(1, FAULT_STEP), (2, FAULT_STEP)]
    spare_a, spare_b = (r["member"] for r in fetched)
    assert list(fetched[1]["served_by"]) == [spare_a]  # the only copy left
    rules = [r for r in events if r["event"] == "commit_rule" and r["config_id"] == 2]
    assert rules and all(r["resume_step"] == FAULT_STEP for r in rules)
    assert all(f.steps_lost == 0 for f in recoveries(events))
    assert {r["member"] for r in faulty.finals} == {spare_a, spare_b}
    assert all(r["steps"] == STEPS for r in faulty.finals)
    assert {r["fingerprint"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["weights_sha256"]}
