"""S10: a source SIGKILLed (a real separate process) when half of a 512 MiB state has arrived;
the transfer completes from the other source, exact."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from torchpass_p2p.transfer import Snapshot, TransferKeys, fetch

REPO = Path(__file__).resolve().parents[2]
SIZE_MIB = 512


async def _start(key: bytes) -> tuple[subprocess.Popen, int, bytes]:
    p = subprocess.Popen([sys.executable, "-m", "tests.transfer.source_proc", key.hex(), "3",
                          str(SIZE_MIB)], cwd=REPO, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 120)
    tag, port, fpr = line.split()
    assert tag == "READY"
    return p, int(port), bytes.fromhex(fpr)


@pytest.mark.slow  # 15-20 s: two processes build 512 MiB each, then 512 MiB moves
async def test_s10_source_killed_halfway():
    key = os.urandom(32)
    procs = []
    try:
        for _ in range(2):
            procs.append(await _start(key))
        (victim, port_a, fp_a), (_, port_b, fp_b) = procs
        assert fp_a == fp_b
        killed_at: list[int] = []

        def on_progress(received: int, total: int) -> None:
            if not killed_at and received * 2 >= total:
                killed_at.append(received)
                victim.send_signal(signal.SIGKILL)

        res = await fetch([("127.0.0.1", port_a), ("127.0.0.1", port_b)], TransferKeys(key),
                          3, expected_fingerprint=fp_a, on_progress=on_progress,
                          progress_timeout_s=5.0)
        assert killed_at and victim.wait(10) == -signal.SIGKILL
        total = res.snapshot.total_bytes
        assert total == SIZE_MIB << 20
        assert set(res.failures) <= {"closed", "no_progress"} and sum(res.failures.values()) == 1
        a, b = res.bytes_by_source[("127.0.0.1", port_a)], res.bytes_by_source[("127.0.0.1",
                                                                                    port_b)]
        assert a + b == total and a < total // 2 + (32 << 20) and b >= total // 2 - (32 << 20)
        # Exact: the fingerprint recomputed over every received byte is the sources'.
        s = res.snapshot
        fresh = Snapshot(s.step, s.table, s.tensors, s.tree, s.chunk_bytes)
        assert await asyncio.to_thread(fresh.fingerprint) == fp_a == res.fingerprint
        assert s.state()["metadata"] == {"pos": 77} and s.step == 100
        from .source_proc import state
        expected = state(SIZE_MIB)
        for name, t in zip((e.name for e in s.table), s.tensors, strict=True):
            assert t.equal(expected[name.split(".", 1)[1]])
    finally:
        for p, *_ in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdin.close()
            p.stdout.close()
