"""``python -m sims report``: PNG plots of a scenario over several seeds.

Either runs SCENARIO once per seed (``--seeds N`` seeds from the scenario's own, or ``--seed``)
or reads files written by ``python -m sims run SCENARIO --series FILE``, then writes three
plots into ``--out`` (default ``reports/``):

* ``NAME_detection_cdf.png``: for every (fault, live member) pair, the virtual seconds from the
  fault until that member knew the faulty one dead, as a CDF per seed. Pairs that never knew
  keep the curve below 1.
* ``NAME_bytes.png``: bytes sent per live member per second, every virtual second.
* ``NAME_views.png``: distinct membership views among live members, every virtual second
  (1 means everyone agrees).

Matplotlib draws off-screen (Agg); nothing needs a display.

``python -m sims report jobmodel`` draws the job-level model's plots instead
(:mod:`sims.fleetmodel.plots`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from torchpass_p2p.cli import plain

from .scenario import ScenarioError, load_scenario, run_scenario

_MAX_LEGEND = 10
"""More seeds than this are drawn without a legend entry each (it would cover the plot)."""


def collect(scenario_name: str, seeds: list[int], members: int | None,
            progress: bool = False) -> list[dict[str, Any]]:
    """Run the scenario once per seed, keeping the series."""
    scenario = load_scenario(scenario_name)
    return [run_scenario(scenario, members=members, seed=seed, progress=progress, series=True)
            for seed in seeds]


def write_plots(runs: list[dict[str, Any]], out: Path, name: str | None = None) -> list[Path]:
    """Write the three PNGs for ``runs`` (results with ``series``) into ``out``; return paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("no runs to plot")
    name = name or runs[0]["scenario"]
    out.mkdir(parents=True, exist_ok=True)
    title = (f"{name}: {runs[0]['members']:,} members, {runs[0]['loss']:.0%} loss, "
             f"{len(runs)} seed{'s' if len(runs) > 1 else ''}")
    paths = []
    for suffix, draw in (("detection_cdf", _draw_cdf), ("bytes", _draw_bytes),
                         ("views", _draw_views)):
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        draw(ax, runs)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        if len(runs) <= _MAX_LEGEND and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        path = out / f"{name}_{suffix}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def _label(run: dict[str, Any], i: int) -> str | None:
    return f"seed {run['seed']}" if i < _MAX_LEGEND else None


def _draw_cdf(ax: Any, runs: list[dict[str, Any]]) -> None:
    drawn = False
    for i, run in enumerate(runs):
        s = run["series"]
        xs = s["detect_member_s"]
        total = len(xs) + s["detect_member_never"]
        if not total:
            continue
        ys = [(k + 1) / total for k in range(len(xs))]
        p50 = run["detect_member_p50_s"]
        label = _label(run, i)
        if label is not None:
            label += f" (p50 {p50:.2f} s)" if p50 is not None else " (p50 never)"
        ax.step([0.0, *xs], [0.0, *ys], where="post", label=label, alpha=0.8)
        drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no expected-removal faults in this scenario", ha="center",
                va="center", transform=ax.transAxes)
    ax.set_xlabel("time from fault until a live member knew it dead (virtual s)")
    ax.set_ylabel("fraction of (fault, live member) pairs")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)


def _mark_faults(ax: Any, runs: list[dict[str, Any]]) -> None:
    """Dashed lines at the first run's fault times, the warmup shaded."""
    first = runs[0]
    if first["warmup_s"]:
        ax.axvspan(0, first["warmup_s"], color="grey", alpha=0.12, label="warmup (not measured)")
    times = sorted({t for t, _, _ in first["series"]["faults"]})
    for k, t in enumerate(times[:200]):
        ax.axvline(t, color="red", linestyle="--", linewidth=0.8, alpha=0.6,
                   label=("fault" if len(runs) == 1 else f"fault (seed {first['seed']})")
                   if k == 0 else None)


def _draw_bytes(ax: Any, runs: list[dict[str, Any]]) -> None:
    sized = runs[0]["series"]["bytes_per_member_per_s"] is not None
    key = "bytes_per_member_per_s" if sized else "packets_per_member_per_s"
    for i, run in enumerate(runs):
        s = run["series"]
        # Each value is the rate over the second that ends at its t: a step back from t.
        ax.step([0.0, *s["t_s"]], [s[key][0], *s[key]], where="pre", label=_label(run, i),
                alpha=0.8)
    _mark_faults(ax, runs)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("bytes sent per live member per second (B/s)" if sized else
                  "packets sent per live member per second")
    ax.set_ylim(bottom=0)


def _draw_views(ax: Any, runs: list[dict[str, Any]]) -> None:
    from matplotlib.ticker import MaxNLocator

    for i, run in enumerate(runs):
        s = run["series"]
        # Instantaneous samples at each t, joined for readability.
        ax.plot(s["t_s"], s["views"], marker=".", markersize=3, label=_label(run, i),
                alpha=0.8)
    _mark_faults(ax, runs)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("distinct membership views among live members")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["jobmodel"]:
        from .fleetmodel.plots import main as jobmodel_main

        return jobmodel_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m sims report", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", nargs="?",
                        help="a scenario file or a name in sims/scenarios/")
    parser.add_argument("--seeds", type=int, default=3, help="runs, one per seed (default 3)")
    parser.add_argument("--seed", type=int, help="first seed (default: the scenario's)")
    parser.add_argument("--members", type=int, help="override the member count")
    parser.add_argument("--series", metavar="FILE", nargs="+",
                        help="plot these files from `python -m sims run --series` instead")
    parser.add_argument("--out", type=Path, default=Path("reports"), help="output folder")
    args = parser.parse_args(argv)
    if (args.scenario is None) == (args.series is None):
        parser.error("give either SCENARIO or --series FILE..., not both")
    try:
        if args.series:
            runs = [json.loads(Path(p).read_text()) for p in args.series]
            if any("series" not in r for r in runs):
                parser.error("a --series file lacks 'series' (write it with run --series)")
        else:
            first = load_scenario(args.scenario).seed if args.seed is None else args.seed
            runs = collect(args.scenario, list(range(first, first + args.seeds)), args.members,
                           progress=sys.stderr.isatty())
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for run in runs:
        print(f"seed {run['seed']}: detect_all_p50_s={run['detect_all_p50_s']} "
              f"false_removals={run['false_removals']} "
              f"bytes_per_member_per_s={run['bytes_per_member_per_s']}")
    for path in write_plots(runs, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
