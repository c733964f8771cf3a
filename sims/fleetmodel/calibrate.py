"""``python -m sims jobmodel --calibrate``: the decided-latency table from protocol-level runs.

For each member count in :data:`MEMBERS` and each scope, one simulator scenario
(:mod:`sims.scenario`, the real protocol core on a virtual network) with 1 % random loss and
pulses on (as the launcher runs agents): warm up, then at :data:`FAULT_AT_S` either one random
member crashes (scope ``gpu``) or a whole random host of 8 does (scope ``host``). The figure kept
is ``decided_all_p99_s`` over the run's faults: seconds from the fault until every live member
holds a decided configuration without the failed member(s), the slowest fault of a host
failure counting (the job waits for every replacement). Several seeds: the median of the runs.

The whole table takes about 12 minutes of one core with the compiled core and simulator
(scripts/build-native; the 8,192-member runs are most of it, 4,096 members about 90 s). In
pure Python a 512-member run alone takes minutes, so there the rows beyond 256 are slow to
regenerate. Beyond the largest row :mod:`sims.fleetmodel.decided` extrapolates in log2 N.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from ..scenario import run_scenario, scenario_from_mapping
from .sources import DECIDED_LATENCY

MEMBERS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SEEDS = (1,)
FAULT_AT_S = 8.0
VIRTUAL_S = 16.0
LOSS = 0.01
GPUS_PER_HOST = 8
SCENARIO_TEXT = (f"sims.scenario runs: 1 % loss, pulse on, spares max(8, N/32), warm-up 4 s, "
                 f"at {FAULT_AT_S:g} s one random crash (gpu) or one random host of "
                 f"{GPUS_PER_HOST} (host), {VIRTUAL_S:g} virtual s; decided_all_p99_s, median "
                 f"over seeds")


def scenario(members: int, scope: str) -> dict[str, Any]:
    """The scenario mapping for ``members`` and ``scope`` (``"gpu"`` or ``"host"``)."""
    fault: dict[str, Any] = ({"kind": "crash", "member": "random", "at": FAULT_AT_S}
                             if scope == "gpu" else
                             {"kind": "host_failure", "host": "random", "at": FAULT_AT_S})
    return {"name": f"decided_{scope}_{members}", "members": members,
            "spares": max(GPUS_PER_HOST, members // 32), "virtual_s": VIRTUAL_S,
            "warmup_s": 4.0, "pulse": True, "count_bytes": False,
            "gpus_per_host": GPUS_PER_HOST, "link": {"loss": LOSS}, "faults": [fault]}


def measure(members: int, scope: str, seeds: tuple[int, ...] = SEEDS) -> dict[str, Any]:
    """One table row: the median decided latency over ``seeds`` and what the runs saw.

    Raises:
        RuntimeError: a run never decided, or broke a safety invariant (the table would be
            wrong, not merely slow).
    """
    values, walls = [], []
    for seed in seeds:
        sc = scenario_from_mapping(scenario(members, scope))
        result = run_scenario(sc, seed=seed)
        if result["decided_all_p99_s"] is None or result["safety_violations"]:
            raise RuntimeError(f"{members} members, {scope}, seed {seed}: decided "
                               f"{result['decided_all_p99_s']}, safety violations "
                               f"{result['safety_violations']}")
        values.append(float(result["decided_all_p99_s"]))
        walls.append(float(result["wall_s"]))
    return {"members": members, "decided_all_s": round(statistics.median(values), 4),
            "per_seed_s": values, "seeds": list(seeds), "wall_s": round(sum(walls), 1)}


def calibrate(members: tuple[int, ...] = MEMBERS, seeds: tuple[int, ...] = SEEDS,
              write: bool = True) -> dict[str, Any]:
    """Measure every (members, scope) and write ``data/decided_latency.json``; return it."""
    started = time.perf_counter()
    scopes: dict[str, list[dict[str, Any]]] = {"gpu": [], "host": []}
    for scope, rows in scopes.items():
        for n in members:
            row = measure(n, scope, seeds)
            print(f"  {scope:>4} {n:>6} members: decided {row['decided_all_s']:.3f} s "
                  f"({row['wall_s']:.1f} s of wall)", file=sys.stderr, flush=True)
            rows.append(row)
    table = {"generated_by": "python -m sims jobmodel --calibrate (sims/fleetmodel/calibrate.py)",
             "scenario": SCENARIO_TEXT,
             "extrapolation": "interpolated linearly in log2 N between rows; beyond the largest "
                              "row the least-squares line in log2 N through all rows, never "
                              "below the largest row's value (sims/fleetmodel/decided.py)",
             "wall_s": round(time.perf_counter() - started, 1),
             "scopes": scopes}
    if write:
        DECIDED_LATENCY.write_text(json.dumps(table, indent=1) + "\n")
    return table
