"""Per-chunk MACs of the TCP transfer: every byte of every chunk is authenticated under keys only
cluster members hold, bound to the connection, the transfer and the chunk's place.

Construction (hash-then-PRF: a keyed almost-universal hash, then a PRF over it)::

    R       = 32 random bytes, drawn by the source once per snapshot
    k_i     = BLAKE3-keyed(R, "torchpass chunk key v1" | le64(i))            (AES-256 key)
    inner_i = GMAC(k_i, chunk_i)                                                   (16 bytes)
    tag_i   = BLAKE3-keyed(S, "torchpass chunk tag v2" | tid | be64(i) | be64(offset)
                               | be64(length) | inner_i)[:16]

* **GMAC** is AES-GCM with the data as additional authenticated data and no plaintext (NIST SP
  800-38D, section 3 "GMAC"; RFC 4543 section 3 uses it the same way). IV = 12 zero bytes:
  each ``k_i`` is used on exactly one message at the source (chunk ``i`` of one snapshot).
* **S** is the connection's session key (``auth``: fresh per connection, bound to the transfer
  id ``tid`` and the configuration). Keyed BLAKE3 is a PRF, so ``tag_i`` is a PRF of (session,
  transfer, chunk index, offset, length, ``inner_i``): a chunk moved to another index, another
  transfer or another connection fails its tag.
* **R** reaches a receiver inside the authenticated manifest frame, encrypted under the session
  (``wrap_key``: XOR with a BLAKE3-keyed(S, ...) pad, one manifest per connection); an
  eavesdropper never learns it. ``inner_i`` never leaves the source or the receiver.

Why it is a MAC: GHASH under a secret uniformly random hash key is almost-XOR-universal with
epsilon = (ceil(L/16) + 1) / 2**128 for L-byte inputs (McGrew and Viega, "The Security and
Performance of the Galois/Counter Mode", 2004), so GMAC under a secret key is almost-universal;
PRF(header, AU-hash(m)) is a secure MAC (Wegman and Carter 1981; Shoup, "On Fast and Provably
Secure Message Authentication Based on Universal Hashing", CRYPTO 1996). To make the receiver
accept other bytes for chunk ``i`` an attacker must hit ``inner_i`` with bytes it chose
without knowing ``k_i``: at most ~2**-108 per try for a 16 MiB chunk, and each failed try costs
it the connection (``bad_chunk``). The inner tags are computed from the snapshot's memory when it
is first served, so a source whose bytes changed afterwards (a faulty source) is caught too;
that pass also checks the bytes against the digests computed before it (``Snapshot._scan``), so
bytes that changed between the fingerprint and the first serve are never MAC'd.

Cost (see ``benchmarks.transfer`` and the README's measurements): GMAC runs at whatever
OpenSSL's GHASH reaches on the CPU: per core, 13.7-21 GB/s on an earlier host and 6.5-7 GB/s
on an AMD EPYC without AVX-512 (``gcm_ghash_avx``), both ``cryptography`` 50 on OpenSSL 4.0.
The receiving thread feeds each 1 MiB piece to the chunk's GMAC as it lands, from cache. Where
sender and receiver share 2 cores that gave 0.97-0.99 of a plain socket's rate with the faster
GHASH, 0.7-0.8 with the slower (0.60-0.70 when a second thread checked each 16 MiB chunk after
it arrived, reading it back from memory). The source computes the inner tags once per snapshot
(~0.1-0.2 s of CPU per GB, spread over threads); serving a chunk then costs one 16-byte keyed
BLAKE3.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

import blake3
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

TAG_BYTES = 16
KEY_BYTES = 32
_KEY_LABEL = b"torchpass chunk key v1\x00"
_TAG_LABEL = b"torchpass chunk tag v2\x00"
_WRAP_LABEL = b"torchpass chunk key wrap v1\x00"
_TAG_HEAD = struct.Struct(">16sQQQ")
_ZERO_IV = bytes(12)


def new_key() -> bytes:
    """A fresh snapshot chunk-MAC key ``R`` (32 random bytes)."""
    return os.urandom(KEY_BYTES)


def chunk_key(key: bytes, index: int) -> bytes:
    """``k_i``: the 32-byte AES-256 key of chunk ``index`` under the snapshot key ``R``."""
    return blake3.blake3(_KEY_LABEL + index.to_bytes(8, "little"), key=key).digest()


class Gmac:
    """Incremental GMAC under a 16-, 24- or 32-byte AES key with a 12-byte ``iv`` (default
    zeros): ``update(buffer)`` any number of times (bytes-like; the GIL is released for 2 KiB
    or more), then ``digest()`` once (16 bytes)."""

    __slots__ = ("_ctx",)

    def __init__(self, aes_key: bytes, iv: bytes = _ZERO_IV) -> None:
        self._ctx = Cipher(algorithms.AES(aes_key), modes.GCM(iv)).encryptor()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._ctx.authenticate_additional_data(data)

    def digest(self) -> bytes:
        self._ctx.finalize()
        return self._ctx.tag


def inner_tag(key: bytes, index: int, buffers: Iterable[bytes | memoryview]) -> bytes:
    """``inner_i``: GMAC under ``chunk_key(key, index)`` of ``buffers`` (concatenated)."""
    mac = Gmac(chunk_key(key, index))
    for b in buffers:
        mac.update(b)
    return mac.digest()


def chunk_tag(session: bytes, transfer_id: bytes, index: int, offset: int, length: int,
              inner: bytes) -> bytes:
    """The 16-byte ``tag_i`` sent with chunk ``index``. ``session``: the connection's 32-byte
    session key; ``transfer_id``: 16 bytes; ``offset`` and ``length`` in bytes; ``inner``: the
    chunk's 16-byte inner tag."""
    h = blake3.blake3(_TAG_LABEL + _TAG_HEAD.pack(transfer_id, index, offset, length),
                      key=session)
    h.update(inner)
    return h.digest(TAG_BYTES)


def wrap_key(session: bytes, key: bytes) -> bytes:
    """``key`` XOR a pad derived from the session key (its own inverse: unwraps too). Use once
    per connection: the server sends one manifest per connection. Raises ``ValueError`` for
    a key that is not 32 bytes."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a chunk-MAC key is {KEY_BYTES} bytes")
    pad = blake3.blake3(_WRAP_LABEL, key=session).digest(KEY_BYTES)
    return bytes(a ^ b for a, b in zip(key, pad, strict=True))
