"""``torchpass-p2p launch`` with real processes: environment, key handling, configuration 0,
fast evidence, respawn, join through seeds and signal handling.

Why one file of this size: its tests share the child scripts and status page of
tests/launch/procs.py and follow one launch from its environment to its signals.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchpass_p2p.agent.bootstrap import read_configuration
from torchpass_p2p.agent.http import http_token
from torchpass_p2p.agent.settings import load_settings
from torchpass_p2p.cli.main import main
from torchpass_p2p.launch.keyfile import write_key_file
from torchpass_p2p.launch.launcher import STALL_S
from torchpass_p2p.launch.outcome import EXIT_STOPPED

from .procs import (
    finish,
    gone,
    reports,
    socket_inodes,
    start_launcher,
    wait_for,
    write_script,
)

pytestmark = pytest.mark.timeout(30)

WAIT_FOR_GO = '''
import socket, time
out = Path(sys.argv[1])
fds = [*os.environ["TORCHPASS_BIND_FDS"].split(","), os.environ["TORCHPASS_STATUS_FD"]]
handed = [socket.socket(fileno=int(fd)) for fd in fds]
env = dump(out, sockets=[(s.type.name, s.getsockname()[1]) for s in handed])
deadline = time.monotonic() + 20
while not (out / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
if env["TORCHPASS_ROLE"] == "spare":
    time.sleep(60)  # an idle spare: the launcher stops it
'''


def test_children_get_the_contract_and_never_the_key(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", WAIT_FOR_GO)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "2",
                               "--topology", "node7/nvl1", str(script), str(out)])
    try:
        envs = reports(out, 3)
        key_file = Path(envs[0]["TORCHPASS_KEY_FILE"])
        run_dir = Path(envs[0]["TORCHPASS_RUN_DIR"])
        key_hex = key_file.read_text().strip()
        assert len(key_hex) == 64 and bytes.fromhex(key_hex)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert key_file.parent == run_dir
        for pid in [launcher.pid, *(e["pid"] for e in envs)]:
            assert key_hex.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert key_hex.encode() not in Path(f"/proc/{pid}/environ").read_bytes()

        ids = [e["TORCHPASS_MEMBER_ID"] for e in envs]
        assert len(set(ids)) == 3 and all(len(i) == 16 for i in ids)
        # Each child is told when the launcher started it and those before it (its agent's
        # start-up grace for members it has not heard from yet: Params.start_grace_s).
        records = [dict(part.split("@") for part in e["TORCHPASS_STARTED"].split(","))
                   for e in envs]
        assert sorted(len(r) for r in records) == [1, 2, 3]
        assert all(e["TORCHPASS_MEMBER_ID"] in r and set(r) <= set(ids)
                   for e, r in zip(envs, records, strict=True))
        ranks = sorted((e for e in envs if e["TORCHPASS_ROLE"] == "rank"),
                       key=lambda e: e["RANK"])
        (spare,) = [e for e in envs if e["TORCHPASS_ROLE"] == "spare"]
        assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"])
                for e in ranks] == [("0", "2", "0", "2"), ("1", "2", "1", "2")]
        assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} & set(spare)
        binds = {e["TORCHPASS_BIND"] for e in envs}
        statuses = {e["TORCHPASS_STATUS"] for e in envs}
        assert len(binds) == 3 and len(statuses) == 3
        assert all(s.startswith("127.0.0.1:") for s in statuses)
        # Each child was handed its sockets already bound to its ports (no race with other
        # binds between choosing a port and the child binding it); the launcher let go of them.
        launchers = set(socket_inodes(launcher.pid).values())
        for e in envs:
            port = int(e["TORCHPASS_BIND"].rsplit(":", 1)[1])
            status = int(e["TORCHPASS_STATUS"].rsplit(":", 1)[1])
            assert e["sockets"] == [["SOCK_DGRAM", port], ["SOCK_STREAM", port],
                                    ["SOCK_STREAM", status]]
            inodes = socket_inodes(e["pid"])
            fds = [*map(int, e["TORCHPASS_BIND_FDS"].split(",")), int(e["TORCHPASS_STATUS_FD"])]
            assert not {inodes[fd] for fd in fds} & launchers
        for e in envs:
            assert e["TORCHPASS_TOPOLOGY"] == "node7/nvl1"
            assert e["TORCHPASS_CLUSTER"] == "torchpass"
            assert "TORCHPASS_SEEDS" not in e and "TORCHPASS_KEY" not in e
            assert "TORCHPASS_PROFILE" not in e

        config = read_configuration(envs[0]["TORCHPASS_CONFIGURATION"])
        assert config.config_id == 0
        assert config.ranks == tuple(int(e["TORCHPASS_MEMBER_ID"], 16) for e in ranks)
        assert config.spares == (int(spare["TORCHPASS_MEMBER_ID"], 16),)
        for e in envs:
            member = int(e["TORCHPASS_MEMBER_ID"], 16)
            host, port = config.addresses[member]
            assert e["TORCHPASS_BIND"] == f"{host}:{port}"
            assert (config.topology_of(member).host, config.topology_of(member).domain) == (
                "node7", "nvl1")
            # The agent accepts exactly this environment.
            settings = load_settings(environ={k: v for k, v in e.items() if k != "pid"})
            assert settings.member_id == member and settings.configuration == config
    finally:
        (out / "go").touch()
    code, log = finish(launcher)
    assert code == 0, log
    assert ("every rank exited 0; 1 process(es) left, started as spare(s); idle: 1 spare "
            "(started as one), stopping them now") in log
    assert not run_dir.exists()
    assert all(gone(e["pid"]) for e in envs)


EVIDENCE = '''
import asyncio
from aiohttp import web

out = Path(sys.argv[1])
env = dump(out)
me = env["TORCHPASS_MEMBER_ID"]

async def main():
    if env.get("RANK") == "1":  # dies once both siblings listen
        while len(list(out.glob("ready-*"))) < 2:
            await asyncio.sleep(0.02)
        sys.exit(3)
    got = asyncio.Event()

    async def evidence(request):
        record = {"auth": request.headers.get("Authorization"), "body": await request.json()}
        (out / f"evidence-{me}.txt").write_text(json.dumps(record))
        got.set()
        return web.json_response({"accepted": True})

    runner = await serve(env, "POST", "/evidence", evidence)
    (out / f"ready-{me}").touch()
    await asyncio.wait_for(got.wait(), 15)
    if env["TORCHPASS_ROLE"] == "spare":
        await asyncio.sleep(60)
    await runner.cleanup()

asyncio.run(main())
'''


def test_a_failed_child_is_reported_to_every_live_sibling(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    key_file = tmp_path / "cluster.key"
    key = write_key_file(key_file)
    script = write_script(tmp_path, "child.py", EVIDENCE)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "1",
                               "--key-file", str(key_file), str(script), str(out)])
    code, log = finish(launcher)
    envs = reports(out, 3, timeout_s=0)
    (dead,) = [e for e in envs if e.get("RANK") == "1"]
    siblings = [e for e in envs if e is not dead]
    for e in envs:
        assert e["TORCHPASS_KEY_FILE"] == str(key_file)
    for e in siblings:
        record = json.loads((out / f"evidence-{e['TORCHPASS_MEMBER_ID']}.txt").read_text())
        assert record == {
            "auth": f"Bearer {http_token(key)}",
            "body": {"member_id": dead["TORCHPASS_MEMBER_ID"], "reason": "exited with 3",
                     "exited": True},
        }
    # rank 1 failed, rank 0 then exited 0 (job complete), the spare was stopped after 1 s.
    assert "rank 1 (" in log and "exited with 3" in log
    assert code == 0, log


RESPAWN = '''
import time
out = Path(sys.argv[1])
env = dump(out)
if env.get("RANK") == "1":
    sys.exit(3)
if "TORCHPASS_CONFIGURATION" not in env:  # the respawned spare
    sys.exit(0)
if env["TORCHPASS_ROLE"] == "rank":  # rank 0 finishes once the new spare has reported
    deadline = time.monotonic() + 15
    while len(list(out.glob("*.json"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(0)
time.sleep(60)
'''


def test_respawn_starts_a_new_spare_that_joins_through_the_live_members(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", RESPAWN)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "1", "--respawn",
                               "--max-respawns", "1", str(script), str(out)])
    code, log = finish(launcher)
    envs = reports(out, 4, timeout_s=0)
    assert code == 0, log
    first = [e for e in envs if "TORCHPASS_CONFIGURATION" in e]
    (new,) = [e for e in envs if "TORCHPASS_CONFIGURATION" not in e]
    assert len(first) == 3
    assert new["TORCHPASS_ROLE"] == "spare" and "RANK" not in new
    assert new["TORCHPASS_MEMBER_ID"] not in {e["TORCHPASS_MEMBER_ID"] for e in first}
    assert new["TORCHPASS_BIND"] not in {e["TORCHPASS_BIND"] for e in first}
    assert new["TORCHPASS_STATUS"] not in {e["TORCHPASS_STATUS"] for e in first}
    live = {e["TORCHPASS_BIND"] for e in first if e.get("RANK") != "1"}
    assert set(new["TORCHPASS_SEEDS"].split(",")) == live
    assert new["TORCHPASS_KEY_FILE"] == first[0]["TORCHPASS_KEY_FILE"]
    assert "respawning rank 1" in log


DRAINED = '''
import time
out = Path(sys.argv[1])
env = dump(out)
if env.get("RANK") == "1":
    sys.exit(4)  # EXIT_DRAINED: its rank went to a spare on purpose
if env["TORCHPASS_ROLE"] == "rank":
    time.sleep(1.5)  # long enough for a respawn to show
    sys.exit(0)
time.sleep(60)
'''


def test_a_drained_member_is_not_respawned(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", DRAINED)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "1", "--respawn",
                               str(script), str(out)])
    code, log = finish(launcher)
    assert code == 0, log
    assert "exited with 4" in log
    assert "respawning" not in log, log
    assert len(reports(out, 3, timeout_s=0)) == 3  # nobody started after the first three


PAUSED_PAST_THE_END = '''
import signal, time
out = Path(sys.argv[1])
dump(out)
rank = os.environ["RANK"]
if rank == "1":
    sys.exit(1)  # a failure first: roles are unknown from here on
if rank == "2":
    os.kill(os.getpid(), signal.SIGSTOP)  # paused, as a member past its lease
    time.sleep(60)
time.sleep(1.5)  # rank 0: the job completes
'''


def test_a_stopped_member_is_not_given_the_grace_and_is_continued_to_terminate(
        tmp_path: Path) -> None:
    # With the old launcher the stopped member held it for the whole grace, then ignored
    # SIGTERM for another grace (it was never continued) until SIGKILL: 40 s here.
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", PAUSED_PAST_THE_END)
    launcher = start_launcher(["--nproc", "3", "--grace", "20", str(script), str(out)])
    code, log = finish(launcher)
    assert code == 0, log
    assert "job complete" in log and "idle: 1 stopped by a signal, stopping them now" in log, log
    assert "rank 2 " in log and "exited with signal SIGTERM" in log, log
    assert "grace period over" not in log and "killing rank 2" not in log, log


PAUSED_WHILE_ANOTHER_FINISHES = '''
import signal, time
out = Path(sys.argv[1])
dump(out)
rank = os.environ["RANK"]
if rank == "1":
    sys.exit(1)  # a failure first: roles are unknown from here on
if rank == "2":
    os.kill(os.getpid(), signal.SIGSTOP)  # paused, as a member past its lease
    time.sleep(60)
time.sleep(1.5 if rank == "0" else 3.0)  # rank 0 completes the job; rank 3 is still finishing
'''


def test_the_grace_ends_when_only_stopped_members_are_left(tmp_path: Path) -> None:
    # The job completes while rank 3 is still finishing and rank 2 is stopped: the launcher
    # waits for rank 3, then stops rank 2 at once instead of after the rest of the 20 s grace
    # (the main job's faulty run spent up to its 3 s grace there).
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", PAUSED_WHILE_ANOTHER_FINISHES)
    launcher = start_launcher(["--nproc", "4", "--grace", "20", str(script), str(out)])
    code, log = finish(launcher)
    assert code == 0, log
    finishing = log.index("job complete; 2 process(es) may still be finishing; "
                          "waiting up to 20.0 s")
    rank_3 = log.index("rank 3 ", finishing)
    assert log.index("idle: 1 stopped by a signal, stopping them now", rank_3) > rank_3, log
    assert "exited with signal SIGTERM" in log[rank_3:], log
    assert "grace period over" not in log and "killing rank 2" not in log, log


ROLES_ON_THE_STATUS_PAGE = '''
import asyncio, time

out = Path(sys.argv[1])
env = dump(out)
rank = env.get("RANK")
if rank == "1":
    sys.exit(1)  # a failure first: roles are unknown from here on
role = {None: "spare", "2": "removed"}.get(rank, "rank")

async def main():
    runner = await serve_status(env, lambda: {"role": role, "members": []})
    # rank 0 completes the job; rank 3 is still finishing; the spare and the removed rank 2
    # would idle for a minute
    await asyncio.sleep({"0": 1.5, "3": 3.0}.get(rank, 60))
    await runner.cleanup()

asyncio.run(main())
'''


def test_the_grace_ends_when_only_members_holding_no_rank_are_left(tmp_path: Path) -> None:
    # After a failure the launcher cannot tell ranks from spares by their exits; their agents'
    # status pages can. It waits for rank 3 (role "rank"), then stops the idle spare and the
    # removed member at once instead of after the 20 s grace (the main job's runs with one
    # fault spent their 3 s grace there).
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", ROLES_ON_THE_STATUS_PAGE)
    launcher = start_launcher(["--nproc", "4", "--spares", "1", "--grace", "20", str(script),
                               str(out)])
    code, log = finish(launcher)
    assert code == 0, log
    finishing = log.index("job complete; 3 process(es) may still be finishing; "
                          "waiting up to 20.0 s")
    rank_3 = log.index("rank 3 (", finishing)
    assert log.index("exited 0: job complete; 2 process(es) may still be finishing; idle: "
                     "1 removed (per its agent), 1 spare (per its agent), stopping them now",
                     rank_3) > rank_3, log
    assert log.count("exited with signal SIGTERM") == 2, log
    assert "grace period over" not in log, log


PAUSED_AT_THE_END_WHILE_HOLDING_ITS_RANK = '''
import asyncio, json, signal, subprocess, time

out = Path(sys.argv[1])
env = dump(out)
rank = env.get("RANK")
if rank == "1":
    sys.exit(1)  # a failure first: roles are unknown from here on
if rank == "0":
    time.sleep(1.5)  # completes the job while rank 2 is paused
    sys.exit(0)
if rank == "2":  # paused for a moment at the very end, not removed: it still holds rank 2
    time.sleep(1.0)
    subprocess.Popen(["sh", "-c", f"sleep 2.5; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
    (out / "rank-2-done").touch()
    sys.exit(0)

async def main():  # the spare: its agent's configuration still gives rank 2 to that member
    (holder,) = [e["TORCHPASS_MEMBER_ID"] for e in map(json.loads, (
        p.read_text() for p in out.glob("*.json"))) if e.get("RANK") == "2"]

    await serve_status(env, lambda: {"role": "spare", "members": [
               {"member_id": holder, "role": "rank", "rank": 2}]})
    await asyncio.sleep(60)

time.sleep(0.5)  # rank 2 has reported its member id
asyncio.run(main())
'''


def test_a_stopped_member_that_still_holds_a_rank_is_waited_for(tmp_path: Path) -> None:
    # Rank 2 is paused (SIGSTOP) when rank 0 completes the job; the idle spare's agent still
    # lists it as holding rank 2, so it is not idle: the launcher waits, rank 2 is continued
    # and finishes, and only then is the spare stopped. (Counting every stopped child as idle
    # had rank 2 killed before it wrote its final output.)
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", PAUSED_AT_THE_END_WHILE_HOLDING_ITS_RANK)
    launcher = start_launcher(["--nproc", "3", "--spares", "1", "--grace", "20", str(script),
                               str(out)])
    code, log = finish(launcher)
    assert code == 0, log
    assert (out / "rank-2-done").exists(), log
    finishing = log.index("job complete; 2 process(es) may still be finishing; "
                          "waiting up to 20.0 s")
    rank_2 = log.index("rank 2 (", finishing)
    assert log[rank_2:].startswith("rank 2 (") and "exited with 0" in log[rank_2:], log
    assert log.index("idle: 1 spare (per its agent), stopping them now", rank_2) > rank_2, log
    assert log.count("exited with signal SIGTERM") == 1, log
    assert "grace period over" not in log, log


A_SPARE_THAT_TOOK_A_RANK_ELSEWHERE = '''
import asyncio, time

out = Path(sys.argv[1])
env = dump(out)
if env["TORCHPASS_ROLE"] == "rank":
    time.sleep(1.0)  # both local ranks finish cleanly: roles look known to this launcher
    sys.exit(0)

async def main():  # the spare replaced a rank of another host and is finishing the last step
    runner = await serve_status(env, lambda: {"role": "rank", "members": []})
    await asyncio.sleep(2.5)
    (out / "spare-done").touch()
    await runner.cleanup()

asyncio.run(main())
'''


def test_a_spare_whose_agent_holds_a_rank_gets_the_grace(tmp_path: Path) -> None:
    # Every rank started here exited 0, but the spare took a rank (on another host, as far as
    # this launcher can tell): stopping it at once, as an idle spare, would cut its last step.
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", A_SPARE_THAT_TOOK_A_RANK_ELSEWHERE)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "20", str(script),
                               str(out)])
    code, log = finish(launcher)
    assert code == 0, log
    assert (out / "spare-done").exists(), log
    assert ("every rank exited 0; 1 process(es) left, started as spare(s); waiting up to "
            "20.0 s") in log, log
    assert "spare (" in log and "SIGTERM" not in log and "grace period over" not in log, log


THE_AGREEMENT_STOPS_THE_JOB = '''
import time
out = Path(sys.argv[1])
env = dump(out)
if env.get("RANK") == "1":
    sys.exit(1)  # a failure: respawned as a new spare, which would wait forever
if env.get("RANK") == "0":
    time.sleep(1.0)
    sys.exit(5)  # EXIT_STOPPED: the agreement stopped the job
time.sleep(60)
'''


def test_the_agreement_stopping_the_job_stops_the_launch(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", THE_AGREEMENT_STOPS_THE_JOB)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "2", "--respawn",
                               str(script), str(out)])
    code, log = finish(launcher)
    assert code == EXIT_STOPPED, log  # the job stopped: resume it from its checkpoint
    assert "respawning rank 1" in log, log
    assert re.search(r"rank 0 \([0-9a-f]{16}\) stopped the job; waiting up to "
                     r"2.0 s for the rest", log), log
    assert "grace period over" in log, log  # the spare and the respawned one would wait
    assert log.count("exited with signal SIGTERM") == 2, log
    assert "exit code 5: a member stopped the job: the agreement left a rank" in log, log
    assert log.rstrip().endswith("the job stops: resume it from its last checkpoint"), log


A_MEMBER_STOPS_ALONE = '''
import asyncio, time

out = Path(sys.argv[1])
env = dump(out)
rank = env.get("RANK")
if rank == "2":
    time.sleep(0.5)
    sys.exit(5)  # EXIT_STOPPED by this member alone: its script described another job


async def main():
    def answer():
        role = "spare" if rank is None else "rank"
        return {"role": role, "config_id": 0, "fenced": False,
                "members": []}

    await serve_status(env, answer)
    await asyncio.sleep(60 if rank is None else 3.5)  # the ranks train on past the grace

asyncio.run(main())
'''


def test_a_member_stopping_alone_leaves_the_job_running(tmp_path: Path) -> None:
    # A member refused at its join (torchpass_p2p.JobMismatch) exits 5 while the others, with
    # a spare in its place, train on; the launcher must not stop them all after the grace.
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", A_MEMBER_STOPS_ALONE)
    launcher = start_launcher(["--nproc", "3", "--spares", "1", "--grace", "1",
                               str(script), str(out)])
    code, log = finish(launcher, timeout_s=15)
    assert code == 0, log
    assert re.search(r"rank 2 \([0-9a-f]{16}\) stopped the job; waiting up to 1.0 s for the "
                     r"rest", log), log
    assert re.search(r"rank \d \([0-9a-f]{16}\) still holds a rank in configuration 0: the "
                     r"job goes on", log), log
    assert "grace period over" not in log, log
    assert len(re.findall(r"rank [01] \([0-9a-f]{16}\) exited with 0", log)) == 2, log
    assert "exit code 0: job complete" in log, log



A_RANK_NOBODY_CAN_RUN = '''
import asyncio, time

out = Path(sys.argv[1])
env = dump(out)
rank = env.get("RANK")
if rank == "2":
    time.sleep(0.5)
    sys.exit(5)  # refused at its join: its script describes another job than the others'
if rank is None:
    time.sleep(3.0)  # past rank 2's grace: the spare took rank 2 and runs the same script
    sys.exit(5)


async def main():
    await serve_status(env, lambda: {"role": "rank", "config_id": 0, "fenced": False,
                                     "members": []})
    await asyncio.sleep(60)

asyncio.run(main())
'''


def test_a_rank_whose_replacement_is_refused_too_stops_the_job(tmp_path: Path) -> None:
    # Rank 2's script describes another job, and so does its replacement's (the same script):
    # every replacement would be refused, so the launcher stops the job at the second refusal
    # instead of leaving ranks 0 and 1 to wait for a spare until their give-up time.
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", A_RANK_NOBODY_CAN_RUN)
    launcher = start_launcher(["--nproc", "3", "--spares", "1", "--grace", "1",
                               str(script), str(out)])
    code, log = finish(launcher, timeout_s=20)
    assert code == EXIT_STOPPED, log
    assert re.search(r"rank 2 \([0-9a-f]{16}\) stopped alone \(refused at its join: its "
                     r"script describes another job than the others', as its last line says\); "
                     r"rank [01] \([0-9a-f]{16}\) still holds a rank in configuration 0: the "
                     r"job goes on", log), log
    why = (r"rank 2 \([0-9a-f]{16}\) and then spare \([0-9a-f]{16}\), which replaced it, were "
           r"refused at their join: the script describes another job on that rank than on the "
           r"others \(their last lines above say what differs\); every replacement runs the "
           r"same script and would be refused too: the job stops; make every rank describe the "
           r"same job \(epochs, dataset, model, seed, \.\.\.\)")
    assert re.search(why + "; stopping the remaining processes", log), log
    assert re.search("exit code 5: " + why + "$", log.rstrip()), log
    assert "resume it from its last checkpoint" not in log, log
    assert log.count("exited with signal SIGTERM") == 2, log
    assert "grace period over" not in log, log


A_RANK_LEFT_WITHOUT_A_SPARE = '''
import asyncio, time

out = Path(sys.argv[1])
env = dump(out)
rank = env.get("RANK")
if rank == "2":
    time.sleep(0.5)
    sys.exit(5)  # refused at its join, and no spare is there to take its rank


async def main():
    started = time.monotonic()
    while len(list(out.glob("*.json"))) < 3:
        await asyncio.sleep(0.02)
    envs = [json.loads(p.read_text()) for p in out.glob("*.json")]
    ranks = [{"member_id": e["TORCHPASS_MEMBER_ID"], "role": "rank"} for e in envs
             if e["RANK"] != "2"]

    def answer():
        later = time.monotonic() - started > 1.0  # the change that left rank 2 vacant
        return {"role": "rank", "config_id": 1 if later else 0,
                "fenced": False, "world_size": 3, "members": ranks}

    await serve_status(env, answer)
    await asyncio.sleep(8.0)  # the ranks wait, then finish (in a real job: their give-up time)

asyncio.run(main())
'''


def test_a_rank_left_vacant_without_a_spare_is_said_once(tmp_path: Path) -> None:
    # Rank 2 stops alone (EXIT_STOPPED, no failure) and no spare is left to take its rank:
    # the launcher says once why the others wait, as after a failure.
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", A_RANK_LEFT_WITHOUT_A_SPARE)
    launcher = start_launcher(["--nproc", "3", "--grace", "1", str(script), str(out)])
    code, log = finish(launcher, timeout_s=25)
    assert code == 0, log
    assert re.search(r"rank 2 \([0-9a-f]{16}\) stopped alone .*: the job goes on", log), log
    hint = ("configuration 1 has 1 vacant rank(s) and no spare left to fill them, and "
            "--respawn is off: under policy wait the members wait for a spare to join")
    assert log.count(hint) == 1, log
    assert "exit code 0: job complete" in log, log

A_MAJORITY_DIES = '''
import asyncio, json, time

out = Path(sys.argv[1])
env = dump(out)
rank = env.get("RANK")
if rank in ("0", "1"):
    time.sleep(0.5)
    sys.exit(1)  # two of four members die: the other two can never decide anything again

joining = "TORCHPASS_SEEDS" in env  # respawned: never admitted, never fenced

async def main():
    started = time.monotonic()
    while len(list(out.glob("*.json"))) < 4:
        await asyncio.sleep(0.02)
    members = [e["TORCHPASS_MEMBER_ID"] for e in map(json.loads, (
        p.read_text() for p in out.glob("*.json"))) if "TORCHPASS_SEEDS" not in e]

    def answer():
        fenced = not joining and time.monotonic() - started > 3.0  # as after the lease
        if fenced:
            (out / f"said-fenced-{rank}").touch()
        role = "joining" if joining else "spare" if rank is None else "rank"
        return {"role": role, "config_id": 0, "fenced": fenced,
                "members": [{"member_id": m} for m in members]}

    await serve_status(env, answer)
    await asyncio.sleep(60)

asyncio.run(main())
'''


@pytest.mark.parametrize("respawn", [False, True], ids=["", "respawn"])
def test_a_job_whose_majority_died_is_stopped_once_the_agents_are_fenced(
        tmp_path: Path, respawn: bool) -> None:
    # Rank 2 and the spare are 2 of the 4 members: no configuration can be decided again, so
    # nothing will ever give them work, and the launcher must not wait for them until killed.
    # Respawned spares change nothing: they could be admitted only by a majority.
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", A_MAJORITY_DIES)
    launcher = start_launcher(["--nproc", "3", "--spares", "1", "--grace", "20",
                               *(["--respawn"] if respawn else []), str(script), str(out)])
    code, log = finish(launcher, timeout_s=15)
    assert code == EXIT_STOPPED, log
    lost = ("no majority of configuration 0 is left: 2 of its 4 members exited and a majority "
            "is 3; the job stops: resume it from its last checkpoint")
    assert f"{lost}; stopping the remaining processes" in log, log
    assert f"exit code 5: {lost}" in log, log
    assert (out / "said-fenced-2").exists() and (out / "said-fenced-None").exists()
    assert log.count("respawning") == (2 if respawn else 0), log
    assert log.count("exited with signal SIGTERM") == (4 if respawn else 2), log
    assert "grace period over" not in log, log


A_SURVIVOR_WITHOUT_A_MAJORITY = '''
import asyncio, json, os, signal, time

out = Path(sys.argv[1])
env = dump(out)
rank = env.get("RANK")
if rank != "0":
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSTOP)  # paused, not dead: nothing exits
    time.sleep(60)

async def main():
    while len(list(out.glob("*.json"))) < 3:
        await asyncio.sleep(0.02)
    members = [json.loads(p.read_text())["TORCHPASS_MEMBER_ID"] for p in out.glob("*.json")]
    started = time.monotonic()

    def answer():
        # As its agent once both peers are suspected: fenced, alone of three.
        (out / "asked").touch()
        return {"role": "rank", "config_id": 0, "fenced": True,
                "reachable": 1, "majority": 2,
                "members": [{"member_id": m, "role": "rank"}
                            for m in members]}

    await serve_status(env, answer)
    while not (out / "asked").exists() or time.monotonic() - started < 3.0:
        await asyncio.sleep(0.05)
    # Its give-up time is over: the trainer stops the job, with its own line.
    sys.exit(5)

asyncio.run(main())
'''


def test_a_member_left_without_a_majority_stops_the_launch_saying_how_many_are_left(
        tmp_path: Path) -> None:
    # Two of three ranks paused (SIGSTOP): nothing exits, so the launcher cannot count a lost
    # majority itself. The survivor stops the job (EXIT_STOPPED) after its give-up time; the
    # launcher says why with the counts the survivor's status page last gave, and exits 5.
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", A_SURVIVOR_WITHOUT_A_MAJORITY)
    launcher = start_launcher(["--nproc", "3", "--grace", "1", str(script), str(out)])
    code, log = finish(launcher, timeout_s=20)
    assert code == EXIT_STOPPED, log
    lost = ("no majority of configuration 0 is left: 1 of its 3 members is reachable and a "
            "majority is 2; the job stops: resume it from its last checkpoint")
    assert re.search(rf"rank 0 \([0-9a-f]{{16}}\) stopped the job: {lost}; waiting up to "
                     r"1.0 s for the rest\n", log), log
    assert log.count("exited with signal SIGTERM") == 2, log  # the paused ones, continued
    assert f"exit code 5: {lost}" in log, log


A_RANK_STAYS_VACANT = '''
import asyncio, json, time

out = Path(sys.argv[1])
env = dump(out)
rank = env.get("RANK")
if rank == "1":
    time.sleep(0.5)
    sys.exit(1)  # no spare: its rank stays vacant (policy wait) in configuration 1


async def main():
    while len(list(out.glob("*.json"))) < 3:
        await asyncio.sleep(0.02)
    members = [e["TORCHPASS_MEMBER_ID"] for e in map(json.loads, (
        p.read_text() for p in out.glob("*.json"))) if e.get("RANK") != "1"]

    await serve_status(env, lambda: {"role": "rank", "config_id": 1, "world_size": 3,
                                     "members": [{"member_id": m, "role": "rank"}
                                                 for m in members]})
    await asyncio.sleep(4)
    sys.exit(0)

asyncio.run(main())
'''


@pytest.mark.parametrize("respawn", [False, True], ids=["", "respawns-used"])
def test_a_vacant_rank_no_spare_can_fill_is_said_once(tmp_path: Path, respawn: bool) -> None:
    # With --respawn on and its respawns used, the vacancy is said once: the ranks must not
    # wait in silence up to their give-up time.
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", A_RANK_STAYS_VACANT)
    launcher = start_launcher(["--nproc", "3", "--spares", "0", "--grace", "1",
                               *(["--respawn", "--max-respawns", "0"] if respawn else []),
                               str(script), str(out)])
    code, log = finish(launcher, timeout_s=20)
    why = ("and the 0 respawn(s) of --max-respawns are used" if respawn
           else "and --respawn is off")
    said = f"configuration 1 has 1 vacant rank(s) and no spare left to fill them, {why}"
    assert log.count(said) == 1, log
    assert code == 0, log


STUBBORN = '''
import signal, subprocess, time
out = Path(sys.argv[1])
extra = {}
if os.environ["TORCHPASS_ROLE"] == "spare":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops it
elif os.environ["RANK"] == "0":
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    extra["worker"] = worker.pid
dump(out, **extra)
time.sleep(60)
'''


def test_sigterm_is_forwarded_then_escalated_and_the_run_dir_removed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", STUBBORN)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "1",
                               str(script), str(out)])
    envs = reports(out, 3)
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    code, log = finish(launcher)
    assert code == 128 + signal.SIGTERM, log
    assert time.monotonic() - started < 5
    assert "received SIGTERM" in log and "killing spare" in log
    pids = [e["pid"] for e in envs] + [e["worker"] for e in envs if "worker" in e]
    assert len(pids) == 4
    wait_for(lambda: all(gone(p) for p in pids), 3, "every child and grandchild gone")
    assert not Path(envs[0]["TORCHPASS_RUN_DIR"]).exists()


def test_exits_reaped_together_after_the_launcher_was_stopped_have_no_order(
        tmp_path: Path) -> None:
    # Rank 1 is killed and rank 0 completes the job while the launcher is stopped: reaped
    # together, the death cannot be shown to come after the completion (it was reported as
    # a failure after completion, exit 1, when reaped second).
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", WAIT_FOR_GO)
    launcher = start_launcher(["--nproc", "2", str(script), str(out)])
    envs = reports(out, 2)
    stopped_at = time.monotonic()
    launcher.send_signal(signal.SIGSTOP)
    try:
        [victim] = [e for e in envs if e["RANK"] == "1"]
        os.kill(victim["pid"], signal.SIGKILL)
        (out / "go").touch()
        wait_for(lambda: all(gone(e["pid"]) for e in envs), 10, "both children ended")
        time.sleep(max(0.0, stopped_at + STALL_S + 0.5 - time.monotonic()))
    finally:
        launcher.send_signal(signal.SIGCONT)
    code, log = finish(launcher)
    assert code == 0, log
    assert "the launcher did not run for" in log and "exited with signal SIGKILL" in log
    assert "exit code 0: job complete" in log


UNKILLABLE_LAUNCH = '''
import asyncio, os, signal, sys
from torchpass_p2p.launch import launcher
from torchpass_p2p.launch.children import Child

launcher.KILL_WAIT_S = 0.5
real_send = Child.send


def send(self, sig):  # a process in uninterruptible sleep: SIGKILL does nothing yet
    if sig != signal.SIGKILL:
        real_send(self, sig)


Child.send = send


async def main():
    options = launcher.LaunchOptions(script=sys.argv[1], nproc=1, grace_s=0.5,
                                     script_args=[sys.argv[2]])
    run = asyncio.ensure_future(launcher.launch(options))
    while not os.listdir(sys.argv[2]):  # the child is up
        await asyncio.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)  # a person stops the job
    print("launch returned", await run, flush=True)


asyncio.run(main())
'''


def test_a_child_that_survives_sigkill_is_abandoned_and_the_launch_still_ends(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
dump(Path(sys.argv[1]))
time.sleep(60)
""")
    driver = tmp_path / "driver.py"
    driver.write_text(UNKILLABLE_LAUNCH)
    log_path = tmp_path / "launch.log"
    with open(log_path, "wb") as log_file:  # not a pipe: the surviving child holds it open
        launch = subprocess.Popen([sys.executable, str(driver), str(script), str(out)],
                                  stdout=log_file, stderr=subprocess.STDOUT)
    try:
        code = launch.wait(20)
    finally:
        launch.kill()
        [env] = reports(out, 1)
        os.kill(env["pid"], signal.SIGKILL)  # what the launcher's SIGKILL could not do
    log = log_path.read_text()
    assert code == 0, log
    assert "survived SIGKILL for 0 s; abandoned" in log
    assert f"launch returned {128 + signal.SIGTERM}" in log


ORPHAN_GUARD = '''
import time
from torchpass_p2p.agent.lifeline import die_with_launcher
out = Path(sys.argv[1])
dump(out, guarded=die_with_launcher())
time.sleep(60)
'''


def test_children_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", ORPHAN_GUARD)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", str(script), str(out)])
    envs = reports(out, 3)
    assert all(e["guarded"] and e["TORCHPASS_LAUNCHER_PID"] == str(launcher.pid) for e in envs)
    launcher.kill()  # no chance to forward anything
    launcher.communicate()
    wait_for(lambda: all(gone(e["pid"]) for e in envs), 5, "every child gone")
    shutil.rmtree(envs[0]["TORCHPASS_RUN_DIR"])  # left behind by a killed launcher, key and all


def test_die_with_launcher_leaves_a_process_alone_unless_its_parent_is_the_launcher() -> None:
    from torchpass_p2p.agent.lifeline import die_with_launcher
    assert die_with_launcher({}) is False
    assert die_with_launcher({"TORCHPASS_LAUNCHER_PID": "garbage"}) is False
    assert die_with_launcher({"TORCHPASS_LAUNCHER_PID": str(os.getpid())}) is False  # not parent


STACKS_CHILD = """
import os, sys, time
from torchpass_p2p.agent.lifeline import die_with_launcher
assert die_with_launcher(os.environ)
def waiting_in_a_named_function():
    print("ready", flush=True)
    time.sleep(5)
    print("still alive", flush=True)
waiting_in_a_named_function()
"""


def test_a_launched_child_prints_its_stacks_on_sigusr1_and_runs_on() -> None:
    from torchpass_p2p.agent.lifeline import STACKS_SIGNAL
    env = {**os.environ, "TORCHPASS_LAUNCHER_PID": str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-c", STACKS_CHILD], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        child.send_signal(STACKS_SIGNAL)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0 and out == "still alive\n"
    assert "Current thread" in err and "in waiting_in_a_named_function" in err


LEAVES_ORPHANS = '''
import subprocess, time
out = Path(sys.argv[1])
if os.environ.get("RANK") == "1":
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    grouped = subprocess.Popen(sleep)  # in the child's process group
    escaped = subprocess.Popen(sleep, start_new_session=True)  # left the group
    dump(out, grouped=grouped.pid, escaped=escaped.pid)
    time.sleep(0.5)  # both running
    sys.exit(1)
dump(out)
time.sleep(60)
'''


def test_orphans_of_a_dead_child_are_killed_and_named_even_outside_its_group(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "child.py", LEAVES_ORPHANS)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "1",
                               str(script), str(out)])
    envs = reports(out, 3)
    [dead] = [e for e in envs if e.get("RANK") == "1"]
    orphans = (dead["grouped"], dead["escaped"])
    try:
        wait_for(lambda: all(gone(p) for p in orphans), 8, "both orphans gone")
    finally:
        launcher.send_signal(signal.SIGTERM)
        code, log = finish(launcher)
    [line] = [ln for ln in log.splitlines() if "left 2 process(es) behind" in ln]
    assert all(str(p) in line for p in orphans), line
    assert "stray" not in log  # each was named once, when its parent died


def test_seeds_mode_joins_every_process_as_a_spare(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    key_file = tmp_path / "cluster.key"
    write_key_file(key_file)
    script = write_script(tmp_path, "child.py", "dump(Path(sys.argv[1]))\n")
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "2",
                               "--seeds", "10.0.0.1:29500,[::1]:29501", "--key-file",
                               str(key_file), str(script), str(out)])
    code, log = finish(launcher)
    assert code == 0, log
    envs = reports(out, 3, timeout_s=0)
    for e in envs:
        assert e["TORCHPASS_ROLE"] == "spare" and "RANK" not in e
        assert "TORCHPASS_CONFIGURATION" not in e
        assert e["TORCHPASS_SEEDS"] == "10.0.0.1:29500,[::1]:29501"
        settings = load_settings(environ={k: v for k, v in e.items() if k != "pid"})
        assert settings.joining and settings.seeds == (("10.0.0.1", 29500), ("::1", 29501))


def test_profile_and_base_port(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with socket.socket() as s:  # a port that is very likely free, and the next two
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    base = min(base, 65000)
    profile = Path(__file__).resolve().parents[2] / "configs" / "lan.toml"
    script = write_script(tmp_path, "child.py", "dump(Path(sys.argv[1]))\n")
    launcher = start_launcher(["--nproc", "2", "--base-port", str(base), "--config",
                               str(profile), str(script), str(out)])
    code, log = finish(launcher)
    assert code == 0, log
    envs = sorted(reports(out, 2, timeout_s=0), key=lambda e: e["RANK"])
    assert [e["TORCHPASS_BIND"] for e in envs] == [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
    assert all(e["TORCHPASS_PROFILE"] == str(profile) for e in envs)


def test_setup_errors_exit_2_without_starting_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("TORCHPASS_KEY_FILE", "TORCHPASS_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert main(["launch", str(tmp_path / "missing.py")]) == 2
    assert "no such script" in caplog.text
    script = write_script(tmp_path, "child.py", "raise SystemExit('must not run')\n")
    assert main(["launch", "--seeds", "127.0.0.1:1", str(script)]) == 2
    assert "joining through --seeds needs the cluster's key" in caplog.text
    monkeypatch.setenv("TORCHPASS_KEY_FILE", os.devnull)
    assert main(["launch", str(script)]) == 2
    assert "no key" in caplog.text
    assert main(["launch", "--nproc", "0", "--spares", "1", str(script)]) == 2
    assert "--nproc must be >= 1" in caplog.text
    with pytest.raises(SystemExit):  # argparse: usage error
        main(["launch", "--seeds", "nonsense", str(script)])
