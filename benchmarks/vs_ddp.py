"""Fault-free cost per training step: torchpass_p2p against plain torch DDP, same script.

Run ``python -m benchmarks.vs_ddp [--json] [--rounds 3] [--steps N] [--sizes small,large]``.
The script is :mod:`benchmarks.ddp_worker` (an MLP, a Dataset with a random augmentation, a
DataLoader with a DistributedSampler, AdamW, gradient clipping; 4 ranks, gloo, one thread per
rank), launched three ways:

* ``torch``: ``python -m torch.distributed.run --standalone --nproc-per-node 4`` with
  ``--api torch``: torch's own names, plain DDP;
* ``exact``: ``torchpass-p2p launch --nproc 4 --spares 1`` with ``--api torchpass``: the
  gradients averaged by rank-order sums (bitwise reproducible);
* ``native``: the same with ``--native``: ``init_process_group(exact=False)``, gloo's
  all-reduce;
* ``torch_hook`` (only with ``--methods``): plain torch DDP as ``torch``, with torch's own
  Python communication hook (``allreduce_hook``), which copies a gradient into DDP's bucket and
  divides it in a pass of its own as any hook must: what a hook itself costs DDP.

Two models (:data:`benchmarks.ddp_worker.SIZES`): ``small`` (about 0.1M parameters, where the
per-step fixed costs show) and ``large`` (about 25M, where the reduction's bandwidth shows).

Each run's rank 0 times its own steps (from one ``optimizer.step()`` to the next, the first
``--warmup`` dropped; :mod:`benchmarks.ddp_worker`), and the run's figure is the median of those.
Runs are interleaved so that a drift of the machine's load reaches every method alike: per round,
per size, the three methods in an order rotated by one each round. Per round and size,
``ratio = median step (ours) / median step (torch)``; ``step_ratio_<exact|native>_<size>`` is
the median of those ratios over the rounds. ``median_step_s`` gives, per size and method, the
median over rounds of the runs' medians (seconds); ``median_cpu_step_s`` likewise the CPU time
of rank 0's process per step (all its threads: where the library's own work shows, and less
disturbed than the step's wall time where the machine is shared), with ``cpu_ratio_...`` its
ratios as above; ``wall_s`` likewise the launch-to-exit time (start-up, the steps, shutdown).
``thread_cpu_step_s`` gives, per size and method, rank 0's CPU time per step by thread name
(median over rounds; Linux only). Targets are printed next to the figures, not asserted:
exact <= 1.10, native <= 1.03.
``machine.load_average`` (1, 5 and 15 minutes, at the start and at the end) says how busy the
machine was. Exit status 1 when a run fails :data:`TRIES` times (its output's tail is
printed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.ddp_worker import SIZES, parameters

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "ddp_worker.py"
NPROC = 4
SPARES = 1
METHODS = ("torch", "exact", "native")
"""The methods run by default; the first, plain torch DDP, is every ratio's baseline."""
OPTIONAL_METHODS = ("torch_hook",)
"""Methods run only when ``--methods`` names them (module docstring)."""
DEFAULT_STEPS = {"small": 100, "large": 10}
"""Timed steps per run by size: the large model's step takes one to two seconds on 2 cores, and
the whole default benchmark must stay within about 12 minutes there."""
DEFAULT_WARMUP = {"small": 5, "large": 3}
"""Untimed steps before them: the first steps build DDP's buckets, and under torchpass_p2p
check the job and take rank 0's model."""
BATCH_SIZE = 32
"""Samples per rank and step."""
TARGETS = {"exact": 1.10, "native": 1.03}
"""Upper bounds on the step ratio, reported beside the figures."""
TRIES = 3
"""Launches of one run before its failure ends the benchmark (each failure is listed in
``failed_then_rerun``): plain torch DDP under torchrun aborts at its teardown now and then here,
twice in a row once."""
RUN_TIMEOUT_S = 600.0
"""Per launch: a run that takes longer than this is broken, not slow."""
STOP_GRACE_S = 15.0
"""After SIGTERM to a launch past its deadline: time for the launcher to stop its children."""
TAIL_CHARS = 4000


class RunFailed(RuntimeError):
    """A launch exited non-zero, timed out, or left no result; ``tail`` is its output's end."""

    def __init__(self, what: str, tail: str) -> None:
        super().__init__(what)
        self.tail = tail


@dataclass(frozen=True)
class Run:
    """One launch's figures (seconds): the median of its timed steps, the median CPU time of
    rank 0's process per step, its launch-to-exit time, the per-step times as rank 0
    measured them, and rank 0's CPU time per step by thread name (empty where the worker
    could not read it)."""

    method: str
    size: str
    median_step_s: float
    median_cpu_step_s: float
    wall_s: float
    step_s: tuple[float, ...]
    thread_cpu_step_s: dict[str, float] = field(default_factory=dict)


def order(round_index: int, methods: tuple[str, ...] = METHODS) -> tuple[str, ...]:
    """``methods`` in the order of round ``round_index``: rotated by one each round, so each
    method takes each place equally often over every ``len(methods)`` rounds."""
    k = round_index % len(methods)
    return methods[k:] + methods[:k]


def _env() -> dict[str, str]:
    """The runs' environment: none of this process's launcher or rank variables, one OpenMP
    thread (torchrun sets it anyway: the same for every method)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHPASS_", "TORCHELASTIC_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    return env


def command(method: str, size: str, steps: int, warmup: int, out: Path,
            device: str = "cpu") -> list[str]:
    """The command line of one run of ``method`` (:data:`METHODS`, :data:`OPTIONAL_METHODS`)
    on ``device``."""
    worker = [str(WORKER), "--size", size, "--steps", str(steps), "--warmup", str(warmup),
              "--batch-size", str(BATCH_SIZE), "--device", device, "--out", str(out)]
    if method in ("torch", "torch_hook"):
        hook = ["--hook"] if method == "torch_hook" else []
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(NPROC), *worker, "--api", "torch", *hook]
    native = ["--native"] if method == "native" else []
    return [sys.executable, "-m", "torchpass_p2p.cli.main", "launch", "--nproc", str(NPROC),
            "--spares", str(SPARES), "--grace", "3", *worker, "--api", "torchpass", *native]


def run_once(work: Path, method: str, size: str, steps: int, warmup: int,
             device: str = "cpu") -> Run:
    """Launch one run in ``work`` and read rank 0's step times.

    Raises:
        RunFailed: non-zero exit, past :data:`RUN_TIMEOUT_S`, or no result written.
    """
    work.mkdir(parents=True, exist_ok=True)
    out, log_path = work / "result.json", work / "output.log"
    cmd = command(method, size, steps, warmup, out, device)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        # Its own session: on a timeout the launcher and every rank it started are signalled.
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
            _stop(proc)
    wall = time.monotonic() - t0
    tail = log_path.read_bytes().decode(errors="replace")[-TAIL_CHARS:]
    what = f"{method} {size}: {' '.join(cmd)}"
    if code is None:
        raise RunFailed(f"{what}: still running after {RUN_TIMEOUT_S:.0f} s", tail)
    if code != 0:
        raise RunFailed(f"{what}: exit code {code}", tail)
    if not out.exists():
        raise RunFailed(f"{what}: exit code 0 but rank 0 wrote no {out.name}", tail)
    result = json.loads(out.read_text())
    step_s = tuple(float(s) for s in result["step_s"])
    if len(step_s) != steps:
        raise RunFailed(f"{what}: {len(step_s)} timed steps, expected {steps}", tail)
    return Run(method, size, statistics.median(step_s), statistics.median(result["cpu_step_s"]),
               wall, step_s, result.get("thread_cpu_step_s", {}))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the run's process group (both launchers stop their children on it), then
    SIGKILL to whatever is left after :data:`STOP_GRACE_S`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def summarize(runs: list[list[Run]], sizes: list[str],
              methods: tuple[str, ...] = METHODS) -> dict[str, Any]:
    """The report's figures from ``runs`` (one list per round, any order within it) of
    ``methods`` (the first, ``torch``, the baseline).

    Returns ``step_ratio_<method>_<size>`` (the median over rounds of each round's
    ``median step (method) / median step (torch)``; None for a size not run),
    ``cpu_ratio_<method>_<size>`` (the same of the CPU time per step), ``median_step_s``,
    ``median_cpu_step_s`` and ``wall_s`` (``{size: {method: seconds}}``, medians over rounds),
    ``thread_cpu_step_s`` (``{size: {method: {thread: seconds}}}``, medians over the rounds
    that measured the thread) and ``per_round`` (each round's figures per size)."""
    out: dict[str, Any] = {}
    per_round: list[dict[str, Any]] = []
    base, ours = methods[0], methods[1:]
    for i, rnd in enumerate(runs):
        row: dict[str, Any] = {"round": i, "order": list(order(i, methods))}
        for size in sizes:
            by = {r.method: r for r in rnd if r.size == size}
            row[size] = {
                "median_step_s": {m: by[m].median_step_s for m in methods},
                "median_cpu_step_s": {m: by[m].median_cpu_step_s for m in methods},
                **{f"ratio_{m}": by[m].median_step_s / by[base].median_step_s for m in ours},
                **{f"cpu_ratio_{m}": by[m].median_cpu_step_s / by[base].median_cpu_step_s
                   for m in ours}}
        per_round.append(row)
    for kind, name in (("step", "ratio"), ("cpu", "cpu_ratio")):
        for m in ours:
            for size in SIZES:
                out[f"{kind}_ratio_{m}_{size}"] = (
                    statistics.median(r[size][f"{name}_{m}"] for r in per_round)
                    if size in sizes else None)
    for key in ("median_step_s", "median_cpu_step_s", "wall_s"):
        out[key] = {size: {m: statistics.median(getattr(r, key) for rnd in runs for r in rnd
                                                if r.size == size and r.method == m)
                           for m in methods} for size in sizes}
    out["thread_cpu_step_s"] = {size: {m: _median_by_thread(
        [r.thread_cpu_step_s for rnd in runs for r in rnd if r.size == size and r.method == m])
        for m in methods} for size in sizes}
    out["per_round"] = per_round
    return out


def _median_by_thread(runs: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for run in runs for name in run})
    return {name: statistics.median(run[name] for run in runs if name in run) for name in names}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _round(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 6)
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_round(x) for x in v]
    return v


def print_table(result: dict[str, Any]) -> None:
    """The figures as a table: with ``rich`` where it is installed, else plain text."""
    rows = []
    for size in result["job"]["sizes"]:
        steps = result["median_step_s"][size]
        for m in result["job"]["methods"]:
            target = TARGETS.get(m)
            cpu = result["median_cpu_step_s"][size][m]
            ratios = ("1", "1") if m == METHODS[0] else (
                f"{result[f'step_ratio_{m}_{size}']:.3f}", f"{result[f'cpu_ratio_{m}_{size}']:.3f}")
            rows.append((size, m, f"{steps[m] * 1e3:.2f}", f"{cpu * 1e3:.2f}",
                         f"{result['wall_s'][size][m]:.1f}", *ratios,
                         "" if target is None else f"<= {target:.2f}"))
    header = ("size", "method", "step ms", "CPU ms", "wall s", "step ratio", "CPU ratio",
              "target")
    title = (f"torchpass_p2p vs torch DDP, {NPROC} ranks, gloo, {result['rounds']} round(s): "
             "medians per step; ratios are medians of per-round ratios; targets on the step "
             "ratio")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
        for r in (header, *rows):
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
        return
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < 2 else "right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per run, every size (default: "
                         + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps before them, every size (default: "
                         + ", ".join(f"{k} {v}" for k, v in DEFAULT_WARMUP.items()) + ")")
    ap.add_argument("--sizes", default=",".join(SIZES),
                    help="comma-separated model sizes: " + ", ".join(SIZES))
    ap.add_argument("--device", default="cpu",
                    help="the ranks' device: cpu, or cuda (all 4 ranks share the one GPU)")
    ap.add_argument("--keep", help="directory to keep every run's output and result in")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated, torch first: "
                         + ", ".join(METHODS + OPTIONAL_METHODS))
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    if not sizes or any(s not in SIZES for s in sizes):
        ap.error(f"--sizes: a comma-separated list of {', '.join(SIZES)}")
    methods = tuple(m for m in args.methods.split(",") if m)
    if (methods[:1] != METHODS[:1] or len(set(methods)) != len(methods)
            or any(m not in METHODS + OPTIONAL_METHODS for m in methods)):
        ap.error(f"--methods: {METHODS[0]} first, then any of "
                 + ", ".join(METHODS[1:] + OPTIONAL_METHODS) + ", each once")
    if args.rounds < 1 or (args.steps is not None and args.steps < 1) or (
            args.warmup is not None and args.warmup < 0):
        ap.error("--rounds and --steps must be at least 1, --warmup at least 0")
    steps = {s: args.steps or DEFAULT_STEPS[s] for s in sizes}
    warmup = {s: DEFAULT_WARMUP[s] if args.warmup is None else args.warmup for s in sizes}
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (
        lambda *a: print(*a, flush=True))
    work = Path(args.keep or tempfile.mkdtemp(prefix="torchpass-vs-ddp-"))
    runs: list[list[Run]] = []
    failed: list[str] = []  # runs that failed once and ran again (any method, ours too)
    load_start = list(os.getloadavg())
    try:
        for i in range(args.rounds):
            runs.append([])
            for size in sizes:
                for method in order(i, methods):
                    say(f"round {i + 1}/{args.rounds}: {size} {method}")
                    where = work / f"round-{i}" / size / method
                    # Up to TRIES: plain torch DDP under torchrun, too, aborts now and then at
                    # its teardown on this loaded host. The last failure ends the benchmark.
                    for attempt in range(1, TRIES + 1):
                        try:
                            run = run_once(where.with_name(f"{method}-{attempt}"), method,
                                           size, steps[size], warmup[size], args.device)
                            break
                        except RunFailed as exc:
                            if attempt == TRIES:
                                raise
                            failed.append(str(exc).split(":", 1)[0] + f", round {i + 1}: "
                                          + str(exc).rsplit(": ", 1)[-1])
                            say(f"  failed ({exc}); again")
                    say(f"  median step {run.median_step_s * 1e3:.2f} ms "
                        f"(CPU {run.median_cpu_step_s * 1e3:.2f} ms), wall {run.wall_s:.1f} s")
                    runs[-1].append(run)
    except RunFailed as exc:
        print(f"vs_ddp: run failed: {exc}\n--- output tail ---\n{exc.tail}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {"benchmark": "vs_ddp", **summarize(runs, sizes, methods),
                              "failed_then_rerun": failed}
    result["targets"] = {f"step_ratio_{m}": f"<= {t:.2f}" for m, t in TARGETS.items()
                         if m in methods}
    result["job"] = {
        "script": "benchmarks/ddp_worker.py", "methods": list(methods), "ranks": NPROC,
        "spares": SPARES,
        "backend": "gloo", "device": args.device, "threads_per_rank": 1, "batch_size": BATCH_SIZE,
        "sizes": {s: {"parameters": parameters(s), "steps": steps[s], "warmup": warmup[s],
                      **SIZES[s]}
                  for s in sizes}}
    result["rounds"] = args.rounds
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "torch": _version("torch"), "load_average": {"start": load_start,
                                          "end": list(os.getloadavg())}}
    result = _round(result)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
