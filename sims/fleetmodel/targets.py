"""The published results the model must reproduce, and the issue's targets with our costs.

Each check is a dict: what was compared, the model's figure, the published or target figure,
the tolerance, and whether it holds. ``python -m sims jobmodel --targets`` prints them;
tests/sims/test_fleetmodel_published.py asserts the reproductions.
"""

from __future__ import annotations

from typing import Any

from . import scenarios as sc
from .failures import default_model
from .formulas import daly_interval
from .simulate import simulate

DALY_PUBLISHED_MIN = {24.0: 117.0, 6.0: 57.0, 0.25: 9.1}
"""Daly 2006's optimum intervals (min) for M = 24 h, 6 h, 15 min; delta 5 min, R 10 min."""
DALY_TOLERANCE = 0.02
KOKOLIS_PUBLISHED = {60.0: 0.70, 5.0: 0.93}
KOKOLIS_TOLERANCE = 0.02
H200_TOLERANCE = 0.15
ETTR_TARGET = 0.97
SPEEDUP_TARGET = 2.0


def _check(what: str, model: float, published: float, tolerance: str, ok: bool,
           **extra: Any) -> dict[str, Any]:
    return {"what": what, "model": round(model, 4), "published": published,
            "tolerance": tolerance, "holds": ok, **extra}


def daly_checks() -> list[dict[str, Any]]:
    """Daly's optimum interval for each published case (relative tolerance 2 %)."""
    out = []
    for m_h, published in DALY_PUBLISHED_MIN.items():
        tau = daly_interval(5.0, m_h * 60.0)
        out.append(_check(f"Daly 2006 optimum interval, M = {m_h:g} h (min)", tau, published,
                          "2 %", abs(tau - published) <= DALY_TOLERANCE * published))
    return out


def kokolis_checks(seeds: range = range(1, 6)) -> list[dict[str, Any]]:
    """The event model's checkpoint-restart ETTR in Meta's case (absolute tolerance 0.02)."""
    out = []
    for interval, published in KOKOLIS_PUBLISHED.items():
        job, method, failures = sc.kokolis_case(interval)
        runs = [simulate(job, method, failures, seed) for seed in seeds]
        ettr = sum(r.work_s for r in runs) / sum(r.wall_s for r in runs)
        out.append(_check(f"Meta ETTR, {sc.KOKOLIS_GPUS:,} GPUs, {interval:g}-min checkpoints",
                          ettr, published, "0.02", abs(ettr - published) <= KOKOLIS_TOLERANCE))
    return out


def h200_checks(seeds: range = range(1, 21), overhead: str | None = None
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The 64 x H200 benchmark: the two published times (15 %), and the 2x target with our
    measured step ratio."""
    job, _, failures = sc.h200_benchmark()
    repro = {s.method: s for s in sc.run_methods(job, sc.h200_methods(overhead, True), failures,
                                                 seeds)}
    ours = {s.method: s for s in sc.run_methods(job, sc.h200_methods(overhead, False), failures,
                                                seeds)}
    checks = []
    for method, key in (("checkpoint_restart", "checkpoint_restart"),
                        ("torchpass_p2p", "same_step")):
        minutes = repro[method].time_to_train_h * 60.0
        published = sc.H200_PUBLISHED_MIN[key]
        checks.append(_check(f"64 x H200 benchmark, {key.replace('_', ' ')} (min)", minutes,
                             published, "15 %",
                             abs(minutes - published) <= H200_TOLERANCE * published))
    cr = ours["checkpoint_restart"].time_to_train_h
    tp = ours["torchpass_p2p"].time_to_train_h
    target = _check("time to train, checkpoint-restart / torchpass_p2p, 64 x H200 conditions, "
                    "our measured step ratio", cr / tp, SPEEDUP_TARGET, ">= 2",
                    cr / tp >= SPEEDUP_TARGET, checkpoint_restart_min=round(cr * 60, 1),
                    torchpass_p2p_min=round(tp * 60, 1),
                    ratio_at_step_ratio_1=round(
                        repro["checkpoint_restart"].time_to_train_h
                        / repro["torchpass_p2p"].time_to_train_h, 3))
    return checks, target


def ettr_target(seeds: range = range(1, 6), overhead: str | None = None,
                software_scope: str = "job") -> dict[str, Any]:
    """torchpass_p2p's ETTR at 16,384 GPUs, central rate, 2 % spares (target >= 0.97), with
    the same figure at a step ratio of 1 (what recovery alone costs)."""
    summaries = sc.reference(16384, 0.02, "central", overhead, seeds,
                             software_scope=software_scope)
    tp = next(s for s in summaries if s.method == "torchpass_p2p")
    job = sc.reference_job(16384)
    from dataclasses import replace

    from .costs import default_methods
    from .sources import Sourced
    method = default_methods(overhead)[2]
    assert method.torchpass is not None
    ratio1 = replace(method, torchpass=replace(method.torchpass,
                                               step_ratio=Sourced(1.0, "x", "counterfactual")))
    alone = sc.run_methods(job, [ratio1], default_model(software_scope=software_scope), seeds)[0]
    return _check(f"torchpass_p2p ETTR, 16,384 GPUs, central rate, 2 % spares, software "
                  f"scope {software_scope}", tp.ettr, ETTR_TARGET, ">= 0.97",
                  tp.ettr >= ETTR_TARGET, step_ratio=method.ratio,
                  ettr_at_step_ratio_1=round(alone.ettr, 4),
                  others={s.method: round(s.ettr, 4) for s in summaries})


def all_checks(seeds: int = 5, overhead: str | None = None) -> dict[str, Any]:
    """Every reproduction and target (``seeds``: runs per stochastic figure; the benchmark
    gets four times as many, its jobs are short)."""
    h200, speedup = h200_checks(range(1, 4 * seeds + 1), overhead)
    return {"reproductions": daly_checks() + kokolis_checks(range(1, seeds + 1)) + h200,
            "targets": [ettr_target(range(1, seeds + 1), overhead),
                        ettr_target(range(1, seeds + 1), overhead, software_scope="gpu"),
                        speedup]}
