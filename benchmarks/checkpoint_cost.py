"""Fault-free cost of last-resort checkpoints: step time with checkpoints on against off, in
one run, interleaved.

Run ``python -m benchmarks.checkpoint_cost [--json] [--every 10] [--blocks 10] [--block 20]``.
One job of :mod:`benchmarks.checkpoint_worker` (an MLP of about 3.2M parameters, AdamW: about
38 MB of state; 2 ranks, gloo, one thread each) runs under ``torchpass-p2p launch
--checkpoint-every EVERY``; its rank 0, the one that writes, switches checkpoints on and off in
alternate blocks of ``--block`` steps, so both sides share the process, the data and the
machine's load. A block's figure is its *mean* step time (a save's cost lands in a few steps:
a median would hide it); ``ratio`` is, per pair of adjacent blocks (on, then off), the on
block's over the off block's, and the figure printed is the median of those ratios.

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


def figures(timings: dict[str, Any], saved: list[dict[str, Any]],
            args: argparse.Namespace) -> dict[str, Any]:
    step_s, on = timings["step_s"], timings["on"]
    blocks: list[tuple[bool, float]] = []
    for start in range(0, len(step_s), args.block):
        block = step_s[start:start + args.block]
        blocks.append((on[start], statistics.fmean(block)))
    ratios = [a[1] / b[1] for a, b in zip(blocks[::2], blocks[1::2], strict=False)
              if a[0] and not b[0]]
    on_s = statistics.median(m for o, m in blocks if o)
    off_s = statistics.median(m for o, m in blocks if not o)
    saves_per_block = args.block // args.every
    extra = statistics.median((a[1] - b[1]) * args.block / saves_per_block
                              for a, b in zip(blocks[::2], blocks[1::2], strict=False))
    stage_s = statistics.median(r["stage_s"] for r in saved)
    young_s = young_interval_s(stage_s, DEFAULT_MTBF_S)
    return {
        "ratio": statistics.median(ratios), "ratios": ratios, "target_ratio": TARGET_RATIO,
        "mean_step_on_s": on_s, "mean_step_off_s": off_s, "every_steps": args.every,
        "saves": len(saved), "state_bytes": timings["state_bytes"],
        "parameters": timings["parameters"],
        "stage_s": stage_s, "save_s": statistics.median(r["save_s"] for r in saved),
        "extra_per_save_s": extra, "young_interval_s": young_s,
        "young_fraction": max(extra, 0.0) / young_s if young_s > 0 else None,
        "mtbf_s": DEFAULT_MTBF_S, "machine": {"cpus": os.cpu_count(),
                                              "load_average": os.getloadavg()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=int, default=10, help="steps between saves (default 10)")
    ap.add_argument("--blocks", type=int, default=10, help="blocks, half on (default 10)")
    ap.add_argument("--block", type=int, default=20, help="steps a block (default 20)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.block % args.every or args.blocks % 2:
        ap.error("--block must be a multiple of --every, --blocks even")
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
          f"bytes of state, 2 ranks, a save every {args.every} steps in alternate blocks of "
          f"{args.block} steps ({result['saves']} saves)")
    print(f"  mean step on {result['mean_step_on_s'] * 1e3:.1f} ms, off "
          f"{result['mean_step_off_s'] * 1e3:.1f} ms; median ratio on/off "
          f"{result['ratio']:.4f} (target <= {TARGET_RATIO}); ratios "
          + ", ".join(f"{r:.3f}" for r in result["ratios"]))
    print(f"  a save: {result['stage_s'] * 1e3:.1f} ms on the training thread, "
          f"{result['save_s'] * 1e3:.0f} ms to its commit; it added "
          f"{result['extra_per_save_s'] * 1e3:.1f} ms to its block")
    print(f"  at the default interval (Young, MTBF {DEFAULT_MTBF_S:g} s: every "
          f"{result['young_interval_s']:.1f} s) that is {result['young_fraction'] * 100:.3f} % "
          f"of training time; load average {result['machine']['load_average'][0]:.1f} on "
          f"{result['machine']['cpus']} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
