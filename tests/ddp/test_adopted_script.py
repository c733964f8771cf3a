"""The adopted torchrun script end to end: ``examples/torchpass_ddp.py`` (a Dataset, a
DataLoader with a shuffled DistributedSampler and two workers, DDP, bf16 autocast with a
GradScaler, clipping, an LR scheduler, epochs and its own ``torch.save`` snapshots) under the
launcher with four ranks and two spares, once without faults and once with a SIGKILL of rank 1
in the middle of epoch 1 (its peers inside the gradient reduction) and a SIGSTOP of rank 2 at
its commit, held past its lease; and once with a transient failure of rank 2 once every vote of
a step is in, which leaves it inside a step the others committed.

Must hold: the faulty run exits 0; no step is lost or run twice by a survivor; every finished
member's state (model, optimizer, scheduler, scaler, data position) has the fault-free run's
fingerprint; the script's own last snapshot is bitwise the fault-free one; the spare that
took rank 1 started with the batch rank 1 would have taken next; and the rank left behind is
handed the committed gradient and statistics and applies the step once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples.main_job import REPO, Run, launch
from tests.ddp.states import bitwise_equal, events, flat

SCRIPT = REPO / "examples" / "torchpass_ddp.py"
EPOCHS = 3
STEPS = 96  # 4096 samples, 4 ranks, batches of 32: 32 steps an epoch
FAULTS = "kill@40:grad:rank=1,stop@75:commit:rank=2:8"


def run(work: Path, faults: str = "") -> tuple[Run, Path]:
    snapshot = work / "snapshot.pt"
    result = launch(work, SCRIPT, ("--epochs", str(EPOCHS), "--snapshot", str(snapshot)),
                    nproc=4, spares=2, faults=faults, timeout_s=240)
    return result, snapshot


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    return run(tmp_path_factory.mktemp("clean"))








@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_and_a_stopped_rank_are_replaced_exactly(
        tmp_path: Path, clean: tuple[Run, Path]) -> None:
    (free, free_snapshot), (faulty, snapshot) = clean, run(tmp_path, FAULTS)
    assert free.code == 0, free.diagnosis()
    assert faulty.code == 0, faulty.diagnosis()

    # Every member that finished holds the fault-free final state, at the last step.
    [reference] = {r["fingerprint"] for r in events(free, "finished")}
    finished = events(faulty, "finished")
    assert len(finished) == 4 and {r["step"] for r in finished} == {STEPS}
    assert {r["fingerprint"] for r in finished} == {reference}
    # The script's own snapshot (model, optimizer, scheduler, scaler, epochs run) too.
    mine, theirs = flat(torch.load(snapshot)), flat(torch.load(free_snapshot))
    assert mine.keys() == theirs.keys() and len(mine) > 50
    assert all(bitwise_equal(mine[k], theirs[k]) for k in mine)

    # No step lost, none run twice: each member commits its steps in order, once each,
    # and together the four ranks committed every step.
    by_member: dict[str, list[int]] = {}
    for r in events(faulty, "step"):
        by_member.setdefault(r["member"], []).append(r["step"])
    assert all(steps == sorted(set(steps)) for steps in by_member.values())
    assert set().union(*map(set, by_member.values())) == set(range(STEPS))

    # Both faults fired, two spares took ranks 1 and 2, and the stopped member was removed.
    assert {(r["kind"], r["step"], r["rank"]) for r in events(faulty, "fault")} == {
        ("kill", 40, 1), ("stop", 75, 2)}
    stopped = {r["member"] for r in events(faulty, "fault") if r["kind"] == "stop"}
    assert stopped and not stopped & {r["member"] for r in finished}

    # The spare that took rank 1 started where rank 1 stood: the same step, epoch and batch
    # of the same loader as rank 1 took at that step in the fault-free run.
    spares = {r["member"] for r in events(faulty, "spare_waiting")}
    first = {}
    for r in events(faulty, "step_started"):
        if r["member"] in spares:
            first.setdefault(r["member"], r)
    # Rank 1 died before its last bucket and vote left: nobody committed 40. Rank 2 stopped
    # at its commit point, once every vote was in: the others committed 75.
    [(rank_1, step_1), (rank_2, step_2)] = sorted((r["rank"], r["step"]) for r in first.values())
    assert (rank_1, step_1, rank_2, step_2) == (1, 40, 2, 76)
    for r in first.values():
        [expected] = [e for e in events(free, "step_started")
                      if (e["rank"], e["step"]) == (r["rank"], r["step"])]
        assert (r["epoch"], r["positions"]) == (expected["epoch"], expected["positions"])
    assert first_of_rank(first, 1)["positions"] == [[1, 8]]  # epoch 1, its 9th batch

    # The console says each takeover in one line (the timeline above is in the log folder).
    took = sorted(line for line in faulty.output.splitlines() if " took rank " in line)
    joined: dict[str, dict[str, Any]] = {}  # a spare's first join: the one with the fetch
    for r in events(faulty, "joined"):
        if r["member"] in spares:
            joined.setdefault(r["member"], r)
    assert len(took) == 2 and took == sorted(
        f"torchpass_p2p: member {r['member']} took rank {r['rank']} at step {r['step']} "
        f"(configuration {r['config_id']})" for r in joined.values())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_left_inside_a_committed_step_is_handed_its_gradient_and_statistics(
        tmp_path: Path, clean: tuple[Run, Path]) -> None:
    """Rank 2's collective fails at step 50 once every vote is in, before it took its averaged
    gradient (``reset@50:commit``): the others commit step 50 and fail in step 51; rank 2 is
    left inside step 50. In the regroup rank 0 hands it step 50's averaged gradient and its
    BatchNorm statistics (rank 0's, which the committed vote gave every committer: rank 2's
    own differ), rank 2's script applies the step, and the job ends with the fault-free
    state, snapshot included."""
    (free, free_snapshot), (faulty, snapshot) = clean, run(tmp_path, "reset@50:commit:rank=2")
    assert faulty.code == 0, faulty.diagnosis()
    [reference] = {r["fingerprint"] for r in events(free, "finished")}
    finished = events(faulty, "finished")
    assert len(finished) == 4 and {r["fingerprint"] for r in finished} == {reference}
    mine, theirs = flat(torch.load(snapshot)), flat(torch.load(free_snapshot))
    assert all(bitwise_equal(mine[k], theirs[k]) for k in mine)
    handed = events(faulty, "gradient_handed")
    assert len(handed) == 4 and {(r["step"], tuple(r["behind"]), r["source"])
                                 for r in handed} == {(50, (2,), 0)}
    done = events(faulty, "regroup_done")
    assert sorted((r["rank"], r["step"], r["action"]) for r in done) == [
        (0, 51, "redo"), (1, 51, "redo"), (2, 51, "roll_forward"), (3, 51, "redo")]
    steps = [r["step"] for r in events(faulty, "step") if r["rank"] == 2]
    assert steps == list(range(STEPS))  # step 50 once, by the roll forward


def first_of_rank(first: dict[str, dict[str, Any]], rank: int) -> dict[str, Any]:
    [record] = [r for r in first.values() if r["rank"] == rank]
    return record
