"""``torchpass-p2p launch --checkpoint-dir``: what the launcher resumes from, what it says, what
it refuses, and what its children are told (real launcher processes; the children only report
their environment)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchpass_p2p.checkpoint.store import DCP_METADATA, Marker, checkpoint_path, write_marker

from .procs import finish, reports, start_launcher, write_script

pytestmark = pytest.mark.timeout(60)

REPORT = '''
import time
out = Path(sys.argv[1])
dump(out)
# A rank waits (up to 20 s) for every child's report: once the ranks have exited, the launcher
# stops the idle spare at once, and a spare that had not yet started writing would report nothing.
deadline = time.monotonic() + 20
while len(list(out.glob("*.json"))) < 3 and time.monotonic() < deadline:
    time.sleep(0.02)
'''


def saved(root: Path, step: int, *, run_id: str = "run-a", world_size: int = 2,
          marker: bool = True) -> None:
    """A checkpoint folder of ``step``: complete, or as a writer killed before its marker
    left it (DCP's data and metadata written)."""
    folder = checkpoint_path(root, step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"tensors")
    (folder / DCP_METADATA).write_bytes(b"dcp")
    if marker:
        write_marker(root, Marker(run_id, step, world_size, {}, "00" * 32, 7, 0.0))


def launch(tmp_path: Path, directory: Path, *more: str) -> tuple[int, str, list[dict[str, str]]]:
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", REPORT)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "2",
                               "--checkpoint-dir", str(directory), *more, str(script),
                               str(out)])
    code, output = finish(launcher, 30)
    envs = reports(out, 3, timeout_s=1) if code == 0 else []
    return code, output, envs


def test_the_newest_complete_checkpoint_is_resumed_never_an_incomplete_one(
        tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    saved(directory, 10)
    saved(directory, 20)
    saved(directory, 30, marker=False)  # the launcher was killed before its marker
    code, output, envs = launch(tmp_path, directory, "--run-id", "run-a",
                                "--checkpoint-every", "15m", "--checkpoint-keep", "2",
                                "--mtbf-correlated", "3600")
    assert code == 0, output
    assert "ignoring 1 incomplete checkpoint(s) in" in output and "(step(s) 30)" in output
    assert f"resuming run run-a at step 20 from {checkpoint_path(directory, 20)}" in output
    assert f"checkpoints: to {directory} every 900 s, keeping the newest 2" in output
    for env in envs:
        assert env["TORCHPASS_CHECKPOINT_DIR"] == str(directory)
        assert env["TORCHPASS_RUN_ID"] == "run-a"
        assert env["TORCHPASS_RESUME_STEP"] == "20"
        assert env["TORCHPASS_CHECKPOINT_EVERY"] == "900s"
        assert env["TORCHPASS_CHECKPOINT_KEEP"] == "2"
        assert float(env["TORCHPASS_MTBF_CORRELATED"]) == 3600.0


def test_without_a_complete_checkpoint_the_run_starts_at_step_0(tmp_path: Path) -> None:
    directory = tmp_path / "fresh" / "ckpt"  # made by the launcher
    code, output, envs = launch(tmp_path, directory, "--run-id", "run-a")
    assert code == 0, output
    assert f"no complete checkpoint in {directory}: run run-a starts at step 0" in output
    assert directory.is_dir()
    assert all("TORCHPASS_RESUME_STEP" not in e and e["TORCHPASS_CHECKPOINT_EVERY"] == "auto"
               for e in envs)


@pytest.mark.parametrize(("run_id", "nproc", "why"), [
    ("run-b", "2", "run id 'run-a' (this run: 'run-b')"),
    ("run-a", "3", "world size 2 (this run: 3)"),
])
def test_a_checkpoint_of_another_run_is_refused_before_anything_starts(
        tmp_path: Path, run_id: str, nproc: str, why: str) -> None:
    directory = tmp_path / "ckpt"
    saved(directory, 10)
    script = write_script(tmp_path, "child.py", REPORT)
    launcher = start_launcher(["--nproc", nproc, "--run-id", run_id, "--checkpoint-dir",
                               str(directory), str(script), str(tmp_path)])
    code, output = finish(launcher, 30)
    assert code == 2, output
    assert f"the checkpoint at step 10 is of another job: {why}" in output
    assert "started rank" not in output


@pytest.mark.parametrize(("args", "why"), [
    (("--checkpoint-dir", "d"), "--checkpoint-dir needs --run-id"),
    (("--checkpoint-dir", "d", "--run-id", "r", "--checkpoint-every", "often"),
     "checkpoint interval 'often'"),
    (("--checkpoint-dir", "d", "--run-id", "r", "--checkpoint-keep", "0"),
     "--checkpoint-keep must be >= 1"),
])
def test_bad_checkpoint_options_are_refused(tmp_path: Path, args: tuple[str, ...],
                                            why: str) -> None:
    script = write_script(tmp_path, "child.py", REPORT)
    code, output = finish(start_launcher([*args, str(script), str(tmp_path)]), 30)
    assert code == 2 and why in output, output
