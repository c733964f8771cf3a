"""The resume state sent over the new configuration's own group (``state_transport="pg"``).

Theory of operation. Once the group of a configuration has formed, every member all-gathers
``[lacks the state, its step, up to GROUP_SOURCES wanted source ranks]`` (int64): a member
that lacks the state of ``resume`` names the ranks its plan gives as sources, by affinity.
Every member then runs the same transfers, one receiver at a time in rank order, each from the
sources it asked for that hold the state (or the first :data:`GROUP_SOURCES` holders). A
watch-bounded all-gather before each transfer keeps a receiver from waiting for sources still
busy with the one before (a transfer's own waits end after ``progress_timeout_s``, and gloo then
closes the group). A transfer runs in a helper thread while the calling thread watches for a
newer configuration, as every wait on a group does (:func:`run_watched`); when one comes the
group's connections are closed: nothing more completes on it, and every member moves on.
Every member must use the same ``state_transport``. Over NCCL this is NVLink or RDMA
(:class:`~torchpass_p2p.transfer.pg_transport.PgTransport`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import torch

from torchpass_p2p.collective import ManagedGroup, Superseded
from torchpass_p2p.transfer import FetchResult, Snapshot
from torchpass_p2p.transfer.pg_transport import PgTransport
from torchpass_p2p.transfer.state_transport import TransferPlan

__all__ = ["GROUP_SOURCES", "SourceTransport", "run_watched", "transfer_over_group"]

GROUP_SOURCES = 4
"""Most sources a member receives from over the group: each keeps a window of chunks in flight
(4 x 16 MiB, in staging buffers over NCCL), and striping over more adds little."""
WATCH_SLICE_S = 0.05
"""Seconds between looks for a newer configuration while a transfer runs."""

Restore = Callable[[FetchResult, int, float, tuple[int, ...]], Snapshot]
"""``restore(result, config_id, seconds, source_ranks)``: load what was received into the live
objects, check it and return the state as captured (the trainer's part)."""


class SourceTransport(PgTransport):
    """One transfer over a configuration's group, seen from a source: each chunk it sent is
    reported to ``on_served(step, served_bytes, total_bytes)`` (the ``serve`` faults), bytes
    counted per receiver as the TCP server counts them per transfer."""

    def __init__(self, group: ManagedGroup, snapshot: Snapshot,
                 on_served: Callable[[int, int, int], None] | None) -> None:
        # The group's device, not the current one: the transfer runs in a helper thread.
        super().__init__(group.process_group, device=group.device)
        self._snapshot = snapshot
        self._on_served = on_served
        self._sent = 0

    def chunk_sent(self, index: int) -> None:
        if self._on_served is not None:
            self._sent += self._snapshot.chunk_range(index)[1]
            self._on_served(self._snapshot.step, self._sent, self._snapshot.total_bytes)


def transfer_over_group(group: ManagedGroup, configuration: Any, plan: Any, resume: int,
                        snap: Snapshot | None, *, step: int, into: Mapping[str, Any],
                        restore: Restore, watch: Callable[[], bool],
                        on_served: Callable[[int, int, int], None] | None,
                        log: Callable[..., None]) -> Snapshot | None:
    """Run this member's part of the transfers of ``configuration`` (module docstring).

    ``snap``: the state of ``resume`` this member holds, or None if it lacks it; ``step``: its
    step; ``into``: the live objects a received state is loaded into (``restore`` does it);
    ``watch()``: True once a newer configuration is due; ``log(event, **fields)``: the
    trainer's timeline. Returns what ``restore`` returned for the state this member received,
    else None.

    Raises:
        CollectiveError, Superseded: an all-gather failed or a newer configuration came.
        TransferFailed: a transfer this member took part in failed; the group is then unusable
            (gloo closes it on a timed-out wait). A death, or a stall past the lease, brings the
            next configuration; anything else (every source sending bad bytes) is a bug that TCP
            would not survive either.
        RuntimeError: a member that claims the state is not at ``resume`` (a bug).
    """
    c, me = configuration.config_id, group.spec.rank
    ranks = list(configuration.ranks)
    wanted = [-1] * GROUP_SOURCES
    if snap is None and plan is not None:
        top = [ranks.index(m) for m in dict(plan.sources).get(me, ())
               if m in ranks][:GROUP_SOURCES]
        wanted[:len(top)] = top
    said = [x.tolist() for x in group.allgather(
        torch.tensor([int(snap is None), step, *wanted], dtype=torch.int64), watch=watch)]
    receivers = [r for r, x in enumerate(said) if x[0]]
    holders = [r for r, x in enumerate(said) if not x[0]]
    if any(said[r][1] != resume for r in holders):
        raise RuntimeError(f"configuration {c}: a member claims the state at a step other "
                           f"than {resume}: {said}")
    received = None
    for r in receivers:
        group.allgather(torch.zeros(1), watch=watch)  # the one before is done
        sources = [s for s in said[r][2:] if s in holders] or holders[:GROUP_SOURCES]
        tp = TransferPlan(sources=tuple(sources), config_id=c, receiver=r, step=resume)
        if r == me:
            t0 = time.monotonic()
            log("fetch_started", config_id=c, step=resume, sources=len(sources),
                over_group=True)
            receiver = PgTransport(group.process_group, device=group.device)
            result = run_watched(group, receiver.receive(tp, into=into), watch,
                                 receiver.abandon)
            received = restore(result, c, time.monotonic() - t0, tuple(sources))
        elif me in sources:
            assert snap is not None
            run_watched(group, SourceTransport(group, snap, on_served).provide(snap, tp), watch)
    return received


def run_watched(group: ManagedGroup, transfer: Coroutine[Any, Any, Any],
                watch: Callable[[], bool],
                abandon: Callable[[], None] | None = None) -> Any:
    """Run ``transfer`` (one transfer over ``group``) in a helper thread while this thread
    watches for a newer configuration. Once one is due (or ``watch()`` raises: this member was
    removed, its agent failed), ``abandon()`` (the receiver's :meth:`PgTransport.abandon`:
    nothing more is copied into its target) and the group is interrupted
    (:meth:`ManagedGroup.interrupt`: NCCL aborts, gloo closes every connection), after which
    nothing more completes on it here or at the peers. The helper is not waited for: a wait
    on a message that was streaming, or on a peer gloo never reported dead, ends only by the
    progress timeout (10 s); its executor's threads then end, and delay the interpreter's
    exit until then unless the process ends by ``exit_process``, as the trainer's does.
    Returns what ``transfer`` returned and raises what it raised; :class:`Superseded` once
    interrupted."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def body() -> None:
        try:
            box["result"] = asyncio.run(transfer)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=body, name=f"transfer-{group.config_id}", daemon=True).start()
    while not done.wait(WATCH_SLICE_S):
        try:
            due = watch()
        except BaseException:
            _give_up(group, abandon)
            raise
        if due:
            _give_up(group, abandon)
            raise Superseded
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _give_up(group: ManagedGroup, abandon: Callable[[], None] | None) -> None:
    if abandon is not None:
        abandon()
    group.interrupt()
