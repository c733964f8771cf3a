"""The checkpoint directory: what is complete, what is resumed from, what is pruned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchpass_p2p.checkpoint.store import (
    DCP_METADATA,
    MARKER,
    Marker,
    NotSameJob,
    checkpoint_path,
    complete,
    newest_complete,
    prune,
    read_marker,
    same_job,
    steps_on_disk,
    write_marker,
)

JOB = {"epochs": 2, "model": "7c8ff4c34f0dd2a8", "seed": 0, "world_size": 3}


def saved(root: Path, step: int, *, metadata: bool = True, marker: bool = True) -> Path:
    """A checkpoint folder of ``step`` as DCP and the writer leave it (data, metadata,
    marker), with parts left out as a writer killed mid-save leaves them."""
    folder = checkpoint_path(root, step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"tensors")
    if metadata:
        (folder / DCP_METADATA).write_bytes(b"dcp")
    if marker:
        write_marker(root, Marker("run-a", step, 3, JOB, "ab" * 32, 7, 1.0, 0.01, 0.2))
    return folder


def test_a_marker_reads_back_as_written(tmp_path: Path) -> None:
    saved(tmp_path, 120)
    marker = read_marker(tmp_path, 120)
    assert marker == Marker("run-a", 120, 3, JOB, "ab" * 32, 7, 1.0, 0.01, 0.2)
    assert sorted(p.name for p in checkpoint_path(tmp_path, 120).iterdir()) == [
        DCP_METADATA, "__0_0.distcp", MARKER]  # no temporary file left


def test_an_incomplete_checkpoint_is_never_resumed_from(tmp_path: Path) -> None:
    saved(tmp_path, 10)
    saved(tmp_path, 20, marker=False)  # killed after DCP's metadata, before the marker
    saved(tmp_path, 30, metadata=False, marker=False)  # killed while writing data
    no_metadata = saved(tmp_path, 40, metadata=False)  # a marker without DCP's metadata
    assert (no_metadata / MARKER).exists()
    assert steps_on_disk(tmp_path) == [10, 20, 30, 40]
    assert [s for s in (10, 20, 30, 40) if complete(tmp_path, s)] == [10]
    newest = newest_complete(tmp_path)
    assert newest is not None and newest.step == 10


def test_a_damaged_or_misplaced_marker_makes_it_incomplete(tmp_path: Path) -> None:
    folder = saved(tmp_path, 10)
    (folder / MARKER).write_text("{not json")
    assert not complete(tmp_path, 10)
    saved(tmp_path, 20)
    moved = checkpoint_path(tmp_path, 30)
    checkpoint_path(tmp_path, 20).rename(moved)  # its marker says step 20
    assert not complete(tmp_path, 30) and newest_complete(tmp_path) is None
    data = json.loads((moved / MARKER).read_text())
    data["format"] = 99
    (moved / MARKER).write_text(json.dumps({**data, "step": 30}))
    assert not complete(tmp_path, 30)


def test_no_directory_holds_no_checkpoint(tmp_path: Path) -> None:
    assert newest_complete(tmp_path / "absent") is None
    (tmp_path / "step-12").mkdir()  # not a checkpoint's name
    (tmp_path / "notes.txt").write_text("")
    assert steps_on_disk(tmp_path) == [] and newest_complete(tmp_path) is None


def test_prune_keeps_the_newest_complete_and_what_is_being_written(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        saved(tmp_path, step)
    saved(tmp_path, 25, marker=False)  # a stale incomplete one, older than the newest
    saved(tmp_path, 50, marker=False)  # being written now
    saved(tmp_path, 60, metadata=False, marker=False)  # newer than the newest complete
    assert prune(tmp_path, keep=2) == [10, 20, 25]
    assert steps_on_disk(tmp_path) == [30, 40, 50, 60]
    assert prune(tmp_path, keep=1, writing=30) == []  # never the one being written
    assert prune(tmp_path, keep=1) == [30]
    with pytest.raises(ValueError):
        prune(tmp_path, keep=0)


def test_prune_without_a_complete_checkpoint_removes_nothing(tmp_path: Path) -> None:
    saved(tmp_path, 10, marker=False)
    assert prune(tmp_path, keep=1) == [] and steps_on_disk(tmp_path) == [10]


def test_same_job_names_every_difference() -> None:
    marker = Marker("run-a", 30, 3, JOB)
    same_job(marker, run_id="run-a", world_size=3, job=JOB)
    same_job(marker, run_id="run-a", world_size=3)  # the launcher knows no job description
    with pytest.raises(NotSameJob) as err:
        same_job(marker, run_id="run-b", world_size=4, job={**JOB, "epochs": 3})
    assert str(err.value) == (
        "the checkpoint at step 30 is of another job: run id 'run-a' (this run: 'run-b'); "
        "world size 3 (this run: 4); epochs 2 (this run: 3)")
