"""State transfer over a process group's send/recv (gloo here; NCCL where GPUs are linked).

Why one module of this size: the sending and receiving sides share one frame schedule (the
order of status words and chunks on the group) that must change in both at once.

Imports on CPU-only machines (torch.distributed is always present in torch wheels). The group
is the one the members built for the current ``config_id``: membership gating happened when it
formed, so no handshake is run here, and the data plane is gloo's, unauthenticated (README,
threat model): every chunk's digest (XXH3 by default: it catches corruption, not an attacker;
``fingerprint``) must equal the manifest's, and the manifest's fingerprint (recomputed by the
receiver) must be the agreed one. The TCP transport's per-chunk MACs (``chunkmac``) have no
counterpart here.

Protocol (ranks from the plan; source ``j`` of ``n``; every wait bounded, see below):

1. each source sends its manifest: an ``int64[2]`` header (length, wire layout: 0 a message
   per tensor segment, 1 one staged message per chunk), then ``uint8[length]`` bytes;
2. the receiver checks the sources agree (or match ``expected_fingerprint``) and builds its
   target, receiving in place where it holds matching tensors; a source whose layout is not
   the receiver's is dropped (``bad_manifest``): gloo aborts the process on a message larger
   than the receive posted for it, so the layouts must match before any chunk is received;
3. source ``j`` sends chunks ``i`` with ``i % n == j`` (each as its tensor segments, straight
   from snapshot memory, ``isend``), the receiver posts the matching ``irecv`` into target
   memory, all outstanding at once so every source streams concurrently;
4. the receiver hashes every chunk (worker threads) and compares with the manifest;
5. **repair rounds**: the receiver sends every source still in the transfer a status, an
   ``int64[1]`` count then ``int64[count]`` chunk indices: the chunks it must (re)send in this
   round, striped over those sources; the chunks of a source that died, stalled or sent a bad
   chunk are among them. ``count == 0`` ends the source's part (``provide`` returns);
   ``count == -1`` tells it the receiver gave up. Rounds repeat until every chunk verifies or
   no source is left. While it still works (other sources' parts, hashing), the receiver sends
   a source whose part of the round has arrived ``count == -2`` ("still working") every
   ``KEEPALIVE_FACTOR * T``: that source waits on.

Deadlines ("no progress for T", ``T = plan.progress_timeout_s``): the receiver waits on each
source's receives in order (a thread per source, except on the staged path over NCCL, so it
learns at once that a source's part has arrived), each for at most ``T``. A source whose
connection closes (it died: ``source_failed``) or that sends a bad chunk (``bad_chunk``) is
dropped and its chunks go to the repair round. A receive that does not complete within ``T`` raises
``TransferFailed("no_progress")``: gloo answers a timed-out wait by closing every connection of
the group (measured: the next send to a healthy source fails with "Application timeout caused
pair closure"), so no repair is possible over it; the caller must abandon the group (the
trainer restarts recovery, ``recovery_restarted``, and enters the next configuration with a
group of its own). When every source has died the receiver raises
``TransferFailed("no_sources_left")``, the TCP client's error for the same case; ``failures``
counts each source's reason. A source raises ``TransferFailed("receiver_lost")`` once the
receiver has said nothing for ``STATUS_WAIT_FACTOR * T`` (a slow co-source or a long hash
does not count: the receiver keeps speaking), or as soon as the receiver's connection closes.

Cancelling ``receive``: it closes the group's connections (``close_connections``: gloo cannot
withdraw a posted receive, docs/design.md section 13) and waits, at most ``CANCEL_WAIT_FACTOR * T``,
for its worker threads to end before the ``CancelledError`` propagates. Then no receive into
target memory is posted any more and nothing writes there; what the target holds is
undefined (part of the state). The group is unusable afterwards, as after ``no_progress``,
and the sources fail at once (``send_failed`` / ``receiver_lost``).

Limits: gloo operations cannot be aborted (docs/design.md section 13). A receive given up on may
stay
posted: should its source resume, its bytes can still land in the target; they are the same
bytes (the same agreed state) that a repair round writes there. To be rid of them, drop the
group (every reference) before receiving into the same memory by other means.

Wire memory: gloo sends snapshot memory as it is. NCCL sends only CUDA memory, and snapshots are
host memory (``Snapshot.capture`` stages accelerator tensors to the host), so with ``device``
set (by default for an NCCL group: the caller's current CUDA device, read when ``provide`` or
``receive`` is called and made current in the worker thread) every message passes through
device buffers: a source copies each chunk into one of ``SEND_WINDOW_CHUNKS`` chunk-sized
buffers and sends it as one message; the receiver keeps up to ``SEND_WINDOW_CHUNKS`` times the
number of live sources receives posted, each into a buffer of its own, and copies every
completed one out into target memory before its digest is checked. Device memory: that many
chunk-sized buffers (64 MiB on a source and 128 MiB on a receiver of two sources, with 16 MiB
chunks), plus up to ``SEND_WINDOW_CHUNKS`` per dropped source: a buffer whose receive was given
up on is never reused, so its source's late bytes cannot land in another chunk.

NCCL: it matches send/recv in posting order per peer and ignores tags (this protocol's per-peer
order is the same on both ends); a failed or timed-out operation aborts the communicator, and
posted operations cannot be withdrawn. So over NCCL there is no repair round: the first lost
source (any reason) ends the transfer with ``TransferFailed`` naming it, and the caller must
build a new group (the trainer: that of the configuration that the lost source's removal
brings). A keep-alive goes to a source only once its part of the round has arrived, so it
never sits in that peer's order ahead of a receive of the round. The staged path runs here
over gloo with ``device="cpu"`` (the shared suite and the failover tests); over NCCL it needs
one GPU per rank (NCCL refuses two ranks on one device) and has not yet been run.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from ..collective.group import CLOSE_TAG, close_connections
from . import fingerprint as fp
from .client import FetchResult
from .errors import PeerError, TransferError, TransferFailed
from .frames import DEFAULT_MAX_MANIFEST_BYTES
from .manifest import Manifest, decode_manifest, encode_manifest
from .snapshot import Snapshot
from .state_transport import TransferPlan, Transport

_TAG_MANIFEST = 1
_TAG_DATA = 2
_TAG_STATUS = 3
assert CLOSE_TAG not in (_TAG_MANIFEST, _TAG_DATA, _TAG_STATUS) and CLOSE_TAG < 16
_LAYOUT_SEGMENTS = 0
"""Wire layout (the manifest header's second word): a message per tensor segment."""
_LAYOUT_STAGED = 1
"""Wire layout: one message per chunk, through staging buffers."""
_TAG_REPAIR = 16
"""Chunks of repair round ``r`` travel with tag ``_TAG_REPAIR + r``: a late byte of an earlier
round can never match a later round's receive."""
SEND_WINDOW_CHUNKS = 4
"""Chunks a source keeps in flight (4 x 16 MiB), as the TCP client's window: enough to keep
the pipe full; a source never has more than this much of its stripe posted."""
_STATUS_ABORT = -1
"""Status count: the receiver gave up (``provide`` raises ``receiver_aborted``)."""
_STATUS_WORKING = -2
"""Status count: the receiver still works (a keep-alive); the source waits on."""
KEEPALIVE_FACTOR = 0.5
"""The receiver tells a source whose part of the round has arrived that it still works every
``T / 2``: twice per ``T``, so even the staged path over NCCL (one thread, which looks between
blocking waits of up to ``T``) speaks well within a source's ``STATUS_WAIT_FACTOR * T``."""
STATUS_WAIT_FACTOR = 3
"""A source gives up after ``3 T`` without a word from the receiver: between two keep-alives
the receiver may spend ``T / 2``, then up to ``T`` blocked on one receive (staged, NCCL) and
one chunk's digest; the rest is margin for a loaded host. The receiver gives a status it sends
after a source's part arrived as long to be taken: the source listens only once the hooks of
its last window of chunks have run."""
CANCEL_WAIT_FACTOR = 2
"""A cancelled ``receive`` waits at most ``2 T`` for its worker threads: once the group is
closed their waits fail at once; should the close not reach one, that wait still ends within
``T`` by its own deadline, plus one chunk's copy or digest."""

_ABANDON = ("the group must be abandoned (the trainer restarts recovery in the next "
            "configuration, with a new group)")

log = logging.getLogger(__name__)


class _Stopped(Exception):
    """The receive was cancelled: the worker thread stops at its next look."""


class _Lost(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


def _post(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Post one ``send`` / ``recv`` of a process group; a pair gloo already closed (the peer died)
    can fail the post itself, not only the wait: raises :class:`_Lost` ``source_failed``."""
    try:
        return op(*args, **kwargs)
    except RuntimeError as e:
        raise _Lost("source_failed", str(e)[:300]) from None


def _wait(work: Any, timeout_s: float) -> None:
    """Wait for one send/recv; a closed peer or ``timeout_s`` without completion raises
    :class:`_Lost` (``source_failed`` / ``no_progress``)."""
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        # gloo: "Timed out waiting ..."; NCCL: "... before timing out"; a closed pair's socket
        # error may read "Connection timed out" (the kernel's ETIMEDOUT): a lost peer
        text = str(e).lower()
        timeout = "timed out waiting" in text or "timing out" in text
        reason = "no_progress" if timeout else "source_failed"
        raise _Lost(reason, str(e)[:300]) from None


def _wait_all(works: Sequence[Any], timeout_s: float) -> _Lost | None:
    """Wait for ``works`` in order, each for at most ``timeout_s``; the first loss, or None."""
    try:
        for w in works:
            _wait(w, timeout_s)
    except _Lost as e:
        return e
    return None


class _KeepAlive:
    """The receiver's "still working" to the sources whose part of the round has arrived (they
    wait for a status), every ``interval_s``. Its sends are never waited on (a wait that times
    out would close the group, and a source still in its chunk hooks may take a while to post
    its receive); they stay referenced until the transfer ends and reach the source in order,
    ahead of its next status."""

    def __init__(self, pg: Any, dev: torch.device | None, interval_s: float) -> None:
        self.pg = pg
        self.dev = dev
        self.interval_s = interval_s
        self._last: dict[int, float] = {}  # source -> when last told (monotonic s)
        self._works: list[Any] = []

    def new_round(self) -> None:
        """No source's part of the new round has arrived yet."""
        self._last.clear()

    def arrived(self, src: int) -> None:
        """``src``'s part of the round has arrived: it waits for a status now."""
        self._last.setdefault(src, -math.inf)

    def tick(self, alive: Sequence[int]) -> None:
        """Tell every source of ``alive`` whose part arrived and that heard nothing for
        ``interval_s``; one whose connection closed is left to the next status."""
        now = time.monotonic()
        for src, last in list(self._last.items()):
            if src not in alive or now - last < self.interval_s:
                continue
            t = torch.tensor([_STATUS_WORKING], dtype=torch.int64)
            try:
                self._works.append(_post(self.pg.send, [t if self.dev is None else t.to(self.dev)],
                                         src, _TAG_STATUS))
            except _Lost:
                del self._last[src]
                continue
            self._last[src] = now


class _Staging:
    """Chunk-sized ``uint8`` buffers on ``device`` that chunks pass through (NCCL sends only
    CUDA memory). A buffer is handed out again only after it is given back: once its message
    completed and its bytes were copied out."""

    def __init__(self, device: torch.device, chunk_bytes: int) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()  # the receiver's lanes (one thread per source) share it

    def take(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A buffer and its first ``nbytes`` (the view a message uses)."""
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            buf = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device)
        return buf, buf[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    @staticmethod
    def pack(view: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
        """Copy ``parts`` (host ``uint8`` segments) one after another into ``view``."""
        pos = 0
        for part in parts:
            view[pos:pos + part.numel()].copy_(part)
            pos += part.numel()

    @staticmethod
    def unpack(view: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
        """Copy ``view`` out into ``parts`` (target memory), in order."""
        pos = 0
        for part in parts:
            part.copy_(view[pos:pos + part.numel()])
            pos += part.numel()


def _send(dev: torch.device | None, t: torch.Tensor, dst: int, group: Any, tag: int,
          timeout_s: float) -> None:
    """Send one small control tensor (host memory), through ``dev`` when staging."""
    _wait(_post(group.send, [t if dev is None else t.to(dev)], dst, tag), timeout_s)


def _recv(dev: torch.device | None, buf: torch.Tensor, src: int, group: Any, tag: int,
          timeout_s: float) -> torch.Tensor:
    """Receive one small control tensor shaped like ``buf``; returns it in host memory."""
    wire = buf if dev is None else torch.empty_like(buf, device=dev)
    _wait(_post(group.recv, [wire], src, tag), timeout_s)
    return wire if dev is None else wire.cpu()


def _on(dev: torch.device | None, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` with ``dev`` as the thread's current CUDA device, if it is one."""
    if dev is None or dev.type != "cuda":
        return fn(*args)
    with torch.cuda.device(dev):
        return fn(*args)


def _gather(lanes: Mapping[futures.Future[_Lost | None], int], alive: Sequence[int],
            drop: Callable[..., None], speak: _KeepAlive, stop: threading.Event) -> None:
    """Wait for one round's ``lanes`` (a future per source, in plan order: the source's loss,
    or None once its part of the round has arrived), telling each source whose part arrived
    that the receiver still works (``speak``) while the others' come in; then drop the lost
    sources. Raises ``_Stopped`` once ``stop`` is set, or ``TransferFailed`` from ``drop``."""
    lost: dict[int, _Lost] = {}
    pending = set(lanes)
    while pending:
        done, pending = futures.wait(pending, speak.interval_s, futures.FIRST_COMPLETED)
        for f in done:
            if (loss := f.result()) is None:
                speak.arrived(lanes[f])
            else:
                lost[lanes[f]] = loss
        if stop.is_set():
            raise _Stopped
        speak.tick(alive)
    # A timed-out wait closed the whole group: the other sources' losses follow from it.
    order = [src for src in lanes.values() if src in lost]
    stalled = [src for src in order if lost[src].reason == "no_progress"]
    for src in stalled[:1] or order:
        drop(src, lost[src].reason, lost[src].detail)


class PgTransport(Transport):
    """Transfer over ``group``: a ``ProcessGroup`` object, registered or not (a
    :class:`~torchpass_p2p.collective.group.ManagedGroup`'s), or ``None`` for the default
    group. Plan ranks are the group's own. ``algo``: chunk digest."""

    name = "pg"

    def __init__(self, group: Any = None, *, algo: str = "xxh3",
                 device: torch.device | str | None = None,
                 max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES,
                 max_state_bytes: int = 1 << 40) -> None:
        """``device``: stage every message through buffers on this device (see the module's
        "Wire memory"); ``None``: the group's backend decides when the transfer starts (NCCL:
        the current CUDA device; gloo: no staging). Both ends must stage or both not: a staged
        chunk is one message, an unstaged one a message per tensor segment (the receiver drops
        a source that does otherwise, ``bad_manifest``)."""
        self.group = group
        self.algo = algo
        self.device = None if device is None else torch.device(device)
        self.max_manifest_bytes = max_manifest_bytes
        self.max_state_bytes = max_state_bytes
        self._writes = threading.Lock()  # held by a staged chunk's copy into the target
        self._receiving: set[threading.Event] = set()  # the stop events of receives in flight
        self._abandoned = False

    def abandon(self) -> None:
        """Stop this transport's receives in flight, from any thread, without waiting for
        them: once it returns, they write nothing more into their targets themselves (a chunk
        being copied out of a staging buffer has landed; none is copied after). Receives posted
        straight into target memory are the backend's: the caller closes the group next
        (:meth:`~torchpass_p2p.collective.group.ManagedGroup.interrupt`), after which none can
        complete. Their threads end by themselves within ``progress_timeout_s`` (a wait on a
        peer that gloo never reported dead ends only by its deadline; at once once the group is
        closed), and a receive still awaited then raises ``TransferFailed`` ``abandoned``; one
        started afterwards raises it at once. For a caller that gives the group up and moves on
        (the trainer, when a newer configuration comes)."""
        with self._writes:
            self._abandoned = True
            for stop in self._receiving:
                stop.set()

    def _pg(self) -> Any:
        return self.group if self.group is not None else dist.distributed_c10d._get_default_group()

    def routes_around_failures(self) -> bool:
        """Whether the receiver moves a lost source's chunks to the others (gloo) or ends the
        transfer at the first lost source (NCCL: see the module)."""
        return self._pg().name() != "nccl"

    def _staging_device(self) -> torch.device | None:
        if self.device is not None:
            return self.device
        if self._pg().name() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return None

    # -- hook (tests inject faults here) ---------------------------------------------------
    def chunk_sent(self, index: int) -> None:
        """Called on a source after chunk ``index`` has left (its sends completed)."""

    def manifest_sent(self) -> None:
        """Called on a source after its manifest has left."""

    def posting(self, round_: int) -> None:
        """Called on the receiver before it posts the receives of ``round_`` (0: the
        stripes)."""

    def staged_lanes(self) -> bool:
        """Whether a staged receive takes each source's chunks in a thread of its own: on every
        backend but NCCL, whose communicator is not for use from several threads at once (it
        takes NCCL's one-thread path, :meth:`_staged_serial`). Tests return False to run
        that path over gloo."""
        return self._pg().name() != "nccl"

    # -- source side -----------------------------------------------------------------------
    async def provide(self, snapshot: Snapshot, plan: TransferPlan) -> None:
        """Send this rank's manifest and stripe to ``plan.receiver``, then serve the repair
        rounds; returns when the receiver says it is done. Raises ``TransferFailed``:
        ``send_failed`` / ``no_progress`` (the receiver died or stalled), ``receiver_lost``
        (the receiver said nothing for ``STATUS_WAIT_FACTOR * plan.progress_timeout_s`` while
        this source waited for a status, or its connection closed), ``receiver_aborted``,
        ``bad_request``."""
        dev = self._staging_device()  # the caller's CUDA device: a new thread's is 0
        await asyncio.to_thread(_on, dev, self._provide, snapshot, plan, dev)

    def _send_chunks(self, snap: Snapshot, chunks: Sequence[int], dst: int, tag: int,
                     timeout_s: float, staging: _Staging | None) -> None:
        """Send ``chunks`` in order, ``SEND_WINDOW_CHUNKS`` outstanding at a time: each as its
        segments (snapshot memory), or as one staged message."""
        pg = self._pg()
        pending: deque[tuple[int, torch.Tensor | None, list[Any]]] = deque()
        for i in (*chunks, None):
            if i is not None:
                parts, buf = snap.segment_tensors(i), None
                if staging is not None:
                    buf, view = staging.take(snap.chunk_range(i)[1])
                    staging.pack(view, parts)
                    parts = [view]
                pending.append((i, buf, [_post(pg.send, [x], dst, tag)
                                         for x in parts]))
            while pending and (i is None or len(pending) >= SEND_WINDOW_CHUNKS):
                done, buf, works = pending.popleft()
                for w in works:
                    _wait(w, timeout_s)
                if buf is not None and staging is not None:
                    staging.give(buf)
                self.chunk_sent(done)

    def _provide(self, snap: Snapshot, plan: TransferPlan, dev: torch.device | None) -> None:
        pg = self._pg()
        me = pg.rank()
        j, n = plan.sources.index(me), len(plan.sources)
        dst, g, t = plan.receiver, pg, plan.progress_timeout_s
        staging = (None if dev is None
                   else _Staging(dev, min(snap.chunk_bytes, snap.total_bytes)))
        body = encode_manifest(snap, self.algo)
        head = [len(body), _LAYOUT_SEGMENTS if dev is None else _LAYOUT_STAGED]
        try:
            _send(dev, torch.tensor(head, dtype=torch.int64), dst, g, _TAG_MANIFEST, t)
            _send(dev, torch.frombuffer(bytearray(body), dtype=torch.uint8), dst, g,
                  _TAG_MANIFEST, t)
            self.manifest_sent()
            self._send_chunks(snap, range(j, snap.num_chunks, n), dst, _TAG_DATA, t, staging)
            for rnd in range(snap.num_chunks + 1):
                c = self._await_status(dev, dst, t)
                if c == 0:
                    return
                if c < 0:
                    raise TransferFailed("receiver_aborted")
                if c > snap.num_chunks:
                    raise TransferFailed("bad_request", f"{c} chunks asked")
                chunks = _recv(dev, torch.empty(c, dtype=torch.int64), dst, g, _TAG_STATUS,
                               t).tolist()
                if any(not 0 <= i < snap.num_chunks for i in chunks):
                    raise TransferFailed("bad_request", "chunk index out of range")
                self._send_chunks(snap, chunks, dst, _TAG_REPAIR + rnd, t, staging)
            raise TransferFailed("bad_request", "more repair rounds than chunks")
        except _Lost as e:
            raise TransferFailed("send_failed" if e.reason == "source_failed" else e.reason,
                                 "the receiver closed or stalled") from None

    def _await_status(self, dev: torch.device | None, dst: int, timeout_s: float) -> int:
        """The receiver's next status count, past its keep-alives: each wait is for at most
        ``STATUS_WAIT_FACTOR * timeout_s`` of silence (``receiver_lost`` after that, or as
        soon as its connection closes); a receiver that keeps speaking is alive."""
        while True:
            try:
                c = int(_recv(dev, torch.zeros(1, dtype=torch.int64), dst, self._pg(),
                              _TAG_STATUS, STATUS_WAIT_FACTOR * timeout_s))
            except _Lost as e:
                raise TransferFailed("receiver_lost", e.reason) from None
            if c != _STATUS_WORKING:
                return c

    # -- receiver side ---------------------------------------------------------------------
    async def receive(self, plan: TransferPlan,
                      into: Snapshot | Mapping[str, Any] | None = None) -> FetchResult:
        """Receive from ``plan.sources`` (ranks), moving the chunks of a source that dies or
        sends a bad chunk to the others. Raises ``TransferFailed``: ``no_progress`` (a source
        moved nothing for ``plan.progress_timeout_s``: gloo closed the group, abandon it),
        ``no_sources_left`` (``failures`` says why each source was dropped),
        ``sources_disagree``, ``fingerprint_mismatch``, ``bad_manifest``, ``abandoned``
        (:meth:`abandon`).

        Cancelled, it closes the group and ends its threads (at most ``CANCEL_WAIT_FACTOR *
        plan.progress_timeout_s``) before ``CancelledError`` propagates: nothing writes into
        ``into`` after that (module, "Cancelling"); the group is unusable."""
        dev = self._staging_device()
        one_shot = not self.routes_around_failures()
        stop = threading.Event()
        with self._writes:
            if self._abandoned:
                raise TransferFailed("abandoned", "the transport was abandoned (its group given "
                                     "up) before this receive started")
            self._receiving.add(stop)
        worker = asyncio.ensure_future(
            asyncio.to_thread(_on, dev, self._receive, plan, into, dev, one_shot, stop))
        try:
            return await asyncio.shield(worker)
        except asyncio.CancelledError:
            if not worker.done():
                await self._stop_worker(worker, stop, plan)
            raise
        except _Stopped:  # abandon() stopped it
            raise TransferFailed("abandoned", "the transport was abandoned (its group given "
                                 "up) during this receive") from None
        finally:
            self._receiving.discard(stop)

    async def _stop_worker(self, worker: asyncio.Future[Any], stop: threading.Event,
                           plan: TransferPlan) -> None:
        """End a cancelled receive's worker: close the group, so that its posted receives
        fail at once and none can write into the target any more, and wait for it (bounded)."""
        with self._writes:
            stop.set()
        await asyncio.to_thread(close_connections, self._pg(), list(plan.sources))
        limit_s = CANCEL_WAIT_FACTOR * plan.progress_timeout_s
        done, _ = await asyncio.wait([worker], timeout=limit_s)
        if not done:  # a bug (every wait of the worker is bounded): say so, do not hang
            log.warning("cancelled pg receive: worker still running after %.1f s", limit_s)
        elif not worker.cancelled():
            worker.exception()  # its outcome is moot (cancelled); retrieved, so never logged

    def _recv_manifest(self, dev: torch.device | None, src: int, timeout_s: float) -> Manifest:
        """``src``'s manifest. Raises ``TransferFailed`` ``bad_manifest`` for a size out of
        bounds, an undecodable body, or a wire layout other than this receiver's (its chunks
        could not be received: module, protocol step 2); ``_Lost`` if ``src`` is lost."""
        size, layout = _recv(dev, torch.zeros(2, dtype=torch.int64), src, self._pg(),
                             _TAG_MANIFEST, timeout_s).tolist()
        if not 0 < size <= self.max_manifest_bytes:
            raise TransferFailed("bad_manifest", f"size {size}")
        buf = _recv(dev, torch.empty(size, dtype=torch.uint8), src, self._pg(), _TAG_MANIFEST,
                    timeout_s)
        mine = _LAYOUT_SEGMENTS if dev is None else _LAYOUT_STAGED
        if layout != mine:
            staged = {_LAYOUT_SEGMENTS: "a message per tensor segment",
                      _LAYOUT_STAGED: "one staged message per chunk"}
            raise TransferFailed(
                "bad_manifest", f"source {src} sends {staged.get(layout, f'layout {layout}')}, "
                f"this receiver takes {staged[mine]}: both ends must stage or neither "
                "(PgTransport's device)")
        try:
            return decode_manifest(buf.numpy().tobytes(), self.max_state_bytes)
        except TransferError as e:
            raise TransferFailed(e.reason, e.detail) from None

    def _post_status(self, dev: torch.device | None, src: int, chunks: Sequence[int], *,
                     abort: bool = False) -> list[Any]:
        """Post the status telling ``src`` which chunks to send next (none: it is done), or
        that the receiver gave up (``abort``); returns its sends (they hold their tensors)."""
        count = _STATUS_ABORT if abort else len(chunks)
        msgs = [torch.tensor([count], dtype=torch.int64)]
        if count > 0:
            msgs.append(torch.tensor(list(chunks), dtype=torch.int64))
        return [_post(self._pg().send, [m if dev is None else m.to(dev)], src, _TAG_STATUS)
                for m in msgs]

    def _abort(self, dev: torch.device | None, src: int) -> list[Any]:
        """Tell ``src``, dropped, that the receiver gave up on it; returns the sends to keep
        referenced until the transfer ends. Never waited on: a source dropped for its manifest
        listens only once its stripe is sent, which nobody receives, so a wait would time out
        and gloo would close the whole group, the healthy sources' connections too: one bad
        manifest must not fail the transfer."""
        try:
            return self._post_status(dev, src, [], abort=True)
        except _Lost:
            return []

    def _status(self, dev: torch.device | None, src: int, chunks: Sequence[int],
                timeout_s: float) -> None:
        """Tell ``src`` which chunks to send next (``_post_status``) and wait until it has."""
        for w in self._post_status(dev, src, chunks):
            _wait(w, timeout_s)

    def _release(self, dev: torch.device | None, sources: Sequence[int], timeout_s: float, *,
                 abort: bool) -> None:
        """Best effort: tell ``sources`` the transfer is over for them. Every status is posted
        before any is waited on: a source slow to listen (or whose wait times out, closing the
        group) does not keep the others from theirs."""
        posted = []
        for src in sources:
            try:
                posted.append(self._post_status(dev, src, [], abort=abort))
            except _Lost:
                pass
        for works in posted:
            _wait_all(works, timeout_s)  # a loss: that source learns it from the closed pair

    def _recv_direct(self, assign: Mapping[int, int], alive: list[int], target: Snapshot,
                     tag: int, timeout_s: float, drop: Callable[..., None],
                     speak: _KeepAlive, waiters: ThreadPoolExecutor,
                     stop: threading.Event) -> None:
        """One round into target memory: every receive posted at once, so every source
        streams concurrently; each source's waited on in order by a thread of ``waiters``, so
        that a source whose part has arrived is known at once and told the receiver still
        works (``speak``) while the others' parts come in."""
        pg = self._pg()
        works: dict[int, list[Any]] = {src: [] for src in alive}
        for i, src in assign.items():
            if src not in alive:
                continue
            try:
                works[src] += [_post(pg.recv, [seg], src, tag)
                               for seg in target.segment_tensors(i)]
            except _Lost as e:  # its chunks fail their digests: the next round
                drop(src, e.reason, e.detail)
        _gather({waiters.submit(_wait_all, ws, timeout_s): src
                 for src, ws in works.items() if src in alive}, alive, drop, speak, stop)

    def _recv_staged(self, staging: _Staging, assign: Mapping[int, int], alive: list[int],
                     target: Snapshot, tag: int, timeout_s: float,
                     drop: Callable[..., None], speak: _KeepAlive, waiters: ThreadPoolExecutor,
                     stop: threading.Event) -> None:
        """One round through ``staging``: ``SEND_WINDOW_CHUNKS`` receives per live source
        posted (as many as the sources keep in flight), each copied out into target memory
        once complete; then its buffer takes the next chunk.

        Over gloo every source has a lane of its own (a thread of ``waiters``,
        :meth:`_staged_lane`): gloo reports a receive complete only once it is waited on, so
        one thread waiting in posting order would hear of a healthy source's last chunks only
        after a slow source's window, and with chunks slower than ~0.75 T the healthy source,
        waiting 3T for a word, would conclude receiver_lost (test_pg_failover's ``slower``).
        Over NCCL one thread posts every receive (a communicator is not for use from several
        threads at once) and takes first those that report completion (a CUDA event):
        :meth:`_staged_serial`."""
        if not self.staged_lanes():
            self._staged_serial(staging, assign, alive, target, tag, timeout_s, drop, speak,
                                stop)
            return
        stripes: dict[int, list[int]] = {src: [] for src in alive}
        for i, src in assign.items():  # each in the order its source sends them
            if src in stripes:
                stripes[src].append(i)
        _gather({waiters.submit(self._staged_lane, staging, chunks, src, target, tag,
                                timeout_s, stop): src
                 for src, chunks in stripes.items()}, alive, drop, speak, stop)

    def _staged_lane(self, staging: _Staging, chunks: Sequence[int], src: int,
                     target: Snapshot, tag: int, timeout_s: float,
                     stop: threading.Event) -> _Lost | None:
        """Receive ``src``'s ``chunks`` of a round in order, ``SEND_WINDOW_CHUNKS`` posted
        at a time; the source's loss, or None once all are in target memory. The buffers of a
        lost source's receives stay out of use: its late bytes may still land in them."""
        pg = self._pg()
        todo = deque(chunks)
        pending: deque[tuple[int, torch.Tensor, torch.Tensor, Any]] = deque()
        while todo or pending:
            while todo and len(pending) < SEND_WINDOW_CHUNKS:
                i = todo.popleft()
                buf, view = staging.take(target.chunk_range(i)[1])
                try:
                    pending.append((i, buf, view, _post(pg.recv, [view], src, tag)))
                except _Lost as e:
                    staging.give(buf)  # nothing was posted into it
                    return e
            i, buf, view, work = pending.popleft()
            try:
                _wait(work, timeout_s)
            except _Lost as e:
                return e
            self._unstage(staging, buf, view, target, i, stop)
        return None

    def _unstage(self, staging: _Staging, buf: torch.Tensor, view: torch.Tensor,
                 target: Snapshot, i: int, stop: threading.Event) -> None:
        """Copy chunk ``i`` out of its staging buffer into target memory, then free the buffer;
        raises ``_Stopped`` instead once the receive was cancelled or abandoned."""
        with self._writes:  # nothing lands in the target after a cancel or abandon
            if stop.is_set():
                raise _Stopped
            staging.unpack(view, target.segment_tensors(i))
        staging.give(buf)

    def _staged_serial(self, staging: _Staging, assign: Mapping[int, int], alive: list[int],
                       target: Snapshot, tag: int, timeout_s: float,
                       drop: Callable[..., None], speak: _KeepAlive,
                       stop: threading.Event) -> None:
        """:meth:`_recv_staged` from one thread (NCCL): receives that report completion are
        taken first, in any order; only when none does is the oldest waited on. A source
        whose last chunk is in is told the receiver still works (``speak``), between two
        waits."""
        pg = self._pg()
        queue = deque(assign.items())
        left = Counter(src for src in assign.values() if src in alive)
        for src in alive:
            if not left[src]:
                speak.arrived(src)
        pending: deque[tuple[int, int, torch.Tensor, torch.Tensor, Any]] = deque()
        while queue or pending:
            while queue and len(pending) < SEND_WINDOW_CHUNKS * max(1, len(alive)):
                i, src = queue.popleft()
                if src not in alive:
                    continue
                buf, view = staging.take(target.chunk_range(i)[1])
                try:
                    work = _post(pg.recv, [view], src, tag)
                except _Lost as e:
                    staging.give(buf)  # nothing was posted into it
                    drop(src, e.reason, e.detail)
                    continue
                pending.append((i, src, buf, view, work))
            if not pending:
                return
            ready = [p for p in pending if p[1] in alive and p[4].is_completed()]
            for entry in ready or [pending[0]]:
                pending.remove(entry)
                i, src, buf, view, work = entry
                if src not in alive:
                    continue  # given up on: the buffer stays out of use (late bytes may land)
                try:
                    _wait(work, timeout_s)
                except _Lost as e:
                    drop(src, e.reason, e.detail)
                    continue
                self._unstage(staging, buf, view, target, i, stop)
                left[src] -= 1
                if not left[src]:
                    speak.arrived(src)
                speak.tick(alive)

    def _receive(self, plan: TransferPlan, into: Any, dev: torch.device | None,
                 one_shot: bool, stop: threading.Event) -> FetchResult:
        """``one_shot``: the first lost source ends the transfer (NCCL: see the module);
        ``stop``: set when the receive is cancelled (raises ``_Stopped`` at the next look)."""
        t0 = time.monotonic()
        t = plan.progress_timeout_s
        failures: Counter[str] = Counter()
        alive: list[int] = []  # sources still in the transfer, plan order

        def drop(src: int, reason: str, detail: str = "") -> None:
            if src in alive:
                alive.remove(src)
            failures[reason] += 1
            if reason == "no_progress":  # the whole group is unusable now: no repair round
                raise TransferFailed(
                    "no_progress", f"source {src} moved nothing for {t} s; gloo closed every "
                    "connection of the group on the timed-out wait, so no repair round can run "
                    f"over it: {_ABANDON} ({detail})", failures)
            if one_shot:
                raise TransferFailed(
                    reason, f"source {src}: {reason}; over NCCL a failed operation cannot be "
                    f"routed around: {_ABANDON}", failures)

        manifests: dict[int, Manifest] = {}
        told: list[Any] = []  # aborts posted to sources dropped for their manifest
        for src in plan.sources:
            try:
                manifest = self._recv_manifest(dev, src, t)
                if plan.step is not None and manifest.step != plan.step:
                    raise TransferFailed("step_mismatch",
                                         f"source {src} at step {manifest.step}, not {plan.step}")
                manifests[src] = manifest
                alive.append(src)
            except _Lost as e:
                drop(src, e.reason, e.detail)
            except TransferFailed as e:  # a bad manifest: drop that source only
                failures[e.reason] += 1
                if one_shot:  # its stripe is already posted: a status would never match
                    raise TransferFailed(e.reason, e.detail, failures) from None
                told += self._abort(dev, src)
        try:
            if not alive:
                raise TransferFailed("no_sources_left", f"failures {dict(failures)}", failures)
            fps = [manifests[s].fingerprint for s in alive]
            want = plan.expected_fingerprint
            if want is None:
                if len(set(fps)) != 1:
                    raise TransferFailed("sources_disagree", "sources hold different states")
                want = fps[0]
            if any(f != want for f in fps):
                # Every source already streams its stripe: a mismatch cannot be routed around.
                raise TransferFailed("fingerprint_mismatch", "a source holds another state")
            m = manifests[alive[0]]
            if m.algo != self.algo:
                raise TransferFailed("bad_manifest", "algorithm")
            own = (into if into is None or isinstance(into, Snapshot)
                   else Snapshot.capture(into, 0))
            try:
                target, allocated = m.allocate(own, self.max_state_bytes)
            except PeerError as e:  # the agreed state does not fit
                raise TransferFailed(e.reason, e.detail, failures) from None
        except BaseException:
            self._release(dev, alive, t, abort=True)
            raise

        n = len(plan.sources)
        assign = {i: plan.sources[i % n] for i in range(m.num_chunks)}
        tag, refetched = _TAG_DATA, 0
        per_src: dict[Any, int] = {s: 0 for s in plan.sources}
        staging = None if dev is None else _Staging(dev, min(m.chunk_bytes, m.total_bytes))
        speak = _KeepAlive(self._pg(), dev, KEEPALIVE_FACTOR * t)
        with (ThreadPoolExecutor(max_workers=2) as pool,
              ThreadPoolExecutor(max_workers=n, thread_name_prefix="pg-wait") as waiters):
            for rnd in range(m.num_chunks + 1):
                self.posting(rnd)
                speak.new_round()
                if staging is None:
                    self._recv_direct(assign, alive, target, tag, t, drop, speak, waiters,
                                      stop)
                else:
                    self._recv_staged(staging, assign, alive, target, tag, t, drop, speak,
                                      waiters, stop)
                todo = sorted(assign)
                digests = pool.map(lambda i: fp.digest_buffers(m.algo, target.segments(i)),
                                   todo)
                missing = []
                for i, d in zip(todo, digests, strict=True):
                    if stop.is_set():
                        pool.shutdown(wait=False, cancel_futures=True)  # digests only read
                        raise _Stopped
                    speak.tick(alive)  # a long hash: the sources whose part arrived wait on
                    if d == m.digest(i):
                        per_src[assign[i]] += m.chunk_range(i)[1]
                        continue
                    missing.append(i)
                    if assign[i] in alive:  # it completed its sends: the bytes were bad
                        bad = assign[i]
                        drop(bad, "bad_chunk")
                        told += self._abort(dev, bad)  # else it waits out its 3T for a word
                if not missing:
                    break
                if not alive:
                    raise TransferFailed("no_sources_left",
                                         f"{len(missing)} chunks missing; failures "
                                         f"{dict(failures)}", failures)
                refetched += len(missing)
                tag = _TAG_REPAIR + rnd
                assign = {i: alive[k % len(alive)] for k, i in enumerate(missing)}
                for src in list(alive):
                    chunks = [i for i in missing if assign[i] == src]
                    try:
                        self._status(dev, src, chunks, STATUS_WAIT_FACTOR * t)
                    except _Lost as e:
                        drop(src, e.reason)
                        continue
                    if not chunks:  # nothing for it this round: released
                        alive.remove(src)
            else:
                raise TransferFailed("no_sources_left", "repair rounds exhausted", failures)
        # Every chunk verified: the sources are done. A status waits as long as a source waits
        # for one: a source listens only after its hooks for its last window of chunks.
        self._release(dev, alive, STATUS_WAIT_FACTOR * t, abort=False)
        target.set_digests(m.algo, m.digests)
        return FetchResult(target, m.fingerprint, failures, per_src, refetched, allocated,
                           time.monotonic() - t0)
