"""The TCP transfer service against bad input and failing sources, on real loopback sockets.

Why one file of this size: the misbehaving servers at its top (corrupt, pickling, stalling,
trickling, dying) are shared by the tests below, each against a real client on loopback.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import socket
import struct
import threading
import weakref

import pytest
import torch

from torchpass_p2p.core.seal import key_id
from torchpass_p2p.transfer import (
    Refused,
    Snapshot,
    TransferFailed,
    TransferKeys,
    client,
    fetch,
    splice,
)
from torchpass_p2p.transfer.auth import client_handshake
from torchpass_p2p.transfer.client import STREAMS
from torchpass_p2p.transfer.frames import Conn, decode_frame, encode_frame
from torchpass_p2p.transfer.manifest import Manifest
from torchpass_p2p.transfer.server import MAX_HANDSHAKING, TransferServer

from .gated import GatedServer
from .states import build, capture

CONFIG = 7
_PICKLE = pickle.dumps({"op": "hello", "v": 1})


@pytest.fixture
def keys():
    return TransferKeys(os.urandom(32))


@pytest.fixture
def snap():
    return capture("edge_tensors", "source")[0]


class CorruptServer(TransferServer):
    """Flips one byte in the middle of every chunk after its tag was computed (an on-path
    attacker, or a source whose memory changed after it computed its inner chunk MACs)."""

    def chunk_buffers(self, snapshot, index):
        bufs = super().chunk_buffers(snapshot, index)
        data = bytearray(b"".join(bufs))
        data[len(data) // 2] ^= 0x01
        return [memoryview(data)]


class PickleServer(TransferServer):
    """Sends a pickle (padded to the chunk's length) as the body of every chunk."""

    def chunk_buffers(self, snapshot, index):
        n = sum(len(b) for b in super().chunk_buffers(snapshot, index))
        payload = pickle.dumps({"evil": list(range(10))})
        return [memoryview((payload * (n // len(payload) + 1))[:n])]


class StallServer(TransferServer):
    """Serves two chunks, then stops making progress (a hung source)."""

    async def serve_chunk(self, conn, snapshot, index, header, skip=0):
        self.stats["stall_calls"] += 1
        if self.stats["stall_calls"] > 2:
            await asyncio.sleep(3600)
        await super().serve_chunk(conn, snapshot, index, header, skip)


class TrickleServer(TransferServer):
    """Sends each chunk's body one byte per ``gap_s`` seconds: slow, never silent."""

    gap_s = 0.2

    async def serve_chunk(self, conn, snapshot, index, header, skip=0):
        await conn.send(header)
        data = b"".join(bytes(b) for b in self.chunk_buffers(snapshot, index))[skip:]
        for p in range(len(data)):
            await conn.send(data[p:p + 1])
            await asyncio.sleep(self.gap_s)


class SlowServer(TransferServer):
    """Serves two chunks, then waits 6 s before each (a source degraded but not stalled: within
    the 10 s progress timeout). It is a straggler while the fastest chunk takes under 6 / 8 s:
    room for a loaded host (a 3 s wait failed once, with a second test run on
    the 2 cores)."""

    async def serve_chunk(self, conn, snapshot, index, header, skip=0):
        self.stats["slow_calls"] += 1
        if self.stats["slow_calls"] > 2:
            await asyncio.sleep(6.0)
        await super().serve_chunk(conn, snapshot, index, header, skip)


class Recorder(TransferServer):
    """Records every chunk frame it sends (header and bytes, by index); with ``replay``
    (requested index -> recorded index, or None) it answers as an on-path attacker would, with
    a recorded frame's bytes and tag under a header naming the requested chunk."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.frames: dict[int, tuple[bytes, bytes]] = {}
        self.replay = lambda index: None

    async def serve_chunk(self, conn, snapshot, index, header, skip=0):
        assert not skip  # (no source of these tests fails mid-chunk)
        body = b"".join(bytes(b) for b in self.chunk_buffers(snapshot, index))
        j = self.replay(index)
        if j is None:
            self.frames[index] = (header, body)
            await conn.send(header + body)
            return
        old_header, old_body = self.frames[j]
        old = decode_frame(old_header[4:])
        off, n = snapshot.chunk_range(index)
        assert n == len(old_body)
        await conn.send(encode_frame("chunk", i=index, o=off, n=n, tag=old["tag"]) + old_body)
        self.stats["replayed"] += 1


def received_fingerprint(result) -> bytes:
    """Fingerprint recomputed from the received bytes (no cached digests)."""
    s = result.snapshot
    return Snapshot(s.step, s.table, s.tensors, s.tree, s.chunk_bytes).fingerprint()


async def serving(snap, keys, *classes, config=CONFIG):
    servers = [cls(keys, lambda: config) for cls in classes]
    for s in servers:
        await s.start()
        s.publish(snap)
    return servers


async def close_all(servers):
    for s in servers:
        await s.close()


async def test_two_sources_exact_and_counted(snap, keys):
    servers = await serving(snap, keys, TransferServer, TransferServer)
    try:
        res = await fetch([s.address for s in servers], keys, CONFIG)
        assert received_fingerprint(res) == snap.fingerprint() == res.fingerprint
        assert sum(res.bytes_by_source.values()) == snap.total_bytes
        assert all(b > 0 for b in res.bytes_by_source.values())
        assert sum(s.stats["chunks"] for s in servers) == snap.num_chunks
        assert [s.refused for s in servers] == [{}, {}]
    finally:
        await close_all(servers)


@pytest.fixture
def streams_for_small_states(monkeypatch):
    """Extra connections for the few-KB states of these tests (``MIN_STREAM_BYTES``)."""
    monkeypatch.setattr(client, "MIN_STREAM_BYTES", 0)


@pytest.mark.usefixtures("streams_for_small_states")
async def test_one_source_is_received_over_two_connections(snap, keys):
    (server,) = await serving(snap, keys, GatedServer)
    try:
        res = await fetch([server.address], keys, CONFIG)
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.bytes_by_source == {server.address: snap.total_bytes}
        assert server.stats["transfers"] == STREAMS == 2  # a manifest per connection
        assert server.stats["chunks"] == snap.num_chunks
        res = await fetch([server.address], keys, CONFIG, streams=1)
        assert received_fingerprint(res) == snap.fingerprint()
        assert server.stats["transfers"] == 3
    finally:
        await server.close()


@pytest.mark.usefixtures("streams_for_small_states")
async def test_a_sources_connections_count_once(snap, keys):
    servers = await serving(snap, keys, CorruptServer, GatedServer)
    # The healthy source waits until the corrupt one has sent a chunk: on a loaded machine it
    # could serve the whole state first, and nothing was corrupted (one CI run).
    servers[1].ready = lambda _: servers[0].stats["chunks"] >= 1
    try:
        res = await fetch([s.address for s in servers], keys, CONFIG, streams=4, window=1)
        assert res.failures == {"bad_chunk": 1}  # before: 2, one per connection
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.bytes_by_source[servers[0].address] == 0
    finally:
        await close_all(servers)


class CorruptOnceServer(GatedServer):
    """Once both connections of a transfer ask for chunks, corrupts the first chunk it serves
    (the other connection waits for its own)."""

    def chunk_buffers(self, snapshot, index):
        bufs = super().chunk_buffers(snapshot, index)
        self.stats["corrupt_calls"] += 1
        if self.stats["corrupt_calls"] > 1:
            return bufs
        data = bytearray(b"".join(bufs))
        data[len(data) // 2] ^= 0x01
        return [memoryview(data)]


@pytest.mark.usefixtures("streams_for_small_states")
async def test_a_bad_chunk_drops_every_connection_of_its_source(snap, keys):
    (server,) = await serving(snap, keys, CorruptOnceServer)
    try:
        with pytest.raises(TransferFailed) as e:  # before: the other connection went on
            await fetch([server.address], keys, CONFIG, streams=2, window=1)
        assert e.value.reason == "no_sources_left" and e.value.failures == {"bad_chunk": 1}
    finally:
        await server.close()


async def _one_connection_proxy(target):
    """Forwards the first connection to ``target``; accepts the later ones and never answers
    (a source whose listen queue takes a connection it never serves)."""
    accepted = []

    async def pipe(reader, writer):
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def handle(reader, writer):
        accepted.append(writer)
        if len(accepted) > 1:
            return  # the connection stays open, silent, until the proxy closes
        up_reader, up_writer = await asyncio.open_connection(*target)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    proxy = await asyncio.start_server(handle, "127.0.0.1", 0)
    return proxy, proxy.sockets[0].getsockname()[:2], accepted


@pytest.mark.usefixtures("streams_for_small_states")
async def test_an_extra_connection_that_never_opens_delays_nothing(snap, keys):
    (server,) = await serving(snap, keys, TransferServer)
    proxy, address, accepted = await _one_connection_proxy(server.address)
    try:
        # The first chunk does not wait for the extra connection: if it did, this would wait
        # for connect_timeout_s (here an hour).
        res = await asyncio.wait_for(
            fetch([address], keys, CONFIG, streams=2, connect_timeout_s=3600), 60)
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.failures == {} and len(accepted) == 2
    finally:
        for w in accepted:
            w.close()
        proxy.close()
        await server.close()


async def _silent_source():
    """A listening socket that accepts and never answers (a source stopped with SIGSTOP)."""
    accepted = []

    async def handle(reader, writer):
        accepted.append(writer)

    silent = await asyncio.start_server(handle, "127.0.0.1", 0)
    return silent, silent.sockets[0].getsockname()[:2], accepted


@pytest.mark.parametrize("expected", [False, True], ids=["majority", "expected"])
async def test_a_source_that_never_opens_delays_nothing(snap, keys, expected):
    # The transfer begins without waiting for every source to open or time out, else a
    # source stopped as the fetch begins costs connect_timeout_s (5 s by default). Without an
    # expected fingerprint two of three sources are a majority; with one, one is enough.
    servers = await serving(snap, keys, *[TransferServer] * (1 if expected else 2))
    silent, address, accepted = await _silent_source()
    want = snap.fingerprint() if expected else None
    try:
        res = await asyncio.wait_for(
            fetch([address, *(s.address for s in servers)], keys, CONFIG, streams=1,
                  expected_fingerprint=want, connect_timeout_s=3600), 60)
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.failures == {} and len(accepted) == 1
        assert address not in res.bytes_by_source
        assert sum(res.bytes_by_source.values()) == snap.total_bytes
    finally:
        for w in accepted:
            w.close()
        silent.close()
        await close_all(servers)


async def test_a_fetch_cancelled_while_its_sources_open_leaves_no_task(snap, keys):
    (server,) = await serving(snap, keys, TransferServer)
    silent, address, accepted = await _silent_source()
    before = asyncio.all_tasks()
    try:
        # Two sources and no expected fingerprint: the state settles only with both, and the
        # silent one never answers.
        fetching = asyncio.ensure_future(
            fetch([server.address, address], keys, CONFIG, connect_timeout_s=3600))
        async with asyncio.timeout(30):
            while not (accepted and server.stats["connections"]):
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the good source's handshake and manifest
        fetching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fetching
        assert asyncio.all_tasks() - before == set()  # before: its openings were left pending
    finally:
        for w in accepted:
            w.close()
        silent.close()
        await server.close()


async def test_a_source_that_opens_late_joins_the_transfer(snap, keys):
    # A serves nothing until B has asked for a chunk; B's connection is let through only once
    # A has been asked for one, so after the transfer began: it completes only if B joins.
    a, b = await serving(snap, keys, GatedServer, GatedServer)
    a.ready = lambda server: bool(b.asking)
    b.ready = lambda server: True
    asked = asyncio.Event()

    async def forward(reader, writer):
        async with asyncio.timeout(30):
            while not a.asking:
                await asyncio.sleep(0.001)
        up_reader, up_writer = await asyncio.open_connection(*b.address)

        async def pipe(r, w):
            try:
                while data := await r.read(1 << 16):
                    w.write(data)
                    await w.drain()
            except OSError:
                pass
            finally:
                w.close()

        asked.set()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    late = await asyncio.start_server(forward, "127.0.0.1", 0)
    try:
        res = await asyncio.wait_for(
            fetch([a.address, late.sockets[0].getsockname()[:2]], keys, CONFIG, streams=1,
                  expected_fingerprint=snap.fingerprint()), 60)
        assert received_fingerprint(res) == snap.fingerprint()
        assert asked.is_set() and res.failures == {}
        assert len(res.bytes_by_source) == 2 and all(res.bytes_by_source.values())
    finally:
        late.close()
        await close_all([a, b])


class HeldOpenServer(TransferServer):
    """Starts a connection's handshake only once ``released()`` holds (checked every
    millisecond, 30 s at most): a source that opens after the transfer began."""

    released = staticmethod(lambda: True)

    async def _serve(self, conn):
        async with asyncio.timeout(30):
            while not self.released():
                await asyncio.sleep(0.001)
        await super()._serve(conn)


@pytest.mark.parametrize("expected", [False, True], ids=["majority", "expected"])
async def test_a_source_still_opening_carries_the_transfer_when_the_first_fail(
        snap, keys, expected):
    # A source still opening carries the transfer when every running connection has failed:
    # the transfer must not end (no_sources_left) and cancel the good source while it opens.
    corrupt = [CorruptServer] * (1 if expected else 2)
    *bad, good = await serving(snap, keys, *corrupt, HeldOpenServer)
    good.released = lambda: all(s.stats["chunks"] for s in bad)  # each has served one
    try:
        res = await asyncio.wait_for(
            fetch([*(s.address for s in bad), good.address], keys, CONFIG, streams=1,
                  expected_fingerprint=snap.fingerprint() if expected else None), 60)
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.failures == {"bad_chunk": len(bad)}
        assert res.bytes_by_source[good.address] == snap.total_bytes
    finally:
        await close_all([*bad, good])


@pytest.mark.usefixtures("streams_for_small_states")
async def test_streams_bound_the_connections_counting_sources_still_opening(snap, keys):
    # Extra connections are planned counting the sources still opening: planned from those
    # open when the transfer begins, a source joining later would make three of streams=2.
    first, held = await serving(snap, keys, TransferServer, HeldOpenServer)
    held.released = lambda: bool(first.stats["chunks"])
    try:
        res = await asyncio.wait_for(
            fetch([first.address, held.address], keys, CONFIG, streams=2,
                  expected_fingerprint=snap.fingerprint()), 60)
        assert received_fingerprint(res) == snap.fingerprint() and res.failures == {}
        assert first.stats["connections"] == 1 and held.stats["connections"] == 1
    finally:
        await close_all([first, held])


@pytest.mark.usefixtures("streams_for_small_states")
async def test_a_bug_in_one_receiving_thread_ends_the_others(snap, keys, monkeypatch):
    """``_pump`` catches every Exception; should one escape it anyway, the transfer shuts the
    other connections down before it raises, so that the thread pool's exit does not wait for
    them with the event loop blocked (here: an hour of ``progress_timeout_s``)."""
    pump = client._Transfer._pump

    def buggy(self, s, first):
        if not first:
            raise RuntimeError("a bug")
        return pump(self, s, first)

    monkeypatch.setattr(client._Transfer, "_pump", buggy)
    (server,) = await serving(snap, keys, GatedServer)  # the first connection waits
    try:
        with pytest.raises(RuntimeError, match="a bug"):
            await asyncio.wait_for(
                fetch([server.address], keys, CONFIG, streams=2, progress_timeout_s=3600), 60)
    finally:
        await server.close()


@pytest.mark.usefixtures("streams_for_small_states")
async def test_an_extra_connection_refused_is_not_a_failed_source(snap, keys):
    server = GatedServer(keys, lambda: CONFIG, max_connections=1)
    server.ready = lambda server: server.refused["too_many_connections"] >= 1
    await server.start()
    server.publish(snap)
    try:
        res = await fetch([server.address], keys, CONFIG, streams=2)
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.failures == {}  # before: too_many_connections, from a healthy source
        assert server.refused == {"too_many_connections": 1}
    finally:
        await server.close()


class SlowLastChunkServer(TransferServer):
    """Waits 2.5 s before the last chunk (twice the straggler floor of 1 s)."""

    async def serve_chunk(self, conn, snapshot, index, header, skip=0):
        if index == snapshot.num_chunks - 1:
            await asyncio.sleep(2.5)
        await super().serve_chunk(conn, snapshot, index, header, skip)


@pytest.mark.usefixtures("streams_for_small_states")
async def test_an_idle_connection_to_the_same_source_makes_no_straggler(snap, keys):
    (server,) = await serving(snap, keys, SlowLastChunkServer)
    try:
        res = await fetch([server.address], keys, CONFIG, streams=2)
        assert res.failures == {}  # before: too_slow, and with no other source, no state
        assert received_fingerprint(res) == snap.fingerprint()
    finally:
        await server.close()


async def test_peer_without_the_key_is_refused(snap, keys):
    (server,) = await serving(snap, keys, TransferServer)
    try:
        other = TransferKeys(os.urandom(32))
        with pytest.raises(TransferFailed) as e:
            await fetch([server.address], other, CONFIG)
        assert e.value.reason == "no_sources"
        assert e.value.failures == {"unknown_key": 1}
        assert server.refused == {"unknown_key": 1}
        # A key with the same 1-byte id but other bytes: the server's proof fails the client.
        target_id = keys.primary_id
        while True:
            k = os.urandom(32)
            if key_id(k) == target_id:
                break
        with pytest.raises(TransferFailed) as e:
            await fetch([server.address], TransferKeys(k), CONFIG)
        assert e.value.failures == {"server_auth_failed": 1}
        await asyncio.sleep(0.05)
        assert server.refused["closed"] == 1
        assert server.stats["transfers"] == 0
    finally:
        await server.close()


async def test_replayed_proof_is_refused(snap, keys):
    (server,) = await serving(snap, keys, TransferServer)
    try:
        loop = asyncio.get_running_loop()
        tid = os.urandom(16)
        # Record a real handshake's frames, then replay the proof on a new connection.
        sent: list[bytes] = []

        class Recorder(Conn):
            async def send(self, data):
                sent.append(bytes(data))
                await super().send(data)

        c1 = Recorder(socket.create_connection(server.address), loop)
        await client_handshake(c1, keys, CONFIG, tid)
        c1.close()
        hello, proof = sent
        c2 = Conn(socket.create_connection(server.address), loop)
        await c2.send(hello)
        challenge = await c2.read_frame()
        assert challenge["op"] == "challenge"
        await c2.send(proof)
        assert (await c2.read_frame()) == {"op": "error", "reason": "auth_failed"}
        c2.close()
        await asyncio.sleep(0.05)
        assert server.refused["auth_failed"] == 1
    finally:
        await server.close()


async def test_stale_config_is_refused(snap, keys):
    (server,) = await serving(snap, keys, TransferServer)
    try:
        with pytest.raises(TransferFailed) as e:
            await fetch([server.address], keys, CONFIG - 1)
        assert e.value.failures == {"stale_config": 1}
        assert server.refused == {"stale_config": 1}
        res = await fetch([server.address], keys, CONFIG + 1)  # a newer one is fine
        assert res.fingerprint == snap.fingerprint()
    finally:
        await server.close()


async def _raw(server, data: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(server.address)
    sock.setblocking(False)
    try:
        await loop.sock_sendall(sock, data)
        return await asyncio.wait_for(loop.sock_recv(sock, 100), 5)
    except ConnectionResetError:  # the server closed with our bytes unread
        return b""
    finally:
        sock.close()


@pytest.mark.parametrize(("data", "reason"), [
    (b"\xff\xff\xff\xff" + b"x" * 100, "frame_too_large"),        # a header claiming 4 GB
    (pickle.dumps({"op": "hello"}), "frame_too_large"),            # a bare pickle
    (struct.pack(">I", len(_PICKLE)) + _PICKLE, "bad_frame"),       # a framed pickle
    (encode_frame("get", i=0), "bad_frame"),                       # request before hello
])
async def test_garbage_is_counted_and_server_survives(snap, keys, data, reason):
    (server,) = await serving(snap, keys, TransferServer)
    try:
        assert await _raw(server, data) in (b"", encode_frame("error", reason=reason))
        await asyncio.sleep(0.05)
        assert server.refused == {reason: 1}
        res = await fetch([server.address], keys, CONFIG)
        assert received_fingerprint(res) == snap.fingerprint()
    finally:
        await server.close()


async def test_pickle_request_after_auth_is_refused(snap, keys):
    (server,) = await serving(snap, keys, TransferServer)
    try:
        loop = asyncio.get_running_loop()
        c = Conn(socket.create_connection(server.address), loop)
        await client_handshake(c, keys, CONFIG, os.urandom(16))
        body = pickle.dumps(["manifest?"])
        await c.send(struct.pack(">I", len(body)) + body)
        try:
            assert await loop.sock_recv(c.sock, 10) == b""
        except ConnectionResetError:
            pass
        c.close()
        await asyncio.sleep(0.05)
        assert server.refused == {"bad_frame": 1}
    finally:
        await server.close()


@pytest.mark.parametrize("bad_server", [CorruptServer, PickleServer])
async def test_bad_chunk_moves_to_a_good_source(snap, keys, bad_server):
    servers = await serving(snap, keys, bad_server, TransferServer)
    try:
        res = await fetch([s.address for s in servers], keys, CONFIG, window=1)
        assert res.failures == {"bad_chunk": 1}
        assert res.refetched_chunks >= 1
        assert received_fingerprint(res) == snap.fingerprint()
    finally:
        await close_all(servers)


async def test_a_source_whose_bytes_changed_after_its_fingerprint_is_refused(snap, keys):
    live = Snapshot(snap.step, snap.table, [t.clone() for t in snap.tensors], snap.tree,
                    snap.chunk_bytes)
    assert live.fingerprint() == snap.fingerprint()  # announced (gossiped) before the change
    for i in range(live.num_chunks):  # then training went on in every chunk
        live.segments(i)[0][0] ^= 1
    (changed,) = await serving(live, keys, TransferServer)
    (good_server,) = await serving(snap, keys, TransferServer)
    try:
        res = await fetch([changed.address, good_server.address], keys, CONFIG,
                          expected_fingerprint=snap.fingerprint())
        assert res.failures == {"snapshot_changed": 1}
        assert changed.refused == {"snapshot_changed": 1} and changed.stats["chunks"] == 0
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.bytes_by_source == {good_server.address: snap.total_bytes}
    finally:
        await close_all([changed, good_server])


async def test_chunk_moved_to_another_index_fails_its_tag(snap, keys):
    # An on-path attacker answers ``get 1`` with chunk 0's frame from this same connection
    # (its bytes and its tag), relabelled as chunk 1 (chunks 0 and 1 are both 4096 bytes).
    (rec,) = await serving(snap, keys, Recorder)
    rec.replay = lambda i: 0 if i == 1 else None
    try:
        with pytest.raises(TransferFailed) as e:
            await fetch([rec.address], keys, CONFIG, window=1)
        assert e.value.failures == {"bad_chunk": 1}
        assert rec.stats["replayed"] == 1
    finally:
        await rec.close()


async def test_chunk_replayed_from_another_transfer_fails_its_tag(snap, keys):
    # Transfer 1 is recorded; in transfer 2 each chunk is answered with transfer 1's frame for
    # the same index: the very same bytes, under the other transfer's tag.
    (rec,) = await serving(snap, keys, Recorder)
    try:
        first = await fetch([rec.address], keys, CONFIG)
        assert first.failures == {} and len(rec.frames) == snap.num_chunks
        rec.replay = lambda i: i
        with pytest.raises(TransferFailed) as e:
            await fetch([rec.address], keys, CONFIG)
        assert e.value.failures == {"bad_chunk": 1}
        assert rec.stats["replayed"] >= 1
        rec.replay = lambda i: None  # honest again: a fresh transfer succeeds
        res = await fetch([rec.address], keys, CONFIG)
        assert received_fingerprint(res) == snap.fingerprint()
    finally:
        await rec.close()


async def test_a_second_manifest_request_is_refused(snap, keys):
    (server,) = await serving(snap, keys, TransferServer)
    try:
        loop = asyncio.get_running_loop()
        c = Conn(socket.create_connection(server.address), loop)
        await client_handshake(c, keys, CONFIG, os.urandom(16))
        await c.send(encode_frame("manifest?", algo="xxh3", step=None))
        msg = await c.read_frame()
        assert msg["op"] == "manifest" and len(msg["key"]) == 32
        await c.recv_exact(msg["size"])
        await c.send(encode_frame("manifest?", algo="xxh3", step=None))
        try:
            assert await loop.sock_recv(c.sock, 10) == b""
        except ConnectionResetError:
            pass
        c.close()
        await asyncio.sleep(0.05)
        assert server.refused == {"bad_request": 1}
    finally:
        await server.close()


async def test_a_withdrawn_snapshot_is_not_served_to_a_connection_that_began_on_it(snap,
                                                                                   keys):
    # The trainer serves live memory while it waits for the fetching members, then withdraws
    # it and trains on: a connection still open must not read the memory that training changes.
    (server,) = await serving(snap, keys, TransferServer)
    try:
        c = Conn(socket.create_connection(server.address), asyncio.get_running_loop())
        await client_handshake(c, keys, CONFIG, os.urandom(16))
        await c.send(encode_frame("manifest?", algo="xxh3", step=None))
        msg = await c.read_frame()
        await c.recv_exact(msg["size"])
        await c.send(encode_frame("get", i=0))
        assert (await c.read_frame())["op"] == "chunk"
        await c.recv_exact(snap.chunk_range(0)[1])
        server.publish(None)
        await c.send(encode_frame("get", i=1))
        assert await c.read_frame() == {"op": "error", "reason": "withdrawn"}
        c.close()
        await asyncio.sleep(0.05)
        assert server.refused == {"withdrawn": 1} and server.stats["chunks"] == 1
        with pytest.raises(TransferFailed) as e:  # and a new transfer finds nothing
            await fetch([server.address], keys, CONFIG)
        assert e.value.failures == {"no_snapshot": 1}
    finally:
        await server.close()


async def test_only_bad_sources_fail_cleanly(snap, keys):
    servers = await serving(snap, keys, CorruptServer)
    try:
        with pytest.raises(TransferFailed) as e:
            await fetch([s.address for s in servers], keys, CONFIG)
        assert e.value.reason == "no_sources_left"
        assert e.value.failures == {"bad_chunk": 1}
    finally:
        await close_all(servers)


async def test_stalled_source_is_dropped_after_no_progress(snap, keys):
    """The healthy source serves nothing before the stalling one was asked for a chunk: else,
    on a loaded host, it serves the whole (small) state while the other is still connecting,
    and a source left unopened when every chunk is in is not counted as failed."""
    asked = asyncio.Event()

    class Stalls(StallServer):
        async def serve_chunk(self, conn, snapshot, index, header, skip=0):
            asked.set()
            await super().serve_chunk(conn, snapshot, index, header, skip)

    class AfterIt(TransferServer):
        async def serve_chunk(self, conn, snapshot, index, header, skip=0):
            async with asyncio.timeout(30):
                await asked.wait()
            await super().serve_chunk(conn, snapshot, index, header, skip)

    servers = await serving(snap, keys, Stalls, AfterIt)
    try:
        # Below STRAGGLER_FLOOR_S (1 s), which would drop the stalled one too_slow first; not
        # much below: the healthy source waits for the other's first request meanwhile.
        res = await fetch([s.address for s in servers], keys, CONFIG, progress_timeout_s=0.6)
        assert res.failures == {"no_progress": 1}
        assert received_fingerprint(res) == snap.fingerprint()
    finally:
        await close_all(servers)


async def test_a_straggler_hands_its_chunks_to_an_idle_source(snap, keys):
    servers = await serving(snap, keys, SlowServer, TransferServer)
    try:
        res = await fetch([s.address for s in servers], keys, CONFIG)
        # What must hold: the slow source delivers its first two chunks only, the idle one
        # the rest. It is dropped too_slow once the idle one holds its chunks, unless (on a
        # loaded host) the fetch completed first.
        assert res.failures in ({"too_slow": 1}, {}), res.failures
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.bytes_by_source[servers[0].address] <= 2 * snap.chunk_bytes
    finally:
        await close_all(servers)


async def test_a_stragglers_chunk_handed_to_a_dead_idle_source_still_arrives(snap, keys):
    """The straggler rule offers a slow source's chunk to an idle source that died while idle
    (its host gone: the request is never answered); the slow source kept its claim and
    delivers it, and the dead one, holding only a copy of a chunk that is in, is left
    uncounted. Were the slow one dropped ``too_slow`` as its chunk moves, the dead one would
    fail ``no_progress`` on it and the fetch fail ``no_sources_left`` (as it would with a dead
    source whose connection closed)."""
    held, handed = asyncio.Event(), asyncio.Event()

    class Slow(TransferServer):
        async def serve_chunk(self, conn, snapshot, index, header, skip=0):
            self.stats["held"] = index
            held.set()
            async with asyncio.timeout(30):
                await handed.wait()  # until the rule handed this chunk to the dead source
            await super().serve_chunk(conn, snapshot, index, header, skip)

    class DiesIdle(TransferServer):
        async def serve_chunk(self, conn, snapshot, index, header, skip=0):
            async with asyncio.timeout(30):
                await held.wait()  # the slow source holds its one chunk (window=1) first
            if self.stats["chunks"] == snapshot.num_chunks - 1:  # served all the rest: idle
                handed.set()
                async with asyncio.timeout(30):
                    await asyncio.Event().wait()  # dead
            await super().serve_chunk(conn, snapshot, index, header, skip)

    servers = slow, dies = await serving(snap, keys, Slow, DiesIdle)
    try:
        res = await fetch([slow.address, dies.address], keys, CONFIG, window=1)
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.failures == {}
        assert res.refetched_chunks == 1
        _, n = snap.chunk_range(slow.stats["held"])
        assert res.bytes_by_source == {slow.address: n, dies.address: snap.total_bytes - n}
    finally:
        await close_all(servers)


async def test_refetched_chunks_counts_the_offered_chunks_another_source_took(keys):
    """Two stragglers' chunks are offered at once; the idle source takes the first, and the
    second straggler delivers its own before anyone takes it. ``refetched_chunks`` counts the
    hand-overs, not the offers (here 1 hand-over for 2 offers)."""
    snap = Snapshot.capture({"m": {"a": torch.arange(40 * 4096, dtype=torch.uint8)}}, 1,
                            chunk_bytes=4096)
    asked, done = asyncio.Event(), asyncio.Event()
    held: dict[str, int] = {}

    class Straggles(TransferServer):
        async def serve_chunk(self, conn, snapshot, index, header, skip=0):
            if held.setdefault("first", index) == index:
                await asyncio.sleep(30)  # dropped once its chunk is in from the idle source
            await super().serve_chunk(conn, snapshot, index, header, skip)

    class StragglesUntilAsked(TransferServer):
        async def serve_chunk(self, conn, snapshot, index, header, skip=0):
            if held.setdefault("second", index) == index:
                async with asyncio.timeout(30):
                    await asked.wait()  # both chunks are offered by now
            await super().serve_chunk(conn, snapshot, index, header, skip)
            done.set()

    class Idle(TransferServer):
        async def serve_chunk(self, conn, snapshot, index, header, skip=0):
            if index in held.values():
                self.stats["offered_taken"] += 1
                asked.set()
                async with asyncio.timeout(30):
                    await done.wait()
            await super().serve_chunk(conn, snapshot, index, header, skip)

    servers = await serving(snap, keys, Straggles, StragglesUntilAsked, Idle)
    try:
        res = await fetch([s.address for s in servers], keys, CONFIG, window=1, streams=1)
        assert received_fingerprint(res) == snap.fingerprint()
        # Which straggler is dropped (one or both) depends on which copy lands first.
        assert set(res.failures) == {"too_slow"}
        assert res.refetched_chunks == servers[2].stats["offered_taken"] >= 1
    finally:
        await close_all(servers)


async def test_a_stragglers_half_written_chunk_is_replaced_by_the_idle_sources_copy(snap, keys):
    """A slow source stalls mid-chunk, after bytes that would not verify; the idle source's
    copy of that chunk, received aside while the slow one still writes it, is written over
    them once the slow one is dropped (``too_slow``)."""
    held = asyncio.Event()

    class StallsMidChunk(TransferServer):
        async def serve_chunk(self, conn, snapshot, index, header, skip=0):
            data = b"".join(bytes(b) for b in self.chunk_buffers(snapshot, index))[skip:]
            await conn.send(header + bytes(x ^ 0xFF for x in data[:len(data) // 2]))
            held.set()
            async with asyncio.timeout(30):
                await asyncio.Event().wait()  # stalled, within the progress timeout

    class AfterHeld(TransferServer):
        async def serve_chunk(self, conn, snapshot, index, header, skip=0):
            async with asyncio.timeout(30):
                await held.wait()  # the slow source holds its one chunk (window=1) first
            await super().serve_chunk(conn, snapshot, index, header, skip)

    servers = slow, idle = await serving(snap, keys, StallsMidChunk, AfterHeld)
    try:
        res = await fetch([slow.address, idle.address], keys, CONFIG, window=1)
        assert received_fingerprint(res) == snap.fingerprint()
        assert res.failures == {"too_slow": 1}
        assert res.refetched_chunks == 1
        assert res.bytes_by_source == {slow.address: 0, idle.address: snap.total_bytes}
    finally:
        await close_all(servers)


class DiesAfterTwoChunks(TransferServer):
    """Serves two chunks, then closes the connection at the next request (killed)."""

    async def serve_chunk(self, conn, snapshot, index, header, skip=0):
        if self.stats["chunks"] >= 2:
            conn.close()
            raise ConnectionError("killed")
        await super().serve_chunk(conn, snapshot, index, header, skip)


async def test_a_failed_fetch_holds_none_of_its_tensors(snap, keys, monkeypatch):
    """The exception of a failed fetch keeps nothing it allocated to receive into alive: were
    the receive target held by its traceback's frames, the trainer's next attempt (which keeps
    the last exception) would hold two states."""
    allocated: list[weakref.ref] = []
    allocate = Manifest.allocate

    def recording(self, own, max_alloc_bytes):
        target, n = allocate(self, own, max_alloc_bytes)
        allocated.extend(weakref.ref(t) for t in (target, *target.tensors))
        return target, n

    monkeypatch.setattr(Manifest, "allocate", recording)
    (server,) = await serving(snap, keys, DiesAfterTwoChunks)
    try:
        with pytest.raises(TransferFailed) as e:
            await fetch([server.address], keys, CONFIG)
    finally:
        await server.close()
    assert e.value.reason == "no_sources_left" and e.value.failures == {"closed": 1}
    gc.collect()
    assert len(allocated) == 1 + len(snap.tensors)
    assert [r() for r in allocated] == [None] * len(allocated)


async def test_step_and_snapshot_presence(snap, keys):
    empty = TransferServer(keys, lambda: CONFIG)
    (server,) = await serving(snap, keys, TransferServer)
    await empty.start()
    try:
        with pytest.raises(TransferFailed) as e:
            await fetch([server.address], keys, CONFIG, step=snap.step + 1)
        assert e.value.failures == {"step_mismatch": 1}
        with pytest.raises(TransferFailed) as e:
            await fetch([empty.address], keys, CONFIG)
        assert e.value.failures == {"no_snapshot": 1}
        assert server.refused == {"step_mismatch": 1} and empty.refused == {"no_snapshot": 1}
    finally:
        await server.close()
        await empty.close()


async def test_sources_must_agree(snap, keys):
    other = capture("edge_tensors", "receiver")[0]
    a, b = await serving(snap, keys, TransferServer, TransferServer)
    b.publish(other)
    try:
        with pytest.raises(TransferFailed) as e:
            await fetch([a.address, b.address], keys, CONFIG)
        assert e.value.reason == "sources_disagree"
        res = await fetch([a.address, b.address], keys, CONFIG,
                          expected_fingerprint=snap.fingerprint())
        assert res.failures == {"fingerprint_mismatch": 1}
        assert received_fingerprint(res) == snap.fingerprint()
    finally:
        await close_all([a, b])


async def test_unreachable_source_is_skipped(snap, keys):
    (server,) = await serving(snap, keys, TransferServer)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    try:
        res = await fetch([("127.0.0.1", port), server.address], keys, CONFIG)
        assert res.failures == {"closed": 1}
        assert received_fingerprint(res) == snap.fingerprint()
    finally:
        await server.close()


async def test_receives_in_place(keys):
    snap = capture("mlp_adam", "source")[0]
    (server,) = await serving(snap, keys, TransferServer)
    try:
        objs = build("mlp_adam", "receiver")[0]
        weight = objs["model"][0].weight
        before = weight.data_ptr()
        res = await fetch([server.address], keys, CONFIG, into=objs)
        got = dict(zip((e.name for e in res.snapshot.table), res.snapshot.tensors, strict=True))
        assert got["model.0.weight"].data_ptr() == before  # no copy of existing tensors
        res.snapshot.restore(objs)
        assert weight.data_ptr() == before
    finally:
        await server.close()


async def test_a_sole_source_trickling_bytes_is_kept_to_the_end(keys):
    # "No progress for T" means no byte for T. A receive that moved fewer bytes than its
    # piece returns them only when the kernel's timeout ends it; a watchdog at T too would race
    # that and drop such a source no_progress after 3 s, 9 s, or never, by luck.
    weights = torch.arange(8, dtype=torch.float32)  # 32 bytes: ~6 s at 0.2 s a byte
    source = Snapshot.capture({"m": {"w": weights}}, step=1)
    (server,) = await serving(source, keys, TrickleServer)
    try:
        res = await fetch([server.address], keys, CONFIG, progress_timeout_s=1.0)
        assert not res.failures and res.fingerprint == source.fingerprint()
        assert torch.equal(res.snapshot.state()["objects"]["m"]["w"], weights)
    finally:
        await server.close()


def test_a_refusal_reason_no_server_sends_is_counted_refused():
    # Any msgpack value can come from a peer without the key: a list or a map must be counted
    # refused, not raise TypeError (unhashable) and be counted internal_error with a traceback.
    assert Refused.of({"op": "error", "reason": "stale_config"}).reason == "stale_config"
    for reason in ("made_up", ["stale_config"], {"k": 1}, 7, None, b"stale_config"):
        assert Refused.of({"op": "error", "reason": reason}).reason == "refused"
    assert Refused.of({"op": "error"}).reason == "refused"


async def test_keyring_rotation(snap):
    from torchpass_p2p.core.seal import Keyring
    old, new = os.urandom(32), os.urandom(32)
    while key_id(new) == key_id(old):
        new = os.urandom(32)
    server_keys = TransferKeys.from_keyring(Keyring(new, [old]))
    server = TransferServer(server_keys, lambda: CONFIG)
    await server.start()
    server.publish(snap)
    try:  # a spare that was offline still proves the old primary
        res = await fetch([server.address], TransferKeys.from_keyring(Keyring(old)), CONFIG)
        assert res.fingerprint == snap.fingerprint()
    finally:
        await server.close()


def test_transfer_keys_from_a_keyring_equal_those_from_its_raw_keys():
    from torchpass_p2p.core.seal import Keyring
    from torchpass_p2p.transfer.auth import TransferKeys

    a, b = bytes(range(32)), bytes(range(1, 33))
    from_ring = TransferKeys.from_keyring(Keyring(a, [b]))
    raw = TransferKeys(a, [b])
    assert from_ring.primary_id == raw.primary_id
    assert from_ring.primary == raw.primary
    assert all(from_ring.get(kid) == raw.get(kid) for kid in Keyring(a, [b]).key_ids)


async def test_colliding_paths_are_received_each_into_its_own_tensor(keys):
    # Keys 1 and "1" both give the path "m.1": one receiver tensor took both entries' bytes.
    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return {"m": {1: torch.rand(1024, generator=g), "1": torch.rand(1024, generator=g)}}

    source = state(0)
    snap = Snapshot.capture(source, 5, copy=True, chunk_bytes=4096)
    (server,) = await serving(snap, keys, TransferServer)
    try:
        objs = state(1)
        res = await fetch([server.address], keys, CONFIG, into=objs)
        assert res.allocated_bytes == 0  # both received in place
        assert received_fingerprint(res) == snap.fingerprint()
        res.snapshot.restore(objs)
        assert torch.equal(objs["m"][1], source["m"][1])
        assert torch.equal(objs["m"]["1"], source["m"]["1"])
    finally:
        await server.close()


async def test_handshakes_without_the_key_never_hold_the_slots_of_transfers(snap, keys):
    server = TransferServer(keys, lambda: CONFIG, handshake_timeout_s=60.0)
    await server.start()
    server.publish(snap)
    loop = asyncio.get_running_loop()
    held = []
    try:
        for _ in range(MAX_HANDSHAKING + 4):  # one byte each, then silence: no key to go on
            s = socket.create_connection(server.address)
            s.sendall(b"\x00")
            held.append(s)
        deadline = loop.time() + 10.0
        while server.refused["evicted_unproven"] < 4 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert server.refused == {"evicted_unproven": 4}  # the oldest, one per arrival
        res = await fetch([server.address], keys, CONFIG)
        assert received_fingerprint(res) == snap.fingerprint() and not res.failures
        assert server.refused == {"evicted_unproven": 5}  # the fetch's arrival evicted one
    finally:
        for s in held:
            s.close()
        await server.close()


async def test_a_key_holder_past_the_connection_limit_is_told(snap, keys):
    server = GatedServer(keys, lambda: CONFIG, max_connections=1)
    server.ready = lambda server: server.refused["too_many_connections"] >= 1
    await server.start()
    server.publish(snap)
    c = Conn(socket.create_connection(server.address), asyncio.get_running_loop())
    try:
        await client_handshake(c, keys, CONFIG, os.urandom(16))  # holds the one slot
        with pytest.raises(TransferFailed) as e:
            await fetch([server.address], keys, CONFIG)
        assert e.value.failures == {"too_many_connections": 1}
        assert server.refused == {"too_many_connections": 1}
    finally:
        c.close()
        await server.close()


async def test_an_unexpected_error_in_a_receiving_thread_fails_only_its_source(snap, keys,
                                                                              monkeypatch):
    # The failing thread hands its chunks back: if it ended without, the other source's
    # thread would wait for them forever and fetch never return.
    segments, raised = Snapshot.segments, []

    def once(self, index):  # in the first receiving thread only (servers run in this process)
        if not raised and threading.current_thread().name.startswith("transfer"):
            raised.append(index)
            raise TypeError("an input no check caught")
        return segments(self, index)

    monkeypatch.setattr(Snapshot, "segments", once)
    servers = await serving(snap, keys, TransferServer, TransferServer)
    try:
        res = await asyncio.wait_for(fetch([s.address for s in servers], keys, CONFIG), 60.0)
        assert res.failures == {"internal_error": 1}
        assert received_fingerprint(res) == snap.fingerprint()
    finally:
        await close_all(servers)


async def test_a_state_that_cannot_be_allocated_fails_the_transfer(snap, keys, monkeypatch):
    from torchpass_p2p.transfer import manifest

    class Torch:  # the receiver's torch.empty fails as for a state larger than memory
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*shape, **kw):
            if shape != (0,):  # decode_manifest's placeholders still work
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
            return torch.empty(*shape, **kw)

    monkeypatch.setattr(manifest, "torch", Torch())
    (server,) = await serving(snap, keys, TransferServer)
    try:
        with pytest.raises(TransferFailed) as e:
            await fetch([server.address], keys, CONFIG)
        assert e.value.reason == "too_large" and "can't allocate memory" in e.value.detail
    finally:
        await server.close()


async def test_a_refusal_reaches_a_receiver_with_requests_in_flight(keys):
    # The server must not close with the receiver's pipelined requests unread: that sends a
    # reset, which throws away what the server has not yet sent (the rest of a chunk and the
    # error frame), and the receiver would count "closed".
    snap = Snapshot.capture({"m": {"w": torch.rand(1 << 20)}}, 1, copy=True, chunk_bytes=1 << 20)
    (server,) = await serving(snap, keys, TransferServer)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # most of a chunk waits
    sock.connect(server.address)  # in the server's send buffer
    c = Conn(sock, asyncio.get_running_loop())
    try:
        await client_handshake(c, keys, CONFIG, os.urandom(16))
        await c.send(encode_frame("manifest?", algo="xxh3", step=None))
        msg = await c.read_frame()
        await c.recv_exact(msg["size"])
        await c.send(encode_frame("get", i=0))
        while server.stats["chunks"] < 1:
            await asyncio.sleep(0.01)
        server.publish(None)
        await c.send(encode_frame("get", i=1) + encode_frame("get", i=2))
        await asyncio.sleep(0.3)  # the server refuses chunk 1 and closes meanwhile
        header = await c.read_frame()
        assert (header["op"], header["i"]) == ("chunk", 0)
        await c.recv_exact(header["n"])
        assert await c.read_frame() == {"op": "error", "reason": "withdrawn"}
    finally:
        c.close()
        await server.close()


async def test_a_reason_no_server_sends_is_counted_refused(keys):
    async def impostor(reader, writer):  # no key: answers the hello with a reason of its own
        await reader.read(1)
        writer.write(encode_frame("error", reason="your disk is full, call 555-0100"))
        await writer.drain()
        writer.close()

    fake = await asyncio.start_server(impostor, "127.0.0.1", 0)
    try:
        with pytest.raises(TransferFailed) as e:
            await fetch([fake.sockets[0].getsockname()[:2]], keys, CONFIG)
        assert e.value.failures == {"refused": 1}  # a bounded set of labels for counters
    finally:
        fake.close()
        await fake.wait_closed()


@pytest.mark.skipif(not splice.available(), reason="no vmsplice/splice here")
async def test_stalled_receivers_of_zero_copy_sends_starve_no_one(keys):
    # Each zero-copy send holds a thread until its receiver reads. They ran on the event
    # loop's default pool, which also encodes manifests: as many stalled receivers as it has
    # threads kept a healthy receiver from its manifest past its connect timeout.
    snap = Snapshot.capture({"m": {"w": torch.rand(4 << 20)}}, 1, copy=True, chunk_bytes=16 << 20)
    server = TransferServer(keys, lambda: CONFIG, zero_copy=True)
    await server.start()
    server.publish(snap)
    stalled = []
    try:
        for _ in range(min(32, (os.cpu_count() or 1) + 4)):  # the default pool's size
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(server.address)
            c = Conn(sock, asyncio.get_running_loop())
            stalled.append(c)
            await client_handshake(c, keys, CONFIG, os.urandom(16))
            await c.send(encode_frame("manifest?", algo="xxh3", step=None))
            msg = await c.read_frame()
            await c.recv_exact(msg["size"])
            await c.send(encode_frame("get", i=0))  # and never reads the chunk
        await asyncio.sleep(0.2)
        res = await fetch([server.address], keys, CONFIG, connect_timeout_s=5.0)
        assert received_fingerprint(res) == snap.fingerprint() and not res.failures
    finally:
        for c in stalled:
            c.close()
        await server.close()
