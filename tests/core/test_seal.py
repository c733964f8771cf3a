"""AEAD sealing: keyring rules, datagram layout, authentication of every bit, replay window."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchpass_p2p.core.seal import (
    DEFAULT_MAX_SENDERS,
    HEADER,
    HEADER_BYTES,
    MAX_COUNTER,
    OVERHEAD_BYTES,
    REPLAY_WINDOW,
    TAG_BYTES,
    VERSION,
    Keyring,
    Opener,
    OpenError,
    ReplayWindow,
    Sealer,
    _hkdf,
    key_id,
)

KEY_A = bytes(range(32))
KEY_B = bytes(range(1, 33))
SENDER = 0x1111_2222_3333_4444
RECEIVER = 0xEEEE_DDDD_CCCC_BBBB  # differs from SENDER in many bits: no single flip maps one
CLUSTER = "job-7"


def _opener(keyring: Keyring | None = None, **kw: object) -> Opener:
    return Opener(CLUSTER, keyring or Keyring(KEY_A), RECEIVER, **kw)  # type: ignore[arg-type]


def _sealer(keyring: Keyring | None = None, cluster: str = CLUSTER) -> Sealer:
    return Sealer(cluster, keyring or Keyring(KEY_A), SENDER)


def _reason(opener: Opener, data: bytes) -> str:
    with pytest.raises(OpenError) as info:
        opener.open(data)
    return info.value.reason


# --- keyring ------------------------------------------------------------------------------------


def _colliding_keys() -> tuple[bytes, bytes]:
    """Two different keys with the same 1-byte id (found deterministically: birthday bound)."""
    seen: dict[int, bytes] = {}
    for i in range(10_000):
        key = i.to_bytes(32, "big")
        other = seen.setdefault(key_id(key), key)
        if other != key:
            return other, key
    raise AssertionError("no collision among 10,000 keys")


def test_keyring_ids_and_lookup() -> None:
    assert key_id(KEY_A) != key_id(KEY_B)  # the fixed keys below rely on it
    ring = Keyring(KEY_A, [KEY_B])
    assert ring.primary_id == key_id(KEY_A)
    assert ring.key_ids == (key_id(KEY_A), key_id(KEY_B))
    assert ring.cipher(key_id(KEY_B)) is not None
    missing = next(i for i in range(256) if i not in ring.key_ids)
    assert ring.cipher(missing) is None


@pytest.mark.parametrize(
    ("primary", "accepted"),
    [
        (b"\x00" * 31, ()),
        (b"\x00" * 33, ()),
        ("k" * 32, ()),
        (KEY_A, [b"short"]),
        (KEY_A, KEY_B),  # one key where a sequence belongs
    ],
    ids=["31", "33", "str", "short-accepted", "bare-accepted"],
)
def test_keyring_rejects_bad_keys(primary: bytes, accepted: object) -> None:
    with pytest.raises(ValueError):
        Keyring(primary, accepted)  # type: ignore[arg-type]


def test_keyring_rejects_key_id_clash_but_keeps_a_repeated_key() -> None:
    first, second = _colliding_keys()
    with pytest.raises(ValueError, match="key id"):
        Keyring(first, [second])
    assert Keyring(KEY_A, [KEY_A, KEY_B, KEY_B]).key_ids == (key_id(KEY_A), key_id(KEY_B))


def test_keyring_repr_hides_keys() -> None:
    text = repr(Keyring(KEY_A, [KEY_B]))
    assert KEY_A.hex() not in text and KEY_B.hex() not in text
    assert str(key_id(KEY_A)) in text


# --- sealing ------------------------------------------------------------------------------------


def test_datagram_layout() -> None:
    sealer = _sealer()
    first = sealer.seal(b"hello", 7)
    second = sealer.seal(b"hello", 7)
    assert len(first) == HEADER_BYTES + 5 + TAG_BYTES == 5 + OVERHEAD_BYTES
    assert HEADER.unpack_from(first) == (VERSION, key_id(KEY_A), SENDER, 7, 0)
    assert HEADER.unpack_from(second) == (VERSION, key_id(KEY_A), SENDER, 7, 1)
    assert b"hello" not in first  # encrypted, not just authenticated
    assert first[HEADER_BYTES:] != second[HEADER_BYTES:]  # fresh nonce per datagram
    assert sealer.counter == 2


def test_counter_exhaustion_raises_overflow() -> None:
    sealer = _sealer()
    sealer.counter = MAX_COUNTER
    assert HEADER.unpack_from(sealer.seal(b"", 0))[4] == MAX_COUNTER
    with pytest.raises(OverflowError):
        sealer.seal(b"", 0)
    with pytest.raises(OverflowError):  # and stays exhausted
        sealer.seal(b"", 0)


@pytest.mark.parametrize("incarnation", [-1, 1 << 32, True, 1.0])
def test_seal_rejects_bad_incarnation(incarnation: object) -> None:
    with pytest.raises(ValueError):
        _sealer().seal(b"", incarnation)  # type: ignore[arg-type]


def test_seal_rejects_a_shrinking_incarnation_without_using_a_counter() -> None:
    sealer = _sealer()
    sealer.seal(b"", 5)
    with pytest.raises(ValueError):
        sealer.seal(b"", 4)
    assert sealer.counter == 1


@pytest.mark.parametrize("sender", [-1, 1 << 64, True])
def test_sealer_rejects_bad_member_id(sender: object) -> None:
    with pytest.raises(ValueError):
        Sealer(CLUSTER, Keyring(KEY_A), sender)  # type: ignore[arg-type]


# --- opening ------------------------------------------------------------------------------------


def test_open_round_trip() -> None:
    assert _opener().open(_sealer().seal(b"body", 3)) == (SENDER, 3, b"body")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_single_bit_flip_is_rejected(data: st.DataObject) -> None:
    datagram = _sealer().seal(b"\x93\x01\x01\x90 a body of some length", 9)
    bit = data.draw(st.integers(0, len(datagram) * 8 - 1), label="bit")
    flipped = bytearray(datagram)
    flipped[bit // 8] ^= 1 << (bit % 8)
    expected = {0: "bad_version", 1: "unknown_key"}.get(bit // 8, "auth_failed")
    opener = _opener()
    assert _reason(opener, bytes(flipped)) == expected
    assert len(opener.window) == 0  # nothing that failed moved a window
    assert opener.open(datagram) == (SENDER, 9, b"\x93\x01\x01\x90 a body of some length")


def test_short_datagrams() -> None:
    datagram = _sealer().seal(b"", 0)
    assert len(datagram) == OVERHEAD_BYTES
    assert _opener().open(datagram) == (SENDER, 0, b"")
    assert _reason(_opener(), datagram[:-1]) == "too_short"
    assert _reason(_opener(), b"") == "too_short"


def test_other_cluster_name_fails_authentication() -> None:
    datagram = _sealer(cluster="job-8").seal(b"body", 0)
    assert _reason(_opener(), datagram) == "auth_failed"


def test_from_self_is_rejected() -> None:
    datagram = Sealer(CLUSTER, Keyring(KEY_A), RECEIVER).seal(b"body", 0)
    assert _reason(_opener(), datagram) == "from_self"


def test_forgery_does_not_move_the_window() -> None:
    sealer = _sealer()
    genuine = sealer.seal(b"genuine", 0)
    # A forged datagram claiming a counter far ahead, with a garbage tag.
    forged = HEADER.pack(VERSION, key_id(KEY_A), SENDER, 0, 50_000) + b"x" * 20
    opener = _opener()
    assert _reason(opener, forged) == "auth_failed"
    forged_new_incarnation = HEADER.pack(VERSION, key_id(KEY_A), SENDER, 9, 0) + b"x" * 20
    assert _reason(opener, forged_new_incarnation) == "auth_failed"
    assert opener.open(genuine) == (SENDER, 0, b"genuine")


# --- replay window ------------------------------------------------------------------------------


def test_duplicate_and_reordering_within_the_window() -> None:
    sealer, opener = _sealer(), _opener()
    d0, d1, d2 = (sealer.seal(bytes([i]), 0) for i in range(3))
    assert opener.open(d2)[2] == b"\x02"
    assert _reason(opener, d2) == "replay"
    assert opener.open(d0)[2] == b"\x00"  # late, but inside the window: accepted once
    assert opener.open(d1)[2] == b"\x01"
    assert _reason(opener, d0) == "replay"
    assert _reason(opener, d1) == "replay"


def test_window_edge() -> None:
    sealer, opener = _sealer(), _opener()
    datagrams = [sealer.seal(b"", 0) for _ in range(REPLAY_WINDOW + 2)]
    top = len(datagrams) - 1
    opener.open(datagrams[top])
    assert _reason(opener, datagrams[top - REPLAY_WINDOW]) == "replay"  # just below the window
    assert _reason(opener, datagrams[0]) == "replay"
    assert opener.open(datagrams[top - REPLAY_WINDOW + 1]) is not None  # oldest slot inside
    assert _reason(opener, datagrams[top - REPLAY_WINDOW + 1]) == "replay"


def test_incarnations() -> None:
    # Sealed before a refutation, delivered after it: accepted once (the counter runs on across
    # incarnations, so the window, not the incarnation, decides), then a replay.
    sealer, opener = _sealer(), _opener()
    old = sealer.seal(b"old", 4)
    new = sealer.seal(b"new", 5)
    assert opener.open(new) == (SENDER, 5, b"new")
    assert opener.open(old) == (SENDER, 4, b"old")
    assert _reason(opener, old) == "replay"
    assert _reason(opener, new) == "replay"
    # Never opened but older than the window: dropped although its incarnation is current.
    late = sealer.seal(b"late", 5)
    for _ in range(REPLAY_WINDOW):
        opener.open(sealer.seal(b"x", 5))
    assert _reason(opener, late) == "replay"


def test_window_unit_behaviour() -> None:
    window = ReplayWindow()
    assert window.max_senders == DEFAULT_MAX_SENDERS
    window.commit(1, 0, 10)
    assert window.check(1, 0, 10) == "replay"
    assert window.check(1, 0, 9) is None
    assert window.check(1, 0, 11) is None
    window.commit(1, 0, 10 + (1 << 31))  # a huge jump: window restarts, no giant bitmap
    assert window.check(1, 0, 10) == "replay"
    assert window.check(1, 0, 10 + (1 << 31)) == "replay"
    assert window.check(1, 0, 9 + (1 << 31)) is None
    window.commit(1, 3, 11 + (1 << 31))  # a newer incarnation moves on in the same window
    assert window.check(1, 0, 9 + (1 << 31)) is None  # older incarnation, inside the window
    assert window.check(1, 3, 11 + (1 << 31)) == "replay"
    # Ahead of the window but behind in incarnation: no honest sender does that.
    assert window.check(1, 2, 12 + (1 << 31)) == "stale_incarnation"
    with pytest.raises(ValueError):
        ReplayWindow(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3 * REPLAY_WINDOW), max_size=60))
def test_window_matches_a_reference_model(counters: list[int]) -> None:
    """Accept a counter iff never accepted before and within REPLAY_WINDOW of the highest."""
    window, accepted, top = ReplayWindow(), set(), -1
    for counter in counters:
        fresh = counter not in accepted and counter > top - REPLAY_WINDOW
        assert (window.check(7, 0, counter) is None) == fresh
        if fresh:
            window.commit(7, 0, counter)
            accepted.add(counter)
            top = max(top, counter)


def test_lru_eviction_restarts_an_evicted_senders_window() -> None:
    keyring = Keyring(KEY_A)
    opener = _opener(keyring, max_senders=2)
    a, b, c = (Sealer(CLUSTER, keyring, member) for member in (1, 2, 3))
    first_a, first_b = a.seal(b"a", 0), b.seal(b"b", 0)
    opener.open(first_a)
    opener.open(first_b)
    opener.open(a.seal(b"a2", 0))  # a is now the most recently heard
    opener.open(c.seal(b"c", 0))  # evicts b, the least recently heard
    assert len(opener.window) == 2
    assert _reason(opener, first_a) == "replay"  # a kept its window
    # b's window restarted, so its old datagram opens once more: the documented cost of the
    # bound (it takes max_senders other keyed senders to get there).
    assert opener.open(first_b) == (2, 0, b"b")
    assert _reason(opener, first_b) == "replay"


def test_derived_keyrings_differ_from_the_cluster_key_and_agree_between_holders():
    a, b = bytes(range(32)), bytes(range(1, 33))
    ring = Keyring(a, [b])
    same = Keyring(a, [b])
    stream = ring.derive(b"torchpass stream v1")
    assert stream.key_ids == ring.key_ids  # each sub-key keeps its cluster key's id
    assert stream.derive_secret(b"x") == same.derive(b"torchpass stream v1").derive_secret(b"x")
    assert ring.derive_secret(b"http") != ring.derive_secret(b"other")
    assert ring.derive_secret(b"http") not in (a, b)
    # A datagram sealed under the cluster key does not open under the derived ring.
    sealed = Sealer("c", ring, 1).seal(b"body", 0)
    with pytest.raises(OpenError):
        Opener("c", stream, 2).open(sealed)


def test_derived_keys_whose_own_ids_collide_still_make_a_keyring():
    """Two cluster keys with distinct ids whose sub-keys for a label share an id (1 in 256 per
    pair: a rotation once hit it in CI): the derived ring keeps the cluster keys' ids, and a
    datagram sealed under either sub-key opens at another holder."""
    label = b"torchpass request v1"
    a = bytes(32)
    b = next(k for k in (i.to_bytes(32, "big") for i in range(1, 1 << 16))
             if key_id(k) != key_id(a)
             and key_id(_hkdf(k, label)) == key_id(_hkdf(a, label)))
    old, new = Keyring(a, [b]).derive(label), Keyring(b, [a]).derive(label)
    assert old.key_ids == (key_id(a), key_id(b)) and new.key_ids == (key_id(b), key_id(a))
    assert Opener("c", new, 2).open(Sealer("c", old, 1).seal(b"x", 0)) == (1, 0, b"x")
    assert Opener("c", old, 2).open(Sealer("c", new, 3).seal(b"y", 0)) == (3, 0, b"y")


def test_a_receiver_bound_datagram_opens_only_at_its_receiver():
    ring = Keyring(bytes(range(32)))
    sealed = Sealer("c", ring, 1).seal(b"body", 0, to=2)
    assert Opener("c", ring, 2, bind_receiver=True).open(sealed) == (1, 0, b"body")
    with pytest.raises(OpenError) as other:
        Opener("c", ring, 3, bind_receiver=True).open(sealed)
    assert other.value.reason == "auth_failed"
    with pytest.raises(OpenError):  # nor at a receiver that does not expect a binding
        Opener("c", ring, 2).open(sealed)
    unbound = Sealer("c", ring, 1).seal(b"body", 0)
    with pytest.raises(OpenError):  # and a bound receiver refuses unbound datagrams
        Opener("c", ring, 2, bind_receiver=True).open(unbound)
    with pytest.raises(ValueError):
        Opener("c", ring, None, bind_receiver=True)
