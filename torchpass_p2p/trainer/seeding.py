"""Per-rank randomness derived from ``(seed, rank, step)`` (docs/design.md section 6).

Every random draw of step ``k`` on rank ``r`` comes from generators seeded by
:func:`step_seed` ``(seed, r, k)`` at the start of the step, so a replacement of rank ``r``
draws exactly what the dead holder would have, and no generator state has to travel with the
training state (it differs per rank; the transferred state must not).
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

__all__ = ["seed_globals", "seed_step", "step_generator", "step_seed"]

_PERSON = b"torchpass-seed-1"


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed for ``(seed, rank, step)``: blake2b of the three as 8-byte big-endian
    unsigned ints, equal on every machine. Raises ``OverflowError`` for negative inputs."""
    data = b"".join(int(v).to_bytes(8, "big") for v in (seed, rank, step))
    digest = hashlib.blake2b(data, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "big") >> 1


def step_generator(seed: int, rank: int, step: int, salt: int = 0) -> torch.Generator:
    """A fresh CPU ``torch.Generator`` for ``(seed, rank, step)`` (``salt`` separates several
    streams of one step, e.g. data sampling from dropout)."""
    return torch.Generator().manual_seed(step_seed(seed, rank, step) ^ salt)


def seed_step(seed: int, rank: int, step: int) -> None:
    """Seed torch's global CPU (and CUDA) generators, ``random`` and numpy's legacy generator
    for step ``step`` of rank ``rank`` (dropout and any library drawing from globals)."""
    seed_globals(step_seed(seed, rank, step))


def seed_globals(s: int) -> None:
    """Seed torch's CPU generator, every CUDA device's where CUDA exists, ``random`` and
    numpy's legacy generator with ``s`` (``0 <= s < 2**64``). ``torch.manual_seed`` does the
    same for torch but also queues a lazy CUDA seeding that records a stack trace, hundreds of
    microseconds a call on a CPU-only build: too much for every sample a loader fetches."""
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(s)
    random.seed(s)
    np.random.seed(s % (1 << 32))
