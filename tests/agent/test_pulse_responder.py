"""The native pulse responder (agent/_pulse.c) and its wire format (agent/pulse_wire.py).

Answers are checked byte for byte against the Python encoding, drops by their exact counter, and
the reason the responder exists by real processes: one holding the GIL keeps answering, one
SIGSTOPped does not. Every "no reply" is shown by a later good ping's pong arriving first (the
responder reads its socket in order), not by waiting, except where the process is stopped.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpass_p2p.agent import pulse_wire
from torchpass_p2p.agent.pulse_wire import (
    PING_BYTES,
    PONG_BYTES,
    PulseResponder,
    PulseUnavailable,
    decode_ping,
    decode_pong,
    encode_ping,
    encode_pong,
    ping_nonce,
)

if not pulse_wire.NATIVE:
    if os.environ.get("CI") == "true":
        pytest.fail("torchpass_p2p.agent._pulse is not built (./scripts/build-native); CI must "
                    "run these tests", pytrace=False)
    pytest.skip("torchpass_p2p.agent._pulse is not built (./scripts/build-native)",
                allow_module_level=True)

from torchpass_p2p.agent._pulse import Responder  # noqa: E402 - only once we know it is built

KID = 7
SECRET = bytes(range(32))
MEMBER = 0x0123_4567_89AB_CDEF
DEADLINE_S = 10.0  # a timeout for what takes milliseconds, generous for a loaded CI machine
ZERO = {"answered": 0, "malformed": 0, "unknown_key": 0, "misdirected": 0, "bad_tag": 0,
        "replayed": 0, "send_errors": 0, "receive_errors": 0}


def nonce(i: int) -> bytes:
    """The ``i``-th ping (from 1) of prober 0."""
    return ping_nonce(0, i)


def until(predicate: Callable[[], bool]) -> None:
    end = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def recv(sock: socket.socket, timeout_s: float = DEADLINE_S) -> bytes | None:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(65536)
    except TimeoutError:
        return None


def counts_after(r: PulseResponder, answered: int) -> dict[str, int]:
    """Counts once ``answered`` pongs were counted (the count follows the send by a moment)."""
    until(lambda: r.counts()["answered"] >= answered)
    return r.counts()


@pytest.fixture
def responder() -> Iterator[PulseResponder]:
    with PulseResponder.start("127.0.0.1", MEMBER, {KID: SECRET}) as r:
        yield r


@pytest.fixture
def client() -> Iterator[socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        yield s


def test_valid_ping_gets_the_pong_python_computes(responder: PulseResponder,
                                                  client: socket.socket) -> None:
    client.sendto(encode_ping(KID, SECRET, nonce(1), MEMBER), ("127.0.0.1", responder.port))
    pong = recv(client)
    assert pong == encode_pong(KID, SECRET, nonce(1), MEMBER)
    assert decode_pong(pong, {KID: SECRET}) == (nonce(1), MEMBER)
    assert counts_after(responder, 1) == {**ZERO, "answered": 1}


def test_a_replayed_ping_is_dropped_and_a_newer_one_answered(responder: PulseResponder,
                                                              client: socket.socket) -> None:
    address = ("127.0.0.1", responder.port)
    first, older, newer = ping_nonce(7, 5), ping_nonce(7, 3), ping_nonce(7, 6)
    client.sendto(encode_ping(KID, SECRET, first, MEMBER), address)
    assert decode_pong(recv(client), {KID: SECRET}) == (first, MEMBER)
    for replay in (first, older, first):  # the same ping again, then an older one
        client.sendto(encode_ping(KID, SECRET, replay, MEMBER), address)
    client.sendto(encode_ping(KID, SECRET, ping_nonce(8, 1), MEMBER), address)  # another prober
    # A forgery with a far sequence fails its tag and must not move prober 7's last one.
    client.sendto(encode_ping(KID, bytes(32), ping_nonce(7, 1000), MEMBER), address)
    client.sendto(encode_ping(KID, SECRET, newer, MEMBER), address)
    replies = [decode_pong(recv(client), {KID: SECRET}) for _ in range(2)]
    assert replies == [(ping_nonce(8, 1), MEMBER), (newer, MEMBER)]
    assert counts_after(responder, 3) == {**ZERO, "answered": 3, "replayed": 3, "bad_tag": 1}
    # Sequences start at 1.
    client.sendto(encode_ping(KID, SECRET, ping_nonce(9, 0), MEMBER), address)
    client.sendto(encode_ping(KID, SECRET, ping_nonce(9, 1), MEMBER), address)
    assert decode_pong(recv(client), {KID: SECRET}) == (ping_nonce(9, 1), MEMBER)
    assert counts_after(responder, 4) == {**ZERO, "answered": 4, "replayed": 4, "bad_tag": 1}


def test_ipv6() -> None:
    try:
        r = PulseResponder.start("::1", 2**64 - 1, {0: SECRET})
    except OSError:
        pytest.skip("no IPv6 loopback")
    with r, socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as c:
        c.sendto(encode_ping(0, SECRET, nonce(2), 2**64 - 1), ("::1", r.port))
        assert recv(c) == encode_pong(0, SECRET, nonce(2), 2**64 - 1)


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1:]


def _v1_ping(kid: int, secret: bytes, n: bytes) -> bytes:
    """A version 1 ping (37 bytes, no target), as a responder before version 2 answered."""
    head = b"TPp1" + bytes([kid]) + n
    return head + hmac.new(secret, head, hashlib.sha256).digest()[:16]


GOOD = encode_ping(KID, SECRET, nonce(9), MEMBER)
BAD = {
    "short": (GOOD[:-1], "malformed"),
    "long": (GOOD + b"\0", "malformed"),
    "wrong magic": (b"XPp1" + GOOD[4:], "malformed"),
    "a pong": (encode_pong(KID, SECRET, nonce(9), MEMBER), "malformed"),
    "empty": (b"", "malformed"),
    # 64 KiB of garbage: 65,507 bytes, the most one IPv4 UDP datagram carries.
    "64 KiB garbage": (bytes([0xA5]) * 65_507, "malformed"),
    "version 1 ping": (_v1_ping(KID, SECRET, nonce(9)), "malformed"),
    "unknown key id": (encode_ping(KID + 1, SECRET, nonce(9), MEMBER), "unknown_key"),
    "another member's": (encode_ping(KID, SECRET, nonce(9), MEMBER + 1), "misdirected"),
    "target bit": (_flip(GOOD, 12), "misdirected"),
    "tag bit": (_flip(GOOD, 44), "bad_tag"),
    "nonce bit": (_flip(GOOD, 13), "bad_tag"),
    "other secret": (encode_ping(KID, bytes(32), nonce(9), MEMBER), "bad_tag"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_datagram_gets_no_reply_and_its_counter(name: str, responder: PulseResponder,
                                                    client: socket.socket) -> None:
    datagram, counter = BAD[name]
    address = ("127.0.0.1", responder.port)
    client.sendto(datagram, address)
    client.sendto(encode_ping(KID, SECRET, nonce(10), MEMBER), address)
    # The first reply is the good ping's: the bad datagram, read before it, got none.
    assert recv(client) == encode_pong(KID, SECRET, nonce(10), MEMBER)
    assert counts_after(responder, 1) == {**ZERO, "answered": 1, counter: 1}


def test_two_keys_each_answered_under_its_own_id(client: socket.socket) -> None:
    secrets = {1: b"a" * 32, 200: b"b" * 32}
    with PulseResponder.start("127.0.0.1", 42, secrets) as r:
        for i, (kid, secret) in enumerate(secrets.items(), start=1):
            client.sendto(encode_ping(kid, secret, nonce(i), 42), ("127.0.0.1", r.port))
            assert recv(client) == encode_pong(kid, secret, nonce(i), 42)
        assert counts_after(r, 2) == {**ZERO, "answered": 2}


GOOD_PONG = encode_pong(KID, SECRET, nonce(3), MEMBER)


def test_decode_pong_rejects_every_truncation_and_bit_flip() -> None:
    secrets = {KID: SECRET}
    assert decode_pong(GOOD_PONG, secrets) == (nonce(3), MEMBER)
    for n in range(PONG_BYTES):
        assert decode_pong(GOOD_PONG[:n], secrets) is None
    for bit in range(PONG_BYTES * 8):
        flipped = bytearray(GOOD_PONG)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert decode_pong(bytes(flipped), secrets) is None, bit
    assert decode_pong(GOOD_PONG, {KID + 1: SECRET}) is None
    assert decode_pong(GOOD_PONG, {KID: bytes(32)}) is None


@given(st.binary(max_size=2 * PONG_BYTES))
def test_decode_pong_never_raises(data: bytes) -> None:
    assert decode_pong(data, {KID: SECRET, 0: bytes(32)}) is None


@given(st.integers(0, 255), st.binary(min_size=16, max_size=16), st.integers(0, 2**64 - 1))
def test_pong_round_trip(kid: int, n: bytes, member: int) -> None:
    assert decode_pong(encode_pong(kid, SECRET, n, member), {kid: SECRET}) == (n, member)


CHILD_MEMBER = 5
CHILD = """
import ctypes, json, signal, socket, sys
from torchpass_p2p.agent.pulse_wire import PulseResponder
mode, kid, secret, member = sys.argv[1:]
r = PulseResponder.start("127.0.0.1", int(member), {int(kid): bytes.fromhex(secret)})
if mode == "counts":  # the smallest receive buffer: a few datagrams fill it
    r._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
print(r.port, flush=True)
if mode == "hold":
    sys.stdin.readline()
    print("before", r.counts()["answered"], flush=True)
    ctypes.PyDLL(None).usleep(2_000_000)  # PyDLL: the GIL stays held for the whole call
    print("after", r.counts()["answered"], flush=True)
    sys.stdin.readline()
elif mode == "counts":
    for _ in sys.stdin:
        print(json.dumps(r.counts()), flush=True)
else:
    signal.pause()
"""


def spawn(mode: str) -> tuple[subprocess.Popen[str], int]:
    argv = [sys.executable, "-c", CHILD, mode, str(KID), SECRET.hex(), str(CHILD_MEMBER)]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, int(child.stdout.readline())


def reap(child: subprocess.Popen[str]) -> None:
    child.kill()
    child.wait(DEADLINE_S)
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            stream.close()


def test_answers_while_the_gil_is_held(client: socket.socket) -> None:
    child, port = spawn("hold")
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["before", "0"]
        # Ping every 50 ms until "after"; the pipe is read before the socket each round, so a
        # pong counted here was received before the "after" line was written.
        pongs, i, line = 0, 0, ""
        now = time.monotonic()
        end, next_ping = now + DEADLINE_S, now
        while not line:
            now = time.monotonic()
            assert now < end, "no 'after' line"
            if now >= next_ping:
                client.sendto(encode_ping(KID, SECRET, nonce(i), CHILD_MEMBER),
                              ("127.0.0.1", port))
                i, next_ping = i + 1, now + 0.05
            ready, _, _ = select.select([child.stdout, client], [], [], next_ping - now)
            if child.stdout in ready:
                line = child.stdout.readline()
            elif client in ready:
                pong = client.recv(PONG_BYTES)
                pongs += decode_pong(pong, {KID: SECRET}) is not None
        word, answered = line.split()
        assert word == "after"
        assert pongs >= 1
        assert int(answered) >= 1  # answered between the two reads that bracket the hold
    finally:
        reap(child)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def _pong_for(client: socket.socket, port: int, n: bytes, window_s: float) -> bool:
    """Ping with nonce ``n`` every 50 ms for up to ``window_s``; True once its pong arrives."""
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        client.sendto(encode_ping(KID, SECRET, n, CHILD_MEMBER), ("127.0.0.1", port))
        reply = recv(client, 0.05)
        if reply is not None and decode_pong(reply, {KID: SECRET}) == (n, CHILD_MEMBER):
            return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_process_does_not_answer(client: socket.socket) -> None:
    child, port = spawn("pause")
    try:
        assert _pong_for(client, port, nonce(1), DEADLINE_S)
        os.kill(child.pid, signal.SIGSTOP)
        until(lambda: _state(child.pid) == "T")
        assert not _pong_for(client, port, nonce(2), 0.5)
        os.kill(child.pid, signal.SIGCONT)
        assert _pong_for(client, port, nonce(3), DEADLINE_S)
    finally:
        reap(child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, SO_MEMINFO")
def test_datagrams_lost_while_the_process_is_stopped_count_as_kernel_dropped(
        client: socket.socket) -> None:
    child, port = spawn("counts")
    sent = 200
    try:
        assert child.stdin is not None and child.stdout is not None

        def counts() -> dict[str, int]:
            child.stdin.write("\n")
            child.stdin.flush()
            return json.loads(child.stdout.readline())

        os.kill(child.pid, signal.SIGSTOP)
        until(lambda: _state(child.pid) == "T")
        for _ in range(sent):  # nothing reads: a few fit the buffer, the kernel drops the rest
            client.sendto(b"\x00", ("127.0.0.1", port))
        os.kill(child.pid, signal.SIGCONT)
        end = time.monotonic() + DEADLINE_S
        while (now := counts())["malformed"] + now.get("kernel_dropped", 0) < sent:
            assert time.monotonic() < end, now
            time.sleep(0.01)
        assert now["kernel_dropped"] > 0 and now["malformed"] > 0
        assert now["malformed"] + now["kernel_dropped"] == sent  # each datagram once
        assert now == {**ZERO, "malformed": now["malformed"],
                       "kernel_dropped": now["kernel_dropped"]}
    finally:
        reap(child)


def test_close_twice_then_the_port_is_free(client: socket.socket) -> None:
    r = PulseResponder.start("127.0.0.1", MEMBER, {KID: SECRET})
    client.sendto(encode_ping(KID, SECRET, nonce(1), MEMBER), ("127.0.0.1", r.port))
    assert recv(client) is not None
    counts = counts_after(r, 1)
    r.close()
    r.close()
    assert r.closed and r.counts() == counts
    client.sendto(encode_ping(KID, SECRET, nonce(2), MEMBER), ("127.0.0.1", r.port))
    assert recv(client, 0.2) is None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", r.port))  # nothing holds it any more


def test_unclosed_responder_warns_and_stops() -> None:
    r = PulseResponder.start("127.0.0.1", MEMBER, {KID: SECRET})
    with pytest.warns(ResourceWarning, match="unclosed"):
        del r


def test_raw_responder_stop_is_idempotent() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        r = Responder(s.fileno(), 0, {0: SECRET})
        assert r.running
        r.stop()
        r.stop()
        assert not r.running and r.counts() == ZERO


def test_start_without_native_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pulse_wire, "_pulse", None)
    with pytest.raises(PulseUnavailable, match=r"build it with \./scripts/build-native"):
        PulseResponder.start("127.0.0.1", MEMBER, {KID: SECRET})


BAD_ARGS: dict[str, tuple[dict[str, object], type[Exception], str]] = {
    "fd -1": (dict(fd=-1), ValueError, "non-negative"),
    "fd str": (dict(fd="3"), TypeError, "integer"),
    "member -1": (dict(member=-1), OverflowError, "0..2"),
    "member 2**64": (dict(member=2**64), OverflowError, "0..2"),
    "member str": (dict(member="1"), TypeError, "member"),
    "member bool": (dict(member=True), TypeError, "member"),
    "no keys": (dict(keys={}), ValueError, "at least one"),
    "keys list": (dict(keys=[(0, SECRET)]), TypeError, "dict"),
    "key id 256": (dict(keys={256: SECRET}), ValueError, "0..255"),
    "key id -1": (dict(keys={-1: SECRET}), ValueError, "0..255"),
    "key id str": (dict(keys={"0": SECRET}), TypeError, "key ids"),
    "secret 31 bytes": (dict(keys={0: SECRET[:31]}), ValueError, "32 bytes"),
    "secret bytearray": (dict(keys={0: bytearray(SECRET)}), TypeError, "bytes"),
}


@pytest.mark.parametrize("name", list(BAD_ARGS))
def test_responder_rejects_bad_arguments(name: str) -> None:
    change, error, match = BAD_ARGS[name]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        args: dict[str, object] = {"fd": s.fileno(), "member": 1, "keys": {0: SECRET}, **change}
        with pytest.raises(error, match=match):
            Responder(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["tcp", "pipe"])
def test_responder_rejects_a_non_udp_descriptor(kind: str) -> None:
    if kind == "tcp":
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            with pytest.raises(ValueError, match="UDP socket"):
                Responder(s.fileno(), 1, {0: SECRET})
        return
    read, write = os.pipe()
    try:
        with pytest.raises(ValueError):
            Responder(read, 1, {0: SECRET})
    finally:
        os.close(read)
        os.close(write)


@given(st.binary(max_size=2 * PING_BYTES))
def test_decode_ping_never_raises(data: bytes) -> None:
    assert decode_ping(data, {KID: SECRET, 0: bytes(32)}) is None


@given(st.integers(0, 255), st.binary(min_size=16, max_size=16), st.integers(0, 2**64 - 1))
def test_ping_round_trip_and_a_pong_is_never_a_ping(kid: int, n: bytes, target: int) -> None:
    ping = encode_ping(kid, SECRET, n, target)
    assert len(ping) == PING_BYTES == PONG_BYTES  # a pong is no bigger than its ping
    assert decode_ping(ping, {kid: SECRET}) == (target, n)
    assert decode_pong(ping, {kid: SECRET}) is None
    assert decode_ping(encode_pong(kid, SECRET, n, target), {kid: SECRET}) is None
