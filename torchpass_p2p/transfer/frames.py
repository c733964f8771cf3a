"""Control frames on a transfer connection: a 4-byte big-endian length, then a msgpack map.

Bodies (the manifest, chunk bytes) follow their frame as raw bytes of the length the frame
states; they are never decoded as msgpack objects, let alone unpickled. Every read is bounded:
a frame longer than its limit is refused before any of it is buffered.

Frames (``op`` and fields; ``bin`` = bytes):

=============  ==========  ===========================================================
op             direction   fields
=============  ==========  ===========================================================
hello          C -> S      v (2), key_id, nonce (32 bin), config_id, transfer_id (16 bin)
challenge      S -> C      nonce (32 bin), tag (32 bin)
proof          C -> S      tag (32 bin)
ready          S -> C      config_id (the server's)
manifest?      C -> S      algo, step (int or None); once per connection
manifest       S -> C      size, key (32 bin), tag (16 bin); then ``size`` raw bytes
get            C -> S      i (chunk index), s (bytes of it to skip; 0 if absent)
chunk          S -> C      i, o (offset), n (length), s, tag (16 bin); then ``n - s`` raw
                           bytes: the chunk's from byte ``s`` on
keepalive      C -> S      (none): an idle receiver is still there (``client.KEEPALIVE_S``)
error          S -> C      reason
bye            C -> S
=============  ==========  ===========================================================

``manifest``: ``key`` is the snapshot's chunk-MAC key wrapped under the session key and ``tag``
a ``frame_tag`` over ``key`` and the manifest bytes. ``chunk``: ``tag`` is the chunk's MAC
(``chunkmac``), over the whole chunk also when ``s`` skips its first bytes: the receiver holds
those already (from a source that failed mid-chunk) and MACs them with the rest. Version 2
replaced version 1's chunk tags, keyed hashes of an unkeyed XXH3 digest; version 3 (this table)
added ``s`` and ``keepalive``; a peer of another version is refused ``bad_version``.

Deadlines: every wait on a connection ends after "no progress for T" (:class:`NoProgress`):
bytes that move, either way, reset it; a fixed bound on a whole message would drop a source
that is slow but moving (a 16 MiB chunk takes ~55 s to each of 7 sources sharing 2 MB/s).
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from concurrent.futures import Executor
from types import TracebackType
from typing import Any

import msgpack

from . import outq, splice
from .errors import PeerError

MAX_FRAME_BYTES = 4096
"""Every control frame above is under 200 bytes; 4 KiB leaves room for growth while a peer that
claims more (e.g. a 4 GB length) is refused before anything is buffered."""

DEFAULT_MAX_MANIFEST_BYTES = 64 << 20
"""64 MiB: a manifest costs ~80 bytes per tensor plus 16-32 bytes per chunk, so this admits
~500k tensors and a 10 TiB state at 8 MiB chunks (a 32-byte digest per chunk: 40 MiB)."""

_LEN = struct.Struct(">I")
LEN_BYTES = _LEN.size
"""Bytes of a frame's length prefix."""


def encode_frame(op: str, **fields: Any) -> bytes:
    """Length-prefixed frame bytes."""
    body = msgpack.packb({"op": op, **fields}, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def no_ext(code: int, data: bytes) -> Any:
    """msgpack ``ext_hook`` for peer data: extension types are refused (ValueError)."""
    raise ValueError("ext types are not allowed in peer data")


def decode_frame(body: bytes) -> dict[str, Any]:
    """Decode one frame body. Raises :class:`PeerError` ``bad_frame`` for anything but a
    msgpack map with a str ``op``."""
    try:
        msg = msgpack.unpackb(body, raw=False, ext_hook=no_ext, strict_map_key=True)
    except Exception as e:
        raise PeerError("bad_frame", f"{type(e).__name__}") from None
    if type(msg) is not dict or type(msg.get("op")) is not str:
        raise PeerError("bad_frame", "not a map with an op")
    return msg


def field(msg: dict[str, Any], name: str, typ: type, size: int | None = None) -> Any:
    """``msg[name]``, checked to be exactly ``typ`` (and ``size`` long for bytes); raises
    :class:`PeerError` ``bad_frame`` otherwise."""
    v: Any = msg.get(name)
    exact = type(v) is typ  # exact: a bool is not an int here (and mypy keeps ``v`` Any)
    if not exact or (size is not None and len(v) != size):
        raise PeerError("bad_frame", f"field {name!r}")
    if typ is int and not 0 <= v < (1 << 63):
        raise PeerError("bad_frame", f"field {name!r} out of range")
    return v


class Conn:
    """A non-blocking TCP socket driven by the event loop's ``sock_*`` calls (the fastest path
    measured here, ~4 GB/s on loopback). ``last_progress`` (``time.monotonic()`` seconds) moves
    whenever bytes arrive or leave (each partial send counts, and :meth:`poll_sent` the peer's
    taking of bytes already sent), for "no progress for T" deadlines (:class:`NoProgress`)."""

    __slots__ = ("sock", "loop", "last_progress", "bytes_in", "bytes_out", "closed", "_outq")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.loop = loop
        self.last_progress = time.monotonic()
        self.bytes_in = 0
        self.bytes_out = 0
        self.closed = False
        self._outq = 0

    async def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly. Raises :class:`PeerError` ``closed`` at end of stream."""
        loop, sock = self.loop, self.sock
        pos, end = 0, len(view)
        while pos < end:
            n = await loop.sock_recv_into(sock, view[pos:])
            if n == 0:
                raise PeerError("closed", "connection closed mid-message")
            pos += n
            self.bytes_in += n
            self.last_progress = time.monotonic()

    async def recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self.recv_into(memoryview(buf))
        return buf

    async def read_frame(self, max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
        """Read and decode one frame. Raises :class:`PeerError` ``frame_too_large`` when the
        length prefix exceeds ``max_bytes``, ``bad_frame`` when it does not decode, ``closed``
        at end of stream; the connection must then be dropped."""
        (n,) = _LEN.unpack(await self.recv_exact(4))
        if n > max_bytes:
            raise PeerError("frame_too_large", f"{n} bytes > {max_bytes}")
        return decode_frame(bytes(await self.recv_exact(n)))

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send all of ``data``. Each partial send moves ``last_progress``: a deadline on the
        whole call would drop a receiver that reads slowly but steadily."""
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        sock, pos, end = self.sock, 0, view.nbytes
        while pos < end:
            try:
                n = sock.send(view[pos:])
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            pos += n
            self.bytes_out += n
            self.last_progress = time.monotonic()

    async def _writable(self) -> None:
        """Until the socket can take more bytes (or is closed)."""
        fd = self.sock.fileno()
        if fd < 0:
            raise ConnectionError("closed")
        ready = self.loop.create_future()
        self.loop.add_writer(fd, _settle, ready)
        try:
            await ready
        finally:
            self.loop.remove_writer(fd)

    def poll_sent(self) -> None:
        """Count the peer taking bytes this side sent earlier as progress: the kernel's count
        of bytes sent and not yet acknowledged (``SIOCOUTQ``, Linux) went down since the last
        call. A server waiting for the next request while its last chunk still drains to a
        slow receiver is making progress (:mod:`.outq`). Does nothing where the count cannot be
        read."""
        queued = None if self.closed else outq.queued(self.sock.fileno())
        if queued is None:
            return
        if queued < self._outq:
            self.last_progress = time.monotonic()
        self._outq = queued

    async def send_pages(self, buffers: list[memoryview], progress_timeout_s: float,
                         executor: Executor | None = None) -> None:
        """Send writable ``buffers`` by reference (:func:`.splice.send_pages`, check
        :func:`.splice.available` first) from a thread of ``executor`` (default: the event
        loop's). The thread works on a duplicate of the socket's descriptor and closes it
        itself, so closing this connection meanwhile (which shuts the socket down and ends the
        thread) never hands its number to another socket. Raises what ``send_pages`` raises."""
        fd = os.dup(self.sock.fileno())

        def moved(n: int) -> None:  # from the sending thread: a float store, atomic
            self.last_progress = time.monotonic()

        def run() -> int:
            try:
                return splice.send_pages(fd, buffers, progress_timeout_s, lambda: self.closed,
                                         moved)
            finally:
                os.close(fd)

        self.bytes_out += await self.loop.run_in_executor(executor, run)
        self.last_progress = time.monotonic()

    def shutdown(self) -> None:
        """Wake any thread blocked in a blocking call on this socket (``close`` alone does
        not)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.closed = True
        self.shutdown()
        try:
            self.sock.close()
        except OSError:
            pass


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class NoProgress:
    """``async with NoProgress(conn, timeout_s):`` raises ``TimeoutError`` out of its body once
    ``conn`` has made no progress (``Conn.last_progress``, with :meth:`Conn.poll_sent`) for
    ``timeout_s`` seconds, counted from the later of the last progress and entering the block.
    Checked every ``timeout_s / 4`` at most, so it fires between ``timeout_s`` and
    ``1.25 * timeout_s`` after the last byte moved. A check that runs more than ``timeout_s / 4``
    late (this process did not run: a loaded host, a pause) starts the count again, once per
    block: the silence may have been ours, and the peer's bytes may be waiting to be read.

    Every wait on a transfer connection has this deadline, never one on a whole message: a
    16 MiB chunk to one of 7 sources sharing 2 MB/s takes ~55 s while every byte moves."""

    __slots__ = ("conn", "timeout_s", "_since", "_due", "_restarted", "_scope", "_check")

    def __init__(self, conn: Conn, timeout_s: float) -> None:
        self.conn = conn
        self.timeout_s = timeout_s
        self._since = 0.0
        self._due = 0.0
        self._restarted = False
        self._scope = asyncio.timeout(None)
        self._check: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> NoProgress:
        await self._scope.__aenter__()
        self._since = time.monotonic()
        self._arm(self.timeout_s)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._check is not None:
            self._check.cancel()
        await self._scope.__aexit__(kind, exc, tb)  # raises TimeoutError once it expired

    def _arm(self, delay_s: float) -> None:
        delay_s = min(delay_s, self.timeout_s / 4)
        self._due = time.monotonic() + delay_s
        self._check = self.conn.loop.call_later(delay_s, self._expire)

    def _expire(self) -> None:
        now = time.monotonic()
        if now - self._due > self.timeout_s / 4 and not self._restarted:  # we did not run
            self._since, self._restarted = now, True
        self.conn.poll_sent()
        left = max(self.conn.last_progress, self._since) + self.timeout_s - now
        if left > 0:
            self._arm(left)
        else:
            self._check = None
            self._scope.reschedule(self.conn.loop.time())  # cancels the body: TimeoutError


def set_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Kernel receive and send timeouts (``SO_RCVTIMEO`` / ``SO_SNDTIMEO``) for a socket in
    blocking mode: a call that moves no byte for ``timeout_s`` seconds fails with ``EAGAIN``
    (``BlockingIOError``); one that moved some returns them. Unlike ``settimeout`` this costs
    no ``poll`` per call."""
    sec = int(timeout_s)
    tv = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def set_buffers(sock: socket.socket, size_bytes: int = 4 << 20) -> None:
    """Ask for large kernel socket buffers (fewer wake-ups per chunk); best effort."""
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, size_bytes)
        except OSError:
            pass
