"""The trainer's pure parts: the commit rule, seeding, fault specs, gradient flattening and
the rank-order sum, and reading timelines back; and the transfer server's hook for faults."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from torchpass_p2p.collective import flatten, sum_in_rank_order, unflatten_into
from torchpass_p2p.launch.children import children_of
from torchpass_p2p.trainer import (
    Fault,
    FaultInjector,
    parse_faults,
    resolve,
    step_generator,
    step_seed,
)
from torchpass_p2p.trainer.ends import Diverged
from torchpass_p2p.trainer.loop import FETCH_ATTEMPTS, Trainer
from torchpass_p2p.trainer.service import StateService
from torchpass_p2p.trainer.timeline import read_events, recoveries
from torchpass_p2p.transfer import Snapshot, TransferFailed, TransferKeys, client, fetch

from ..transfer.gated import GatedServer


@pytest.mark.parametrize(("applied", "reduced", "resume", "action"), [
    (37, None, 37, "redo"),          # killed in the gradient all-reduce: nobody has it
    (37, 37, 37, "redo"),            # all-reduce done, nobody committed: drop it
    (37, 37, 38, "roll_forward"),    # someone committed 37: apply the held gradient
    (38, None, 38, "redo"),          # this one already applied 37, blocked in 38
    (37, None, 38, "fetch"),         # cannot happen to a survivor: fall back to a transfer
    (39, None, 38, "fetch"),
])
def test_commit_rule(applied: int, reduced: int | None, resume: int, action: str) -> None:
    got, reason = resolve(applied, reduced, resume)
    assert got == action
    assert reason == resolve(applied, reduced, resume)[1]  # deterministic


def test_commit_rule_reasons_are_exact() -> None:
    assert resolve(5, 5, 6) == ("roll_forward",
                                "step 5 was committed: apply its averaged gradient")
    assert resolve(5, 5, 5) == ("redo", "nobody committed step 5: redo it, dropping the "
                                        "averaged gradient of step 5")


def test_step_seed_is_a_fixed_function_of_seed_rank_step() -> None:
    assert step_seed(1234, 1, 37) == step_seed(1234, 1, 37)
    seeds = {step_seed(1234, r, k) for r in range(4) for k in range(100)}
    assert len(seeds) == 400
    assert all(0 <= s < 1 << 63 for s in seeds)
    a = torch.rand(5, generator=step_generator(1, 2, 3))
    assert torch.equal(a, torch.rand(5, generator=step_generator(1, 2, 3)))
    assert not torch.equal(a, torch.rand(5, generator=step_generator(1, 2, 3, salt=1)))


def test_fault_specs() -> None:
    spec = ("kill@37:grad:rank=1, stop@80:commit:rank=2:8,orphan@5:compute:rank=0,"
            "kill@37:serve:rank=2:0.25,kill@37:enter:rank=3,kill@60:finish:rank=1")
    assert parse_faults(spec) == [Fault("kill", 37, "grad", 1), Fault("stop", 80, "commit", 2, 8.0),
                                  Fault("orphan", 5, "compute", 0),
                                  Fault("kill", 37, "serve", 2, fraction=0.25),
                                  Fault("kill", 37, "enter", 3), Fault("kill", 60, "finish", 1)]
    assert parse_faults("") == []
    for bad in ("kill@x:grad:rank=1", "boom@1:grad:rank=1", "kill@1:nowhere:rank=1",
                "kill@1:grad:r=1", "orphans@1:grad:rank=1", "kill@1:serve:rank=1",
                "kill@1:serve:rank=1:1.5", "stop@1:serve:rank=1:0.5",
                "kill@1:grad:rank=1:2:3", "reset@1:enter:rank=1"):
        with pytest.raises(ValueError, match="bad fault"):
            parse_faults(bad)


def test_flatten_roundtrip_and_missing_grads() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    params[3].grad = None
    flat = flatten(params)
    assert flat.shape == (3 * 4 + 4 + 4 * 2 + 2,) and flat.dtype == torch.float32
    assert torch.count_nonzero(flat[-2:]) == 0
    before = [None if p.grad is None else p.grad.clone() for p in params]
    unflatten_into(flat * 2, params)
    assert torch.equal(params[0].grad, before[0] * 2)
    assert torch.equal(params[3].grad, torch.zeros(2))
    with pytest.raises(ValueError, match="elements"):
        unflatten_into(flat[:-1], params)


def test_sum_in_rank_order_is_left_to_right() -> None:
    parts = [torch.tensor([1e8], dtype=torch.float32), torch.tensor([1.0]),
             torch.tensor([-1e8])]
    assert sum_in_rank_order(parts).item() == 0.0  # (1e8 + 1) - 1e8 in float32
    assert sum_in_rank_order([parts[0], parts[2], parts[1]]).item() == 1.0
    with pytest.raises(ValueError):
        sum_in_rank_order([])


def test_recovery_timeline_from_logs(tmp_path) -> None:
    recs = [
        {"t": 10.0, "event": "step", "member": "a", "step": 36, "config_id": 0},
        {"t": 10.5, "event": "fault", "member": "b", "kind": "kill", "step": 37,
         "point": "grad", "rank": 1, "seconds": 0.0},
        {"t": 12.0, "event": "change", "member": "a", "config_id": 1, "decided_at": 11.9,
         "ready_at": 11.95, "resume_step": 37, "removed": ["b"], "assignments": [[1, "s"]],
         "alerts_at": [9.0, 10.6]},
        {"t": 12.0, "event": "commit_rule", "member": "a", "action": "redo", "config_id": 1},
        {"t": 12.3, "event": "state_fetched", "member": "s", "config_id": 1},
        {"t": 12.4, "event": "group_formed", "member": "a", "config_id": 1},
        {"t": 12.5, "event": "group_formed", "member": "s", "config_id": 1},
        {"t": 12.9, "event": "step", "member": "a", "step": 37, "config_id": 1},
        {"t": 13.0, "event": "step", "member": "s", "step": 37, "config_id": 1},
    ]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[::-1]))
    [f] = recoveries(read_events(tmp_path))
    assert (f.kind, f.rank, f.config_id, f.resume_step, f.last_committed, f.steps_lost,
            f.action) == ("kill", 1, 1, 37, 36, 0, ("redo",))
    assert [round(v, 6) for v in (f.detected_s, f.decided_s, f.transferred_s, f.rebuilt_s,
                                  f.resumed_s)] == [0.1, 1.4, 1.8, 2.0, 2.5]


def test_a_recovery_superseded_before_it_trained_resumes_in_the_next(tmp_path) -> None:
    # Configuration 1 never trained (a source died while serving the spare): the fault's
    # training resumed at its resume step in configuration 2.
    recs = [
        {"t": 10.0, "event": "fault", "member": "b", "kind": "kill", "step": 37,
         "point": "grad", "rank": 1, "seconds": 0.0},
        {"t": 10.2, "event": "change", "member": "a", "config_id": 1, "decided_at": 10.2,
         "ready_at": 10.2, "resume_step": 37, "removed": ["b"], "assignments": [[1, "s"]],
         "alerts_at": [10.1]},
        {"t": 10.4, "event": "change", "member": "a", "config_id": 2, "decided_at": 10.4,
         "ready_at": 10.4, "resume_step": 37, "removed": ["c"], "assignments": [[2, "u"]],
         "alerts_at": [10.3]},
        {"t": 11.0, "event": "step", "member": "a", "step": 37, "config_id": 2},
        {"t": 11.5, "event": "step", "member": "a", "step": 38, "config_id": 2},
    ]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    [f] = recoveries(read_events(tmp_path))
    assert (f.config_id, f.resume_step, f.steps_lost) == (1, 37, 0)
    assert f.resumed_s == 1.0


def test_each_fault_is_matched_with_the_change_that_removed_its_member(tmp_path) -> None:
    # c dies as it enters configuration 1 (b's replacement): logged before some members log
    # configuration 1's change, its own replacement is configuration 2.
    recs = [
        {"t": 10.0, "event": "fault", "member": "b", "kind": "kill", "step": 37,
         "point": "grad", "rank": 1, "seconds": 0.0},
        {"t": 10.2, "event": "fault", "member": "c", "kind": "kill", "step": 37,
         "point": "enter", "rank": 3, "seconds": 0.0},
        {"t": 10.21, "event": "change", "member": "a", "config_id": 1, "decided_at": 10.19,
         "ready_at": 10.2, "resume_step": 37, "removed": ["b"], "assignments": [[1, "s"]],
         "alerts_at": [10.05]},
        {"t": 10.5, "event": "change", "member": "a", "config_id": 2, "decided_at": 10.45,
         "ready_at": 10.5, "resume_step": 37, "removed": ["c"], "assignments": [[3, "u"]],
         "alerts_at": [10.25]},
        {"t": 11.0, "event": "step", "member": "a", "step": 37, "config_id": 2},
    ]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    first, second = recoveries(read_events(tmp_path))
    assert (first.config_id, first.resumed_s) == (1, 1.0)
    assert (second.config_id, round(second.decided_s, 6), round(second.resumed_s, 6)) == (
        2, 0.25, 0.8)


def test_a_serve_fault_fires_once_past_its_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kill@S:serve:rank=R:F`` fires on rank R serving a snapshot of step S or later, once one
    connection was sent F of it; not for another rank, an earlier step or fewer bytes."""
    kills: list[int] = []
    monkeypatch.setattr("torchpass_p2p.trainer.faults.os.kill", lambda pid, sig: kills.append(sig))
    logged: list[tuple[Fault, dict]] = []
    injector = FaultInjector(parse_faults("kill@5:serve:rank=2:0.25"), started_as=2,
                             before=lambda f, **details: logged.append((f, details)))
    assert injector.serving
    injector.served(4, 90, 100, rank=2)  # the state of step 4: not armed yet
    injector.served(5, 90, 100, rank=1)  # another rank
    injector.served(5, 24, 100, rank=2)  # less than a quarter
    injector.served(5, 20, 100, rank=None)  # no rank (a spare before it holds one)
    assert kills == [] and logged == []
    injector.served(6, 25, 100, rank=2)
    assert kills == [signal.SIGKILL] and not injector.serving
    assert logged == [(Fault("kill", 5, "serve", 2, fraction=0.25),
                       {"snapshot_step": 6, "served_bytes": 25, "total_bytes": 100})]
    injector.served(6, 50, 100, rank=2)  # once
    assert len(kills) == 1
    assert not FaultInjector(parse_faults("kill@5:serve:rank=2:0.25"),
                             started_as=None).serving  # a spare never faults


def test_a_fault_fires_only_in_the_process_started_as_its_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Under policy shrink a survivor renumbered to rank 1 redoes step 20: were rank 1's kill
    # armed in it, it would fire again, then in the next one: three ranks dead for one fault.
    kills: list[int] = []
    monkeypatch.setattr("torchpass_p2p.trainer.faults.os.kill", lambda pid, sig: kills.append(sig))
    monkeypatch.setenv("TORCHPASS_FAULTS", "kill@20:grad:rank=1")
    monkeypatch.setenv("TORCHPASS_ROLE", "rank")
    monkeypatch.setenv("RANK", "2")
    renumbered = FaultInjector.from_env()
    assert renumbered.faults == []
    renumbered.at(20, "grad", 1)
    monkeypatch.setenv("RANK", "1")
    FaultInjector.from_env().at(20, "grad", 1)
    assert kills == [signal.SIGKILL]


async def test_the_transfer_server_reports_each_chunk_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook a ``serve`` fault rides on: ``on_served(step, served_bytes, total_bytes)`` after
    each chunk handed to the socket, bytes counted per transfer over all its connections."""
    monkeypatch.setattr(client, "MIN_STREAM_BYTES", 0)  # two connections for 12 KB
    calls: list[tuple[int, int, int]] = []
    keys = TransferKeys(os.urandom(32))
    snap = Snapshot.capture({"w": {"t": torch.arange(3000, dtype=torch.float32)}}, 9,
                            copy=True, chunk_bytes=4096)  # 12000 bytes: 3 chunks, 4096 .. 3808
    # No chunk goes out before both connections of the first receiver ask for one.
    async with GatedServer(keys, lambda: 3, on_served=lambda *a: calls.append(a)) as server:
        server.publish(snap)
        for streams in (2, 1):  # two receivers: counted apart
            got = await fetch([server.address], keys, 3, step=9, window=1, streams=streams)
            assert got.fingerprint == snap.fingerprint()
        assert server.stats["transfers"] == 3
    # Over two connections the chunks go out in either order; their bytes add up per transfer.
    sums = [n for _, n, _ in calls[:3]]
    assert sorted(b - a for a, b in zip([0, *sums[:-1]], sums, strict=True)) == [3808, 4096, 4096]
    assert calls[2] == (9, 12000, 12000)
    assert calls[3:] == [(9, n, 12000) for n in (4096, 8192, 12000)]


def test_a_fetch_past_its_deadline_is_cancelled_and_fails_typed() -> None:
    """A source that accepts and then says nothing (a stopped process): the state service's
    backstop cancels the fetch on its loop and raises TransferFailed("timeout"), which the
    trainer retries, not a bare TimeoutError; the target is untouched."""
    service = StateService(TransferKeys(os.urandom(32)), lambda: 0)
    service.start()
    target = {"w": {"t": torch.zeros(1000)}}
    with socket.create_server(("127.0.0.1", 0)) as silent:
        try:
            with pytest.raises(TransferFailed) as caught:
                service.fetch([silent.getsockname()], 0, step=1, into=target, timeout_s=0.5)
            assert caught.value.reason == "timeout"
            assert not target["w"]["t"].any()
        finally:
            service.close()


def test_a_retried_fetch_holds_nothing_of_the_attempt_before() -> None:
    """Each attempt of the trainer's fetch starts with the memory of the one before freed: the
    last error is kept with its traceback, whose frames must not hold that attempt's target."""
    targets: list[weakref.ref] = []
    alive_at_start = []

    class FailingService:
        def fetch(self, addresses, config_id, *, step, into, on_progress):
            gc.collect()
            alive_at_start.append(sum(r() is not None for r in targets))
            target = torch.empty(1000)  # what a real attempt allocates to receive into
            targets.append(weakref.ref(target))
            raise TransferFailed("no_sources_left", "1 chunks missing")

    trainer = object.__new__(Trainer)  # only what ``_fetch`` uses
    trainer.service = FailingService()
    trainer.objects = {}
    trainer.log = lambda *a, **kw: None
    trainer.history = None  # no status page
    trainer._find_sources = lambda members, config_id: ({("127.0.0.1", 1): members[0]}, set())
    trainer._poll = lambda: False
    with pytest.raises(TransferFailed) as caught:
        trainer._fetch((5,), 3, 9)
    assert caught.value.reason == "no_sources_left"
    assert alive_at_start == [0] * FETCH_ATTEMPTS


def test_a_fetch_from_sources_holding_different_states_stops_at_once() -> None:
    """Two live replicas serve different states at the same step (the script steered one
    apart): no retry can settle which one to take, so the spare stops with Diverged and one
    line that says why, at the first attempt, instead of waiting out the job's give-up time."""
    keys = TransferKeys(os.urandom(32))
    services = [StateService(keys, lambda: 3) for _ in range(3)]
    for s in services:
        s.start()
    try:
        for s, value in zip(services[:2], (1.0, 2.0), strict=False):
            s.publish(Snapshot.capture({"w": {"t": torch.full((100,), value)}}, 9, copy=True))
        fetched = []
        fetcher = services[2]
        trainer = object.__new__(Trainer)  # only what ``_fetch`` uses
        trainer.service = fetcher
        trainer.objects = {"w": {"t": torch.zeros(100)}}
        trainer.log = lambda event, **kw: fetched.append((event, kw.get("what")))
        trainer.history = None  # no status page
        trainer._find_sources = lambda members, config_id: (
            {("127.0.0.1", services[0].port): 5, ("127.0.0.1", services[1].port): 6}, set())
        trainer._poll = lambda: False
        with pytest.raises(Diverged, match=r"configuration 3: the sources of the state at "
                           r"step 9 hold different states \(sources_disagree: no majority "
                           r"fingerprint\): a replica was steered by state that does not "
                           r"move to a spare"):
            trainer._fetch((5, 6), 3, 9)
        assert fetched == [("fetch_started", None), ("diverged", "fetch")]
    finally:
        for s in services:
            s.close()


STOPPED_RANK = """
from torchpass_p2p.trainer.faults import Fault, FaultInjector
FaultInjector([Fault("stop", 1, "grad", 0, 20.0)], started_as=0).at(1, "grad", 0)
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
def test_the_continue_helper_of_a_stop_fault_dies_with_its_rank() -> None:
    # A helper outliving its killed rank would SIGCONT whatever process gets the pid next (a
    # stopped test worker of a later test, say).
    rank = subprocess.Popen([sys.executable, "-c", STOPPED_RANK])
    try:
        deadline = time.monotonic() + 60
        while _state(rank.pid) != "T":
            assert time.monotonic() < deadline and rank.poll() is None
            time.sleep(0.05)
        (helper,) = children_of(rank.pid)
        assert b"kill -CONT" in Path(f"/proc/{helper}/cmdline").read_bytes()
    finally:
        rank.kill()
        rank.wait()
    deadline = time.monotonic() + 10
    while _state(helper) not in ("", "Z"):  # gone, or a zombie until init reaps it
        assert time.monotonic() < deadline, "the helper outlived its rank"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def test_the_main_jobs_loss_curve_merges_the_ranks_and_labels_real_steps() -> None:
    from examples.main_job import loss_curve

    # Each final logs its own rank's losses, for the steps its member trained.
    spare = {"rank": 0, "losses": {"2": 3.0, "3": 2.0}}  # took rank 0 at step 2: listed first
    rank = {"rank": 0, "losses": {"0": 5.0, "1": 4.0, "2": 3.0}}
    other = {"rank": 1, "losses": {"0": 9.0, "1": 9.0, "2": 9.0, "3": 9.0, "4": 9.0}}
    assert loss_curve([spare, other, rank], points=4) == (
        "step 0: 5.000  step 1: 4.000  step 2: 3.000  step 3: 2.000")
    assert loss_curve([spare, other, rank], points=2, rank=1) == "step 0: 9.000  step 4: 9.000"
    assert loss_curve([other], rank=0) == "(none)"
