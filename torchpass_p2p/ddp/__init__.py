"""Fault tolerance inside the user's own torchrun-style DDP script (``docs/training.md``).

A script adopts it by importing these names instead of torch's::

    from torchpass_p2p import init_process_group, destroy_process_group, epochs, track
    from torchpass_p2p import DistributedDataParallel as DDP, DistributedSampler, DataLoader

and looping ``for epoch in epochs(start, stop)``. Everything else (its Dataset, DataLoader
workers, epochs, evaluation, logging, checkpoints) stays as it is.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from torchpass_p2p.core.messages import format_member_id

from .data import DataLoader, DistributedSampler
from .model import DistributedDataParallel
from .session import JobMismatch, Session, current, install

__all__ = [
    "DataLoader", "DistributedDataParallel", "DistributedSampler", "JobMismatch",
    "destroy_process_group", "epochs", "get_rank", "get_world_size", "init_process_group",
    "track",
]

REFUSED = ("init_method", "store", "rank", "world_size")


def init_process_group(backend: str | None = "gloo", *, seed: int | None = None,
                       exact: bool = True, state_transport: str = "auto",
                       give_up_s: float | None = None, **kwargs: Any) -> None:
    """Start this process's agent and take its place in the job. A rank returns at once; a
    spare returns only once it holds a rank (``RANK`` and ``WORLD_SIZE`` are set then, as
    torchrun sets them). Its state arrives at the epochs loop (:func:`epochs`).

    Args:
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"``; None: gloo.
        seed: the job's seed for per-step and per-sample generators (default
            ``TORCHPASS_SEED``, else 0).
        exact: average gradients by rank-order sums, bitwise equal to a fault-free run
            (default), or by the backend's all-reduce (faster; same step, not bitwise).
        state_transport: how a spare receives its rank's state: ``"tcp"`` (the agents'
            transfer service, from every surviving holder), ``"pg"`` (point-to-point over the
            new configuration's process group: NCCL's RDMA path on GPUs) or ``"auto"`` (pg
            over NCCL, else tcp).
        give_up_s: the last resort, in seconds: a member fenced this long (or whose failed
            collective nothing repaired) stops (``docs/training.md``, exit codes); None: the
            trainer's default, :data:`~torchpass_p2p.trainer.regroup.GIVE_UP_S`.
        kwargs: torch's other arguments; ``timeout``, ``group_name``, ``pg_options`` and
            ``device_id`` are accepted and unused.

    Raises:
        ValueError: ``init_method``, ``store``, ``rank`` or ``world_size`` given (the
            launcher and the agreement decide them), an unknown backend or
            state_transport, or ``"nccl"`` where torch has no NCCL or no CUDA device.
        RuntimeError: called twice, or not under ``torchpass-p2p launch`` (neither
            ``TORCHPASS_KEY_FILE`` nor ``TORCHPASS_KEY`` set).
    """
    for name in REFUSED:
        if kwargs.get(name) not in (None, -1, ""):
            raise ValueError(f"init_process_group({name}=...): run under `torchpass-p2p "
                             "launch`, which decides ranks and rendezvous")
    backend = backend or "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: 'gloo' or 'nccl'")
    if state_transport not in ("auto", "tcp", "pg"):
        raise ValueError(f"state_transport {state_transport!r}: 'auto', 'tcp' or 'pg'")
    if backend == "nccl":
        _refuse_nccl_without_cuda()
    try:
        current()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("init_process_group() was called already")
    _refuse_outside_the_launcher()
    from torchpass_p2p import start

    agent = start()
    if seed is None:
        seed = int(os.environ.get("TORCHPASS_SEED", "0"))
    log_dir = os.environ.get("TORCHPASS_LOG_DIR")
    log_path = (None if not log_dir
                else os.path.join(log_dir, f"{format_member_id(agent.member_id)}.jsonl"))
    session = Session(agent, seed=seed, exact=exact, backend=backend, log_path=log_path,
                      state_transport=state_transport, give_up_s=give_up_s)
    install(session)
    session._set_env()
    _skip_teardown_of_stuck_groups()


def _refuse_nccl_without_cuda() -> None:
    """NCCL missing from this torch build, or no CUDA device, can never be repaired by a
    regroup: refused here, before the agent starts, so that the script ends at once instead of
    waiting ``give_up_s`` for a group that cannot form.

    Raises:
        ValueError: no NCCL in this torch build, or no CUDA device.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        why = "torch.distributed.is_nccl_available() is False here"
    elif not torch.cuda.is_available():
        why = "torch.cuda.is_available() is False here"
    else:
        return
    raise ValueError(f'backend="nccl" needs a torch build with NCCL and a CUDA device ({why}): '
                     'use backend="gloo"')


def _refuse_outside_the_launcher() -> None:
    """The launcher always gives its children ``TORCHPASS_KEY_FILE``; a process started by hand
    with ``TORCHPASS_KEY`` or ``TORCHPASS_KEY_FILE`` set configures its agent itself and is let
    through. Neither set: the script was started by ``python`` or ``torchrun``, and the agent
    could only fail for want of a cluster key, a message that does not say what to do.

    Raises:
        RuntimeError: neither variable set.
    """
    if not (os.environ.get("TORCHPASS_KEY_FILE") or os.environ.get("TORCHPASS_KEY")):
        raise RuntimeError("init_process_group(): run this script under `torchpass-p2p launch` "
                           "(not python or torchrun): no TORCHPASS_KEY_FILE or TORCHPASS_KEY "
                           "is set, so no launcher started it")


_failed = False


def _skip_teardown_of_stuck_groups() -> None:
    """A gloo group given up with an operation in flight can be neither aborted nor
    destroyed: the interpreter's teardown would destroy it and abort the process
    (``docs/collective.md``). So when the script ends and such a group exists, the process
    exits at once, with status 1 if the script died of an exception, else 0 (a script's
    ``sys.exit(n)`` then ends with 0: return from ``main`` instead). Nothing changes for a
    process that has none."""
    hook = sys.excepthook

    def record(kind: type[BaseException], value: BaseException,
               tb: TracebackType | None) -> None:
        global _failed
        _failed = True
        hook(kind, value, tb)

    sys.excepthook = record

    def skip() -> None:
        from torchpass_p2p.collective import exit_process
        from torchpass_p2p.collective.group import stuck_groups

        if stuck_groups():
            exit_process(1 if _failed else 0)

    atexit.register(skip)


def destroy_process_group(group: Any = None) -> None:
    """The end of training: every member holds the final state, then this member leaves
    the job (its agent stops). Scripts call it where they called torch's."""
    del group
    session = current()
    session.finish()
    session.agent.stop(leave=False, timeout_s=2.0)
    install(None)


def epochs(start: int, stop: int) -> Iterator[int]:
    """``range(start, stop)`` for this job. A spare joins here: it receives the state and
    starts at the epoch (and batch) the job is at. Every member must give the same ``stop``.
    Build the model, optimizer, scheduler and data loaders before the loop."""
    session = current()
    session.epoch = session.join(start, stop)
    while session.epoch < stop:
        yield session.epoch
        session.epoch += 1


def track(*objects: Any, **named: Any) -> None:
    """Move these objects with the training state (the one call for what the library cannot
    see): optimizers, LR schedulers, ``GradScaler``, anything with ``state_dict`` and
    ``load_state_dict``. Unnamed objects are named by kind (``optimizer``, ``scheduler``,
    ``scaler``; a second one gets ``.1``). Call it before the epochs loop.

    Raises:
        TypeError: an object without ``state_dict``/``load_state_dict``.
        ValueError: a name given twice, or the loop has started.
    """
    import torch

    session = current()
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            kind = "optimizer"
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            kind = "scheduler"
        elif type(obj).__name__ == "GradScaler":
            kind = "scaler"
        else:
            raise TypeError(f"name the {type(obj).__name__}: track(name=obj)")
        name, n = kind, 0
        while name in session.objects:
            n += 1
            name = f"{kind}.{n}"
        session.track(name, obj)
    for name, obj in named.items():
        session.track(name, obj)


def get_rank() -> int:
    """This member's rank in its configuration."""
    return current().rank


def get_world_size() -> int:
    """Ranks in this member's configuration."""
    return current().world_size
