"""Which pending handshake the transfer server drops when a peer without the key floods it."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from torchpass_p2p.transfer import TransferKeys, fetch
from torchpass_p2p.transfer.auth import VERSION, client_handshake
from torchpass_p2p.transfer.errors import PeerError
from torchpass_p2p.transfer.frames import Conn, encode_frame
from torchpass_p2p.transfer.server import (
    MAX_HANDSHAKING,
    TransferServer,
    pick_evicted,
    source_of,
)

from .states import capture

CONFIG = 7
FLOOD = "127.0.0.2"  # another loopback address: a flood from another host


@pytest.fixture
def keys():
    return TransferKeys(os.urandom(32))


@pytest.fixture
def snap():
    return capture("edge_tensors", "source")[0]


def test_pick_evicted_takes_the_longest_waiting_of_the_source_holding_the_most():
    pending = {"a": ("x", 1.0), "b": ("y", 0.5), "c": ("x", 2.0)}
    assert pick_evicted(pending) == ("a", "x held 2 of 3")  # y's waited longer, but holds 1


def test_pick_evicted_of_one_source_takes_the_longest_waiting_not_the_first_arrived():
    # "a" arrived first but answered its hello late: it has waited least for its peer.
    assert pick_evicted({"a": ("x", 3.0), "b": ("x", 1.0), "c": ("x", 2.0)})[0] == "b"


def test_pick_evicted_ties_go_to_the_longest_waiting_source_then_to_order():
    assert pick_evicted({"a": ("x", 2.0), "b": ("y", 1.0)})[0] == "b"
    assert pick_evicted({"a": ("x", 1.0), "b": ("y", 1.0)})[0] == "a"


def test_source_of_keys_ipv4_by_address_and_ipv6_by_its_64():
    assert source_of(("127.0.0.1", 4000)) == "127.0.0.1"
    assert source_of(("::ffff:10.0.0.1", 4000, 0, 0)) == "10.0.0.1"
    assert source_of(("2001:db8::1:2:3:4", 4000, 0, 0)) == "2001:db8::/64"
    assert source_of(("2001:db8::ffff:1", 1, 0, 0)) == "2001:db8::/64"
    assert source_of(("fe80::1%lo", 4000, 0, 1)) == "fe80::/64"


def _hello(keys: TransferKeys) -> bytes:
    """A well-formed hello (the key id is sent in clear): all a peer without the key can send."""
    return encode_frame("hello", v=VERSION, key_id=keys.primary_id, nonce=os.urandom(32),
                        config_id=CONFIG, transfer_id=os.urandom(16))


async def _unproven(server: TransferServer, keys: TransferKeys, source: str | None = None
                    ) -> Conn:
    """A connection (from ``source``, if given) that has sent its hello and read the server's
    challenge, and will never prove the key."""
    sock = socket.socket()
    try:
        if source is not None:
            sock.bind((source, 0))
        sock.connect(server.address)  # the kernel completes it; no accept needed
    except OSError:
        sock.close()
        raise
    conn = Conn(sock, asyncio.get_running_loop())
    await conn.send(_hello(keys))
    assert (await conn.read_frame())["op"] == "challenge"
    return conn


async def _flooded(snap, keys):
    server = TransferServer(keys, lambda: CONFIG, handshake_timeout_s=60.0)
    await server.start()
    server.publish(snap)
    return server


async def test_a_flood_of_hellos_without_the_key_lets_a_fetch_through(snap, keys):
    # With every slot held by an answered hello, a new connection (nothing read yet) must not
    # be the one evicted, or every fetch fails at once, whatever the flood's rate.
    server = await _flooded(snap, keys)
    held = []
    try:
        for _ in range(MAX_HANDSHAKING):
            held.append(await _unproven(server, keys))
        assert not server.refused
        res = await fetch([server.address], keys, CONFIG)
        assert not res.failures
        assert server.refused == {"evicted_unproven": 1}  # the longest waiting: the first
        with pytest.raises(PeerError):
            await held[0].read_frame()
    finally:
        for c in held:
            c.close()
        await server.close()


class _HeldProof(Conn):
    """Sends its second frame (the handshake's proof) only once ``release`` is set."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(sock, loop)
        self.frames = 0
        self.challenged = asyncio.Event()
        self.release = asyncio.Event()

    async def send(self, data) -> None:
        self.frames += 1
        if self.frames == 2:
            self.challenged.set()
            await self.release.wait()
        await super().send(data)


async def test_a_flood_from_another_address_evicts_only_its_own_handshakes(snap, keys):
    with socket.socket() as probe:
        try:
            probe.bind((FLOOD, 0))
        except OSError:
            pytest.skip(f"{FLOOD} is not a local address here")
    server = await _flooded(snap, keys)
    loop = asyncio.get_running_loop()
    holder = _HeldProof(socket.create_connection(server.address), loop)
    held: list[Conn] = []
    handshake = asyncio.ensure_future(client_handshake(holder, keys, CONFIG, os.urandom(16)))
    try:
        await holder.challenged.wait()
        for _ in range(3 * MAX_HANDSHAKING):  # each arrival from then on evicts one
            held.append(await _unproven(server, keys, FLOOD))
        assert server.refused == {"evicted_unproven": 2 * MAX_HANDSHAKING + 1}
        holder.release.set()  # the key holder, the longest waiting of all, is still there
        await handshake
        res = await fetch([server.address], keys, CONFIG)
        assert not res.failures  # in the slot the key holder left: no eviction
        assert server.refused == {"evicted_unproven": 2 * MAX_HANDSHAKING + 1}
    finally:
        handshake.cancel()
        holder.close()
        for c in held:
            c.close()
        await server.close()


async def test_a_flood_of_bad_hellos_counts_each_connection_once(keys):
    """Connections end as fast as they arrive: one whose task has ended (counted) but not yet
    left the handshake slots must not be evicted and counted again."""
    server = TransferServer(keys, lambda: CONFIG, max_handshaking=1)
    await server.start()
    flood = 400

    def send_all() -> list[socket.socket]:
        held = []
        for _ in range(flood):
            s = socket.create_connection(server.address)
            s.sendall(b"\x00\x00\x00\x03abc")  # not msgpack: bad_frame
            held.append(s)
        return held

    held = await asyncio.to_thread(send_all)
    try:
        async with asyncio.timeout(30):
            while server.stats["connections"] < flood or server._conns:
                await asyncio.sleep(0.01)
        assert set(server.refused) <= {"bad_frame", "evicted_unproven"}
        assert server.refused.total() == flood
    finally:
        for s in held:
            s.close()
        await server.close()
