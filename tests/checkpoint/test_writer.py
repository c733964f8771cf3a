"""Saves with torch.distributed.checkpoint's async save and loads back, on a real model,
optimizer and scheduler: the state restored is bitwise the state saved, and nothing but a
complete checkpoint of the same job is ever loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torchpass_p2p.checkpoint import CheckpointSettings, Every, NotSameJob
from torchpass_p2p.checkpoint.store import DCP_METADATA, MARKER, checkpoint_path, steps_on_disk
from torchpass_p2p.checkpoint.writer import Checkpointer, CheckpointError, load
from torchpass_p2p.transfer import Snapshot

JOB = {"model": "mlp", "epochs": 3, "world_size": 2}
# DCP warns at each single-process save and load (no process group: what is meant), from its
# own thread too; the writer filters it where no test harness turns warnings into errors.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Progress:
    def __init__(self) -> None:
        self.epoch, self.batches = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "loaders": [[self.epoch, self.batches]]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.batches = sd["epoch"], sd["loaders"][0][1]


def build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler,
            "progress": Progress()}


def train(objects: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        objects["model"](torch.randn(8, 6)).square().mean().backward()
        objects["optimizer"].step()
        objects["optimizer"].zero_grad()
        objects["scheduler"].step()
        objects["progress"].batches += 1


def fingerprint(objects: dict[str, Any], step: int) -> bytes:
    return Snapshot.capture(objects, step, {"seed": 0}).fingerprint()


def checkpointer(settings: CheckpointSettings, objects: dict[str, Any], step: list[int],
                 events: list[tuple[str, dict[str, Any]]]) -> Checkpointer:
    return Checkpointer(
        settings, 0, capture=lambda: Snapshot.capture(objects, step[0], {"seed": 0}, copy=True),
        job=lambda: JOB, log=lambda event, **f: events.append((event, f)), say=lambda _: None)


def saved_run(tmp_path: Path) -> tuple[CheckpointSettings, dict[str, Any], bytes]:
    """Train 5 steps, save step 5 in the background while training 3 more; returns the
    settings, the objects (at step 8) and step 5's fingerprint."""
    settings = CheckpointSettings(str(tmp_path), "run-a", Every(steps=5))
    objects, step, events = build(0), [0], []
    writer = checkpointer(settings, objects, step, events)
    train(objects, 5)
    step[0] = 5
    expected = fingerprint(objects, 5)
    assert writer.maybe_save(5)
    train(objects, 3)  # the save copied the state: training on changes nothing in it
    writer.close()
    assert [e for e, _ in events] == ["checkpoint_started", "checkpoint_saved"]
    assert events[1][1]["fingerprint"] == expected.hex()
    return settings, objects, expected


def test_a_resumed_state_is_bitwise_the_saved_one(tmp_path: Path) -> None:
    settings, _, expected = saved_run(tmp_path)
    fresh = build(1)  # another initialization: every value must come from the checkpoint
    assert fingerprint(fresh, 5) != expected
    marker = load(settings, 5, fresh, world_size=2, job=JOB)
    assert marker.step == 5 and fingerprint(fresh, 5) == expected
    assert fresh["progress"].batches == 5
    assert fresh["scheduler"].last_epoch == 5 and len(fresh["optimizer"].state) == 6


def test_training_on_from_a_resume_matches_training_through(tmp_path: Path) -> None:
    settings, _, _ = saved_run(tmp_path)
    through = build(0)
    torch.manual_seed(5)
    train(through, 5)
    resumed = build(2)
    load(settings, 5, resumed, world_size=2, job=JOB)
    torch.manual_seed(5)
    train(resumed, 3)
    torch.manual_seed(5)
    reference = build(0)
    train(reference, 5)
    torch.manual_seed(5)
    train(reference, 3)
    assert fingerprint(resumed, 8) == fingerprint(reference, 8)


@pytest.mark.parametrize("loses", [MARKER, DCP_METADATA])
def test_an_incomplete_checkpoint_is_never_loaded(tmp_path: Path, loses: str) -> None:
    settings, _, _ = saved_run(tmp_path)
    (checkpoint_path(tmp_path, 5) / loses).unlink()
    objects = build(1)
    before = fingerprint(objects, 5)
    with pytest.raises(CheckpointError, match="no complete checkpoint of step 5"):
        load(settings, 5, objects, world_size=2, job=JOB)
    assert fingerprint(objects, 5) == before  # nothing was loaded


def test_a_checkpoint_whose_bytes_changed_is_refused(tmp_path: Path) -> None:
    settings, _, _ = saved_run(tmp_path)
    data = checkpoint_path(tmp_path, 5) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[200] ^= 0x01  # inside the first tensor's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="not the one saved|unreadable"):
        load(settings, 5, build(1), world_size=2, job=JOB)


def test_another_job_is_refused(tmp_path: Path) -> None:
    settings, _, _ = saved_run(tmp_path)
    with pytest.raises(NotSameJob, match="epochs 3 .this run: 4."):
        load(settings, 5, build(1), world_size=2, job={**JOB, "epochs": 4})
    with pytest.raises(NotSameJob, match="world size 2 .this run: 3."):
        load(settings, 5, build(1), world_size=3, job=JOB)
    other = CheckpointSettings(settings.directory, "run-b")
    with pytest.raises(NotSameJob, match="run id 'run-a'"):
        load(other, 5, build(1), world_size=2, job=JOB)


def test_one_save_at_a_time_and_the_newest_kept(tmp_path: Path) -> None:
    settings = CheckpointSettings(str(tmp_path), "run-a", Every(steps=1), keep=2)
    objects, step, events = build(0), [0], []
    writer = checkpointer(settings, objects, step, events)
    started = []
    for k in range(1, 9):
        train(objects, 1)
        step[0] = k
        if k % 2 == 0:
            writer.close()  # this boundary finds none in flight: it saves
        busy = writer.busy  # only this thread starts saves: busy cannot become True meanwhile
        if writer.maybe_save(k):
            started.append(k)
        else:
            assert busy and k % 2 == 1  # due at every step: skipped only while one is in flight
    writer.close()
    assert writer.saves == len(started) and {2, 4, 6, 8} <= set(started)
    assert steps_on_disk(tmp_path) == started[-2:]


def test_a_leftover_incomplete_folder_of_the_step_is_replaced(tmp_path: Path) -> None:
    settings = CheckpointSettings(str(tmp_path), "run-a", Every(steps=5))
    folder = checkpoint_path(tmp_path, 5)
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"left by a writer killed mid-save")
    objects, step, events = build(0), [5], []
    writer = checkpointer(settings, objects, step, events)
    writer.save(5)
    writer.close()
    load(settings, 5, build(1), world_size=2, job=JOB)
