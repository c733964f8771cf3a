"""The transport alone: two endpoints on loopback, real sockets, real sealing."""

from __future__ import annotations

import asyncio
import secrets

from torchpass_p2p.agent.transport import Kind, Received, Transport
from torchpass_p2p.core.codec import (
    MAX_CUT_JOINED,
    MAX_CUT_REMOVED,
    MAX_LABEL_BYTES,
    MAX_SEGMENT,
    SEGMENT_BYTES,
)
from torchpass_p2p.core.messages import Cut, Joiner, Ping, Topology, Vote
from torchpass_p2p.core.seal import Keyring


def largest_vote() -> Vote:
    """A vote at every codec limit: its sealed datagram exceeds 1,400 bytes."""
    label = "h" * MAX_LABEL_BYTES
    joined = tuple(Joiner(1000 + i, label, 65535, Topology(label, label))
                   for i in range(MAX_CUT_JOINED))
    cut = Cut(removed=tuple(range(1 << 60, (1 << 60) + MAX_CUT_REMOVED)), joined=joined)
    return Vote((1 << 63) - 1, (1 << 32) - 1, cut, MAX_SEGMENT, b"\xff" * SEGMENT_BYTES, 1 << 62)


async def pair(keyring: Keyring):
    got: list[Received] = []
    errors: list = []
    a = Transport("t", keyring, 1, on_message=got.append, on_send_error=lambda *e: errors.append(e),
                  on_request=lambda k, b: (Kind.CONFIG_REPLY, b"pong:" + b) if k == 1 else None)
    b = Transport("t", keyring, 2, on_message=got.append, on_send_error=lambda *e: errors.append(e),
                  on_request=lambda k, b: None)
    await a.start(("127.0.0.1", 0))
    await b.start(("127.0.0.1", 0))
    return a, b, got, errors


async def test_small_messages_go_by_udp_and_oversized_ones_by_one_tcp_frame():
    a, b, got, errors = await pair(Keyring(secrets.token_bytes(32)))
    try:
        vote = largest_vote()
        b.send(a.address, Ping(7, ()), 0, 1)
        b.send(a.address, vote, 0, 1)
        async with asyncio.timeout(5):
            while len(got) < 2:
                await asyncio.sleep(0.01)
        by_type = {type(r.message): r for r in got}
        assert by_type[Ping].message == Ping(7, ())
        assert by_type[Vote].message == vote and by_type[Vote].sender == 2
        assert b.traffic["datagrams_sent"] == 1 and b.traffic["frames_sent"] == 1
        assert errors == [] and a.rejected.total() == 0 and a.rejected_frames.total() == 0
    finally:
        await a.close()
        await b.close()


async def test_a_request_gets_its_reply_on_the_same_connection():
    a, b, _, _ = await pair(Keyring(secrets.token_bytes(32)))
    try:
        kind, body = await b.request(a.address, Kind.CONFIG_REQUEST, b"ping")
        assert (kind, body) == (Kind.CONFIG_REPLY, b"pong:ping")
    finally:
        await a.close()
        await b.close()


async def test_a_datagram_replayed_to_another_member_does_not_open_there():
    keyring = Keyring(secrets.token_bytes(32))
    a, b, got, _ = await pair(keyring)
    c = Transport("t", keyring, 3, on_message=got.append, on_send_error=print,
                  on_request=lambda k, body: None)
    await c.start(("127.0.0.1", 0))
    try:
        from torchpass_p2p.core.wire import Wire
        datagram = Wire("t", keyring, 2).seal(Ping(5, ()), 0, to=1)  # from 2, for member 1
        import socket
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(datagram, c.address)  # replayed to member 3
            s.sendto(datagram, a.address)  # and to its receiver
        async with asyncio.timeout(5):
            while not got or c.rejected.total() < 1:
                await asyncio.sleep(0.01)
        assert [(r.sender, r.message) for r in got] == [(2, Ping(5, ()))]
        assert c.rejected == {"auth_failed": 1}
    finally:
        for t in (a, b, c):
            await t.close()
