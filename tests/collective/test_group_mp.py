"""The collective across real processes (gloo), configurations driven by hand.

Four ranks and a spare all-gather in a loop under configuration 1. SIGKILL the holder of rank 0
(the member hosting configuration 1's store): the survivors leave the collective (failed at
once, or superseded when configuration 2 is announced) and re-form configuration 2, where the
spare holds rank 0 and hosts the new store. Then SIGSTOP one rank: everyone else is stuck in an
operation; configuration 3 leaves it out (world of 3) and the survivors build it alongside
the stuck group. The woken member learns it holds no rank and never joins.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def records(root: Path, member: int) -> list[dict]:
    path = root / f"{member:016x}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def ops(root: Path, member: int, config_id: int) -> list[dict]:
    return [r for r in records(root, member) if r["event"] == "op" and r["config_id"] == config_id]


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def announce(root: Path, config_id: int, ranks: list[int]) -> None:
    tmp = root / f"config-{config_id}.tmp"
    tmp.write_text(json.dumps({"ranks": ranks}))
    tmp.rename(root / f"config-{config_id}.json")


@pytest.mark.timeout(120)
def test_kill_store_host_then_pause_a_rank_regroups_twice(tmp_path: Path) -> None:
    members = [1, 2, 3, 4, 5]
    announce(tmp_path, 1, [1, 2, 3, 4])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = {m: subprocess.Popen([sys.executable, "-m", "tests.collective.mp_worker",
                                  str(tmp_path), str(m)], cwd=REPO, env=env)
             for m in members}
    try:
        for m in (1, 2, 3, 4):
            wait_for(lambda m=m: len(ops(tmp_path, m, 1)) >= 10, 60, f"member {m} in config 1")
        # 1. SIGKILL the holder of rank 0, host of configuration 1's store.
        procs[1].kill()
        killed_at = time.time()
        time.sleep(0.3)  # about what detection and agreement take
        announce(tmp_path, 2, [5, 2, 3, 4])
        for m in (5, 2, 3, 4):
            wait_for(lambda m=m: len(ops(tmp_path, m, 2)) >= 10, 30, f"member {m} in config 2")
        formed = [next(r for r in records(tmp_path, m)
                       if r["event"] == "formed" and r["config_id"] == 2) for m in (5, 2, 3, 4)]
        assert max(r["t"] for r in formed) - killed_at < 3.0
        assert sorted(r["rank"] for r in formed) == [0, 1, 2, 3]
        for m in (2, 3, 4):  # every survivor left configuration 1's collective
            left = [r for r in records(tmp_path, m)
                    if r["event"] in ("failed", "superseded") and r["config_id"] == 1]
            assert left, m
        # 2. SIGSTOP rank 2 (member 3): the others are stuck; configuration 3 leaves it out.
        procs[3].send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        announce(tmp_path, 3, [5, 2, 4])
        for m in (5, 2, 4):
            wait_for(lambda m=m: len(ops(tmp_path, m, 3)) >= 10, 30, f"member {m} in config 3")
        procs[3].send_signal(signal.SIGCONT)
        wait_for(lambda: any(r["event"] == "not_a_rank" and r["config_id"] == 3
                             for r in records(tmp_path, 3)), 15, "member 3 learning")
        time.sleep(0.3)
    finally:
        (tmp_path / "stop").touch()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        exits = {}
        for m, p in procs.items():
            try:
                exits[m] = p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                exits[m] = "hung"
    for c, world in ((1, 4), (2, 4), (3, 3)):
        live = [m for m in members if ops(tmp_path, m, c)]
        assert all(r["ok"] for m in live for r in ops(tmp_path, m, c))
        # mean_in_rank_order: identical bits on every rank, equal to the local rank-order sum.
        import torch
        parts = [torch.full((4,), r + 0.1, dtype=torch.float32) for r in range(world)]
        expect = parts[0].clone()
        for p in parts[1:]:
            expect.add_(p)
        expect.div_(world)
        bits = {tuple(r["mean_bits"]) for m in live for r in ops(tmp_path, m, c)}
        assert bits == {tuple(expect.view(torch.int32).tolist())}
    assert not [r for r in records(tmp_path, 3) if r["event"] == "op" and r["config_id"] == 3]
    assert exits[1] == -signal.SIGKILL
    assert all(exits[m] == 0 for m in (2, 3, 4, 5)), exits  # teardown bounded, no hang
