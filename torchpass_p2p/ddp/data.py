"""The data position: which batch a rank takes next, so that a spare takes the dead rank's.

:class:`DistributedSampler` is torch's, with the rank and world size taken from this member's
place in the configuration, and a start offset a spare is given once. :class:`DataLoader` is
torch's, counting the batches it hands the training loop; with a :class:`DistributedSampler`
it also seeds every batch's fetch: before the samples of a batch whose first index is ``i`` in
epoch ``e`` are fetched (in order, by one worker, as torch's fetcher does), the worker's torch,
``random`` and numpy generators are seeded from ``(seed, e, i)`` (:func:`splitmix64` of the
epoch's base seed plus ``i``), so a random transform draws the same in every process whichever
worker fetches the batch (a worker's generator otherwise depends on the batches it fetched
before, which a replacement that starts mid-epoch never fetched). Without automatic batching
(``batch_size=None``) every sample is seeded on its own. Seeding costs tens of microseconds
(``random`` and numpy's Mersenne Twisters): once a batch, not once a sample.

The position of a step boundary (``docs/training.md``): every tracked loader's ``(epoch,
batches handed out by its current iterator)``, taken just before the step's first batch was
handed out. An iterator run to its end counts as not started: the loader's next iterator
starts from the first batch, as torch's does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch.utils.data as tud

from torchpass_p2p.trainer.seeding import seed_globals, step_seed

from .session import current

__all__ = ["DataLoader", "DistributedSampler"]

SAMPLE_SALT = 0x5A4D
"""Separates the per-sample seeds from the per-step ones (``step_seed(seed, epoch, index)``
would otherwise equal the seed of rank ``epoch``'s step ``index``)."""


class DistributedSampler(tud.distributed.DistributedSampler):
    """torch's ``DistributedSampler`` (same arguments, same order of indices), for a world
    whose members change. ``num_replicas`` and ``rank`` default to this member's place in its
    configuration, taken again at every ``__iter__``; a spare that takes a rank mid-epoch
    starts at the batch the dead rank would have taken next.

    Raises:
        RuntimeError: iterated by anything but a :class:`DataLoader` (the batches a loop took
            would be unknown, and a replacement would start at the wrong one).
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        session = current()
        self._fixed = (num_replicas, rank)
        super().__init__(dataset, num_replicas=num_replicas or session.world_size,
                         rank=session.rank if rank is None else rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.loader: DataLoader | None = None
        self.skip = 0
        """Samples to skip at the next ``__iter__`` (once): a restored position."""

    def __iter__(self) -> Iterator[Any]:
        if self.loader is None:
            raise RuntimeError("torchpass_p2p.DistributedSampler must be given to a "
                               "torchpass_p2p.DataLoader: a torch DataLoader does not say which "
                               "batches the training loop took")
        session = current()
        world, rank = self._fixed
        self.num_replicas = world or session.world_size
        self.rank = session.rank if rank is None else rank
        if self.drop_last and len(self.dataset) % self.num_replicas != 0:  # type: ignore[arg-type]
            self.num_samples = -(-(len(self.dataset) - self.num_replicas)  # type: ignore[arg-type]
                                 // self.num_replicas)
        else:
            self.num_samples = -(-len(self.dataset) // self.num_replicas)  # type: ignore[arg-type]
        self.total_size = self.num_samples * self.num_replicas
        skip, self.skip = self.skip, 0
        epoch = self.epoch
        return ((epoch, i) for i in itertools.islice(super().__iter__(), skip, None))

    def describe(self) -> dict[str, Any]:
        """What every member's sampler must agree on."""
        return {"samples": len(self.dataset), "shuffle": self.shuffle,  # type: ignore[arg-type]
                "seed": self.seed, "drop_last": self.drop_last}


MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output function of ``x`` (Steele, Lea and Flood, "Fast splittable
    pseudorandom number generators", OOPSLA 2014): distinct 64-bit inputs give well-mixed,
    distinct outputs; a 63-bit seed for the sample after the epoch's base. Cheap enough for every
    sample a loader fetches, where a digest per sample (``step_seed``) is not."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) >> 1


class _SeededSamples(tud.Dataset):  # type: ignore[type-arg]
    """``dataset[(epoch, i)]`` is ``dataset[i]`` fetched with every generator seeded from
    ``(seed, epoch, i)`` (module docstring). Other attributes are the dataset's."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self._epoch, self._base = -1, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Any) -> Any:
        epoch, index = key
        self._seed(epoch, index)
        return self.dataset[index]

    def __getitems__(self, keys: list[Any]) -> Any:
        """A batch (torch's fetcher calls this with the batch's keys, in order): seeded once,
        from its first key."""
        self._seed(*keys[0])
        indices = [index for _, index in keys]
        many = getattr(self.dataset, "__getitems__", None)
        return many(indices) if many is not None else [self.dataset[i] for i in indices]

    def _seed(self, epoch: int, index: int) -> None:
        if epoch != self._epoch:
            self._epoch, self._base = epoch, step_seed(self.seed ^ SAMPLE_SALT, epoch, 0)
        seed_globals(splitmix64(self._base + index))

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed", "_epoch", "_base"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _wraps_distributed_sampler(batch_sampler: Any) -> bool:
    """Whether ``batch_sampler`` draws from a :class:`DistributedSampler` through its chain of
    ``sampler`` attributes (torch's ``BatchSampler`` and most wrappers name it so). Such a
    sampler would be iterated without its loader, which refuses only at the first batch."""
    seen: set[int] = set()
    inner = getattr(batch_sampler, "sampler", None)
    while inner is not None and id(inner) not in seen:
        if isinstance(inner, DistributedSampler):
            return True
        seen.add(id(inner))
        inner = getattr(inner, "sampler", None)
    return False


class DataLoader(tud.DataLoader):  # type: ignore[type-arg]
    """torch's ``DataLoader`` (same arguments), whose batches are counted for the data
    position (module docstring) when its sampler is a :class:`DistributedSampler`. Workers,
    shuffling, ``drop_last``, pinned memory and collation are torch's own.

    Raises:
        ValueError: a :class:`DistributedSampler` with a ``batch_sampler``, or a
            ``batch_sampler`` wrapping one (a position counts whole batches of
            ``batch_size``), or a :class:`DistributedSampler` with an ``IterableDataset``.
    """

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        sampler = kwargs.get("sampler", args[2] if len(args) > 2 else None)
        batch_sampler = kwargs.get("batch_sampler", args[3] if len(args) > 3 else None)
        if _wraps_distributed_sampler(batch_sampler):
            raise ValueError("a batch_sampler over a torchpass_p2p.DistributedSampler is not "
                             "supported: give the DistributedSampler as sampler=, and "
                             "batch_size (and drop_last) to the DataLoader")
        self._tracked = isinstance(sampler, DistributedSampler)
        if self._tracked:
            if kwargs.get("batch_sampler") is not None:
                raise ValueError("a DistributedSampler with a batch_sampler is not supported: "
                                 "give batch_size (and drop_last) to the DataLoader instead")
            if isinstance(dataset, tud.IterableDataset):
                raise ValueError("an IterableDataset has no sampler: a replacement could not "
                                 "start at the dead rank's batch; use a map-style Dataset "
                                 "(__getitem__ and __len__) with the DistributedSampler")
            dataset = _SeededSamples(dataset, current().seed)
        super().__init__(dataset, *args, **kwargs)
        self._epoch = 0
        self._handed = 0
        """Batches the current iterator handed out (-1: it ran to its end)."""
        if self._tracked:
            assert isinstance(sampler, DistributedSampler)
            sampler.loader = self
            current().track_loader(self)

    @property
    def distributed_sampler(self) -> DistributedSampler:
        sampler = self.sampler
        assert isinstance(sampler, DistributedSampler)
        return sampler

    def __iter__(self) -> Any:
        if not self._tracked:
            return super().__iter__()
        sampler = self.distributed_sampler
        # Before torch's iterator exists: making it runs the sampler (workers prefetch), which
        # uses up the skip.
        start = sampler.skip // (self.batch_size or 1)
        epoch = sampler.epoch
        return self._counted(super().__iter__(), epoch, start)

    def _counted(self, batches: Iterator[Any], epoch: int, start: int) -> Iterator[Any]:
        self._epoch, self._handed = epoch, start
        session = current()
        for batch in batches:
            session.handing_out(self)
            self._handed += 1
            yield batch
        self._handed = -1

    # ------------------------------------------------------------------ the position

    def position(self) -> list[int]:
        """``[epoch, batches handed out]`` of the current iterator (0 once it ran out)."""
        return [self._epoch, max(self._handed, 0)]

    def restore(self, position: list[int]) -> None:
        """The next iterator starts ``position[1]`` batches into epoch ``position[0]``."""
        self._epoch, batches = position
        self._handed = batches
        self.distributed_sampler.skip = batches * (self.batch_size or 1)

    def describe(self) -> dict[str, Any]:
        """What every member's loader must agree on."""
        return {"batch_size": self.batch_size, "drop_last": self.drop_last,
                **self.distributed_sampler.describe()}
