"""CPU use of idle agents: N member processes on this host, each an agent and nothing else.

Starts ``--members`` processes (ranks plus 1/8 spares) under ``torchpass-p2p launch``, lets them
settle, then reads every process's CPU time (utime + stime from ``/proc/PID/stat``) over
``--seconds`` and prints one JSON object: per-agent CPU as a percentage of one core (median,
p90, max), and, measured in the same run, a baseline process that runs an idle asyncio loop in
a thread (what any agent costs before it does protocol work). Issue #5's target: an idle agent
under 2 % of a core at N = 64.

    python -m benchmarks.agent [--members 64] [--seconds 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IDLE_MEMBER = """
import os, sys, time
import torchpass_p2p
agent = torchpass_p2p.start()
open(os.path.join(os.environ["BENCH_DIR"], f"{os.getpid()}.pid"), "w").close()
while True:
    time.sleep(3600)
"""

IDLE_LOOP = """
import asyncio, os, sys, threading, time
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w").close()
while True:
    time.sleep(3600)
"""

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def wait_for_pids(directory: Path, count: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [int(p.stem) for p in directory.glob("*.pid")]
        if len(pids) >= count:
            return pids
        time.sleep(0.2)
    raise TimeoutError(f"{count} processes did not start within {timeout_s} s")


def measure(pids: list[int], seconds: float) -> list[float]:
    """CPU of each pid over ``seconds``, as a percentage of one core."""
    before = {p: cpu_seconds(p) for p in pids}
    start = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    return [100.0 * (cpu_seconds(p) - before[p]) / elapsed for p in pids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds between the last start and the measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    spares = max(1, args.members // 8)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "agents").mkdir()
        (work / "base").mkdir()
        script = work / "idle_member.py"
        script.write_text(IDLE_MEMBER)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}
        env |= {"BENCH_DIR": str(work / "agents"), "TORCHPASS_HEALTH": "off"}
        launcher = subprocess.Popen(
            [sys.executable, "-m", "torchpass_p2p.cli.main", "launch",
             "--nproc", str(args.members - spares), "--spares", str(spares), "--grace", "2",
             str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        baseline = subprocess.Popen([sys.executable, "-c", IDLE_LOOP, str(work / "base")])
        try:
            pids = wait_for_pids(work / "agents", args.members, 120 + args.members)
            base_pid = wait_for_pids(work / "base", 1, 30)
            time.sleep(args.settle)
            both = measure(pids + base_pid, args.seconds)
            agents, base = sorted(both[:-1]), both[-1]
        finally:
            launcher.send_signal(signal.SIGTERM)
            baseline.kill()
            launcher.wait(30)
            baseline.wait(5)
    result = {
        "members": args.members,
        "seconds": args.seconds,
        "agent_cpu_pct_median": round(statistics.median(agents), 3),
        "agent_cpu_pct_p90": round(agents[int(0.9 * (len(agents) - 1))], 3),
        "agent_cpu_pct_max": round(agents[-1], 3),
        "baseline_idle_loop_cpu_pct": round(base, 3),
        "target_pct": 2.0,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:30} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
