"""The transfer server: every member serves the snapshot of its last committed step.

Why one module of this size: the handshake slots, the served snapshot and the per-connection
senders share the server's accounting of connections and refusals.

Lifecycle: ``server = TransferServer(keys, current_config_id)``, ``await server.start()``,
``server.publish(snapshot)`` (the trainer: when it enters a configuration, where it waits for
the members that fetch; ``None`` once they have all joined), ``await server.close()``
(bounded).
``async with TransferServer(...) as server`` does start and close.

Per connection: handshake (``auth``), then requests: one manifest, then any number of chunk
requests, each answered in order (a request may skip the first bytes of its chunk: the receiver
holds them from a source that failed mid-chunk), and ``keepalive`` frames from a receiver that
has nothing to ask for yet. Serving costs no hashing
of chunk bytes: a published snapshot's chunk digests (for its fingerprint) and inner chunk MACs
(``chunkmac``) are computed once (in worker threads, on the first request), and each chunk's
16-byte tag is a keyed BLAKE3 of its inner MAC under the connection's session key.

Consistency: a connection serves the snapshot that was published when its manifest was asked
for, for its whole life, even if a newer one is published meanwhile (the old one stays alive
until the connection ends: see ``snapshot`` for the memory cost), until ``publish(None)``
withdraws everything: from then on every chunk request is refused ``withdrawn``, so a snapshot
of live memory (``capture(copy=False)``, the trainer's) is never read once its owner trains on.
A receiver that asks for a ``step`` the server does not hold is refused ``step_mismatch``.

Bad input never crashes the server: each refused or dropped connection is counted in
``refused`` by reason (``bad_frame``, ``frame_too_large``, ``bad_version``, ``unknown_key``,
``auth_failed``, ``stale_config``, ``bad_request``, ``no_snapshot``, ``step_mismatch``,
``withdrawn``, ``snapshot_changed`` (its bytes are not those its fingerprint describes:
``Snapshot._scan``), ``handshake_timeout``, ``send_timeout``, ``evicted_unproven`` (a handshake
dropped to make room: ``MAX_HANDSHAKING``, ``pick_evicted``), ``too_many_connections``, ``closed``,
``internal_error`` (a bug, logged with its traceback)), each connection once. :meth:`refusals`
adds ``kernel_dropped`` (connection attempts lost in the listening socket's full accept queue)
and may be read from any thread: the agent shows it in ``/metrics`` and ``/status``.

Deadlines, all "no progress for T" (:class:`~.frames.NoProgress`), none on a whole message:
``handshake_timeout_s`` for each frame of the handshake (the hello after the accept, the proof
after the challenge: from a peer not yet shown to hold the key a frame is the unit of progress,
so one trickling a byte at a time holds its slot 2 x T at most), ``idle_timeout_s`` while waiting
for the next request (the receiver's taking of chunk bytes sent before counts, and so does its
``keepalive``), ``send_timeout_s`` while sending (every byte the socket takes counts).

Progress: ``on_served(step, served_bytes, total_bytes)``, if given, is called on the server's
event loop after each chunk is handed to the socket: the served snapshot's step, the chunk bytes
sent of it so far to this transfer (the receiver's transfer id, over all its connections), and
its total bytes. It must not block; the trainer's fault injection uses it (``kill@S:serve``,
:mod:`torchpass_p2p.trainer.faults`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn, TypeVar

from torchpass_p2p.kernel_drops import socket_drops
from torchpass_p2p.tasks import OwnedTasks, TaskLimitReached

from . import chunkmac, splice
from . import fingerprint as fp
from .auth import TransferKeys, server_handshake
from .errors import PeerError, SnapshotChanged
from .frames import Conn, NoProgress, encode_frame, field, set_buffers
from .manifest import encode_manifest
from .snapshot import Snapshot

log = logging.getLogger(__name__)
K = TypeVar("K")

HANDSHAKE_TIMEOUT_S = 5.0
"""Seconds the peer has for each handshake frame (its hello after the accept, its proof after
the challenge): a small frame on a LAN takes milliseconds; 5 s tolerates a loaded host."""
IDLE_TIMEOUT_S = 60.0
"""Waiting for the next request: a connection with no progress for this long (no request, no
``keepalive``, and its receiver took none of the bytes sent before) is closed. A receiver asks
for its next chunk as one arrives, and one with nothing to ask for sends a keepalive every
``client.KEEPALIVE_S`` (10 s): this only reaps abandoned connections."""
SEND_TIMEOUT_S = 30.0
"""Sending: no byte taken by the socket for this long drops the connection (``send_timeout``).
Not a bound on a whole chunk: 16 MiB to each of 7 sources sharing 2 MB/s takes ~55 s, and such
sources were dropped while every byte moved (4 drops, 275 MB moved for a 169 MB state)."""
MAX_CONNECTIONS = 64
"""Concurrent authenticated connections; a receiver opens at least one per source (two to a
sole source: the client's ``STREAMS``)."""
SERVED_ENTRIES = 256
"""Transfers whose served bytes are kept for ``on_served`` (the most recent)."""
MAX_HANDSHAKING = 16
"""Connections still in their handshake (not yet shown to hold the key), counted apart from
``MAX_CONNECTIONS``: a peer without the key that keeps reconnecting holds only these slots,
never those of transfers (with shared slots such a peer could hold all 64 and no fetch
would get through). One more evicts one of them (counted ``evicted_unproven``), chosen by
``pick_evicted``: a flood from one address evicts only its own handshakes."""
MAX_CONNECTION_TASKS = 4096
"""Connections held at once in any phase (handshake, transfer, lingering after an ``error``
frame). ``MAX_HANDSHAKING`` and ``MAX_CONNECTIONS`` bound the first two; this bounds the rest
(each over within ``LINGER_S``), above the usual limit of open files (1024), so that the
kernel refuses first. One more is closed at once, counted ``too_many_connections``."""
LINGER_S = 1.0
"""After an ``error`` frame: how long the server reads what the peer still sends before it
closes (the peer closes as soon as it has read the frame)."""
_LOG_EVERY_S = 10.0


class TransferServer:
    """Serves published snapshots over TCP to key holders with a current ``config_id``.

    ``current_config_id()`` is read at each handshake; a client presenting an older one is
    refused. The receiver names the digest algorithm of the manifest's fingerprint
    (``fingerprint.ALGORITHMS``); chunks are authenticated by ``chunkmac`` whatever it is.
    """

    def __init__(self, keys: TransferKeys, current_config_id: Callable[[], int], *,
                 host: str = "127.0.0.1", port: int = 0,
                 max_connections: int = MAX_CONNECTIONS,
                 max_handshaking: int = MAX_HANDSHAKING,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S,
                 send_timeout_s: float = SEND_TIMEOUT_S,
                 on_served: Callable[[int, int, int], None] | None = None,
                 zero_copy: bool | None = None) -> None:
        self.keys = keys
        self.zero_copy = zero_copy if splice.available() else False
        """Chunks leave by reference (:mod:`.splice`) instead of through ``send()``: always
        (True), never (False), or to receivers on other hosts (None, the default). On one host
        the receiver's read then takes the pages from memory instead of a copy still in cache,
        which cost it more CPU than the source saved (loopback benchmark: 2.4 GB/s against
        3.7 with a copying source); across a network the receiver's side is the same either
        way and the source's copy is saved."""
        self.on_served = on_served
        self.current_config_id = current_config_id
        self.host, self.port = host, port
        self.max_connections = max_connections
        self.max_handshaking = max_handshaking
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.send_timeout_s = send_timeout_s
        self.refused: Counter[str] = Counter()
        """Dropped connections by reason (a peer's fault, or a refusal)."""
        self.stats: Counter[str] = Counter()
        """``connections``, ``transfers`` (manifests served: one per connection, so a receiver
        with two connections counts two), ``chunks``, ``bytes`` (chunk bytes sent),
        ``idle_timeouts`` (connections closed waiting for a request), ``keepalives``."""
        self._snapshot: Snapshot | None = None
        self._withdrawals = 0  # publish(None) calls: a connection older than the last is cut
        self._lsock: socket.socket | None = None
        self._accepting = OwnedTasks("transfer-server-accept", 1)
        self._conns = OwnedTasks("transfer-server", MAX_CONNECTION_TASKS)  # one a connection
        self._handshaking: dict[asyncio.Task, _Pending] = {}  # in arrival order
        self._serving = 0  # connections past their handshake
        # Chunk bytes served per transfer (the receiver's transfer id) and step, over all its
        # connections; the most recent SERVED_ENTRIES only.
        self._served: OrderedDict[tuple[bytes, int], int] = OrderedDict()
        # Zero-copy sends block a thread each until the receiver reads (up to send_timeout_s):
        # their own pool, one thread per connection at most. On the event loop's default pool
        # (6 threads on 2 cores) six stalled receivers would starve every other connection's
        # manifest.
        self._senders: ThreadPoolExecutor | None = None
        self._last_log = 0.0

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind and listen. ``address`` is then the bound ``(host, port)``."""
        lsock = socket.create_server((self.host, self.port), backlog=128)
        lsock.setblocking(False)
        set_buffers(lsock)
        self._lsock = lsock
        self.port = lsock.getsockname()[1]
        self._accepting.spawn(self._accept_loop(), name=f"accept :{self.port}")

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def refusals(self) -> dict[str, int]:
        """``refused`` by reason (a copy), with ``kernel_dropped``: packets of connection
        attempts the kernel dropped because the listening socket's accept queue was full
        (:func:`torchpass_p2p.kernel_drops.socket_drops`; while listening, once any).

        Safe from any thread, though ``refused`` changes on the server's loop: ``dict()`` of a
        ``Counter`` (a dict subclass with dict's own iterator) is one merge in C, which holds
        the GIL throughout (or, without a GIL, the dict's own lock)."""
        out = dict(self.refused)
        lsock = self._lsock
        dropped = socket_drops(lsock) if lsock is not None else None
        if dropped:
            out["kernel_dropped"] = dropped
        return out

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, cancel every connection and wait at most ``timeout_s`` seconds."""
        handshaking = [p.conn for p in self._handshaking.values()]
        self._accepting.cancel()
        self._conns.cancel()
        if self._lsock is not None:
            self._lsock.close()
        await asyncio.gather(self._accepting.wait(timeout_s), self._conns.wait(timeout_s))
        for conn in handshaking:  # a task cancelled before it ran never reached its close
            conn.close()
        if self._senders is not None:  # its threads end as their sockets close
            self._senders.shutdown(wait=False)
            self._senders = None

    async def __aenter__(self) -> TransferServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def publish(self, snapshot: Snapshot | None) -> None:
        """Serve ``snapshot`` from now on; transfers already reading an older snapshot finish
        on it. ``None`` withdraws every snapshot: nothing is served any more, and transfers in
        progress are refused their next chunk (``withdrawn``)."""
        self._snapshot = snapshot
        if snapshot is None:
            self._withdrawals += 1

    # -- hooks (tests override these to inject faults) -------------------------------------
    def chunk_buffers(self, snapshot: Snapshot, index: int) -> list[memoryview]:
        """The bytes sent for chunk ``index``: the snapshot's own memory, no copy."""
        return snapshot.segments(index)

    async def serve_chunk(self, conn: Conn, snapshot: Snapshot, index: int,
                          header: bytes, skip: int = 0) -> None:
        """Send one chunk: its header frame, then :meth:`chunk_buffers` from byte ``skip`` on
        (by reference when ``zero_copy`` says so and every buffer is writable memory, as the
        snapshot's own is)."""
        await conn.send(header)
        buffers = tail(self.chunk_buffers(snapshot, index), skip)
        by_reference = self.zero_copy if self.zero_copy is not None else _remote(conn.sock)
        if by_reference and all(isinstance(b, memoryview) and not b.readonly
                                and b.c_contiguous for b in buffers):
            if self._senders is None:
                self._senders = ThreadPoolExecutor(self.max_connections, "transfer-send")
            await conn.send_pages(buffers, self.send_timeout_s, self._senders)
            return
        for buf in buffers:
            await conn.send(buf)

    # -- serving ---------------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._lsock is not None
        while True:
            try:
                sock, peer = await loop.sock_accept(self._lsock)
            except OSError as e:
                log.warning("accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            conn = Conn(sock, loop)
            source = source_of(peer)
            try:
                task = self._conns.spawn(self._serve(conn), name=f"serve {source}")
            except TaskLimitReached:
                conn.close()
                self._count("too_many_connections")
                continue
            self._handshaking[task] = _Pending(conn, source, time.monotonic())
            task.add_done_callback(self._handshook)
            if len(self._handshaking) > self.max_handshaking:
                self._evict()
            # Let the new connection answer the hello it usually already holds, and others
            # read their proofs, before the next accept: with connections queued, sock_accept
            # returns without yielding.
            await asyncio.sleep(0)

    def _evict(self) -> None:
        """Drop the handshake ``pick_evicted`` names (counted ``evicted_unproven``)."""
        # A task that ended has counted its own reason; its callback that unlists it may not
        # have run yet. Evicting it would count that connection twice.
        for task in [t for t in self._handshaking if t.done()]:
            del self._handshaking[task]
        if len(self._handshaking) <= self.max_handshaking:
            return
        victim, why = pick_evicted({t: (p.source, p.since)
                                    for t, p in self._handshaking.items()})
        conn = self._handshaking.pop(victim).conn
        victim.cancel()
        # Closed after the task has handled its cancellation (FIFO callbacks): closing a socket
        # with a read still registered left the selector a stale entry that broke the next
        # socket given the same descriptor; a task cancelled before it ran never closes it.
        asyncio.get_running_loop().call_soon(conn.close)
        self._count("evicted_unproven", why)

    def _challenged(self, task: asyncio.Task) -> None:
        pending = self._handshaking.get(task)
        if pending is not None:  # its hello is answered: it waits for its proof from now
            pending.since = time.monotonic()

    def _handshook(self, task: asyncio.Task) -> None:
        self._handshaking.pop(task, None)

    def _count(self, reason: str, detail: str = "") -> None:
        self.refused[reason] += 1
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:  # bounded-rate logging of bad input
            self._last_log = now
            log.warning("transfer server dropped a connection: %s %s (totals %s)", reason,
                        detail, dict(self.refused))

    async def _serve(self, conn: Conn) -> None:
        self.stats["connections"] += 1
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        try:
            try:
                # "No progress for T", a frame being the unit of progress (module docstring).
                async with asyncio.timeout(self.handshake_timeout_s) as phase:
                    def challenged() -> None:  # the proof is due from now
                        self._challenged(task)
                        phase.reschedule(loop.time() + self.handshake_timeout_s)

                    session, tid, _ = await server_handshake(
                        conn, self.keys, self.current_config_id(), on_challenge=challenged)
            except TimeoutError:
                self._count("handshake_timeout")
                return
            self._handshook(task)
            if self._serving >= self.max_connections:
                await self._refuse(conn, "too_many_connections")
            self._serving += 1
            try:
                await self._requests(conn, session, tid)
            finally:
                self._serving -= 1
        except PeerError as e:
            self._count(e.reason, e.detail)
            if isinstance(e, _Told):
                await self._linger(conn)
        except TimeoutError:  # a send that moved no byte for send_timeout_s
            self._count("send_timeout")
        except (ConnectionError, OSError) as e:
            self._count("closed", type(e).__name__)
        except Exception as e:  # never let a peer crash the server
            log.exception("transfer server: unexpected error")
            self._count("internal_error", type(e).__name__)
        finally:
            conn.close()

    async def _requests(self, conn: Conn, session: bytes, tid: bytes) -> None:
        snap: Snapshot | None = None
        inner = b""
        withdrawals = self._withdrawals  # as when ``snap`` was taken
        while True:
            try:
                async with NoProgress(conn, self.idle_timeout_s):
                    msg = await conn.read_frame()
            except TimeoutError:
                self.stats["idle_timeouts"] += 1
                return
            op = msg["op"]
            if op == "get":
                if snap is None:
                    raise PeerError("bad_request", "get before manifest")
                if withdrawals != self._withdrawals:
                    await self._refuse(conn, "withdrawn")
                i = field(msg, "i", int)
                skip = field(msg, "s", int) if "s" in msg else 0
                if i >= snap.num_chunks:
                    raise PeerError("bad_request", f"chunk {i} out of range")
                off, n = snap.chunk_range(i)
                if skip >= n:
                    raise PeerError("bad_request", f"chunk {i}: skip {skip} of {n} bytes")
                tb = chunkmac.TAG_BYTES
                tag = chunkmac.chunk_tag(session, tid, i, off, n, inner[i * tb:(i + 1) * tb])
                async with NoProgress(conn, self.send_timeout_s):
                    await self.serve_chunk(
                        conn, snap, i, encode_frame("chunk", i=i, o=off, n=n, s=skip, tag=tag),
                        skip)
                self.stats["chunks"] += 1
                self.stats["bytes"] += n - skip
                key = (tid, snap.step)
                served = self._served.pop(key, 0) + n - skip
                self._served[key] = served
                if len(self._served) > SERVED_ENTRIES:
                    self._served.popitem(last=False)
                if self.on_served is not None:
                    self.on_served(snap.step, served, snap.total_bytes)
            elif op == "manifest?":
                if snap is not None:
                    raise PeerError("bad_request", "second manifest request")
                algo = msg.get("algo")
                step = msg.get("step")
                if algo not in fp.ALGORITHMS or (step is not None and type(step) is not int):
                    raise PeerError("bad_request", "manifest request")
                snap, withdrawals = self._snapshot, self._withdrawals
                if snap is None:
                    await self._refuse(conn, "no_snapshot")
                if step is not None and step != snap.step:
                    await self._refuse(conn, "step_mismatch", f"asked {step}, have {snap.step}")
                try:
                    body = await asyncio.to_thread(encode_manifest, snap, algo)
                    mac_key, inner = await asyncio.to_thread(snap.chunk_macs)
                except SnapshotChanged as e:  # not the bytes its fingerprint describes
                    await self._refuse(conn, e.reason, e.detail)
                wrapped = chunkmac.wrap_key(session, mac_key)
                tag = fp.frame_tag(session, b"manifest", wrapped + body)
                await self._send(conn, encode_frame("manifest", size=len(body), key=wrapped,
                                                    tag=tag), body)
                self.stats["transfers"] += 1
            elif op == "keepalive":
                self.stats["keepalives"] += 1  # its arrival was the progress
            elif op == "bye":
                return
            else:
                raise PeerError("bad_request", f"op {op!r}")

    async def _refuse(self, conn: Conn, reason: str, detail: str = "") -> NoReturn:
        """Tell the peer ``reason`` in an ``error`` frame, then raise :class:`_Told`."""
        await self._send(conn, encode_frame("error", reason=reason))
        raise _Told(reason, detail)

    @staticmethod
    async def _linger(conn: Conn) -> None:
        """Half close, then read what the peer still sends (``LINGER_S`` at most): closing
        with its pipelined requests unread sends a reset, which throws away what this side
        has not sent yet (the tail of a chunk, the error frame): the peer counted ``closed``."""
        loop = asyncio.get_running_loop()
        try:
            conn.sock.shutdown(socket.SHUT_WR)
            async with asyncio.timeout(LINGER_S):
                while await loop.sock_recv(conn.sock, 1 << 16):
                    pass
        except (OSError, TimeoutError):
            pass

    async def _send(self, conn: Conn, *data: bytes) -> None:
        """Send ``data``; a receiver that takes no byte of it for ``send_timeout_s`` is dropped
        (``TimeoutError``) instead of holding its connection and the snapshot."""
        async with NoProgress(conn, self.send_timeout_s):
            for d in data:
                await conn.send(d)


def tail(buffers: list[memoryview], skip: int) -> list[memoryview]:
    """``buffers`` without their first ``skip`` bytes (no copy)."""
    if not skip:
        return buffers
    out = []
    for b in buffers:
        b = b if b.ndim == 1 and b.format == "B" else b.cast("B")
        if skip >= b.nbytes:
            skip -= b.nbytes
            continue
        out.append(b[skip:])
        skip = 0
    return out


class _Pending:
    """A connection in its handshake: its ``source_of`` key, and since when it has waited for
    its peer (``time.monotonic()`` seconds: its accept, then the challenge that answered its
    hello; bytes that trickle in do not count, so a peer cannot look busy a byte at a time)."""

    __slots__ = ("conn", "source", "since")

    def __init__(self, conn: Conn, source: str, since: float) -> None:
        self.conn, self.source, self.since = conn, source, since


def pick_evicted(pending: Mapping[K, tuple[str, float]]) -> tuple[K, str]:
    """The handshake to drop to make room, and why. ``pending`` maps each handshake to its
    source (``source_of``) and since when it has waited for its peer (seconds, any clock);
    it must not be empty.

    Of the sources holding the most handshakes (ties: the one that has waited longest), the
    handshake that has waited longest; ties by ``pending``'s order. So a peer flooding from
    one address evicts only its own handshakes, and a key holder (its proof follows the
    challenge within a round trip) sharing the flood's address lasts the flood's next
    ``max_handshaking - 1`` arrivals. Ranking by wait, not by phase: the rule before (evict
    the first that had not sent a whole frame) picked the connection just accepted, its hello
    still unread, so under a flood of hellos every fetch was dropped on arrival."""
    held = Counter(source for source, _ in pending.values())
    victim = min(pending, key=lambda k: (-held[pending[k][0]], pending[k][1]))
    source = pending[victim][0]
    return victim, f"{source} held {held[source]} of {len(pending)}"


def source_of(peer: object) -> str:
    """The key of a peer address (``sock_accept``'s) that pending handshakes are shared by:
    its IPv4 address, or the /64 of its IPv6 one (one host's usual prefix: a host holding a
    /64 could otherwise count as billions of sources)."""
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return str(peer)
    try:
        ip = ipaddress.ip_address(peer[0].split("%", 1)[0])
    except ValueError:
        return peer[0]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _Told(PeerError):
    """A refusal the peer was told in an ``error`` frame (it should read it before the close)."""


def _remote(sock: socket.socket) -> bool:
    """Whether the peer of the connected ``sock`` is on another host (not a loopback address,
    not our own address)."""
    try:
        peer, local = sock.getpeername()[0], sock.getsockname()[0]
    except OSError:
        return False
    return peer != local and not ipaddress.ip_address(peer).is_loopback
