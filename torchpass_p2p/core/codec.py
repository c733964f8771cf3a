"""Wire codec of the membership core: message dataclasses <-> msgpack bodies.

Why one module of this size: one encoder and one decoder per message type, side by side, so
that every limit is checked where the field is read and a reviewer sees both directions at once.

A body is one msgpack array ``[tag, field, ...]``; updates nest as ``[utag, field, ...]``. The
membership messages (tags 1..7) hold only non-negative integers, booleans and arrays. The
agreement messages (tags 8..13) add, in named fields only: UTF-8 strings (host names and
topology labels), binaries (``bits`` of :class:`Vote` and :class:`Progress`), nil
(``Promise.cut`` of a member that never voted) and the value -1 (``max_step``,
``voted_round``). Maps, floats and extension types never occur, so the decoder forbids them
outright, and every string or binary is bounded before it is read.

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
Vote         8  ``[8, config_id, round, cut, segment, bits, max_step]``
Prepare      9  ``[9, config_id, round]``
Promise     10  ``[10, config_id, round, voted_round, cut or nil]``
Accept      11  ``[11, config_id, round, cut]``
Join        12  ``[12, joiner, config_id]``
Progress    13  ``[13, config_id, segment, bits, max_step]``
=========  ===  ==================================================================

=========  ===  ==================================================================
update     tag  array
=========  ===  ==================================================================
Alive        1  ``[1, member, incarnation]``
Alert        2  ``[2, observer, subject, incarnation]``, ``[..., true]`` when ``silent``
Dead         3  ``[3, member, incarnation, confirmer]``
Left         4  ``[4, member, incarnation]``
=========  ===  ==================================================================

Agreement values (no tag: their place in the message says what they are)::

    cut     [removed, joined]        removed: [member, ...]  joined: [joiner, ...]
    joiner  [member, host, port, topology.host, topology.domain]

Field ranges: member ids (``member``, ``observer``, ``subject``, ``confirmer``, ``target``)
uint64; ``incarnation``, ``seq`` and ``entries`` (of :class:`Digest`) uint32; ``config_id`` and
``digest`` uint64; ``page`` and ``pages`` 0..65535; ``reply`` a msgpack bool. Update lists hold
at most :data:`MAX_UPDATES` (``SyncState.entries``: :data:`MAX_SYNC_ENTRIES`) items.

Agreement fields (:class:`Progress` shares ``segment``, ``bits`` and ``max_step`` with
:class:`Vote`): ``round`` uint32; ``voted_round`` -1..2**32-1, -1 exactly when ``cut`` is nil
(the sender never voted); ``max_step`` -1..2**63-1; ``segment`` 0..:data:`MAX_SEGMENT`; ``bits``
a binary of at most :data:`SEGMENT_BYTES`; ``port`` 1..65535; ``host`` a string of 1 to
:data:`MAX_LABEL_BYTES` UTF-8 bytes, topology labels 0 to :data:`MAX_LABEL_BYTES`. A cut's
``removed`` (at most :data:`MAX_CUT_REMOVED`) and ``joined`` (at most :data:`MAX_CUT_JOINED`)
are strictly increasing by member id: the one canonical form, so equal cuts have equal bytes
(votes for a cut are compared and counted by value) and no id appears twice.

Speed: an update is piggybacked on many datagrams, so both directions keep a bounded cache of
updates already validated (:data:`ENCODE_CACHE_SIZE`, :data:`UPDATE_CACHE_SIZE`); it returns
equal immutable values only and changes no result. ``python -m benchmarks.wire`` measures it.
Agreement messages are rare (a few per configuration change) and are not cached.

:func:`encode` raises ``ValueError`` for a message outside these limits (local misuse: the caller
built it). :func:`decode` raises :class:`DecodeError`, and nothing else, for any body that does
not hold exactly one valid message (any msgpack width of an integer is accepted);
``decode(encode(m)) == m`` for every valid ``m``.
"""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]

from torchpass_p2p.core.messages import (
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
    Update,
    Vote,
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
    Vote: 8,
    Prepare: 9,
    Promise: 10,
    Accept: 11,
    Join: 12,
    Progress: 13,
}
UPDATE_TAGS: dict[type, int] = {Alive: 1, Alert: 2, Dead: 3, Left: 4}

# --- hard limits ------------------------------------------------------------------------------

MAX_U64 = (1 << 64) - 1
"""Member ids, ``config_id`` and ``digest`` are unsigned 64-bit (docs/design.md section 2)."""
MAX_U32 = (1 << 32) - 1
"""Incarnations, ``seq`` and ``Digest.entries`` are unsigned 32-bit: 4e9 refutations or probes
per process start, or members per view, are far beyond any job."""
MAX_PAGE = 65535
"""``page``/``pages`` of a :class:`SyncState`: 64 entries a page times 65,535 pages covers 4.2
million entries, 40 times the largest job in docs/design.md section 1."""
MAX_UPDATES = 64
"""Updates per message: what a hostile body can make a receiver build. Senders piggyback
``Params.max_piggyback`` (24); 64 of the largest updates make a 1.6 kB body, so at the default
1,400-byte datagram the sender's size check (``Wire.seal``) binds before this does."""
MAX_SYNC_ENTRIES = 64
"""Entries per :class:`SyncState` page, for the same reason as :data:`MAX_UPDATES`."""
MAX_UPDATE_BYTES = 26
"""Largest encoded update, a silent :class:`Alert`: array header 1 + tag 1 + uint64 9 + uint64 9
+ uint32 5 + true 1 bytes (a :class:`Dead`, the largest entry of a view, takes 25)."""

MAX_STEP = (1 << 63) - 1
"""``Vote.max_step``: a training step, signed 64-bit like torch's own step counters; -1 means no
voter has committed a step yet."""
MAX_PORT = 65535
"""``Joiner.port``: a UDP port, 1..65535 (0 is "any port" to ``bind``, never an address)."""
MAX_LABEL_BYTES = 64
"""UTF-8 bytes of ``Joiner.host`` and of each :class:`Topology` label. An IPv6 literal is at
most 45 characters and a DNS label 63 bytes, so any address and any short host name fits; a
longer fully qualified name must be given as an address. Bounds what one joiner costs to parse
and to keep (three labels: 3 * 66 bytes on the wire)."""
SEGMENT_BYTES = 256
"""Bytes of one :class:`Vote` bitmap segment (``bits``; shorter is allowed, never longer):
2,048 members per segment, so the 16,384-member job of docs/design.md section 1 is 8 segments. A
full segment is 259 bytes on the wire, small enough that a vote with a typical cut rides in one
1,400-byte datagram, large enough that a few datagrams carry a whole configuration's votes."""
MAX_SEGMENT = 255
"""``Vote.segment``: 256 segments of 2,048 members cover 524,288 members, 32 times the
16,384-member job. Bounds the bitmap a receiver may be asked to grow to (64 KiB)."""
MAX_CUT_REMOVED = 32
"""Member ids a :class:`Cut` removes. Rapid batches concurrent failures into one cut; 32 covers
four 8-GPU hosts (a switch or a rack) failing together. More failures are decided over several
configuration changes, so a cut stays small enough to vote on (32 ids: 291 bytes)."""
MAX_CUT_JOINED = 64
"""Spares a :class:`Cut` admits, at most: msgpack's bound on every array of ours. What binds
first is the cut's size in bytes: a member proposes no cut over
:func:`~torchpass_p2p.core.sizes.cut_budget` (every agreement message carrying it fits one
datagram), and no body over :data:`MAX_BODY_BYTES` encodes or decodes. A joiner takes 7 to
211 bytes (array 1 + member 1-9 + host 2-66 + port 1-3 + two labels 1-66 each), so a
configuration change admits from 3 joiners with the longest labels beside 32 removals up to
64 (a mass restart admitted in one change, not in eight)."""
MAX_CUT_BYTES = 1080
"""Largest encoded cut a member proposes in a configuration of 2,048 members or more (smaller
ones have room for more: :func:`~torchpass_p2p.core.sizes.cut_budget`): a :class:`Vote` with
this cut and a full segment, every other field at its widest, seals to exactly the default
1,400-byte datagram: 1,400 - 34 (seal) - 286 (array 1, tag 1, config_id 9, round 5,
segment 2, bin16 bits 3 + 256, max_step 9). 32 removals take 291 bytes of it."""
MAX_BODY_BYTES = 2048
"""Largest body :func:`encode` writes and :func:`decode` reads. The largest valid body of a
membership message is a full ``SyncState``: 1 (array) + 1 (tag) + 9 + 3 + 3 + 3 (array16
header) + 64 * 25 + 1 = 1,621 bytes (1,685 with 64 silent alerts, which decode but which no
member puts in a view page). An agreement message whose cut keeps to its budget
(:data:`MAX_CUT_BYTES`) is at most 1,366 bytes (a sealed 1,400-byte datagram); a longer one,
up to this limit, goes by TCP (``agent/transport.py``). Anything longer is refused by both
sides, and rejected before msgpack sees it, so a hostile body costs at most this much
parsing."""

# msgpack's own limits, checked while parsing and before allocating (a 4-byte length prefix can
# claim 4 GB). Arrays: no array of ours is longer than 64 items. Strings are only ever labels and
# binaries only ever vote segments, so their limits are exactly those maxima (in bytes; msgpack
# checks them before decoding or copying). Maps and extension types never occur: limit zero.
# ``raw=False`` keeps strings and binaries apart (str vs bytes) and decodes strings as strict
# UTF-8: invalid sequences, overlong forms and surrogates raise UnicodeDecodeError.
_UNPACK_LIMITS = {
    "max_bin_len": SEGMENT_BYTES,
    "max_str_len": MAX_LABEL_BYTES,
    "max_array_len": max(MAX_UPDATES, MAX_SYNC_ENTRIES, MAX_CUT_REMOVED, MAX_CUT_JOINED, 7),
    "max_map_len": 0,
    "max_ext_len": 0,
    "strict_map_key": True,
    "use_list": False,
    "raw": False,
}


class DecodeError(ValueError):
    """A body that no valid peer could have sent. ``reason`` is a short snake_case token:

    * ``too_long``: the body is over :data:`MAX_BODY_BYTES`, or a length prefix over its limit
      (an array over 64 items, a string over :data:`MAX_LABEL_BYTES` bytes, a binary over
      :data:`SEGMENT_BYTES`; any non-empty map or extension value), or a list over its field's
      limit (updates, cut ids, cut joiners);
    * ``msgpack``: not exactly one complete msgpack value (truncated, trailing bytes, a reserved
      byte, nesting deeper than msgpack's stack);
    * ``utf8``: a string (anywhere in the body) that is not valid UTF-8;
    * ``shape``: an array of the wrong length for its tag, or empty;
    * ``type``: a value of the wrong type (``true`` or a float where an integer belongs, a map
      where an array belongs, an integer where ``reply``'s bool belongs, a binary where a string
      belongs or the reverse, nil anywhere but ``Promise.cut``), or ``body`` is not bytes-like;
    * ``unknown_tag``: a message or update tag not in the tables above (or not an integer);
    * ``range``: an integer outside its field's range, or an empty ``host``;
    * ``order``: a cut's ``removed`` or ``joined`` not strictly increasing by member id (out of
      order or repeated: not the canonical form);
    * ``mismatch``: a ``Promise`` whose ``cut`` is nil while ``voted_round`` is not -1, or the
      reverse.
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
            silent = u.silent  # type: ignore[union-attr]
            if silent is True:
                return (2, o, s, i, True)
            if silent is False:
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


def _signed(name: str, value: int, top: int) -> int:
    """``value`` if it is an int (not a bool) in -1..top."""
    if type(value) is not int or not -1 <= value <= top:
        raise _bad(name, value)
    return value


def _segment(value: int) -> int:
    if type(value) is not int or not 0 <= value <= MAX_SEGMENT:
        raise _bad("segment", value)
    return value


def _bits(value: bytes) -> bytes:
    if type(value) is not bytes or len(value) > SEGMENT_BYTES:
        raise ValueError(f"bits must be bytes of at most {SEGMENT_BYTES}, got {value!r}")
    return value


def _label(name: str, value: str, *, nonempty: bool = False) -> str:
    if type(value) is not str:
        raise ValueError(f"{name} must be a str, got {value!r}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 spelling
        raise ValueError(f"{name} is not valid Unicode: {value!r}") from None
    if size > MAX_LABEL_BYTES or (nonempty and not size):
        low = 1 if nonempty else 0
        raise ValueError(f"{name} is {size} UTF-8 bytes, outside {low}..{MAX_LABEL_BYTES}")
    return value


def _joiner_array(joiner: Joiner) -> tuple:
    if type(joiner) is not Joiner:
        raise ValueError(f"not a Joiner: {joiner!r}")
    topology = joiner.topology
    if type(topology) is not Topology:
        raise ValueError(f"not a Topology: {topology!r}")
    port = joiner.port
    if type(port) is not int or not 1 <= port <= MAX_PORT:
        raise _bad("port", port)
    return (
        _u64("joiner member", joiner.member),
        _label("host", joiner.host, nonempty=True),
        port,
        _label("topology.host", topology.host),
        _label("topology.domain", topology.domain),
    )


def _cut_array(cut: Cut) -> tuple:
    """``[removed, joined]``; raises ``ValueError`` unless both are tuples in canonical order."""
    if type(cut) is not Cut:
        raise ValueError(f"not a Cut: {cut!r}")
    removed, joined = cut.removed, cut.joined
    if type(removed) is not tuple or type(joined) is not tuple:
        raise ValueError("cut.removed and cut.joined must be tuples")
    if len(removed) > MAX_CUT_REMOVED or len(joined) > MAX_CUT_JOINED:
        raise ValueError(
            f"cut of {len(removed)} removed / {len(joined)} joined exceeds the limits of "
            f"{MAX_CUT_REMOVED} / {MAX_CUT_JOINED}"
        )
    previous = -1
    for member in removed:
        if _u64("removed member", member) <= previous:
            raise ValueError(f"cut.removed must be strictly increasing: {removed!r}")
        previous = member
    joiners = []
    previous = -1
    for joiner in joined:
        array = _joiner_array(joiner)
        if array[0] <= previous:
            raise ValueError("cut.joined must be strictly increasing by member id")
        previous = array[0]
        joiners.append(array)
    return (removed, tuple(joiners))


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
    if isinstance(message, Vote):
        return (
            8,
            _u64("config_id", message.config_id),
            _u32("round", message.round),
            _cut_array(message.cut),
            _segment(message.segment),
            _bits(message.bits),
            _signed("max_step", message.max_step, MAX_STEP),
        )
    if isinstance(message, Prepare):
        return (9, _u64("config_id", message.config_id), _u32("round", message.round))
    if isinstance(message, Promise):
        voted_round = _signed("voted_round", message.voted_round, MAX_U32)
        cut = message.cut
        if (cut is None) != (voted_round == -1):
            raise ValueError(f"cut must be None exactly when voted_round is -1: {message!r}")
        return (
            10,
            _u64("config_id", message.config_id),
            _u32("round", message.round),
            voted_round,
            None if cut is None else _cut_array(cut),
        )
    if isinstance(message, Accept):
        return (
            11,
            _u64("config_id", message.config_id),
            _u32("round", message.round),
            _cut_array(message.cut),
        )
    if isinstance(message, Join):
        return (12, _joiner_array(message.joiner), _u64("config_id", message.config_id))
    if isinstance(message, Progress):
        return (
            13,
            _u64("config_id", message.config_id),
            _segment(message.segment),
            _bits(message.bits),
            _signed("max_step", message.max_step, MAX_STEP),
        )
    raise ValueError(f"not a message: {message!r}")


def encode(message: Message) -> bytes:
    """The msgpack body of ``message`` (at most :data:`MAX_BODY_BYTES` bytes).

    Raises ``ValueError`` if a field is out of range or of the wrong type, a list is too long,
    or the body is over :data:`MAX_BODY_BYTES` (a cut of many joiners with long labels), for
    :func:`decode` would refuse it.
    """
    # packb, not a shared Packer: a Packer's buffer is not safe to share between threads.
    body: bytes = msgpack.packb(to_array(message))
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"{type(message).__name__} of {len(body)} bytes exceeds the body "
                         f"limit of {MAX_BODY_BYTES}")
    return body


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
    # One spelling per value: a plain alert has no fifth element, a silent one ``true``.
    if len(a) == 5:
        if a[4] is not True:
            raise DecodeError("type")
    elif len(a) != 4:
        raise DecodeError("shape")
    observer, subject, inc = a[1], a[2], a[3]
    if type(observer) is not int or type(subject) is not int or type(inc) is not int:
        raise DecodeError("type")
    if not (0 <= observer <= MAX_U64 and 0 <= subject <= MAX_U64 and 0 <= inc <= MAX_U32):
        raise DecodeError("range")
    if len(a) == 5:
        return Alert(observer, subject, inc, True)  # rare: not worth a cache slot
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


def _signed_field(x: object, top: int) -> int:
    """``x`` if it is an int (not a bool) in -1..top, else DecodeError("type"/"range")."""
    if type(x) is not int:
        raise DecodeError("type")
    if not -1 <= x <= top:  # type: ignore[operator]
        raise DecodeError("range")
    return x  # type: ignore[return-value]


def _dec_label(x: object) -> str:
    # msgpack's max_str_len (MAX_LABEL_BYTES) bounded its UTF-8 length, raw=False checked it.
    if type(x) is not str:
        raise DecodeError("type")
    return x


def _dec_joiner(a: object) -> Joiner:
    if type(a) is not tuple:
        raise DecodeError("type")
    if len(a) != 5:
        raise DecodeError("shape")
    member, host, port, topology_host, topology_domain = a
    if not _dec_label(host):
        raise DecodeError("range")
    if _ranged(port, MAX_PORT) == 0:
        raise DecodeError("range")
    return Joiner(
        _u64_field(member),
        host,
        port,  # type: ignore[arg-type]
        Topology(_dec_label(topology_host), _dec_label(topology_domain)),
    )


def _dec_cut(a: object) -> Cut:
    if type(a) is not tuple:
        raise DecodeError("type")
    if len(a) != 2:
        raise DecodeError("shape")
    removed, joined = a
    if type(removed) is not tuple or type(joined) is not tuple:
        raise DecodeError("type")
    if len(removed) > MAX_CUT_REMOVED or len(joined) > MAX_CUT_JOINED:
        raise DecodeError("too_long")
    previous = -1
    for member in removed:
        if _u64_field(member) <= previous:
            raise DecodeError("order")
        previous = member
    joiners = []
    previous = -1
    for item in joined:
        joiner = _dec_joiner(item)
        if joiner.member <= previous:
            raise DecodeError("order")
        previous = joiner.member
        joiners.append(joiner)
    return Cut(removed, tuple(joiners))


def _dec_bits(x: object) -> bytes:
    # msgpack's max_bin_len (SEGMENT_BYTES) bounded its length.
    if type(x) is not bytes:
        raise DecodeError("type")
    return x


def _dec_vote(a: tuple) -> Message:
    if len(a) != 7:
        raise DecodeError("shape")
    return Vote(
        _u64_field(a[1]),
        _seq(a[2]),
        _dec_cut(a[3]),
        _ranged(a[4], MAX_SEGMENT),
        _dec_bits(a[5]),
        _signed_field(a[6], MAX_STEP),
    )


def _dec_prepare(a: tuple) -> Message:
    if len(a) != 3:
        raise DecodeError("shape")
    return Prepare(_u64_field(a[1]), _seq(a[2]))


def _dec_promise(a: tuple) -> Message:
    if len(a) != 5:
        raise DecodeError("shape")
    config_id, round_, voted_round = _u64_field(a[1]), _seq(a[2]), _signed_field(a[3], MAX_U32)
    cut = None if a[4] is None else _dec_cut(a[4])
    if (cut is None) != (voted_round == -1):
        raise DecodeError("mismatch")
    return Promise(config_id, round_, voted_round, cut)


def _dec_accept(a: tuple) -> Message:
    if len(a) != 4:
        raise DecodeError("shape")
    return Accept(_u64_field(a[1]), _seq(a[2]), _dec_cut(a[3]))


def _dec_join(a: tuple) -> Message:
    if len(a) != 3:
        raise DecodeError("shape")
    return Join(_dec_joiner(a[1]), _u64_field(a[2]))


def _dec_progress(a: tuple) -> Message:
    if len(a) != 5:
        raise DecodeError("shape")
    return Progress(
        _u64_field(a[1]), _ranged(a[2], MAX_SEGMENT), _dec_bits(a[3]), _signed_field(a[4], MAX_STEP)
    )


_MESSAGE_DECODERS = {
    1: _dec_ping,
    2: _dec_ping_req,
    3: _dec_ack,
    4: _dec_nack,
    5: _dec_gossip,
    6: _dec_digest,
    7: _dec_sync_state,
    8: _dec_vote,
    9: _dec_prepare,
    10: _dec_promise,
    11: _dec_accept,
    12: _dec_join,
    13: _dec_progress,
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
    except UnicodeDecodeError:  # a ValueError too: must come first
        raise DecodeError("utf8") from None
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
    try:
        return decoder(obj)
    except TypeError:
        # The decoders check every field before building a message, so this is a gap in those
        # checks that the compiled message classes (scripts/build-native) caught when built.
        raise DecodeError("type") from None

