"""Background checkpoints with torch.distributed.checkpoint, and the load at a resume.

What is saved is the state a spare receives (:class:`~torchpass_p2p.transfer.Snapshot`: the
model, every tracked object, the epoch and data position, the step): its tensors, each under
its name in the snapshot's table (``model.0.weight``, ``optimizer.state.0.exp_avg``, ...), and
its tree (the state dicts' structure and plain values, msgpack) as a ``uint8`` tensor, in one
DCP checkpoint of a single writer (``no_dist``). Data parallelism replicates the whole state on
every rank, so rank 0 alone writes: no two ranks write the same bytes, and no collective runs
during a save (a fault mid-save costs only that checkpoint).

A save copies the state on the training thread (:meth:`Snapshot.capture` with ``copy=True``:
``total_bytes`` more host memory while it lasts; DCP's own staging is skipped, the copy is the
staging) and hands the copy to :func:`torch.distributed.checkpoint.async_save`, whose thread
writes it. When DCP's save returns (its ``.metadata`` written last), a callback on that thread
fingerprints the copy, commits the marker (:func:`.store.write_marker`) and prunes old
checkpoints. One save at a time: a boundary that is due while one is in flight waits for the
next.

A load reads the checkpoint back into a snapshot, checks its fingerprint against the marker's,
and restores it into the live objects with :meth:`Snapshot.restore`, as a spare restores a
fetched state.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from torchpass_p2p.transfer import Snapshot

from .schedule import Schedule
from .settings import CheckpointSettings
from .store import Marker, checkpoint_path, prune, read_marker, same_job, write_marker

__all__ = ["CheckpointError", "Checkpointer", "load"]

CLOSE_WAIT_S = 60.0
"""How long a member that ends waits for its save in flight to commit (no progress for this
long: the save is abandoned, left incomplete, never resumed from)."""

# No process group exists for DCP (ours are built apart from torch.distributed's default
# group): a single writer and a single reader is what is meant, and DCP says so each call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: incomplete, unreadable, or not the state its
    marker describes."""


class _Staged(AsyncStager):
    """The state handed to DCP is already a private copy (module docstring): no second one."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:  # type: ignore[override]
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _as_state_dict(snap: Snapshot) -> dict[str, Any]:
    tree = torch.frombuffer(bytearray(snap.tree), dtype=torch.uint8)
    return {"tensors": {e.name: t for e, t in zip(snap.table, snap.tensors, strict=True)},
            "snapshot": {"tree": tree, "names": [e.name for e in snap.table],
                         "step": snap.step, "chunk_bytes": snap.chunk_bytes}}


class Checkpointer:
    """The saves of the member holding rank 0 (module docstring).

    Args:
        settings: directory, interval, how many to keep, run id.
        start_step: the step the job started or resumed at (not saved again).
        capture: a copy of the state at the current step boundary
            (``Snapshot.capture(..., copy=True)``).
        job: the job as the members agree on it, with its ``world_size``
            (``Session.describe()``), recorded in the marker.
        log: the member's timeline (``log(event, **fields)``).
        say: one line for the user (default: to stderr).
        clock: seconds, monotonic.
    """

    def __init__(self, settings: CheckpointSettings, start_step: int, *,
                 capture: Callable[[], Snapshot], job: Callable[[], Mapping[str, Any]],
                 log: Callable[..., None], say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.capture, self.job = capture, job
        self.log = log
        self.say = say or _say
        self.clock = clock
        self.schedule = Schedule(settings.every, settings.mtbf_s, start_step, clock())
        self.enabled = True
        """False: no save starts (the benchmark's "off" blocks)."""
        self.saves = 0
        """Saves committed by this member."""
        self._committed: threading.Event | None = None
        """Set once the save in flight committed or failed."""

    @property
    def busy(self) -> bool:
        """A save is in flight (not yet committed or failed)."""
        committed = self._committed
        return committed is not None and not committed.is_set()

    def maybe_save(self, step: int) -> bool:
        """At a step boundary: start a save of the state after ``step`` steps when one is due
        and none is in flight. Returns whether a save started."""
        if not self.enabled or self.busy or not self.schedule.due(step, self.clock()):
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        """Start a save of the state after ``step`` steps now (module docstring). A folder of
        that step left incomplete is replaced; a complete one is kept (it holds this state)."""
        directory = self.settings.directory
        if read_marker(directory, step) is not None:
            return
        t0, wall = self.clock(), time.time()
        folder = checkpoint_path(directory, step)
        shutil.rmtree(folder, ignore_errors=True)
        snap = self.capture()
        job = dict(self.job())
        future = dcp.async_save(_as_state_dict(snap), checkpoint_id=str(folder), no_dist=True,
                                async_stager=_Staged())
        assert isinstance(future, Future)  # a stager that returns the state, not a future
        stage_s = self.clock() - t0
        self.schedule.started(step, t0)
        marker = Marker(self.settings.run_id, step, int(job["world_size"]), job, "",
                        snap.total_bytes, wall, stage_s)
        committed = self._committed = threading.Event()
        self.log("checkpoint_started", step=step, stage_s=round(stage_s, 6),
                 bytes=snap.total_bytes)
        future.add_done_callback(lambda f: self._commit(f, snap, marker, t0, committed))

    def _commit(self, future: Future[Any], snap: Snapshot, marker: Marker, t0: float,
                committed: threading.Event) -> None:
        """DCP's thread, once its save returned: fingerprint, marker, prune."""
        try:
            self._commit_now(future, snap, marker, t0)
        finally:
            committed.set()

    def _commit_now(self, future: Future[Any], snap: Snapshot, marker: Marker,
                    t0: float) -> None:
        step = marker.step
        try:
            future.result()
            fingerprint = snap.fingerprint().hex()
            save_s = self.clock() - t0
            done = Marker(**{**marker.__dict__, "fingerprint": fingerprint, "save_s": save_s})
            write_marker(self.settings.directory, done)
            removed = prune(self.settings.directory, self.settings.keep)
        except Exception as exc:  # noqa: BLE001 - a failed save costs this checkpoint only
            self.log("checkpoint_failed", step=step, error=f"{type(exc).__name__}: {exc}"[:300])
            self.say(f"checkpoint of step {step} failed, training goes on: "
                     f"{type(exc).__name__}: {exc}")
            return
        self.saves += 1
        self.log("checkpoint_saved", step=step, stage_s=round(marker.stage_s, 6),
                 save_s=round(save_s, 6), bytes=snap.total_bytes, fingerprint=fingerprint,
                 removed=removed)
        interval = self.schedule.measured(marker.stage_s, save_s)
        if interval is not None:
            self.say(f"checkpoint every {interval:.1f} s: Young's sqrt(2 x {marker.stage_s:.4f} "
                     f"s x MTBF {self.settings.mtbf_s:g} s), at least the save's "
                     f"{save_s:.3f} s (step {step}: {snap.total_bytes} bytes, "
                     f"{marker.stage_s:.4f} s on the training thread, {save_s:.3f} s in all)")

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Wait up to ``timeout_s`` seconds for the save in flight to commit."""
        committed = self._committed
        if committed is not None and not committed.wait(timeout_s):
            self.log("checkpoint_abandoned", step=self.schedule.last_step, waited_s=timeout_s)


def load(settings: CheckpointSettings, step: int, objects: Mapping[str, Any], *,
         world_size: int, job: Mapping[str, Any]) -> Marker:
    """Restore the checkpoint of ``step`` in ``settings.directory`` into ``objects``; returns
    its marker.

    Raises:
        CheckpointError: it is not complete, or what it holds is not the state its marker
            fingerprinted.
        torchpass_p2p.checkpoint.NotSameJob: it is of another run id, world size or job.
        ValueError: the state does not load into ``objects`` (another model, say).
    """
    marker = read_marker(settings.directory, step)
    if marker is None:
        raise CheckpointError(f"no complete checkpoint of step {step} in "
                              f"{settings.directory} (no marker, or no DCP metadata)")
    same_job(marker, run_id=settings.run_id, world_size=world_size, job=job)
    folder = checkpoint_path(settings.directory, step)
    state: dict[str, Any] = {}
    try:
        # DCP's public load fills a template; this state's structure is in the checkpoint
        # alone, so it is read as torch's own dcp_to_torch_save reads one.
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(folder)),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        meta = state["snapshot"]
        names = list(meta["names"])
        snap = Snapshot.of_tensors(int(meta["step"]), names,
                                   [state["tensors"][n] for n in names],
                                   bytes(meta["tree"].numpy().tobytes()),
                                   int(meta["chunk_bytes"]))
    except (KeyError, TypeError, ValueError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"{folder}: unreadable: {type(exc).__name__}: {exc}") from exc
    if snap.step != step or snap.fingerprint().hex() != marker.fingerprint:
        raise CheckpointError(f"{folder}: the state read back is not the one saved (its "
                              "fingerprint differs from the marker's)")
    snap.restore(objects)
    return marker


def _say(line: str) -> None:
    # One write: the launcher's children share its stderr.
    sys.stderr.write(f"torchpass_p2p: {line}\n")
    sys.stderr.flush()
