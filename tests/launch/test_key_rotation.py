"""Key rotation on a running job, end to end: real processes under the launcher (issue 33,
item 2; ``docs/running.md``, "Keys").

Two ranks train ``examples/char_lm.py`` under one launcher from ``main.key`` (key K1). A spare
joins from a second launcher (``--seeds``, as from another host) with its own copy of the old
file, ``old.key``, and is stopped: the spare is down. Then, with the job training:

1. ``torchpass-p2p rotate-key main.key --launcher PID``: K2 primary, K1 accepted. Every rank's
   agent reloads it (its ``/status`` says so).
2. The spare returns on the old key (K1 only) and joins: K1 is still accepted, and the ranks
   talk to it under K1.
3. ``rotate-key --drop-old``: K2 alone. The spare, in the configuration, is refused: it exits
   6 with one line naming key ids. A spare started again on the old key is refused as it joins,
   with the same one line, no traceback.

Must hold: no rank is removed (both ranks that started finish every step, with equal state
fingerprints), no second cluster forms (the refused joiner never appears in the ranks'
configuration and never decides one of its own), the refused processes exit 6 and are not
respawned, and no key appears in any output.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from examples.main_job import SCRIPT, Run, run_job
from tests.trainer.settings import ARGS
from torchpass_p2p.agent.settings import read_keys
from torchpass_p2p.core.seal import key_id
from torchpass_p2p.launch.children import children_of
from torchpass_p2p.launch.keyfile import write_key_file
from torchpass_p2p.launch.outcome import EXIT_KEY_REFUSED

REPO = Path(__file__).resolve().parents[2]
STEPS = 1200
PACE = ("--step-sleep", "0.1")
"""Each step sleeps 0.1 s: the job lasts at least 120 s however fast the host computes, long
enough for the three phases (about a minute on a loaded 2-core host)."""


def _free_base_port() -> int:
    """A port whose next one is free too, for the ranks' gossip ports (--base-port)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port < 65000:
            try:
                for p in (port, port + 1):
                    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                        with socket.socket(socket.AF_INET, kind) as s:
                            s.bind(("127.0.0.1", p))
                return port
            except OSError:
                continue
    raise AssertionError("no free pair of ports")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _status(address: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://{address}/status", timeout=2) as reply:
            return json.loads(reply.read())
    except (OSError, ValueError):
        return None


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _child_statuses(launcher_pid: int) -> list[str]:
    out = []
    for pid in children_of(launcher_pid):
        try:
            env = _environ(pid)
        except OSError:
            continue
        if "TORCHPASS_STATUS" in env:
            out.append(env["TORCHPASS_STATUS"])
    return out


def _launcher_pid(marker: str) -> int | None:
    for pid in children_of(os.getpid()):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                return pid
        except OSError:
            continue
    return None


def _start_spare(work: Path, key_file: Path, seeds: str, name: str
                 ) -> tuple[subprocess.Popen[bytes], Path]:
    """A second launcher with one spare joining through ``seeds`` from ``key_file``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHPASS_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["TORCHPASS_LOG_DIR"] = str(work / "logs")
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchpass_p2p.cli.main", "launch", "--nproc", "0",
             "--spares", "1", "--seeds", seeds, "--key-file", str(key_file), "--grace", "3",
             str(SCRIPT), "--out", str(work / "out"), "--log-dir", str(work / "logs"),
             "--steps", str(STEPS), *ARGS, *PACE],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def _rotate(key_file: Path, launcher: int, *more: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "torchpass_p2p.cli.main", "rotate-key", str(key_file),
         "--launcher", str(launcher), *more],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rotation_while_a_spare_is_down(tmp_path: Path) -> None:
    main_key, old_key = tmp_path / "main.key", tmp_path / "old.key"
    k1 = write_key_file(main_key)
    write_key_file(old_key, k1)
    base = _free_base_port()
    seeds = f"127.0.0.1:{base},127.0.0.1:{base + 1}"
    result: list[Run] = []
    job = threading.Thread(target=lambda: result.append(run_job(
        tmp_path, nproc=2, spares=0, steps=STEPS, script_args=(*ARGS, *PACE), timeout_s=540,
        launch_args=("--key-file", str(main_key), "--base-port", str(base)))), daemon=True)
    job.start()
    launcher = _wait("the main launcher runs", lambda: _launcher_pid(str(main_key)), 30)
    ranks = _wait("both ranks serve their status", lambda: (
        s if len(s := _child_statuses(launcher)) == 2 and all(map(_status, s)) else None))

    def members() -> set[str]:
        status = _status(ranks[0])
        return set() if status is None else {m["member_id"] for m in status["members"]}

    def keys_of(address: str) -> list[int] | None:
        status = _status(address)
        return None if status is None else status["keys"]["key_ids"]

    def training() -> int:
        status = _status(ranks[0])
        assert status is not None and status["step"] < STEPS - 50, \
            "the job is (nearly) over before the test is: raise STEPS"
        return int(status["step"])

    rank_ids = _wait("configuration 0 of two ranks", lambda: (m if len(m := members()) == 2
                                                              else None))
    # A spare joins from the old file, then goes down.
    spare, _ = _start_spare(tmp_path, old_key, seeds, "spare-1")
    (first_id,) = _wait("the spare joins", lambda: (
        m - rank_ids if len(m := members()) == 3 else None))
    spare.terminate()
    assert spare.wait(30) == 128 + 15
    _wait("the spare is out of the configuration", lambda: members() == rank_ids)
    training()

    # 1. New primary, old key accepted.
    said = _rotate(main_key, launcher)
    k2_id, k1_id = (key_id(k) for k in read_keys(main_key))
    assert key_id(k1) == k1_id and f"primary key id {k2_id}, accepted key ids {k2_id}, " \
        f"{k1_id} (were {k1_id})" in said
    for address in ranks:
        _wait("a rank reloads", lambda a=address: keys_of(a) == [k2_id, k1_id], 30)
    training()

    # 2. The spare returns on the old key and joins while it is accepted.
    spare, spare_log = _start_spare(tmp_path, old_key, seeds, "spare-2")
    joined = _wait("the spare on the old key joins", lambda: (
        m - rank_ids if len(m := members()) == 3 else None))
    (spare_id,) = joined
    spare_status = _wait("the spare serves its status", lambda: [
        s for s in _child_statuses(spare.pid) if _status(s)])
    assert keys_of(spare_status[0]) == [k1_id]
    # The ranks list a joining member before its own agent learns it was admitted.
    _wait("the spare knows it joined", lambda: (_status(spare_status[0]) or {}).get("role")
          == "spare", 30)
    step_before_drop = training()

    # 3. The old key is dropped: the spare is refused and exits 6, and one started again on
    # the old key is refused as it joins.
    _rotate(main_key, launcher, "--drop-old")
    for address in ranks:
        _wait("a rank drops the old key", lambda a=address: keys_of(a) == [k2_id], 30)
    assert spare.wait(120) == EXIT_KEY_REFUSED, spare_log.read_text()
    first = spare_log.read_text()
    again, again_log = _start_spare(tmp_path, old_key, seeds, "spare-3")
    assert again.wait(180) == EXIT_KEY_REFUSED, again_log.read_text()
    second = again_log.read_text()
    assert training() > step_before_drop
    _wait("the refused spare is out of the configuration", lambda: members() == rank_ids)

    job.join(540)
    (run,) = result
    assert run.code == 0, run.diagnosis()
    line = (f"key not accepted: this process seals with key id {k1_id} (its keys: {k1_id}) "
            f"and 2 of 2 member(s) asked accept only key ids {k2_id}")
    assert f"member {spare_id}: {line}" in first, first
    for out in (first, second):
        refusals = [ln for ln in out.splitlines() if "key not accepted" in ln]
        assert len(refusals) == 1 and refusals[0].endswith(
            f'(docs/running.md, "Keys"); exit code {EXIT_KEY_REFUSED}'), out
        assert f"exited with {EXIT_KEY_REFUSED}" in out and "Traceback" not in out, out
        assert "IncompleteReadError" not in out
    assert f"2 of 2 seed(s) accept only key ids {k2_id}" in second, second
    # Nobody removed, no step lost: both starting ranks finished every step, equal states.
    assert [(f["rank"], f["steps"]) for f in run.finals] == [(0, STEPS), (1, STEPS)]
    assert len({f["fingerprint"] for f in run.finals}) == 1
    assert {f["member"] for f in run.finals} == rank_ids
    assert "key file reloaded" in run.output and "2 of 2 running process(es) reloaded it" \
        in run.output, run.diagnosis()
    # No second cluster: the joiner refused at its start never ran (no timeline at all), and
    # the spares that joined never entered a configuration of their own.
    assert {e["member"] for e in run.events} <= rank_ids | {first_id, spare_id}
    assert not [e for e in run.events if e["member"] in (first_id, spare_id)
                and e["event"] == "change"]
    for text in (run.output, first, second):
        assert k1.hex() not in text
        assert all(k.hex() not in text for k in read_keys(main_key))
