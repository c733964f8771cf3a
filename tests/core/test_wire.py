"""Wire and NullWire: one conformance suite for the shared interface, then Wire's security.

``open`` must never raise, whatever arrives; every drop is counted under an exact reason.
"""

from __future__ import annotations

import pickle
import tracemalloc
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.strategies import messages
from torchpass_p2p.core.codec import MAX_BODY_BYTES, encode
from torchpass_p2p.core.messages import Alert, Alive, Dead, Gossip, Message, Nack, Ping
from torchpass_p2p.core.seal import HEADER, OVERHEAD_BYTES, VERSION, Keyring, Sealer, key_id
from torchpass_p2p.core.wire import NullWire, Opened, Wire

OLD_KEY = bytes(range(32))
NEW_KEY = bytes(range(100, 132))
SENDER = 0x1111_2222_3333_4444
RECEIVER = 0xEEEE_DDDD_CCCC_BBBB  # many bits away from SENDER: no single flip turns one into it
CLUSTER = "job-7"
PING = Ping(1, (Alive(5, 1), Alert(6, 7, 2)))

WIRES = [Wire, NullWire]
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _pair(
    cls: type = Wire, *, sender_key: bytes = OLD_KEY, receiver: Keyring | None = None, **kw: object
) -> tuple[Wire, Wire]:
    sender = cls(CLUSTER, Keyring(sender_key), SENDER, **kw)
    return sender, cls(CLUSTER, receiver or Keyring(sender_key), RECEIVER, **kw)


def _only(wire: Wire, reason: str, count: int = 1) -> None:
    assert wire.rejected == Counter({reason: count})


# --- conformance: Wire and NullWire -----------------------------------------------------------


@pytest.mark.parametrize("cls", WIRES)
@HYP
@given(message=messages, incarnation=st.integers(0, (1 << 32) - 1))
def test_round_trip(cls: type, message: Message, incarnation: int) -> None:
    # Room for any valid body: a full SyncState or Vote is over the default 1,400-byte datagram.
    a, b = _pair(cls, max_datagram_bytes=MAX_BODY_BYTES + OVERHEAD_BYTES)
    datagram = a.seal(message, incarnation)
    assert len(datagram) == len(encode(message)) + OVERHEAD_BYTES
    assert b.open(datagram) == Opened(SENDER, incarnation, message)
    assert (a.seal_count, b.accepted, b.rejected) == (1, 1, Counter())


def test_null_wire_datagrams_match_real_ones_in_layout_and_size() -> None:
    real = Wire(CLUSTER, Keyring(OLD_KEY), SENDER).seal(PING, 3)
    null = NullWire(CLUSTER, None, SENDER).seal(PING, 3)
    assert len(real) == len(null)
    assert HEADER.unpack_from(null) == (VERSION, 0, SENDER, 3, 0)
    assert HEADER.unpack_from(real) == (VERSION, key_id(OLD_KEY), SENDER, 3, 0)


@pytest.mark.parametrize("cls", WIRES)
@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=1500))
def test_open_random_bytes_never_raises_and_counts(cls: type, data: bytes) -> None:
    _, b = _pair(cls)
    result = b.open(data)
    assert result is None or cls is NullWire  # NullWire cannot tell a forgery
    assert b.accepted + sum(b.rejected.values()) == 1


@settings(max_examples=100, deadline=None)
@given(
    tail=st.binary(min_size=OVERHEAD_BYTES - 18, max_size=1382),
    sender=st.integers(0, (1 << 64) - 1).filter(lambda s: s != RECEIVER),
    incarnation=st.integers(0, (1 << 32) - 1),
    counter=st.integers(0, (1 << 32) - 1),
)
def test_random_datagrams_with_a_valid_header_fail_authentication(
    tail: bytes, sender: int, incarnation: int, counter: int
) -> None:
    _, b = _pair()
    header = HEADER.pack(VERSION, key_id(OLD_KEY), sender, incarnation, counter)
    assert b.open(header + tail) is None
    _only(b, "auth_failed")


@pytest.mark.parametrize("cls", WIRES)
@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "too_short"),
        (b"\x01" * (OVERHEAD_BYTES - 1), "too_short"),
        (b"\x02" + b"\x00" * 60, "bad_version"),
        (b"\x00" * 1401, "too_large"),
        (bytearray(b"\x00" * 1401), "too_large"),
        (memoryview(b"\x00" * 1401), "too_large"),
        ("a str" * 10, "not_bytes"),
        (None, "not_bytes"),
        (12345, "not_bytes"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) or len(v) > 12 else v,
)
def test_open_rejects_with_exact_reason(cls: type, data: object, reason: str) -> None:
    _, b = _pair(cls)
    assert b.open(data) is None  # type: ignore[arg-type]
    _only(b, reason)
    assert b.accepted == 0


@pytest.mark.parametrize("cls", WIRES)
def test_bytearray_and_memoryview_datagrams_open(cls: type) -> None:
    a, b = _pair(cls)
    assert b.open(bytearray(a.seal(PING, 0))) == Opened(SENDER, 0, PING)
    assert b.open(memoryview(a.seal(PING, 0))) == Opened(SENDER, 0, PING)


@pytest.mark.parametrize("cls", WIRES)
def test_own_datagram_reflected_back_is_rejected(cls: type) -> None:
    a, _ = _pair(cls)
    assert a.open(a.seal(PING, 0)) is None
    _only(a, "from_self")


@pytest.mark.parametrize("cls", WIRES)
def test_seal_refuses_a_datagram_over_the_limit(cls: type) -> None:
    updates = tuple(Dead(i << 40, 1, i << 41) for i in range(24))
    a, b = _pair(cls, max_datagram_bytes=200)
    with pytest.raises(ValueError, match="max_datagram_bytes"):
        a.seal(Gossip(updates), 0)
    assert a.seal_count == 0  # no counter spent
    assert b.open(a.seal(Gossip(updates[:4]), 0)) is not None  # a smaller one fits


@pytest.mark.parametrize("cls", WIRES)
def test_seal_rejects_local_misuse(cls: type) -> None:
    a, _ = _pair(cls)
    with pytest.raises(ValueError):
        a.seal(Nack(-1, 0), 0)
    a.seal(PING, 5)
    with pytest.raises(ValueError):
        a.seal(PING, 4)  # incarnations never shrink


@pytest.mark.parametrize("cls", WIRES)
@pytest.mark.parametrize(
    ("cluster", "member_id", "max_bytes"),
    [
        ("", 1, 1400),
        (b"c", 1, 1400),
        ("c", -1, 1400),
        ("c", 1 << 64, 1400),
        ("c", True, 1400),
        ("c", 1, OVERHEAD_BYTES),
        ("c", 1, 65508),
    ],
)
def test_constructor_rejects_bad_arguments(
    cls: type, cluster: object, member_id: object, max_bytes: int
) -> None:
    with pytest.raises(ValueError):
        cls(cluster, Keyring(OLD_KEY), member_id, max_bytes)


@pytest.mark.parametrize("cls", WIRES)
def test_oversized_input_rejected_without_copying(cls: type) -> None:
    huge = bytes(64 << 20)  # 64 MiB, allocated before tracing starts
    _, b = _pair(cls)
    tracemalloc.start()
    try:
        assert b.open(huge) is None
        assert b.open(memoryview(huge)) is None
        assert b.open(bytearray(b"\x01" * 2000)) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    _only(b, "too_large", 3)


# --- Wire only: authentication, replay, keys --------------------------------------------------


@HYP
@given(data=st.data())
def test_any_single_bit_flip_is_rejected(data: st.DataObject) -> None:
    a, b = _pair()
    datagram = a.seal(Gossip((Alive(1, 2), Dead(3, 4, 5))), 2)
    bit = data.draw(st.integers(0, len(datagram) * 8 - 1), label="bit")
    flipped = bytearray(datagram)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert b.open(bytes(flipped)) is None
    _only(b, {0: "bad_version", 1: "unknown_key"}.get(bit // 8, "auth_failed"))
    assert b.open(datagram) is not None  # the failure moved no window


def test_replay_and_reordering() -> None:
    a, b = _pair()
    d0, d1, d2 = (a.seal(Nack(i, 9), 0) for i in range(3))
    assert b.open(d2) == Opened(SENDER, 0, Nack(2, 9))
    assert b.open(d0) == Opened(SENDER, 0, Nack(0, 9))  # out of order, inside the window
    assert b.open(d0) is None
    assert b.open(d2) is None
    assert b.open(d1) == Opened(SENDER, 0, Nack(1, 9))
    assert b.accepted == 3
    _only(b, "replay", 2)


def test_datagram_older_than_the_window_is_rejected() -> None:
    a, b = _pair()
    first = a.seal(PING, 0)
    for _ in range(1100):
        last = a.seal(PING, 0)
    assert b.open(last) is not None
    assert b.open(first) is None
    _only(b, "replay")


def test_datagram_sealed_before_a_refutation_is_accepted_once() -> None:
    a, b = _pair()
    old = a.seal(PING, 1)
    new = a.seal(PING, 2)
    assert b.open(new) == Opened(SENDER, 2, PING)
    assert b.open(old) == Opened(SENDER, 1, PING)
    assert b.open(old) is None
    _only(b, "replay")


def test_other_cluster_is_rejected() -> None:
    other = Wire("job-8", Keyring(OLD_KEY), SENDER)
    _, b = _pair()
    assert b.open(other.seal(PING, 0)) is None
    _only(b, "auth_failed")


def test_key_rotation() -> None:
    assert key_id(OLD_KEY) != key_id(NEW_KEY)
    # A spare still on the old primary, talking to peers that already rotated.
    stale_sender = Wire(CLUSTER, Keyring(OLD_KEY), SENDER)
    rotated = Wire(CLUSTER, Keyring(NEW_KEY, [OLD_KEY]), RECEIVER)
    finished = Wire(CLUSTER, Keyring(NEW_KEY), RECEIVER + 1)
    assert rotated.open(stale_sender.seal(PING, 0)) == Opened(SENDER, 0, PING)
    assert finished.open(stale_sender.seal(PING, 0)) is None
    _only(finished, "unknown_key")
    # The rotated peer seals with the new key, which a ring accepting it opens.
    accepting_new = Wire(CLUSTER, Keyring(OLD_KEY, [NEW_KEY]), SENDER + 1)
    assert accepting_new.open(rotated.seal(PING, 0)) == Opened(RECEIVER, 0, PING)
    assert stale_sender.open(rotated.seal(PING, 0)) is None
    _only(stale_sender, "unknown_key")


def _seal_body(body: bytes) -> bytes:
    """A correctly sealed datagram around an arbitrary body: what a key holder could send."""
    return Sealer(CLUSTER, Keyring(OLD_KEY), SENDER).seal(body, 0)


_unpickled: list[str] = []


def _record_unpickling(tag: str) -> str:
    _unpickled.append(tag)
    return tag


class _Trap:
    def __reduce__(self) -> tuple:
        return (_record_unpickling, ("unpickled!",))


def test_pickle_payload_is_rejected_never_unpickled() -> None:
    _, b = _pair()
    assert b.open(_seal_body(pickle.dumps(_Trap(), protocol=pickle.HIGHEST_PROTOCOL))) is None
    _only(b, "decode_msgpack")
    assert _unpickled == []


def test_authentic_length_claim_of_4_gb_is_rejected_without_allocation() -> None:
    datagram = _seal_body(b"\x93\x01\x01\xdd\xff\xff\xff\xff" + b"\x00" * 32)  # array32: 4G
    _, b = _pair()
    tracemalloc.start()
    try:
        assert b.open(datagram) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    _only(b, "decode_too_long")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "decode_msgpack"),
        (b"\x91\x63", "decode_unknown_tag"),
        (b"\x93\x01\xff\x90", "decode_range"),
        (b"\x92\x01\x01", "decode_shape"),
        (b"\x93\x01\xc3\x90", "decode_type"),
    ],
)
def test_authentic_but_undecodable_bodies_count_decode_reasons(body: bytes, reason: str) -> None:
    _, b = _pair()
    assert b.open(_seal_body(body)) is None
    _only(b, reason)


def test_mixed_traffic_counts_exactly() -> None:
    a, b = _pair()
    good = [a.seal(PING, 0) for _ in range(5)]
    for datagram in good + good[:2]:
        b.open(datagram)
    b.open(b"junk")
    b.open(good[3][:-1] + bytes([good[3][-1] ^ 1]))  # seen counter: dropped before decrypting
    assert b.accepted == 5
    assert b.rejected == Counter({"replay": 3, "too_short": 1})
