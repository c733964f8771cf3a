"""Wire codec of the membership core: message dataclasses <-> msgpack bodies.

A body is one msgpack array ``[tag, field, ...]``; updates nest as ``[utag, field, ...]``. Only
non-negative integers, booleans and arrays ever appear: no maps, strings, binaries, floats, nil
or extension types, so the decoder can forbid all of them.

=========  ===  ==================================================================
message    tag  array
=========  ===  ==================================================================
Ping         1  ``[1, seq, updates]``
PingReq      2  ``[2, seq, target, updates]``
Ack          3  ``[3, seq, updates]``
Nack         4  ``[4, seq, target]``
Gossip       5  ``[5, updates]``
Digest       6  ``[6, config_id, digest, entries]``
SyncState    7  ``[7, config_id, page, pages, entries, reply]``
=========  ===  ==================================================================

=========  ===  ==================================================================
update     tag  array
=========  ===  ==================================================================
Alive        1  ``[1, member, incarnation]``
Alert        2  ``[2, observer, subject, incarnation]``
Dead         3  ``[3, member, incarnation, confirmer]``
Left         4  ``[4, member, incarnation]``
=========  ===  ==================================================================

Field ranges: member ids (``member``, ``observer``, ``subject``, ``confirmer``, ``target``)
uint64; ``incarnation``, ``seq`` and ``entries`` (of :class:`Digest`) uint32; ``config_id`` and
``digest`` uint64; ``page`` and ``pages`` 0..65535; ``reply`` a msgpack bool. Update lists hold
at most :data:`MAX_UPDATES` (``SyncState.entries``: :data:`MAX_SYNC_ENTRIES`) items.

Speed: an update is piggybacked on many datagrams, so both directions keep a bounded cache of
updates already validated (:data:`ENCODE_CACHE_SIZE`, :data:`UPDATE_CACHE_SIZE`); it returns
equal immutable values only and changes no result. ``python -m benchmarks.wire`` measures it.

:func:`encode` raises ``ValueError`` for a message outside these limits (local misuse: the caller
built it). :func:`decode` raises :class:`DecodeError`, and nothing else, for any body that does
not hold exactly one valid message (any msgpack width of an integer is accepted);
``decode(encode(m)) == m`` for every valid ``m``.
"""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]

from torchpass_p2p.core.messages import (
    Ack,
    Alert,
    Alive,
    Dead,
    Digest,
    Gossip,
    Left,
    Message,
    Nack,
    Ping,
    PingReq,
    SyncState,
    Update,
)

# --- the tables: part of the wire format, never change a number's meaning ------------------

MESSAGE_TAGS: dict[type, int] = {
    Ping: 1,
    PingReq: 2,
    Ack: 3,
    Nack: 4,
    Gossip: 5,
    Digest: 6,
    SyncState: 7,
}
UPDATE_TAGS: dict[type, int] = {Alive: 1, Alert: 2, Dead: 3, Left: 4}

# --- hard limits ------------------------------------------------------------------------------

MAX_U64 = (1 << 64) - 1
"""Member ids, ``config_id`` and ``digest`` are unsigned 64-bit (DESIGN section 2)."""
MAX_U32 = (1 << 32) - 1
"""Incarnations, ``seq`` and ``Digest.entries`` are unsigned 32-bit: 4e9 refutations or probes
per process start, or members per view, are far beyond any job."""
MAX_PAGE = 65535
"""``page``/``pages`` of a :class:`SyncState`: 64 entries a page times 65,535 pages covers 4.2
million entries, 40 times the largest job in DESIGN section 1."""
MAX_UPDATES = 64
"""Updates per message: what a hostile body can make a receiver build. Senders piggyback
``Params.max_piggyback`` (24); 64 of the largest updates make a 1.6 kB body, so at the default
1,400-byte datagram the sender's size check (``Wire.seal``) binds before this does."""
MAX_SYNC_ENTRIES = 64
"""Entries per :class:`SyncState` page, for the same reason as :data:`MAX_UPDATES`."""
MAX_UPDATE_BYTES = 25
"""Largest encoded update: array header 1 + tag 1 + uint64 9 + uint32 5 + uint64 9 bytes."""
MAX_BODY_BYTES = 2048
"""Largest body :func:`decode` reads. The largest valid body is a full ``SyncState``:
1 (array) + 1 (tag) + 9 + 3 + 3 + 3 (array16 header) + 64 * 25 + 1 = 1,621 bytes; anything longer
is rejected before msgpack sees it, so a hostile body costs at most this much parsing."""

# msgpack's own limits, checked while parsing and before allocating (a 4-byte length prefix can
# claim 4 GB). Arrays: no array of ours is longer than 64. Strings, binaries, maps and extension
# types never occur, so their limit is zero.
_UNPACK_LIMITS = {
    "max_bin_len": 0,
    "max_str_len": 0,
    "max_array_len": max(MAX_UPDATES, MAX_SYNC_ENTRIES),
    "max_map_len": 0,
    "max_ext_len": 0,
    "strict_map_key": True,
    "use_list": False,
    "raw": True,
}


class DecodeError(ValueError):
    """A body that no valid peer could have sent. ``reason`` is a short snake_case token:

    * ``too_long``: the body is over :data:`MAX_BODY_BYTES`, or a length prefix over its limit
      (an array over 64 items; any non-empty string, binary, map or extension value);
    * ``msgpack``: not exactly one complete msgpack value (truncated, trailing bytes, a reserved
      byte, nesting deeper than msgpack's stack);
    * ``shape``: an array of the wrong length for its tag, or empty;
    * ``type``: a value of the wrong type (``true`` or a float where an integer belongs, a map
      where an array belongs, an integer where ``reply``'s bool belongs), or ``body`` is not
      bytes-like;
    * ``unknown_tag``: a message or update tag not in the tables above (or not an integer);
    * ``range``: an integer outside its field's range.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --- encoding ---------------------------------------------------------------------------------


def _bad(name: str, value: object) -> ValueError:
    return ValueError(f"{name} out of range or not an int: {value!r}")


def _u64(name: str, value: int) -> int:
    if type(value) is not int or not 0 <= value <= MAX_U64:
        raise _bad(name, value)
    return value


def _u32(name: str, value: int) -> int:
    if type(value) is not int or not 0 <= value <= MAX_U32:
        raise _bad(name, value)
    return value


def _u(x: object, top: int) -> bool:
    """``x`` is an int (not a bool) in 0..top."""
    return type(x) is int and 0 <= x <= top  # type: ignore[operator]


def _update_array(u: Update) -> tuple[int, ...]:
    t = type(u)
    if t is Alert:
        o, s, i = u.observer, u.subject, u.incarnation  # type: ignore[union-attr]
        if _u(o, MAX_U64) and _u(s, MAX_U64) and _u(i, MAX_U32):
            return (2, o, s, i)
    elif t is Alive or t is Left:
        m, i = u.member, u.incarnation  # type: ignore[union-attr]
        if _u(m, MAX_U64) and _u(i, MAX_U32):
            return (1 if t is Alive else 4, m, i)
    elif t is Dead:
        m, i, c = u.member, u.incarnation, u.confirmer  # type: ignore[union-attr]
        if _u(m, MAX_U64) and _u(i, MAX_U32) and _u(c, MAX_U64):
            return (3, m, i, c)
    else:
        raise ValueError(f"not an update: {u!r}")
    raise ValueError(f"field out of range or not an int in {u!r}")


ENCODE_CACHE_SIZE = 4096
"""Encoded updates kept for reuse, keyed by the update object's identity. A member piggybacks
each update on many datagrams (Params.retransmit_mult), so validating it once saves most of the
encoding cost. The entry holds the object itself, so its ``id`` cannot be reused while cached;
when full the cache is cleared."""
_encode_cache: dict[int, tuple[Update, tuple[int, ...]]] = {}


def _updates_array(updates: tuple[Update, ...], limit: int) -> tuple[tuple[int, ...], ...]:
    if type(updates) is not tuple:
        raise ValueError(f"updates must be a tuple, got {type(updates).__name__}")
    if len(updates) > limit:
        raise ValueError(f"{len(updates)} updates exceed the limit of {limit}")
    cache = _encode_cache
    out = []
    for u in updates:
        entry = cache.get(id(u))
        if entry is not None and entry[0] is u:
            out.append(entry[1])
            continue
        array = _update_array(u)
        if len(cache) >= ENCODE_CACHE_SIZE:
            cache.clear()
        cache[id(u)] = (u, array)
        out.append(array)
    return tuple(out)


def to_array(message: Message) -> tuple:
    """The msgpack-ready nested tuple of ``message`` (see the module table). Raises
    ``ValueError`` for a message outside the limits."""
    if isinstance(message, (Ping, Ack)):
        return (
            1 if isinstance(message, Ping) else 3,
            _u32("seq", message.seq),
            _updates_array(message.updates, MAX_UPDATES),
        )
    if isinstance(message, PingReq):
        return (
            2,
            _u32("seq", message.seq),
            _u64("target", message.target),
            _updates_array(message.updates, MAX_UPDATES),
        )
    if isinstance(message, Nack):
        return (4, _u32("seq", message.seq), _u64("target", message.target))
    if isinstance(message, Gossip):
        return (5, _updates_array(message.updates, MAX_UPDATES))
    if isinstance(message, Digest):
        return (
            6,
            _u64("config_id", message.config_id),
            _u64("digest", message.digest),
            _u32("entries", message.entries),
        )
    if isinstance(message, SyncState):
        if type(message.reply) is not bool:
            raise ValueError(f"reply must be a bool, got {message.reply!r}")
        page, pages = message.page, message.pages
        if type(page) is not int or type(pages) is not int:
            raise ValueError("page and pages must be ints")
        if not (0 <= page <= MAX_PAGE and 0 <= pages <= MAX_PAGE):
            raise ValueError(f"page {page} / pages {pages} outside 0..{MAX_PAGE}")
        return (
            7,
            _u64("config_id", message.config_id),
            page,
            pages,
            _updates_array(message.entries, MAX_SYNC_ENTRIES),
            message.reply,
        )
    raise ValueError(f"not a message: {message!r}")


def encode(message: Message) -> bytes:
    """The msgpack body of ``message`` (at most :data:`MAX_BODY_BYTES` bytes).

    Raises ``ValueError`` if a field is out of range or of the wrong type, or a list is too long.
    """
    # packb, not a shared Packer: a Packer's buffer is not safe to share between threads.
    return msgpack.packb(to_array(message))


# --- decoding ---------------------------------------------------------------------------------
# Each decoder gets a tuple from msgpack whose first item is its tag. ``type(x) is int`` rejects
# bools (msgpack returns True/False, which are ints to ``isinstance``). msgpack never returns an
# integer above 2**64 - 1, but the upper bounds are checked anyway so the limits read in one place.

UPDATE_CACHE_SIZE = 4096
"""Decoded updates kept for reuse, keyed by their msgpack tuple. Gossip hands each update to
every member about ``retransmit_mult * log10(N + 1)`` times (Params), so most updates a member
decodes it has decoded before, and building the frozen dataclass is the costliest step of
decoding (~1 us each, 24 per full datagram). 4,096 covers the updates in flight while thousands
of members fail at once; about 1.5 MB. The cache only returns equal immutable values, so it changes
no result; when full it is cleared (amortised O(1), no ordering to maintain)."""
_update_cache: dict[tuple, Update] = {}


def _remember(key: tuple, update: Update) -> Update:
    if len(_update_cache) >= UPDATE_CACHE_SIZE:
        _update_cache.clear()
    _update_cache[key] = update
    return update


# The decoders below run when the cache (looked up in ``_dec_updates``) misses. They store only
# all-int keys that passed the range check, so a later hit on an all-int key needs no check.


def _dec_alive(a: tuple) -> Update:
    if len(a) != 3:
        raise DecodeError("shape")
    _, member, inc = a
    if type(member) is not int or type(inc) is not int:
        raise DecodeError("type")
    if not (0 <= member <= MAX_U64 and 0 <= inc <= MAX_U32):
        raise DecodeError("range")
    return _remember(a, Alive(member, inc))


def _dec_left(a: tuple) -> Update:
    if len(a) != 3:
        raise DecodeError("shape")
    _, member, inc = a
    if type(member) is not int or type(inc) is not int:
        raise DecodeError("type")
    if not (0 <= member <= MAX_U64 and 0 <= inc <= MAX_U32):
        raise DecodeError("range")
    return _remember(a, Left(member, inc))


def _dec_alert(a: tuple) -> Update:
    if len(a) != 4:
        raise DecodeError("shape")
    _, observer, subject, inc = a
    if type(observer) is not int or type(subject) is not int or type(inc) is not int:
        raise DecodeError("type")
    if not (0 <= observer <= MAX_U64 and 0 <= subject <= MAX_U64 and 0 <= inc <= MAX_U32):
        raise DecodeError("range")
    return _remember(a, Alert(observer, subject, inc))


def _dec_dead(a: tuple) -> Update:
    if len(a) != 4:
        raise DecodeError("shape")
    _, member, inc, confirmer = a
    if type(member) is not int or type(inc) is not int or type(confirmer) is not int:
        raise DecodeError("type")
    if not (0 <= member <= MAX_U64 and 0 <= inc <= MAX_U32 and 0 <= confirmer <= MAX_U64):
        raise DecodeError("range")
    return _remember(a, Dead(member, inc, confirmer))


_UPDATE_DECODERS = {1: _dec_alive, 2: _dec_alert, 3: _dec_dead, 4: _dec_left}
assert sorted(_UPDATE_DECODERS) == sorted(UPDATE_TAGS.values())


def _dec_updates(a: object, limit: int) -> tuple[Update, ...]:
    # msgpack's max_array_len already bounds every array; ``limit`` is the per-field bound.
    if type(a) is not tuple:
        raise DecodeError("type")
    if len(a) > limit:
        raise DecodeError("too_long")
    out = []
    get = _update_cache.get
    for u in a:
        if type(u) is not tuple:
            raise DecodeError("type")
        # Fast path, inlined (this loop is the hot spot of decoding): an all-int tuple seen
        # before. Types first: True == 1 and 1.0 == 1 would otherwise find a cached entry.
        n = len(u)
        if n == 3:
            t, x, y = u
            if type(t) is int and type(x) is int and type(y) is int:
                hit = get(u)
                if hit is not None:
                    out.append(hit)
                    continue
        elif n == 4:
            t, x, y, z = u
            if type(t) is int and type(x) is int and type(y) is int and type(z) is int:
                hit = get(u)
                if hit is not None:
                    out.append(hit)
                    continue
        elif not n:
            raise DecodeError("shape")
        tag = u[0]
        # ``type(tag) is int``: True and 1.0 hash like 1 and would find a decoder.
        decoder = _UPDATE_DECODERS.get(tag) if type(tag) is int else None
        if decoder is None:
            raise DecodeError("unknown_tag")
        out.append(decoder(u))
    return tuple(out)


def _ranged(x: object, top: int) -> int:
    """``x`` if it is an int (not a bool) in 0..top, else DecodeError("type"/"range")."""
    if type(x) is not int:
        raise DecodeError("type")
    if not 0 <= x <= top:  # type: ignore[operator]
        raise DecodeError("range")
    return x  # type: ignore[return-value]


def _seq(x: object) -> int:
    return _ranged(x, MAX_U32)


def _u64_field(x: object) -> int:
    return _ranged(x, MAX_U64)


def _page(x: object) -> int:
    return _ranged(x, MAX_PAGE)


def _dec_ping(a: tuple) -> Message:
    if len(a) != 3:
        raise DecodeError("shape")
    return Ping(_seq(a[1]), _dec_updates(a[2], MAX_UPDATES))


def _dec_ack(a: tuple) -> Message:
    if len(a) != 3:
        raise DecodeError("shape")
    return Ack(_seq(a[1]), _dec_updates(a[2], MAX_UPDATES))


def _dec_ping_req(a: tuple) -> Message:
    if len(a) != 4:
        raise DecodeError("shape")
    return PingReq(_seq(a[1]), _u64_field(a[2]), _dec_updates(a[3], MAX_UPDATES))


def _dec_nack(a: tuple) -> Message:
    if len(a) != 3:
        raise DecodeError("shape")
    return Nack(_seq(a[1]), _u64_field(a[2]))


def _dec_gossip(a: tuple) -> Message:
    if len(a) != 2:
        raise DecodeError("shape")
    return Gossip(_dec_updates(a[1], MAX_UPDATES))


def _dec_digest(a: tuple) -> Message:
    if len(a) != 4:
        raise DecodeError("shape")
    return Digest(_u64_field(a[1]), _u64_field(a[2]), _seq(a[3]))


def _dec_sync_state(a: tuple) -> Message:
    if len(a) != 6:
        raise DecodeError("shape")
    reply = a[5]
    if type(reply) is not bool:
        raise DecodeError("type")
    return SyncState(
        _u64_field(a[1]), _page(a[2]), _page(a[3]), _dec_updates(a[4], MAX_SYNC_ENTRIES), reply
    )


_MESSAGE_DECODERS = {
    1: _dec_ping,
    2: _dec_ping_req,
    3: _dec_ack,
    4: _dec_nack,
    5: _dec_gossip,
    6: _dec_digest,
    7: _dec_sync_state,
}
assert sorted(_MESSAGE_DECODERS) == sorted(MESSAGE_TAGS.values())


def decode(body: bytes) -> Message:
    """The message in ``body`` (bytes-like: one msgpack array, at most :data:`MAX_BODY_BYTES`
    bytes).

    Raises :class:`DecodeError` (and nothing else, whatever ``body`` is) for any body that does
    not hold exactly one valid message; its ``reason`` says which check failed.
    """
    if type(body) is bytes:
        size = len(body)
    elif isinstance(body, memoryview):
        size = body.nbytes  # len() would count items, not bytes
    elif isinstance(body, (bytes, bytearray)):
        size = len(body)
    else:
        raise DecodeError("type")
    if size > MAX_BODY_BYTES:
        raise DecodeError("too_long")
    try:
        obj = msgpack.unpackb(body, **_UNPACK_LIMITS)
    except ValueError as exc:  # every msgpack parse error subclasses ValueError
        # "N exceeds max_array_len(64)" and friends: a length prefix over our limits.
        raise DecodeError("too_long" if "exceeds max_" in str(exc) else "msgpack") from None
    except Exception:  # e.g. BufferError for an odd memoryview; never let it escape
        raise DecodeError("msgpack") from None
    if type(obj) is not tuple:
        raise DecodeError("type")
    if not obj:
        raise DecodeError("shape")
    tag = obj[0]
    decoder = _MESSAGE_DECODERS.get(tag) if type(tag) is int else None
    if decoder is None:
        raise DecodeError("unknown_tag")
    return decoder(obj)

