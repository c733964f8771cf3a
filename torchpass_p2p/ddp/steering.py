"""Catch a replica that its script steers apart from the others, at the step it happens.

A spare takes over a rank with the tracked state, but the script's own variables start over on
it: a gradient-accumulation counter from ``enumerate``, an LR computed from a step counter of
the script's own. Such a replica steps its optimizer at other steps, or with another learning
rate, than the survivors: the replicas drift apart and, unchecked, the job would end with exit 0
and weights that are nobody's. The final barrier compares the final states
(:meth:`~torchpass_p2p.trainer.loop.Trainer._finish`); this module catches it the step after it
happens, before more compute is spent on it.

Every rank counts its tracked optimizers' ``step()`` calls between two step openings and
digests their hyperparameters at each (every ``param_groups`` entry but ``params``: the
learning rate the step used, betas, weight decay, ...). The figures of the step before ride in
the next step's vote (:meth:`~torchpass_p2p.ddp.session.Session._vote`): in a job whose
replicas are steered alike, every rank calls the same ``step()`` calls with the same
hyperparameters, a GradScaler's skipped steps included (the averaged gradient, hence the
decision, is the same on every rank). A rank that does not know the step before (the job's
first step, the first after it received another's state) sends :data:`UNKNOWN`, and is left
out of the comparison for that step.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["UNKNOWN", "OptimizerSteps", "disagreement"]

UNKNOWN = -1.0
"""The figures of a rank that does not know the step before."""


class OptimizerSteps:
    """The step calls and hyperparameter digest of ``optimizers`` (the tracked ones) between
    two step openings (module docstring)."""

    def __init__(self, optimizers: Callable[[], Iterable[torch.optim.Optimizer]]) -> None:
        self._optimizers = optimizers
        self._count = 0
        self._digest = 0
        self._known = False
        self.last: tuple[float, float] = (UNKNOWN, UNKNOWN)
        """``(step calls, digest)`` of the step before the open one, or :data:`UNKNOWN`
        twice; exact as float64 (a count, a CRC-32)."""

    def install(self) -> Callable[[], None]:
        """Watch every optimizer's ``step()`` from now on; returns the function that stops."""
        me = weakref.ref(self)

        def seen(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            watch = me()
            if watch is not None:
                watch.seen(optimizer)

        return register_optimizer_step_pre_hook(seen).remove

    def seen(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` is about to run: count it if it is tracked."""
        if not any(optimizer is o for o in self._optimizers()):
            return
        self._count += 1
        self._digest = zlib.crc32(repr(hyperparameters(optimizer)).encode(), self._digest)

    def opened(self) -> None:
        """A step opens: what was counted since the last opening becomes :attr:`last`."""
        self.last = (float(self._count), float(self._digest)) if self._known else (
            UNKNOWN, UNKNOWN)
        self._count, self._digest, self._known = 0, 0, True

    def forget(self) -> None:
        """This rank's state was replaced by another's: it does not know the step before."""
        self._count, self._digest, self._known = 0, 0, False
        self.last = (UNKNOWN, UNKNOWN)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[list[tuple[str, Any]]]:
    """Every param group's entries but ``params``, as plain values in key order (a tensor as
    its values, exactly: a learning rate may be a 0-d tensor)."""
    return [[(k, _plain(v)) for k, v in sorted(group.items()) if k != "params"]
            for group in optimizer.param_groups]


def _plain(v: Any) -> Any:
    """``v`` as a value whose ``repr`` is the same in every process: anything but a number, a
    string, None, a tensor or a sequence of them by its type alone (an object's default
    ``repr`` holds its address)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.detach().reshape(-1).tolist()) if v.numel() <= 16
                else tuple(v.shape))
    if isinstance(v, list | tuple):
        return tuple(_plain(x) for x in v)
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return ("object", type(v).__qualname__)


def disagreement(figures: list[tuple[float, float]]) -> str | None:
    """Why the ranks' ``(step calls, digest)`` of one step disagree (in rank order, unknown
    ones left out), or None when they agree."""
    known = {(r, f) for r, f in enumerate(figures) if f[0] != UNKNOWN}
    distinct = {f for _, f in known}
    if len(distinct) <= 1:
        return None
    counts = {f[0] for f in distinct}
    if len(counts) > 1:
        by = {c: sorted(r for r, f in known if f[0] == c) for c in sorted(counts)}
        return "optimizer steps " + ", ".join(f"{int(c)} on ranks {rs}" for c, rs in by.items())
    groups = sorted(sorted(r for r, f in known if f == d) for d in distinct)
    return ("the optimizers' hyperparameters (the learning rate, ...) differ between ranks "
            + ", ".join(map(str, groups)))
