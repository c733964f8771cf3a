"""The msgpack codec: exact round trips, a pinned wire format, and total rejection of bad bodies."""

from __future__ import annotations

import pickle
import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.strategies import MESSAGE_STRATEGIES, messages
from torchpass_p2p.core import codec
from torchpass_p2p.core.codec import (
    MAX_BODY_BYTES,
    MAX_SYNC_ENTRIES,
    MAX_UPDATES,
    MESSAGE_TAGS,
    UPDATE_TAGS,
    DecodeError,
    decode,
    encode,
)
from torchpass_p2p.core.messages import (
    MAX_INCARNATION,
    MAX_MEMBER_ID,
    Ack,
    Alert,
    Alive,
    Dead,
    Digest,
    Gossip,
    Left,
    Nack,
    Ping,
    PingReq,
    SyncState,
)
from torchpass_p2p.core.sizes import encoded_size

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", list(MESSAGE_STRATEGIES), ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_round_trip_every_message_type(cls: type, data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[cls])
    body = encode(message)
    assert len(body) <= MAX_BODY_BYTES
    decoded = decode(body)
    assert decoded == message
    assert type(decoded) is cls
    assert [type(u) for u in getattr(decoded, "updates", ())] == [
        type(u) for u in getattr(message, "updates", ())
    ]
    assert encode(decoded) == body


def test_tag_tables_cover_every_class() -> None:
    assert MESSAGE_TAGS == {
        Ping: 1, PingReq: 2, Ack: 3, Nack: 4, Gossip: 5, Digest: 6, SyncState: 7,
    }  # fmt: skip
    assert UPDATE_TAGS == {Alive: 1, Alert: 2, Dead: 3, Left: 4}


@pytest.mark.parametrize(
    ("message", "golden"),
    [
        (Ping(1, (Alive(2, 3),)), "93 01 01 91 93 01 02 03"),
        (PingReq(5, 6, ()), "94 02 05 06 90"),
        (Ack(7, (Left(8, 0),)), "93 03 07 91 93 04 08 00"),
        (Nack(9, 10), "93 04 09 0a"),
        (Gossip((Alert(1, 2, 3), Dead(4, 5, 6))), "92 05 92 94 02 01 02 03 94 03 04 05 06"),
        (Digest(1, 2, 3), "94 06 01 02 03"),
        (SyncState(1, 0, 1, (), True), "96 07 01 00 01 90 c3"),
        (Nack(0, MAX_MEMBER_ID), "93 04 00 cf ff ff ff ff ff ff ff ff"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else "",
)
def test_wire_format_is_pinned(message: object, golden: str) -> None:
    body = encode(message)  # type: ignore[arg-type]
    assert body.hex(" ") == golden
    assert decode(bytes.fromhex(golden)) == message


def test_largest_valid_bodies_fit_the_body_limit() -> None:
    big = Dead(MAX_MEMBER_ID, MAX_INCARNATION, MAX_MEMBER_ID)
    sync = SyncState(MAX_MEMBER_ID, 65535, 65535, (big,) * MAX_SYNC_ENTRIES, False)
    gossip = Gossip((Alert(MAX_MEMBER_ID, MAX_MEMBER_ID, MAX_INCARNATION),) * MAX_UPDATES)
    assert len(_pack((3, MAX_MEMBER_ID, MAX_INCARNATION, MAX_MEMBER_ID))) == codec.MAX_UPDATE_BYTES
    assert len(encode(sync)) == 1621  # the figure in codec.MAX_BODY_BYTES's comment
    assert len(encode(gossip)) < len(encode(sync)) <= MAX_BODY_BYTES
    assert decode(encode(sync)) == sync
    assert decode(encode(gossip)) == gossip


# --- encode refuses what decode would refuse (local misuse) -------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        'Ping(-1)',
        'Ping(1 << 32)',
        'Ping(True)',
        'Ping(1.0)',
        'Ping(1, [Alive(1, 1)])',
        'Ping(1, (Alive(1, 1),) * (MAX_UPDATES + 1))',
        'Ping(1, ("not an update",))',
        'PingReq(1, 1 << 64)',
        'Nack(1, -1)',
        'Gossip((Alive(-1, 0),))',
        'Gossip((Alive(1, 1 << 32),))',
        'Gossip((Alert(1, 1 << 64, 0),))',
        'Gossip((Dead(1, 0, False),))',
        'Gossip((Left(1, None),))',
        'Digest(1 << 64, 0, 0)',
        'Digest(0, 0, 1 << 32)',
        'SyncState(0, 65536, 1, ())',
        'SyncState(0, 0, -1, ())',
        'SyncState(0, 0, 1, (), 1)',
        'SyncState(0, 0, 1, (Alive(1, 1),) * (MAX_SYNC_ENTRIES + 1))',
        '"not a message"',
    ],
)
def test_encode_rejects_invalid_messages(source: str) -> None:
    namespace = {**globals(), "MAX_UPDATES": MAX_UPDATES, "MAX_SYNC_ENTRIES": MAX_SYNC_ENTRIES}
    message = eval(source, namespace)
    with pytest.raises(ValueError):
        encode(message)


# --- decode: exact reasons ----------------------------------------------------------------------

_65_UPDATES = tuple((1, i, 0) for i in range(MAX_UPDATES + 1))


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "msgpack"),
        (b"\xc1", "msgpack"),  # never-used msgpack byte
        (_pack((1, 1, ())) + b"\x00", "msgpack"),  # trailing data
        (b"\x91" * 1500 + b"\x00", "msgpack"),  # nesting beyond msgpack's stack
        (b"\xdb\xff\xff\xff\xff" + b"a" * 64, "msgpack"),  # str32 claiming 4 GB, input short
        (b"\xdd\xff\xff\xff\xff" + b"\x00" * 64, "too_long"),  # array32 claiming 4G items
        (b"\xdf\xff\xff\xff\xff", "too_long"),  # map32 claiming 4G pairs
        (b"\xa1a", "too_long"),  # any non-empty string
        (b"\xd4\x01\x00", "too_long"),  # any extension type
        (b"\x00" * (MAX_BODY_BYTES + 1), "too_long"),
        (_pack((1, 1, _65_UPDATES)), "too_long"),
        (b"\x80", "type"),  # empty map
        (b"\xc4\x00", "type"),  # empty binary
        (_pack(5), "type"),
        (_pack(None), "type"),
        (_pack(()), "shape"),
        (_pack((99,)), "unknown_tag"),
        (_pack((0, 1, ())), "unknown_tag"),
        (_pack((True, 1, ())), "unknown_tag"),  # True == 1 must not find Ping
        (_pack((1.0, 1, ())), "unknown_tag"),
        (b"\x93\x80\x01\x90", "unknown_tag"),  # an unhashable tag ({})
        (_pack((1, 1)), "shape"),
        (_pack((1, 1, (), 0)), "shape"),
        (_pack((1, -1, ())), "range"),
        (_pack((1, 1 << 32, ())), "range"),
        (_pack((1, True, ())), "type"),
        (_pack((1, 1.5, ())), "type"),
        (_pack((1, 1, 5)), "type"),
        (_pack((1, 1, (5,))), "type"),
        (_pack((1, 1, ((),))), "shape"),
        (_pack((1, 1, ((9, 1, 0),))), "unknown_tag"),
        (_pack((1, 1, ((True, 1, 0),))), "unknown_tag"),
        (b"\x93\x01\x01\x91\x93\x80\x01\x00", "unknown_tag"),  # unhashable update tag
        (b"\x93\x01\x01\x91\x93\x01\x80\x00", "type"),  # map where a member id belongs
        (_pack((1, 1, ((1, 1),))), "shape"),
        (_pack((1, 1, ((2, 1, 2),))), "shape"),
        (_pack((1, 1, ((1, True, 0),))), "type"),
        (_pack((1, 1, ((1, -1, 0),))), "range"),
        (_pack((1, 1, ((1, 1, 1 << 32),))), "range"),
        (_pack((2, 1, -1, ())), "range"),
        (_pack((3, 1, ((4, 1, -2),))), "range"),
        (_pack((4, 1, False)), "type"),
        (_pack((5, ((3, 1, 1, -1),))), "range"),
        (_pack((5, ((2, 1, 1, False),))), "type"),
        (_pack((6, 1, 2, 1 << 32)), "range"),
        (_pack((6, 1, 2)), "shape"),
        (_pack((7, 0, 65536, 1, (), False)), "range"),
        (_pack((7, 0, 0, 1, (), 1)), "type"),
        (_pack((7, 0, 0, 1, (), None)), "type"),
        (_pack((7, 0, 0, 1, _65_UPDATES, False)), "too_long"),
        ("not bytes", "type"),
        (None, "type"),
    ],
    ids=lambda v: v.hex()[:24] if isinstance(v, bytes) else repr(v)[:24],
)
def test_decode_rejects_with_exact_reason(body: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode(body)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError)


def test_decode_accepts_bytearray_and_memoryview() -> None:
    body = encode(Ping(3, (Alive(1, 2),)))
    assert decode(bytearray(body)) == decode(memoryview(body)) == Ping(3, (Alive(1, 2),))
    wide = memoryview(bytes(8 * 1024)).cast("Q")  # 1,024 items, 8 KiB
    with pytest.raises(DecodeError) as info:
        decode(wide)  # type: ignore[arg-type]
    assert info.value.reason == "too_long"


def test_cached_update_is_not_returned_for_a_bool_field() -> None:
    # Alive(1, 0) lands in the decode cache; (1, True, 0) == (1, 1, 0) as a dict key.
    assert decode(_pack((1, 1, ((1, 1, 0),)))) == Ping(1, (Alive(1, 0),))
    with pytest.raises(DecodeError) as info:
        decode(_pack((1, 1, ((1, True, 0),))))
    assert info.value.reason == "type"
    with pytest.raises(DecodeError):
        decode(_pack((1, 1, ((1, 1.0, 0),))))


def test_update_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "UPDATE_CACHE_SIZE", 3)
    codec._update_cache.clear()
    updates = tuple(Alive(i, i) for i in range(10))
    assert decode(encode(Gossip(updates))) == Gossip(updates)
    assert len(codec._update_cache) <= 3
    codec._update_cache.clear()


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=MAX_BODY_BYTES + 16))
def test_decode_random_bytes_raises_only_decode_error(body: bytes) -> None:
    try:
        message = decode(body)
    except DecodeError as exc:
        assert exc.reason in {"too_long", "msgpack", "shape", "type", "unknown_tag", "range"}
    else:
        assert decode(encode(message)) == message


_msgpack_values = st.recursive(
    st.one_of(
        st.integers(-(1 << 63), (1 << 64) - 1),
        st.integers(0, 8),
        st.booleans(),
        st.none(),
        st.floats(allow_nan=False),
    ),
    lambda inner: st.lists(inner, max_size=6).map(tuple),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(
    st.tuples(st.integers(0, 8), st.integers(0, 8)).flatmap(
        lambda tags: st.tuples(st.just(tags[0]), _msgpack_values, _msgpack_values)
    )
    | _msgpack_values
)
def test_decode_structured_garbage_raises_only_decode_error(obj: object) -> None:
    """Well-formed msgpack of the right kinds of values, in wrong shapes: deeper than random
    bytes get."""
    body = _pack(obj)
    try:
        message = decode(body)
    except DecodeError:
        return
    assert decode(encode(message)) == message


@settings(max_examples=40, deadline=None)
@given(messages, st.data())
def test_mutated_valid_body_raises_only_decode_error(message: object, data: st.DataObject) -> None:
    body = bytearray(encode(message))  # type: ignore[arg-type]
    index = data.draw(st.integers(0, len(body) - 1))
    body[index] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(body))
    except DecodeError:
        pass


# --- hostile bodies -----------------------------------------------------------------------------

_unpickled: list[str] = []


def _record_unpickling(tag: str) -> str:
    _unpickled.append(tag)
    return tag


class _Trap:
    def __reduce__(self) -> tuple:
        return (_record_unpickling, ("unpickled!",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_body_is_rejected_never_unpickled(protocol: int) -> None:
    body = pickle.dumps({"payload": _Trap(), "tag": 1}, protocol=protocol)
    with pytest.raises(DecodeError) as info:
        decode(body)
    assert info.value.reason in {"msgpack", "too_long", "type"}
    assert _unpickled == []


@pytest.mark.parametrize(
    "body",
    [
        b"\xdd\xff\xff\xff\xff" + b"\x00" * 16,  # array32: 4G items
        b"\xdf\xff\xff\xff\xff" + b"\x00" * 16,  # map32: 4G pairs
        b"\xdb\xff\xff\xff\xff" + b"\x00" * 16,  # str32: 4 GB
        b"\xc6\xff\xff\xff\xff" + b"\x00" * 16,  # bin32: 4 GB
        b"\xc9\xff\xff\xff\xff\x01" + b"\x00" * 16,  # ext32: 4 GB
        b"\x93\x01\x01\xdd\xff\xff\xff\xff" + b"\x00" * 16,  # nested array32
    ],
    ids=lambda b: b.hex()[:16],
)
def test_huge_length_claims_rejected_without_allocation(body: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError):
            decode(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_oversized_body_rejected_before_parsing() -> None:
    body = _pack((5, ((1, 1, 1),) * 60)) + b"\x00" * (16 << 20)  # 16 MiB
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError) as info:
            decode(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.reason == "too_long"
    assert peak < 64 * 1024


def test_encode_cache_is_bounded_and_keyed_by_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "ENCODE_CACHE_SIZE", 3)
    codec._encode_cache.clear()
    updates = tuple(Alive(i, i) for i in range(10))
    body = encode(Gossip(updates))
    assert len(codec._encode_cache) <= 3
    assert encode(Gossip(updates)) == body  # hits and misses give the same bytes
    equal_but_new = tuple(Alive(i, i) for i in range(10))
    assert encode(Gossip(equal_but_new)) == body
    codec._encode_cache.clear()


def test_invalid_update_is_never_cached() -> None:
    bad = Alive(-1, 0)
    for _ in range(2):
        with pytest.raises(ValueError):
            encode(Gossip((bad,)))
    assert all(entry[0] is not bad for entry in codec._encode_cache.values())


@settings(max_examples=300, deadline=None)
@given(messages)
def test_encoded_size_equals_the_encoded_length(message: object) -> None:
    assert encoded_size(message) == len(codec.encode(message))
