"""Agreement safety over many seeds: the long run of issue 4 (at least 10,000 seeded runs).

    python -m benchmarks.safety_fuzz [--seeds 10000] [--first-seed 0] [--jobs 2]
                                     [--members N] [--window-s 40] [--settle-s 20]

Each seed is one :func:`sims.safety_runs.safety_run`: a cluster of 8..24 real cores with lossy,
duplicating, reordering links and a seeded mix of crashes (up to 10 at once, a spare crashing as
it is promoted, crashes during agreement) and partitions (halves, one-way, flapping), with the
safety rules of :mod:`sims.safety`, [minority-decided] and the membership invariants checked on
every event. Seeds run in ``--jobs`` worker processes. Prints one JSON object:

* seeds, first_seed, runs_with_violations, violation_seeds (every seed with a safety or invariant
  violation, so any one replays with ``safety_run(seed)``), first_violations;
* decisions (distinct configurations decided, all runs), runs_with_decisions;
* fast_path_fraction: mean and quantiles over runs that decided something;
* converged_fraction (all runs) and converged_fraction_with_majority (runs where no partition
  left every side without a majority), not_converged_seeds (the first 50);
* wall_s, and seconds per run.

Exit status 1 if any run violated safety or an invariant. The figures are virtual-time results
and do not depend on the machine; only ``wall_s`` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from sims.safety_runs import FAULT_WINDOW_S, SETTLE_S, SafetyResult, safety_run


def _one(args: tuple[int, int | None, float, float]) -> SafetyResult:
    seed, members, window_s, settle_s = args
    return safety_run(seed, members=members, fault_window_s=window_s, settle_s=settle_s)


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))], 4)

    return {"mean": round(statistics.fmean(ordered), 4), "min": ordered[0], "p10": q(0.10),
            "p50": q(0.50), "p90": q(0.90), "max": ordered[-1]}


def summarize(runs: list[SafetyResult], wall_s: float) -> dict[str, Any]:
    """Aggregate ``runs`` into the JSON summary described in the module docstring."""
    bad = [r for r in runs if not r.ok]
    fractions = [r.fast_path_fraction for r in runs if r.fast_path_fraction is not None]
    with_majority = [r for r in runs if not r.majority_lost]
    fault_kinds: dict[str, int] = {}
    for r in runs:
        for kind in {f.split()[1] for f in r.faults}:
            fault_kinds[kind] = fault_kinds.get(kind, 0) + 1
    return {
        "seeds": len(runs),
        "first_seed": min((r.seed for r in runs), default=0),
        "runs_with_violations": len(bad),
        "violation_seeds": [r.seed for r in bad],
        "safety_violations": sum(r.safety_violations for r in runs),
        "invariant_violations": sum(r.invariant_violations for r in runs),
        "first_violations": [f"seed {r.seed}: {v}" for r in bad for v in r.violations[:3]][:20],
        "decisions": sum(r.decisions for r in runs),
        "runs_with_decisions": len(fractions),
        "fast_path_fraction": _quantiles(fractions),
        "members": _quantiles([float(r.members) for r in runs]),
        "converged_fraction": round(sum(r.converged for r in runs) / max(1, len(runs)), 4),
        "converged_fraction_with_majority": round(
            sum(r.converged for r in with_majority) / max(1, len(with_majority)), 4),
        "runs_majority_lost": len(runs) - len(with_majority),
        "not_converged_seeds": [r.seed for r in runs if not r.converged][:50],
        "fault_kinds_runs": dict(sorted(fault_kinds.items())),
        "events": sum(r.events for r in runs),
        "wall_s": round(wall_s, 1),
        "wall_s_per_run": round(wall_s / max(1, len(runs)), 3),
    }


def run(seeds: int, *, first_seed: int = 0, jobs: int = 1, members: int | None = None,
        window_s: float = FAULT_WINDOW_S, settle_s: float = SETTLE_S) -> dict[str, Any]:
    """Run seeds ``first_seed .. first_seed + seeds - 1`` and summarize them."""
    started = time.perf_counter()
    tasks = [(first_seed + i, members, window_s, settle_s) for i in range(seeds)]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            runs = list(pool.map(_one, tasks, chunksize=8))
    else:
        runs = [_one(t) for t in tasks]
    return summarize(runs, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.safety_fuzz")
    parser.add_argument("--seeds", type=int, default=10_000)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--members", type=int, default=None,
                        help="fixed cluster size (default: drawn per seed, 8..24)")
    parser.add_argument("--window-s", type=float, default=FAULT_WINDOW_S,
                        help="virtual seconds of faults")
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help="virtual seconds after the final heal")
    args = parser.parse_args(argv)
    out = run(args.seeds, first_seed=args.first_seed, jobs=args.jobs, members=args.members,
              window_s=args.window_s, settle_s=args.settle_s)
    print(json.dumps(out))
    return 0 if out["runs_with_violations"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
