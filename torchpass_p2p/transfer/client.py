"""The receiving side: pull one snapshot from several sources at once, exactly.

``await fetch(sources, keys, config_id, into=...)``:

1. **Open** every source concurrently (connect, handshake, manifest), each within
   ``connect_timeout_s``. A source that refuses or misbehaves is counted and left out.
2. **Agree.** Each manifest's fingerprint is recomputed locally from its bytes. With
   ``expected_fingerprint`` (from the plan) only sources holding it are used; without, the
   fingerprint held by most sources wins and a tie is :class:`TransferFailed`
   ``sources_disagree``.
3. **Target.** Tensors of ``into`` (a Snapshot, or live objects captured without copying) with
   the manifest's name, dtype and shape are received into in place; the others are allocated.
4. **Stripe.** Chunks sit in one work queue; each source's worker keeps ``window`` chunk
   requests outstanding and takes the next chunk as one arrives, so faster sources carry more.
   Each chunk is received straight into tensor memory (``sock_recv_into``), then hashed in a
   worker thread (overlapped with the next receive) and accepted only if its digest equals the
   manifest's and its tag verifies under the connection's session key.
5. **Failover.** A source that closes, errs, sends a bad chunk, or makes no progress for
   ``progress_timeout_s`` seconds is dropped; its unverified chunks go back to the queue and the
   other sources take them. No fixed total deadline: only "no progress for T".
6. **Done** when every chunk is verified: since each chunk's digest matched the manifest whose
   fingerprint was agreed, the received state has that fingerprint. Restore it into live
   objects with ``result.snapshot.restore(objects)``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from . import fingerprint as fp
from .auth import TRANSFER_ID_BYTES, TransferKeys, client_handshake
from .errors import PeerError, Refused, TransferError, TransferFailed
from .frames import DEFAULT_MAX_MANIFEST_BYTES, Conn, encode_frame, set_buffers
from .frames import field as get_field
from .manifest import Manifest, decode_manifest
from .snapshot import Snapshot

PROGRESS_TIMEOUT_S = 10.0
"""A source that moves no byte for 10 s is dropped: a live source on a loaded LAN host moves
megabytes per second; 10 s is well below the minutes a stuck collective would cost."""
CONNECT_TIMEOUT_S = 5.0
"""Connect, handshake and manifest, per source."""
WINDOW_CHUNKS = 4
"""Chunk requests outstanding per source (4 x 16 MiB = 64 MiB): enough to keep a loopback or
LAN pipe full across the request round trip."""
DEFAULT_MAX_STATE_BYTES = 1 << 40
"""1 TiB: refuse manifests claiming more (a bound, not a real model size)."""

Address = tuple[str, int]


@dataclass
class FetchResult:
    """Outcome of :func:`fetch`. ``seconds``: wall time from first connect to last chunk."""

    snapshot: Snapshot
    fingerprint: bytes
    failures: Counter[str]
    bytes_by_source: dict[Address, int]
    refetched_chunks: int
    allocated_bytes: int
    seconds: float


@dataclass(eq=False)
class _Source:
    addr: Address
    conn: Conn
    session: bytes
    manifest: Manifest
    inflight: deque[int] = field(default_factory=deque)
    pending: deque[tuple[int, int, int, bytes, asyncio.Future]] = field(default_factory=deque)
    idle: bool = False
    body: concurrent.futures.Future | None = None
    failed: str | None = None
    task: asyncio.Task | None = None
    bytes: int = 0


async def _open(addr: Address, keys: TransferKeys, config_id: int, tid: bytes, algo: str,
                step: int | None, max_manifest_bytes: int, max_state_bytes: int) -> _Source:
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    set_buffers(sock)
    conn = Conn(sock, loop)
    try:
        await loop.sock_connect(sock, addr)
        session, _server_config = await client_handshake(conn, keys, config_id, tid)
        await conn.send(encode_frame("manifest?", algo=algo, step=step))
        msg = await conn.read_frame()
        if msg["op"] == "error":
            raise Refused(str(msg.get("reason", "refused"))[:64])
        if msg["op"] != "manifest":
            raise PeerError("bad_frame", f"expected manifest, got {msg['op']!r}")
        size = get_field(msg, "size", int)
        tag = get_field(msg, "tag", bytes, fp.TAG_BYTES)
        if size > max_manifest_bytes:
            raise PeerError("too_large", f"manifest of {size} bytes > {max_manifest_bytes}")
        body = bytes(await conn.recv_exact(size))
        if not hmac.compare_digest(tag, fp.frame_tag(session, b"manifest", body)):
            raise PeerError("bad_tag", "manifest tag")
        manifest = await asyncio.to_thread(decode_manifest, body, max_state_bytes)
        if manifest.algo != algo:
            raise PeerError("bad_manifest", "algorithm")
        return _Source(addr, conn, session, manifest)
    except BaseException:
        conn.close()
        raise


class _Transfer:
    def __init__(self, sources: list[_Source], target: Snapshot, manifest: Manifest,
                 tid: bytes, window: int, progress_timeout_s: float,
                 on_progress: Callable[[int, int], None] | None,
                 pool: ThreadPoolExecutor, failures: Counter[str]) -> None:
        self.sources = sources
        self.target = target
        self.m = manifest
        self.tid = tid
        self.window = window
        self.progress_timeout_s = progress_timeout_s
        self.on_progress = on_progress
        self.pool = pool
        self.failures = failures
        self.queue: deque[int] = deque(range(manifest.num_chunks))
        self.remaining = manifest.num_chunks
        self.received_bytes = 0
        self.refetched = 0
        self.wake = asyncio.Event()

    async def run(self) -> None:
        if self.remaining == 0:
            return
        async with asyncio.TaskGroup() as tg:
            for s in self.sources:
                s.task = tg.create_task(self._worker(s))
            watchdog = tg.create_task(self._watchdog())
            await asyncio.wait([s.task for s in self.sources if s.task is not None])
            watchdog.cancel()
        if self.remaining:
            raise TransferFailed("no_sources_left",
                                 f"{self.remaining} chunks missing; failures "
                                 f"{dict(self.failures)}", self.failures)

    async def _watchdog(self) -> None:
        period = min(self.progress_timeout_s / 4, 1.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for s in self.sources:
                if (s.task is not None and not s.task.done() and not s.idle
                        and s.failed is None
                        and now - s.conn.last_progress > self.progress_timeout_s):
                    s.failed = "no_progress"
                    s.task.cancel()

    async def _worker(self, s: _Source) -> None:
        conn, queue = s.conn, self.queue
        try:
            while True:
                while len(s.inflight) < self.window and queue:
                    i = queue.popleft()
                    s.inflight.append(i)
                    await conn.send(encode_frame("get", i=i))
                if not s.inflight:
                    await self._drain(s, 0)
                    if self.remaining == 0:
                        return
                    if not queue:
                        s.idle = True
                        self.wake.clear()
                        await self.wake.wait()
                        s.idle = False
                        conn.last_progress = time.monotonic()
                    continue
                i = s.inflight[0]
                msg = await conn.read_frame()
                if msg["op"] == "error":
                    raise Refused(str(msg.get("reason", "refused"))[:64])
                if msg["op"] != "chunk":
                    raise PeerError("bad_frame", f"expected chunk, got {msg['op']!r}")
                off, n = self.m.chunk_range(i)
                if (msg.get("i") != i or msg.get("o") != off or msg.get("n") != n):
                    raise PeerError("bad_chunk_header", f"chunk {i}")
                tag = get_field(msg, "tag", bytes, fp.TAG_BYTES)
                segs = self.target.segments(i)
                # The body is received by a worker thread (blocking recv_into straight into
                # tensor memory); the thread must have ended before the chunk can be handed
                # to another source, see _stop_body.
                s.body = self.pool.submit(conn.fill_blocking, segs, self.progress_timeout_s)
                await asyncio.wrap_future(s.body)
                s.body = None
                s.inflight.popleft()
                fut = asyncio.get_running_loop().run_in_executor(
                    self.pool, fp.digest_buffers, self.m.algo, segs)
                s.pending.append((i, off, n, tag, fut))
                await self._drain(s, self.window)
        except asyncio.CancelledError:
            if s.failed is None:  # cancelled from outside, not by the watchdog
                s.conn.shutdown()
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            await self._stop_body(s)
            self._fail(s, s.failed)
        except TransferError as e:
            await self._stop_body(s)
            self._fail(s, e.reason)
        except (ConnectionError, OSError) as e:
            await self._stop_body(s)
            self._fail(s, "closed" if isinstance(e, ConnectionError) else type(e).__name__)

    async def _stop_body(self, s: _Source) -> None:
        """Shut the socket down and wait for the receiving thread to end, so no late byte
        lands in a chunk another source is about to fill."""
        s.conn.shutdown()
        if s.body is not None:
            # A fresh wrapper: cancelling the worker cancelled the old one, not the thread.
            try:
                await asyncio.wrap_future(s.body)
            except (TransferError, OSError, concurrent.futures.CancelledError):
                pass
            s.body = None

    async def _drain(self, s: _Source, keep: int) -> None:
        """Judge received chunks until at most ``keep`` await hashing (always judge the done
        ones). A bad chunk goes back to the queue and fails the source."""
        while s.pending and (len(s.pending) > keep or s.pending[0][4].done()):
            i, off, n, tag, fut = s.pending.popleft()
            digest = await fut
            good = digest == self.m.digest(i) and hmac.compare_digest(
                tag, fp.chunk_tag(s.session, self.tid, i, off, n, digest))
            if not good:
                self.queue.append(i)
                self.refetched += 1
                self.wake.set()
                raise PeerError("bad_chunk", f"chunk {i} from {s.addr}")
            s.bytes += n
            self.remaining -= 1
            self.received_bytes += n
            if self.on_progress is not None:
                self.on_progress(self.received_bytes, self.m.total_bytes)
            if self.remaining == 0:
                self.wake.set()

    def _fail(self, s: _Source, reason: str) -> None:
        s.failed = s.failed or reason
        self.failures[reason] += 1
        s.conn.close()
        # Chunks received but not yet judged: their bytes are complete, judge them later by
        # requeueing the hashing (cheap) -- simpler: requeue them all.
        for i, *_ in s.pending:
            self.queue.append(i)
        self.refetched += len(s.pending) + len(s.inflight)
        self.queue.extend(s.inflight)
        s.pending.clear()
        s.inflight.clear()
        self.wake.set()


async def fetch(sources: Sequence[Address], keys: TransferKeys, config_id: int, *,
                into: Snapshot | Mapping[str, Any] | None = None,
                expected_fingerprint: bytes | None = None, step: int | None = None,
                algo: str = "xxh3", progress_timeout_s: float = PROGRESS_TIMEOUT_S,
                connect_timeout_s: float = CONNECT_TIMEOUT_S, window: int = WINDOW_CHUNKS,
                max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES,
                max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
                max_alloc_bytes: int | None = None,
                on_progress: Callable[[int, int], None] | None = None,
                verify_threads: int = 2) -> FetchResult:
    """Receive the snapshot the ``sources`` (``(host, port)`` of transfer servers) agree on.

    ``into``: the receiver's own state (a :class:`Snapshot`, or the dict of live objects it
    would pass to ``Snapshot.capture``) to receive into in place. ``step``: ask for exactly this
    step (sources holding another refuse). ``algo``: chunk digest, ``"xxh3"`` or ``"blake3"``
    (see ``fingerprint``). ``progress_timeout_s``: seconds without a byte from a busy source
    before it is dropped. ``max_alloc_bytes``: bytes the receiver may allocate for tensors it
    lacks (default ``max_state_bytes``). ``on_progress(received_bytes, total_bytes)`` is called
    after each verified chunk.

    Raises :class:`TransferFailed` (``no_sources``, ``sources_disagree``, ``no_sources_left``)
    with ``failures`` counting each source's reason; ``ValueError`` for local misuse.
    """
    if not sources:
        raise ValueError("no sources")
    if algo not in fp.ALGORITHMS or window < 1:
        raise ValueError("bad algo or window")
    t0 = time.monotonic()
    tid = os.urandom(TRANSFER_ID_BYTES)
    failures: Counter[str] = Counter()

    async def attempt(addr: Address) -> _Source | None:
        try:
            async with asyncio.timeout(connect_timeout_s):
                return await _open(addr, keys, config_id, tid, algo, step, max_manifest_bytes,
                                   max_state_bytes)
        except TimeoutError:
            failures["connect_timeout"] += 1
        except TransferError as e:
            failures[e.reason] += 1
        except OSError as e:
            failures["closed" if isinstance(e, ConnectionError) else "connect_failed"] += 1
        return None

    opened = [s for s in await asyncio.gather(*(attempt(a) for a in sources)) if s is not None]
    chosen: list[_Source] = []
    try:
        if not opened:
            raise TransferFailed("no_sources", f"failures {dict(failures)}", failures)
        by_fp: dict[bytes, list[_Source]] = {}
        for s in opened:
            by_fp.setdefault(s.manifest.fingerprint, []).append(s)
        if expected_fingerprint is not None:
            chosen = by_fp.get(expected_fingerprint, [])
        else:
            ranked = sorted(by_fp.values(), key=len, reverse=True)
            if len(ranked) > 1 and len(ranked[0]) == len(ranked[1]):
                raise TransferFailed("sources_disagree", "no majority fingerprint", failures)
            chosen = ranked[0]
        for s in opened:
            if s not in chosen:
                failures["fingerprint_mismatch"] += 1
                s.conn.close()
        if not chosen:
            raise TransferFailed("no_sources", "no source holds the expected fingerprint",
                                 failures)
        manifest = chosen[0].manifest
        if into is None or isinstance(into, Snapshot):
            own = into
        else:
            own = Snapshot.capture(into, step=0)
        target, allocated = manifest.allocate(
            own, max_state_bytes if max_alloc_bytes is None else max_alloc_bytes)
        # Threads: one receiving per source, plus the hashing ones.
        with ThreadPoolExecutor(max_workers=verify_threads + len(chosen),
                                thread_name_prefix="transfer") as pool:
            tr = _Transfer(chosen, target, manifest, tid, window, progress_timeout_s,
                           on_progress, pool, failures)
            await tr.run()
        for s in chosen:
            if s.failed is None:
                try:
                    await asyncio.wait_for(s.conn.send(encode_frame("bye")), 1.0)
                except (OSError, TimeoutError):
                    pass
        target.set_digests(manifest.algo, manifest.digests)  # verified chunk by chunk
        return FetchResult(target, manifest.fingerprint, failures,
                           {s.addr: s.bytes for s in chosen}, tr.refetched, allocated,
                           time.monotonic() - t0)
    finally:
        for s in opened:
            s.conn.close()
