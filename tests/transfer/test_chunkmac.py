"""Per-chunk MACs (``chunkmac``): known answers, agreement with an independent implementation,
and that every bound field changes the tag."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from torchpass_p2p.transfer import chunkmac

SESSION, TID, KEY = bytes(range(32)), bytes(range(100, 116)), bytes(range(64, 96))


def test_gmac_known_answer():
    # McGrew and Viega, "The Galois/Counter Mode of Operation (GCM)", test case 13: AES-256,
    # key and IV all zeros, no plaintext and no additional data.
    assert chunkmac.Gmac(bytes(32)).digest().hex() == "530f8afbc74536b9a963b4f1c4cb738b"


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 4096, 100_003])
def test_gmac_is_aes_gcm_with_the_data_as_aad(size):
    data = os.urandom(size)
    k = os.urandom(32)
    pieces = [data[i:i + 999] for i in range(0, size, 999)]  # unaligned pieces
    mac = chunkmac.Gmac(k)
    for p in pieces:
        mac.update(memoryview(p))
    assert mac.digest() == AESGCM(k).encrypt(bytes(12), b"", data)  # tag only: no plaintext


def test_inner_tag_uses_one_key_per_chunk():
    data = os.urandom(5000)
    assert chunkmac.inner_tag(KEY, 3, [data]) == AESGCM(chunkmac.chunk_key(KEY, 3)).encrypt(
        bytes(12), b"", data)
    assert chunkmac.inner_tag(KEY, 3, [data[:7], data[7:]]) == chunkmac.inner_tag(KEY, 3, [data])
    assert chunkmac.inner_tag(KEY, 4, [data]) != chunkmac.inner_tag(KEY, 3, [data])
    other = bytearray(data)
    other[4999] ^= 1
    assert chunkmac.inner_tag(KEY, 3, [other]) != chunkmac.inner_tag(KEY, 3, [data])
    assert len({chunkmac.chunk_key(KEY, i) for i in range(100)}) == 100


def test_chunk_tag_binds_session_transfer_and_place():
    inner = os.urandom(16)
    base = chunkmac.chunk_tag(SESSION, TID, 5, 5 * 4096, 4096, inner)
    assert len(base) == chunkmac.TAG_BYTES
    assert base == chunkmac.chunk_tag(SESSION, TID, 5, 5 * 4096, 4096, inner)
    variants = [
        chunkmac.chunk_tag(os.urandom(32), TID, 5, 5 * 4096, 4096, inner),   # other connection
        chunkmac.chunk_tag(SESSION, os.urandom(16), 5, 5 * 4096, 4096, inner),  # other transfer
        chunkmac.chunk_tag(SESSION, TID, 6, 5 * 4096, 4096, inner),          # other index
        chunkmac.chunk_tag(SESSION, TID, 5, 6 * 4096, 4096, inner),          # other offset
        chunkmac.chunk_tag(SESSION, TID, 5, 5 * 4096, 4095, inner),          # other length
        chunkmac.chunk_tag(SESSION, TID, 5, 5 * 4096, 4096, os.urandom(16)),  # other bytes
    ]
    assert base not in variants and len(set(variants)) == len(variants)


def test_wrap_key_round_trips_and_depends_on_the_session():
    r = chunkmac.new_key()
    wrapped = chunkmac.wrap_key(SESSION, r)
    assert wrapped != r and chunkmac.wrap_key(SESSION, wrapped) == r
    assert chunkmac.wrap_key(os.urandom(32), r) != wrapped
    with pytest.raises(ValueError):
        chunkmac.wrap_key(SESSION, b"short")
