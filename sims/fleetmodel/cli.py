"""``python -m sims jobmodel``: time to train over weeks, by recovery method.

Runs the job-level model (docs/jobmodel.md) for checkpoint-restart, replica-group recovery
(torchft's kind) and torchpass_p2p on the same failures (several seeds) and prints, per method,
``ettr`` (plain-DDP work over wall time), ``time_to_train_h`` and the lost hours split by
cause; ``--json`` prints one JSON object instead. ``--sources`` adds every input with where it
comes from. ``--targets`` prints the published results the model reproduces and the issue's
targets computed with our measured costs instead. ``--calibrate`` regenerates the
decided-latency table from simulator runs (a few minutes) and exits.

Exit status: 0; 2 for a bad option.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torchpass_p2p.cli import plain

from .costs import default_methods, sources_table
from .failures import ARRIVALS, FailureModel, category_mix
from .scenarios import Summary, reference_job, run_methods
from .simulate import CAUSES
from .sources import Sourced, rate_per_gpu_hour


def _rate(text: str) -> Sourced:
    if text in ("low", "central", "high"):
        return rate_per_gpu_hour(text)
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not low/central/high or a number: {text!r}") from None
    return Sourced(value, "failures per GPU-hour", "given on the command line")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sims jobmodel", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=16384, help="training GPUs (default 16384)")
    p.add_argument("--days", type=float, default=30.0,
                   help="fault-free days of work (default 30)")
    p.add_argument("--step-s", type=float, default=8.0, help="plain-DDP step, seconds")
    p.add_argument("--state-gb", type=float, default=4.0, help="state per rank, GB (1e9 B)")
    p.add_argument("--state-holders", type=int, default=2,
                   help="ranks holding each rank's state, itself included (default 2)")
    p.add_argument("--spare-fraction", type=float, default=0.02, help="default 0.02")
    p.add_argument("--repair-h", type=float, default=2.2,
                   help="hours until failed hardware is back in the spare pool")
    p.add_argument("--rate", type=_rate, default=rate_per_gpu_hour("central"),
                   help="failures per GPU-hour: low, central (default), high or a number")
    p.add_argument("--arrivals", choices=ARRIVALS[:2], default="exponential")
    p.add_argument("--weibull-shape", type=float, default=0.7)
    p.add_argument("--software-scope", choices=("job", "gpu"), default="job",
                   help="what a software failure takes down (default: the whole job)")
    p.add_argument("--detection", choices=("watchdog", "health_check"), default="watchdog",
                   help="checkpoint-restart's detection delay")
    p.add_argument("--checkpoint-interval-min", type=float,
                   help="checkpoint every this many compute minutes (default: Daly's optimum)")
    p.add_argument("--overhead", help="the measured step-ratio figure to use (a key of "
                                      "sims/fleetmodel/data/measured_costs.json)")
    p.add_argument("--seeds", type=int, default=5, help="runs per method (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sources", action="store_true", help="also list every input's source")
    p.add_argument("--targets", action="store_true",
                   help="print the published reproductions and the targets instead")
    p.add_argument("--calibrate", action="store_true",
                   help="regenerate the decided-latency table and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.calibrate:
        from .calibrate import calibrate

        table = calibrate()
        print(f"wrote the decided-latency table ({table['wall_s']} s)")
        return 0
    if args.targets:
        from .targets import all_checks

        result = all_checks(args.seeds, args.overhead)
        print(json.dumps(result) if args.json else format_checks(result))
        return 0
    try:
        job = reference_job(args.gpus, args.days, args.spare_fraction, args.step_s,
                            args.state_gb, args.state_holders, args.repair_h)
        failures = FailureModel(args.rate, arrivals=args.arrivals,
                                weibull_shape=args.weibull_shape,
                                mix=tuple(category_mix(args.software_scope).items()))
        interval = (None if args.checkpoint_interval_min is None
                    else args.checkpoint_interval_min * 60.0)
        methods = default_methods(args.overhead, args.detection, interval)
    except (KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summaries = run_methods(job, methods, failures, range(1, args.seeds + 1))
    sources = sources_table(job, methods)
    sources.append(("failure rate", f"{args.rate.value:g} {args.rate.unit}", args.rate.source))
    if args.json:
        out: dict[str, Any] = {
            "gpus": job.gpus, "steps": job.steps, "step_s": job.step_s,
            "spare_gpus": job.spare_gpus, "rate_per_gpu_hour": args.rate.value,
            "arrivals": args.arrivals, "scope_mix": dict(failures.mix),
            "methods": [s.as_dict() for s in summaries]}
        if args.sources:
            out["sources"] = [{"input": a, "value": b, "source": c} for a, b, c in sources]
        print(json.dumps(out))
        return 0
    print(format_summaries(summaries, f"{job.gpus:,} GPUs, {args.days:g} days of work, "
                                      f"{job.spare_gpus} spare GPUs, {args.rate.value:g} "
                                      f"failures/GPU-h ({args.arrivals}), {args.seeds} seeds"))
    if args.sources:
        print(format_sources(sources))
    return 0


def _table(title: str, header: list[str], rows: list[list[str]], numeric: bool = True) -> str:
    """Rows as a rich table when rich is installed, else aligned plain text (``numeric``:
    right-align every column but the first)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [title] + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                           for r in [header, *rows]]
        return "\n".join(lines)
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="right" if i and numeric else "left", no_wrap=i == 0,
                         overflow="fold")
    for r in rows:
        table.add_row(*r)
    console = Console(width=200, force_terminal=False, no_color=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get().rstrip()


def format_summaries(summaries: list[Summary], title: str) -> str:
    """Per method: ETTR (and its range over seeds), time to train, lost hours by cause."""
    causes = [c for c in CAUSES if any(s.lost_h[c] > 0 for s in summaries)]
    header = ["method", "ettr", "range", "time_to_train_h", "ckpt_min",
              *[f"{c}_h" for c in causes]]
    rows = [[s.method, f"{s.ettr:.4f}", f"{s.ettr_min:.3f}-{s.ettr_max:.3f}",
             f"{s.time_to_train_h:,.1f}",
             "-" if s.checkpoint_interval_min is None else f"{s.checkpoint_interval_min:.0f}",
             *[f"{s.lost_h[c]:,.2f}" for c in causes]] for s in summaries]
    return _table(title, header, rows)


def format_sources(rows: list[tuple[str, str, str]]) -> str:
    """Every input with its value and source."""
    return _table("inputs and their sources", ["input", "value", "source"],
                  [list(r) for r in rows], numeric=False)


def format_checks(result: dict[str, Any]) -> str:
    """The reproductions and targets as two tables."""
    parts = []
    for key in ("reproductions", "targets"):
        rows = [[c["what"], f"{c['model']:g}", f"{c['published']:g}", c["tolerance"],
                 "holds" if c["holds"] else "FAILS"] for c in result[key]]
        parts.append(_table(key, ["check", "model", "published / target", "tolerance", ""],
                            rows, numeric=False))
        for c in result[key]:
            extra = {k: v for k, v in c.items()
                     if k not in ("what", "model", "published", "tolerance", "holds")}
            if extra:
                parts.append(f"  {c['what']}: {json.dumps(extra)}")
    return "\n".join(parts)
