"""A ManagedGroup in one process (world size 1, gloo): its operations keep the input's device,
and interrupting it while an operation of the caller's own is in flight retires it as stuck."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from torchpass_p2p.collective import GroupSpec, ManagedGroup
from torchpass_p2p.collective import group as group_module


def _group() -> ManagedGroup:
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    return ManagedGroup(pg, GroupSpec(7, 0, 1, 1), "gloo")


def test_operations_return_fresh_tensors_where_the_input_was() -> None:
    g = _group()
    assert g.device is None and g.process_group is not None
    x = torch.arange(4, dtype=torch.float64)
    [y] = g.allgather(x)
    z = g.allreduce_sum(x)
    assert torch.equal(y, x) and torch.equal(z, x)
    assert y.data_ptr() != x.data_ptr() and z.data_ptr() != x.data_ptr()
    g.close()


def test_interrupt_retires_a_ready_group_as_stuck_and_keeps_it_referenced() -> None:
    g = _group()
    pg = g.process_group
    before = len(group_module._STUCK)
    g.interrupt()
    assert g.state == "stuck" and g.process_group is None
    assert len(group_module._STUCK) == before + 1 and group_module._STUCK[-1][0] is pg
    g.interrupt()  # once
    assert len(group_module._STUCK) == before + 1
