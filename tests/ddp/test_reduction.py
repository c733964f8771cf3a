"""The step's reduction in the canonical layout (torchpass_p2p/ddp/reduction.py), over real
gloo groups of three ranks built in threads of one process.

Must hold: the result does not depend on the order or grouping in which DDP hands over the
gradients (each rank fills in another order, as a spare's first-iteration bucket and rebuilt
buckets do); it is bitwise the rank-order mean of the whole flat gradient, through gathered and
sharded buckets alike; reducing the kept inputs again on another group gives the same bits.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchpass_p2p.collective import GroupSpec, ManagedGroup
from torchpass_p2p.collective.reduce import divide, sum_in_rank_order
from torchpass_p2p.ddp.reduction import Layout, StepReduction

N = 3
# 1 MiB of float32 in one parameter: its bucket is summed in shards.
SHAPES = [(7, 5), (5,), (300, 1024), (64, 3), (3,), (11,)]


def groups(config_id: int) -> list[ManagedGroup]:
    store, pgs = dist.HashStore(), [None] * N

    def connect(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(store, rank, N, datetime.timedelta(seconds=30))

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [ManagedGroup(pg, GroupSpec(config_id, r, N, 0), "gloo") for r, pg in enumerate(pgs)]


def on_every_rank(fn: Callable[[int], Any]) -> list[Any]:
    out: list[Any] = [None] * N
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.empty(s)) for s in SHAPES]


def gradients(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(s, generator=g) * 10 ** (rank - 1) for s in SHAPES]


def layout() -> Layout:
    return Layout.of(params(), first_bytes=16, bytes_cap=512)


def one_step(reduction: StepReduction, group: ManagedGroup, grads: list[torch.Tensor],
             world_size: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A new step of ``reduction`` over ``grads`` (``world_size`` as for ``reset``): its
    results per bucket, and the averaged gradient per parameter (written out as DDP would be
    handed it)."""
    reduction.reset(world_size)
    for i, g in enumerate(grads):
        reduction.fill(i, g)
    reduction.launch_ready(group, None)
    results = reduction.wait(group, None)
    out = [torch.empty(s) for s in SHAPES]
    for i, g in enumerate(out):
        reduction.copy_out(results, i, g)
    return results, out


def test_the_layout_is_a_function_of_the_parameters() -> None:
    a, b = layout(), layout()
    assert a == b
    assert len(a.sizes) >= 4
    # Reverse order: the last parameter starts the first bucket.
    assert a.where[len(SHAPES) - 1] == (0, 0, 11)
    assert sum(a.sizes) == sum(torch.Size(s).numel() for s in SHAPES)


def test_any_filling_order_gives_the_flat_rank_order_mean_bitwise() -> None:
    every = groups(1)
    orders = [list(range(len(SHAPES))), list(reversed(range(len(SHAPES)))), [2, 0, 5, 1, 4, 3]]

    def step(rank: int) -> list[torch.Tensor]:
        reduction = StepReduction(layout(), exact=True)
        reduction.reset()
        grads = gradients(rank)
        for i in orders[rank]:
            reduction.fill(i, grads[i])
            reduction.launch_ready(every[rank], None)
        assert reduction.filled
        results = reduction.wait(every[rank], None)
        out = [torch.empty(s) for s in SHAPES]
        for i, g in enumerate(out):
            reduction.copy_out(results, i, g)
        return out

    outs = on_every_rank(step)
    flat = [torch.cat([g.reshape(-1) for g in gradients(r)]) for r in range(N)]
    expected = divide(sum_in_rank_order(flat), N)
    for out in outs:
        got = torch.cat([g.reshape(-1) for g in out])
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_the_kept_inputs_reduce_again_on_another_group_to_the_same_bits() -> None:
    first, second = groups(2), groups(3)

    def step(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        reduction = StepReduction(layout(), exact=True)
        reduction.reset()
        for i, g in enumerate(gradients(rank)):
            reduction.fill(i, g)
        reduction.launch_ready(first[rank], None)
        before = [r.clone() for r in reduction.wait(first[rank], None)]
        reduction.relaunch(second[rank], None)
        return before, reduction.wait(second[rank], None)

    for before, after in on_every_rank(step):
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "native"])
@pytest.mark.parametrize("last", ["gathered", "sharded"])
def test_the_vote_rides_in_a_gathered_last_bucket_and_the_gradient_is_the_same_bits(
        exact: bool, last: str) -> None:
    # The last canonical bucket holds the first parameter: 1 MiB of float32 makes it sharded.
    shapes = [(3,), (300, 1024), (5,)] if last == "gathered" else [(300, 1024), (3,), (5,)]
    lay = Layout.of([torch.nn.Parameter(torch.empty(s)) for s in shapes],
                    first_bytes=16, bytes_cap=512)
    every = groups(12 if exact else 13)

    def step(rank: int) -> tuple[list[bool], list[list[list[float]]]]:
        group = every[rank]
        reduction = StepReduction(lay, exact=exact)
        reduction.reset(N)
        g = torch.Generator().manual_seed(rank)
        for i, s in enumerate(shapes):
            reduction.fill(i, torch.randn(s, generator=g))
        rode, rows, results = [], [], []
        # the vote, a redo's vote on the same group, then the reduction without one
        for attempt, vote in enumerate([torch.tensor([rank, 0.5, -1e300], dtype=torch.float64),
                                        torch.tensor([rank, 1.5, 2.0], dtype=torch.float64),
                                        None]):
            ballot = (reduction.launch_ready(group, None, vote) if attempt == 0
                      else reduction.relaunch(group, None, vote))
            results.append(torch.cat(reduction.wait(group, None)))
            if ballot is None:
                continue
            if ballot.work is not None:
                group.complete(ballot.work)
            rode.append(ballot.work is None)
            rows.append(ballot.rows.tolist())
        assert all(torch.equal(r.view(torch.int32), results[2].view(torch.int32))
                   for r in results)
        return rode, rows

    for rode, rows in on_every_rank(step):
        assert rode == [last == "gathered"] * 2
        assert rows == [[[r, 0.5, -1e300] for r in range(N)], [[r, 1.5, 2.0] for r in range(N)]]


def test_native_mode_averages_with_the_backends_all_reduce() -> None:
    every = groups(5)

    def step(rank: int) -> list[torch.Tensor]:
        return one_step(StepReduction(layout(), exact=False), every[rank], gradients(rank))[1]

    outs = on_every_rank(step)
    flat = [torch.cat([g.reshape(-1) for g in gradients(r)]) for r in range(N)]
    expected = divide(sum_in_rank_order(flat), N)
    for out in outs:
        got = torch.cat([g.reshape(-1) for g in out])
        torch.testing.assert_close(got, expected)
    assert all(torch.equal(outs[0][i], o[i]) for o in outs for i in range(len(SHAPES)))


def test_consecutive_steps_reuse_the_buffers_and_each_gives_its_own_mean() -> None:
    """A step's operation buffers serve the next step (no page faults for a fresh bucket),
    and nothing of the last step's shards, padding or sums leaks into the next result."""
    every = groups(6)

    def steps(rank: int) -> list[tuple[list[torch.Tensor], list[int]]]:
        reduction = StepReduction(layout(), exact=True)
        out = []
        for k in range(3):
            results, grads = one_step(reduction, every[rank], gradients(rank + N * k))
            out.append((grads, [r.data_ptr() for r in results]))
        return out

    per_rank = on_every_rank(steps)
    for k in range(3):
        flat = [torch.cat([g.reshape(-1) for g in gradients(r + N * k)]) for r in range(N)]
        expected = divide(sum_in_rank_order(flat), N)
        for rank_steps in per_rank:
            got = torch.cat([r.reshape(-1) for r in rank_steps[k][0]])
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    sharded = [b for b, n in enumerate(layout().sizes) if 4 * n >= 1 << 20]
    assert sharded  # the layout has a bucket summed in shards
    for rank_steps in per_rank:
        assert [rank_steps[1][1][b] for b in sharded] == [rank_steps[0][1][b] for b in sharded]


def test_the_results_handed_out_stay_intact_through_the_next_step() -> None:
    """A member that committed step k hands its results to a peer whose reduction of k failed
    while it is itself inside step k + 1 (torchpass_p2p/ddp/handoff.py): the next step's
    reduction must not write them. Step k + 2 reuses step k's buffers, in both modes."""
    every = groups(15)
    big = [b for b, n in enumerate(layout().sizes) if 4 * n >= 1 << 20]
    assert big  # a bucket summed in shards (exact) or all-reduced in place (native)

    def steps(rank: int) -> list[tuple[bool, list[int], list[int], list[int]]]:
        out = []
        for exact in (True, False):
            reduction = StepReduction(layout(), exact=exact)
            first, _ = one_step(reduction, every[rank], gradients(rank))
            reduction.hand_out(first)
            copy = [r.clone() for r in first]
            second, _ = one_step(reduction, every[rank], gradients(rank + N))
            intact = (all(torch.equal(a, b) for a, b in zip(first, copy, strict=True))
                      and not all(torch.equal(a, b) for a, b in zip(first, second, strict=True)))
            assert reduction.held is first
            reduction.hand_out(second)
            assert reduction.held is second
            third, _ = one_step(reduction, every[rank], gradients(rank + 2 * N))
            out.append((intact, *([r.data_ptr() for r in results]
                                  for results in (first, second, third))))
        return out

    for per_mode in on_every_rank(steps):
        for intact, first, second, third in per_mode:
            assert intact
            assert [third[b] for b in big] == [first[b] for b in big]
            assert not {second[b] for b in big} & {first[b] for b in big}


def test_forgetting_a_step_gives_the_redo_new_buffers() -> None:
    """An abandoned operation may still write into its buffers: after ``forget`` the redo's
    results live in new storage, while the held results keep their bits."""
    every = groups(7)

    def step(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[int]]:
        reduction = StepReduction(layout(), exact=True)
        reduction.reset()
        for i, g in enumerate(gradients(rank)):
            reduction.fill(i, g)
        reduction.launch_ready(every[rank], None)
        held = reduction.wait(every[rank], None)
        copy = [r.clone() for r in held]
        reduction.forget()
        reduction.launch_ready(every[rank], None)
        again = reduction.wait(every[rank], None)
        return held, copy, [r.data_ptr() for r in held], [r.data_ptr() for r in again]

    for held, copy, before, after in on_every_rank(step):
        assert all(torch.equal(a, b) for a, b in zip(held, copy, strict=True))
        assert not set(before) & set(after)


def test_native_mode_reduces_its_local_gradients_again_after_forget() -> None:
    """A native bucket's all-reduce overwrites its input with the sum: after ``forget`` (a
    group given up) the input is the local gradient again. Rank 2 redoes the step with a new
    reduction, as a spare that joined would; were the others to send their sums, the redo's
    mean would be off by a third of the spread between ranks."""
    first, second = groups(8), groups(9)
    summed = [b for b, n in enumerate(layout().sizes) if 4 * n >= 1 << 20]  # all-reduced
    assert summed

    def step(rank: int) -> list[torch.Tensor]:
        reduction = StepReduction(layout(), exact=False)
        grads = gradients(rank)
        one_step(reduction, first[rank], grads)
        if rank == 2:
            return one_step(StepReduction(layout(), exact=False), second[rank], grads)[1]
        # held as an abandoned operation holds its buffers (freed, an address may be reused)
        kept = [reduction.input_of(b) for b in summed]
        given_up = {t.data_ptr() for t in kept}
        reduction.relaunch(second[rank], None)
        results = reduction.wait(second[rank], None)
        out = [torch.empty(s) for s in SHAPES]
        for i, g in enumerate(out):
            reduction.copy_out(results, i, g)
        reduction.reset()  # the next step never fills storage a given-up group may write
        assert not given_up & {reduction.input_of(b).data_ptr() for b in summed}
        return out

    flat = [torch.cat([g.reshape(-1) for g in gradients(r)]) for r in range(N)]
    expected = divide(sum_in_rank_order(flat), N)
    for out in on_every_rank(step):
        torch.testing.assert_close(torch.cat([g.reshape(-1) for g in out]), expected)


def test_native_mode_divides_as_it_fills_and_refills_for_another_world_size() -> None:
    """Native mode divides each gradient by the world size given to ``reset`` as it copies it
    in. Filled for a world size the group does not have (the configuration changed meanwhile),
    every bucket is written again for the group's at its launch: were it not, the mean would
    be the sum over four ranks' worth. Both ways give the same bits."""
    first, second = groups(11), groups(12)

    def step(rank: int) -> list[torch.Tensor]:
        means = []
        for world_size, group in ((N, first[rank]), (N + 1, second[rank])):
            reduction = StepReduction(layout(), exact=False)
            out = one_step(reduction, group, gradients(rank), world_size)[1]
            means.append(torch.cat([g.reshape(-1) for g in out]))
        return means

    flat = [torch.cat([g.reshape(-1) for g in gradients(r)]) for r in range(N)]
    expected = divide(sum_in_rank_order(flat), N)
    for right, refilled in on_every_rank(step):
        assert torch.equal(right, refilled)
        torch.testing.assert_close(right, expected)


def test_exact_mode_reduces_a_whole_ddp_bucket_where_it_lies_and_again_on_a_new_group() -> None:
    """A DDP bucket that is a whole canonical bucket is the exact reduction's input itself (no
    copy): its all-to-all sends shards of uneven length (263,000 elements over three ranks)
    straight from it, and a redo on another group reads it again. Both reductions and the
    hook's future give the rank-order mean bitwise."""
    shapes = [(5,), (1000, 263)]
    sharded = Layout.of([torch.nn.Parameter(torch.empty(s)) for s in shapes],
                        first_bytes=16, bytes_cap=512)
    assert sharded.sizes == (263_000, 5)
    first, second = groups(13), groups(14)

    def grads_of(rank: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        return [torch.randn(s, generator=g) * 10 ** (rank - 1) for s in shapes]

    def step(rank: int) -> list[torch.Tensor]:
        grads = grads_of(rank)
        reduction = StepReduction(sharded, exact=True)
        reduction.reset()
        bucket = grads[1].reshape(-1).clone()  # DDP's buffer
        future = reduction.fill_bucket([1], [bucket.view(shapes[1])], bucket)
        reduction.fill(0, grads[0])
        assert reduction.input_of(0).data_ptr() == bucket.data_ptr()
        reduction.launch_ready(first[rank], None)
        before = [r.clone() for r in reduction.wait(first[rank], None)]
        reduction.relaunch(second[rank], None)
        after = reduction.wait(second[rank], None)
        reduction.hand_out(after)
        assert torch.equal(bucket, grads[1].reshape(-1))  # only read
        return [*before, *after, future.value()]

    expected = [divide(sum_in_rank_order([grads_of(r)[i].reshape(-1) for r in range(N)]), N)
                for i in (1, 0)]
    for before0, before1, after0, after1, handed in on_every_rank(step):
        for got, want in ((before0, expected[0]), (before1, expected[1]),
                          (after0, expected[0]), (after1, expected[1]), (handed, expected[0])):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("norm", [False, True], ids=["linear", "batchnorm"])
def test_ddps_own_buckets_get_the_reduced_gradient_through_the_hook_before_and_after_rebuild(
        norm: bool) -> None:
    """torch DDP's real buckets, on a group of one: each hook hands its bucket to
    ``fill_bucket``, the last one reduces and hands every result out. In the first iteration
    DDP's one bucket holds the parameters in registration order (a piece per parameter); once
    rebuilt, DDP's buckets are the canonical ones, since a stack of layers gives its gradients
    in reverse registration order (one piece each: its result a view DDP copies from), except
    where a BatchNorm's weight reaches DDP before its bias (three pieces). Every way gives
    every parameter its plain autograd gradient, bitwise (the mean over one rank)."""
    from torchpass_p2p.ddp.model import _local_group

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(),
                              *([torch.nn.BatchNorm1d(256)] if norm else []),
                              torch.nn.Linear(256, 1024), torch.nn.Tanh(),
                              torch.nn.Linear(1024, 8))
    plain = deepcopy(net)
    [group] = groups_of_one()
    ddp = torch.nn.parallel.DistributedDataParallel(net, process_group=_local_group(),
                                                    bucket_cap_mb=0.5)
    params = list(net.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    reduction = StepReduction(Layout.of(params, first_bytes=1 << 20, bytes_cap=1 << 19),
                              exact=True)
    pieces: list[int] = []

    def hook(_state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        indices = [index[id(p)] for p in bucket.parameters()]
        pieces.append(len(reduction._pieces_of(tuple(indices))))
        future = reduction.fill_bucket(indices, bucket.gradients(), bucket.buffer())
        reduction.launch_ready(group, None)
        if bucket.is_last():
            reduction.hand_out(reduction.wait(group, None))
        return future

    ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))  # unannotated
    per_iteration = []
    for k in range(3):
        x = torch.randn(32, 16)
        reduction.reset()
        pieces.clear()
        ddp(x).square().mean().backward()
        plain.zero_grad()
        plain(x).square().mean().backward()
        per_iteration.append(list(pieces))
        for p, q in zip(params, plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), k
        ddp.zero_grad()
    # one bucket of everything first, then the canonical buckets
    rebuilt = [1, 3] if norm else [1, 1]
    assert per_iteration == [[len(params)], rebuilt, rebuilt]


def groups_of_one() -> list[ManagedGroup]:
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    return [ManagedGroup(pg, GroupSpec(10, 0, 1, 0), "gloo")]
