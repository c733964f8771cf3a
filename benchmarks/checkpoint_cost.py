"""Fault-free cost of last-resort checkpoints: step time with checkpoints on against off, in
one run, interleaved.

Run ``python -m benchmarks.checkpoint_cost [--json] [--every 10] [--blocks 16] [--block 20]``.
One job of :mod:`benchmarks.checkpoint_worker` (an MLP of about 3.2M parameters, AdamW: about
38 MB of state; 2 ranks, gloo, one thread each) runs under ``torchpass-p2p launch
--checkpoint-every EVERY``; its rank 0, the one that writes, switches checkpoints on and off in
blocks of ``--block`` steps (on, off, off, on, on, off, ...: pairs in alternate order, against a
drift of the load), so both sides share the process, the data and the machine's load. A
block's figure is its *mean* step time (a save's cost lands in a few steps: a median would hide
it); ``ratio`` is, per pair of adjacent blocks (one of each, in either order), the on block's
over the off block's, and the figure printed is the median of those ratios; the same for rank
0's CPU time per step (all its threads: the writer's too), less disturbed than wall time where
the machine is shared.

The default ``--every 10`` saves every 10 steps, far more often than the default interval
(Young's ``sqrt(2 C M)``): the measured ratio is an upper bound. ``extra_per_save_s`` (what one
save added to its block, seconds) over Young's interval for the measured ``C`` (the training
thread's share of a save, from the timeline's ``checkpoint_saved`` events) and the default MTBF
gives ``young_fraction``, the cost at the default interval. Target, printed and not asserted:
at most 1 % (ratio <= 1.01). ``machine.load_average`` says how busy the machine was. Exit status
1 when the run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchpass_p2p.checkpoint import DEFAULT_MTBF_S, young_interval_s

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "checkpoint_worker.py"
TARGET_RATIO = 1.01


def run(work: Path, args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Launch the job; returns rank 0's timings and the checkpoints it saved (the
    ``checkpoint_saved`` events). Raises ``RuntimeError`` with the output's tail on a failure."""
    logs = work / "logs"
    logs.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHPASS_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["TORCHPASS_LOG_DIR"] = str(logs)
    out = work / "timings.json"
    cmd = [sys.executable, "-m", "torchpass_p2p.cli.main", "launch", "--nproc", "2",
           "--run-id", "checkpoint-cost", "--checkpoint-dir", str(work / "checkpoints"),
           "--checkpoint-every", str(args.every), str(WORKER), "--out", str(out),
           "--blocks", str(args.blocks), "--block", str(args.block),
           "--hidden", str(args.hidden), "--depth", str(args.depth)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.timeout, check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"exit {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    saved = [r for f in logs.glob("*.jsonl") for line in f.read_text().splitlines()
             if (r := json.loads(line))["event"] == "checkpoint_saved"]
    return json.loads(out.read_text()), saved


def compare(per_step: list[float], on: list[bool], block: int, saves_per_block: int
            ) -> dict[str, Any]:
    """Per pair of adjacent blocks (one on, one off, in either order): the ratio of their mean
    step times, and what one save added (seconds); medians over the pairs."""
    blocks = [(on[start], statistics.fmean(per_step[start:start + block]))
              for start in range(0, len(per_step), block)]
    pairs = []
    for a, b in zip(blocks[::2], blocks[1::2], strict=False):
        if a[0] != b[0]:
            pairs.append((a[1], b[1]) if a[0] else (b[1], a[1]))
    ratios = [a / b for a, b in pairs]
    return {"ratio": statistics.median(ratios), "ratios": ratios,
            "on_s": statistics.median(a for a, _ in pairs),
            "off_s": statistics.median(b for _, b in pairs),
            "extra_per_save_s": statistics.median((a - b) * block / saves_per_block
                                                  for a, b in pairs)}


def figures(timings: dict[str, Any], saved: list[dict[str, Any]],
            args: argparse.Namespace) -> dict[str, Any]:
    saves_per_block = args.block // args.every
    wall = compare(timings["step_s"], timings["on"], args.block, saves_per_block)
    cpu = compare(timings["cpu_step_s"], timings["on"], args.block, saves_per_block)
    stage_s = statistics.median(r["stage_s"] for r in saved)
    young_s = young_interval_s(stage_s, DEFAULT_MTBF_S)

    def at_young(extra: float) -> float:
        return max(extra, 0.0) / young_s if young_s > 0 else 0.0

    return {
        "ratio": wall["ratio"], "ratios": wall["ratios"], "target_ratio": TARGET_RATIO,
        "mean_step_on_s": wall["on_s"], "mean_step_off_s": wall["off_s"],
        "cpu_ratio": cpu["ratio"], "cpu_ratios": cpu["ratios"],
        "cpu_step_on_s": cpu["on_s"], "cpu_step_off_s": cpu["off_s"],
        "every_steps": args.every, "saves": len(saved), "state_bytes": timings["state_bytes"],
        "parameters": timings["parameters"],
        "stage_s": stage_s, "save_s": statistics.median(r["save_s"] for r in saved),
        "extra_per_save_s": wall["extra_per_save_s"],
        "cpu_per_save_s": cpu["extra_per_save_s"], "young_interval_s": young_s,
        "young_fraction": at_young(wall["extra_per_save_s"]),
        "young_cpu_fraction": at_young(cpu["extra_per_save_s"]),
        "mtbf_s": DEFAULT_MTBF_S, "machine": {"cpus": os.cpu_count(),
                                              "load_average": os.getloadavg()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=int, default=10, help="steps between saves (default 10)")
    ap.add_argument("--blocks", type=int, default=16,
                    help="blocks, half on, a multiple of 4 (default 16)")
    ap.add_argument("--block", type=int, default=20, help="steps a block (default 20)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.block % args.every or args.blocks % 4:
        ap.error("--block must be a multiple of --every, --blocks a multiple of 4")
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as tmp:
        try:
            timings, saved = run(Path(tmp), args)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"run failed: {exc}", file=sys.stderr)
            return 1
    result = figures(timings, saved, args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"checkpoint cost: {result['parameters']:,} parameters, {result['state_bytes']:,} "
          f"bytes of state, 2 ranks, a save every {args.every} steps in blocks of "
          f"{args.block} steps ({result['saves']} saves)")
    print(f"  mean step on {result['mean_step_on_s'] * 1e3:.1f} ms, off "
          f"{result['mean_step_off_s'] * 1e3:.1f} ms; median ratio on/off "
          f"{result['ratio']:.4f} (target <= {TARGET_RATIO}); ratios "
          + ", ".join(f"{r:.3f}" for r in result["ratios"]))
    print(f"  CPU time of rank 0 a step: on {result['cpu_step_on_s'] * 1e3:.1f} ms, off "
          f"{result['cpu_step_off_s'] * 1e3:.1f} ms; median ratio {result['cpu_ratio']:.4f}")
    print(f"  a save: {result['stage_s'] * 1e3:.1f} ms on the training thread, "
          f"{result['save_s'] * 1e3:.0f} ms to its commit; it added "
          f"{result['extra_per_save_s'] * 1e3:.1f} ms of wall time to its block, "
          f"{result['cpu_per_save_s'] * 1e3:.1f} ms of CPU time")
    print(f"  at the default interval (Young, MTBF {DEFAULT_MTBF_S:g} s: every "
          f"{result['young_interval_s']:.1f} s) that is {result['young_fraction'] * 100:.3f} % "
          f"of training time ({result['young_cpu_fraction'] * 100:.3f} % in CPU time); load "
          f"average {result['machine']['load_average'][0]:.1f} on "
          f"{result['machine']['cpus']} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
