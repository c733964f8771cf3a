"""The status page watching a real job through a fault, in headless Chromium.

Three ranks and a spare train a small job (``page_worker.py``) under ``torchpass-p2p launch``.
Once every rank has trained 20 steps, the test opens rank 0's status page, reads from its DOM
that configuration 0 has the three ranks and the spare, then SIGKILLs the process holding
rank 1. Must hold, read from the same open page (no reload: the page updates from its event
stream): a newer configuration in which the spare holds rank 1 and the killed member is gone,
in the members table and the configuration history; the recovery drawn with all five phases
(rank 0 saw the state transferred as a source, or by the new group's fingerprint check); the
member the page names as the replacement is the one whose timeline says it joined rank 1
there. A screenshot of the page then is saved (``status-page.png`` in the test's folder, and
where ``STATUS_PAGE_SCREENSHOT`` names, e.g. ``docs/status-page.png``). The job is then stopped
with SIGTERM: its end is not what this test checks.

Timings are not asserted (2 shared cores); each wait has a generous limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from examples.main_job import Run, launch
from tests.agent.browser import Browser
from torchpass_p2p.launch.children import children_of

WORKER = Path(__file__).with_name("page_worker.py")
STEPS = 5000
"""Far more than the test waits for (8 minutes at 0.1 s a step): it ends the job itself."""
KILL_AFTER = 20
"""Rank 1 is killed once every rank has committed this step (2 s of training)."""
JOB_LIMIT_S = 600.0
WAIT_S = 180.0
"""Longest wait for each thing the test waits for (the job's start, the page, the change)."""

MEMBERS = """(() => [...document.querySelectorAll('#members tbody tr')].map(
    (r) => ({member: r.dataset.member, role: r.dataset.role, rank: r.dataset.rank,
             state: r.dataset.state})))()"""
VIEW = f"""(() => ({{
  config: Number(document.getElementById('summary').dataset.configId),
  updates: Number(document.body.dataset.updates || 0),
  members: {MEMBERS},
  history: [...document.querySelectorAll('#configurations tbody tr[data-config-id]')].map(
      (r) => ({{config: Number(r.dataset.configId), ranks: r.cells[3].textContent,
               removed: r.cells[5].textContent}})),
  recoveries: [...document.querySelectorAll('.recovery')].map((b) => ({{
      config: Number(b.dataset.configId), title: b.querySelector('h3').textContent,
      seen: [...b.querySelectorAll('.phase.seen')].map((p) => p.dataset.phase)}})),
  transfer: document.getElementById('transfer').textContent,
}}))()"""


def records(logs: Path) -> list[dict[str, Any]]:
    """Every complete timeline record written so far."""
    out = []
    for path in sorted(logs.glob("*.jsonl")):
        with open(path) as f:
            out.extend(json.loads(line) for line in f if line.endswith("\n"))
    return out


async def until(what: str, check: Any, timeout_s: float = WAIT_S) -> Any:
    """Poll ``check()`` every 0.2 s until it returns something truthy."""
    try:
        async with asyncio.timeout(timeout_s):
            while not (found := check()):
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise TimeoutError(f"not within {timeout_s} s: {what}") from None
    return found


def launcher_pid() -> int | None:
    for pid in children_of(os.getpid()):
        with contextlib.suppress(OSError):
            if b"torchpass_p2p.cli.main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


def pid_of(member: str) -> int:
    """The pid of the launcher's child that runs ``member`` (its environment says)."""
    launcher = launcher_pid()
    assert launcher is not None
    for pid in children_of(launcher):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"TORCHPASS_MEMBER_ID={member}".encode() in environ:
                return pid
    raise LookupError(f"no child runs member {member}")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # may install Chromium first (CI), then a job of minutes
async def test_the_page_shows_the_spare_taking_a_killed_rank(browser: Browser,
                                                             tmp_path: Path) -> None:
    work = tmp_path / "job"
    logs = work / "logs"
    args = ("--steps", str(STEPS), "--step-s", "0.1", "--state-kib", "4096",
            "--log-dir", str(logs))
    job: asyncio.Future[Run] = asyncio.get_running_loop().run_in_executor(
        None, functools.partial(launch, work, WORKER, args, nproc=3, spares=1,
                                timeout_s=JOB_LIMIT_S))
    try:
        # Every member started; every rank has trained a while.
        def started() -> dict[str, dict[str, Any]] | None:
            found = {r["member"]: r for r in records(logs) if r["event"] == "start"}
            stepped = {r["rank"] for r in records(logs)
                       if r["event"] == "step" and r["step"] >= KILL_AFTER}
            return found if len(found) == 4 and stepped == {0, 1, 2} else None

        starts = await until(f"4 members started and 3 ranks past step {KILL_AFTER}", started)
        by_rank = {r["rank"]: m for m, r in starts.items() if r["role"] == "rank"}
        [spare] = [m for m, r in starts.items() if r["role"] == "spare"]
        killed = by_rank[1]
        page = await browser.open(f"http://{starts[by_rank[0]]['status']}/")

        before = await page.wait_for(
            f"(() => {{ const v = {VIEW}; return v.members.length === 4 ? v : null; }})()",
            timeout_s=WAIT_S)
        assert before["config"] == 0
        assert sorted((m["rank"], m["member"], m["role"]) for m in before["members"]) == [
            ("", spare, "spare"), ("0", by_rank[0], "rank"), ("1", killed, "rank"),
            ("2", by_rank[2], "rank")]
        assert before["history"] == [] and before["recoveries"] == []

        os.kill(pid_of(killed), signal.SIGKILL)

        # The same page, redrawn from its stream: the spare holds rank 1 in a newer
        # configuration, and the recovery has reached training again.
        after = await page.wait_for(
            f"""(() => {{ const v = {VIEW};
                return v.config > 0 && v.recoveries.length
                    && v.recoveries[0].seen.includes('resumed') ? v : null; }})()""",
            timeout_s=WAIT_S)
        config = after["config"]
        assert after["updates"] > before["updates"]
        assert sorted((m["rank"], m["member"], m["role"], m["state"])
                      for m in after["members"]) == [
            ("0", by_rank[0], "rank", "alive"), ("1", spare, "rank", "alive"),
            ("2", by_rank[2], "rank", "alive")]
        [recovery] = after["recoveries"]
        assert recovery["config"] == config == 1
        assert recovery["title"] == f"configuration 1: rank 1 \u2192 {spare}"
        assert recovery["seen"] == ["detected", "decided", "transferred", "rebuilt", "resumed"]
        [decided] = after["history"]
        assert decided == {"config": 1, "removed": killed,
                           "ranks": f"0: {by_rank[0]}1: {spare}2: {by_rank[2]}"}

        shot = tmp_path / "status-page.png"
        data = await page.screenshot(shot)
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        if target := os.environ.get("STATUS_PAGE_SCREENSHOT"):
            shutil.copyfile(shot, target)

        # What the page says is what the members' own timelines say.
        joined = [r for r in records(logs) if r["event"] == "joined" and r["config_id"] == 1]
        assert {(r["member"], r["rank"]) for r in joined} == {
            (by_rank[0], 0), (spare, 1), (by_rank[2], 2)}
        assert any(r["event"] == "state_fetched" and r["member"] == spare
                   and r["config_id"] == 1 for r in records(logs))
    finally:
        launcher = launcher_pid()
        if launcher is not None:
            os.kill(launcher, signal.SIGTERM)
        run = await job
    assert run.code == 128 + signal.SIGTERM, run.diagnosis()  # stopped by the test, as asked
