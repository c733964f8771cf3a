"""Comparing saved training states bit for bit, and reading the members' timelines: shared by
the end-to-end tests of the training API."""

from __future__ import annotations

from typing import Any

import torch

from examples.main_job import Run


def events(result: Run, name: str) -> list[dict[str, Any]]:
    """The run's timeline records of event ``name``, in time order."""
    return [r for r in result.events if r["event"] == name]


def flat(obj: Any, path: str = "") -> dict[str, Any]:
    """Nested dicts, lists and tuples as ``{"/key/0/...": leaf}``."""
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in flat(value, f"{path}/{key}").items()}
    if isinstance(obj, list | tuple):
        return {k: v for i, value in enumerate(obj) for k, v in flat(value, f"{path}/{i}").items()}
    return {path: obj}


def bitwise_equal(a: Any, b: Any) -> bool:
    """Tensors: same dtype, shape and bytes (so NaNs and signed zeros count); else ``==``."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8),
                                b.reshape(-1).view(torch.uint8)))
    return bool(a == b)
