"""Refuse an optimizer or LR scheduler whose state would not move to a spare.

A spare takes over a rank with the state :func:`torchpass_p2p.track` registered. An optimizer
over the model's parameters left out of it would start over on the spare (fresh moments, the
first LR of its schedule) while the survivors go on with theirs: the replicas drift apart, the
job ends with exit 0 and final weights that are not the fault-free run's. Nothing else in the
library can see the script's optimizer, so the first ``step()`` of each one is checked, through
torch's global optimizer step hook, and an untracked one is refused there, on every rank alike,
before it changed anything.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


class UntrackedState(RuntimeError):
    """An optimizer, or the LR scheduler wrapping one, steps the model's parameters without
    being tracked (:func:`torchpass_p2p.track`)."""


def untracked(optimizer: torch.optim.Optimizer, tracked: Mapping[str, Any],
              params: set[int]) -> str | None:
    """Why ``optimizer`` is not safe to step, or None: it updates some of ``params`` (ids of
    the model's parameters) and is not among ``tracked``, or an LR scheduler wraps its
    ``step`` (torch marks the wrapper ``_wrapped_by_lr_sched``) and no tracked scheduler
    drives it."""
    if not any(id(p) in params for g in optimizer.param_groups for p in g["params"]):
        return None  # not the model's: what it holds is the script's own business
    if not any(obj is optimizer for obj in tracked.values()):
        return (f"this {type(optimizer).__name__} steps the model's parameters but is not "
                "tracked: a spare would start it over; call torchpass_p2p.track(optimizer, "
                "scheduler, scaler) before the epochs loop")
    schedulers = [obj for obj in tracked.values()
                  if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)]
    if (getattr(optimizer.step, "_wrapped_by_lr_sched", False)
            and not any(s.optimizer is optimizer for s in schedulers)):
        return (f"an LR scheduler drives this {type(optimizer).__name__} but is not tracked: a "
                "spare would start its schedule over; track the scheduler too")
    return None


def install(tracked: Mapping[str, Any], module: torch.nn.Module) -> Callable[[], None]:
    """Check every optimizer's first ``step()`` from now on (:func:`untracked`); returns the
    function that removes the check. Raises :class:`UntrackedState` from that ``step()``."""
    params = {id(p) for p in module.parameters()}
    checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def check(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if optimizer in checked:
            return
        why = untracked(optimizer, tracked, params)
        if why is not None:
            raise UntrackedState(why)
        checked.add(optimizer)

    handle = register_optimizer_step_pre_hook(check)
    return handle.remove
