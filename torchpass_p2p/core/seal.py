"""AEAD sealing of datagrams: ChaCha20-Poly1305 (RFC 8439), a keyring, and a replay window.

Datagram layout (big-endian)::

    offset  size  field
    0       1     version       (VERSION = 1)
    1       1     key_id        (Keyring.key_id of the sealing key)
    2       8     sender        (member id, uint64)
    10      4     incarnation   (the sender's incarnation, uint32)
    14      4     counter       (per-sender datagram counter, uint32)
    18      n     ciphertext    (ChaCha20-Poly1305 of the body; n = body bytes)
    18+n    16    tag           (Poly1305)

* **Nonce** (12 bytes) = ``sender`` (8) || ``counter`` (4). It never repeats under one key: a
  member id belongs to one process start only (docs/design.md section 2) and its counter only grows.
  When the counter would wrap, :meth:`Sealer.seal` raises ``OverflowError``: the process must
  restart under a new member id (at 1,000 datagrams/s that is after 49 days).
* **Associated data** = the cluster name (UTF-8) || the 18-byte header. A datagram of another
  cluster, or with any header bit changed, fails authentication. The header has a fixed length
  and comes last, so the concatenation is unambiguous.
* **Replay window** per sender (RFC 4303 section 3.4.3, RFC 6479): the highest incarnation and
  counter seen and a :data:`REPLAY_WINDOW`-bit bitmap of the counters below it. Only a datagram
  that authenticated moves the window, so forgeries cannot shift it.

Local misuse (bad key length, clashing key ids, counter exhaustion, a shrinking incarnation)
raises; a peer's bad datagram raises :class:`OpenError`, which the caller counts and drops.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

VERSION = 1
"""Datagram format version; a receiver drops any other."""
HEADER = struct.Struct(">BBQII")
HEADER_BYTES = HEADER.size  # 18
TAG_BYTES = 16
"""Poly1305 tag length (RFC 8439)."""
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES  # 34
KEY_BYTES = 32
"""ChaCha20-Poly1305 key length (RFC 8439)."""
MAX_U64 = (1 << 64) - 1
MAX_U32 = (1 << 32) - 1
MAX_COUNTER = MAX_U32

REPLAY_WINDOW = 1024
"""Counters accepted out of order below the highest one seen, per sender. A member sends at
most a few hundred datagrams a second and UDP reorders within milliseconds, so 1,024 is ample;
RFC 6479 uses windows of this order for IPsec at far higher rates."""
_WINDOW_MASK = (1 << REPLAY_WINDOW) - 1

DEFAULT_MAX_SENDERS = 1 << 17
"""Senders whose replay window is kept (least recently heard ones are evicted first). 131,072 is
above the largest job in docs/design.md section 1 (100k GPUs plus spares), so a real cluster never
evicts; only keyed senders get an entry, so the bound is against a key holder cycling member
ids. About 350 bytes an entry (measured): 46 MB at the bound. An evicted sender's window
restarts empty: its datagrams from before the eviction would be accepted once more."""

_NONCE = struct.Struct(">QI")
_U64 = struct.Struct(">Q")
_KEY_ID_PERSON = b"torchpass-keyid"


def key_id(key: bytes) -> int:
    """The 1-byte id of ``key``: first byte of its BLAKE2b-64 (personalised). Public: it is sent
    in clear and reveals nothing useful about a 256-bit random key."""
    return hashlib.blake2b(key, digest_size=8, person=_KEY_ID_PERSON).digest()[0]


class Keyring:
    """The cluster keys: ``primary`` seals, ``primary`` and every ``accepted`` key open.

    Keys are 32 random bytes. Rotation: give every member the new key as accepted, then make it
    primary everywhere, then drop the old one; a spare that was offline meanwhile still opens
    what its peers send as long as its ring accepts their primary.

    Raises ``ValueError`` for a key that is not 32 bytes, or for two different keys with the
    same 1-byte id (odds 1/256 per pair: generate another key). The same key listed twice is
    kept once.
    """

    __slots__ = ("primary_id", "_ciphers", "_keys")

    def __init__(self, primary: bytes, accepted: Sequence[bytes] = ()) -> None:
        if isinstance(accepted, (bytes, bytearray)):
            raise ValueError("accepted must be a sequence of keys, not one key")
        keys: dict[int, bytes] = {}
        for key in (primary, *accepted):
            if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
                raise ValueError(f"a cluster key must be {KEY_BYTES} bytes")
            key = bytes(key)
            kid = key_id(key)
            known = keys.get(kid)
            if known is not None:
                if known != key:
                    raise ValueError(f"two keys share key id {kid}; generate another key")
                continue
            keys[kid] = key
        self._open_with(keys, key_id(bytes(primary)))

    def _open_with(self, keys: dict[int, bytes], primary_id: int) -> None:
        self._keys = keys
        # One cipher object per key, reused: building it costs more than sealing a datagram.
        self._ciphers: list[ChaCha20Poly1305 | None] = [None] * 256
        for kid, key in keys.items():
            self._ciphers[kid] = ChaCha20Poly1305(key)
        self.primary_id = primary_id
        """Key id of the primary key."""

    @property
    def key_ids(self) -> tuple[int, ...]:
        """Ids of every key that opens, the primary first."""
        return (self.primary_id, *(k for k in self._keys if k != self.primary_id))

    def derive(self, label: bytes) -> Keyring:
        """The keyring of sub-keys for another use of the same cluster key (HKDF-SHA256, RFC
        5869, ``info=label``), with the same primary and accepted keys.

        Each channel that seals with its own counters (datagrams, TCP frames, state transfer)
        needs its own key: two sealers under one key would repeat (sender, counter) nonces,
        which breaks ChaCha20-Poly1305 outright.

        Each sub-key keeps its cluster key's id, which every holder derives alike: ids of the
        sub-keys' own bytes could collide (1 in 256 per pair of keys and label), which the
        distinct ids of the cluster keys do not rule out.
        """
        ring = Keyring.__new__(Keyring)
        ring._open_with({kid: _hkdf(key, label) for kid, key in self._keys.items()},
                        self.primary_id)
        return ring

    def derive_secrets(self, label: bytes) -> dict[int, bytes]:
        """Key id of each cluster key -> 32 bytes derived from it for ``label`` (HKDF-SHA256):
        what another channel with its own MAC keys (state transfer) verifies with, so it can
        follow the same key rotation without holding the cluster keys themselves."""
        return {kid: _hkdf(key, label) for kid, key in self._keys.items()}

    def derive_secret(self, label: bytes) -> bytes:
        """32 bytes derived from the primary key for ``label`` (HKDF-SHA256): a shared secret
        every holder of the cluster key computes alike, e.g. a bearer token for local HTTP."""
        return _hkdf(self._keys[self.primary_id], label)

    def cipher(self, kid: int) -> ChaCha20Poly1305 | None:
        """The cipher of key id ``kid`` (0..255), or ``None`` if no key has that id."""
        return self._ciphers[kid]

    def __repr__(self) -> str:  # never print key bytes
        return f"Keyring(primary_id={self.primary_id}, key_ids={self.key_ids})"


def _hkdf(key: bytes, label: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=label).derive(key)


class OpenError(ValueError):
    """A datagram that does not open. ``reason``: ``too_short``, ``bad_version``,
    ``unknown_key``, ``stale_incarnation``, ``replay``, ``auth_failed`` or ``from_self``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Sealer:
    """Seals bodies as datagrams from ``sender`` with the keyring's primary key.

    ``counter`` is the next datagram counter; it starts at 0 and grows by one per datagram.
    """

    __slots__ = ("_ad_prefix", "_keyring", "sender", "counter", "_incarnation")

    def __init__(self, cluster: str, keyring: Keyring, sender: int) -> None:
        if type(sender) is not int or not 0 <= sender <= MAX_U64:
            raise ValueError(f"member id must be a uint64, got {sender!r}")
        self._ad_prefix = cluster.encode("utf-8")
        self._keyring = keyring
        self.sender = sender
        self.counter = 0
        self._incarnation = 0

    def rekey(self, keyring: Keyring) -> None:
        """Seal with ``keyring`` from now on (a reloaded key file); the counter runs on, so no
        nonce repeats under a key both keyrings hold."""
        self._keyring = keyring

    def seal(self, body: bytes, incarnation: int, to: int | None = None,
             kid: int | None = None) -> bytes:
        """The datagram carrying ``body``: ``OVERHEAD_BYTES`` (34) longer than ``body``.

        ``to``: the receiver's member id, bound into the associated data (not sent), for a
        receiver whose :class:`Opener` has ``bind_receiver``: then a copy replayed to another
        member fails authentication there (each receiver keeps its own replay window, so a
        counter one member saw is new to the next).

        ``kid``: seal under that key of the keyring instead of the primary (a peer still on a
        key this ring accepts; ``None``, or an id the ring lacks: the primary). The nonce stays
        unique: it is the sender and its one counter, whatever the key.

        Raises ``OverflowError`` once 2**32 datagrams were sealed (restart with a new member
        id), ``ValueError`` if ``incarnation`` is not a uint32 or is below an earlier one (the
        receivers would drop it as stale).
        """
        counter = self.counter
        if counter > MAX_COUNTER:
            raise OverflowError("datagram counter exhausted: restart under a new member id")
        if type(incarnation) is not int or not self._incarnation <= incarnation <= MAX_U32:
            raise ValueError(f"incarnation {incarnation!r} is not a uint32 >= {self._incarnation}")
        self._incarnation = incarnation
        keyring = self._keyring
        cipher = None if kid is None else keyring.cipher(kid)
        if cipher is None:
            kid = keyring.primary_id
            cipher = keyring.cipher(kid)
        assert cipher is not None and kid is not None
        header = HEADER.pack(VERSION, kid, self.sender, incarnation, counter)
        self.counter = counter + 1
        sealed = cipher.encrypt(
            _NONCE.pack(self.sender, counter), body,
            self._ad_prefix + header if to is None else self._ad_prefix + header + _U64.pack(to)
        )
        return header + sealed


class ReplayWindow:
    """Per-sender replay state: ``[incarnation, top counter, bitmap]``, bit ``d`` of the bitmap
    meaning counter ``top - d`` was seen. At most ``max_senders`` senders, least recently
    committed evicted first (an evicted sender's window restarts empty).

    A sender's counter runs on across its incarnations (the nonce must never repeat), so one
    sliding window per sender covers every (member id, incarnation): a datagram sealed before a
    refutation but delivered after it is still accepted once, while anything older than the
    window or seen before is dropped. A datagram whose counter is ahead of the window but whose
    incarnation is below one already seen cannot come from an honest sender and is dropped as
    ``stale_incarnation``.

    Use :meth:`check` before authenticating and :meth:`commit` only after, with the same values.
    """

    __slots__ = ("_senders", "max_senders")

    def __init__(self, max_senders: int = DEFAULT_MAX_SENDERS) -> None:
        if max_senders < 1:
            raise ValueError("max_senders must be >= 1")
        self.max_senders = max_senders
        self._senders: OrderedDict[int, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._senders)

    def check(self, sender: int, incarnation: int, counter: int) -> str | None:
        """``None`` if the datagram is new, else the reason to drop it: ``replay`` (counter
        seen, or below the window) or ``stale_incarnation`` (newer counter, older incarnation)."""
        state = self._senders.get(sender)
        if state is None:
            return None
        seen_incarnation, top, bits = state
        if counter > top:
            return "stale_incarnation" if incarnation < seen_incarnation else None
        behind = top - counter
        if behind >= REPLAY_WINDOW or (bits >> behind) & 1:
            return "replay"
        return None

    def commit(self, sender: int, incarnation: int, counter: int) -> None:
        """Record an authenticated datagram that passed :meth:`check`."""
        senders = self._senders
        state = senders.get(sender)
        if state is None:
            if len(senders) >= self.max_senders:
                senders.popitem(last=False)
            senders[sender] = [incarnation, counter, 1]
            return
        senders.move_to_end(sender)
        if incarnation > state[0]:
            state[0] = incarnation
        top = state[1]
        if counter > top:
            shift = counter - top
            # Never shift by a huge amount: counters are 32-bit, bitmaps must stay 1,024 bits.
            state[2] = ((state[2] << shift) | 1) & _WINDOW_MASK if shift < REPLAY_WINDOW else 1
            state[1] = counter
        else:
            state[2] |= 1 << (top - counter)


class Opener:
    """Opens datagrams sealed by any member of ``cluster`` under a key ``keyring`` accepts.

    ``local_member``, if given, is this process's own id: datagrams claiming it as sender are
    dropped (``from_self``: a reflected datagram of ours). With ``bind_receiver`` only datagrams
    sealed ``to`` this member open (:meth:`Sealer.seal`); it needs ``local_member``, or
    ``receiver``: the uint64 bound instead (e.g. a tag naming the request a reply answers).
    """

    __slots__ = ("_ad_prefix", "_keyring", "_local", "_ad_suffix", "window")

    def __init__(
        self,
        cluster: str,
        keyring: Keyring,
        local_member: int | None = None,
        max_senders: int = DEFAULT_MAX_SENDERS,
        *,
        bind_receiver: bool = False,
        receiver: int | None = None,
    ) -> None:
        bound = local_member if receiver is None else receiver
        if bind_receiver and bound is None:
            raise ValueError("bind_receiver needs local_member or receiver")
        self._ad_prefix = cluster.encode("utf-8")
        self._keyring = keyring
        self._local = local_member
        self._ad_suffix = _U64.pack(bound) if bind_receiver else b""
        self.window = ReplayWindow(max_senders)

    def rekey(self, keyring: Keyring) -> None:
        """Open under ``keyring`` from now on (a reloaded key file). The replay window is kept:
        a datagram seen under the old keys is still a replay under the new ones."""
        self._keyring = keyring

    def open(self, data: bytes) -> tuple[int, int, bytes]:
        """``(sender, incarnation, body)`` of the datagram ``data`` (bytes).

        Raises :class:`OpenError` for a datagram that is too short, of another version, sealed
        under an unknown key, from ourselves, replayed or stale, or that fails authentication.
        The replay window moves only when this returns.
        """
        if len(data) < OVERHEAD_BYTES:
            raise OpenError("too_short")
        version, kid, sender, incarnation, counter = HEADER.unpack_from(data)
        if version != VERSION:
            raise OpenError("bad_version")
        cipher = self._keyring.cipher(kid)
        if cipher is None:
            raise OpenError("unknown_key")
        if sender == self._local:
            raise OpenError("from_self")
        window = self.window
        # Checked before decrypting (cheap drop of replays), committed only after.
        reason = window.check(sender, incarnation, counter)
        if reason is not None:
            raise OpenError(reason)
        header = data[:HEADER_BYTES]
        try:
            body = cipher.decrypt(
                _NONCE.pack(sender, counter), data[HEADER_BYTES:],
                self._ad_prefix + header + self._ad_suffix
            )
        except InvalidTag:
            raise OpenError("auth_failed") from None
        window.commit(sender, incarnation, counter)
        return sender, incarnation, body
