"""The last resort end to end: a job under the launcher writing checkpoints every 10 steps
(``tests/ddp/feature_worker.py``, 2 ranks + 1 spare, 120 steps), the launcher's whole process
group SIGKILLed mid-run (its children die with it: nothing in memory survives), then a new
launcher with the same run id and directory.

Must hold: the new launcher says it resumes, from the newest complete checkpoint on disk
after the kill; every rank loads that step; the run exits 0 having committed each step from
there once; every member's final state (model, optimizer, scheduler, data position) has the
fingerprint of a fault-free run without checkpoints, and the script's own final DCP saves are
bitwise the fault-free ones. A launch with another run id is refused at start, saying why.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.main_job import REPO, launch
from tests.ddp.states import bitwise_equal, events
from tests.ddp.test_features import checkpoints
from torchpass_p2p.checkpoint.store import newest_complete

WORKER = REPO / "tests" / "ddp" / "feature_worker.py"
STEPS = 120  # 960 samples, 2 ranks, batches of 8: 60 steps an epoch, 2 epochs
ARGS = ("--samples", "960", "--sleep", "0.05")
KILL_AFTER_STEP = 30
"""The launcher is killed once a checkpoint of this step or later is complete."""
RUN_TIMEOUT_S = 150.0


def worker_args(work: Path) -> tuple[str, ...]:
    return (*ARGS, "--dcp", str(work / "dcp"))


def checkpointing(run_id: str, directory: Path) -> tuple[str, ...]:
    return ("--run-id", run_id, "--checkpoint-dir", str(directory), "--checkpoint-every", "10")


def launch_and_kill(work: Path, directory: Path) -> str:
    """Start the job with checkpoints; SIGKILL the launcher's process group once a checkpoint
    of :data:`KILL_AFTER_STEP` or later is complete. Returns the launcher's output."""
    (work / "logs").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHPASS_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["TORCHPASS_LOG_DIR"] = str(work / "logs")
    cmd = [sys.executable, "-m", "torchpass_p2p.cli.main", "launch", "--nproc", "2",
           "--spares", "1", *checkpointing("run-a", directory), str(WORKER),
           *worker_args(work)]
    out = (work / "launcher.out").open("wb")
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            marker = newest_complete(directory)
            if marker is not None and marker.step >= KILL_AFTER_STEP:
                break
            assert launcher.poll() is None, "the job ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.02)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
        out.close()
    # The children die with their launcher (PR_SET_PDEATHSIG): wait until none writes.
    members = {p.stem for p in (work / "logs").glob("*.jsonl")}
    deadline = time.monotonic() + 10
    while _running(members) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(members), "children outlived their launcher"
    return (work / "launcher.out").read_text(errors="replace")


def _running(members: set[str]) -> bool:
    """Whether a process with one of these member ids in its environment still runs."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(f"TORCHPASS_MEMBER_ID={m}".encode() in environ
                                for m in members):
            return True
    return False


def final_saves(work: Path) -> dict[str, dict[str, object]]:
    """The script's own DCP saves of the last epoch, by rank, flattened."""
    return {name: state for name, state in checkpoints(work / "dcp").items()
            if name.startswith("epoch1/")}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_killed_launcher_resumes_from_the_newest_checkpoint_exactly(tmp_path: Path) -> None:
    free = launch(tmp_path / "free", WORKER, worker_args(tmp_path / "free"), nproc=2, spares=1,
                  timeout_s=RUN_TIMEOUT_S)
    assert free.code == 0, free.diagnosis()
    [reference] = {r["fingerprint"] for r in events(free, "finished")}

    directory = tmp_path / "checkpoints"
    output = launch_and_kill(tmp_path / "killed", directory)
    assert "checkpoints: to " in output and "run run-a starts at step 0" in output, output
    marker = newest_complete(directory)
    assert marker is not None and KILL_AFTER_STEP <= marker.step < STEPS
    assert marker.step % 10 == 0 and marker.run_id == "run-a" and marker.world_size == 2

    # Another run id is refused at start, before any process starts.
    refused = launch(tmp_path / "other", WORKER, worker_args(tmp_path / "other"), nproc=2,
                     spares=1, timeout_s=RUN_TIMEOUT_S,
                     launch_args=checkpointing("run-b", directory))
    assert refused.code == 2, refused.output
    assert "is of another job: run id 'run-a' (this run: 'run-b')" in refused.output
    assert "started rank" not in refused.output

    resumed = launch(tmp_path / "resumed", WORKER, worker_args(tmp_path / "resumed"), nproc=2,
                     spares=1, timeout_s=RUN_TIMEOUT_S,
                     launch_args=checkpointing("run-a", directory))
    assert resumed.code == 0, resumed.diagnosis()
    said = re.search(r"resuming run run-a at step (\d+) from (\S+)", resumed.output)
    assert said is not None, resumed.output
    assert int(said.group(1)) == marker.step
    loaded = events(resumed, "resumed")
    assert len(loaded) == 2 and {r["step"] for r in loaded} == {marker.step}
    assert {r["fingerprint"] for r in loaded} == {marker.fingerprint}

    # Each step from the checkpoint on is committed once, in order, by each member.
    by_member: dict[str, list[int]] = {}
    for r in events(resumed, "step"):
        by_member.setdefault(r["member"], []).append(r["step"])
    assert sorted(by_member.values()) == [list(range(marker.step, STEPS))] * 2

    finished = events(resumed, "finished")
    assert len(finished) == 2 and {r["step"] for r in finished} == {STEPS}
    assert {r["fingerprint"] for r in finished} == {reference}
    mine, theirs = final_saves(tmp_path / "resumed"), final_saves(tmp_path / "free")
    assert sorted(mine) == ["epoch1/rank0", "epoch1/rank1"] and mine.keys() == theirs.keys()
    for name, state in mine.items():
        assert state.keys() == theirs[name].keys() and len(state) > 20
        assert [k for k in state if not bitwise_equal(state[k], theirs[name][k])] == [], name
    saved_after = newest_complete(directory)
    assert saved_after is not None and saved_after.step > marker.step
