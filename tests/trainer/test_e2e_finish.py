"""A rank lost in the final barrier, end to end: real processes under the launcher.

Every rank passes one barrier after its last step, so that nobody leaves before all hold the
final state. A rank SIGKILLed just before it (its peers inside it) is replaced like a rank
lost in any step: the spare fetches the final state and passes the barrier with the
survivors; the survivors' barrier must not raise out of the trainer and fail the job. A rank
SIGSTOPped there for twice as long as a death takes to be decided with a single accuser
(:func:`~torchpass_p2p.trainer.regroup.regroup_wait_s`, so that a loaded host still decides
within the pause) is replaced the same way; once woken it must not finish as if it still held
its rank (write a final state and exit 0 while the survivors crash).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from examples.main_job import Run, run_job
from tests.trainer.settings import ARGS
from torchpass_p2p.core.params import Params
from torchpass_p2p.trainer.regroup import regroup_wait_s

STEPS = 30
PAUSE_S = 2 * math.ceil(regroup_wait_s(Params()))


def finished(run: Run) -> list[str]:
    return [r["member"] for r in run.events if r["event"] == "finished"]


def faulted(run: Run) -> str:
    [fault] = [r for r in run.events if r["event"] == "fault"]
    assert (fault["step"], fault["point"]) == (STEPS, "finish")
    return fault["member"]


def same_final_state(clean: Run, faulty: Run) -> None:
    assert [r["rank"] for r in faulty.finals] == [0, 1, 2, 3]
    assert all(r["steps"] == STEPS for r in faulty.finals)
    assert {r["fingerprint"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["weights_sha256"]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_before_the_final_barrier_is_replaced_and_the_job_completes(
        tmp_path: Path, clean_run: Callable[..., Run]) -> None:
    faulty = run_job(tmp_path, nproc=4, spares=1, steps=STEPS,
                     faults=f"kill@{STEPS}:finish:rank=1", script_args=ARGS, timeout_s=150)
    assert faulty.code == 0, faulty.diagnosis()
    killed = faulted(faulty)
    changes = {r["config_id"]: r["removed"] for r in faulty.events if r["event"] == "change"}
    assert changes == {1: [killed]}
    [fetched] = [r for r in faulty.events if r["event"] == "state_fetched"]
    assert fetched["step"] == STEPS
    assert len(finished(faulty)) == 4 and killed not in finished(faulty)
    same_final_state(clean_run(STEPS), faulty)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_paused_in_the_final_barrier_does_not_finish_once_replaced(
        tmp_path: Path, clean_run: Callable[..., Run]) -> None:
    faulty = run_job(tmp_path, nproc=4, spares=1, steps=STEPS,
                     faults=f"stop@{STEPS}:finish:rank=2:{PAUSE_S}", script_args=ARGS,
                     timeout_s=150)
    assert faulty.code == 0, faulty.diagnosis()
    paused = faulted(faulty)
    changes = {r["config_id"]: r["removed"] for r in faulty.events if r["event"] == "change"}
    assert changes == {1: [paused]}
    assert len(finished(faulty)) == 4 and paused not in finished(faulty)
    same_final_state(clean_run(STEPS), faulty)
