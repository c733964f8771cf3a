"""Crash -> every-live-member-knows latency over many seeds, in virtual seconds.

    python -m benchmarks.detection [--members 64] [--seeds 50] [--loss 0.01]

Prints one JSON object: p50/p99/max of detect_first_s and detect_all_s, how many runs had a live
member that never learned, and false removals. Virtual time, so the figures do not depend on the
machine; ``wall_s`` is printed for scale only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sims.membership_runs import crash_run


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.detection")
    parser.add_argument("--members", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--loss", type=float, default=0.01)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    runs = [crash_run(args.members, seed, loss=args.loss) for seed in range(args.seeds)]
    first = [r.detect_first_s for r in runs if r.detect_first_s is not None]
    every = [r.detect_all_s for r in runs if r.detect_all_s is not None]
    out = {
        "members": args.members,
        "loss": args.loss,
        "seeds": args.seeds,
        "detect_first_p50_s": round(statistics.median(first), 3),
        "detect_all_p50_s": round(statistics.median(every), 3),
        "detect_all_p99_s": round(quantile(every, 0.99), 3),
        "detect_all_max_s": round(max(every), 3),
        "runs_not_all_knew": len(runs) - len(every),
        "false_removals": sum(r.false_removals for r in runs),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(out))
    return 0 if out["runs_not_all_knew"] == 0 and out["false_removals"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
