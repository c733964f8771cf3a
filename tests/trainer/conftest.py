"""The fault-free runs the end-to-end scenarios compare with, launched once per session."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from examples.main_job import Run, run_job
from tests.trainer.settings import ARGS

CLEAN_TIMEOUT_S = 200.0


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    """``clean_run(steps, script_args=ARGS, nproc=4)``: the fault-free run of ``steps`` steps
    (``nproc`` ranks, 1 spare, the example's ``script_args``), launched on first use and shared
    by every module asking for the same length and settings."""
    runs: dict[tuple[int, tuple[str, ...], int], Run] = {}

    def get(steps: int, script_args: tuple[str, ...] = ARGS, nproc: int = 4) -> Run:
        key = (steps, tuple(script_args), nproc)
        if key not in runs:
            run = run_job(tmp_path_factory.mktemp(f"clean-{steps}"), nproc=nproc, spares=1,
                          steps=steps, script_args=key[1], timeout_s=CLEAN_TIMEOUT_S)
            assert run.code == 0, run.diagnosis()
            assert len(run.finals) == nproc and all(r["steps"] == steps for r in run.finals)
            # The state's fingerprint is each member's "finished" record's (run_job).
            assert all(r["fingerprint"] for r in run.finals)
            assert len({r["fingerprint"] for r in run.finals}) == 1
            runs[key] = run
        return runs[key]

    return get
