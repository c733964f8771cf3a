"""S09 end to end: a rank drained through its status page while a late spare joins, with real
training under the launcher.

Four ranks and two spares train the example language model (the settings of ``test_e2e``, more
steps). Once training is under way a second launcher's process (``--seeds`` mode) asks to join
the job as a spare, and at once ``torchpass-p2p drain`` asks rank 1 to hand its rank over: the
join and the leave reach the agreement together (one cut, or two in a row). Must hold: every
member of each new configuration logs the same plan (same plan hash) before its first collective
in it, and all of them form the same group; the drained member keeps training until the
configuration without it is decided, then stops as drained (not failed) and its process exits
with ``EXIT_DRAINED``, which the launcher neither counts as a failure nor reports; a spare takes
rank 1 with state fetched from the survivors, who reach the resume step by themselves; the late
spare is admitted; no step is lost, every rank finishes every step, and the final state of every
rank (weights, optimizer, schedule, data position) is bitwise equal to a fault-free run's: a
drain does not change the result.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from examples.main_job import REPO, SCRIPT, Run
from tests.launch.procs import free_ports_block, wait_for
from tests.trainer.settings import ARGS
from torchpass_p2p.cli.main import main as cli
from torchpass_p2p.launch.keyfile import write_key_file
from torchpass_p2p.launch.outcome import EXIT_DRAINED
from torchpass_p2p.trainer.timeline import final_states, read_events

STEPS = 160
"""15-30 s of training on a 2-core machine: the drain, at about step 50, is decided and the rank
handed over long before the end."""
UNDER_WAY_STEP = 10
"""Training is under way once a rank committed this step: then the late spare joins."""
LATE_SPARE = """
# char_lm.py, imported ahead and started when the test creates "go" next to this file: a
# process importing torch takes seconds, far more while four ranks train on a small machine,
# and the test wants the join at a moment of its choosing.
import sys
import time
from pathlib import Path

import examples.char_lm as char_lm
from torchpass_p2p.collective import exit_process

here = Path(__file__).parent
(here / "ready").touch()
deadline = time.monotonic() + 300
while not (here / "go").exists():
    if time.monotonic() > deadline:
        sys.exit("never told to go")
    time.sleep(0.02)
exit_process(char_lm.main())
"""


@pytest.fixture(scope="module")
def clean(clean_run: Callable[[int], Run]) -> Run:
    """The fault-free run to compare with."""
    return clean_run(STEPS)


def _environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHPASS_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _launch(work: Path, name: str, args: list[str], script: Path = SCRIPT,
            ) -> tuple[subprocess.Popen[bytes], Path]:
    """A launcher of ``script`` (``char_lm.py``) writing into ``work``; its output goes to a
    file (a pipe nobody reads while the test waits could fill up and stall it)."""
    output = work / f"{name}.out"
    with open(output, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchpass_p2p.cli.main", "launch", *args, "--grace", "3",
             "--key-file", str(work / "cluster.key"), str(script), "--out", str(work / "out"),
             "--log-dir", str(work / "logs"), "--steps", str(STEPS), *ARGS],
            cwd=REPO, env=_environ(), stdout=sink, stderr=subprocess.STDOUT)
    return proc, output


def _events(work: Path) -> list[dict[str, Any]]:
    return read_events(work / "logs")


def _starts(work: Path) -> dict[str, dict[str, Any]]:
    return {r["member"]: r for r in _events(work) if r["event"] == "start"}


def _role(status: str) -> str | None:
    """The role on the status page at ``status`` (``host:port``); None if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{status}/status", timeout=10) as reply:
            return json.loads(reply.read())["role"]
    except OSError:
        return None


def _finish(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_s09_drain_while_a_late_spare_joins(tmp_path: Path, clean: Run,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "drain"
    (work / "logs").mkdir(parents=True)
    (work / "late").mkdir()
    write_key_file(work / "cluster.key")
    late_script = work / "late" / "late_spare.py"
    late_script.write_text(LATE_SPARE)
    # Known ports, so that the late spare's launcher can name ranks 0 and 2 as seeds before
    # the job starts: its process imports everything first, then waits for "go".
    base = free_ports_block(6, ["127.0.0.1"])
    late, late_out = _launch(work, "late", ["--nproc", "0", "--spares", "1", "--seeds",
                                            f"127.0.0.1:{base},127.0.0.1:{base + 2}"],
                             late_script)
    job: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: (work / "late" / "ready").exists(), 120, "the late spare's imports")
        job, job_out = _launch(work, "job", ["--nproc", "4", "--spares", "2",
                                             "--base-port", str(base)])
        wait_for(lambda: any(r["event"] == "step" and r["step"] >= UNDER_WAY_STEP
                             for r in _events(work)), 180, f"step {UNDER_WAY_STEP}")
        starts = _starts(work)
        by_rank = {r["rank"]: r for r in starts.values() if r["role"] == "rank"}
        assert len(starts) == 6 and [by_rank[r]["address"] for r in range(4)] == [
            f"127.0.0.1:{base + r}" for r in range(4)]
        (work / "late" / "go").touch()
        # Its trainer starts right after its agent asked to join: drain rank 1 now (in this
        # process: a second interpreter would take a second to start).
        wait_for(lambda: len(_starts(work)) == 7, 60, "the late spare's agent")
        [late_member] = set(_starts(work)) - set(starts)
        late_status = _starts(work)[late_member]["status"]
        drained = by_rank[1]["member"]
        capsys.readouterr()
        assert cli([
            "drain", by_rank[1]["status"], "--key-file", str(work / "cluster.key")]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["draining"] is True
        assert (answer["member_id"], answer["rank"]) == (drained, 1)

        code = _finish(job, 240)
        wait_for(lambda: len(final_states(work / "out")) >= 4, 30, "four final states")
        late_role = None
        if late.poll() is None:  # the late spare got no rank: it idles, a member, until stopped
            late_role = _role(late_status)
            late.send_signal(signal.SIGTERM)
        late_code = _finish(late, 60)
    finally:
        for proc in (job, late):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    output = job_out.read_text(errors="replace")
    late_output = late_out.read_text(errors="replace")
    assert code == 0, output[-4000:]
    assert late_code in (0, 128 + signal.SIGTERM), late_output[-4000:]
    events = _events(work)
    mine = [r for r in events if r["member"] == drained]

    # The drained member stopped as drained, after the configuration without it was decided;
    # its process exited with EXIT_DRAINED, which its launcher counts as no failure.
    [stopped] = [r for r in mine if r["event"] == "removed"]
    assert stopped["drained"] is True, stopped
    assert re.search(rf"rank 1 \({drained}\) exited with {EXIT_DRAINED}\b", output), output[-4000:]

    # One configuration removed it, and a spare took rank 1 with the survivors' state. Every
    # member of the new configuration formed the same group, once: the handover's, even one
    # that was handed only the late spare's admission decided right after (its plan names no
    # assignment; the heir then fetches all the same).
    changes = [r for r in events if r["event"] == "change"]
    [c_drain] = {r["config_id"] for r in changes if drained in r["removed"]}
    [plan] = [r for r in changes if r["config_id"] == c_drain][:1]
    [[rank, heir]] = plan["assignments"]
    assert rank == 1 and heir in set(_starts(work)) - {r["member"] for r in by_rank.values()}
    survivors = {by_rank[r]["member"] for r in (0, 2, 3)}
    formed = [r for r in events if r["event"] == "group_formed" and r["config_id"] >= c_drain]
    assert {r["group_id"] for r in formed} == {c_drain}
    assert sorted(r["member"] for r in formed) == sorted(survivors | {heir})
    [fetched] = [r for r in events if r["event"] == "state_fetched"]
    assert fetched["member"] == heir and fetched["config_id"] >= c_drain
    assert fetched["restored_fingerprint"] == fetched["fingerprint"]
    assert fetched["step"] >= plan["resume_step"]
    # The drained member trained until the decision, never in a configuration without it. The
    # survivors reach the resume step by themselves (redo or roll forward, never a fetch): no
    # survivor applied a step past the plan's resume step, though their group could still
    # commit after the decision (their agents refuse such a commit); only the drained member
    # may have applied the step the survivors then refused and redo.
    its_steps = [r["step"] for r in mine if r["event"] == "step"]
    assert its_steps == list(range(len(its_steps))) and its_steps
    assert max(its_steps) <= plan["resume_step"]
    assert all(r["config_id"] < c_drain for r in mine if r["event"] in ("step", "joined"))
    assert all(r["step"] < plan["resume_step"] for r in events if r["event"] == "step"
               and r["member"] in survivors and r["config_id"] < c_drain)
    rules = [r for r in events if r["event"] == "commit_rule" and r["config_id"] >= c_drain]
    # Every survivor applies the rule; one that rolls a committed step forward then logs the
    # redo of the next (the training API applies the step in the script's loop).
    assert {r["member"] for r in rules} == survivors
    for member in survivors:
        own = [(r["action"], r["step"]) for r in rules if r["member"] == member]
        assert len(own) == 1 or (len(own) == 2 and own[0][0] == "roll_forward"
                                 and own[1] == ("redo", own[0][1] + 1)), own
    assert {r["action"] for r in rules} <= {"redo", "roll_forward"}, rules
    assert {r["member"] for r in mine if r["event"] == "draining"} == {drained}

    # The late spare was admitted: it took rank 1, or it is a spare of the final configuration.
    assert heir == late_member or late_role == "spare", (heir, late_member, late_role)

    # Same plan for everyone: every member that built a group of a new configuration logged
    # that configuration's plan before its first collective there (the group's rendezvous),
    # and every member that logged a configuration's plan logged the same plan hash.
    for c in sorted({r["config_id"] for r in events if r["event"] == "joined"} - {0}):
        for member in {r["member"] for r in events if r["event"] == "joined"
                       and r["config_id"] == c}:
            planned = [r["t"] for r in changes if r["config_id"] == c and r["member"] == member]
            formed = [r["t"] for r in events if r["event"] == "group_formed"
                      and r["config_id"] == c and r["member"] == member]
            assert planned and formed and min(planned) < min(formed), (c, member)
    for c in {r["config_id"] for r in changes}:
        assert len({r["plan_hash"] for r in changes if r["config_id"] == c}) == 1, c

    # No step lost, every rank ran every step, the same result as without the drain.
    committed = {r["step"] for r in events if r["event"] == "step"}
    assert committed == set(range(STEPS))
    finals = final_states(work / "out")
    assert {r["rank"] for r in finals} == {0, 1, 2, 3}
    assert {r["member"] for r in finals if r["rank"] == 1} == {heir}
    assert all(r["steps"] == STEPS for r in finals)
    finished = [r for r in events if r["event"] == "finished"]
    assert {r["member"] for r in finished} >= {r["member"] for r in finals}
    assert {r["fingerprint"] for r in finished} == {clean.finals[0]["fingerprint"]}
    assert {r["weights_sha256"] for r in finals} == {clean.finals[0]["weights_sha256"]}
    # Rank 0's own losses (each rank logs its own), the same curve bit for bit.
    survivor = next(r for r in finals if r["rank"] == 0)
    assert survivor["losses"] == next(r for r in clean.finals if r["rank"] == 0)["losses"]
