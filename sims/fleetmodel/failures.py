"""Failures of a job's GPUs over weeks: when they arrive and how much each one takes down.

A failure has a scope:

* ``"gpu"``: one rank's GPU or process (a faulty GPU, HBM, SRAM, a hang);
* ``"host"``: a whole host of ``gpus_per_host`` GPUs at once, a correlated failure (the host
  itself, its NIC or cable, unplanned maintenance);
* ``"job"``: every rank at once, which no in-memory recovery covers (a software bug that the
  same code on a spare would hit again): every method restarts from its last checkpoint.

The category mix is Llama 3's interruption table by count (419 unexpected interruptions in
54 days on up to 16,384 H100; ``llama3_interruption_table`` of ``data/failure_rates.json``),
each category mapped to a scope by :data:`CATEGORY_SCOPE`.

Arrivals are a renewal process over the job's training GPUs, in wall time (failures also strike
while the job checkpoints or recovers, as in Daly's model): the gaps are exponential with mean
``1 / (gpus x rate)``, or Weibull with the same mean and a shape below 1 for the bursts real
fleets show (decreasing hazard; ``suggested_simulator_defaults.interarrival``), or uniform in a
window (a fault-injection benchmark's schedule). Modelling the job's whole failure stream as one
renewal process is the simplification: for exponential gaps it is exact (a superposition of
Poisson processes), for Weibull gaps it is a statement about the job's stream, not each GPU's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from .sources import Sourced, failure_data, rate_per_gpu_hour

SCOPES = ("gpu", "host", "job")

CATEGORY_SCOPE: dict[str, str] = {
    "GPU": "gpu",
    "Unknown": "gpu",
    "Network": "host",
    "Host": "host",
    "Unplanned Maintenance": "host",
    "Dependency": "job",
}
"""Llama 3's categories -> scope. "Unknown" is NCCL watchdog timeouts: one rank hung. "Network"
(a switch or cable) and "Host" take a host off the job; so does unplanned maintenance.
"Dependency" (software bugs, dependencies) is ``"job"`` by default: the model cannot show that a
spare running the same code avoids the bug (``--software-scope gpu`` says it does)."""

ARRIVALS = ("exponential", "weibull", "uniform")


@dataclass(frozen=True, slots=True)
class Failure:
    """One failure: when (wall seconds since the job started) and its scope."""

    at_s: float
    scope: str


def category_mix(software_scope: str = "job") -> dict[str, float]:
    """Probability of each scope, from Llama 3's counts (sums to 1).

    Raises:
        ValueError: ``software_scope`` is not a scope.
    """
    if software_scope not in SCOPES:
        raise ValueError(f"software_scope must be one of {SCOPES}, got {software_scope!r}")
    totals = failure_data()["llama3_interruption_table"]["category_totals"]
    counts = dict.fromkeys(SCOPES, 0.0)
    for category, row in totals.items():
        scope = software_scope if category == "Dependency" else CATEGORY_SCOPE[category]
        counts[scope] += row["count"]
    total = sum(counts.values())
    return {scope: n / total for scope, n in counts.items()}


@dataclass(frozen=True, slots=True)
class FailureModel:
    """How often failures come, how they are spaced, and what they take down.

    Args:
        rate: failures per GPU-hour (a :class:`Sourced`, e.g. :func:`rate_per_gpu_hour`).
        arrivals: ``"exponential"``, ``"weibull"`` or ``"uniform"``.
        weibull_shape: the Weibull shape k (< 1: bursts); used with ``"weibull"``.
        uniform_window_s: (min, max) gap in seconds, used with ``"uniform"`` (the rate is then
            ignored: the schedule is the job's, whatever its size).
        mix: probability of each scope (:func:`category_mix`).
    """

    rate: Sourced
    arrivals: str = "exponential"
    weibull_shape: float = 0.7
    uniform_window_s: tuple[float, float] = (2700.0, 4500.0)
    mix: tuple[tuple[str, float], ...] = tuple(category_mix().items())

    def __post_init__(self) -> None:
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {ARRIVALS}, got {self.arrivals!r}")
        if not self.weibull_shape > 0:
            raise ValueError("weibull_shape must be positive")

    def mean_gap_s(self, gpus: int) -> float:
        """Mean seconds between two failures of a job on ``gpus`` GPUs."""
        if self.arrivals == "uniform":
            return sum(self.uniform_window_s) / 2.0
        return 3600.0 / (gpus * self.rate.value)

    def scope_rate_per_s(self, gpus: int, scope: str) -> float:
        """Failures of ``scope`` per second on ``gpus`` GPUs."""
        return dict(self.mix).get(scope, 0.0) / self.mean_gap_s(gpus)

    def stream(self, gpus: int, rng: random.Random) -> Iterator[Failure]:
        """The job's failures in time order, forever (draws from ``rng`` only)."""
        mean = self.mean_gap_s(gpus)
        scopes = [s for s, _ in self.mix]
        weights = [p for _, p in self.mix]
        t = 0.0
        while True:
            if self.arrivals == "exponential":
                gap = rng.expovariate(1.0 / mean)
            elif self.arrivals == "weibull":
                k = self.weibull_shape
                gap = rng.weibullvariate(mean / math.gamma(1.0 + 1.0 / k), k)
            else:
                gap = rng.uniform(*self.uniform_window_s)
            t += gap
            yield Failure(t, rng.choices(scopes, weights)[0])


def default_model(level: str = "central", arrivals: str = "exponential",
                  software_scope: str = "job", weibull_shape: float = 0.7) -> FailureModel:
    """The model with the failure data's suggested rate at ``level`` and Llama 3's mix."""
    return FailureModel(rate_per_gpu_hour(level), arrivals=arrivals, weibull_shape=weibull_shape,
                        mix=tuple(category_mix(software_scope).items()))
