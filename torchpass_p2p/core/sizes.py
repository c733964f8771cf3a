"""Exact encoded sizes of messages, computed without encoding.

``encoded_size(m) == len(codec.encode(m))`` for every valid message (a test checks it over
generated messages). The simulator counts every datagram's bytes at 16k members; this arithmetic
is several times cheaper than building the msgpack body.
"""

from __future__ import annotations

from typing import Final

from .messages import (
    Ack,
    Alert,
    Dead,
    Digest,
    Gossip,
    Message,
    Nack,
    Ping,
    PingReq,
    SyncState,
    Update,
)

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


def _array_header_size(n: int) -> int:
    return 1 if n < 16 else 3 if n < 65536 else 5


def _updates_size(updates: tuple[Update, ...]) -> int:
    if not updates:
        return 1  # most probes and acks carry none
    size = _array_header_size(len(updates))
    for u in updates:
        if isinstance(u, _ALERT):
            size += 2 + _uint_size(u.observer) + _uint_size(u.subject) + _uint_size(u.incarnation)
        elif isinstance(u, _DEAD):
            size += 2 + _uint_size(u.member) + _uint_size(u.incarnation) + _uint_size(u.confirmer)
        else:
            size += 2 + _uint_size(u.member) + _uint_size(u.incarnation)
    return size


def encoded_size(message: Message) -> int:
    """``len(encode(message))`` in bytes for a valid message. It does not validate: call it on
    messages the core built. Raises ValueError for something that is not a message."""
    # Separate isinstance calls: a tuple of classes is built and walked on every call.
    if isinstance(message, _PING) or isinstance(message, _ACK):
        return 2 + _uint_size(message.seq) + _updates_size(message.updates)
    if isinstance(message, _GOSSIP):
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
    raise ValueError(f"not a message: {message!r}")
