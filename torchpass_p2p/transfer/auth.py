"""Who may serve and read state: a mutual challenge-response on the cluster key.

Sub-keys: each cluster key gives a 32-byte transfer key by HKDF-SHA256 with info
``b"torchpass transfer v1"`` (the datagram key itself is never used here). Keys are looked up
by the cluster key's 1-byte id (``core.seal.key_id``), so a keyring rotation works as for
datagrams: the client proves its primary key, the server accepts any key of its ring.

Handshake (tags are keyed BLAKE3-256 under the transfer key ``K``)::

    C -> S  hello      key_id, Nc (32 random bytes), config_id, transfer_id
    S -> C  challenge  Ns (32 random bytes), MAC_K("server" | Nc | Ns | config_id | tid)
    C -> S  proof      MAC_K("client" | Nc | Ns | config_id | tid)
    S -> C  ready      (or error: auth_failed / stale_config)

Each side proves the key over a nonce the other just drew, so a recorded handshake replayed to
either side fails; ``config_id`` and ``transfer_id`` are bound into both tags. The connection's
session key, which keys every chunk and manifest tag, is
``MAC_K("session" | Nc | Ns | config_id | tid)``: fresh per connection. Under it, the manifest
frame carries the snapshot's chunk-MAC key (wrapped) and every chunk its MAC (``chunkmac``).

The stream is authenticated, not encrypted: an eavesdropper on the fabric can read tensor
bytes; only key holders can request them or inject bytes a receiver accepts.
"""

from __future__ import annotations

import hmac
import os
import struct
from collections.abc import Callable, Sequence

import blake3
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from torchpass_p2p.core.seal import KEY_BYTES, Keyring, key_id

from .errors import PeerError, Refused
from .frames import Conn, encode_frame, field

INFO = b"torchpass transfer v1"
NONCE_BYTES = 32
TRANSFER_ID_BYTES = 16
VERSION = 3
"""Of the transfer protocol (``frames``); 2: chunk MACs over every byte (``chunkmac``); 3: chunk
requests that skip bytes the receiver holds, and ``keepalive``."""


def derive(key: bytes) -> bytes:
    """The 32-byte transfer key of a 32-byte cluster key (HKDF-SHA256, info ``INFO``)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=INFO).derive(key)


class TransferKeys:
    """Derived transfer keys: ``primary`` proves, every key (primary and accepted) verifies.

    One object is shared by a member's server and client; :meth:`rekey` swaps its keys in place
    (a reloaded key file) as one assignment, so a handshake on another thread sees the old
    keys or the new ones, never a mix.

    Raises ``ValueError`` for a key that is not 32 bytes."""

    __slots__ = ("_state",)

    def __init__(self, primary: bytes, accepted: Sequence[bytes] = ()) -> None:
        keys: dict[int, bytes] = {}
        for k in (primary, *accepted):
            if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
                raise ValueError(f"a cluster key must be {KEY_BYTES} bytes")
            keys.setdefault(key_id(bytes(k)), derive(bytes(k)))
        self._state: tuple[int, dict[int, bytes]] = (key_id(bytes(primary)), keys)

    @classmethod
    def from_keyring(cls, keyring: Keyring) -> TransferKeys:
        """The transfer keys of a cluster ``Keyring`` (derived there, same ``INFO``)."""
        keys = cls.__new__(cls)
        keys.rekey(keyring)
        return keys

    def rekey(self, keyring: Keyring) -> None:
        """Prove and verify under ``keyring``'s keys from now on (class docstring)."""
        self._state = (keyring.primary_id, keyring.derive_secrets(INFO))

    @property
    def primary_id(self) -> int:
        return self._state[0]

    def get(self, kid: int) -> bytes | None:
        return self._state[1].get(kid)

    @property
    def primary(self) -> bytes:
        return self.proving()[1]

    def proving(self) -> tuple[int, bytes]:
        """``(primary_id, primary)`` of one state (the two properties read apart could straddle
        a :meth:`rekey`)."""
        primary_id, keys = self._state
        return primary_id, keys[primary_id]

    def __repr__(self) -> str:
        return f"TransferKeys(primary_id={self.primary_id}, key_ids={sorted(self._state[1])})"


def _mac(key: bytes, label: bytes, nc: bytes, ns: bytes, config_id: int, tid: bytes) -> bytes:
    return blake3.blake3(label + nc + ns + struct.pack(">Q", config_id) + tid,
                         key=key).digest()


async def client_handshake(conn: Conn, keys: TransferKeys, config_id: int,
                           transfer_id: bytes) -> tuple[bytes, int]:
    """Run the client side on ``conn``. Returns ``(session_key, server_config_id)``.

    Raises :class:`Refused` with the server's reason (``unknown_key``, ``auth_failed``,
    ``stale_config``...) or :class:`PeerError` ``server_auth_failed`` when the server does not
    prove the key, ``bad_frame`` / ``closed`` / ``frame_too_large`` for garbage. The caller
    bounds the time."""
    nc = os.urandom(NONCE_BYTES)
    kid, k = keys.proving()
    await conn.send(encode_frame("hello", v=VERSION, key_id=kid, nonce=nc,
                                 config_id=config_id, transfer_id=transfer_id))
    msg = await conn.read_frame()
    if msg["op"] == "error":
        raise Refused.of(msg)
    if msg["op"] != "challenge":
        raise PeerError("bad_frame", f"expected challenge, got {msg['op']!r}")
    ns = field(msg, "nonce", bytes, NONCE_BYTES)
    tag = field(msg, "tag", bytes, 32)
    if not hmac.compare_digest(tag, _mac(k, b"server", nc, ns, config_id, transfer_id)):
        raise PeerError("server_auth_failed", "the server did not prove the cluster key")
    await conn.send(encode_frame("proof", tag=_mac(k, b"client", nc, ns, config_id,
                                                   transfer_id)))
    msg = await conn.read_frame()
    if msg["op"] == "error":
        raise Refused.of(msg)
    if msg["op"] != "ready":
        raise PeerError("bad_frame", f"expected ready, got {msg['op']!r}")
    server_config = field(msg, "config_id", int)
    return _mac(k, b"session", nc, ns, config_id, transfer_id), server_config


async def server_handshake(conn: Conn, keys: TransferKeys, current_config_id: int,
                           on_challenge: Callable[[], object] | None = None,
                           ) -> tuple[bytes, bytes, int]:
    """Run the server side. Returns ``(session_key, transfer_id, client_config_id)``.
    ``on_challenge``, if given, is called once the challenge is sent (the next move is the
    client's: the server ranks handshakes it may drop by how long they have waited since).

    Raises :class:`PeerError` with the reason to count (``bad_frame``, ``bad_version``,
    ``unknown_key``, ``auth_failed``, ``stale_config``, ...) after sending the client an
    ``error`` frame where one is due."""
    msg = await conn.read_frame()
    if msg["op"] != "hello":
        raise PeerError("bad_frame", f"expected hello, got {msg['op']!r}")
    if msg.get("v") != VERSION:
        await _refuse(conn, "bad_version")
    kid = field(msg, "key_id", int)
    nc = field(msg, "nonce", bytes, NONCE_BYTES)
    config_id = field(msg, "config_id", int)
    tid = field(msg, "transfer_id", bytes, TRANSFER_ID_BYTES)
    k = keys.get(kid) if kid < 256 else None
    if k is None:
        await _refuse(conn, "unknown_key")
    assert k is not None
    ns = os.urandom(NONCE_BYTES)
    await conn.send(encode_frame("challenge", nonce=ns,
                                 tag=_mac(k, b"server", nc, ns, config_id, tid)))
    if on_challenge is not None:
        on_challenge()
    msg = await conn.read_frame()
    if msg["op"] != "proof":
        raise PeerError("bad_frame", f"expected proof, got {msg['op']!r}")
    tag = field(msg, "tag", bytes, 32)
    if not hmac.compare_digest(tag, _mac(k, b"client", nc, ns, config_id, tid)):
        await _refuse(conn, "auth_failed")
    if config_id < current_config_id:
        await _refuse(conn, "stale_config")
    await conn.send(encode_frame("ready", config_id=current_config_id))
    return _mac(k, b"session", nc, ns, config_id, tid), tid, config_id


async def _refuse(conn: Conn, reason: str) -> None:
    try:
        await conn.send(encode_frame("error", reason=reason))
    except OSError:
        pass
    raise PeerError(reason)
