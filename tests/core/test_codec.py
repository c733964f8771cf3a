"""The msgpack codec: exact round trips, a pinned wire format, and total rejection of bad bodies.

Why one file of this size: its sections (round trips, refusals, hostile bodies, limits, sizes)
share the message strategies and the pinned wire bytes, and each walks every message kind.
"""

from __future__ import annotations

import pickle
import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.strategies import MESSAGE_STRATEGIES, messages
from torchpass_p2p.core import codec
from torchpass_p2p.core import messages as messages_module
from torchpass_p2p.core.codec import (
    MAX_BODY_BYTES,
    MAX_CUT_BYTES,
    MAX_CUT_JOINED,
    MAX_CUT_REMOVED,
    MAX_LABEL_BYTES,
    MAX_PORT,
    MAX_SEGMENT,
    MAX_STEP,
    MAX_SYNC_ENTRIES,
    MAX_U32,
    MAX_UPDATES,
    MESSAGE_TAGS,
    SEGMENT_BYTES,
    UPDATE_TAGS,
    DecodeError,
    decode,
    encode,
)
from torchpass_p2p.core.messages import (
    MAX_INCARNATION,
    MAX_MEMBER_ID,
    Accept,
    Ack,
    Alert,
    Alive,
    Cut,
    Dead,
    Digest,
    Gossip,
    Join,
    Joiner,
    Left,
    Message,
    Nack,
    Ping,
    PingReq,
    Prepare,
    Progress,
    Promise,
    SyncState,
    Topology,
    Vote,
)
from torchpass_p2p.core.seal import OVERHEAD_BYTES
from torchpass_p2p.core.sizes import encoded_size
from torchpass_p2p.core.wire import DEFAULT_MAX_DATAGRAM_BYTES

_COMPILED_MESSAGES = not messages_module.__file__.endswith(".py")
"""True when scripts/build-native compiled the message classes."""

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
    cut = getattr(decoded, "cut", None)
    if cut is not None:
        assert type(cut) is Cut and all(type(m) is int for m in cut.removed)
        assert all(type(j) is Joiner and type(j.topology) is Topology for j in cut.joined)
    if isinstance(decoded, Vote):
        assert type(decoded.bits) is bytes


def test_tag_tables_cover_every_class() -> None:
    assert MESSAGE_TAGS == {
        Ping: 1, PingReq: 2, Ack: 3, Nack: 4, Gossip: 5, Digest: 6, SyncState: 7,
        Vote: 8, Prepare: 9, Promise: 10, Accept: 11, Join: 12, Progress: 13,
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
        (Gossip((Alert(1, 2, 3, True),)), "92 05 91 95 02 01 02 03 c3"),
        (Digest(1, 2, 3), "94 06 01 02 03"),
        (SyncState(1, 0, 1, (), True), "96 07 01 00 01 90 c3"),
        (Nack(0, MAX_MEMBER_ID), "93 04 00 cf ff ff ff ff ff ff ff ff"),
        (Vote(1, 0, Cut((5,)), 2, b"\x0f", -1), "97 08 01 00 92 91 05 90 02 c4 01 0f ff"),
        (Vote(1, 1, Cut(), 0, b"", 300), "97 08 01 01 92 90 90 00 c4 00 cd 01 2c"),
        (Prepare(3, 1), "93 09 03 01"),
        (Promise(3, 2, -1, None), "95 0a 03 02 ff c0"),
        (Promise(3, 2, 1, Cut((4, 9))), "95 0a 03 02 01 92 92 04 09 90"),
        (
            Accept(3, 2, Cut((), (Joiner(7, "h", 9000, Topology("n1", "\u00e9")),))),
            "94 0b 03 02 92 90 91 95 07 a1 68 cd 23 28 a2 6e 31 a2 c3 a9",
        ),
        (Join(Joiner(7, "10.0.0.1", 1), 3), "93 0c 95 07 a8 31 30 2e 30 2e 30 2e 31 01 a0 a0 03"),
        (Progress(3, 1, b"\x01\x80", 1000), "95 0d 03 01 c4 02 01 80 cd 03 e8"),
        (Progress(3, 0, b"", -1), "95 0d 03 00 c4 00 ff"),
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
    assert len(_pack((3, MAX_MEMBER_ID, MAX_INCARNATION, MAX_MEMBER_ID))) == 25
    silent = Alert(MAX_MEMBER_ID, MAX_MEMBER_ID, MAX_INCARNATION, True)
    assert len(_pack(codec._update_array(silent))) == codec.MAX_UPDATE_BYTES
    hostile = SyncState(MAX_MEMBER_ID, 65535, 65535, (silent,) * MAX_SYNC_ENTRIES, False)
    assert len(encode(hostile)) == 1685 <= MAX_BODY_BYTES and decode(encode(hostile)) == hostile
    assert len(encode(sync)) == 1621  # the figure in codec.MAX_BODY_BYTES's comment
    assert len(encode(gossip)) < len(encode(sync)) <= MAX_BODY_BYTES
    assert decode(encode(sync)) == sync
    assert decode(encode(gossip)) == gossip
    # The largest agreement body a member sends: the second figure in codec.MAX_BODY_BYTES's
    # comment, a vote whose cut takes its whole budget (codec.MAX_CUT_BYTES) beside a full
    # segment, sealed to exactly the default datagram.
    vote = Vote(MAX_MEMBER_ID, MAX_U32, _LARGEST_CUT, MAX_SEGMENT, b"\xff" * SEGMENT_BYTES,
                MAX_STEP)
    assert len(msgpack.packb(codec.to_array(Accept(0, 0, _LARGEST_CUT))[3])) == MAX_CUT_BYTES
    assert len(encode(vote)) == 1366 <= MAX_BODY_BYTES
    assert len(encode(vote)) + OVERHEAD_BYTES == DEFAULT_MAX_DATAGRAM_BYTES
    assert decode(encode(vote)) == vote
    for message in (Accept(MAX_MEMBER_ID, MAX_U32, _LARGEST_CUT),
                    Promise(MAX_MEMBER_ID, MAX_U32, MAX_U32, _LARGEST_CUT)):
        assert len(encode(message)) < len(encode(vote))
        assert decode(encode(message)) == message


def test_a_cut_over_the_body_limit_encodes_nowhere() -> None:
    # 64 joiners (the array bound) with the longest labels take 13.5 kB: no member proposes
    # such a cut (its budget binds first), and encode refuses it as decode would.
    joined = tuple(Joiner(i, _LONGEST_LABEL, MAX_PORT, Topology(_LONGEST_LABEL, _LONGEST_LABEL))
                   for i in range(1, MAX_CUT_JOINED + 1))
    with pytest.raises(ValueError, match="exceeds the body limit of 2048"):
        encode(Accept(1, 1, Cut((), joined)))
    body = msgpack.packb(codec.to_array(Accept(1, 1, Cut((), joined))))
    with pytest.raises(DecodeError) as info:
        decode(body)
    assert info.value.reason == "too_long"
    # As many of those joiners as fit 2,048 bytes still encode and decode (sent by TCP): 10
    # of 203 bytes (array 1, member 1, host 66, port 3, labels 66 + 66), with array 1, tag 1,
    # config_id 1, round 1 and the cut's three array headers.
    fits = Accept(1, 1, Cut((), joined[:10]))
    assert len(encode(fits)) == 4 + 3 + 10 * 203 <= MAX_BODY_BYTES
    assert decode(encode(fits)) == fits
    with pytest.raises(ValueError, match="Accept of 2240 bytes"):
        encode(Accept(1, 1, Cut((), joined[:11])))


_LONGEST_LABEL = "x" * MAX_LABEL_BYTES
_LARGEST_CUT = Cut(
    tuple(range(MAX_MEMBER_ID - MAX_CUT_REMOVED + 1, MAX_MEMBER_ID + 1)),
    (
        *(Joiner(MAX_MEMBER_ID - 4 + i, _LONGEST_LABEL, MAX_PORT,
                 Topology(_LONGEST_LABEL, _LONGEST_LABEL)) for i in range(1, 4)),
        # 32 removals (291 bytes) and three joiners of 211 leave 154 bytes of the budget.
        Joiner(MAX_MEMBER_ID, _LONGEST_LABEL, MAX_PORT, Topology(_LONGEST_LABEL, "x" * 8)),
    ),
)
"""A cut that takes exactly its budget, :data:`codec.MAX_CUT_BYTES`, at every width's widest."""


# --- encode refuses what decode would refuse (local misuse) -------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        'Ping(-1)',
        'Ping(1 << 32)',
        'Ping(1.0)',
        'Ping(1, [Alive(1, 1)])',
        'Ping(1, (Alive(1, 1),) * (MAX_UPDATES + 1))',
        'Ping(1, ("not an update",))',
        'PingReq(1, 1 << 64)',
        'Nack(1, -1)',
        'Gossip((Alive(-1, 0),))',
        'Gossip((Alive(1, 1 << 32),))',
        'Gossip((Alert(1, 1 << 64, 0),))',
        'Gossip((Alert(1, 2, 0, 1),))',  # silent is a bool
        'Gossip((Left(1, None),))',
        'Digest(1 << 64, 0, 0)',
        'Digest(0, 0, 1 << 32)',
        'SyncState(0, 65536, 1, ())',
        'SyncState(0, 0, -1, ())',
        'SyncState(0, 0, 1, (), 1)',
        'SyncState(0, 0, 1, (Alive(1, 1),) * (MAX_SYNC_ENTRIES + 1))',
        '"not a message"',
        'Vote(1, 0, Cut(), 0, bytearray(1))',  # bits must be bytes
        'Vote(1, 0, Cut(), 0, "ab")',
        'Vote(1, 0, Cut(), 0, b"", 1.0)',
        'Vote(1, 0, (), 0, b"")',  # a tuple is not a Cut
        'Vote(1, 0, None, 0, b"")',
        'Promise(1, 0, 0, None)',  # voted without a cut
        'Promise(1, 0, -1, Cut())',  # a cut but never voted
        'Accept(1, 0, Cut([1]))',  # removed must be a tuple
        'Accept(1, 0, Cut((), [JOINER]))',
        'Accept(1, 0, Cut((2, 1)))',  # not strictly increasing
        'Accept(1, 0, Cut((1, 1)))',
        'Accept(1, 0, Cut((True,)))',
        'Accept(1, 0, Cut((), (JOINER, JOINER)))',
        'Accept(1, 0, Cut((), ((7, "h", 1, "", ""),)))',  # a tuple is not a Joiner
        'Join(Joiner(7, "h", 1, ("", "")), 1)',  # a tuple is not a Topology
        'Join(Joiner(7, b"h", 1), 1)',
        'Join(Joiner(7, "h", 1, Topology(None)), 1)',
        'Join(Joiner(7, "\\ud800", 1), 1)',  # a lone surrogate has no UTF-8 spelling
        'Join(Joiner(7, "h", 1, Topology("", "\\udfff")), 1)',
        'Join(JOINER, -1)',
        'Prepare(None, 0)',
        'Progress(1, 0, bytearray(1))',
        'Progress(1, -1, b"")',
        'Progress(1, 0, b"", -2)',
    ],
)
def test_encode_rejects_invalid_messages(source: str) -> None:
    # Compiled message classes refuse a wrong type already when built (TypeError); in pure
    # Python the encoder refuses it. Either way nothing reaches the wire.
    namespace = {**globals(), "MAX_UPDATES": MAX_UPDATES, "MAX_SYNC_ENTRIES": MAX_SYNC_ENTRIES,
                 "JOINER": Joiner(7, "h", 1)}
    try:
        message = eval(source, namespace)
    except TypeError:
        assert _COMPILED_MESSAGES
        return
    with pytest.raises(ValueError):
        encode(message)


@pytest.mark.parametrize(
    ("source", "stored"),
    [
        ("Ping(True)", Ping(1)),
        ("Gossip((Dead(1, 0, False),))", Gossip((Dead(1, 0, 0),))),
        ('Vote(1, 0, Cut(), 0, b"", True)', Vote(1, 0, Cut(), 0, b"", 1)),
        ('Join(Joiner(7, "h", True), 1)', Join(Joiner(7, "h", 1), 1)),
        ("Prepare(1, True)", Prepare(1, 1)),
    ],
)
def test_a_bool_for_an_int_field_is_refused_or_stored_as_that_int(source: str,
                                                                   stored: Message) -> None:
    message = eval(source)
    if not _COMPILED_MESSAGES:
        with pytest.raises(ValueError):
            encode(message)
        return
    # mypyc stores the bool as the int it equals: the message is then a valid one.
    assert message == stored
    assert decode(encode(message)) == stored


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
        (b"\xa1a", "type"),  # a string where the message array belongs
        (b"\xd9\x41" + b"a" * 65, "too_long"),  # any string over MAX_LABEL_BYTES
        (b"\xc5\x01\x01" + b"\x00" * 257, "too_long"),  # any binary over SEGMENT_BYTES
        (b"\xa2\xff\xfe", "utf8"),  # any string that is not UTF-8, wherever it sits
        (b"\x93\x01\x01\x91\xa1\x80", "utf8"),
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
        (_pack((1, 1, ((2, 1, 2, 0, False),))), "type"),  # a plain alert has no fifth element
        (_pack((1, 1, ((2, 1, 2, 0, 1),))), "type"),
        (_pack((1, 1, ((2, 1, 2, 0, True, True),))), "shape"),
        (_pack((1, 1, ((2, 1, 2, -1, True),))), "range"),
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
        (_pack((1, "1", ())), "type"),  # strings and binaries only where the tables put them
        (_pack((1, b"1", ())), "type"),
        (_pack((5, ("ab",))), "type"),
        (_pack((6, 1, 2, None)), "type"),
        (_pack((1, None, ())), "type"),
        (_pack((8, 1, 0, ((), ()), 0, "ab", -1)), "type"),  # bits: a string, not a binary
        (_pack((8, 1, 0, ((), ()), 0, None, -1)), "type"),
        (_pack((8, 1, 0, ((), ()), 0, b"", None)), "type"),
        (_pack((8, 1, 0, ((), ()), 0, b"", 1.0)), "type"),
        (_pack((8, 1, 0, ((), ()), True, b"", -1)), "type"),
        (_pack((8, 1, 0, None, 0, b"", -1)), "type"),  # nil only in Promise.cut
        (_pack((8, 1, 0, 5, 0, b"", -1)), "type"),
        (_pack((8, 1, 0, ((), ()), 0, b"")), "shape"),
        (_pack((8, 1, 0, ((), ()), 0, b"", -1, 0)), "shape"),
        (_pack((8, 1, 0, ((),), 0, b"", -1)), "shape"),
        (_pack((8, 1, 0, ((), (), ()), 0, b"", -1)), "shape"),
        (_pack((8, 1, 0, (5, ()), 0, b"", -1)), "type"),
        (_pack((8, 1, 0, ((), 5), 0, b"", -1)), "type"),
        (_pack((8, 1, 0, (("a",), ()), 0, b"", -1)), "type"),
        (_pack((8, 1, 0, ((), (5,)), 0, b"", -1)), "type"),
        (_pack((9, 1)), "shape"),
        (_pack((9, 1, 2, 3)), "shape"),
        (_pack((9, -1, 0)), "range"),
        (_pack((9, 1.0, 0)), "type"),
        (_pack((10, 1, 0, -1)), "shape"),
        (_pack((10, 1, 0, False, None)), "type"),
        (_pack((10, 1, 0, 0, None)), "mismatch"),  # voted in round 0 but no cut
        (_pack((10, 1, 0, 5, None)), "mismatch"),
        (_pack((10, 1, 0, -1, ((), ()))), "mismatch"),  # a cut but never voted
        (_pack((10, 1, 0, -1, 0)), "type"),
        (_pack((11, 1, 0, None)), "type"),
        (_pack((11, 1, 0)), "shape"),
        (_pack((12, (7, "h", 1, "", ""))), "shape"),
        (_pack((12, None, 1)), "type"),
        (_pack((12, 7, 1)), "type"),
        (_pack((12, (7, "h", 1, ""), 1)), "shape"),
        (_pack((12, (7, "h", 1, "", "", ""), 1)), "shape"),
        (_pack((12, (7, b"h", 1, "", ""), 1)), "type"),  # host: a binary, not a string
        (_pack((12, (7, "h", 1, b"", ""), 1)), "type"),
        (_pack((12, (7, "h", 1, "", None), 1)), "type"),
        (_pack((12, (7, "h", "1", "", ""), 1)), "type"),
        (_pack((12, (7, "h", True, "", ""), 1)), "type"),
        (_pack((12, ("7", "h", 1, "", ""), 1)), "type"),
        (_pack((12, (7, "h", 1, "", ""), -1)), "range"),
        (_pack((13, 1, 0, b"")), "shape"),
        (_pack((13, 1, 0, "", -1)), "type"),
        (_pack((13, 1, 0, None, -1)), "type"),
        (_pack((13, 1, 0, b"", False)), "type"),
        (_pack((14, 1)), "unknown_tag"),
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


_REASONS = {
    "too_long", "msgpack", "utf8", "shape", "type", "unknown_tag", "range", "order", "mismatch",
}  # fmt: skip
"""Every reason DecodeError documents."""


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=MAX_BODY_BYTES + 16))
def test_decode_random_bytes_raises_only_decode_error(body: bytes) -> None:
    try:
        message = decode(body)
    except DecodeError as exc:
        assert exc.reason in _REASONS
    else:
        assert decode(encode(message)) == message


_msgpack_values = st.recursive(
    st.one_of(
        st.integers(-(1 << 63), (1 << 64) - 1),
        st.integers(0, 8),
        st.booleans(),
        st.none(),
        st.floats(allow_nan=False),
        st.text(max_size=3),
        st.binary(max_size=3),
    ),
    lambda inner: st.lists(inner, max_size=6).map(tuple),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(
    st.tuples(st.integers(0, 13), st.integers(0, 8)).flatmap(
        lambda tags: st.tuples(st.just(tags[0]), _msgpack_values, _msgpack_values)
    )
    | st.integers(8, 12).flatmap(
        lambda tag: st.lists(_msgpack_values, min_size=1, max_size=7).map(lambda v: (tag, *v))
    )
    | _msgpack_values
)
def test_decode_structured_garbage_raises_only_decode_error(obj: object) -> None:
    """Well-formed msgpack of the right kinds of values, in wrong shapes: deeper than random
    bytes get."""
    body = _pack(obj)
    try:
        message = decode(body)
    except DecodeError as exc:
        assert exc.reason in _REASONS
        return
    assert decode(encode(message)) == message


@settings(max_examples=150, deadline=None)
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


# --- agreement messages: every limit at its boundary --------------------------------------------


def _wire_joiner(j: Joiner) -> tuple:
    return (j.member, j.host, j.port, j.topology.host, j.topology.domain)


def _wire_cut(c: Cut) -> tuple:
    return (tuple(c.removed), tuple(_wire_joiner(j) for j in c.joined))


def _wire(m: object) -> tuple:
    """The module table's layout of an agreement message, written out again without any check:
    pins the format independently of ``to_array``, and builds bodies that break one limit."""
    if isinstance(m, Vote):
        return (8, m.config_id, m.round, _wire_cut(m.cut), m.segment, m.bits, m.max_step)
    if isinstance(m, Prepare):
        return (9, m.config_id, m.round)
    if isinstance(m, Promise):
        cut = None if m.cut is None else _wire_cut(m.cut)
        return (10, m.config_id, m.round, m.voted_round, cut)
    if isinstance(m, Accept):
        return (11, m.config_id, m.round, _wire_cut(m.cut))
    if isinstance(m, Join):
        return (12, _wire_joiner(m.joiner), m.config_id)
    assert isinstance(m, Progress)
    return (13, m.config_id, m.segment, m.bits, m.max_step)


@FAST
@given(st.one_of(*(MESSAGE_STRATEGIES[c] for c in (Vote, Prepare, Promise, Accept, Join,
                                                    Progress))))
def test_agreement_layout_matches_the_module_table(message: object) -> None:
    assert encode(message) == _pack(_wire(message))  # type: ignore[arg-type]


def _joiner(member: int = 7, host: str = "h", port: int = 9000, topology_host: str = "",
            topology_domain: str = "") -> Joiner:
    return Joiner(member, host, port, Topology(topology_host, topology_domain))


_NO_CHANGE = Cut()


def _vote(cut: Cut = _NO_CHANGE, segment: int = 0, bits: bytes = b"", max_step: int = -1) -> Vote:
    return Vote(1, 0, cut, segment, bits, max_step)


_IDS = tuple(range(1, MAX_CUT_REMOVED + 1))
_JOINERS = tuple(_joiner(member=i) for i in range(1, MAX_CUT_JOINED + 1))
_E_ACUTE = "\u00e9"  # 2 UTF-8 bytes
_EMOJI = "\U0001f600"  # 4 UTF-8 bytes

# (message exactly at a limit, the same message one step past it, the reason for the latter)
_BOUNDARIES = {
    "round_max": (Prepare(1, MAX_U32), Prepare(1, MAX_U32 + 1), "range"),
    "round_min": (Prepare(1, 0), Prepare(1, -1), "range"),
    "config_id_min": (Accept(0, 0, Cut()), Accept(-1, 0, Cut()), "range"),
    "voted_round_max": (Promise(1, 2, MAX_U32, Cut()), Promise(1, 2, MAX_U32 + 1, Cut()), "range"),
    "voted_round_min": (Promise(1, 2, -1, None), Promise(1, 2, -2, None), "range"),
    "voted_round_min_with_cut": (Promise(1, 2, 0, Cut()), Promise(1, 2, -2, Cut()), "range"),
    "max_step_max": (_vote(max_step=MAX_STEP), _vote(max_step=MAX_STEP + 1), "range"),
    "max_step_min": (_vote(max_step=-1), _vote(max_step=-2), "range"),
    "segment_max": (_vote(segment=MAX_SEGMENT), _vote(segment=MAX_SEGMENT + 1), "range"),
    "segment_min": (_vote(segment=0), _vote(segment=-1), "range"),
    "bits": (
        _vote(bits=b"\x5a" * SEGMENT_BYTES), _vote(bits=b"\x5a" * (SEGMENT_BYTES + 1)), "too_long"
    ),
    "removed_count": (
        _vote(cut=Cut(_IDS)), _vote(cut=Cut(_IDS + (MAX_CUT_REMOVED + 1,))), "too_long"
    ),
    "removed_id_min": (Accept(1, 0, Cut((0,))), Accept(1, 0, Cut((-1,))), "range"),
    "joined_count": (
        Accept(1, 0, Cut((), _JOINERS)),
        Accept(1, 0, Cut((), (*_JOINERS, _joiner(member=MAX_CUT_JOINED + 1)))),
        "too_long",
    ),
    "joiner_member_min": (Join(_joiner(member=0), 1), Join(_joiner(member=-1), 1), "range"),
    "port_max": (Join(_joiner(port=MAX_PORT), 1), Join(_joiner(port=MAX_PORT + 1), 1), "range"),
    "port_min": (Join(_joiner(port=1), 1), Join(_joiner(port=0), 1), "range"),
    "host_min": (Join(_joiner(host="h"), 1), Join(_joiner(host=""), 1), "range"),
    "host_ascii": (
        Join(_joiner(host="x" * MAX_LABEL_BYTES), 1),
        Join(_joiner(host="x" * (MAX_LABEL_BYTES + 1)), 1),
        "too_long",
    ),
    "host_2_byte": (  # 32 characters are 64 bytes; one more byte is over, whatever the count
        Join(_joiner(host=_E_ACUTE * (MAX_LABEL_BYTES // 2)), 1),
        Join(_joiner(host=_E_ACUTE * (MAX_LABEL_BYTES // 2) + "x"), 1),
        "too_long",
    ),
    "host_4_byte": (
        Join(_joiner(host=_EMOJI * (MAX_LABEL_BYTES // 4)), 1),
        Join(_joiner(host=_EMOJI * (MAX_LABEL_BYTES // 4) + "x"), 1),
        "too_long",
    ),
    "topology_host": (
        Join(_joiner(topology_host="x" * MAX_LABEL_BYTES), 1),
        Join(_joiner(topology_host="x" * (MAX_LABEL_BYTES + 1)), 1),
        "too_long",
    ),
    "topology_domain": (
        Accept(1, 0, Cut((), (_joiner(topology_domain=_E_ACUTE * (MAX_LABEL_BYTES // 2)),))),
        Accept(1, 0, Cut((), (_joiner(topology_domain=_E_ACUTE * 33),))),
        "too_long",
    ),
    "config_id_max": (Join(_joiner(), MAX_MEMBER_ID), Join(_joiner(), -1), "range"),
    "progress_segment": (
        Progress(1, MAX_SEGMENT, b""), Progress(1, MAX_SEGMENT + 1, b""), "range"
    ),
    "progress_bits": (
        Progress(1, 0, b"\xa5" * SEGMENT_BYTES), Progress(1, 0, b"\xa5" * (SEGMENT_BYTES + 1)),
        "too_long",
    ),
    "progress_step_max": (
        Progress(1, 0, b"", MAX_STEP), Progress(1, 0, b"", MAX_STEP + 1), "range"
    ),
    "progress_step_min": (Progress(1, 0, b"", -1), Progress(1, 0, b"", -2), "range"),
}


@pytest.mark.parametrize(("at_limit", "over", "reason"), _BOUNDARIES.values(), ids=_BOUNDARIES)
def test_agreement_limit_boundaries(at_limit: object, over: object, reason: str) -> None:
    body = encode(at_limit)  # type: ignore[arg-type]
    assert body == _pack(_wire(at_limit))
    assert decode(body) == at_limit
    with pytest.raises(ValueError):  # local misuse when we build it
        encode(over)  # type: ignore[arg-type]
    with pytest.raises(DecodeError) as info:  # a peer's fault when it arrives
        decode(_pack(_wire(over)))
    assert info.value.reason == reason


def test_empty_labels_are_unknown_topology_and_accepted() -> None:
    message = Join(Joiner(1, "h", 1, Topology("", "")), 0)
    assert decode(encode(message)) == message


# --- strings must be UTF-8 ----------------------------------------------------------------------

_NOT_UTF8 = {
    "invalid_start": b"\xff",
    "continuation_alone": b"\x80",
    "truncated_sequence": b"\xe2\x82",
    "overlong_slash": b"\xc0\xaf",
    "overlong_nul": b"\xe0\x80\x80",
    "surrogate_d800": b"\xed\xa0\x80",
    "above_10ffff": b"\xf4\x90\x80\x80",
    "latin1": "h\u00f4te".encode("latin-1"),
}


def _raw_str_body(host: bytes, topology_host: bytes = b"", topology_domain: bytes = b"") -> bytes:
    # use_bin_type=False packs bytes as the msgpack string type, whatever they hold.
    return msgpack.packb((12, (7, host, 9000, topology_host, topology_domain), 1),
                         use_bin_type=False)


@pytest.mark.parametrize("position", range(3), ids=["host", "topology_host", "topology_domain"])
@pytest.mark.parametrize("bad", _NOT_UTF8.values(), ids=_NOT_UTF8)
def test_non_utf8_strings_rejected(bad: bytes, position: int) -> None:
    labels = [b"h", b"", b""]
    labels[position] = b"ok" + bad
    with pytest.raises(DecodeError) as info:
        decode(_raw_str_body(*labels))
    assert info.value.reason == "utf8"


def test_utf8_strings_from_any_plane_accepted() -> None:
    host = "\u00e9\u20ac\U0001f600\u0000"  # 2, 3, 4 bytes, and NUL (valid UTF-8)
    body = _raw_str_body(host.encode(), "\u6771\u4eac".encode(), b"nvl-0")
    assert decode(body) == Join(Joiner(7, host, 9000, Topology("\u6771\u4eac", "nvl-0")), 1)


# --- cuts have one canonical form ---------------------------------------------------------------

_NON_CANONICAL = {
    "removed_descending": ((2, 1), ()),
    "removed_repeated": ((1, 1), ()),
    "removed_last_pair": ((*_IDS[:-2], _IDS[-1], _IDS[-2]), ()),
    "joined_descending": ((), (_joiner(member=9), _joiner(member=3))),
    "joined_repeated": ((), (_joiner(member=5, host="a"), _joiner(member=5, host="b"))),
    "joined_repeated_identical": ((), (_joiner(member=5), _joiner(member=5))),
}


@pytest.mark.parametrize("container", ["vote", "promise", "accept"])
@pytest.mark.parametrize(("removed", "joined"), _NON_CANONICAL.values(), ids=_NON_CANONICAL)
def test_non_canonical_cuts_rejected(removed: tuple, joined: tuple, container: str) -> None:
    cut = Cut(removed, joined)
    message = {"vote": _vote(cut=cut), "promise": Promise(1, 2, 1, cut),
               "accept": Accept(1, 2, cut)}[container]
    with pytest.raises(ValueError, match="strictly increasing"):
        encode(message)
    with pytest.raises(DecodeError) as info:
        decode(_pack(_wire(message)))
    assert info.value.reason == "order"


@FAST
@given(st.data())
def test_equal_cuts_have_equal_bytes(data: st.DataObject) -> None:
    """Canonical form: the one accepted spelling of a set of removals and joiners is sorted, so
    votes for the same cut are byte-identical however their senders gathered it."""
    cut = data.draw(MESSAGE_STRATEGIES[Accept]).cut
    removed = data.draw(st.permutations(cut.removed))
    joined = data.draw(st.permutations(cut.joined))
    rebuilt = Cut(tuple(sorted(removed)), tuple(sorted(joined, key=lambda j: j.member)))
    assert encode(Accept(1, 2, rebuilt)) == encode(Accept(1, 2, cut))
    if tuple(removed) != cut.removed or tuple(joined) != cut.joined:
        with pytest.raises(DecodeError) as info:
            decode(_pack(_wire(Accept(1, 2, Cut(tuple(removed), tuple(joined))))))
        assert info.value.reason == "order"


# --- encoded_size at every msgpack width change -------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        *(Join(_joiner(host="x" * n, topology_host="y" * n), 1) for n in (1, 31, 32, 63, 64)),
        *(_vote(bits=b"\x01" * n) for n in (0, 1, 255, 256)),
        *(_vote(max_step=s) for s in (-1, 0, 127, 128, 255, 256, 65535, 65536, MAX_STEP)),
        *(_vote(segment=s) for s in (0, 127, 128, MAX_SEGMENT)),
        *(_vote(cut=Cut(_IDS[:n])) for n in (0, 15, 16, MAX_CUT_REMOVED)),
        *(Promise(1, 2, v, None if v < 0 else Cut()) for v in (-1, 0, 128, MAX_U32)),
        Accept(MAX_MEMBER_ID, MAX_U32, _LARGEST_CUT),
    ],
    ids=lambda m: type(m).__name__,
)
def test_encoded_size_at_width_changes(message: object) -> None:
    assert encoded_size(message) == len(encode(message))  # type: ignore[arg-type]
