"""S10 end to end: a state source SIGKILLed in the middle of serving a promoted spare.

The scenario asks for 8 ranks and 2 spares and a 512 MB state; on two cores (this machine and
CI) the largest faithful setup is 4 ranks and 2 spares and a 256 MiB state: the example's
``--extra-state-mb 256`` ballast (deterministic, part of every snapshot and fingerprint) on top of
the smaller model of :mod:`.test_e2e`. 256 MiB is 17 chunks of 16 MiB, more than the 3 sources'
first request windows (3 x ``WINDOW_CHUNKS`` = 12 chunks): every source is asked for chunks from
the start, so the victim is surely one the spare pulls from; 512 MiB would double the memory and
the time of every transfer on two shared cores.

Rank 1 SIGKILLs itself at step ``FAULT_STEP`` (mid-step, peers in the all-reduce). Spare A is
promoted and pulls the state of step ``FAULT_STEP`` from ranks 0, 2 and 3 at once (striped).
Rank 2 SIGKILLs itself (fault ``kill@S:serve:rank=2:F``, :mod:`torchpass_p2p.trainer.faults`)
once it has sent A 17 % of the state: three of its chunks, about half of its third, i.e. when
A holds about half of the state; A's fourth request to it stays unanswered. Must hold: the
partial state is completed from the other sources (A's fetch records rank 2's failure, the
bytes rank 2 delivered, the chunks put back in the queue, and the other two sources delivering
the rest; no retry from scratch); the second death's configuration change happens and spare B
replaces rank 2 (pulling from ranks 0, 3 and A); training resumes at step ``FAULT_STEP`` with no
step lost; no hang (every wait is bounded by the run's limit); after the run every rank's state
(weights, optimizer, schedule, data position, ballast) is bitwise equal to the fault-free run's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from examples.main_job import Run, run_job
from tests.trainer.settings import ARGS
from torchpass_p2p.trainer.timeline import recoveries
from torchpass_p2p.transfer.snapshot import DEFAULT_CHUNK_BYTES

STEPS = 8
FAULT_STEP = 4
STATE_MIB = 256
S10_ARGS = (*ARGS, "--extra-state-mb", str(STATE_MIB))
SERVED_FRACTION = 0.17
"""Rank 2 dies once it has sent this much of the state (on A's connection), about a sixth: with
3 sources sharing the chunks, about half of its share, when A holds about half of the state."""
FAULTS = f"kill@{FAULT_STEP}:grad:rank=1,kill@{FAULT_STEP}:serve:rank=2:{SERVED_FRACTION}"
ATTEMPTS = 3
"""Faulty runs at most, for the fetch S10 is about to happen once (:func:`run_scenario`)."""
RUN_LIMIT_S = 200.0
"""A launch that outlives this fails the test (``subprocess.TimeoutExpired``): the "no hang"."""


@pytest.fixture(scope="module")
def clean(clean_run: Callable[..., Run]) -> Run:
    """The fault-free run with the same ballast (it is part of the fingerprint)."""
    return clean_run(STEPS, S10_ARGS)


def members_of(events: list[dict], config_id: int) -> dict[int, str]:
    """``{rank: member}`` of the members that joined ``config_id``."""
    return {r["rank"]: r["member"] for r in events
            if r["event"] == "joined" and r["config_id"] == config_id}


def run_scenario(tmp_path: Path) -> Run:
    """The faulty run, once more when the fetch S10 is about did not happen: every source must
    be asked for its share, and on a loaded host a source's connection may open only once the
    others served nearly every chunk. Seen: the victim's (1.4 MB of 270 MB from it, the fetch
    complete in 0.26 s: its serve fault never fired), and a healthy source's (the victim and
    one other served it all; 1 run in 3 on an idle machine). That run is a fetch with one
    source less, not S10; it is run again, twice at most."""
    for attempt in range(ATTEMPTS):
        faulty = run_job(tmp_path / f"faults-{attempt}", nproc=4, spares=2, steps=STEPS,
                         faults=FAULTS, script_args=S10_ARGS, timeout_s=RUN_LIMIT_S)
        assert faulty.code == 0, faulty.diagnosis()
        points = [r["point"] for r in faulty.events if r["event"] == "fault"]
        if points not in (["grad"], ["grad", "serve"]):
            return faulty  # the test's assertions say what went wrong
        [fetched, *_] = [r for r in faulty.events if r["event"] == "state_fetched"]
        before = members_of(faulty.events, 0)
        served = {member for member, n in fetched["served_by"].items() if n > 0}
        if points == ["grad", "serve"] and served == {before[0], before[2], before[3]}:
            return faulty
        if points == ["grad"]:
            assert fetched["served_by"].get(before[2], 0) < SERVED_FRACTION * fetched["bytes"]
    return faulty


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_s10_source_killed_mid_transfer_is_replaced_exactly(tmp_path: Path, clean: Run) -> None:
    faulty = run_scenario(tmp_path)
    events = faulty.events
    before = members_of(events, 0)

    # Rank 1 died mid-step; rank 2 died while serving spare A the state of FAULT_STEP.
    first, second = (r for r in events if r["event"] == "fault")
    assert (first["kind"], first["point"], first["rank"], first["step"]) == (
        "kill", "grad", 1, FAULT_STEP)
    assert (second["kind"], second["point"], second["rank"]) == ("kill", "serve", 2)
    victim = second["member"]
    assert victim == before[2] and second["snapshot_step"] == FAULT_STEP
    total = second["total_bytes"]
    assert total >= STATE_MIB << 20
    # It died right after the chunk that took it past 17 % of the state (its third 16 MiB
    # chunk here), long before the end of its share.
    assert SERVED_FRACTION * total <= second["served_bytes"] < SERVED_FRACTION * total + (
        DEFAULT_CHUNK_BYTES)

    # Spare A's fetch for configuration 1: rank 2 failed mid-stream, its delivered chunks were
    # kept, the unanswered ones went back to the queue and ranks 0 and 3 served them; one
    # attempt, no retry from scratch.
    fetched = [r for r in events if r["event"] == "state_fetched"]
    assert [r["config_id"] for r in fetched] == [1, 2]
    a, b = fetched
    assert a["step"] == FAULT_STEP and a["bytes"] == total and a["t"] > second["t"]
    assert a["restored_fingerprint"] == a["fingerprint"]
    assert set(a["failures"]) <= {"closed", "no_progress"} and sum(a["failures"].values()) == 1
    assert set(a["served_by"]) == {before[0], victim, before[3]}
    # Flow control: its third chunk could not leave before A had read (and verified) the
    # first, so at least one whole chunk came from it; not more than it sent.
    assert DEFAULT_CHUNK_BYTES <= a["served_by"][victim] <= second["served_bytes"]
    assert a["refetched_chunks"] >= 1  # its unanswered requests, moved to other sources
    assert sum(a["served_by"].values()) == total
    assert a["served_by"][before[0]] > 0 and a["served_by"][before[3]] > 0
    assert not [r for r in events if r["event"] == "fetch_retry"]

    # The second death's configuration change: spare B takes rank 2, A keeps rank 1.
    faults = recoveries(events)
    assert [(f.kind, f.point, f.rank, f.config_id) for f in faults] == [
        ("kill", "grad", 1, 1), ("kill", "serve", 2, 2)]
    assert all(f.resume_step == FAULT_STEP and f.steps_lost == 0 for f in faults)
    assert faults[1].action == ("redo",) and faults[1].resumed_s is not None
    after = members_of(events, 2)
    spare_a, spare_b = a["member"], b["member"]
    assert after == {0: before[0], 1: spare_a, 2: spare_b, 3: before[3]}
    assert {r["step"] for r in events if r["event"] == "joined" and r["config_id"] == 2} == {
        FAULT_STEP}
    assert b["step"] == FAULT_STEP and b["failures"] == {} and b["bytes"] == total
    assert set(b["served_by"]) == {before[0], spare_a, before[3]}
    assert b["fingerprint"] == a["fingerprint"] == b["restored_fingerprint"]

    # Every rank ends with the fault-free run's state, bit for bit.
    assert len(clean.finals) == len(faulty.finals) == 4
    assert {r["rank"]: r["member"] for r in faulty.finals} == after
    assert all(r["steps"] == STEPS for r in clean.finals + faulty.finals)
    assert {r["fingerprint"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["weights_sha256"]}
    assert clean.finals[0]["losses"] == faulty.finals[0]["losses"]  # same curve, bit for bit
    assert sorted(map(int, faulty.finals[0]["losses"])) == list(range(STEPS))
    for r in (1, 2):  # the replacements ran FAULT_STEP.. only
        assert sorted(map(int, faulty.finals[r]["losses"])) == list(range(FAULT_STEP, STEPS))


PG_SERVED_FRACTION = 0.02
"""Over the group the victim dies after its first chunk: a source keeps 4 chunks in flight
(``SEND_WINDOW_CHUNKS``), so dying at 17 % (its third chunk) would still let its whole stripe
of 5-6 chunks through."""
PG_FAULTS = (f"kill@{FAULT_STEP}:grad:rank=1,"
             f"kill@{FAULT_STEP}:serve:rank=2:{PG_SERVED_FRACTION}")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_s10_over_the_new_group(tmp_path: Path, clean: Run) -> None:
    # The same scenario with the state sent over the configuration's group (PgTransport, the
    # NCCL jobs' path): rank 2 dies after its first chunk to spare A. gloo either reports the
    # dead source (its missing chunks go to ranks 0 and 3 in a repair round) or the receive
    # from it would only time out: then A gets the state in the next configuration instead,
    # the transfer ended by the group's closing when that configuration came. Either way no
    # step is lost and the end state is exact.
    faulty = run_job(tmp_path / "faults", nproc=4, spares=2, steps=STEPS, faults=PG_FAULTS,
                     script_args=(*S10_ARGS, "--state-transport", "pg"),
                     timeout_s=RUN_LIMIT_S)
    assert faulty.code == 0, faulty.diagnosis()
    events = faulty.events
    before = members_of(events, 0)
    second = [r for r in events if r["event"] == "fault"][1]
    assert (second["kind"], second["point"], second["rank"]) == ("kill", "serve", 2)
    assert second["served_bytes"] == DEFAULT_CHUNK_BYTES
    faults = recoveries(events)
    assert [(f.kind, f.point, f.rank) for f in faults] == [
        ("kill", "grad", 1), ("kill", "serve", 2)]
    assert all(f.resume_step == FAULT_STEP and f.steps_lost == 0 for f in faults)
    fetched = [r for r in events if r["event"] == "state_fetched"]
    assert all(r["over_group"] and r["step"] == FAULT_STEP
               and r["restored_fingerprint"] == r["fingerprint"] for r in fetched)
    # Where gloo reported the death only as a timeout, the transfer ended when configuration 2
    # (the dead source replaced) came, at every member (the group's connections closed), not
    # after the transfer's 10 s without progress.
    restarted = [r["error"] for r in events if r["event"] == "recovery_restarted"]
    assert not any("no_progress" in e for e in restarted), restarted
    first = fetched[0]
    if first["config_id"] == 1:  # completed around the dead source within configuration 1
        # Every chunk verified by its digest. Those whose receive failed are refetched from
        # the others, unless the spare already held their bytes: the ballast is the same
        # deterministic tensor in every process, so its chunks verify in place, and the
        # victim is credited with them (tests/transfer/test_pg_failover.py checks the repair
        # round into zeroed memory).
        assert first["failures"] == {"source_failed": 1}
        assert sum(first["served_by"].values()) == first["bytes"]
    after = members_of(events, 2)
    assert {after[0], after[3]} == {before[0], before[3]}
    assert {r["rank"]: r["member"] for r in faulty.finals} == after
    assert {r["fingerprint"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["weights_sha256"]}
