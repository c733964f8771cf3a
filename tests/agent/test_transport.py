"""The transport alone: two endpoints on loopback, real sockets, real sealing."""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct

from torchpass_p2p.agent.transport import (
    MAX_UNPROVEN_CONNECTIONS,
    REQUEST_LABEL,
    STREAM_LABEL,
    Channel,
    Kind,
    Received,
    Transport,
    TransportError,
)
from torchpass_p2p.core.codec import (
    MAX_BODY_BYTES,
    MAX_CUT_REMOVED,
    MAX_LABEL_BYTES,
    MAX_SEGMENT,
    SEGMENT_BYTES,
    encode,
)
from torchpass_p2p.core.messages import Cut, Joiner, Ping, Topology, Vote
from torchpass_p2p.core.seal import Keyring, Sealer


def largest_vote() -> Vote:
    """A vote at every codec limit, with as many joiners of the longest labels as the body
    limit holds (7 of 209 bytes beside 32 removals: a 2,014-byte body): its sealed datagram
    exceeds 1,400 bytes."""
    label = "h" * MAX_LABEL_BYTES
    joined = tuple(Joiner(1000 + i, label, 65535, Topology(label, label)) for i in range(7))
    cut = Cut(removed=tuple(range(1 << 60, (1 << 60) + MAX_CUT_REMOVED)), joined=joined)
    vote = Vote((1 << 63) - 1, (1 << 32) - 1, cut, MAX_SEGMENT, b"\xff" * SEGMENT_BYTES, 1 << 62)
    assert len(encode(vote)) == 2014 <= MAX_BODY_BYTES
    return vote


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


def frame(keyring: Keyring, label: bytes, sender: int, kind: int, body: bytes,
          incarnation: int = 0, to: int | None = None) -> bytes:
    """A frame sealed as a member ``sender`` would seal it on the channel of ``label``."""
    channel = Channel.MESSAGE if label == STREAM_LABEL else Channel.REQUEST
    sealed = Sealer("t", keyring.derive(label), sender).seal(bytes((kind,)) + body,
                                                             incarnation, to)
    return struct.pack(">I", 1 + len(sealed)) + bytes((channel,)) + sealed


async def exchange(address, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; the frame that comes back, or b"" if the peer
    closes the connection (or sends nothing for 2 s)."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(data)
    try:
        async with asyncio.timeout(2.0):
            header = await reader.readexactly(4)
            return header + await reader.readexactly(struct.unpack(">I", header)[0])
    except (TimeoutError, asyncio.IncompleteReadError):
        return b""
    finally:
        writer.close()


async def test_requests_still_seal_after_a_message_frame_at_a_higher_incarnation():
    # Regression: requests and message frames shared one sealer, whose incarnation may not
    # go down, so after a refutation (incarnation 1) and one oversized message every request
    # and every reply raised ValueError.
    a, b, got, _ = await pair(Keyring(secrets.token_bytes(32)))
    try:
        b.send(a.address, largest_vote(), 1, 1)
        async with asyncio.timeout(5):
            while not got:
                await asyncio.sleep(0.01)
        assert got[0].incarnation == 1
        a.send(b.address, largest_vote(), 1, 2)  # a, the answering side, refuted too
        assert await b.request(a.address, Kind.CONFIG_REQUEST, b"x") == (Kind.CONFIG_REPLY,
                                                                         b"pong:x")
    finally:
        await a.close()
        await b.close()


async def test_a_message_frame_replayed_to_another_member_does_not_open_there():
    keyring = Keyring(secrets.token_bytes(32))
    a, b, got, _ = await pair(keyring)
    try:
        vote = largest_vote()
        for_b = frame(keyring, STREAM_LABEL, 7, Kind.MESSAGE, encode(vote), to=2)
        assert await exchange(a.address, for_b) == b""  # closed: not for member 1
        assert await exchange(b.address, for_b) == b""  # opens at its receiver
        async with asyncio.timeout(5):
            while not got:
                await asyncio.sleep(0.01)
        assert [(r.sender, r.message) for r in got] == [(7, vote)]
        assert a.rejected_frames == {"auth_failed": 1} and b.rejected_frames == {}
    finally:
        await a.close()
        await b.close()


async def test_an_old_reply_replayed_to_a_new_request_is_rejected():
    keyring = Keyring(secrets.token_bytes(32))
    a, b, _, _ = await pair(keyring)

    async def replay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        writer.write(recorded)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(replay, "127.0.0.1", 0)
    try:
        # A genuine reply of a to some request, recorded off the wire.
        recorded = await exchange(a.address, frame(keyring, REQUEST_LABEL, 9,
                                                   Kind.CONFIG_REQUEST, b"x"))
        assert recorded[4] == Channel.REQUEST
        address = server.sockets[0].getsockname()[:2]
        try:
            await b.request(address, Kind.CONFIG_REQUEST, b"x")
            raise AssertionError("a replayed reply was accepted")
        except TransportError as exc:
            assert "auth_failed" in str(exc)
        assert await b.request(a.address, Kind.CONFIG_REQUEST, b"y") == (Kind.CONFIG_REPLY,
                                                                         b"pong:y")
    finally:
        server.close()
        await a.close()
        await b.close()


async def test_idle_connections_without_the_key_cannot_take_every_slot():
    a, b, _, _ = await pair(Keyring(secrets.token_bytes(32)))
    idle = []
    try:
        for _ in range(MAX_UNPROVEN_CONNECTIONS + 16):
            idle.append(await asyncio.open_connection(*a.address))
        # A member's request still gets in: the oldest idle connections made room.
        assert await b.request(a.address, Kind.CONFIG_REQUEST, b"z") == (Kind.CONFIG_REPLY,
                                                                         b"pong:z")
        assert a.rejected_frames["evicted_unproven"] >= 16
        # The rest are closed by the first-frame deadline.
        async with asyncio.timeout(10):
            for reader, _ in idle:
                assert await reader.read() == b""
    finally:
        for _, writer in idle:
            writer.close()
        await a.close()
        await b.close()


async def test_a_failing_request_handler_closes_only_that_connection(caplog):
    def handler(kind: int, body: bytes):
        if body == b"bug":
            raise OverflowError("a bug in the handler")
        return Kind.CONFIG_REPLY, b"pong:" + body

    keyring = Keyring(secrets.token_bytes(32))
    a = Transport("t", keyring, 1, on_message=print, on_send_error=print, on_request=handler)
    b = Transport("t", keyring, 2, on_message=print, on_send_error=print,
                  on_request=lambda k, body: None)
    await a.start(("127.0.0.1", 0))
    await b.start(("127.0.0.1", 0))
    try:
        try:
            await b.request(a.address, Kind.CONFIG_REQUEST, b"bug")
            raise AssertionError("a reply to a request whose handler failed")
        except TransportError:
            pass
        assert await b.request(a.address, Kind.CONFIG_REQUEST, b"ok") == \
            (Kind.CONFIG_REPLY, b"pong:ok")
        assert a.traffic["handler_errors"] == 1 and a.rejected_frames == {"handler_error": 1}
        assert "handling a request of kind 1 failed" in caplog.text
    finally:
        await a.close()
        await b.close()


async def test_a_requester_that_never_reads_its_reply_is_dropped(monkeypatch):
    from torchpass_p2p.agent import transport as transport_module

    monkeypatch.setattr(transport_module, "REPLY_TIMEOUT_S", 0.3)
    keyring = Keyring(secrets.token_bytes(32))
    big = b"x" * (32 << 20)  # far above what the socket buffers take
    a = Transport("t", keyring, 1, on_message=print, on_send_error=print,
                  on_request=lambda k, body: (Kind.CONFIG_REPLY, big))
    await a.start(("127.0.0.1", 0))
    try:
        reader, writer = await asyncio.open_connection(*a.address)
        writer.write(frame(keyring, REQUEST_LABEL, 2, Kind.CONFIG_REQUEST, b""))
        await writer.drain()  # and never read
        async with asyncio.timeout(30):
            while not a.rejected_frames:
                await asyncio.sleep(0.05)
        assert a.rejected_frames == {"reply_not_taken": 1}
        writer.close()
    finally:
        await a.close()
