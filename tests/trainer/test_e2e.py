"""S17 and S12 end to end: real processes under the launcher, gloo, SIGKILLs in the middle of
a step.

Four ranks and a spare train the example language model (smaller settings) for 57 steps. In
the second run rank 1 SIGKILLs itself at step 37 while its peers are inside the gradient
all-reduce. Must hold: the spare's restored state has the sources' fingerprint before it
joins, and every member of the new configuration holds that same fingerprint at the resume
step; no step is lost (step 37 is redone, nobody committed it); after 20 more steps every rank's
state (weights, optimizer, schedule, data position) is bitwise equal to the fault-free run's.

The same kill with a model whose gradient is averaged in shards (``mean_in_rank_order`` above
``SHARDED_MIN_BYTES``): the peers are inside the all-to-all when it lands.

S12: rank 0 (the member that served the last rendezvous: it hosted configuration 0's store) and
rank 2 die in the same step; two spares. Must hold: both ranks replaced in one or two
configuration changes, same step, no hang, the same final state as the fault-free run.

A survivor killed as it enters the recovery's configuration (before announcing its state): the
promoted spare fetches from the others; the same final state. And a rank (0, which hosts the
first rendezvous, or 1) killed as the job starts, before its first group forms.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from examples.char_lm import CharLM
from examples.main_job import Run, run_job
from tests.trainer.settings import ARGS
from torchpass_p2p.collective.group import SHARDED_MIN_BYTES
from torchpass_p2p.trainer.timeline import recoveries

STEPS = 57


@pytest.fixture(scope="module")
def clean(clean_run: Callable[[int], Run]) -> Run:
    """The fault-free run both scenarios compare with."""
    return clean_run(STEPS)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_s17_killed_rank_is_healed_exactly(tmp_path: Path, clean: Run) -> None:
    faulty = run_job(tmp_path / "faults", nproc=4, spares=1, steps=STEPS,
                     faults="kill@37:grad:rank=1", script_args=ARGS, timeout_s=200)
    assert faulty.code == 0, faulty.diagnosis()

    [fault] = recoveries(faulty.events)
    assert (fault.kind, fault.rank, fault.step, fault.config_id) == ("kill", 1, 37, 1)
    assert fault.resume_step == 37 and fault.last_committed == 36 and fault.steps_lost == 0
    assert fault.action == ("redo",)
    assert fault.resumed_s is not None  # training resumed (recovery times: benchmarks)

    # The replacement's fingerprint equals the sources' before it joins ...
    [fetched] = [r for r in faulty.events if r["event"] == "state_fetched"]
    assert fetched["step"] == 37 and fetched["restored_fingerprint"] == fetched["fingerprint"]
    joined = [r for r in faulty.events if r["event"] == "joined" and r["config_id"] == 1]
    assert len(joined) == 4 and {r["fingerprint"] for r in joined} == {fetched["fingerprint"]}
    assert fetched["t"] < min(r["t"] for r in joined)
    # ... and the end state is the fault-free run's, on every rank:
    assert len(clean.finals) == len(faulty.finals) == 4
    assert {r["rank"] for r in faulty.finals} == {0, 1, 2, 3}
    assert all(r["steps"] == STEPS for r in clean.finals + faulty.finals)
    prints = {r["fingerprint"] for r in clean.finals + faulty.finals}
    weights = {r["weights_sha256"] for r in clean.finals + faulty.finals}
    assert len(prints) == 1 and len(weights) == 1
    assert clean.finals[0]["losses"] == faulty.finals[0]["losses"]  # same curve, bit for bit
    # A survivor ran every step once in the final history; the replacement ran 37..56.
    assert sorted(map(int, faulty.finals[0]["losses"])) == list(range(STEPS))
    assert sorted(map(int, faulty.finals[1]["losses"])) == list(range(37, STEPS))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_s17_with_a_gradient_mean_in_shards(tmp_path: Path,
                                            clean_run: Callable[..., Run]) -> None:
    # A wider model: its 3.8 MB gradient is averaged in shards (all-to-all, then all-gather),
    # and the kill leaves the peers inside the all-to-all. Same checks: no step lost, and
    # the end state bitwise the fault-free run's.
    args = (*ARGS, "--dim", "192")
    model = CharLM(context=32, dim=192, heads=4, layers=2)
    assert 4 * sum(p.numel() for p in model.parameters()) > SHARDED_MIN_BYTES
    steps = 30
    clean = clean_run(steps, args)
    faulty = run_job(tmp_path / "faults", nproc=4, spares=1, steps=steps,
                     faults="kill@17:grad:rank=2", script_args=args, timeout_s=200)
    assert faulty.code == 0, faulty.diagnosis()
    [fault] = recoveries(faulty.events)
    assert (fault.kind, fault.rank, fault.step, fault.resume_step) == ("kill", 2, 17, 17)
    assert fault.steps_lost == 0 and fault.action == ("redo",)
    left = [r for r in faulty.events if r["event"] in ("collective_failed", "superseded")
            and r["config_id"] == 0]  # the three survivors, from inside step 17's mean
    assert len(left) == 3 and all(r["step"] == 17 for r in left)
    assert len(faulty.finals) == 4 and all(r["steps"] == steps for r in faulty.finals)
    assert {r["fingerprint"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["weights_sha256"]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_s12_two_ranks_at_once_including_the_rendezvous_host(tmp_path: Path,
                                                             clean: Run) -> None:
    faulty = run_job(tmp_path / "faults", nproc=4, spares=2, steps=STEPS,
                     faults="kill@37:grad:rank=0,kill@37:grad:rank=2", script_args=ARGS,
                     timeout_s=200)
    assert faulty.code == 0, faulty.diagnosis()
    faults = recoveries(faulty.events)
    assert sorted(f.rank for f in faults) == [0, 2]
    assert {f.config_id for f in faults} <= {1, 2}
    assert all(f.resume_step == 37 and f.steps_lost == 0 and f.resumed_s is not None
               for f in faults)
    fetched = [r for r in faulty.events if r["event"] == "state_fetched"]
    assert len(fetched) == 2 and all(r["step"] == 37 for r in fetched)
    assert {r["rank"] for r in faulty.finals} == {0, 1, 2, 3}
    assert {r["fingerprint"] for r in faulty.finals} == {clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in faulty.finals} == {clean.finals[0]["weights_sha256"]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_s12_with_the_state_sent_over_the_new_group(tmp_path: Path, clean: Run) -> None:
    # The path NCCL jobs take (state_transport "auto" there), run over gloo: the two spares
    # join the group of the new configuration without the state, say so in an all-gather, and
    # receive it one after the other over the group from the plan's sources; then the same
    # checks as over TCP, and the same final state as the fault-free run.
    faulty = run_job(tmp_path / "faults", nproc=4, spares=2, steps=STEPS,
                     faults="kill@37:grad:rank=0,kill@37:grad:rank=2",
                     script_args=(*ARGS, "--state-transport", "pg"), timeout_s=200)
    assert faulty.code == 0, faulty.diagnosis()
    faults = recoveries(faulty.events)
    assert sorted(f.rank for f in faults) == [0, 2]
    assert all(f.resume_step == 37 and f.steps_lost == 0 and f.resumed_s is not None
               for f in faults)
    fetched = [r for r in faulty.events if r["event"] == "state_fetched"]
    assert len(fetched) >= 2 and all(r["over_group"] for r in fetched)
    assert all(r["restored_fingerprint"] == r["fingerprint"] and r["step"] == 37
               for r in fetched)
    # Over the group, after it formed: the spare's fetch comes after its group_formed.
    for r in fetched:
        formed = [e["t"] for e in faulty.events if e["event"] == "group_formed"
                  and e["member"] == r["member"] and e["config_id"] == r["config_id"]]
        assert formed and max(formed) < r["t"]
    prints = {r["fingerprint"] for r in clean.finals + faulty.finals}
    weights = {r["weights_sha256"] for r in clean.finals + faulty.finals}
    assert len(faulty.finals) == 4 and len(prints) == 1 and len(weights) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_more_deaths_than_spares_wait_for_a_respawned_spare(tmp_path: Path, clean: Run) -> None:
    # Ranks 1 and 2 die in one step with one spare left: the configuration that promotes it
    # keeps rank 2 vacant (policy "wait"). Nobody trains in it (before, every member crashed
    # in GroupSpec.of); the launcher respawns the dead processes as new spares (--respawn),
    # one fills the vacancy, and training resumes at the same step, exact.
    faulty = run_job(tmp_path / "faults", nproc=4, spares=1, steps=STEPS,
                     faults="kill@37:grad:rank=1,kill@37:grad:rank=2", script_args=ARGS,
                     launch_args=("--respawn",), timeout_s=200)
    assert faulty.code == 0, faulty.diagnosis()
    waited = [r for r in faulty.events if r["event"] == "waiting_for_spare"]
    assert waited and all(r["vacant"] for r in waited)
    # Each member waits once per such configuration, never re-entering it in a tight loop.
    once = [(r["member"], r["config_id"]) for r in waited]
    assert len(once) == len(set(once)), once
    joined = {}
    for r in faulty.events:
        if r["event"] == "joined":
            joined.setdefault(r["config_id"], []).append(r)
    last = max(joined)
    assert len(joined[last]) == 4 and {r["step"] for r in joined[last]} == {37}
    assert all(f.steps_lost == 0 for f in recoveries(faulty.events))
    assert len(faulty.finals) == 4 and all(r["steps"] == STEPS for r in faulty.finals)
    assert {r["fingerprint"] for r in faulty.finals} == {clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in faulty.finals} == {clean.finals[0]["weights_sha256"]}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_survivor_dying_as_it_enters_the_recovery(tmp_path: Path, clean: Run) -> None:
    # Rank 1 dies mid-step; rank 3 dies as it enters configuration 1, after the decision and
    # before it announces its state, while the promoted spare counts on it as a source. Two
    # spares. The spare fetches from the sources that did announce (or the change that
    # removes rank 3 supersedes its fetch): it once waited LOOKUP_TIMEOUT_S for rank 3 (how
    # briefly a silent source is waited for: test_drain's _find_sources tests, in the
    # timeouts asked; the recovery time: the main job's timeline).
    faulty = run_job(tmp_path / "faults", nproc=4, spares=2, steps=STEPS,
                     faults="kill@37:grad:rank=1,kill@37:enter:rank=3", script_args=ARGS,
                     timeout_s=200)
    assert faulty.code == 0, faulty.diagnosis()
    first, second = recoveries(faulty.events)
    assert (first.kind, first.point, first.rank, first.config_id) == ("kill", "grad", 1, 1)
    assert (second.kind, second.point, second.rank, second.config_id) == ("kill", "enter", 3, 2)
    assert all(f.resume_step == 37 and f.steps_lost == 0 for f in (first, second))
    assert second.resumed_s is not None
    # Every member resumed in configuration 2, at step 37, with the fault-free state:
    resumed = [r for r in faulty.events if r["event"] == "joined" and r["config_id"] == 2]
    assert len(resumed) == 4 and {r["step"] for r in resumed} == {37}
    assert {r["rank"] for r in faulty.finals} == {0, 1, 2, 3}
    assert all(r["steps"] == STEPS for r in faulty.finals)
    assert {r["fingerprint"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["weights_sha256"]}


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])  # 0 hosts the rendezvous of configuration 0
def test_a_rank_dying_before_the_first_group_forms(tmp_path: Path, clean: Run,
                                                   rank: int) -> None:
    # A rank killed while the job starts, before its first group forms, is replaced like any
    # other: the survivors' Superseded must not escape the start-up entry and end the job.
    faulty = run_job(tmp_path / "faults", nproc=4, spares=1, steps=STEPS,
                     faults=f"kill@0:enter:rank={rank}", script_args=ARGS, timeout_s=200)
    assert faulty.code == 0, faulty.diagnosis()
    [fault] = recoveries(faulty.events)
    assert (fault.kind, fault.point, fault.rank, fault.step) == ("kill", "enter", rank, 0)
    assert fault.resume_step == 0 and fault.steps_lost == 0
    assert {r["rank"] for r in faulty.finals} == {0, 1, 2, 3}
    assert all(r["steps"] == STEPS for r in faulty.finals)
    assert {r["fingerprint"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["weights_sha256"]}
