"""Every drop counted once, under a reason, and shown in /metrics and /status (issue 32, item
10): inbound connections that end without a frame, datagrams and connection attempts the kernel
dropped, and the state-transfer server's refusals. Real sockets on loopback throughout."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import struct

import aiohttp
import pytest

from tests.agent.cluster import LocalCluster
from tests.agent.test_bad_input import rejected_in_metrics
from tests.agent.test_transport import frame
from torchpass_p2p.agent import transport as transport_module
from torchpass_p2p.agent.transport import (
    MAX_UNPROVEN_CONNECTIONS,
    STREAM_LABEL,
    Kind,
    Received,
    Transport,
)
from torchpass_p2p.core.codec import encode
from torchpass_p2p.core.messages import Ping
from torchpass_p2p.core.seal import Keyring
from torchpass_p2p.kernel_drops import socket_drops
from torchpass_p2p.transfer import TransferKeys
from torchpass_p2p.transfer.server import MAX_HANDSHAKING, TransferServer


def _kernel_counts() -> bool:
    with socket.socket() as s:
        return socket_drops(s) is not None


pytestmark = pytest.mark.skipif(not _kernel_counts(),
                                reason="the kernel's drop counter is Linux 4.12+'s")
DEADLINE_S = 10.0  # for what takes milliseconds, generous for a loaded machine


async def started(keyring: Keyring) -> tuple[Transport, list[Received]]:
    got: list[Received] = []
    t = Transport("t", keyring, 1, on_message=got.append, on_send_error=print,
                  on_request=lambda kind, body: None)
    await t.start(("127.0.0.1", 0))
    return t, got


async def until(predicate, timeout_s: float = DEADLINE_S) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


async def settled(t: Transport, total: int) -> None:
    """Until ``total`` drops are counted and every inbound handler has ended (so none can count
    anything more)."""
    await until(lambda: t.rejected_frames.total() >= total and not t._serving)


def reset(address: tuple[str, int], data: bytes = b"") -> None:
    """Connect, send ``data``, and end with a reset (RST) instead of a close."""
    with socket.create_connection(address) as s:
        s.sendall(data)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def test_a_connection_that_delivers_no_frame_counts_once_under_why_it_ended(monkeypatch):
    monkeypatch.setattr(transport_module, "FIRST_FRAME_TIMEOUT_S", 0.3)
    t, got = await started(Keyring(secrets.token_bytes(32)))
    try:
        steps = [
            (b"", "close"),  # empty
            (b"", "reset"),  # reset before a byte
            (b"\x00\x00", "close"),  # half a length: truncated
            (struct.pack(">I", 100), "close"),  # a length, no body: truncated
            (struct.pack(">I", 100) + bytes(10), "reset"),  # inside a frame: truncated
            (b"", "wait"),  # nothing at all: first_frame_timeout
            (b"\x00", "wait"),  # a byte, then nothing: first_frame_timeout
        ]
        for n, (data, how) in enumerate(steps, start=1):
            if how == "reset":
                reset(t.address, data)
            else:
                reader, writer = await asyncio.open_connection(*t.address)
                writer.write(data)
                if how == "wait":
                    async with asyncio.timeout(DEADLINE_S):
                        assert await reader.read() == b""  # the server closed it
                writer.close()
            await settled(t, n)
        assert t.rejected_frames == {"empty": 1, "reset": 1, "truncated": 3,
                                     "first_frame_timeout": 2}
        assert got == []
    finally:
        await t.close()


async def test_a_connection_evicted_holding_part_of_a_frame_counts_once():
    t, _ = await started(Keyring(secrets.token_bytes(32)))
    clients = []
    try:
        for _ in range(MAX_UNPROVEN_CONNECTIONS):
            reader, writer = await asyncio.open_connection(*t.address)
            writer.write(b"\x00\x00")  # half a frame's length
            clients.append((reader, writer))
        await until(lambda: len(t._unproven) == MAX_UNPROVEN_CONNECTIONS)
        clients.append(await asyncio.open_connection(*t.address))  # one more: evicts the oldest
        await until(lambda: t.rejected_frames["evicted_unproven"] == 1)
        async with asyncio.timeout(DEADLINE_S):
            assert await clients[0][0].read() == b""  # the oldest, closed
        for _, writer in clients:
            writer.close()
        await settled(t, MAX_UNPROVEN_CONNECTIONS + 1)
        # Not evicted_unproven and truncated both for the first: each connection once.
        assert t.rejected_frames == {"evicted_unproven": 1,
                                     "truncated": MAX_UNPROVEN_CONNECTIONS - 1, "empty": 1}
    finally:
        for _, writer in clients:
            writer.close()
        await t.close()


async def test_a_proven_connection_counts_only_a_frame_it_drops(monkeypatch):
    monkeypatch.setattr(transport_module, "IDLE_TIMEOUT_S", 0.3)
    keyring = Keyring(secrets.token_bytes(32))
    t, got = await started(keyring)

    def message(sender: int) -> bytes:
        return frame(keyring, STREAM_LABEL, sender, Kind.MESSAGE, encode(Ping(sender, ())),
                     to=1)

    try:
        ends = [b"", b"\x00\x00\x00\x40" + bytes(5)]  # at a frame's end; inside the next
        for n, (sender, tail) in enumerate(zip((2, 3), ends, strict=True), start=1):
            _, writer = await asyncio.open_connection(*t.address)
            writer.write(message(sender) + tail)
            await until(lambda: len(got) == n)  # noqa: B023 - awaited in this iteration
            writer.close()
            await until(lambda: not t._serving)
        reader, writer = await asyncio.open_connection(*t.address)
        writer.write(message(4))
        async with asyncio.timeout(DEADLINE_S):
            assert await reader.read() == b""  # idle past IDLE_TIMEOUT_S: closed by the server
        writer.close()
        await until(lambda: not t._serving)
        assert [r.sender for r in got] == [2, 3, 4]
        assert t.rejected_frames == {"truncated": 1}  # the frame cut short, nothing else
    finally:
        await t.close()


async def test_datagrams_lost_in_a_full_receive_buffer_count_as_kernel_dropped():
    t, _ = await started(Keyring(secrets.token_bytes(32)))
    sent = 200
    try:
        assert t._udp_socket is not None
        t._udp_socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the minimum
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(sent):  # this loop cannot read meanwhile: most are dropped
                s.sendto(bytes(1000), t.address)
        await until(lambda: t.traffic["datagrams_received"]
                    + t.rejected.get("kernel_dropped", 0) >= sent)
        rejected = t.rejected
        assert rejected["kernel_dropped"] > 0
        # Every datagram dropped once: by the kernel, or read and refused (not sealed).
        assert t.traffic["datagrams_received"] + rejected["kernel_dropped"] == sent
        assert rejected.total() == sent
    finally:
        await t.close()


async def test_connection_attempts_lost_in_a_full_accept_queue_count_as_kernel_dropped():
    t, _ = await started(Keyring(secrets.token_bytes(32)))
    clients = [socket.socket() for _ in range(150)]
    try:
        for c in clients:  # this loop cannot accept meanwhile: 101 fit (backlog 100)
            c.setblocking(False)
            try:
                c.connect(t.address)
            except BlockingIOError:
                pass
        await until(lambda: t.rejected_frames["kernel_dropped"] >= 150 - 101)
    finally:
        for c in clients:
            c.close()
        await t.close()


async def test_transfer_server_refusals_show_in_metrics_and_status():
    cluster = LocalCluster(2, 0, seed=3, status=True, pulse=False)
    await cluster.start()
    agent = cluster[1]
    server = TransferServer(TransferKeys(os.urandom(32)), lambda: 0)
    await server.start()
    held = []
    try:
        agent.add_counter_source("transfer_refused", server.refusals)
        with pytest.raises(KeyError):
            agent.add_counter_source("nonsense", server.refusals)
        with socket.create_connection(server.address) as s:
            s.sendall(struct.pack(">I", 3) + b"abc")  # not msgpack: bad_frame
        with socket.create_connection(server.address) as s:
            s.sendall(struct.pack(">I", 1 << 30))  # frame_too_large
        with socket.create_connection(server.address):
            pass  # closed
        for _ in range(MAX_HANDSHAKING + 4):  # a flood of silent connections: 4 evicted
            held.append(socket.create_connection(server.address))
        await until(lambda: server.refused.total() == 7)
        for s in held:
            s.close()
        await until(lambda: server.refused.total() == 7 + MAX_HANDSHAKING)
        expected = {"bad_frame": 1, "frame_too_large": 1, "closed": 1 + MAX_HANDSHAKING,
                    "evicted_unproven": 4}
        assert server.refusals() == expected

        agent.refresh_metrics()
        host, port = agent.status_address
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://{host}:{port}/metrics") as response:
                text = await response.text()
            async with http.get(f"http://{host}:{port}/status") as response:
                counters = (await response.json())["counters"]
        assert rejected_in_metrics(text, "torchpass_transfer_refused") == expected
        assert {k.removeprefix("transfer_refused_"): v for k, v in counters.items()
                if k.startswith("transfer_refused_")} == expected
    finally:
        for s in held:
            s.close()
        await server.close()
        await cluster.stop()
