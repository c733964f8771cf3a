"""The hand-off of a committed step's averaged gradient (torchpass_p2p/ddp/handoff.py), over
real gloo groups of three ranks built in threads of one process.

Must hold: with nobody behind, nothing but the flags is exchanged and nothing is received;
with a rank behind, it receives the lowest-ranked holder's results bitwise, bucket by bucket,
and that holder's module buffers; with a rank behind and no holder, nobody sends and the
result says so (the member behind leaves); a source lost in the middle of its broadcast fails
the hand-off on every receiver (a CollectiveError: the recovery starts again), never leaves one
with part of a gradient.
"""

from __future__ import annotations

import torch

from tests.ddp.test_reduction import groups, on_every_rank
from torchpass_p2p.collective import CollectiveError
from torchpass_p2p.ddp.handoff import Gap, hand_off, pack, unpack
from torchpass_p2p.ddp.reduction import Layout

SIZES = [(300, 1024), (7, 5), (11,)]


def layout() -> Layout:
    return Layout.of([torch.empty(s) for s in SIZES], first_bytes=16, bytes_cap=512)


def results(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(n, generator=g) for n in layout().sizes]


def buffers(rank: int) -> list[torch.Tensor]:
    """A BatchNorm's kind of buffers: float statistics and an int64 counter."""
    return [torch.full((4,), float(rank) + 0.5), torch.tensor(10 + rank, dtype=torch.int64)]


def test_nobody_behind_exchanges_the_flags_only() -> None:
    every = groups(16)

    def run(rank: int) -> Gap:
        return hand_off(every[rank], layout(), behind=False,
                        held=results(rank) if rank else None, buffers=buffers(rank), watch=None)

    assert on_every_rank(run) == [Gap((), None, None, None)] * 3


def test_a_rank_behind_receives_the_lowest_holders_results_and_buffers() -> None:
    every = groups(17)

    def run(rank: int) -> Gap:
        return hand_off(every[rank], layout(), behind=rank == 0,
                        held=None if rank == 0 else results(rank), buffers=buffers(rank),
                        watch=None)

    gaps = on_every_rank(run)
    assert [(g.behind, g.source) for g in gaps] == [((0,), 1)] * 3
    assert gaps[1].received is None and gaps[2].received is None
    got = gaps[0].received
    assert got is not None
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
               for a, b in zip(got, results(1), strict=True))
    assert gaps[0].buffers is not None
    mine = buffers(0)
    unpack(gaps[0].buffers, mine)
    assert all(torch.equal(a, b) for a, b in zip(mine, buffers(1), strict=True))
    assert mine[1].dtype == torch.int64


def test_a_rank_behind_with_no_holder_receives_nothing() -> None:
    every = groups(18)

    def run(rank: int) -> Gap:
        return hand_off(every[rank], layout(), behind=rank == 2, held=None,
                        buffers=buffers(rank), watch=None)

    assert on_every_rank(run) == [Gap((2,), None, None, None)] * 3


def test_a_source_lost_mid_broadcast_fails_the_hand_off_on_every_receiver() -> None:
    every = groups(19)

    def run(rank: int) -> CollectiveError | Gap | None:
        group = every[rank]
        if rank == 1:  # the source, by hand: the flags, the first bucket, then it is gone
            group.exchange(torch.tensor([0, 1], dtype=torch.int64), watch=None)
            group.broadcast(results(1)[0].clone(), 1, watch=None)
            group.abandon()
            return None
        try:
            return hand_off(group, layout(), behind=rank == 0,
                            held=None if rank == 0 else results(rank), buffers=buffers(rank),
                            watch=None)
        except CollectiveError as exc:
            return exc

    out = on_every_rank(run)
    assert isinstance(out[0], CollectiveError) and isinstance(out[2], CollectiveError), out


def test_pack_is_exact_for_integers_and_narrow_floats() -> None:
    tensors = [torch.tensor([2**53, -7], dtype=torch.int64),
               torch.tensor([1.1, -3.3], dtype=torch.bfloat16), torch.zeros(0)]
    flat = pack(tensors)
    assert flat.dtype == torch.float64 and flat.numel() == 4
    out = [torch.empty_like(t) for t in tensors]
    unpack(flat, out)
    assert all(torch.equal(a, b) for a, b in zip(out, tensors, strict=True))
