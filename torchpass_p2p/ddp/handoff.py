"""Handing a committed step's averaged gradient to a peer whose reduction of it failed.

The commit vote is launched with a step's last bucket, not after the whole reduction
(``docs/training.md``, "Commit"). So a rank that sees every vote knows that every rank reached
the end of the step and *sent* all it had, not that every rank *received* all of it: a rank that
dies in the middle of its last sends can reach one peer and not another. The first completes
its reduction, sees every vote, commits the step and applies it; the second's reduction fails.
Both survive one step apart, and the second cannot reach the first's state by itself.

So whenever a group forms (a configuration's, or a regroup of one), its members exchange two
flags (:func:`hand_off`): whether this member is *behind*, still inside step ``resume - 1``,
and whether it *holds* that step's averaged gradient, because it applied the step through the
hook (:attr:`~.reduction.StepReduction.held`, kept intact until the step after the next
opens). When some member is behind, the lowest-ranked holder broadcasts the held gradient
bucket by bucket in the canonical layout, then its module's buffers (those the committed vote
gave every committer: rank 0's), and the members behind roll forward with both as if their own
step had been committed: the same bits as every committer's, so the fingerprints that follow
agree. A member behind that completed its own reduction receives it all the same: it missed
the vote, and with it rank 0's buffers. When nobody holds the gradient (its holders died too),
the members behind cannot reach the resume step: they leave, and spares take their ranks from
the state's holders.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchpass_p2p.collective import ManagedGroup
from torchpass_p2p.collective.group import Watch

from .reduction import Layout

__all__ = ["Gap", "hand_off", "pack", "unpack"]


@dataclass(frozen=True)
class Gap:
    """What :func:`hand_off` found and did.

    Attributes:
        behind: the ranks that lacked the gradient, ascending (empty: nothing was sent).
        source: the rank that broadcast it, or None (nobody behind, or nobody held it).
        received: on a rank behind that received it, the averaged gradient per canonical
            bucket; else None.
        buffers: on a rank behind, the source's module buffers as :func:`pack` made them (1-d,
            float64, CPU); else None.
    """

    behind: tuple[int, ...]
    source: int | None
    received: list[torch.Tensor] | None
    buffers: torch.Tensor | None


def hand_off(group: ManagedGroup, layout: Layout, *, behind: bool,
             held: list[torch.Tensor] | None, buffers: list[torch.Tensor],
             watch: Watch | None) -> Gap:
    """Every member of ``group`` calls this at the same point of its entry (module docstring).

    Args:
        group: the group just formed.
        layout: the canonical layout (the same on every member).
        behind: this member lacks the averaged gradient of step ``resume - 1``.
        held: that gradient per canonical bucket, when this member holds it; else None.
        buffers: the module's buffers (read on the source, left alone elsewhere).
        watch: as for :meth:`ManagedGroup.complete`.

    Returns:
        The :class:`Gap`. One all-to-all of two flags when nobody is behind; else one
        broadcast per canonical bucket and one of the buffers (every rank receives them;
        this happens only after a fault at the end of a step).

    Raises:
        CollectiveError, Superseded: as :meth:`ManagedGroup.complete`.
    """
    flags = group.exchange(torch.tensor([int(behind), int(held is not None)],
                                        dtype=torch.int64), watch=watch).to("cpu")
    lacking = tuple(r for r in range(flags.shape[0]) if flags[r, 0])
    holders = [r for r in range(flags.shape[0]) if flags[r, 1]]
    if not lacking or not holders:
        return Gap(lacking, None, None, None)
    source = holders[0]
    me = group.spec.rank
    out: list[torch.Tensor] = []
    for b, (n, dtype, device) in enumerate(zip(layout.sizes, layout.dtypes, layout.devices,
                                               strict=True)):
        if me == source:
            assert held is not None
            buf = held[b].contiguous()
        else:
            buf = torch.empty(n, dtype=dtype, device=device)
        group.broadcast(buf, source, watch=watch)
        out.append(buf)
    flat = pack(buffers).to(group.device or "cpu")
    if flat.numel():
        group.broadcast(flat, source, watch=watch)
    if me not in lacking:
        return Gap(lacking, source, None, None)
    return Gap(lacking, source, out, flat.to("cpu"))


def pack(buffers: list[torch.Tensor]) -> torch.Tensor:
    """``buffers`` as one 1-d float64 CPU tensor (exact for the narrower dtypes, integers up to
    2**53): one copy per device (each copy from a GPU waits for it), whatever their devices."""
    runs = _runs_by_device(buffers)
    return torch.cat([torch.zeros(0, dtype=torch.float64),
                      *(torch.cat([b.detach().reshape(-1).to(torch.float64) for b in run])
                        .to("cpu") for run in runs)])


def unpack(flat: torch.Tensor, buffers: list[torch.Tensor]) -> None:
    """Undo :func:`pack` into ``buffers``, in place: one copy per device."""
    offset = 0
    for run in _runs_by_device(buffers):
        n = sum(b.numel() for b in run)
        part = flat[offset:offset + n].to(run[0].device)
        offset += n
        at = 0
        for b in run:
            b.detach().copy_(part[at:at + b.numel()].view_as(b))
            at += b.numel()


def _runs_by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into runs of consecutive tensors on one device."""
    runs: list[list[torch.Tensor]] = []
    for t in tensors:
        if runs and runs[-1][0].device == t.device:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs
