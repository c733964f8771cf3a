"""The checkpoint directory: one folder per checkpoint, complete only once committed.

Layout (``docs/checkpoints.md``)::

    DIR/step-000000120/.metadata        written last by torch.distributed.checkpoint
    DIR/step-000000120/__0_0.distcp     the tensors and the tree (:mod:`.writer`)
    DIR/step-000000120/committed.json   the marker: run id, step, world size, job, fingerprint

A checkpoint is *complete* once its marker exists and parses, and DCP's ``.metadata`` exists:
the marker is written (to a temporary name, flushed, fsynced, renamed, the folder fsynced) only
after DCP's save returned, which writes ``.metadata`` after every data file. A folder without
its marker (a writer killed mid-save) is never resumed from; it is removed once a newer
checkpoint is complete, or overwritten when its step is saved again. Nothing here imports torch:
the launcher reads the directory at start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DCP_METADATA", "FORMAT", "MARKER", "Marker", "NotSameJob", "checkpoint_path", "complete",
    "newest_complete", "prune", "read_marker", "same_job", "steps_on_disk", "write_marker",
]

FORMAT = 1
"""The marker's ``format``: a reader refuses others."""
MARKER = "committed.json"
DCP_METADATA = ".metadata"
"""What ``torch.distributed.checkpoint.FileSystemWriter`` writes once every data file is."""
_NAME = re.compile(r"^step-(\d{9})$")


class NotSameJob(ValueError):
    """A checkpoint of another job than the one asked to resume (the message says how)."""


@dataclass(frozen=True)
class Marker:
    """What a complete checkpoint's ``committed.json`` holds.

    Attributes:
        run_id: the ``--run-id`` of the run that wrote it.
        step: steps applied in the saved state (training resumes at this step).
        world_size: ranks of the configuration that wrote it.
        job: the job as the members agreed on it (``Session.describe()``).
        fingerprint: hex of the saved state's 32-byte fingerprint
            (:meth:`torchpass_p2p.transfer.Snapshot.fingerprint`), checked after a load.
        total_bytes: bytes of tensor data in the state.
        saved_at: Unix time (seconds) the save began.
        stage_s: seconds the training thread spent on it (the copy of the state).
        save_s: seconds from its start to its commit.
    """

    run_id: str
    step: int
    world_size: int
    job: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    total_bytes: int = 0
    saved_at: float = 0.0
    stage_s: float = 0.0
    save_s: float = 0.0

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Marker:
        """Raises ``ValueError`` for anything but a marker of :data:`FORMAT`."""
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict) or raw.pop("format", None) != FORMAT:
                raise ValueError(f"not a checkpoint marker of format {FORMAT}")
            marker = cls(**raw)
        except (TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"unreadable checkpoint marker: {exc}") from exc
        if type(marker.step) is not int or marker.step < 0 or type(marker.world_size) is not int:
            raise ValueError("checkpoint marker: step and world_size must be integers")
        return marker


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """The folder of the checkpoint of ``step``."""
    return Path(directory) / f"step-{step:09d}"


def steps_on_disk(directory: str | os.PathLike[str]) -> list[int]:
    """Steps of every checkpoint folder in ``directory``, complete or not, ascending."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _NAME.match(n)))


def read_marker(directory: str | os.PathLike[str], step: int) -> Marker | None:
    """The marker of ``step``'s checkpoint when it is complete (module docstring), else None."""
    folder = checkpoint_path(directory, step)
    try:
        data = (folder / MARKER).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not (folder / DCP_METADATA).is_file():
        return None
    try:
        marker = Marker.decode(data)
    except ValueError:
        return None
    return marker if marker.step == step else None


def complete(directory: str | os.PathLike[str], step: int) -> bool:
    return read_marker(directory, step) is not None


def newest_complete(directory: str | os.PathLike[str]) -> Marker | None:
    """The marker of the newest complete checkpoint in ``directory``, None when there is none.
    Raises ``OSError`` when the directory cannot be read (a missing one holds none)."""
    for step in reversed(steps_on_disk(directory)):
        marker = read_marker(directory, step)
        if marker is not None:
            return marker
    return None


def write_marker(directory: str | os.PathLike[str], marker: Marker) -> Path:
    """Commit ``marker`` in its checkpoint's folder: written to a temporary name, fsynced,
    renamed into place, the folder fsynced, so that a crash leaves either no marker or a whole
    one. Returns the marker's path. Raises ``OSError``."""
    folder = checkpoint_path(directory, marker.step)
    tmp = folder / (MARKER + ".tmp")
    with open(tmp, "wb") as f:
        f.write(marker.encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)
    _fsync_dir(folder)
    _fsync_dir(Path(directory))
    return folder / MARKER


def prune(directory: str | os.PathLike[str], keep: int, *, writing: int | None = None
          ) -> list[int]:
    """Keep the ``keep`` newest complete checkpoints; remove the older complete ones and every
    incomplete one older than the newest complete (a writer killed mid-save left it), except
    ``writing``, the step being written now. A complete one loses its marker first, so a
    removal cut short never leaves something that looks complete. Returns the steps removed.
    Raises ``ValueError`` for ``keep < 1``."""
    if keep < 1:
        raise ValueError("keep at least one checkpoint")
    steps = steps_on_disk(directory)
    done = [s for s in steps if complete(directory, s)]
    if not done:
        return []
    kept = set(done[-keep:])
    removed = []
    for step in steps:
        if step in kept or step == writing or step > done[-1]:
            continue
        folder = checkpoint_path(directory, step)
        try:
            (folder / MARKER).unlink(missing_ok=True)
            shutil.rmtree(folder)
        except OSError:
            continue  # another writer's removal, or not ours to remove: no harm left
        removed.append(step)
    return removed


def same_job(marker: Marker, *, run_id: str, world_size: int,
             job: Mapping[str, Any] | None = None) -> None:
    """Check that ``marker``'s checkpoint is of this job: the same run id, world size and (when
    given) job description. Raises :class:`NotSameJob` naming every difference."""
    diffs = []
    if marker.run_id != run_id:
        diffs.append(f"run id {marker.run_id!r} (this run: {run_id!r})")
    if marker.world_size != world_size:
        diffs.append(f"world size {marker.world_size} (this run: {world_size})")
    if job is not None:
        for key in sorted(set(marker.job) | set(job)):
            if marker.job.get(key) != job.get(key):
                diffs.append(f"{key} {marker.job.get(key)!r} (this run: {job.get(key)!r})")
    if diffs:
        raise NotSameJob(f"the checkpoint at step {marker.step} is of another job: "
                         + "; ".join(diffs))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
