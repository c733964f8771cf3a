"""torch's ``DistributedDataParallel``, reducing over the configuration's group.

DDP keeps its own bucketing, overlap, ``no_sync``, unused-parameter search and compile
integration. It is built on a process group of this process alone, so that nothing DDP does
by itself (its constructor's checks, a buffer broadcast, the unused-parameter map) waits for
another member; every byte that crosses between members goes through the session's
communication hook (:meth:`~.session.Session.comm_hook`), on the group of the configuration
this member trains in.
"""

from __future__ import annotations

import datetime
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from .session import current

__all__ = ["DistributedDataParallel"]

REFUSED = {
    "process_group": "the process group is the configuration's, rebuilt after each fault: "
                     "leave process_group out",
    "device_mesh": "the mesh is the configuration's: leave device_mesh out",
    "mixed_precision": "DDP's experimental mixed_precision is not supported: use "
                       "torch.autocast (with a GradScaler) around the forward",
}


def _local_group() -> Any:
    """A gloo process group of this process alone (rank 0 of 1), for CPU and CUDA tensors."""
    from torch._C._distributed_c10d import ProcessGroup

    store = dist.HashStore()
    backend = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=60))
    pg = ProcessGroup(store, 0, 1)
    pg._set_default_backend(ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():  # DDP's constructor checks a CUDA module's tensors on it
        pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.GLOO, backend)
    return pg


class DistributedDataParallel(TorchDDP):
    """``torch.nn.parallel.DistributedDataParallel`` (same arguments but
    ``process_group``), whose gradients are averaged over the members of the configuration
    (rank-order sums unless :func:`~torchpass_p2p.init_process_group` chose
    ``exact=False``). A spare that takes a rank receives the module's state; at step 0 every
    rank takes rank 0's, as DDP's constructor gives it.

    Raises:
        ValueError: an argument this wrapper cannot honour (the message names what to do).
        RuntimeError: before :func:`~torchpass_p2p.init_process_group`, or a second model.
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        for name, why in REFUSED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"DistributedDataParallel({name}=...): {why}")
        if any(getattr(m, "sparse", False) for m in module.modules()):
            raise ValueError("sparse gradients (an Embedding with sparse=True) are not "
                             "supported: use sparse=False")
        for name in ("broadcast_buffers", "forward_sync_buffers"):
            if kwargs.pop(name, None) is False:
                raise ValueError(f"DistributedDataParallel({name}=False): buffers that differ "
                                 "between ranks cannot move to a spare; every rank takes rank "
                                 "0's buffers after each step, as DDP's default does")
        session = current()
        # The session takes rank 0's buffers after each step (with the commit vote); DDP's own
        # per-forward broadcast would cost a collective on the local group for nothing. Torch
        # before 2.12 has no forward_sync_buffers: there broadcast_buffers=False is the switch.
        kwargs[_NO_FORWARD_SYNC] = False
        kwargs["process_group"] = _local_group()
        super().__init__(module, *args, **kwargs)
        # unannotated: DDP checks a hook's annotations against its own types
        self.register_comm_hook(None, lambda state, bucket: session.comm_hook(state, bucket))
        session.attach_model(self)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.training:
            _step_starting()
        return super().forward(*inputs, **kwargs)


_NO_FORWARD_SYNC = ("forward_sync_buffers"
                    if "forward_sync_buffers" in inspect.signature(
                        TorchDDP.__init__).parameters
                    else "broadcast_buffers")


@torch.compiler.disable
def _step_starting() -> None:
    """The session's step opening, run as it is under ``torch.compile(ddp)``: dynamo traced
    into it and recompiled at every step (its generators are seeded from the step number)
    until it hit its recompile limit; a graph break here keeps the session's code eager."""
    current().step_starting()
