"""Closed forms of checkpoint-restart: Young, Daly and Meta's expected ETTR.

All times are in one unit of the caller's choice (seconds, minutes, hours), the same for every
argument; rates are per that unit. The event model (:mod:`sims.fleetmodel.simulate`) uses
:func:`daly_interval` to choose checkpoint intervals; the tests compare both the formulas and the
event model against the published figures.
"""

from __future__ import annotations

import math


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum checkpoint interval, ``sqrt(2 delta M)``.

    Source: J.W. Young, "A first order approximation to the optimum checkpoint interval",
    CACM 17(9), 1974. ``delta``: time to write one checkpoint; ``mtbf``: mean time between
    failures.
    """
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum checkpoint interval (compute time between checkpoints).

    ``sqrt(2 delta M) (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta`` for
    ``delta < 2M``, else ``M``. Source: J.T. Daly, "A higher order estimate of the optimum
    checkpoint interval for restart dumps", FGCS 22(3):303-312, 2006, eq. 37. The restart time
    does not enter the optimum (it does enter :func:`daly_wall_time`).

    Raises:
        ValueError: a non-positive ``mtbf`` or a negative ``delta``.
    """
    if mtbf <= 0 or delta < 0:
        raise ValueError(f"need mtbf > 0 and delta >= 0, got {mtbf}, {delta}")
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def daly_wall_time(solve: float, tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Expected wall time to finish ``solve`` of work, checkpointing every ``tau`` of work.

    ``T_w = M exp(R/M) (exp((tau + delta)/M) - 1) T_s / tau``: exponential failures at any time,
    during checkpoints and restarts too, each costing ``restart`` plus the work since the last
    checkpoint. Source: Daly 2006, eq. 20.
    """
    return mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf) * solve / tau


def daly_efficiency(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """``T_s / T_w`` of :func:`daly_wall_time`: the fraction of wall time doing new work."""
    return tau / (mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf))


def kokolis_ettr(nodes: int, failures_per_node_day: float, restart_min: float,
                 interval_min: float, write_min: float = 0.0) -> float:
    """Meta's expected effective training time ratio of a checkpoint-restart job.

    ``E[ETTR] ~= (1 - N r (u0 + dt/2)) / (1 + w/dt)`` with ``N r`` failures per minute.
    Source: Kokolis, Kuchnik et al., "Revisiting Reliability in Large-Scale Machine Learning
    Research Clusters", arXiv:2410.21680v2 / HPCA 2025 (as transcribed in
    ``data/failure_rates.json``, ``checkpoint_formulas.kokolis_ettr``).
    """
    per_min = nodes * failures_per_node_day / 1440.0
    return (1.0 - per_min * (restart_min + interval_min / 2.0)) / (1.0 + write_min / interval_min)
