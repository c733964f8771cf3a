"""The model's input files, read from this package's ``data/`` folder.

* ``failure_rates.json``: published failure rates, failure categories, restart and checkpoint
  costs, each entry with its source (a copy of the project's failure data).
* ``measured_costs.json``: this project's own measurements (step ratio against torch DDP,
  rejoin, transfer rate), each with the page it comes from.
* ``decided_latency.json``: the decided-configuration latency at N members from protocol-level
  simulator runs, written by ``python -m sims jobmodel --calibrate``
  (:mod:`sims.fleetmodel.calibrate`).

:class:`Sourced` carries a value together with the text that says where it comes from; every
cost the model uses is one, so that the command line can print the sources.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).parent / "data"
FAILURE_RATES = DATA_DIR / "failure_rates.json"
MEASURED_COSTS = DATA_DIR / "measured_costs.json"
DECIDED_LATENCY = DATA_DIR / "decided_latency.json"


@dataclass(frozen=True, slots=True)
class Sourced:
    """A model input: ``value`` in ``unit``, and where it comes from."""

    value: float
    unit: str
    source: str


@cache
def failure_data() -> dict[str, Any]:
    """``failure_rates.json``, parsed (cached; do not mutate)."""
    return json.loads(FAILURE_RATES.read_text())


@cache
def measured() -> dict[str, Any]:
    """``measured_costs.json``, parsed (cached; do not mutate)."""
    return json.loads(MEASURED_COSTS.read_text())


def source_of(key: str) -> str:
    """The full citation of a ``sources`` key of the failure data (``"llama3"``, ...)."""
    return str(failure_data()["sources"][key])


def restart_component(name: str) -> dict[str, Any]:
    """The entry of ``restart_cost_components`` whose ``component`` starts with ``name``.

    Raises:
        KeyError: no such entry.
    """
    for entry in failure_data()["restart_cost_components"]:
        if entry["component"].startswith(name):
            return dict(entry)
    raise KeyError(name)


def rate_per_gpu_hour(level: str = "central") -> Sourced:
    """The suggested job-interrupting failure rate per GPU-hour: ``low``, ``central`` or
    ``high`` (``suggested_simulator_defaults`` of the failure data, with its rationale)."""
    defaults = failure_data()["suggested_simulator_defaults"]
    value = float(defaults["per_gpu_interrupt_rate_per_hour"][level])
    return Sourced(value, "failures per GPU-hour",
                   f"data/failure_rates.json suggested_simulator_defaults ({level}): "
                   f"{defaults['rationale']}")


def step_ratio(key: str | None = None) -> Sourced:
    """A measured fault-free step ratio against torch DDP (``measured_costs.json``;
    ``None``: its ``default``).

    Raises:
        KeyError: an unknown key (the message lists the known ones).
    """
    table = measured()["step_ratio"]
    name = table["default"] if key is None else key
    if name not in table["figures"]:
        raise KeyError(f"unknown step ratio {name!r} (known: {', '.join(table['figures'])})")
    fig = table["figures"][name]
    return Sourced(float(fig["value"]), f"x torch DDP's step ({name})", fig["source"])


def recovery_figure(key: str) -> Sourced:
    """One of ``measured_costs.json``'s ``recovery`` figures."""
    fig = measured()["recovery"][key]
    unit = "GB/s" if key.endswith("gb_per_s") else "s"
    return Sourced(float(fig["value"]), unit, fig["source"])


def decided_table() -> dict[str, Any]:
    """``decided_latency.json``, parsed.

    Raises:
        FileNotFoundError: the table was never generated (run ``python -m sims jobmodel
            --calibrate``).
    """
    return json.loads(DECIDED_LATENCY.read_text())
