"""Simulator speed: events per second of wall time at N members, compiled against pure Python.

    python -m benchmarks.sim_speed [--members 1000] [--virtual-s 10] [--repeats 3]

Runs the same seeded crash workload (the real protocol core, 1 % loss, byte counting on) in fresh
processes, alternating the mypyc build (scripts/build-native) and the pure-Python reference
(TORCHPASS_PURE_PYTHON=1), and prints one JSON object: medians of events_per_s for each, their
ratio, and the event count (identical for both: same seed, same trace). Wall time only counts
``Cluster.run``, not building the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = """
import json, sys, time
from sims.cluster import Cluster
from sims.network import LinkModel
import sims.cluster as mod
from sims.scenario import frozen_heap
members, virtual_s = int(sys.argv[1]), float(sys.argv[2])
c = Cluster(members, seed=1, link=LinkModel(loss=0.01), keep_events=False, count_bytes=True)
c.at(virtual_s / 2, lambda: c.crash(c.members[7]))
with frozen_heap():  # as sims.scenario.run_scenario runs a cluster
    t = time.perf_counter()
    c.run(virtual_s)
    wall = time.perf_counter() - t
compiled = mod.__file__.endswith(".so")
print(json.dumps({"events": c.engine.events, "wall_s": wall, "compiled": compiled}))
"""


def _once(members: int, virtual_s: float, pure: bool) -> dict:
    env = dict(os.environ)
    if pure:
        env["TORCHPASS_PURE_PYTHON"] = "1"
    else:
        env.pop("TORCHPASS_PURE_PYTHON", None)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(members), str(virtual_s)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim_speed")
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--virtual-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    native, pure = [], []
    for _ in range(args.repeats):
        native.append(_once(args.members, args.virtual_s, pure=False))
        pure.append(_once(args.members, args.virtual_s, pure=True))
    events = {r["events"] for r in native + pure}
    native_eps = statistics.median(r["events"] / r["wall_s"] for r in native)
    pure_eps = statistics.median(r["events"] / r["wall_s"] for r in pure)
    print(json.dumps({
        "members": args.members,
        "virtual_s": args.virtual_s,
        "events": sorted(events),
        "compiled_available": native[0]["compiled"],
        "events_per_s": round(native_eps),
        "pure_python_events_per_s": round(pure_eps),
        "ratio_vs_pure_python": round(native_eps / pure_eps, 2),
        "target_events_per_s": 250_000,
    }))
    return 0 if len(events) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
