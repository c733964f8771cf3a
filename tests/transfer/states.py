"""Deterministic training states for the transfer tests: the same code builds a source's state
(trained a few steps) and a receiver's (same model, other seed, optimizer never stepped)."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from torchpass_p2p.transfer import RNGState, Snapshot

CASES = ("mlp_adam", "edge_tensors", "metadata_only")


class Extra:
    """A user object following the Stateful convention."""

    def __init__(self) -> None:
        self.counter = 0
        self.history: list[float] = []
        self.tag: tuple = ()

    def state_dict(self) -> dict[str, Any]:
        return {"counter": self.counter, "history": list(self.history), "tag": self.tag}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.counter = sd["counter"]
        self.history = list(sd["history"])
        self.tag = sd["tag"]


METADATA = {"data_pos": 12345, "epoch": 2, "floats": [math.nan, -0.0, 1e308, 5e-324],
            "nested": {"a": (1, 2.5, None, True, b"\x00\xff"), 7: "int key"},
            "big": (1 << 64) - 1, "neg": -(1 << 63)}


def build(case: str, role: str) -> tuple[dict[str, Any], int, dict[str, Any], int]:
    """``(objects, step, metadata, chunk_bytes)`` of ``case`` for ``role`` (``source`` or
    ``receiver``)."""
    source = role == "source"
    if case == "mlp_adam":
        torch.manual_seed(0 if source else 1)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 8))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        extra = Extra()
        random.seed(3 if source else 4)
        np.random.seed(5 if source else 6)
        step = 0
        if source:
            for _ in range(3):
                step += 1
                x = torch.randn(16, 32)
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                sched.step()
                extra.counter += 1
                extra.history.append(random.random() + float(np.random.rand()))
            extra.tag = ("done", 3)
        objs = {"model": model, "optim": opt, "sched": sched, "extra": extra,
                "rng": RNGState()}
        return objs, step, (dict(METADATA) if source else {}), 4096
    if case == "edge_tensors":
        g = torch.Generator().manual_seed(0 if source else 1)
        big = torch.rand(10_000, generator=g)
        tied = torch.rand(7, 3, generator=g)
        d: dict[str, Any] = {
            "big": big,
            "zero_dim": torch.tensor(-5, dtype=torch.int64) if source else torch.tensor(0),
            "empty": torch.empty(0, 3),
            "bool": torch.rand(17, generator=g) > 0.5,
            "bf16": torch.rand(33, generator=g).to(torch.bfloat16),
            "f16": torch.rand(5, generator=g).half(),
            "c64": torch.rand(3, 2, generator=g).view(torch.complex64).squeeze(-1),
            "u8": torch.tensor([255], dtype=torch.uint8),
            "tied_a": tied,
            "tied_b": tied,
            "transposed": torch.rand(6, 4, generator=g).t(),
            "list": [torch.rand(2, generator=g), (torch.rand(1, generator=g), 3)],
        }
        if not source:  # the receiver lacks some tensors, has others with another dtype
            del d["list"]
            d["f16"] = torch.zeros(5)
        return {"tensors": d}, 9, {"case": "edge"}, 4096
    if case == "metadata_only":
        extra = Extra()
        if source:
            extra.counter, extra.history, extra.tag = 42, [0.1, 0.2], ("x", (1, (2, 3)))
        return {"extra": extra}, 1 if source else 0, {"k": [1, 2, {"z": None}]}, 4096
    raise ValueError(case)


def capture(case: str, role: str) -> tuple[Snapshot, dict[str, Any]]:
    objs, step, meta, chunk = build(case, role)
    return Snapshot.capture(objs, step, meta, copy=True, chunk_bytes=chunk), objs


def report(case: str, result: Any, objs: dict[str, Any]) -> dict[str, Any]:
    """What the shared suite asserts, computed on the receiver: its restored state,
    recaptured from the live objects, against a source state it builds itself."""
    step, meta = result.snapshot.restore(objs)
    chunk = result.snapshot.chunk_bytes
    mine = Snapshot.capture(objs, step, meta, chunk_bytes=chunk)
    src, _ = capture(case, "source")
    same_tensors = len(mine.tensors) == len(src.tensors) and all(
        bytes(a) == bytes(b) for a, b in zip(mine._views, src._views, strict=True))
    return {
        "restored_fingerprint_equal": mine.fingerprint() == src.fingerprint(),
        "result_fingerprint_equal": result.fingerprint == src.fingerprint(),
        "tensors_bitwise_equal": same_tensors,
        "table_equal": mine.table == src.table,
        "tree_equal": mine.tree == src.tree,
        "step": step,
        "metadata_repr": repr(meta),
        "source_metadata_repr": repr(build(case, "source")[2]),
        "allocated_bytes": result.allocated_bytes,
        "total_bytes": src.total_bytes,
        "num_chunks": src.num_chunks,
    }
