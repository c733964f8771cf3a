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
get            C -> S      i (chunk index)
chunk          S -> C      i, o (offset), n (length), tag (16 bin); then ``n`` raw bytes
error          S -> C      reason
bye            C -> S
=============  ==========  ===========================================================

``manifest``: ``key`` is the snapshot's chunk-MAC key wrapped under the session key and ``tag``
a ``frame_tag`` over ``key`` and the manifest bytes. ``chunk``: ``tag`` is the chunk's MAC
(``chunkmac``). Version 2 (this table) replaced version 1's chunk tags, keyed hashes of an
unkeyed XXH3 digest; a version-1 peer is refused ``bad_version``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from concurrent.futures import Executor
from typing import Any

import msgpack

from . import splice
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
    whenever bytes arrive or leave, for "no progress for T" watchdogs."""

    __slots__ = ("sock", "loop", "last_progress", "bytes_in", "bytes_out", "closed")

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

    async def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly. Raises :class:`PeerError` ``closed`` at end of stream."""
        loop, sock = self.loop, self.sock
        pos, end = 0, len(view)
        while pos < end:
            n = await loop.sock_recv_into(sock, view[pos:])
            if n == 0:
                raise PeerError("closed", "connection closed mid-message")
            pos += n
            self.last_progress = time.monotonic()
        self.bytes_in += end

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

    async def send(self, data: bytes | memoryview) -> None:
        await self.loop.sock_sendall(self.sock, data)
        self.bytes_out += len(data)
        self.last_progress = time.monotonic()

    async def send_pages(self, buffers: list[memoryview], progress_timeout_s: float,
                         executor: Executor | None = None) -> None:
        """Send writable ``buffers`` by reference (:func:`.splice.send_pages`, check
        :func:`.splice.available` first) from a thread of ``executor`` (default: the event
        loop's). The thread works on a duplicate of the socket's descriptor and closes it
        itself, so closing this connection meanwhile (which shuts the socket down and ends the
        thread) never hands its number to another socket. Raises what ``send_pages`` raises."""
        fd = os.dup(self.sock.fileno())

        def run() -> int:
            try:
                return splice.send_pages(fd, buffers, progress_timeout_s, lambda: self.closed)
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
