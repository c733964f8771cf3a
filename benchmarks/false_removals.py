"""False removals of healthy members over many simulated member-hours at uniform random loss.

    python -m benchmarks.false_removals [--member-hours 1000] [--loss 0.05] [--members 64]
                                        [--horizon-s 3600] [--jobs 2]

Runs quiet clusters (no fault at all, every link losing ``--loss`` of its datagrams) of
``--members`` members for ``--horizon-s`` virtual seconds each, seeds 0, 1, 2, ..., until the
member-hours are covered, spread over ``--jobs`` processes. Every conviction is a false removal
(issue 3: 0 over at least 1,000 member-hours at 5 % loss); the membership invariants of
:mod:`sims.invariants` are checked on every event as well. Prints one JSON object: member_hours,
false_removals (with seed, member index and time of each, so any one can be replayed), suspicions,
refutations, invariant_violations, wall_s. Exit status 1 if any false removal or violation.
Virtual time: the figures do not depend on the machine; ``wall_s`` is for scale only.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from sims.cluster import Cluster
from sims.invariants import InvariantChecker
from sims.network import LinkModel
from sims.recorder import DetectionRecorder


@dataclass(frozen=True, slots=True)
class QuietRun:
    seed: int
    members: int
    horizon_s: float
    false_removals: list[tuple[int, float]]
    """(member index, first conviction time in seconds) for each member convicted."""
    suspicions: int
    refutations: int
    violations: int
    first_violations: list[str]
    wall_s: float


def quiet(seed: int, members: int, loss: float, horizon_s: float) -> QuietRun:
    """One faultless cluster for ``horizon_s``; every conviction is a false removal."""
    started = time.perf_counter()
    cluster = Cluster(members, seed=seed, link=LinkModel(loss=loss), keep_events=False)
    recorder = DetectionRecorder(cluster)
    checker = InvariantChecker(cluster, recorder, max_kept=5)
    cluster.run(horizon_s)
    return QuietRun(
        seed=seed,
        members=members,
        horizon_s=horizon_s,
        false_removals=[(cluster.by_id[m].index, round(t, 3))
                        for m, t in recorder.false_removals.items()],
        suspicions=recorder.suspicions,
        refutations=recorder.refutations,
        violations=checker.count,
        first_violations=checker.violations,
        wall_s=round(time.perf_counter() - started, 1),
    )


def _quiet_args(args: tuple[int, int, float, float]) -> QuietRun:
    return quiet(*args)


def run(member_hours: float, loss: float, members: int, horizon_s: float, jobs: int,
        first_seed: int = 0) -> dict[str, object]:
    """Cover ``member_hours`` with runs of ``members`` x ``horizon_s``; aggregate them."""
    started = time.perf_counter()
    runs_needed = max(1, math.ceil(member_hours * 3600.0 / (members * horizon_s)))
    tasks = [(first_seed + i, members, loss, horizon_s) for i in range(runs_needed)]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            runs = list(pool.map(_quiet_args, tasks))
    else:
        runs = [_quiet_args(t) for t in tasks]
    removals = [{"seed": r.seed, "member": m, "at_s": t} for r in runs
                for m, t in r.false_removals]
    return {
        "members": members,
        "loss": loss,
        "horizon_s": horizon_s,
        "runs": len(runs),
        "seeds": [tasks[0][0], tasks[-1][0]],
        "member_hours": round(sum(r.members * r.horizon_s for r in runs) / 3600.0, 1),
        "false_removals": len(removals),
        "false_removal_list": removals[:50],
        "suspicions": sum(r.suspicions for r in runs),
        "refutations": sum(r.refutations for r in runs),
        "invariant_violations": sum(r.violations for r in runs),
        "first_violations": [v for r in runs for v in r.first_violations][:10],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.false_removals")
    parser.add_argument("--member-hours", type=float, default=1000.0)
    parser.add_argument("--loss", type=float, default=0.05)
    parser.add_argument("--members", type=int, default=64)
    parser.add_argument("--horizon-s", type=float, default=3600.0,
                        help="virtual seconds per run (one seed)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = run(args.member_hours, args.loss, args.members, args.horizon_s, args.jobs,
              args.first_seed)
    print(json.dumps(out))
    return 0 if out["false_removals"] == 0 and out["invariant_violations"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
