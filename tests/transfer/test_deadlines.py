"""Every deadline of a transfer is "no progress for T", on real loopback sockets: a peer that is
slow but moving keeps its connection, a silent one loses it; and a chunk a source stopped
sending halfway is finished by another source from where it stopped."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest
import torch

from torchpass_p2p.transfer import Snapshot, TransferKeys, fetch
from torchpass_p2p.transfer.auth import client_handshake
from torchpass_p2p.transfer.frames import Conn, encode_frame
from torchpass_p2p.transfer.server import TransferServer

from .test_tcp import CONFIG, close_all, received_fingerprint, serving

CHUNK = 64 << 10


@pytest.fixture
def keys():
    return TransferKeys(os.urandom(32))


def state(chunks: int, chunk_bytes: int = CHUNK) -> Snapshot:
    g = torch.Generator().manual_seed(7)
    w = torch.randint(0, 256, (chunks * chunk_bytes,), dtype=torch.uint8, generator=g)
    return Snapshot.capture({"m": {"w": w}}, 1, copy=True, chunk_bytes=chunk_bytes)


def chunk_bytes(snap: Snapshot, index: int) -> bytes:
    return b"".join(bytes(b) for b in snap.segments(index))


class SmallSendBuffer(TransferServer):
    """A source whose socket holds 32 KiB (the kernel doubles it) instead of megabytes: a chunk
    larger than that is sent at the pace its receiver takes it."""

    async def serve_chunk(self, conn, snapshot, index, header, skip=0):
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
        await super().serve_chunk(conn, snapshot, index, header, skip)


async def receiver(server: TransferServer, keys: TransferKeys) -> Conn:
    """A hand-driven receiver with a 32 KiB receive buffer, authenticated, its manifest read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
    sock.connect(server.address)
    c = Conn(sock, asyncio.get_running_loop())
    await client_handshake(c, keys, CONFIG, os.urandom(16))
    await c.send(encode_frame("manifest?", algo="xxh3", step=None))
    msg = await c.read_frame()
    await c.recv_exact(msg["size"])
    return c


async def read_slowly(c: Conn, n: int, piece: int, gap_s: float) -> bytes:
    """``n`` bytes, at most ``piece`` per read with ``gap_s`` seconds between reads."""
    got = bytearray()
    while len(got) < n:
        data = await c.loop.sock_recv(c.sock, min(piece, n - len(got)))
        assert data, "closed"
        got += data
        await asyncio.sleep(gap_s)
    return bytes(got)


async def until(condition, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_receiver_taking_a_chunk_slowly_is_served_one_that_stops_is_dropped(keys):
    # SEND_TIMEOUT_S bounds the time without a byte taken, not the sending of a whole chunk:
    # a receiver behind a slow link, taking every byte, is kept however long the chunk takes.
    snap = state(1, 4 << 20)
    server = SmallSendBuffer(keys, lambda: CONFIG, send_timeout_s=1.0)
    await server.start()
    server.publish(snap)
    slow = stalled = None
    try:
        slow = await receiver(server, keys)
        await slow.send(encode_frame("get", i=0))
        header = await slow.read_frame()
        assert (header["op"], header["i"], header["s"]) == ("chunk", 0, 0)
        t0 = time.monotonic()
        body = await read_slowly(slow, header["n"], 64 << 10, 0.04)
        # 64 reads 40 ms apart: the chunk took over twice the deadline to send, every byte
        # moving all along.
        assert time.monotonic() - t0 > 2 * server.send_timeout_s
        assert body == chunk_bytes(snap, 0)
        assert server.refused == {} and server.stats["chunks"] == 1

        stalled = await receiver(server, keys)
        await stalled.send(encode_frame("get", i=0))
        await stalled.read_frame()
        await read_slowly(stalled, 64 << 10, 64 << 10, 0)  # then takes nothing more
        await until(lambda: server.refused)
        assert server.refused == {"send_timeout": 1}
        assert server.stats["chunks"] == 1
    finally:
        for c in (slow, stalled):
            if c is not None:
                c.close()
        await server.close()


async def test_a_request_to_skip_a_whole_chunk_is_refused(keys):
    snap = state(2)
    (server,) = await serving(snap, keys, TransferServer)
    c = await receiver(server, keys)
    try:
        await c.send(encode_frame("get", i=1, s=CHUNK))
        await until(lambda: server.refused)
        assert server.refused == {"bad_request": 1}
    finally:
        c.close()
        await server.close()


async def test_waiting_for_a_request_a_receiver_taking_bytes_or_keeping_alive_is_kept(keys):
    # IDLE_TIMEOUT_S bounds the time without a byte moving or a keepalive: a receiver with
    # nothing to ask for stays connected while the transfer goes on.
    snap = state(1, 2 << 20)
    (server,) = await serving(snap, keys, TransferServer)
    server.idle_timeout_s = 0.5
    kept = silent = None
    try:
        kept = await receiver(server, keys)
        await kept.send(encode_frame("get", i=0))
        header = await kept.read_frame()
        # The chunk fits the server's send buffer: it waits for the next request while the
        # receiver takes the bytes, 32 KiB every 25 ms (over 1.6 s).
        body = await read_slowly(kept, header["n"], 32 << 10, 0.025)
        assert body == chunk_bytes(snap, 0)
        for _ in range(15):  # 1.5 s of keepalives, then a request
            await kept.send(encode_frame("keepalive"))
            await asyncio.sleep(0.1)
        await kept.send(encode_frame("get", i=0, s=1000))
        header = await kept.read_frame()
        assert (header["i"], header["s"]) == (0, 1000)
        assert await kept.recv_exact(header["n"] - 1000) == chunk_bytes(snap, 0)[1000:]
        assert server.stats["idle_timeouts"] == 0 and server.refused == {}
        assert server.stats["keepalives"] == 15
        await kept.send(encode_frame("bye"))  # (else it would idle out too, from now on)

        silent = await receiver(server, keys)  # asks for nothing, says nothing
        assert await silent.loop.sock_recv(silent.sock, 1) == b""
        assert server.stats["idle_timeouts"] == 1 and server.refused == {}
    finally:
        for c in (kept, silent):
            if c is not None:
                c.close()
        await server.close()


class Paced(TransferServer):
    """Waits 0.3 s before each chunk: slow, at the same pace as its peers (no straggler)."""

    async def serve_chunk(self, conn, snapshot, index, header, skip=0):
        await asyncio.sleep(0.3)
        await super().serve_chunk(conn, snapshot, index, header, skip)


async def test_an_idle_connection_keeps_alive_past_the_sources_idle_timeout(keys):
    # Five chunks, four requested at once: one source holds four, the other one and then waits
    # (nothing left to take) for ~0.9 s, past its server's 0.4 s idle timeout.
    snap = state(5)
    servers = await serving(snap, keys, Paced, Paced)
    for s in servers:
        s.idle_timeout_s = 0.4
    try:
        res = await fetch([s.address for s in servers], keys, CONFIG, keepalive_s=0.1)
        assert received_fingerprint(res) == snap.fingerprint() and res.failures == {}
        assert sorted(s.stats["chunks"] for s in servers) == [1, 4]
        assert [s.stats["idle_timeouts"] for s in servers] == [0, 0]
        idle = min(servers, key=lambda s: s.stats["chunks"])
        assert idle.stats["keepalives"] >= 3
    finally:
        await close_all(servers)


def half_then_stall(flip: bool) -> type[TransferServer]:
    """A source that sends the first half of the first chunk asked for (each byte flipped, with
    ``flip``), then stalls (for 30 s: the test is over long before)."""

    class HalfThenStall(TransferServer):
        async def serve_chunk(self, conn, snapshot, index, header, skip=0):
            data = chunk_bytes(snapshot, index)[:len(chunk_bytes(snapshot, index)) // 2]
            self.stats["sent_half_of"] = index
            await conn.send(header + (bytes(x ^ 0xFF for x in data) if flip else data))
            await asyncio.sleep(30)

    return HalfThenStall


async def test_a_chunk_a_source_stopped_sending_halfway_is_finished_by_another(keys):
    # The half received is kept and the next source sends only the rest: every chunk byte
    # crosses the receiver's link once, however far into a 16 MiB chunk a source stopped.
    snap = state(8)
    servers = stalls, other = await serving(snap, keys, half_then_stall(False), Paced)
    try:
        res = await fetch([s.address for s in servers], keys, CONFIG, progress_timeout_s=0.3)
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.failures == {"no_progress": 1}
        assert res.resumed_chunks == 1
        assert res.bytes_by_source == {stalls.address: 0, other.address: snap.total_bytes}
        # Every chunk byte moved once: the stalled source's half, the other's rest.
        assert other.stats["bytes"] == snap.total_bytes - CHUNK // 2
        frames = res.received_bytes - snap.total_bytes  # handshakes, manifests, headers
        assert 0 < frames < 8192
    finally:
        await close_all(servers)


async def test_a_resumed_chunk_that_fails_its_mac_is_received_whole_blaming_nobody(keys):
    # The half left by the failed source was wrong: the MAC over it and the other source's rest
    # fails, and the other source is not to blame. It sends the chunk whole once more.
    snap = state(8)
    servers = stalls, other = await serving(snap, keys, half_then_stall(True), Paced)
    try:
        res = await fetch([s.address for s in servers], keys, CONFIG, progress_timeout_s=0.3)
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.failures == {"no_progress": 1}
        assert res.resumed_chunks == 0
        assert res.bytes_by_source == {stalls.address: 0, other.address: snap.total_bytes}
        assert other.stats["bytes"] == snap.total_bytes + CHUNK // 2
        assert other.stats["chunks"] == snap.num_chunks + 1
    finally:
        await close_all(servers)
