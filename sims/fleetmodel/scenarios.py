"""Named set-ups of the job-level model: the reference fleet and the published cases.

* :func:`reference_job`: a large LLM pre-training job (the default of ``python -m sims
  jobmodel``), sized from Llama 3's published figures.
* :func:`daly_case`, :func:`kokolis_case`: checkpoint-restart exactly as Daly (2006) and Meta
  (Kokolis et al., 2025) model it, to reproduce their published numbers.
* :func:`h200_benchmark`: the published 64 x H200 fault-injection benchmark (Clockwork's
  TorchPass against checkpoint-restart), to reproduce its two times and to compute the 2x
  target with our own costs.
* :func:`run_methods`: every method over several seeds, averaged.

Every parameter that is not a published or measured figure says so in ``Job.sources``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from .costs import Job, Method, RestartCosts, default_methods, default_torchpass
from .failures import FailureModel, default_model
from .formulas import daly_interval
from .simulate import CAUSES, RunResult, simulate
from .sources import Sourced, failure_data, restart_component, source_of

GB = 1e9

REFERENCE_STEP_S = 8.0
"""Seconds per plain-DDP step of the reference job: the order of the 64 x H200 benchmark's step
(:data:`H200_STEP_S`, derived); it only sets how much work a redone step costs."""

REFERENCE_SOURCES = {
    "gpus, 8 GPUs per host, 400 Gbit/s per GPU": "Llama 3 pre-training, up to 16,384 H100, "
                                                 "8 per server, RoCE 400 Gbps: "
                                                 + source_of("llama3"),
    "state_bytes 4 GB per rank": "Llama 3's checkpoint, '1 MB - 4 GB per GPU' (upper figure): "
                                 + source_of("llama3"),
    "step_s 8 s": "assumed: the order of the 64 x H200 benchmark's derived step; it only prices "
                  "a redone step",
    "state_holders 2": "assumed: each rank's state has one other data-parallel holder (DP or "
                       "HSDP replica); with 1 the model sends every failure to the checkpoint",
    "repair_s 2.2 h": "NCSA Delta study: 2.2 h node recovery (spare capacity held, "
                      "data/failure_rates.json restart_cost_components)",
    "days 30 of fault-free work": "assumed: a month-long pre-training run (Llama 3's "
                                  "snapshot was 54 days)",
}


def reference_job(gpus: int = 16384, days: float = 30.0, spare_fraction: float = 0.02,
                  step_s: float = REFERENCE_STEP_S, state_gb: float = 4.0,
                  state_holders: int = 2, repair_h: float = 2.2) -> Job:
    """The reference job: ``days`` of fault-free work on ``gpus`` GPUs."""
    steps = max(1, round(days * 86400.0 / step_s))
    return Job(gpus=gpus, steps=steps, step_s=step_s, state_bytes=state_gb * GB,
               state_holders=state_holders, spare_fraction=spare_fraction,
               repair_s=repair_h * 3600.0, sources=dict(REFERENCE_SOURCES))


# ----------------------------------------------------------------------------------- Daly 2006

def daly_case(mtbf_h: float, delta_min: float = 5.0, restart_min: float = 10.0,
              solve_h: float = 500.0) -> tuple[Job, Method, FailureModel]:
    """Daly's validation case: one 'GPU' failing every ``mtbf_h`` hours (exponential), a
    ``delta_min`` checkpoint every Daly-optimal interval, ``restart_min`` per restart, no
    detection delay, spares never short. Source: Daly 2006 (``reference_results`` R18)."""
    job = Job(gpus=1, steps=round(solve_h * 3600.0), step_s=1.0, state_bytes=0.0,
              spare_fraction=8.0, repair_s=0.0)
    restart = RestartCosts(Sourced(0.0, "s", "Daly's model: none"),
                           Sourced(restart_min * 60.0, "s", "Daly 2006 R"),
                           Sourced(delta_min * 60.0, "s", "Daly 2006 delta"),
                           daly_interval(delta_min * 60.0, mtbf_h * 3600.0))
    failures = FailureModel(Sourced(1.0 / mtbf_h, "failures per GPU-hour", "Daly 2006 M"),
                            mix=(("gpu", 1.0),))
    return job, Method("checkpoint_restart", restart), failures


# ------------------------------------------------------------------------ Kokolis et al. 2025

KOKOLIS_FAILURES_PER_NODE_DAY = 6.5e-3
KOKOLIS_GPUS = 16384
"""'16k GPUs' read as 16,384: the size at which the same paper gives the 1.8 h MTTF
(reference_results R7); the transcription of R2 says 16,000. The first-order formula gives 0.676
and 0.931 at 16,384 (0.684 and 0.932 at 16,000); the event model, which counts only the work
since the last checkpoint that a failure really undoes (E[X mod dt] < dt/2), gives about 0.715
and 0.933 (0.723 and 0.934 at 16,000). docs/jobmodel.md discusses it."""


def kokolis_case(interval_min: float, solve_h: float = 2000.0) -> tuple[Job, Method,
                                                                         FailureModel]:
    """Meta's ETTR case: 16,384 GPUs (2,048 nodes), r = 6.5 failures per 1,000 node-days,
    u0 = 5 min per restart, non-blocking checkpoints every ``interval_min``. Source:
    ``reference_results`` R2 of the failure data (Kokolis et al.)."""
    job = Job(gpus=KOKOLIS_GPUS, steps=round(solve_h * 3600.0), step_s=1.0, state_bytes=0.0,
              spare_fraction=1.0, repair_s=0.0)
    restart = RestartCosts(Sourced(0.0, "s", "Meta's model: part of u0"),
                           Sourced(300.0, "s", "Meta's u0 = 5 min"),
                           Sourced(0.0, "s", "non-blocking checkpoints"), interval_min * 60.0)
    rate = KOKOLIS_FAILURES_PER_NODE_DAY / (8 * 24.0)
    failures = FailureModel(Sourced(rate, "failures per GPU-hour", source_of("kokolis")),
                            mix=(("gpu", 1.0),))
    return job, Method("checkpoint_restart", restart), failures


# ---------------------------------------------------------------------- the 64 x H200 benchmark

H200_PUBLISHED_MIN = {"checkpoint_restart": 818.0, "same_step": 405.0}
"""Published wall minutes: reference_results R12 of the failure data (Clockwork)."""
H200_RECOVERY_MIN = 2.0
"""Clockwork's press figure for a TorchPass recovery, '<2 min' (restart_cost_components, 'no-
rollback systems'): used only to back the fault-free time out of the published 405 min."""
H200_STEPS = 3000
H200_FAULT_FREE_MIN = (H200_PUBLISHED_MIN["same_step"]
                       - H200_PUBLISHED_MIN["same_step"] / 60.0 * H200_RECOVERY_MIN)
H200_STEP_S = H200_FAULT_FREE_MIN * 60.0 / H200_STEPS
"""The benchmark's fault-free time was not retrievable: 405 min less one 2-minute recovery per
mean 60-minute gap, 391.5 min, 7.83 s a step. This makes the same-step time nearly an input;
the checkpoint-restart time and the ratio are what the model predicts."""
H200_STATE_BYTES = 109e9 * 14 / 32
"""Llama 4 Scout's 109B parameters at 14 bytes each (bf16 weights, fp32 master copy, two fp32
Adam moments), sharded over 32 GPUs with 2 replicas (HSDP): 47.7 GB per rank. Assumed: the
benchmark's sharding was not published."""


def h200_benchmark() -> tuple[Job, RestartCosts, FailureModel]:
    """The 64 x H200 benchmark: 3,000 steps, a node failure every 45-75 min (uniform), a
    checkpoint every 100 steps, the checkpoint-restart costs of the benchmark's own vendor
    (10 min node replacement + 5 min restore, R13) after PyTorch's 10-minute NCCL watchdog."""
    job = Job(gpus=64, steps=H200_STEPS, step_s=H200_STEP_S, state_bytes=H200_STATE_BYTES,
              state_holders=2, spare_fraction=8 / 64, repair_s=600.0,
              sources={"benchmark": source_of("clockwork"),
                       "step_s": f"{H200_STEP_S:.2f} s, derived (H200_STEP_S)",
                       "state_bytes": "47.7 GB per rank, assumed (H200_STATE_BYTES)",
                       "spares": "one spare host back 10 min after each fault (the vendor's "
                                 "node replacement): the benchmark never ran short"})
    watchdog = restart_component("detection: PyTorch NCCL collective timeout")
    restart = RestartCosts(
        Sourced(600.0, "s", f"{watchdog['component']}: {watchdog['source']}"),
        Sourced(900.0, "s", "Clockwork's cost model: 10 min node + 5 min restore (R13): "
                            + source_of("clockwork")),
        Sourced(6.3, "s", "blocking part of an asynchronous PyTorch DCP save (7B), "
                          "restart_cost_components"),
        100 * H200_STEP_S)
    failures = FailureModel(Sourced(0.0, "", "uniform 2,700-4,500 s (R12)"), arrivals="uniform",
                            uniform_window_s=(2700.0, 4500.0), mix=(("host", 1.0),))
    return job, restart, failures


def h200_methods(overhead: str | None, same_step_ratio_1: bool) -> list[Method]:
    """Checkpoint-restart and same-step replacement for :func:`h200_benchmark`; with
    ``same_step_ratio_1`` the replacement's step costs what plain DDP's does (the published
    system's own overhead is inside the derived fault-free time)."""
    _, restart, _ = h200_benchmark()
    tp = default_torchpass(overhead)
    if same_step_ratio_1:
        tp = replace(tp, step_ratio=Sourced(1.0, "x", "inside the derived fault-free time"))
    return [Method("checkpoint_restart", restart), Method("torchpass_p2p", restart, torchpass=tp)]


# ------------------------------------------------------------------------------- many seeds

@dataclass(frozen=True, slots=True)
class Summary:
    """One method over several seeds: means, and the spread of the ETTR."""

    method: str
    gpus: int
    ettr: float
    ettr_min: float
    ettr_max: float
    time_to_train_h: float
    lost_h: dict[str, float]
    failures: dict[str, float]
    checkpoint_interval_min: float | None
    spares_min: int
    runs: tuple[RunResult, ...]

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers for JSON."""
        return {"method": self.method, "gpus": self.gpus, "ettr": round(self.ettr, 4),
                "ettr_min": round(self.ettr_min, 4), "ettr_max": round(self.ettr_max, 4),
                "time_to_train_h": round(self.time_to_train_h, 2),
                "lost_h": {k: round(v, 3) for k, v in self.lost_h.items()},
                "failures": {k: round(v, 1) for k, v in self.failures.items()},
                "checkpoint_interval_min": (None if self.checkpoint_interval_min is None
                                            else round(self.checkpoint_interval_min, 2)),
                "spares_min": self.spares_min, "seeds": [r.seed for r in self.runs]}


def summarize(runs: list[RunResult]) -> Summary:
    """Average ``runs`` of one method (ETTR as total work over total wall)."""
    ettrs = [r.ettr for r in runs]
    n = len(runs)
    tau = runs[0].checkpoint_interval_s
    return Summary(
        method=runs[0].method, gpus=runs[0].gpus,
        ettr=sum(r.work_s for r in runs) / sum(r.wall_s for r in runs),
        ettr_min=min(ettrs), ettr_max=max(ettrs),
        time_to_train_h=statistics.fmean(r.wall_s for r in runs) / 3600.0,
        lost_h={c: sum(r.lost_s[c] for r in runs) / n / 3600.0 for c in CAUSES},
        failures={k: sum(r.failures[k] for r in runs) / n for k in runs[0].failures},
        checkpoint_interval_min=None if tau is None else tau / 60.0,
        spares_min=min(r.spares_min for r in runs), runs=tuple(runs))


def run_methods(job: Job, methods: list[Method], failures: FailureModel,
                seeds: range | list[int] = range(1, 6)) -> list[Summary]:
    """Every method over ``seeds`` (the same failures for each method under one seed)."""
    return [summarize([simulate(job, m, failures, seed) for seed in seeds]) for m in methods]


def reference(gpus: int = 16384, spare_fraction: float = 0.02, level: str = "central",
              overhead: str | None = None, seeds: range | list[int] = range(1, 6),
              days: float = 30.0, **kw: Any) -> list[Summary]:
    """The three methods on :func:`reference_job` with the default failure model."""
    job = reference_job(gpus, days=days, spare_fraction=spare_fraction)
    return run_methods(job, default_methods(overhead), default_model(level, **kw), seeds)


def failure_meta() -> dict[str, Any]:
    """The failure data's meta block (for reports)."""
    return dict(failure_data()["meta"])
