"""``python -m sims report jobmodel``: PNG plots of the job-level model.

Writes into ``--out`` (default ``docs/``):

* ``jobmodel_ettr_vs_gpus.png``: ETTR of each method against training GPUs (1,024 to 100,000),
  central failure rate, 2 % spares; torchpass_p2p also at a step ratio of 1 (recovery alone,
  dashed).
* ``jobmodel_time_vs_gpus.png``: time to train the same total work (the reference job's
  16,384 GPUs x 30 days, spread evenly over the GPUs: ideal scaling) against GPUs.
* ``jobmodel_ettr_vs_spares.png``: ETTR against the spare fraction at 16,384 GPUs.

Each point is the mean over ``--seeds`` seeds. Matplotlib draws off-screen (Agg); if it is not
installed the command says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchpass_p2p.cli import plain

from .costs import Method, default_methods
from .failures import default_model
from .scenarios import reference_job, run_methods
from .sources import Sourced

GPUS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000)
SPARE_FRACTIONS = (0.0, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05)
REFERENCE_GPU_DAYS = 16384 * 30.0
RATIO_1 = "torchpass_p2p, step ratio 1"


def _methods(overhead: str | None) -> list[Method]:
    methods = default_methods(overhead)
    tp = methods[2]
    assert tp.torchpass is not None
    ideal = replace(tp, name=RATIO_1, torchpass=replace(
        tp.torchpass, step_ratio=Sourced(1.0, "x", "counterfactual: recovery alone")))
    return [*methods, ideal]


def sweep(seeds: int, overhead: str | None = None) -> dict[str, Any]:
    """The figures behind the plots: per GPU count and per spare fraction, each method's ETTR
    and time to train (hours)."""
    methods = _methods(overhead)
    failures = default_model()
    by_gpus: list[dict[str, Any]] = []
    for gpus in GPUS:
        job = reference_job(gpus, days=REFERENCE_GPU_DAYS / gpus)
        sums = run_methods(job, methods, failures, range(1, seeds + 1))
        by_gpus.append({"gpus": gpus, "fault_free_h": job.work_s / 3600.0,
                        **{s.method: {"ettr": s.ettr, "time_to_train_h": s.time_to_train_h}
                           for s in sums}})
    by_spares: list[dict[str, Any]] = []
    for fraction in SPARE_FRACTIONS:
        job = reference_job(16384, days=REFERENCE_GPU_DAYS / 16384, spare_fraction=fraction)
        sums = run_methods(job, methods, failures, range(1, seeds + 1))
        by_spares.append({"spare_fraction": fraction, "spare_gpus": job.spare_gpus,
                          **{s.method: {"ettr": s.ettr, "time_to_train_h": s.time_to_train_h}
                             for s in sums}})
    return {"methods": [m.name for m in methods], "step_ratio": methods[2].ratio,
            "by_gpus": by_gpus, "by_spares": by_spares, "seeds": seeds}


def write_plots(data: dict[str, Any], out: Path) -> list[Path]:
    """The three PNGs from :func:`sweep`'s figures; returns their paths.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    style = {"checkpoint_restart": ("tab:red", "-", "o"),
             "replica_group": ("tab:orange", "-", "s"),
             "torchpass_p2p": ("tab:blue", "-", "^"),
             RATIO_1: ("tab:blue", "--", "^")}
    ratio = data["step_ratio"]
    panels = (
        ("jobmodel_ettr_vs_gpus.png", "by_gpus", "gpus", "ettr", "training GPUs",
         "ETTR (plain-DDP work / wall time)"),
        ("jobmodel_time_vs_gpus.png", "by_gpus", "gpus", "time_to_train_h", "training GPUs",
         "time to train (hours), 16,384 GPUs x 30 days of work"),
        ("jobmodel_ettr_vs_spares.png", "by_spares", "spare_fraction", "ettr",
         "spare GPUs / training GPUs (16,384 GPUs)", "ETTR"),
    )
    for name, series, xkey, ykey, xlabel, ylabel in panels:
        fig = Figure(figsize=(8, 4.8), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        rows = data[series]
        for method in data["methods"]:
            color, line, marker = style.get(method, ("gray", "-", "."))
            label = f"torchpass_p2p (step ratio {ratio:g}, measured)" if (
                method == "torchpass_p2p") else method
            ax.plot([r[xkey] for r in rows], [r[method][ykey] for r in rows], color=color,
                    linestyle=line, marker=marker, label=label)
        if xkey == "gpus":
            ax.set_xscale("log")
        if ykey == "time_to_train_h":
            ax.set_yscale("log")
            ax.plot([r["gpus"] for r in rows], [r["fault_free_h"] for r in rows], color="gray",
                    linestyle=":", label="fault-free plain DDP")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"central failure rate 2.5e-5 /GPU-h, Llama 3 failure mix, "
                     f"{data['seeds']} seeds", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
        path = out / name
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sims report jobmodel", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs"), help="output folder (docs/)")
    p.add_argument("--seeds", type=int, default=3, help="runs per point (default 3)")
    p.add_argument("--overhead", help="the measured step-ratio figure to use")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE (JSON)")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: python -m sims report jobmodel needs matplotlib, which is not installed "
              "in this environment (it is in the project's dev dependencies)", file=sys.stderr)
        return 2
    data = sweep(args.seeds, args.overhead)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    for row in data["by_gpus"]:
        print(f"{row['gpus']:>7} GPUs: " + ", ".join(
            f"{m} ettr {row[m]['ettr']:.3f}" for m in data["methods"]))
    for path in write_plots(data, args.out):
        print(path)
    return 0
