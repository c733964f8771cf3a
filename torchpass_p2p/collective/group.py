"""One process group per configuration, waited on in slices and abandoned, never aborted.

Why one module of this size: every operation, the states and the closing of connections keep
one rule (never block in gloo, never free a group in flight) that holds only if they live
together.

Theory of operation (docs/design.md sections 8 and 13). gloo operations cannot be aborted in place:
``abort()``, ``shutdown()`` and destroying the group from another thread all return without
freeing a blocked operation (a wait that times out closes every connection of the group,
:func:`close_connections`: nothing completes on it any more, but an operation whose message was
streaming still waits out its own deadline). So a :class:`ManagedGroup` never blocks in one:
every operation is started asynchronously, and the caller's thread waits for its completion in
slices of
``slice_s`` seconds, calling ``watch()`` between slices and at once after
:meth:`ManagedGroup.wake` (gloo: on the work's future; NCCL: by polling the work's completion,
:func:`_poll_completed`). When ``watch()`` says a newer
configuration is due, the wait ends with :class:`Superseded` and the group is *stuck*: it stays
referenced (in :data:`_STUCK`; destroying it would block) while the next configuration's group
is built alongside. When the operation fails (a peer's connection closed), the wait ends with
:class:`CollectiveError` and the group is *failed*: every reference to it, its work objects and
the backend's exception is dropped at once, so its sockets close and the error reaches the next
peer immediately instead of after the group timeout.

Each operation takes fresh buffers that the caller never reads before the operation completed:
an abandoned operation may still write into them later (a woken peer finishing its send), and
must never write into live training state.

States: ``ready`` -> ``failed`` (an operation failed) | ``stuck`` (superseded while one was in
flight) | ``closed`` (:meth:`ManagedGroup.close`). Only ``ready`` accepts operations.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from torchpass_p2p.core.messages import format_member_id

from .forksafe import sockets_made_by
from .reduce import divide, from_shards, sum_in_rank_order, to_shards
from .rendezvous import STORE_TIMEOUT_S, ServiceDirectory, StoreKeeper, connect_store

__all__ = ["CollectiveError", "GroupSpec", "ManagedGroup", "Superseded", "build_group",
           "close_connections", "exit_process"]

Watch = Callable[[], bool]
"""Called between wait slices; True: stop waiting, a newer configuration is due."""

SLICE_S = 0.05
"""Seconds between ``watch()`` calls while an operation or a rendezvous is in flight: a new
configuration is noticed within 50 ms, and a poll costs microseconds."""
SHARDED_MIN_BYTES = 1 << 20
"""From this size on :meth:`ManagedGroup.mean_in_rank_order` sums shards (all-to-all, then
all-gather) instead of gathering whole buffers. Measured with 4 gloo processes on this 2-core
machine (``python -m benchmarks.rank_order_mean``): 2.8x faster at 10 and 100 MB, 1.2x at
1 MB, and 0.9x at 0.4 MB, where the extra round trip costs more than the bytes it saves."""
CLOSE_TAG = 4
"""The point-to-point tag :func:`close_connections` receives on: one nobody sends (the state
transfer's tags are others)."""
CLOSE_WAIT = datetime.timedelta(milliseconds=1)
"""How long :func:`close_connections` waits on its never-matched receive: any timeout closes."""
POLL_MIN_S = 50e-6
POLL_MAX_S = 1e-3
"""Bounds of the backoff between completion polls of an NCCL operation: at most 1 ms added
to an operation's latency, about a thousand event queries a second while one is in flight."""
GROUP_TIMEOUT_S = 1800.0
"""The backend's own operation timeout (torch's 30-minute default). Never what ends a wait
here: a new configuration does, via ``watch``."""

_STUCK: list[Any] = []
"""Groups superseded with an operation in flight, kept alive until the process exits
(destroying one blocks in gloo)."""
_FORMING = [0]
"""Groups being formed in :func:`build_group`'s helper threads (under ``_FORMING_LOCK``)."""
_FORMING_LOCK = threading.Lock()


class CollectiveError(RuntimeError):
    """An operation of the group failed (a peer closed its connection or timed out). The
    group is failed; build the next configuration's. ``config_id``: the group's."""

    def __init__(self, message: str, config_id: int) -> None:
        super().__init__(message)
        self.config_id = config_id


class Superseded(Exception):
    """``watch()`` asked to stop waiting (a newer configuration is due) before the operation or
    the rendezvous completed."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Who this member is in the group of one configuration.

    Attributes:
        config_id: the configuration (fencing token; part of every store key).
        rank: this member's rank, ``0 <= rank < world_size``.
        world_size: ranks in the configuration (none vacant).
        holder: member id holding rank 0 (hosts the store).
        attempt: 0 for the configuration's first group; ``a > 0`` for its ``a``-th regroup
            (formed again after a collective failed with no member failing: its own store and
            key namespace, :mod:`.rendezvous`).
    """

    config_id: int
    rank: int
    world_size: int
    holder: int
    attempt: int = 0

    @classmethod
    def of(cls, configuration: Any, member_id: int) -> GroupSpec:
        """The spec of ``member_id`` in a :class:`~torchpass_p2p.core.Configuration`.

        Raises:
            ValueError: the member holds no rank there, or a rank is vacant.
        """
        rank = configuration.rank_of(member_id)
        if rank is None:
            raise ValueError(f"member {format_member_id(member_id)} holds no rank in configuration "
                             f"{configuration.config_id}")
        if configuration.vacant_ranks:
            raise ValueError(f"configuration {configuration.config_id} has vacant ranks "
                             f"{configuration.vacant_ranks}")
        return cls(configuration.config_id, rank, configuration.world_size,
                   configuration.ranks[0])


def _wait_set(done: threading.Event, watch: Watch | None, slice_s: float) -> None:
    while not done.wait(slice_s):
        if watch is not None and watch():
            raise Superseded


def _wait_future(future: Any, wake: threading.Event, watch: Watch | None,
                 slice_s: float) -> None:
    """Wait for a gloo operation's ``future`` (gloo completes it when the operation is done),
    calling ``watch()`` every ``slice_s`` and at once when ``wake`` is set by
    :meth:`ManagedGroup.wake` (the future's completion sets it too)."""
    while not future.done():
        if wake.wait(slice_s):
            wake.clear()  # before the check below, so a completion is never missed
            if future.done():
                return
        if watch is not None and watch():
            raise Superseded


def _poll_completed(work: Any, wake: threading.Event, watch: Watch | None,
                    slice_s: float) -> None:
    """Wait for an NCCL ``work`` by polling ``is_completed()`` (a query of its CUDA end event
    that never blocks: torch's ``WorkNCCL::isCompleted``), calling ``watch()`` every
    ``slice_s`` and at the first poll after ``wake`` is set. NCCL marks a work's future
    complete once the kernel is enqueued and its ``wait()`` only orders streams, so neither
    says that a peer took part: a hung peer would block the host later, in a copy of the
    result, where no watch runs. Polls back off from :data:`POLL_MIN_S` to
    :data:`POLL_MAX_S`. Not yet run on a GPU."""
    pause, next_watch = POLL_MIN_S, time.monotonic() + slice_s
    while not work.is_completed():
        if time.monotonic() >= next_watch or wake.is_set():
            wake.clear()
            if watch is not None and watch():
                raise Superseded
            next_watch = time.monotonic() + slice_s
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)


def build_group(spec: GroupSpec, directory: ServiceDirectory, keeper: StoreKeeper, *,
                backend: str = "gloo", watch: Watch | None = None, slice_s: float = SLICE_S,
                timeout_s: float = STORE_TIMEOUT_S, device: torch.device | None = None,
                ) -> ManagedGroup:
    """Rendezvous and build the group of ``spec.config_id`` (attempt ``spec.attempt``).

    The rendezvous and the backend's connection setup run in a helper thread; this thread waits
    in slices and stops with :class:`Superseded` when ``watch()`` is true (the helper then
    gives up on its own within ``timeout_s``).

    Args:
        spec: this member's place in the configuration.
        directory: where the store's port is announced (the agent).
        keeper: this process's hosted stores.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors; needs a CUDA build).
        watch: stop condition checked every ``slice_s`` seconds.
        timeout_s: longest the rendezvous waits for the other members.
        device: the CUDA device for ``"nccl"``.

    Returns:
        A ``ready`` :class:`ManagedGroup`; about 5 ms after the last member arrives (gloo).

    Raises:
        Superseded: ``watch()`` was true first.
        CollectiveError: the rendezvous failed (store unreachable, a member never came).
        ValueError: unknown backend.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; expected 'gloo' or 'nccl'")
    done = threading.Event()
    box: dict[str, Any] = {}

    def form() -> None:
        try:
            store = connect_store(spec.config_id, spec.rank, spec.holder, directory, keeper,
                                  timeout_s=timeout_s, attempt=spec.attempt)
            box["pg"] = _make_pg(backend, store, spec, device)
        except Exception as exc:  # reported to the waiting thread as text only
            box["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            with _FORMING_LOCK:
                _FORMING[0] -= 1
            done.set()

    with _FORMING_LOCK:
        _FORMING[0] += 1

    started = time.monotonic()
    threading.Thread(target=form, name=f"rendezvous-{spec.config_id}.{spec.attempt}",
                     daemon=True).start()
    _wait_set(done, watch, slice_s)
    if "error" in box:
        again = f" (attempt {spec.attempt})" if spec.attempt else ""
        raise CollectiveError(f"rendezvous of configuration {spec.config_id}{again} failed: "
                              f"{box['error']}", spec.config_id)
    return ManagedGroup(box["pg"], spec, backend, time.monotonic() - started, device=device)


def _make_pg(backend: str, store: dist.Store, spec: GroupSpec,
             device: torch.device | None) -> Any:
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    if backend == "gloo":
        # its connections must close when this process drops it, forked children or not
        return sockets_made_by(lambda: dist.ProcessGroupGloo(store, spec.rank,
                                                             spec.world_size, timeout))
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise RuntimeError("this torch build has no NCCL")
    opts = nccl.Options()
    opts._timeout = timeout
    if device is not None:
        torch.cuda.set_device(device)
    return nccl(store, spec.rank, spec.world_size, opts)


def close_connections(pg: Any, peers: list[int] | tuple[int, ...]) -> bool:
    """Close every connection of process group ``pg`` from this thread, so that no operation
    in flight on it, here or at its peers, can complete (and write into its buffers) any more:
    those still queued fail at once; one whose message is streaming when the pair closes
    (gloo has taken it off the queue) ends only by its own deadline, with nothing more
    written. gloo offers no abort that frees a posted operation (docs/design.md section 13), but a
    wait that times out closes every connection of the group (measured: the next operation with
    any peer fails with "Application timeout caused pair closure"): a receive from a peer of
    ``peers`` on :data:`CLOSE_TAG`, which nobody sends, waited on for :data:`CLOSE_WAIT`; a
    peer whose connection is already closed fails it at once, so the next is tried. NCCL:
    ``abort()``. Returns whether the group was closed (False: it could not be, or every pair
    tried was already closed). Never raises."""
    if pg.name() == "nccl":
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - best effort: the group is given up
            return False
        return True
    for peer in peers:
        try:
            pg.recv([torch.empty(1, dtype=torch.uint8)], peer, CLOSE_TAG).wait(CLOSE_WAIT)
        except RuntimeError as e:
            # gloo's own timeout, not a closed pair's socket error ("Connection timed out")
            if "timed out waiting" in str(e).lower():
                return True
    return False


class ManagedGroup:
    """The process group of one configuration (module docstring). Build with
    :func:`build_group`.

    Attributes:
        spec: this member's place in it.
        backend: ``"gloo"`` or ``"nccl"``.
        formed_s: seconds the rendezvous and connection setup took here.
        state: ``ready``, ``failed``, ``stuck`` or ``closed``.
        device: where operations run: NCCL's CUDA device (a tensor elsewhere, such as the
            trainer's small CPU votes, is copied there and its result back), else None.
    """

    def __init__(self, pg: Any, spec: GroupSpec, backend: str, formed_s: float = 0.0, *,
                 device: torch.device | None = None) -> None:
        self._pg: Any = pg
        self.spec = spec
        self.backend = backend
        self.formed_s = formed_s
        self.state = "ready"
        self.device = device
        self._wake = threading.Event()
        self._in_flight = 0  # launched and not completed (a step's buckets)
        if backend == "nccl" and device is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def wake(self) -> None:
        """Have the operation in flight call its ``watch`` now instead of at the end of its
        wait slice. Thread-safe: for the thread that learns of a newer configuration (the
        agent's, through ``Agent.on_change``); the change is noticed in microseconds
        instead of up to ``slice_s`` later."""
        self._wake.set()

    @property
    def process_group(self) -> Any:
        """The backend's ``ProcessGroup`` (for point-to-point use, e.g. the state transfer's
        :class:`~torchpass_p2p.transfer.pg_transport.PgTransport`); None unless ``ready``."""
        return self._pg if self.state == "ready" else None

    @property
    def config_id(self) -> int:
        return self.spec.config_id

    # ------------------------------------------------------------------ operations

    def allgather(self, tensor: torch.Tensor, *, watch: Watch | None = None,
                  slice_s: float = SLICE_S) -> list[torch.Tensor]:
        """Every rank's ``tensor``: a list of ``world_size`` new tensors, entry ``r`` from rank
        ``r`` (shape and dtype of ``tensor``, equal on every rank).

        Raises:
            CollectiveError: the operation failed; the group is failed (stuck, its
                connections closed, over gloo with other operations in flight).
            Superseded: ``watch()`` was true first; the group is stuck.
            RuntimeError: the group is not ``ready`` (local misuse).
        """
        src = self._wire(tensor)
        out = [torch.empty_like(src) for _ in range(self.spec.world_size)]
        self._run(lambda pg: pg.allgather([out], [src]), watch, slice_s)
        return [o.to(tensor.device) for o in out]

    def exchange(self, tensor: torch.Tensor, *, watch: Watch | None = None,
                 slice_s: float = SLICE_S) -> torch.Tensor:
        """Every rank's ``tensor`` as the rows of one new ``[world_size, numel]`` tensor, row
        ``r`` from rank ``r`` (dtype and device of ``tensor``): :meth:`allgather`'s result, by
        one all-to-all in which every rank sends its tensor to every other at once. gloo's
        all-gather passes each tensor along a ring instead, ``world_size - 1`` hops one after
        another; for a small tensor each hop costs the next rank's wake-up, not the bytes, and
        with more ranks than cores that is a scheduling delay per hop. For small tensors only:
        the send side holds ``world_size`` copies. Errors as :meth:`allgather`."""
        work, recv = self.launch_exchange(tensor)
        self.complete(work, watch=watch, slice_s=slice_s)
        return recv.to(tensor.device)

    def launch_exchange(self, tensor: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """:meth:`exchange` launched, not waited for: ``(work, rows)``; ``rows`` (on the
        group's device) holds every rank's ``tensor`` once :meth:`complete` returned for
        ``work``. Raises as :meth:`launch`."""
        n = self.spec.world_size
        send = self._wire(tensor).reshape(1, -1).expand(n, -1).contiguous()
        recv = torch.empty_like(send)
        return self.launch(lambda pg: pg.alltoall_base(recv, send, [], [])), recv

    def broadcast(self, tensor: torch.Tensor, root: int, *, watch: Watch | None = None,
                  slice_s: float = SLICE_S) -> None:
        """Rank ``root``'s ``tensor`` into every rank's ``tensor``, in place (contiguous, on
        the group's device, the same shape and dtype on every rank). Errors as
        :meth:`allgather`."""
        self._run(lambda pg: pg.broadcast(tensor, root), watch, slice_s)

    def allreduce_sum(self, tensor: torch.Tensor, *, watch: Watch | None = None,
                      slice_s: float = SLICE_S) -> torch.Tensor:
        """The backend's sum of every rank's ``tensor``, in a new tensor (order of the sum is
        the backend's). Errors as :meth:`allgather`."""
        buf = self._wire(tensor)
        self._run(lambda pg: pg.allreduce([buf]), watch, slice_s)
        return buf.to(tensor.device)

    def mean_in_rank_order(self, tensor: torch.Tensor, *, watch: Watch | None = None,
                           slice_s: float = SLICE_S) -> torch.Tensor:
        """``(t_0 + t_1 + ... + t_{n-1}) / n`` summed left to right in rank order: the same
        bits for the same inputs whatever the backend's algorithm (:mod:`.reduce`), in a new
        tensor of ``tensor``'s shape, dtype and device. From :data:`SHARDED_MIN_BYTES` on, each
        rank sums one shard (an all-to-all, then an all-gather of the sums: three buffers the
        size of ``tensor`` in flight); below it, one all-gather of whole buffers (``n`` of
        them, one round trip fewer). Errors as :meth:`allgather`."""
        n = self.spec.world_size
        if n == 1 or tensor.numel() * tensor.element_size() < SHARDED_MIN_BYTES:
            parts = self.allgather(tensor, watch=watch, slice_s=slice_s)
            total = sum_in_rank_order(parts)
            del parts
            return divide(total, n)
        send = to_shards(tensor.detach().to(self.device or tensor.device), n)
        recv = torch.empty_like(send)
        self._run(lambda pg: pg.alltoall_base(recv, send, [], []), watch, slice_s)
        mine = divide(sum_in_rank_order(recv.unbind(0)), n)
        gathered = torch.empty_like(send).view(-1)  # gloo splits the output along dim 0
        # _allgather_base: all_gather_into_tensor's ProcessGroup method in every torch 2.x
        self._run(lambda pg: pg._allgather_base(gathered, mine), watch, slice_s)
        return from_shards(gathered, tensor).to(tensor.device)

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """A fresh copy of ``tensor`` on the group's device (its own if the group has none)."""
        if self.device is None or tensor.device == self.device:
            return tensor.detach().clone()
        return tensor.detach().to(self.device, copy=True)

    def _run(self, start: Callable[[Any], Any], watch: Watch | None, slice_s: float) -> None:
        self.complete(self.launch(start), watch=watch, slice_s=slice_s)

    def launch(self, start: Callable[[Any], Any]) -> Any:
        """Start an operation: ``start(process_group)`` returns the backend's work, which is
        returned for :meth:`complete`. Every rank must launch the same operations in the
        same order. Raises ``RuntimeError`` if the group is not ``ready``."""
        if self.state != "ready":
            raise RuntimeError(f"group of configuration {self.config_id} is {self.state}")
        work = start(self._pg)
        self._in_flight += 1
        return work

    def complete(self, work: Any, *, watch: Watch | None = None,
                 slice_s: float = SLICE_S) -> None:
        """Wait for a launched ``work`` as every operation is waited for (module docstring).

        Raises:
            CollectiveError: the operation failed; the group is failed.
            Superseded: ``watch()`` was true first; the group is stuck.
            RuntimeError: the group stopped being ``ready`` since the launch.
        """
        if self.state != "ready":
            raise RuntimeError(f"group of configuration {self.config_id} is {self.state}")
        try:
            if self.backend == "nccl":
                _poll_completed(work, self._wake, watch, slice_s)
            else:
                future = work.get_future()
                future.add_done_callback(lambda _fut: self._wake.set())
                _wait_future(future, self._wake, watch, slice_s)
        except BaseException:  # Superseded, or the watch's own exception: left in flight
            self._retire("stuck", work)
            raise
        self._in_flight = max(0, self._in_flight - 1)
        error = None
        try:
            work.wait()
        except Exception as exc:  # the backend's error; keep its text, not the object
            error = f"{type(exc).__name__}: {exc}"
        del work
        if error is not None:
            if self._in_flight and self.backend == "gloo":
                # Other operations of this group are in flight (a step's buckets): dropping
                # the last reference would run gloo's destructor, which waits for them, and
                # they may never end (a peer that gave the group up keeps its own referenced).
                # Closing the connections fails them, here and at the peers, at once.
                self.interrupt()
            else:
                self._retire("failed", None)
            raise CollectiveError(f"configuration {self.config_id}: {error}", self.config_id)

    # ------------------------------------------------------------------ lifecycle

    def abandon(self) -> None:
        """Give the group up without an operation in flight (e.g. a newer configuration arrived
        between operations): references dropped, like a failed group."""
        if self.state == "ready":
            self._retire("failed", None)

    def interrupt(self) -> None:
        """Give the group up while the caller's own operation on :attr:`process_group` (a
        point-to-point state transfer) is in flight in another thread: its connections are
        closed (:func:`close_connections`: NCCL aborts, gloo closes them by a timed-out wait),
        which fails that operation at once, and its peers' operations on the group too. The
        group is kept referenced (stuck)."""
        if self.state == "ready":
            pg, me = self._pg, self.spec.rank
            close_connections(pg, [r for r in range(self.spec.world_size) if r != me])
            self._pg = None
            self.state = "stuck"
            _STUCK.append((pg, None))

    def _retire(self, state: str, work: Any) -> None:
        if state == "stuck":
            if self.backend == "nccl":
                try:
                    self._pg.abort()  # NCCL can abort in place (gloo cannot)
                except Exception:  # noqa: BLE001 - best effort; the group is abandoned
                    pass
            _STUCK.append((self._pg, work))
        self._pg = None
        self.state = state

    def close(self) -> None:
        """Shut a ``ready`` group down (its connections close); a failed or stuck one is only
        dropped. Idempotent."""
        pg, self._pg = self._pg, None
        if pg is not None and self.state == "ready":
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - nothing more to do at teardown
                pass
        if self.state == "ready":
            self.state = "closed"

    def __repr__(self) -> str:
        s = self.spec
        again = f" attempt {s.attempt}" if s.attempt else ""
        return (f"ManagedGroup(config {s.config_id}{again}, rank {s.rank}/{s.world_size}, "
                f"{self.backend}, {self.state})")


def exit_process(code: int) -> NoReturn:
    """End this process with ``code`` at once: flush the standard streams and logging, then
    ``os._exit``, skipping the interpreter's teardown. Call it after the healthy groups were
    closed and the agent stopped.

    Two reasons, both measured here. A stuck gloo group (a peer hung mid-operation) can be
    neither aborted nor destroyed (docs/design.md section 13): its destructor blocks, or aborts the
    process (``terminate called after throwing gloo::IoException``) once the hung peer's sockets
    close. And the teardown itself (a full garbage collection of torch's modules, then torch's
    static destructors re-computing dispatch tables) costs seconds of CPU: a rank removed in
    the middle of a job spent 5 s of a core on it while the surviving ranks trained beside it on
    this 2-core host, slowing every step ~40 % until it was gone. ``atexit`` handlers do not run.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stuck_groups() -> int:
    """How many superseded groups this process keeps alive, counting the groups still being
    formed in a helper thread (one given up by :func:`build_group` waits out its store
    timeout inside the backend's constructor; the interpreter's exit would abort the process
    under it)."""
    with _FORMING_LOCK:
        return len(_STUCK) + _FORMING[0]
