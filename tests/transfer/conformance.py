"""The one suite every transport must pass (style 12): harnesses that run each case of
``states.CASES`` through a transport and return the receiver's ``states.report``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchpass_p2p.transfer import TransferKeys, TransferServer
from torchpass_p2p.transfer.state_transport import TcpTransport, TransferPlan

from .states import CASES, build, capture, report

REPO = Path(__file__).resolve().parents[2]


async def _tcp_case(case: str) -> dict[str, Any]:
    keys = TransferKeys(os.urandom(32))
    snap, _ = capture(case, "source")
    async with TransferServer(keys, lambda: 7) as s1, TransferServer(keys, lambda: 7) as s2:
        plan = TransferPlan(sources=(s1.address, s2.address), config_id=7, step=snap.step)
        for server in (s1, s2):
            await TcpTransport(keys, server).provide(snap, plan)
        objs = build(case, "receiver")[0]
        result = await TcpTransport(keys).receive(plan, into=objs)
        out = report(case, result, objs)
        out["failures"] = dict(result.failures)
        out["sources_used"] = sum(1 for b in result.bytes_by_source.values() if b)
        return out


def run_tcp() -> dict[str, dict[str, Any]]:
    return {case: asyncio.run(_tcp_case(case)) for case in CASES}


def run_pg(device: str | None = None, timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
    """Three processes over gloo (ranks 0 and 1 are sources, 2 receives), FileStore rendezvous.
    Each runs every case in one group; the receiver writes its reports as JSON. ``device``:
    stage every message through buffers there (``PgTransport(device=...)``)."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        procs = [subprocess.Popen([sys.executable, "-m", "tests.transfer.pg_worker", str(r),
                                   "3", store, out, *([device] if device else [])],
                                  cwd=REPO)
                 for r in range(3)]
        try:
            for p in procs:
                rc = p.wait(timeout_s)
                assert rc == 0, f"pg worker exited {rc}"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return json.loads(Path(out).read_text())
