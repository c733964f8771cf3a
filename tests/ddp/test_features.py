"""What a real DDP script does, each feature on its own, under the launcher with 3 ranks and a
spare (``tests/ddp/feature_worker.py``): gradient accumulation with ``no_sync()``, optimizer
parameter groups, an unused parameter (``find_unused_parameters=True``), one used by some ranks
in some steps only (the others must still receive its averaged gradient), a ``torch.compile``d
DDP model (inductor), the script's own ``torch.distributed.checkpoint`` saves, and native mode
(``exact=False``) with a bucket that takes the backend's all-reduce.

For each feature: a fault-free run, and a run in which rank 1 is SIGKILLed in the middle of
step ``KILL_AT`` (epoch 1, its peers inside the gradient reduction). Must hold: both exit 0;
every member of the faulty run finishes at the last step with the fault-free run's state
fingerprint (model, optimizer, scheduler, data position); no member commits a step twice and
together the ranks commit every step; the spare took rank 1 at that step, at the batch rank 1
took there in the fault-free run. With DCP, every checkpoint the script saved (each rank, each
epoch; the spare's for rank 1 in epoch 1) is bitwise the fault-free run's.

And the job agreement: a process whose script describes another job (the one started as rank
2 runs 3 epochs, the others 2) is refused at its join with exit code 5 and one line naming the
difference; the spare takes its rank and the job ends with the fault-free state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.main_job import Run, launch
from tests.ddp.states import bitwise_equal, events, flat
from torchpass_p2p.launch.outcome import EXIT_STOPPED

WORKER = Path(__file__).with_name("feature_worker.py")
STEPS = 20  # two epochs of 10 optimizer steps
KILL_AT = 13
FAULTS = f"kill@{KILL_AT}:grad:rank=1"
FEATURES: dict[str, tuple[str, ...]] = {
    # 2 micro-batches per step: 480 samples, 3 ranks, batches of 8 -> 20 batches an epoch
    "accumulation": ("--accum", "2", "--samples", "480"),
    "param_groups": ("--groups",),
    "unused_parameter": ("--unused",),
    "unused_on_some_ranks": ("--unused", "--sometimes"),
    "compile": ("--compile", "inductor"),
    "dcp": ("--dcp",),  # followed by the run's checkpoint folder
    # the first layer's weight (2 MiB) is reduced by gloo's all-reduce, in place: the
    # survivors' redo of the killed step must send their own gradients again, not the sums
    "native": ("--native", "--hidden", "65536"),
    "own_lr": ("--own-lr",),  # steered by a counter of its own: refused after a replacement
}
RUN_TIMEOUT_S = 90.0


def worker_args(feature: str, work: Path) -> tuple[str, ...]:
    args = FEATURES[feature]
    return (*args, str(work / "dcp")) if feature == "dcp" else args


def run(work: Path, feature: str, faults: str = "", more: tuple[str, ...] = ()) -> Run:
    return launch(work, WORKER, (*worker_args(feature, work), *more), nproc=3, spares=1,
                  faults=faults, timeout_s=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Run, Path]]:
    """``clean(feature)``: the fault-free run of ``feature`` and its folder, launched on first
    use and shared by the module's tests."""
    runs: dict[str, tuple[Run, Path]] = {}

    def get(feature: str) -> tuple[Run, Path]:
        if feature not in runs:
            work = tmp_path_factory.mktemp(f"clean-{feature}")
            result = run(work, feature)
            assert result.code == 0, result.diagnosis()
            finished = events(result, "finished")
            assert len(finished) == 3 and {r["step"] for r in finished} == {STEPS}
            assert len({r["fingerprint"] for r in finished}) == 1
            runs[feature] = result, work
        return runs[feature]

    return get




def fingerprint(result: Run) -> str:
    [reference] = {r["fingerprint"] for r in events(result, "finished")}
    return str(reference)


def assert_each_step_committed_once(result: Run) -> None:
    """Each member commits its steps in order, once each; together they commit every step."""
    by_member: dict[str, list[int]] = {}
    for r in events(result, "step"):
        by_member.setdefault(r["member"], []).append(r["step"])
    assert all(steps == sorted(set(steps)) for steps in by_member.values()), by_member
    assert set().union(*map(set, by_member.values())) == set(range(STEPS))


def first_steps_of_spares(result: Run) -> list[dict[str, Any]]:
    spares = {r["member"] for r in events(result, "spare_waiting")}
    first: dict[str, dict[str, Any]] = {}
    for r in events(result, "step_started"):
        if r["member"] in spares:
            first.setdefault(r["member"], r)
    return list(first.values())


def assert_took_over_where_it_stood(free: Run, faulty: Run, batches_a_step: int) -> None:
    """The spare took rank 1 at the killed step, or at the next one when the killed rank's
    vote went out with its last bucket before it died (the others committed the step without
    it), at the epoch and data position rank 1 had there in the fault-free run: epoch 1,
    ``batches_a_step`` batches for each step of that epoch before it."""
    [first] = first_steps_of_spares(faulty)
    assert first["rank"] == 1 and first["step"] in (KILL_AT, KILL_AT + 1), first
    [expected] = [e for e in events(free, "step_started")
                  if (e["rank"], e["step"]) == (1, first["step"])]
    assert (first["epoch"], first["positions"]) == (expected["epoch"], expected["positions"])
    assert first["positions"] == [[1, batches_a_step * (first["step"] - STEPS // 2)]]


def checkpoints(root: Path) -> dict[str, dict[str, Any]]:
    """Every DCP checkpoint under ``root`` (``epoch{E}/rank{R}``), loaded and flattened."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    for folder in sorted(p.parent for p in root.glob("*/*/.metadata")):
        saved = folder / "as-torch-save.pt"
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp_to_torch_save(folder, saved)
        out[str(folder.relative_to(root))] = flat(torch.load(saved))
    return out






def assert_same_checkpoints(mine: Path, theirs: Path) -> None:
    got, expected = checkpoints(mine), checkpoints(theirs)
    assert sorted(got) == [f"epoch{e}/rank{r}" for e in range(2) for r in range(3)]
    assert got.keys() == expected.keys()
    for name, state in got.items():
        reference = expected[name]
        assert state.keys() == reference.keys() and len(state) > 20, name
        assert [k for k in state if not bitwise_equal(state[k], reference[k])] == [], name


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("feature", [f for f in FEATURES if f != "own_lr"])
def test_a_killed_rank_is_replaced_exactly(
        feature: str, tmp_path: Path, clean: Callable[[str], tuple[Run, Path]]) -> None:
    (free, free_work), faulty = clean(feature), run(tmp_path, feature, FAULTS)
    assert faulty.code == 0, faulty.diagnosis()
    finished = events(faulty, "finished")
    assert len(finished) == 3 and {r["step"] for r in finished} == {STEPS}, faulty.diagnosis()
    assert {r["fingerprint"] for r in finished} == {fingerprint(free)}
    assert_each_step_committed_once(faulty)
    assert {(r["kind"], r["step"], r["rank"]) for r in events(faulty, "fault")} == {
        ("kill", KILL_AT, 1)}
    killed = {r["member"] for r in events(faulty, "fault")}
    assert not killed & {r["member"] for r in finished}
    # a step is one optimizer step: with accumulation, two batches
    assert_took_over_where_it_stood(free, faulty, 2 if feature == "accumulation" else 1)
    if feature == "compile":
        # the session's code runs eagerly inside the compiled forward: dynamo recompiled it
        # at every step (its step seeds) until it gave up on the frame
        for result in (free, faulty):
            assert "recompile_limit" not in result.output, result.diagnosis()
    if feature == "dcp":
        assert_same_checkpoints(tmp_path / "dcp", free_work / "dcp")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_member_running_another_job_is_refused_and_replaced(
        tmp_path: Path, clean: Callable[[str], tuple[Run, Path]]) -> None:
    free, free_work = clean("dcp")
    result = run(tmp_path, "dcp", more=("--odd-epochs", "3"))
    assert result.code == 0, result.diagnosis()

    # The process started as rank 2 is refused at its join, before any step: one line says
    # what differs, and it exits with 5 (not respawned: it would run the same script again).
    [refused] = events(result, "exit")
    member = refused["member"]
    assert (refused["code"], refused["step"]) == (EXIT_STOPPED, 0)
    assert f"started rank 2 ({member})" in result.output
    said = [line for line in result.output.splitlines() if "differs from the others'" in line]
    assert said == [f"torchpass_p2p: member {member}: configuration 0: this member's job "
                    f"differs from the others': epochs 3 vs 2; exit code {EXIT_STOPPED}"]
    assert f"rank 2 ({member}) exited with {EXIT_STOPPED}" in result.output
    assert not [r for r in events(result, "step") if r["member"] == member]

    # The spare took rank 2 at step 0; the job ends as without the refused process.
    [first] = first_steps_of_spares(result)
    assert (first["rank"], first["step"]) == (2, 0)
    finished = events(result, "finished")
    assert len(finished) == 3 and member not in {r["member"] for r in finished}
    assert {r["fingerprint"] for r in finished} == {fingerprint(free)}
    assert_each_step_committed_once(result)
    assert_same_checkpoints(tmp_path / "dcp", free_work / "dcp")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_replica_steered_by_the_scripts_own_counter_stops_the_job(
        tmp_path: Path, clean: Callable[[str], tuple[Run, Path]]) -> None:
    """The script sets the learning rate from a step counter of its own, which starts over on
    the spare that takes rank 1 at step ``KILL_AT``: the spare steps its optimizer with
    another learning rate than the survivors. The next step's vote shows it, and every rank
    stops with exit code 5 and one line saying so, instead of the job ending with exit 0 and
    replicas that differ. Without a fault the replicas are steered alike: the job finishes."""
    free, _ = clean("own_lr")  # asserts exit 0 and one final state
    result = run(tmp_path, "own_lr", FAULTS)
    assert result.code != 0, result.diagnosis()
    assert events(result, "finished") == []
    diverged = events(result, "diverged")
    assert {(r["step"], r["reason"]) for r in diverged} == {(KILL_AT, (
        "the optimizers' hyperparameters (the learning rate, ...) differ between ranks "
        "[0, 2], [1]"))}, result.diagnosis()
    assert len(diverged) == 3
    exits = events(result, "exit")
    assert len(exits) == 3 and {r["code"] for r in exits} == {EXIT_STOPPED}
    said = [line for line in result.output.splitlines()
            if "a replica was steered by state that does not move to a spare" in line]
    assert len(said) == 3, result.output[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("feature", "point"), [
    ("param_groups", "compute"), ("param_groups", "grad"), ("param_groups", "commit"),
    ("native", "commit")])
def test_a_transient_collective_failure_regroups_the_same_ranks(
        feature: str, point: str, tmp_path: Path,
        clean: Callable[[str], tuple[Run, Path]]) -> None:
    """Rank 1's collective fails at step ``KILL_AT`` with no process dying (before its
    forward, inside the reduction, or once the votes are in but before it took its averaged
    gradient): nobody is suspected, so no configuration change comes; the three ranks form
    their group again in configuration 0 and go on. The spare never takes a rank and the job
    ends with the fault-free state. At ``commit`` the others committed the step: rank 1 is
    handed its averaged gradient and the committed buffers in the new group and rolls
    forward (in native mode too: it is handed the all-reduced gradient the others applied)."""
    free, _ = clean(feature)
    result = run(tmp_path, feature, f"reset@{KILL_AT}:{point}:rank=1")
    assert result.code == 0, result.diagnosis()
    finished = events(result, "finished")
    assert len(finished) == 3 and {r["fingerprint"] for r in finished} == {fingerprint(free)}
    assert_each_step_committed_once(result)
    assert first_steps_of_spares(result) == []
    assert {r["config_id"] for r in events(result, "step_started")} == {0}
    done = events(result, "regroup_done")
    assert {r["member"] for r in done} == {r["member"] for r in finished}, result.diagnosis()
    handed = events(result, "gradient_handed")
    rank_1 = {r["member"] for r in done if r["rank"] == 1}
    if point != "commit":  # rank 1's last bucket and vote never left: nobody committed
        assert {(r["config_id"], r["step"], r["action"]) for r in done} == {(0, KILL_AT, "redo")}
        assert handed == []
    else:  # the others committed; rank 1 rolls forward with what it is handed
        assert {(r["config_id"], r["step"], r["action"], r["member"] in rank_1)
                for r in done} == {(0, KILL_AT + 1, "redo", False),
                                   (0, KILL_AT + 1, "roll_forward", True)}
        assert len(handed) == 3  # every member of the new group logs it
        assert {(r["step"], tuple(r["behind"]), r["source"]) for r in handed} == {
            (KILL_AT, (1,), 0)}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_spare_receives_its_state_over_the_process_group(
        tmp_path: Path, clean: Callable[[str], tuple[Run, Path]]) -> None:
    """``init_process_group(state_transport="pg")``: the spare that takes the killed rank
    receives the state point-to-point over the new configuration's group (the path NCCL's
    RDMA takes on GPUs), not from the agents' transfer service."""
    free, _ = clean("param_groups")
    result = run(tmp_path, "param_groups", FAULTS, more=("--state-transport", "pg"))
    assert result.code == 0, result.diagnosis()
    finished = events(result, "finished")
    assert len(finished) == 3 and {r["fingerprint"] for r in finished} == {fingerprint(free)}
    assert_each_step_committed_once(result)
    fetched = events(result, "state_fetched")
    assert fetched and all(r["over_group"] for r in fetched), fetched
    assert_took_over_where_it_stood(free, result, 1)
