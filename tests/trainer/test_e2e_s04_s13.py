"""S04 and S13 end to end: real processes under the launcher, gloo, a rank SIGKILLed in the
middle of the gradient all-reduce (the settings and fault-free run of :mod:`.test_e2e`).

S04: 4 ranks and a spare, the process group's timeout at torch's 30-minute default
(:data:`~torchpass_p2p.collective.group.GROUP_TIMEOUT_S`); rank 2 dies while its peers wait in
the all-reduce. Must hold: every survivor leaves that collective (it fails, or a new
configuration supersedes it) and the job trains again, not after the timeout. Timings are not
asserted (shared, noisy machines; the benchmarks report them): the run's own limit, a ninth of
the group timeout, is what a survivor waiting for the timeout would fail on, and no survivor's
collective may have failed by timing out.

S13: rank 1 leaves an orphan (a grandchild ignoring SIGTERM that holds every socket of the rank,
its agent port among them) and dies mid-step. Must hold: the spare replaces it without that port
(the same final state as the fault-free run, bit for bit), and the orphan does not outlive the
run (the launcher kills a dead child's process group as soon as it reaps the child: so the
orphan holds the port and the peers' gloo connections only until then, a fraction of a second).
"""

from __future__ import annotations

import os
import re
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from examples.main_job import Run, run_job
from tests.launch.procs import gone, wait_for
from tests.trainer.settings import ARGS
from torchpass_p2p.collective.group import GROUP_TIMEOUT_S
from torchpass_p2p.trainer.faults import ORPHAN_SLEEP_S, start_orphan
from torchpass_p2p.trainer.timeline import recoveries

STEPS = 57
RUN_LIMIT_S = GROUP_TIMEOUT_S / 9
"""200 s per launch: a survivor that left the collective only on the group timeout would make
the faulty run overrun this (``subprocess.TimeoutExpired``)."""
LEFT = ("collective_failed", "superseded")
"""How a member records leaving a configuration's collective (:mod:`torchpass_p2p.trainer`)."""


@pytest.fixture(scope="module")
def clean(clean_run: Callable[[int], Run]) -> Run:
    """The fault-free run both scenarios compare with."""
    return clean_run(STEPS)


def assert_same_end_state(clean: Run, faulty: Run) -> None:
    """Every rank of both runs ran ``STEPS`` steps and holds the same state, bit for bit."""
    assert len(clean.finals) == len(faulty.finals) == 4
    assert {r["rank"] for r in faulty.finals} == {0, 1, 2, 3}
    assert all(r["steps"] == STEPS for r in clean.finals + faulty.finals)
    assert {r["fingerprint"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in clean.finals + faulty.finals} == {
        clean.finals[0]["weights_sha256"]}
    assert clean.finals[0]["losses"] == faulty.finals[0]["losses"]  # same curve, bit for bit


def members_of(events: list[dict[str, Any]], config_id: int) -> dict[int, str]:
    """``{rank: member}`` of the members that joined ``config_id``."""
    return {r["rank"]: r["member"] for r in events
            if r["event"] == "joined" and r["config_id"] == config_id}


def started(output: str, name: str) -> tuple[str, int, int]:
    """(member, pid, port) from the launcher's ``started rank 1 (...)`` line."""
    [(member, pid, port)] = re.findall(
        rf"started {name} \((\w+)\): pid (\d+), [^\s:]+:(\d+)", output)
    return member, int(pid), int(port)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_s04_survivors_leave_the_collective_without_its_timeout(tmp_path: Path,
                                                                clean: Run) -> None:
    faulty = run_job(tmp_path / "faults", nproc=4, spares=1, steps=STEPS,
                     faults="kill@37:grad:rank=2", script_args=ARGS, timeout_s=RUN_LIMIT_S)
    assert faulty.code == 0, faulty.diagnosis()
    events = faulty.events

    [fault] = recoveries(events)
    assert (fault.kind, fault.rank, fault.step, fault.config_id) == ("kill", 2, 37, 1)
    assert fault.resume_step == 37 and fault.steps_lost == 0 and fault.action == ("redo",)
    assert fault.detected_s is not None and fault.resumed_s is not None  # trains again

    [fault_record] = [r for r in events if r["event"] == "fault"]
    before = members_of(events, 0)
    assert before[2] == fault_record["member"]
    survivors = {before[r] for r in (0, 1, 3)}
    after = members_of(events, 1)
    assert {after[r] for r in (0, 1, 3)} == survivors  # each kept its rank
    for member in survivors:
        mine = [r for r in events if r["member"] == member]
        steps = [(r["step"], r["config_id"]) for r in mine if r["event"] == "step"]
        # It committed every step once: 0..36 in configuration 0 (its step 36 record may come
        # after the fault: rank 2 went on to step 37 while it still published its state) ...
        assert [k for k, _ in steps] == list(range(STEPS))
        assert all((c == 0) == (k < 37) for k, c in steps)
        # ... left configuration 0's step 37 (the all-reduce rank 2 never joined) ...
        [left] = [r for r in mine if r["event"] in LEFT]
        assert (left["step"], left["config_id"]) == (37, 0) and left["t"] > fault_record["t"]
        # ... not because gloo's timeout fired (a peer's closed connection, or a new
        # configuration, ended the wait) ...
        assert "timed out" not in left["error"].lower() and "timeout" not in left["error"]
        # ... and redid step 37 in configuration 1.
        [rule] = [r for r in mine if r["event"] == "commit_rule"]
        assert (rule["action"], rule["config_id"], rule["resume_step"]) == ("redo", 1, 37)
        joined = [(r["config_id"], r["step"]) for r in mine if r["event"] == "joined"]
        assert joined == [(0, 0), (1, 37)]
    assert_same_end_state(clean, faulty)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_s13_the_orphan_of_a_killed_rank_is_killed_and_not_needed(tmp_path: Path,
                                                                   clean: Run) -> None:
    faulty = run_job(tmp_path / "faults", nproc=4, spares=1, steps=STEPS,
                     faults="orphan@37:grad:rank=1", script_args=ARGS, timeout_s=RUN_LIMIT_S)
    [fault_record] = [r for r in faulty.events if r["event"] == "fault"]
    orphan = fault_record["orphan_pid"]
    try:
        assert faulty.code == 0, faulty.diagnosis()
        # The orphan held rank 1's agent port (UDP and TCP), not the spare's.
        member, pid, port = started(faulty.output, "rank 1")
        spare, _, spare_port = started(faulty.output, "spare")
        assert fault_record["member"] == member and orphan != pid
        assert port in fault_record["orphan_ports"]
        assert spare_port not in fault_record["orphan_ports"]
        # ... and was killed with rank 1's process group, before the launcher exited.
        assert not orphan_alive(orphan)
    finally:
        if orphan_alive(orphan):  # do not leave it behind when the test fails
            os.kill(orphan, signal.SIGKILL)

    [fault] = recoveries(faulty.events)
    assert (fault.kind, fault.rank, fault.step, fault.config_id) == ("orphan", 1, 37, 1)
    assert fault.resume_step == 37 and fault.steps_lost == 0 and fault.resumed_s is not None
    [fetched] = [r for r in faulty.events if r["event"] == "state_fetched"]
    assert fetched["member"] == spare and fetched["step"] == 37
    assert members_of(faulty.events, 1)[1] == spare
    [replacement] = [r for r in faulty.finals if r["rank"] == 1]
    assert replacement["member"] == spare
    assert sorted(map(int, replacement["losses"])) == list(range(37, STEPS))
    assert_same_end_state(clean, faulty)


def orphan_alive(pid: int) -> bool:
    """``pid`` is still our orphan (not gone, not a zombie, not a reused pid)."""
    if gone(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[:2] == [b"sleep", str(ORPHAN_SLEEP_S).encode()]
    except FileNotFoundError:
        return False


def test_an_orphan_ignores_sigterm_and_holds_the_ports() -> None:
    """The ``orphan`` fault's grandchild, started from this process: it holds a listening port
    after this process closed its socket, and ignores SIGTERM."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    orphan, ports = start_orphan()
    try:
        assert port in ports
        listener.close()
        with pytest.raises(OSError), socket.create_server(("127.0.0.1", port)):
            pass  # still bound: by the orphan
        wait_for(lambda: orphan_alive(orphan.pid), what="the orphan's shell exec'ing sleep")
        with open(f"/proc/{orphan.pid}/status") as f:
            ignored = re.search(r"^SigIgn:\s*([0-9a-f]+)$", f.read(), re.M)
        assert ignored is not None and int(ignored[1], 16) >> (signal.SIGTERM - 1) & 1
        assert os.getpgid(orphan.pid) == os.getpgid(0)  # the launcher's killpg reaches it
    finally:
        orphan.kill()
        orphan.wait()
