"""The rank-order mean: shards cut and restored exactly, and the sharded reduction across real
gloo processes gives the same bits as gathering whole buffers."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchpass_p2p.collective import GroupSpec, ManagedGroup, sum_in_rank_order
from torchpass_p2p.collective.group import SHARDED_MIN_BYTES
from torchpass_p2p.collective.reduce import divide, from_shards, shard_sizes, to_shards


def test_shards_are_contiguous_pieces_padded_with_zeros() -> None:
    x = torch.arange(1, 8, dtype=torch.float64).view(7, 1)
    shards = to_shards(x, 3)
    assert shards.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 0.0, 0.0]]
    back = from_shards(shards, x)
    assert back.shape == (7, 1) and torch.equal(back, x)
    assert to_shards(x, 1).tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    assert to_shards(torch.ones(2), 4).tolist() == [[1.0], [1.0], [0.0], [0.0]]


def test_shard_errors() -> None:
    with pytest.raises(ValueError, match="world_size 0"):
        to_shards(torch.ones(3), 0)
    with pytest.raises(ValueError, match="2 elements for a tensor of 3"):
        from_shards(torch.ones(2, 1), torch.ones(3))


def test_divide_is_ieee_division_not_a_reciprocal_multiply() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    exact = x / torch.full_like(x, 3.0)
    assert not torch.equal(x * (1 / 3), exact)  # the two differ for these inputs
    got = divide(x.clone(), 3)
    assert torch.equal(got, exact) and got.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_divide_gives_the_cpu_bits_on_cuda() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    assert torch.equal(divide(x.cuda(), 3).cpu(), divide(x.clone(), 3))


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # wide exponents, so a different summation order would change low bits
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(numel, generator=g, dtype=torch.float64)
            * torch.pow(10.0, torch.randint(-6, 7, (numel,), generator=g))).to(dtype)


def _worker(rank: int, world: int, port: int, numel: int, out: dict) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=30))
    group = ManagedGroup(pg, GroupSpec(1, rank, world, 0), "gloo")
    for dtype in (torch.float32, torch.float64):
        mean = group.mean_in_rank_order(_inputs(rank, numel, dtype).view(-1, 1))
        out[(rank, str(dtype))] = mean
    group.close()


@pytest.mark.timeout(120)
def test_sharded_mean_equals_the_rank_order_sum_bit_for_bit() -> None:
    world = 3
    numel = SHARDED_MIN_BYTES // 4 + 7  # above the threshold, not divisible by the world size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.get_context("spawn").Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(world, port, numel, out), nprocs=world,
                           start_method="spawn")
        results = dict(out)
    for dtype in (torch.float32, torch.float64):
        expected = sum_in_rank_order([_inputs(r, numel, dtype) for r in range(world)])
        expected = expected.div_(world).view(-1, 1)
        # not a vacuous check: another order gives other bits for these inputs
        other = sum_in_rank_order([_inputs(r, numel, dtype) for r in (2, 1, 0)]).div_(world)
        assert not torch.equal(other.view(-1, 1), expected)
        for rank in range(world):
            got = results[(rank, str(dtype))]
            assert got.dtype == dtype and got.shape == (numel, 1)
            assert torch.equal(got, expected), (rank, dtype)


def test_shard_sizes_are_the_unpadded_lengths_of_the_shards() -> None:
    assert shard_sizes(7, 3) == (3, 3, 1)
    assert shard_sizes(9, 4) == (3, 3, 3, 0)
    assert shard_sizes(2, 4) == (1, 1, 0, 0)
    assert shard_sizes(263_000, 3) == (87_667, 87_667, 87_666)
    x = torch.arange(10.0)
    for n in (1, 3, 4, 7):
        rows = to_shards(x, n)
        pieces = torch.split(x, list(shard_sizes(10, n)))
        assert len(pieces) == n
        for row, piece in zip(rows, pieces, strict=True):
            assert torch.equal(row[:piece.numel()], piece)
