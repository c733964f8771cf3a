"""Gradients as one flat buffer, and a sum whose result never depends on the algorithm.

A float sum depends on its order. gloo's allreduce picks an algorithm (ring, bcube) and a
chunking by size and layout, so its result is only as reproducible as that choice. Gathering
every rank's buffer and adding them in rank order, ``((g0 + g1) + g2) + ...``, gives the same
bits for the same inputs whatever backend, algorithm or process layout produced the gather.

The sum is elementwise, so it can be split: cut the buffer into ``world_size`` shards
(:func:`to_shards`), send shard ``r`` of every rank to rank ``r`` (an all-to-all), let each rank
sum its shard in rank order, then all-gather the summed shards. Every element is still
``((g0 + g1) + g2) + ...``, so the bits are the same as gathering everything, while each rank
receives ``2 (n - 1) / n`` buffers instead of ``n - 1`` and adds ``1 / n`` of them: the traffic
of a reduce-scatter plus an all-gather, as a ring all-reduce has.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch

__all__ = ["divide", "flatten", "from_shards", "shard_sizes", "shards_shape", "sum_in_rank_order",
           "to_shards", "unflatten_into"]


def flatten(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """A new contiguous buffer ``[sum of numel]`` holding every parameter's gradient in order
    (zeros where a parameter has none). dtype: the parameters' (they must share one).

    Raises:
        ValueError: parameters of different dtypes, or no parameters.
    """
    params = list(params)
    if not params:
        raise ValueError("no parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"parameters of several dtypes {sorted(map(str, dtypes))}: bucket them")
    out = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                      device=params[0].device)
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            out[offset:offset + n].zero_()
        else:
            out[offset:offset + n].copy_(p.grad.reshape(-1))
        offset += n
    return out


def unflatten_into(flat: torch.Tensor, params: Iterable[torch.nn.Parameter]) -> None:
    """Set each parameter's ``.grad`` from ``flat`` (``[sum of numel]``, as :func:`flatten`).

    Raises:
        ValueError: ``flat`` has the wrong length.
    """
    params = list(params)
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"flat buffer of {flat.numel()} elements for {total} parameters")
    offset = 0
    for p in params:
        n = p.numel()
        view = flat[offset:offset + n].view_as(p)
        if p.grad is None:
            p.grad = view.clone()
        else:
            p.grad.copy_(view)
        offset += n


def sum_in_rank_order(parts: Sequence[torch.Tensor], out: torch.Tensor | None = None,
                      ) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` left to right, in ``out`` (a tensor of the parts' shape,
    dtype and device, overwritten) or a new tensor. ``parts[r]`` is rank ``r``'s contribution.

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("nothing to sum")
    if len(parts) == 1:
        return parts[0].clone() if out is None else out.copy_(parts[0])
    out = torch.add(parts[0], parts[1], out=out)
    for p in parts[2:]:
        out.add_(p)
    return out


def divide(total: torch.Tensor, n: int) -> torch.Tensor:
    """``total / n`` in place, by IEEE division on every device. CUDA divides by a Python
    number as a multiply by its reciprocal (``div_true_kernel_cuda``: one bit less exact, and
    other bits than the CPU's true division), so the divisor is a 0-dim tensor on ``total``'s
    device, which both devices divide by exactly."""
    return total.div_(torch.tensor(n, dtype=total.dtype, device=total.device))


def shards_shape(numel: int, world_size: int) -> tuple[int, int]:
    """``(world_size, ceil(numel / world_size))``: the shape :func:`to_shards` returns.

    Raises:
        ValueError: ``world_size`` below 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size {world_size}")
    return world_size, -(-numel // world_size)


@functools.cache
def shard_sizes(numel: int, world_size: int) -> tuple[int, ...]:
    """How many of ``numel`` elements each of :func:`to_shards`' rows holds before its
    padding: ``width`` (:func:`shards_shape`) for each row but the last ones, which are shorter
    or empty. Summing to ``numel``, they are the split sizes of an all-to-all that sends shard
    ``r`` of an unpadded buffer to rank ``r``. Cached: a step asks once per bucket.

    Raises:
        ValueError: ``world_size`` below 1.
    """
    _, width = shards_shape(numel, world_size)
    return tuple(min(width, max(0, numel - r * width)) for r in range(world_size))


def to_shards(tensor: torch.Tensor, world_size: int, out: torch.Tensor | None = None,
              ) -> torch.Tensor:
    """A ``[world_size, ceil(numel / world_size)]`` tensor (dtype and device of ``tensor``;
    ``out`` of that shape, overwritten, or a new one): row ``r`` is the ``r``-th contiguous
    piece of ``tensor``'s flattened elements, the last row padded with zeros. Row ``r`` is what
    rank ``r`` sums in a sharded reduction (module docstring).

    Raises:
        ValueError: ``world_size`` below 1, or ``out`` of another shape.
    """
    flat = tensor.reshape(-1)
    shape = shards_shape(flat.numel(), world_size)
    if out is None:
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    elif tuple(out.shape) != shape:
        raise ValueError(f"shards of shape {tuple(out.shape)}, expected {shape}")
    out.view(-1)[:flat.numel()].copy_(flat)
    out.view(-1)[flat.numel():].zero_()
    return out


def from_shards(shards: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Undo :func:`to_shards`: ``shards`` (``[world_size, width]``) without the padding, in
    ``like``'s shape (a view of ``shards``).

    Raises:
        ValueError: ``shards`` holds fewer elements than ``like``.
    """
    if shards.numel() < like.numel():
        raise ValueError(f"{shards.numel()} elements for a tensor of {like.numel()}")
    return shards.view(-1)[:like.numel()].view(like.shape)
