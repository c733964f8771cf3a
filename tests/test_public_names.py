"""The one import surface of a training script, ``torchpass_p2p``: its names, the exit code of
each end of training (:func:`torchpass_p2p.exit_code_for`), and that importing the package (or
reading the exit codes) loads neither torch nor the runtime."""

from __future__ import annotations

import subprocess
import sys

import pytest

import torchpass_p2p
from torchpass_p2p.launch import outcome
from torchpass_p2p.trainer import ends

SCRIPT_NAMES = (
    "start", "init_process_group", "destroy_process_group", "epochs", "track", "get_rank",
    "get_world_size", "DataLoader", "DistributedDataParallel", "DistributedSampler",
    "JobMismatch", "Trainer", "TrainingAgent", "AgentError", "Removed", "Drained", "Stopped",
    "exit_code_for", "EXIT_FAILED", "EXIT_REMOVED", "EXIT_DRAINED", "EXIT_STOPPED",
    "EXIT_KEY_REFUSED",
)


def test_a_training_script_finds_every_name_it_uses_at_the_top() -> None:
    for name in SCRIPT_NAMES:
        assert getattr(torchpass_p2p, name) is not None, name
    with pytest.raises(AttributeError):
        torchpass_p2p.nothing_of_that_name  # noqa: B018


def test_the_names_at_the_top_are_the_definitions() -> None:
    assert torchpass_p2p.Removed is ends.Removed and torchpass_p2p.Drained is ends.Drained
    assert torchpass_p2p.Stopped is ends.Stopped
    assert torchpass_p2p.exit_code_for is ends.exit_code_for
    assert (torchpass_p2p.EXIT_REMOVED, torchpass_p2p.EXIT_DRAINED, torchpass_p2p.EXIT_STOPPED,
            torchpass_p2p.EXIT_KEY_REFUSED) == (3, 4, 5, 6)
    assert torchpass_p2p.EXIT_REMOVED is outcome.EXIT_REMOVED


@pytest.mark.parametrize(("exc", "code"), [
    (torchpass_p2p.Drained("drained"), outcome.EXIT_DRAINED),
    (torchpass_p2p.Removed("removed"), outcome.EXIT_REMOVED),
    (torchpass_p2p.Stopped("no majority"), outcome.EXIT_STOPPED),
    (torchpass_p2p.JobMismatch("another job"), outcome.EXIT_STOPPED),
    (RuntimeError("a bug"), 1),
])
def test_each_end_of_training_has_the_launchers_exit_code(exc: BaseException, code: int) -> None:
    assert torchpass_p2p.exit_code_for(exc) == code


def test_only_the_ends_that_are_no_failure_escape_the_launchers_report() -> None:
    # A drain and a stopped job are no failure; a removal and anything else are.
    clean = {type(e).__name__ for e in (torchpass_p2p.Drained(""), torchpass_p2p.Removed(""),
                                        torchpass_p2p.Stopped(""), ValueError(""))
             if not outcome.is_failure(torchpass_p2p.exit_code_for(e))}
    assert clean == {"Drained", "Stopped"}


def test_importing_the_package_and_its_exit_codes_loads_neither_torch_nor_the_runtime() -> None:
    code = ("import sys, torchpass_p2p as t; codes = (t.EXIT_REMOVED, t.EXIT_DRAINED, "
            "t.EXIT_STOPPED, t.EXIT_KEY_REFUSED); loaded = [m for m in ('torch', "
            "'torchpass_p2p.agent.runtime') if m in sys.modules]; print(codes, loaded); "
            "sys.exit(bool(loaded))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
