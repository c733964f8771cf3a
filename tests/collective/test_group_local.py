"""A ManagedGroup in one process (world size 1, gloo): its operations keep the input's device,
and interrupting it while an operation of the caller's own is in flight retires it as stuck
and (world size 2 in two threads) fails that operation and the peer's at once;
``wake()`` ends the wait slice of an operation hung on a silent peer (world size 2 in two
threads). The NCCL wait (completion polled, never the future) against a scripted work
object."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchpass_p2p.collective import CollectiveError, GroupSpec, ManagedGroup, Superseded
from torchpass_p2p.collective import group as group_module

from .gloo_pair import gloo_pair


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


@pytest.mark.timeout(60)
def test_interrupt_fails_the_operations_in_flight_here_and_at_the_peer_at_once() -> None:
    # A state transfer in flight when a newer configuration comes: gloo cannot abort it, and
    # it reports a dead peer often only as a timeout; closing the connections ends the
    # receiver's wait and the peer's (a source waiting for a status) with a closed pair, not
    # after the group's or the transfer's timeout.
    pgs = gloo_pair(timeout_s=600.0)
    g = ManagedGroup(pgs[0], GroupSpec(9, 0, 2, 1), "gloo")
    mine = pgs[0].recv([torch.empty(4)], 1, 2)  # a chunk that rank 1 never sends
    theirs = pgs[1].recv([torch.empty(1)], 0, 3)  # rank 1 waits for a status
    g.interrupt()
    assert g.state == "stuck" and g.process_group is None
    errors = []
    for work in (mine, theirs):
        with pytest.raises(RuntimeError) as e:
            work.wait(datetime.timedelta(seconds=30))
        errors.append(str(e.value))
    assert "pair closure" in errors[0], errors
    assert "closed by peer" in errors[1] or "reset by peer" in errors[1], errors


@pytest.mark.timeout(60)  # a wake that did not end the hour-long slice fails here
def test_wake_runs_the_watch_of_an_operation_hung_on_a_silent_peer_at_once() -> None:
    pgs = gloo_pair(timeout_s=30.0)
    g = ManagedGroup(pgs[0], GroupSpec(8, 0, 2, 1), "gloo")
    changed, watched = threading.Event(), []

    def watch() -> bool:
        watched.append(changed.is_set())
        return changed.is_set()

    def decide() -> None:  # what the agent's thread does when a change is ready
        changed.set()
        g.wake()

    threading.Timer(0.2, decide).start()
    with pytest.raises(Superseded):  # rank 1 never joins the all-reduce
        g.allreduce_sum(torch.ones(2), watch=watch, slice_s=3600.0)
    assert watched == [True] and g.state == "stuck"


class _NcclLikeWork:
    """NCCL's behaviour: the future is complete at once (the kernel was enqueued);
    ``is_completed`` turns true after ``polls`` queries; ``wait`` raises ``error`` if set."""

    def __init__(self, polls: int | None, error: str | None = None) -> None:
        self.polls, self.queries, self.error = polls, 0, error

    def get_future(self) -> Any:
        raise AssertionError("the NCCL wait must not rely on the future")

    def is_completed(self) -> bool:
        self.queries += 1
        return self.polls is not None and self.queries > self.polls

    def wait(self) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return True


class _ScriptedPg:
    def __init__(self, work: _NcclLikeWork) -> None:
        self.work, self.aborted = work, False

    def allreduce(self, tensors: list[torch.Tensor]) -> _NcclLikeWork:
        return self.work

    def abort(self) -> None:
        self.aborted = True


def _nccl_group(work: _NcclLikeWork) -> tuple[ManagedGroup, _ScriptedPg]:
    pg = _ScriptedPg(work)
    return ManagedGroup(pg, GroupSpec(3, 0, 1, 1), "nccl", device=torch.device("cpu")), pg


def test_nccl_wait_polls_completion_until_the_work_is_done() -> None:
    work = _NcclLikeWork(polls=5)
    g, _ = _nccl_group(work)
    g.allreduce_sum(torch.ones(2))
    assert work.queries == 6 and g.state == "ready"


def test_nccl_wait_for_a_hung_peer_is_superseded_and_aborts_the_group() -> None:
    work = _NcclLikeWork(polls=None)  # never completes: a peer hangs
    g, pg = _nccl_group(work)
    before = len(group_module._STUCK)
    watched = []

    def watch() -> bool:
        watched.append(work.queries)
        return len(watched) == 3

    with pytest.raises(Superseded):
        g.allreduce_sum(torch.ones(2), watch=watch, slice_s=0.005)
    assert len(watched) == 3 and watched[0] > 1  # polled between watches
    assert g.state == "stuck" and pg.aborted
    assert len(group_module._STUCK) == before + 1 and group_module._STUCK[-1][1] is work


@pytest.mark.timeout(60)
def test_nccl_wait_runs_the_watch_at_the_first_poll_after_a_wake() -> None:
    work = _NcclLikeWork(polls=None)
    g, _ = _nccl_group(work)
    g.wake()  # a change became ready between two operations
    with pytest.raises(Superseded):
        g.allreduce_sum(torch.ones(2), watch=lambda: True, slice_s=3600.0)
    assert work.queries == 1


def test_nccl_error_seen_at_completion_fails_the_group() -> None:
    g, _ = _nccl_group(_NcclLikeWork(polls=0, error="NCCL error: remote process exited"))
    with pytest.raises(CollectiveError, match="configuration 3: RuntimeError: NCCL error"):
        g.allreduce_sum(torch.ones(2))
    assert g.state == "failed" and g.process_group is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_nccl_group_of_one_completes_its_operations_by_polling() -> None:
    # Real WorkNCCL objects through the polled wait: results right, on the input's device.
    spec = GroupSpec(5, 0, 1, 1)
    device = torch.device("cuda", 0)
    g = ManagedGroup(group_module._make_pg("nccl", dist.HashStore(), spec, device), spec,
                     "nccl", device=device)
    x = torch.arange(6, dtype=torch.float32)
    [y] = g.allgather(x)
    assert y.device == x.device and torch.equal(y, x)
    z = g.mean_in_rank_order(x.cuda())
    assert z.is_cuda and torch.equal(z.cpu(), x)
    g.close()


@pytest.mark.timeout(60)
def test_a_group_given_up_while_forming_counts_as_stuck_until_its_thread_ends(
        tmp_path: Any) -> None:
    # The rendezvous thread of a superseded build waits out its store timeout inside the
    # backend; until it ends, the process's exit must skip the interpreter's teardown
    # (torchpass_p2p.ddp's atexit hook reads stuck_groups()).
    from tests.collective.files_directory import FileDirectory
    from torchpass_p2p.collective import StoreKeeper, build_group

    before = group_module.stuck_groups()
    keeper = StoreKeeper()
    spec = GroupSpec(3, 0, 2, 11)  # rank 0 of 2: rank 1 never comes
    keeper.host_store(3)
    directory = FileDirectory(tmp_path, 11)
    directory.register_service("store", 3, keeper.host_store(3).port)
    t0 = time.monotonic()
    with pytest.raises(Superseded):
        build_group(spec, directory, keeper, watch=lambda: time.monotonic() - t0 > 0.3,
                    slice_s=0.05, timeout_s=3.0)
    assert group_module.stuck_groups() == before + 1
    # The backend waits for rank 1 for its own timeout (half an hour); rank 1 arriving ends
    # the helper thread, and the count with it.
    late = build_group(GroupSpec(3, 1, 2, 11), FileDirectory(tmp_path, 12), StoreKeeper(),
                       timeout_s=10.0)
    deadline = time.monotonic() + 30
    while group_module.stuck_groups() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_module.stuck_groups() == before
    late.abandon()
    keeper.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.uint8])
def test_exchange_gives_every_ranks_tensor_as_its_rows_bitwise(dtype: torch.dtype) -> None:
    pgs = gloo_pair(timeout_s=30.0)
    groups = [ManagedGroup(pg, GroupSpec(11, r, 2, 1), "gloo") for r, pg in enumerate(pgs)]
    sent = [(torch.randn(3, 5, generator=torch.Generator().manual_seed(r)) * 100).to(dtype)
            for r in (0, 1)]
    got: list[Any] = [None, None]

    def run(r: int) -> None:
        got[r] = groups[r].exchange(sent[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = torch.stack([s.reshape(-1) for s in sent])
    for rows in got:
        assert rows.shape == (2, 15) and rows.dtype == dtype
        assert torch.equal(rows.view(torch.uint8), expected.view(torch.uint8))
    for g in groups:
        g.close()
