"""The receiving side: pull one snapshot from several sources at once, exactly.

Why one module of this size: opening, planning, the per-source threads, failover and the
straggler rule all read and write one transfer's chunk table under one condition variable; split,
each piece would have to expose that table and its locking rule.

``await fetch(sources, keys, config_id, into=...)``:

1. **Open** every source concurrently (connect, handshake, manifest), each dropped after
   ``connect_timeout_s`` without progress (connecting, then no byte moving). A source that
   refuses or misbehaves is counted and left out.
2. **Agree.** Each manifest's fingerprint is recomputed locally from its bytes. With
   ``expected_fingerprint`` (from the plan) only sources holding it are used; without, the
   fingerprint held by most sources wins and a tie is :class:`TransferFailed`
   ``sources_disagree``. Receiving begins once the state is settled (the expected fingerprint
   is held, or one is held by a majority of all the sources); a source still opening joins
   when it opens, so one that hangs in its handshake delays nothing.
3. **Target.** Tensors of ``into`` (a Snapshot, or live objects captured without copying) with
   the manifest's name, dtype and shape are received into in place; the others are allocated.
4. **Stripe.** Chunks sit in one work queue. Every agreed source gets a connection, and with fewer
   sources than ``streams`` (and ``MIN_STREAM_BYTES`` of state per connection) more connections are
   opened to them in turn while the first ones already receive (a receiving thread verifies only
   what its own connection brings, so one connection alone is capped by one core's receive-and-MAC
   rate). Each connection has one receiving thread that keeps ``window`` chunk requests outstanding
   and takes the next chunk as one arrives, so faster sources carry more. The thread owns its
   socket in blocking mode (kernel receive timeout, no event-loop round trip per chunk), receives
   each chunk straight into tensor memory in 1 MiB pieces and feeds each piece to the chunk's MAC
   while it is still in cache (``chunkmac``: GMAC over all its bytes under the snapshot's key, then
   a keyed-BLAKE3 tag under the connection's session key binding transfer, index, offset and
   length); a chunk counts only once its MAC verifies.
5. **Failover.** A source that closes, errs, sends a bad chunk, or makes no progress for
   ``progress_timeout_s`` seconds on any of its connections is dropped, all its connections
   with it; their unverified chunks go back to the queue and the other sources take them. A
   chunk it was receiving in place is resumed, not received again: the next source is asked
   for its bytes past those already in (``get`` with ``s``), and the chunk's MAC runs over the
   bytes in memory and the rest; should that MAC fail, the bytes of the failed source may be
   at fault, so the chunk is received whole once more and nobody is blamed. No fixed total
   deadline and none per message: only "no progress for T" (a 16 MiB chunk from one of 7
   sources sharing 2 MB/s takes ~55 s). A connection with nothing to receive (its source is
   idle) sends a ``keepalive`` every ``KEEPALIVE_S``, so the source keeps it open for the
   chunks a failed source may hand back. A straggler's chunks are offered to an idle
   source while the straggler keeps them (see ``STRAGGLER_FACTOR``): the first verified copy
   counts, so the idle source's death loses nothing.
6. **Done** when every chunk is verified: each chunk's bytes are those its source MAC'd from
   the snapshot whose manifest (and so fingerprint) was agreed, and a source MACs only bytes
   that still have the digests its manifest announces (else it refuses, ``snapshot_changed``),
   so the state received has the agreed fingerprint at no cost to the receiver. Restore it into
   live objects with ``result.snapshot.restore(objects)``; ``result.snapshot.fingerprint()``
   recomputes the fingerprint from the received bytes (the trainer compares it again, which
   also covers the receiver's own memory).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torchpass_p2p.tasks import OwnedTasks

from . import chunkmac
from . import fingerprint as fp
from .auth import TRANSFER_ID_BYTES, TransferKeys, client_handshake
from .errors import PeerError, Refused, TransferError, TransferFailed
from .frames import (
    DEFAULT_MAX_MANIFEST_BYTES,
    LEN_BYTES,
    MAX_FRAME_BYTES,
    Conn,
    NoProgress,
    decode_frame,
    encode_frame,
    set_buffers,
    set_timeouts,
)
from .frames import field as get_field
from .manifest import Manifest, decode_manifest
from .snapshot import Snapshot

PROGRESS_TIMEOUT_S = 10.0
"""A source that moves no byte for 10 s is dropped: a live source on a loaded LAN host moves
megabytes per second; 10 s is well below the minutes a stuck collective would cost."""
WATCHDOG_FACTOR = 2.0
"""The watchdog shuts down a connection whose receive or send has not returned for this many
times ``progress_timeout_s`` (the kernel's timeout ends one every ``progress_timeout_s / 4``)."""
KERNEL_TIMEOUT_PARTS = 4
"""A receiving thread's socket calls end after ``progress_timeout_s / 4`` (``SO_RCVTIMEO`` /
``SO_SNDTIMEO``), and the thread fails its source once no byte moved for ``progress_timeout_s``.
With the whole ``progress_timeout_s`` as the kernel's timeout, a receive that got a few bytes
before the source stalled returned them only at its end, and the next call waited as long
again: a stalled source was dropped up to 2 x ``progress_timeout_s`` after its last byte (20 s
at the defaults, measured behind a 2 MB/s link)."""
CONNECT_TIMEOUT_S = 5.0
"""Opening a source (connect, handshake, manifest): dropped after this long without progress
(connecting, then no byte moving)."""
KEEPALIVE_S = 10.0
"""An idle connection (its source has nothing this receiver still needs) sends a ``keepalive``
frame this often, well inside the server's ``IDLE_TIMEOUT_S`` (60 s): the connection stays
open for the chunks a failed source hands back (a closed one would fail the first chunk handed
to it)."""
BYE_TIMEOUT_S = 1.0
"""The closing ``bye`` is given up after this long without progress."""
WINDOW_CHUNKS = 4
"""Chunks per source requested and not yet verified (4 x 16 MiB = 64 MiB): enough to keep a
loopback or LAN pipe full across the request round trip; a slow source gets no new chunks
until its outstanding ones arrive (the stripe follows what each source delivers)."""
STRAGGLER_FACTOR = 8.0
STRAGGLER_FLOOR_S = 1.0
"""A busy source whose oldest chunk has taken 8 times what its bytes took at the fastest recent
chunk's rate (seconds per byte: a short last chunk sets no bar for a full one), and over 1 s,
while another source sits idle with the queue empty, is a straggler: its chunks are offered to
the idle ones while it keeps them, the first verified copy of each counts, and it is dropped
(``too_slow``) once the others have them all, or one of them has the chunk it is receiving
(it could be writing that chunk's memory, so that copy is received aside and written over
it once the straggler's thread has stopped). Without this rule a source that delivers a byte
per ``progress_timeout_s`` keeps its window to the end while a healthy source idles. The
straggler is dropped only once its chunks are held elsewhere: an idle source may have died
unnoticed (idle, it reads nothing), and chunks moved to it alone would leave no source. A
source behind a 4x slower link is never dropped."""
DEFAULT_MAX_STATE_BYTES = 1 << 40
"""1 TiB: refuse manifests claiming more (a bound, not a real model size)."""
RECV_PIECE_BYTES = 1 << 20
"""Bytes per receive call (``MSG_WAITALL``); each piece is fed to the chunk's GMAC right after
it lands, from cache (L2 or L3). Two GIL hand-offs per piece (the receive and the MAC each
release it) are what a second receiving thread contends for, so larger pieces cost two
connections less: receiver CPU with two connections (1 GiB, loopback, 2 cores, an AMD EPYC
with VPCLMULQDQ, medians over three alternating runs of 3 rounds each) 0.47, 0.60 and 0.62 s/GB
at 256-512 KiB against 0.38, 0.52 and 0.55 at 1 MiB; with one connection 0.34-0.47 at 256 KiB
against 0.34-0.48 at 1 MiB. An earlier host, one connection: ~0.38 s/GB at 256-512 KiB, ~0.41 at
1 MiB, ~0.47 at 4 MiB. With the MAC in a second thread reading each 16 MiB chunk back from
memory the receiver needed 0.38-0.48 s/GB against 0.25 fed from cache (an earlier host)."""
STREAMS = 2
"""Receiving connections per transfer, at least one per source: one source gets two (for a state of
``MIN_STREAM_BYTES`` per connection or more). A connection is received and MAC'd by one thread,
which caps it at one core's rate of both. On 2 cores shared with the source, 1 GiB on loopback
(``benchmarks.transfer``, an AMD EPYC without VPCLMULQDQ, medians of 5-10 paired rounds per
run), two connections gave 0.88x, 1.10x, 1.07x, 1.03x and 1.38x one in five runs (GMAC at
2.8-5.4 GB/s per core: the slower the MAC, the larger the gain), 0.89x in a sixth (GMAC
5.6 GB/s); with VPCLMULQDQ and 1 MiB pieces, 1.02x (GMAC 4.7 GB/s). Not more by default: on
those 2 cores a third thread only competes with the source."""
MIN_STREAM_BYTES = 64 << 20
"""Extra connections (past one per source) only for states of at least this many bytes per
connection: a smaller state is in before a second handshake would pay off, and the extra
connection would be closed mid-handshake (the source logs a dropped connection)."""
STOP_TIMEOUT_S = 5.0
"""After a cancelled transfer: how long to wait for the receiving threads to end (their sockets
are shut down first, which ends a blocked receive at once). Also how long a verified copy waits
for a dropped straggler's thread to stop writing the chunk."""
FINISHED = "finished"
"""The failure mark of a connection still holding chunks when the last one is in (copies of
chunks verified from others): it is shut down, and not counted in ``failures``."""

Address = tuple[str, int]
log = logging.getLogger(__name__)
_KEEPALIVE = encode_frame("keepalive")


@dataclass
class FetchResult:
    """Outcome of :func:`fetch`. ``seconds``: wall time from first connect to last chunk.
    ``refetched_chunks``: chunks handed to another source after the connection holding them
    failed, or (still holding them) straggled; counted at each hand-over."""

    snapshot: Snapshot
    fingerprint: bytes
    failures: Counter[str]
    bytes_by_source: dict[Address, int]
    refetched_chunks: int
    allocated_bytes: int
    seconds: float
    received_bytes: int = 0
    """Bytes read from every connection of the transfer (frames, manifests, chunk bytes,
    verified or not: a failed source's part of a chunk counts), to compare with the state's.
    0 from the process-group transport, which does not count them."""
    resumed_chunks: int = 0
    """Chunks a source failed while sending that another source finished from where it
    stopped (their bytes received once)."""


@dataclass(eq=False)
class _Source:
    addr: Address
    conn: Conn
    session: bytes
    manifest: Manifest
    chunk_key: bytes
    inflight: deque[int] = field(default_factory=deque)
    idle: bool = False
    done: bool = False
    failed: str | None = None
    bytes: int = 0
    head_since: float = 0.0  # monotonic seconds since its oldest requested chunk is awaited
    byte_s: float | None = None  # seconds per byte its last chunk took
    straggler: bool = False  # its chunks were offered to the other sources (it still holds them)
    skips: dict[int, int] = field(default_factory=dict)  # chunk -> bytes its request skips
    landing: int | None = None  # the chunk being received in place, while it is
    landed: int = 0  # bytes of ``landing`` received (after those skipped)
    sent_at: float = 0.0  # monotonic seconds of its last frame to the source


async def _open(addr: Address, keys: TransferKeys, config_id: int, tid: bytes, algo: str,
                step: int | None, max_manifest_bytes: int, max_state_bytes: int,
                timeout_s: float) -> _Source:
    """Connect to ``addr``, authenticate and read its manifest; ``TimeoutError`` after
    ``timeout_s`` without progress (``NoProgress``)."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    set_buffers(sock)
    conn = Conn(sock, loop)
    try:
        async with NoProgress(conn, timeout_s):
            await loop.sock_connect(sock, addr)
            session, _server_config = await client_handshake(conn, keys, config_id, tid)
            await conn.send(encode_frame("manifest?", algo=algo, step=step))
            msg = await conn.read_frame()
            if msg["op"] == "error":
                raise Refused.of(msg)
            if msg["op"] != "manifest":
                raise PeerError("bad_frame", f"expected manifest, got {msg['op']!r}")
            size = get_field(msg, "size", int)
            wrapped = get_field(msg, "key", bytes, chunkmac.KEY_BYTES)
            tag = get_field(msg, "tag", bytes, fp.TAG_BYTES)
            if size > max_manifest_bytes:
                raise PeerError("too_large", f"manifest of {size} bytes > {max_manifest_bytes}")
            body = bytes(await conn.recv_exact(size))
        if not hmac.compare_digest(tag, fp.frame_tag(session, b"manifest", wrapped + body)):
            raise PeerError("bad_tag", "manifest tag")
        manifest = await asyncio.to_thread(decode_manifest, body, max_state_bytes)
        if manifest.algo != algo:
            raise PeerError("bad_manifest", "algorithm")
        return _Source(addr, conn, session, manifest, chunkmac.wrap_key(session, wrapped))
    except BaseException:
        conn.close()
        raise


class _Transfer:
    """The stripe-and-failover state of one transfer, shared by one receiving thread per
    connection (``_pump``) and the event loop (``run``, ``_watchdog``). ``sources`` holds one
    ``_Source`` per connection; those with the same ``addr`` are one source and fail together.
    A chunk is held (in ``inflight``) by one connection, or, once a straggler's are offered, by
    it and one other; the first verified copy counts, and at most one connection at a time
    receives a chunk into the target (``writer``), any other copy into a buffer of its own.
    ``cond`` guards the queue, ``offered``, ``verified``, ``writer``, the counters and every
    connection's ``inflight`` / ``idle`` / ``failed`` / ``straggler``."""

    def __init__(self, sources: list[_Source], target: Snapshot, manifest: Manifest,
                 tid: bytes, window: int, progress_timeout_s: float,
                 on_progress: Callable[[int, int], None] | None,
                 pool: ThreadPoolExecutor, failures: Counter[str],
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.sources = sources
        self.target = target
        self.m = manifest
        self.tid = tid
        self.window = window
        self.progress_timeout_s = progress_timeout_s
        self.keepalive_s = keepalive_s
        self.on_progress = on_progress
        self.pool = pool
        self.failures = failures
        self.cond = threading.Condition()
        self.queue: deque[int] = deque(range(manifest.num_chunks))  # held by no connection
        self.offered: deque[int] = deque()  # held by a straggler, offered to other sources
        self.verified = bytearray(manifest.num_chunks)  # 1: its first copy verified
        self.writer: dict[int, _Source] = {}  # chunk -> the connection receiving it in place
        # chunk -> its bytes in the target (from its start) that a connection which failed
        # while receiving it in place left: the next request for it skips them.
        self.partial: dict[int, int] = {}
        self.remaining = manifest.num_chunks
        self.received_bytes = 0
        self.refetched = 0
        self.resumed = 0
        self.stopping = False
        self.dropped: set[Address] = set()  # sources counted in ``failures``
        self.loop = asyncio.get_running_loop()
        # Every receiving thread takes its first chunks only once all have started, so a small
        # state is not all taken by the thread that happened to start first.
        self.started = threading.Barrier(len(sources))

    async def run(self, late: Sequence[Coroutine[Any, Any, _Source | None]] = (),
                  extra: Sequence[Coroutine[Any, Any, _Source | None]] = ()) -> None:
        """Receive until every chunk is verified, or no connection is left and none of ``late``
        is still opening. ``late``: sources still opening (each bounded by its connect
        timeout); ``extra``: more connections to sources already here (``fetch``'s extra
        streams). Both run as tasks of this call; each that opens while chunks remain gets its
        own thread, the others are closed."""
        if self.remaining == 0:
            for c in (*late, *extra):
                c.close()
            return
        threads = {self.loop.run_in_executor(self.pool, self._pump, s, True)
                   for s in self.sources}
        # Owned by this call; each opening's result is read here as it ends.
        tasks = OwnedTasks("transfer-receive", len(late) + len(extra) + 1)
        awaited: set[asyncio.Future[Any]] = {tasks.spawn(c, name="late source") for c in late}
        opening: set[asyncio.Future[Any]] = awaited | {
            tasks.spawn(c, name="extra connection") for c in extra}
        watchdog = tasks.spawn(self._watchdog(), name="watchdog")
        try:
            # With every connection gone, a source still opening may yet carry the rest.
            while threads or (awaited & opening and self.remaining and not self.stopping):
                done, _ = await asyncio.wait(threads | opening,
                                             return_when=asyncio.FIRST_COMPLETED)
                for f in done & opening:
                    opening.discard(f)
                    if (s := f.result()) is not None and self._join(s):
                        threads.add(self.loop.run_in_executor(self.pool, self._pump, s, False))
                for t in done & threads:
                    threads.discard(t)
                    t.result()  # _pump raises only on a bug
        except BaseException:
            # Cancelled from outside (or a thread's bug): end every thread (bounded) before the
            # target's memory is handed back, so no late byte lands in it.
            self._stop()
            if threads:
                await asyncio.wait(threads, timeout=STOP_TIMEOUT_S)
            raise
        finally:
            tasks.cancel()  # a connection still opening closes itself (``_open``)
            await asyncio.wait([watchdog, *opening])  # each ends at its next await
            for f in opening:  # opened after the last wait: not used
                if not f.cancelled() and (s := f.result()) is not None:
                    s.conn.close()
        if self.remaining:
            raise TransferFailed("no_sources_left",
                                 f"{self.remaining} chunks missing; failures "
                                 f"{dict(self.failures)}", self.failures)

    def _join(self, s: _Source) -> bool:
        """Add the opened connection ``s`` to the transfer, or close it: when its manifest is
        not the agreed one, its source was dropped, or nothing is left to receive."""
        with self.cond:
            ok = (s.manifest.fingerprint == self.m.fingerprint and self.remaining > 0
                  and not self.stopping and s.addr not in self.dropped)
            if ok:
                self.sources.append(s)
        if not ok:
            s.conn.close()
        return ok

    def _stop(self) -> None:
        self.started.abort()
        with self.cond:
            self.stopping = True
            for s in self.sources:
                s.failed = s.failed or "cancelled"
            self.cond.notify_all()
        for s in self.sources:
            s.conn.shutdown()

    async def _watchdog(self) -> None:
        """Backstop for the sockets' own timeouts: a busy source whose thread has not
        returned from a call for ``WATCHDOG_FACTOR`` times ``progress_timeout_s`` is shut down
        (its thread then fails it ``no_progress``). Not at ``progress_timeout_s`` itself: a
        receive that moved fewer bytes than its piece returns them only when the kernel's
        timeout ends it, so a source trickling bytes refreshes its progress just then, and a
        watchdog at the same deadline would race it (dropping a live source, or not, by luck).
        And the straggler rule: while another source sits idle with nothing left to take, a
        busy one whose oldest chunk has taken ``STRAGGLER_FACTOR`` times what its bytes took at
        the fastest recent chunk's rate and over ``STRAGGLER_FLOOR_S`` has its chunks offered
        to the idle ones, which no other source holds yet; it keeps them (the idle one may be
        dead: idle, it reads nothing) and is dropped ``too_slow`` only once they are in from
        others."""
        period = min(self.progress_timeout_s / 4, 1.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            drop = []
            with self.cond:
                live = [s for s in self.sources if not s.done and s.failed is None]
                busy = [s for s in live if not s.idle]
                idle_addrs = {s.addr for s in live if s.idle}
                fastest = None  # seconds per byte
                if not self.queue and idle_addrs:
                    fastest = min((s.byte_s for s in self.sources if s.byte_s is not None),
                                  default=None)
                offered = len(self.offered)
                for s in busy:
                    if now - s.conn.last_progress > WATCHDOG_FACTOR * self.progress_timeout_s:
                        s.failed = "no_progress"
                        drop.append(s)
                    elif (fastest is not None and s.inflight
                          and now - s.head_since > max(
                              STRAGGLER_FLOOR_S, STRAGGLER_FACTOR * fastest
                              * self.m.chunk_range(s.inflight[0])[1])
                          and idle_addrs - {s.addr}):  # idle: another source, not its own
                        offer = [i for i in s.inflight if not self.verified[i]
                                 and i not in self.offered and not self._held(i, s.addr)]
                        s.straggler = s.straggler or bool(offer)
                        self.offered.extend(offer)  # counted when one is taken
                if len(self.offered) > offered:
                    self.cond.notify_all()  # the idle ones take them
            for s in drop:
                s.conn.shutdown()

    # -- which connection holds which chunk (all under ``cond``) -----------------------------
    def _held(self, i: int, addr: Address) -> bool:
        """Whether a live connection to a source other than ``addr`` holds chunk ``i``."""
        return any(o.addr != addr and o.failed is None and i in o.inflight for o in self.sources)

    def _take(self, s: _Source) -> int | None:
        """The next chunk for ``s``: from the queue, else one a straggler of another source
        holds (``offered``); ``None`` if there is none."""
        while self.queue:
            i = self.queue.popleft()
            if not self.verified[i]:
                # A queued chunk has no other holder, so nothing writes its bytes in place but
                # ``s``: those a failed connection left stay put, and ``s`` skips them.
                s.skips[i] = self.partial.get(i, 0)
                return i
        for i in list(self.offered):
            if self.verified[i]:
                self.offered.remove(i)
            elif not any(o.addr == s.addr and o.failed is None and i in o.inflight
                         for o in self.sources):
                self.offered.remove(i)
                self.refetched += 1  # handed to another source
                s.skips[i] = 0  # received aside, whole (its straggler writes it in place)
                return i
        return None

    def _release(self, s: _Source, chunks: Sequence[int]) -> None:
        """``s`` lets go of ``chunks`` (it failed, or received a copy it could not use): each
        not verified that no other live connection holds goes back to the queue."""
        for i in chunks:
            if (self.verified[i] or i in self.queue
                    or any(o is not s and o.failed is None and i in o.inflight
                           for o in self.sources)):
                continue
            if i in self.offered:  # its straggler failed before another source took it
                self.offered.remove(i)
            self.refetched += 1
            self.queue.append(i)

    def _verified(self, s: _Source, i: int, n: int) -> list[_Source]:
        """Count chunk ``i`` (``n`` bytes), just verified from ``s``, as in. Returns the
        connections to shut down: stragglers whose every chunk is in from others (they would
        only receive copies), and once the last chunk is in, any that still holds one."""
        self.verified[i] = 1
        self.partial.pop(i, None)
        s.bytes += n
        self.remaining -= 1
        self.received_bytes += n
        stop = [o for o in self.sources if o.straggler and o.failed is None and o.inflight
                and all(self.verified[j] for j in o.inflight)]
        for o in stop:
            o.failed = "too_slow"
        if self.remaining == 0:
            for o in self.sources:
                if o.failed is None and o.inflight:
                    o.failed = FINISHED
                    stop.append(o)
        return stop

    def _adopt(self, s: _Source, i: int, copy: memoryview) -> bool:
        """``s`` verified a copy of chunk ``i`` that it received aside (another connection was
        receiving that chunk into the target, or it was in). When that one is a straggler (or
        failed), it is dropped ``too_slow``, and once its thread has stopped writing the chunk
        the copy is written over whatever it left. Returns whether the copy is in the target
        (``s`` is then the chunk's writer); ``False``: the chunk is in, or on its way from a
        connection not known to be slow (the copy is dropped)."""
        with self.cond:
            w = self.writer.get(i)
            if self.verified[i] or (w is not None and not w.straggler and w.failed is None):
                return False
            if w is not None and w.failed is None:
                w.failed = "too_slow"  # its thread counts it, and fails its siblings
        if w is not None:
            w.conn.shutdown()
        with self.cond:
            self.cond.wait_for(lambda: self.verified[i] or self.stopping
                               or i not in self.writer, STOP_TIMEOUT_S)
            if self.verified[i] or self.stopping or i in self.writer:
                return False
            self.writer[i] = s
        pos = 0
        for seg in self.target.segments(i):
            seg[:] = copy[pos:pos + len(seg)]
            pos += len(seg)
        return True

    # -- the receiving thread of one connection ---------------------------------------------
    def _pump(self, s: _Source, first: bool) -> None:
        """Request, receive and verify chunks from ``s`` until none is left or ``s`` fails; a
        failure puts ``s``'s unverified chunks that no other connection holds back in the
        queue for the other sources.
        ``first``: one of the connections the transfer started with (they start together)."""
        try:
            sock = s.conn.sock
            sock.setblocking(True)
            set_timeouts(sock, self.progress_timeout_s / KERNEL_TIMEOUT_PARTS)
            try:
                if first:
                    self.started.wait(self.progress_timeout_s)
            except threading.BrokenBarrierError:
                pass  # a thread failed before it (or the wait timed out): go on
            self._chunks(s)
            with self.cond:
                if s.failed not in (None, FINISHED) and not self.stopping:
                    raise PeerError(s.failed)  # marked by the watchdog or a verified copy
            sock.setblocking(False)  # back to the event loop (the closing ``bye``)
        except Exception as e:
            if isinstance(e, TransferError):
                reason = e.reason
            elif isinstance(e, BlockingIOError):  # SO_RCVTIMEO / SO_SNDTIMEO expired
                reason = "no_progress"
            elif isinstance(e, OSError):
                reason = "closed" if isinstance(e, ConnectionError) else type(e).__name__
            else:  # a bug, or input no check caught: fail the source, never hang the rest
                log.exception("transfer: receiving from %s failed", s.addr)
                reason = "internal_error"
            self.started.abort()  # no other thread waits for this one
            with self.cond:
                s.failed = s.failed or reason
                siblings = []
                if s.failed != FINISHED:
                    if s.addr not in self.dropped:  # a source counts once, by its first reason
                        self.dropped.add(s.addr)
                        self.failures[s.failed] += 1
                    siblings = [o for o in self.sources
                                if o.addr == s.addr and o is not s and o.failed is None]
                for o in siblings:
                    o.failed = s.failed
                for i in [i for i, w in self.writer.items() if w is s]:
                    del self.writer[i]  # its thread writes no more
                    if s.landing == i and s.landed:  # failed while receiving it: keep them
                        self.partial[i] = s.skips.get(i, 0) + s.landed
                self._release(s, s.inflight)  # (a straggler's chunk others hold stays theirs)
                s.inflight.clear()
                self.cond.notify_all()
            s.conn.close()
            for o in siblings:  # their threads then requeue their chunks
                o.conn.shutdown()
        finally:
            s.done = True

    def _chunks(self, s: _Source) -> None:
        m, conn, cond = self.m, s.conn, self.cond
        head = bytearray(LEN_BYTES)
        head_view = memoryview(head)
        s.sent_at = time.monotonic()
        keepalive = False
        while True:
            if keepalive:  # idle: tell the source we are still here (KEEPALIVE_S)
                _send_all(conn, _KEEPALIVE, self.progress_timeout_s)
                s.sent_at = time.monotonic()
                keepalive = False
            with cond:
                if s.failed is not None:  # a sibling failed, or the watchdog dropped it:
                    return  # take nothing more (_pump requeues what it holds)
                gets = []
                while len(s.inflight) < self.window and (g := self._take(s)) is not None:
                    s.inflight.append(g)
                    gets.append(g)
                if gets and len(gets) == len(s.inflight):  # its oldest is awaited from now
                    s.head_since = time.monotonic()
                if not s.inflight:
                    if (self.remaining == 0 or self.stopping
                            or not any(o.inflight for o in self.sources)):
                        return  # (nobody owes a chunk and the queue is empty: none will come)
                    # Until another source fails (its chunks come back) or the last chunk
                    # is in.
                    s.idle = True
                    cond.wait(min(self.progress_timeout_s, self.keepalive_s))
                    s.idle = False
                    conn.last_progress = time.monotonic()
                    keepalive = conn.last_progress - s.sent_at >= self.keepalive_s
                    continue
                i = s.inflight[0]
            if gets:
                _send_all(conn, b"".join([encode_frame("get", i=g, s=s.skips[g]) if s.skips[g]
                                          else encode_frame("get", i=g) for g in gets]),
                          self.progress_timeout_s)
                s.sent_at = time.monotonic()
            t = self.progress_timeout_s
            _recv_exact(conn, head_view, t)
            size = int.from_bytes(head, "big")
            if size > MAX_FRAME_BYTES:
                raise PeerError("frame_too_large", f"{size} bytes > {MAX_FRAME_BYTES}")
            body = bytearray(size)
            _recv_exact(conn, memoryview(body), t)
            msg = decode_frame(bytes(body))
            if msg["op"] == "error":
                raise Refused.of(msg)
            if msg["op"] != "chunk":
                raise PeerError("bad_frame", f"expected chunk, got {msg['op']!r}")
            off, n = m.chunk_range(i)
            skip = s.skips.pop(i)
            if (msg.get("i") != i or msg.get("o") != off or msg.get("n") != n
                    or msg.get("s", 0) != skip):
                raise PeerError("bad_chunk_header", f"chunk {i}")
            tag = get_field(msg, "tag", bytes, chunkmac.TAG_BYTES)
            with cond:
                copy = self.verified[i] or i in self.writer  # another's (a straggler's) chunk
                if not copy:
                    self.writer[i] = s
            mac = chunkmac.Gmac(chunkmac.chunk_key(s.chunk_key, i))
            views = self.target.segments(i)
            aside = None
            if copy:
                aside = memoryview(bytearray(n))
                if skip:  # (a resumed chunk is a queued one, which has no other writer)
                    aside[:skip] = b"".join(bytes(v) for v in _split(views, skip)[0])
                views = [aside]
            held, todo = _split(views, skip)
            for v in held:  # the bytes a failed source left: MAC'd with the rest
                mac.update(v)
            s.landing, s.landed = (None if copy else i), 0

            def landed(piece: memoryview, update: Callable[[memoryview], None] = mac.update,
                       s: _Source = s) -> None:
                update(piece)
                s.landed += len(piece)

            for seg in todo:
                _recv_exact(conn, seg, t, landed)
            s.landing = None
            inner = mac.digest()
            if not hmac.compare_digest(tag, chunkmac.chunk_tag(s.session, self.tid, i, off, n,
                                                               inner)):
                if not skip:
                    raise PeerError("bad_chunk", f"chunk {i}")  # still in s.inflight: requeued
                # The skipped bytes came from a source that failed mid-chunk and may be the
                # ones at fault: receive the chunk whole once more, blaming nobody.
                with cond:
                    s.inflight.popleft()
                    if not copy:
                        del self.writer[i]
                    self.partial.pop(i, None)
                    self._release(s, (i,))
                    cond.notify_all()
                log.warning("transfer: chunk %d resumed from %s failed its MAC; received whole "
                            "again", i, s.addr)
                continue
            in_target = aside is None or self._adopt(s, i, aside)
            with cond:
                s.inflight.popleft()
                now = time.monotonic()
                s.byte_s, s.head_since = (now - s.head_since) / max(1, n - skip), now
                stop: list[_Source] = []
                received = None
                if in_target:
                    del self.writer[i]
                    stop = self._verified(s, i, n)
                    received = self.received_bytes
                    self.resumed += skip > 0
                else:
                    self._release(s, (i,))
                cond.notify_all()  # the last chunk ends every thread's wait
            for o in stop:
                o.conn.shutdown()
            if self.on_progress is not None and received is not None:
                self.loop.call_soon_threadsafe(self.on_progress, received, m.total_bytes)


def _split(views: list[memoryview], at: int) -> tuple[list[memoryview], list[memoryview]]:
    """``views`` (byte views) cut after their first ``at`` bytes: (those bytes, the rest)."""
    head: list[memoryview] = []
    rest: list[memoryview] = []
    for v in views:
        if at >= len(v):
            head.append(v)
            at -= len(v)
        elif at:
            head.append(v[:at])
            rest.append(v[at:])
            at = 0
        else:
            rest.append(v)
    return head, rest


def _recv_exact(conn: Conn, view: memoryview, timeout_s: float,
                on_piece: Callable[[memoryview], None] | None = None) -> None:
    """Fill ``view`` from ``conn``'s blocking socket in pieces of ``RECV_PIECE_BYTES``
    (``MSG_WAITALL``: one call per piece), handing each piece to ``on_piece`` as it lands.
    Raises ``PeerError`` ``closed`` at end of stream, ``BlockingIOError`` once no byte arrived
    for ``timeout_s`` (the socket's own timeout, a part of it, ends each call)."""
    recv_into, pos, end = conn.sock.recv_into, 0, len(view)
    piece = RECV_PIECE_BYTES
    while pos < end:
        part = view[pos:min(pos + piece, end)]
        try:
            k = recv_into(part, 0, socket.MSG_WAITALL)
        except BlockingIOError:
            if time.monotonic() - conn.last_progress < timeout_s:
                continue
            raise
        if k == 0:
            raise PeerError("closed", "connection closed mid-message")
        if on_piece is not None:
            on_piece(part[:k])
        pos += k
        conn.bytes_in += k
        conn.last_progress = time.monotonic()


def _send_all(conn: Conn, data: bytes, timeout_s: float) -> None:
    """Send ``data`` on ``conn``'s blocking socket; ``BlockingIOError`` once no byte left for
    ``timeout_s``. The wait for the answer counts from here (``last_progress``)."""
    view = memoryview(data)
    while view:
        try:
            k = conn.sock.send(view)
        except BlockingIOError:
            if time.monotonic() - conn.last_progress < timeout_s:
                continue
            raise
        view = view[k:]
        conn.bytes_out += k
        conn.last_progress = time.monotonic()


async def fetch(sources: Sequence[Address], keys: TransferKeys, config_id: int, *,
                into: Snapshot | Mapping[str, Any] | None = None,
                expected_fingerprint: bytes | None = None, step: int | None = None,
                algo: str = "xxh3", progress_timeout_s: float = PROGRESS_TIMEOUT_S,
                connect_timeout_s: float = CONNECT_TIMEOUT_S, window: int = WINDOW_CHUNKS,
                max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES,
                max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
                max_alloc_bytes: int | None = None, streams: int = STREAMS,
                on_progress: Callable[[int, int], None] | None = None,
                keepalive_s: float = KEEPALIVE_S) -> FetchResult:
    """Receive the snapshot the ``sources`` (``(host, port)`` of transfer servers) agree on.

    ``keys``: derived from the cluster key. ``config_id``: the receiver's current configuration;
    a source whose own is newer refuses it (``stale_config``), an older or equal one serves.
    ``into``: the receiver's own state (a :class:`Snapshot`, or the dict of live objects it
    would pass to ``Snapshot.capture``) to receive into in place.
    ``expected_fingerprint``: the 32-byte fingerprint the plan names; only sources holding it
    are used (without it, the one most sources hold). Receiving starts as soon as one source
    holds it (without it: as soon as a majority of ``sources`` hold one fingerprint, or every
    source has answered); sources still opening then join as they open. ``step``: ask for
    exactly this step (sources holding another refuse). ``algo``: the digest algorithm of the
    fingerprint, ``"xxh3"`` or ``"blake3"`` (see ``fingerprint``); chunks are authenticated by
    their MACs (``chunkmac``) either way: a chunk whose MAC fails counts ``bad_chunk`` against
    its source, which is dropped. ``progress_timeout_s``: seconds without a byte from a busy
    source before it is dropped. ``connect_timeout_s``: seconds without progress a source has
    to connect, authenticate and send its manifest. ``keepalive_s``: seconds between the
    ``keepalive`` frames of an idle connection (``KEEPALIVE_S``; below the sources'
    ``IDLE_TIMEOUT_S``). ``window``: chunks requested ahead per connection.
    ``max_manifest_bytes`` / ``max_state_bytes``: manifests and states claiming more bytes are
    refused (``too_large``). ``max_alloc_bytes``: bytes the receiver may allocate for tensors it
    lacks (default ``max_state_bytes``). ``streams``: receiving connections in all, at least one
    per agreed source (``STREAMS``; extra ones only for ``MIN_STREAM_BYTES`` of state each).
    ``on_progress(received_bytes, total_bytes)`` is called (on the event loop) after each
    verified chunk. ``failures`` counts each failed source once, by the first reason one of its
    connections gave; an extra connection (past one per source) that fails to open is logged,
    not counted: its source still serves; a source still opening when every chunk is in is
    left, not counted, and so is one that then holds only copies of a straggler's chunks.

    Raises :class:`TransferFailed` (``no_sources``, ``sources_disagree``, ``no_sources_left``,
    ``too_large`` when the state does not fit) with ``failures`` counting each source's reason;
    ``ValueError`` for local misuse; ``TypeError`` for an ``into`` that ``Snapshot.capture``
    refuses. A failed fetch's exception holds none of the tensors it allocated: the locals of
    the frames in its traceback are cleared (files and lines are kept).
    """
    try:
        return await _fetch(
            sources, keys, config_id, into=into, expected_fingerprint=expected_fingerprint,
            step=step, algo=algo, progress_timeout_s=progress_timeout_s,
            connect_timeout_s=connect_timeout_s, window=window,
            max_manifest_bytes=max_manifest_bytes, max_state_bytes=max_state_bytes,
            max_alloc_bytes=max_alloc_bytes, streams=streams, on_progress=on_progress,
            keepalive_s=keepalive_s)
    except BaseException as e:
        _drop_locals(e)
        raise


def _drop_locals(e: BaseException) -> None:
    """Clear the locals of the finished frames in the tracebacks of ``e`` and of the exceptions
    chained to it. Those of ``_fetch`` and ``_Transfer`` hold the receive target (every tensor
    allocated for it) and the connections for as long as the exception lives, and a caller
    that retries keeps the last one: a failed attempt's memory must not be held through the
    next."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if id(x) not in seen:
            seen.add(id(x))
            traceback.clear_frames(x.__traceback__)  # skips a frame still running (ours)
            todo += [c for c in (x.__cause__, x.__context__) if c is not None]


async def _fetch(sources: Sequence[Address], keys: TransferKeys, config_id: int, *,
                 into: Snapshot | Mapping[str, Any] | None, expected_fingerprint: bytes | None,
                 step: int | None, algo: str, progress_timeout_s: float,
                 connect_timeout_s: float, window: int, max_manifest_bytes: int,
                 max_state_bytes: int, max_alloc_bytes: int | None, streams: int,
                 on_progress: Callable[[int, int], None] | None,
                 keepalive_s: float) -> FetchResult:
    """:func:`fetch`, whose frame (this one) has ended when ``fetch`` clears it."""
    if not sources:
        raise ValueError("no sources")
    if algo not in fp.ALGORITHMS or window < 1 or streams < 1:
        raise ValueError("bad algo, window or streams")
    t0 = time.monotonic()
    tid = os.urandom(TRANSFER_ID_BYTES)
    failures: Counter[str] = Counter()
    seen: list[_Source] = []  # every connection opened, for ``received_bytes``

    async def attempt(addr: Address, counts: Counter[str] = failures) -> _Source | None:
        try:
            s = await _open(addr, keys, config_id, tid, algo, step, max_manifest_bytes,
                            max_state_bytes, connect_timeout_s)
            seen.append(s)
            return s
        except TimeoutError:
            counts["connect_timeout"] += 1
        except TransferError as e:
            counts[e.reason] += 1
        except OSError as e:
            counts["closed" if isinstance(e, ConnectionError) else "connect_failed"] += 1
        except Exception:  # input no check caught: this source is left out, the others go on
            log.exception("transfer: opening %s failed", addr)
            counts["internal_error"] += 1
        return None

    async def attempt_extra(addr: Address) -> _Source | None:
        # An extra connection that fails costs a stream, not the source: logged, not counted.
        counts: Counter[str] = Counter()
        more = await attempt(addr, counts)
        if counts:
            log.info("transfer: no extra connection to %s: %s", addr, dict(counts))
        return more

    async def late(opening: asyncio.Future[_Source | None]) -> _Source | None:
        # A source that opens after the transfer started: used if it holds the agreed state.
        s = await opening
        if s is not None and s.manifest.fingerprint != manifest.fingerprint:
            failures["fingerprint_mismatch"] += 1
            s.conn.close()
            return None
        return s

    # Start once the state is settled: the expected fingerprint is held, or one is held by a
    # majority of all the sources (no other can have more). The rest join as they open, so a
    # source that hangs while opening delays nothing (before, all were awaited: up to
    # ``connect_timeout_s``).
    owned = OwnedTasks("transfer-open", max(len(sources), 1))  # this call's; results read here
    openings = [owned.spawn(attempt(a), name=f"open {a[0]}:{a[1]}") for a in sources]
    pending: set[asyncio.Future[_Source | None]] = set(openings)
    opened: list[_Source] = []
    chosen: list[_Source] = []
    try:
        while pending and not _settled(openings, expected_fingerprint, len(sources) // 2 + 1):
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        opened = [s for t in openings if t.done() and (s := t.result()) is not None]
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
        try:
            target, allocated = manifest.allocate(
                own, max_state_bytes if max_alloc_bytes is None else max_alloc_bytes)
        except PeerError as e:  # the agreed state does not fit
            raise TransferFailed(e.reason, e.detail, failures) from None
        # One receiving (and verifying) thread per connection.
        # Fewer sources than streams: more connections to them, opened while the first ones
        # already receive (one that is slow to open delays nothing).
        # (Counting the sources still opening: ``streams`` bounds the connections in all.)
        first = len(chosen) + len(pending)
        wanted = min(streams, max(first, manifest.total_bytes // max(MIN_STREAM_BYTES, 1)))
        extra = [chosen[k % len(chosen)].addr for k in range(wanted - first)]
        with ThreadPoolExecutor(max_workers=first + len(extra),
                                thread_name_prefix="transfer") as pool:
            tr = _Transfer(chosen, target, manifest, tid, window, progress_timeout_s,
                           on_progress, pool, failures, keepalive_s)
            await tr.run([late(t) for t in pending], [attempt_extra(a) for a in extra])
        for s in tr.sources:
            if s.failed is None:
                try:
                    async with NoProgress(s.conn, BYE_TIMEOUT_S):
                        await s.conn.send(encode_frame("bye"))
                except (OSError, TimeoutError):
                    pass
        by_source: Counter[Address] = Counter()
        for s in tr.sources:
            by_source[s.addr] += s.bytes
        return FetchResult(target, manifest.fingerprint, failures, dict(by_source),
                           tr.refetched, allocated, time.monotonic() - t0,
                           sum(s.conn.bytes_in for s in seen), tr.resumed)
    finally:
        owned.cancel()  # those still opening (the transfer ended first, or never began)
        opened = [s for t in openings if t.done() and not t.cancelled()
                  and (s := t.result()) is not None]
        for s in opened + chosen:  # ``chosen``: the transfer's, extra connections included
            s.conn.close()
        if pending:
            await asyncio.wait(pending)  # a cancelled opening closes its own connection
            for t in pending:
                if not t.cancelled() and (s := t.result()) is not None:
                    s.conn.close()  # opened as it was cancelled


def _settled(openings: Sequence[asyncio.Future[_Source | None]], expected: bytes | None,
             majority: int) -> bool:
    """Whether the sources opened so far settle which state to receive: one holds
    ``expected``, or (without it) ``majority`` of them hold the same fingerprint."""
    held = Counter(s.manifest.fingerprint for t in openings
                   if t.done() and (s := t.result()) is not None)
    if expected is not None:
        return held[expected] > 0
    return bool(held) and max(held.values()) >= majority
