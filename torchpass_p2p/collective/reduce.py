"""Gradients as one flat buffer, and a sum whose result never depends on the algorithm.

A float sum depends on its order. gloo's allreduce picks an algorithm (ring, bcube) and a
chunking by size and layout, so its result is only as reproducible as that choice. Gathering
every rank's buffer and adding them in rank order, ``((g0 + g1) + g2) + ...``, gives the same
bits for the same inputs whatever backend, algorithm or process layout produced the gather.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["flatten", "sum_in_rank_order", "unflatten_into"]


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


def sum_in_rank_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` left to right, in a new tensor (shape and dtype of the
    parts). ``parts[r]`` is rank ``r``'s contribution.

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("nothing to sum")
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out
