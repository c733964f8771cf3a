"""Exact encoded sizes of messages, computed without encoding.

``encoded_size(m) == len(codec.encode(m))`` for every valid message (a test checks it over
generated messages). The simulator counts every datagram's bytes at 16k members; this arithmetic
is several times cheaper than building the msgpack body.
"""

from __future__ import annotations

from typing import Final

from .codec import MAX_BODY_BYTES, SEGMENT_BYTES
from .messages import (
    Accept,
    Ack,
    Alert,
    Cut,
    Dead,
    Digest,
    Gossip,
    Join,
    Joiner,
    Message,
    Nack,
    Ping,
    PingReq,
    Prepare,
    Progress,
    Promise,
    SyncState,
    Update,
    Vote,
)
from .seal import OVERHEAD_BYTES
from .wire import DEFAULT_MAX_DATAGRAM_BYTES

# The classes tested for every datagram, as Final aliases: the compiled build reads them from C
# statics instead of looking each name up in the module dict on every test.
_PING: Final = Ping
_ACK: Final = Ack
_GOSSIP: Final = Gossip
_ALERT: Final = Alert
_DEAD: Final = Dead


def _uint_size(x: int) -> int:
    # msgpack's smallest encoding of a non-negative int: fixint, uint8, 16, 32, 64.
    if x < 128:
        return 1
    if x >= 4294967296:  # member ids, nearly always: one comparison of a 64-bit int, not four
        return 9
    if x < 256:
        return 2
    if x < 65536:
        return 3
    return 5


def _int_size(x: int) -> int:
    # msgpack's smallest encoding of any int: negative fixint (-32..-1), int8, 16, 32, 64.
    if x >= 0:
        return _uint_size(x)
    if x >= -32:
        return 1
    if x >= -128:
        return 2
    if x >= -32768:
        return 3
    return 5 if x >= -2147483648 else 9


def _str_size(s: str) -> int:
    # fixstr (under 32 bytes), str8, str16, str32: header plus the UTF-8 bytes.
    n = len(s.encode("utf-8"))
    return n + (1 if n < 32 else 2 if n < 256 else 3 if n < 65536 else 5)


def _bin_size(n: int) -> int:
    # bin8, bin16, bin32: header plus the bytes (there is no fixbin).
    return n + (2 if n < 256 else 3 if n < 65536 else 5)


def _array_header_size(n: int) -> int:
    return 1 if n < 16 else 3 if n < 65536 else 5


def array_header_size(items: int) -> int:
    """Bytes of the header of a msgpack array of ``items`` items (fixarray, array16, 32)."""
    return _array_header_size(items)


def _updates_size(updates: tuple[Update, ...]) -> int:
    if not updates:
        return 1  # most probes and acks carry none
    size = _array_header_size(len(updates))
    for u in updates:
        if isinstance(u, _ALERT):
            size += (2 + _uint_size(u.observer) + _uint_size(u.subject)
                     + _uint_size(u.incarnation) + (1 if u.silent else 0))
        elif isinstance(u, _DEAD):
            size += 2 + _uint_size(u.member) + _uint_size(u.incarnation) + _uint_size(u.confirmer)
        else:
            size += 2 + _uint_size(u.member) + _uint_size(u.incarnation)
    return size


def _joiner_size(j: Joiner) -> int:
    return (1 + _uint_size(j.member) + _str_size(j.host) + _uint_size(j.port)
            + _str_size(j.topology.host) + _str_size(j.topology.domain))


def _cut_size(cut: Cut) -> int:
    size = 1 + _array_header_size(len(cut.removed)) + _array_header_size(len(cut.joined))
    for member in cut.removed:
        size += _uint_size(member)
    for joiner in cut.joined:
        size += _joiner_size(joiner)
    return size


def encoded_size(message: Message) -> int:
    """``len(encode(message))`` in bytes for a valid message. It does not validate: call it on
    messages the core built. Raises ValueError for something that is not a message."""
    # The frequent classes first, by identity: in pure Python an isinstance miss costs a walk
    # of __instancecheck__ (compiled, both are a pointer compare).
    if type(message) is _PING or type(message) is _ACK:
        return 2 + _uint_size(message.seq) + _updates_size(message.updates)
    if type(message) is _GOSSIP:
        return 2 + _updates_size(message.updates)
    if isinstance(message, PingReq):
        return (2 + _uint_size(message.seq) + _uint_size(message.target)
                + _updates_size(message.updates))
    if isinstance(message, Nack):
        return 2 + _uint_size(message.seq) + _uint_size(message.target)
    if isinstance(message, Digest):
        return (2 + _uint_size(message.config_id) + _uint_size(message.digest)
                + _uint_size(message.entries))
    if isinstance(message, SyncState):
        return (3 + _uint_size(message.config_id) + _uint_size(message.page)
                + _uint_size(message.pages) + _updates_size(message.entries))
    if isinstance(message, Vote):
        return (2 + _uint_size(message.config_id) + _uint_size(message.round)
                + _cut_size(message.cut) + _uint_size(message.segment)
                + _bin_size(len(message.bits)) + _int_size(message.max_step))
    if isinstance(message, Prepare):
        return 2 + _uint_size(message.config_id) + _uint_size(message.round)
    if isinstance(message, Promise):
        return (2 + _uint_size(message.config_id) + _uint_size(message.round)
                + _int_size(message.voted_round)
                + (1 if message.cut is None else _cut_size(message.cut)))
    if isinstance(message, Accept):
        return (2 + _uint_size(message.config_id) + _uint_size(message.round)
                + _cut_size(message.cut))
    if isinstance(message, Join):
        return 2 + _joiner_size(message.joiner) + _uint_size(message.config_id)
    if isinstance(message, Progress):
        return (2 + _uint_size(message.config_id) + _uint_size(message.segment)
                + _bin_size(len(message.bits)) + _int_size(message.max_step))
    raise ValueError(f"not a message: {message!r}")


_VOTE_FIELDS_BYTES: Final = 27
"""A :class:`Vote`'s bytes besides its cut and its bits, every field at its widest: array 1 +
tag 1 + config_id 9 + round 5 + segment 2 + max_step 9. A ``Promise`` (21) and an ``Accept``
(16) carry a cut with less."""


def cut_size(cut: Cut) -> int:
    """``len(msgpack.packb(codec.to_array(Accept(0, 0, cut))[3]))``: the bytes ``cut`` takes
    in any agreement message."""
    return _cut_size(cut)


def joiner_size(joiner: Joiner) -> int:
    """Bytes ``joiner`` adds to a cut (or to a :class:`Join`)."""
    return _joiner_size(joiner)


def cut_budget(members: int, max_datagram_bytes: int = DEFAULT_MAX_DATAGRAM_BYTES) -> int:
    """The most bytes a cut proposed for a configuration of ``members`` may take, so that every
    agreement message carrying it (the largest is a :class:`Vote` with a full bitmap segment
    of that configuration) fits one sealed datagram of ``max_datagram_bytes`` (default: the
    1,400 bytes of :data:`~.wire.DEFAULT_MAX_DATAGRAM_BYTES`): 1,329 bytes at 64 members,
    1,080 (:data:`~.codec.MAX_CUT_BYTES`) from 2,048 on. Every member computes the same
    budget for the same configuration, so members that see the same joiners propose the same
    cut. Never over :data:`~.codec.MAX_BODY_BYTES`, whatever the datagram.

    Raises:
        ValueError: ``members`` is below 1, or the datagram leaves no room for a cut.
    """
    if members < 1:
        raise ValueError(f"a configuration has at least one member, got {members}")
    segment = min(SEGMENT_BYTES, (members + 7) // 8)
    fixed = _VOTE_FIELDS_BYTES + _bin_size(segment)
    budget = min(max_datagram_bytes - OVERHEAD_BYTES, MAX_BODY_BYTES) - fixed
    if budget < 3:  # array 1 + two empty arrays
        raise ValueError(f"a {max_datagram_bytes}-byte datagram leaves no room for a cut")
    return budget
