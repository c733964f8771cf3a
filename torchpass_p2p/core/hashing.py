"""Deterministic 64-bit mixing for ring orders and view digests.

Python's built-in ``hash`` of ``str``/``bytes`` is salted per process, and its hash of ``int`` is
not a mixer, so neither can order rings or compare digests across processes. SplitMix64's
finalizer (Steele, Lea, Flood, "Fast Splittable Pseudorandom Number Generators", OOPSLA 2014) is
a cheap, well-studied bijection on 64-bit words that every member computes identically.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(x: int) -> int:
    """SplitMix64 finalizer: a bijection on unsigned 64-bit integers."""
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mix_pair(a: int, b: int) -> int:
    """Hash of an ordered pair of unsigned 64-bit integers (not symmetric)."""
    return mix64(mix64(a) ^ b)


def mix_triple(a: int, b: int, c: int) -> int:
    """Hash of an ordered triple of unsigned 64-bit integers."""
    return mix64(mix_pair(a, b) ^ c)
