"""Scenarios: a seeded cluster, a link model and a list of faults, read from a TOML file.

A scenario file looks like this (every key but ``members`` and ``virtual_s`` has a default)::

    name = "crash"                # default: the file's stem
    description = "one crash at 1 % loss"
    members = 1000                # ranks + spares
    spares = 16                   # the last members of the configuration hold no rank
    virtual_s = 30.0              # simulated seconds
    seed = 1
    warmup_s = 5.0                # bytes and packets are measured after this
    count_bytes = true            # encode every datagram to measure its size
    sealed = false                # send real sealed datagrams (slow; small runs)
    gpus_per_host = 8             # what "host:H" selects
    check_convergence = false     # at the end, live members must agree on one view
    pulse = false                 # members watch their subjects' pulse responders

    [link]                        # sims.network.LinkModel
    base_latency_s = 0.0005
    jitter_s = 0.0002
    loss = 0.01
    duplicate = 0.0               # probability that a datagram arrives more than once
    duplicate_copies = 1          # extra arrivals of a duplicated datagram (needs duplicate > 0)

    [params.probe]                # overrides of core Params, same tables as configs/*.toml
    probe_interval_s = 1.0

    [[faults]]                    # see sims.scenario_faults for every kind and its keys
    kind = "crash"
    member = "random"
    at = 10.0

Like :mod:`torchpass_p2p.config`, everything is strict: an unknown key, a wrong type or an
impossible value raises :class:`ScenarioError` naming the file and the key.
:func:`run_scenario` runs one and returns the metrics that ``python -m sims run`` prints.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

from torchpass_p2p.config import ConfigError, params_from_mapping
from torchpass_p2p.core import Params

from .cluster import Cluster
from .faults import FaultInjector
from .invariants import InvariantChecker
from .metrics import Sampler, scenario_metrics
from .network import LinkModel
from .recorder import DetectionRecorder
from .safety import SafetyChecker
from .scenario_faults import FaultSpec, ScenarioError, parse_fault, schedule_faults
from .tomlcheck import boolean, check_keys, integer, number, string

__all__ = ["SCENARIO_DIR", "Scenario", "ScenarioError", "find_scenario", "load_scenario",
           "run_scenario", "scenario_from_mapping"]

SCENARIO_DIR = Path(__file__).parent / "scenarios"
"""Where a bare scenario name (``crash``) is looked up: ``sims/scenarios/NAME.toml``."""

_TOP_KEYS = ("name", "description", "members", "spares", "virtual_s", "seed", "warmup_s",
             "count_bytes", "sealed", "gpus_per_host", "check_convergence", "pulse", "link",
             "params",
             "faults")
_LINK_KEYS = ("base_latency_s", "jitter_s", "loss", "duplicate", "duplicate_copies")
_LINK_DEFAULTS = LinkModel()
_EXAMPLES = 3
"""Violation messages copied into the result: enough to start debugging, short on stdout."""


@dataclass(frozen=True, slots=True)
class Scenario:
    """One scenario file, validated. Times are virtual seconds."""

    name: str
    members: int
    virtual_s: float
    description: str = ""
    spares: int = 0
    seed: int = 0
    warmup_s: float = 0.0
    count_bytes: bool = True
    sealed: bool = False
    gpus_per_host: int = 8
    check_convergence: bool = False
    pulse: bool = False
    """Also check at the end that live members agree on one view (the run must end quiet:
    faults detected, partitions healed, a few sync intervals passed)."""
    link: LinkModel = field(default_factory=LinkModel)
    params: Params = field(default_factory=Params)
    faults: tuple[FaultSpec, ...] = ()
    source: str = "<mapping>"


def find_scenario(name_or_path: str | PathLike[str]) -> Path:
    """``crash`` -> ``sims/scenarios/crash.toml``; an existing path is returned as is.

    Raises:
        ScenarioError: neither a file nor a known scenario name (the message lists the names).
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = SCENARIO_DIR / f"{name_or_path}.toml"
    if candidate.is_file():
        return candidate
    known = ", ".join(sorted(p.stem for p in SCENARIO_DIR.glob("*.toml")))
    raise ScenarioError(f"no scenario file or name {str(name_or_path)!r} (known: {known})")


def load_scenario(name_or_path: str | PathLike[str]) -> Scenario:
    """Read and validate a scenario file (or a bare name, see :func:`find_scenario`).

    Raises:
        ScenarioError: invalid TOML, an unknown key, a wrong type or an impossible value.
    """
    path = find_scenario(name_or_path)
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError(f"{path}: invalid TOML: {exc}") from exc
    return scenario_from_mapping(data, source=str(path), default_name=path.stem)


def scenario_from_mapping(data: Mapping[str, Any], *, source: str = "<mapping>",
                          default_name: str = "scenario") -> Scenario:
    """Build a :class:`Scenario` from parsed TOML (see the module docstring for the keys)."""
    check_keys(data, _TOP_KEYS, "", source)
    for key in ("members", "virtual_s"):
        if key not in data:
            raise ScenarioError(f"missing key {key!r} in {source}")
    members = integer(data, "members", source, minimum=2)
    virtual_s = number(data, "virtual_s", source, minimum=1e-9)
    spares = integer(data, "spares", source, default=0, minimum=0)
    if spares >= members:
        raise ScenarioError(f"key 'spares' in {source}: {spares} spares leave no rank "
                            f"among {members} members")
    warmup_s = number(data, "warmup_s", source, default=0.0, minimum=0.0)
    if warmup_s >= virtual_s:
        raise ScenarioError(f"key 'warmup_s' in {source}: {warmup_s} s leaves nothing to "
                            f"measure in a {virtual_s} s run")
    link_table = data.get("link", {})
    if not isinstance(link_table, Mapping):
        raise ScenarioError(f"'link' must be a table in {source}")
    check_keys(link_table, _LINK_KEYS, "link.", source)
    link = LinkModel(
        base_latency_s=number(link_table, "base_latency_s", source, prefix="link.",
                              default=_LINK_DEFAULTS.base_latency_s, minimum=0.0),
        jitter_s=number(link_table, "jitter_s", source, prefix="link.",
                        default=_LINK_DEFAULTS.jitter_s, minimum=1e-12),
        loss=number(link_table, "loss", source, prefix="link.", default=0.0, minimum=0.0,
                    maximum=1.0),
        duplicate=number(link_table, "duplicate", source, prefix="link.", default=0.0,
                         minimum=0.0, maximum=1.0),
        duplicate_copies=integer(link_table, "duplicate_copies", source, prefix="link.",
                                 default=1, minimum=1),
    )
    if link.duplicate_copies > 1 and link.duplicate == 0:
        raise ScenarioError(f"key 'link.duplicate_copies' in {source}: copies of duplicated "
                            f"datagrams need link.duplicate > 0 (the probability of a "
                            f"duplicate), which is 0")
    params_table = data.get("params", {})
    if not isinstance(params_table, Mapping):
        raise ScenarioError(f"'params' must be a table of tables in {source}")
    try:
        params = params_from_mapping(params_table, source=f"{source} [params]")
    except ConfigError as exc:
        raise ScenarioError(str(exc)) from exc
    raw_faults = data.get("faults", [])
    if not isinstance(raw_faults, list):
        raise ScenarioError(f"'faults' must be an array of tables ([[faults]]) in {source}")
    gpus_per_host = integer(data, "gpus_per_host", source, default=8, minimum=1)
    faults = tuple(parse_fault(i, raw, source, virtual_s, members=members, spares=spares,
                               gpus_per_host=gpus_per_host)
                   for i, raw in enumerate(raw_faults))
    return Scenario(
        name=string(data, "name", source, default=default_name),
        description=string(data, "description", source, default=""),
        members=members,
        virtual_s=virtual_s,
        spares=spares,
        seed=integer(data, "seed", source, default=0, minimum=0),
        warmup_s=warmup_s,
        count_bytes=boolean(data, "count_bytes", source, default=True),
        sealed=boolean(data, "sealed", source, default=False),
        gpus_per_host=gpus_per_host,
        check_convergence=boolean(data, "check_convergence", source, default=False),
        pulse=boolean(data, "pulse", source, default=False),
        link=link,
        params=params,
        faults=faults,
        source=source,
    )


def run_scenario(scenario: Scenario, *, members: int | None = None, seed: int | None = None,
                 progress: bool = False, series: bool = False) -> dict[str, Any]:
    """Run ``scenario`` on the virtual clock and return its metrics (see
    :func:`sims.metrics.scenario_metrics` for the exact definition of each).

    Args:
        members: override the scenario's member count; spares scale with it (rounded, at
            least one rank left).
        seed: override the scenario's seed. The same (scenario, members, seed) gives the same
            dict except ``wall_s`` and ``events_per_s``.
        progress: draw a tqdm bar on stderr that advances with virtual time (shown only when
            the run lasts over a second of wall time).
        series: add ``series``: per-sample lists (bytes per member, distinct views, ...) and
            every (fault, member) detection latency, for reports.

    Raises:
        ScenarioError: a fault names a member or host that the cluster does not have.
    """
    n = scenario.members if members is None else members
    if n < 2:
        raise ScenarioError(f"a scenario needs at least 2 members, got {n}")
    spares = min(n - 1, round(scenario.spares * n / scenario.members))
    run_seed = scenario.seed if seed is None else seed
    started = time.perf_counter()
    cluster = Cluster(n, spares=spares, seed=run_seed, params=scenario.params,
                      link=dataclasses.replace(scenario.link), sealed=scenario.sealed,
                      count_bytes=scenario.count_bytes, keep_events=False,
                      pulse=scenario.pulse)
    recorder = DetectionRecorder(cluster)
    checker = InvariantChecker(cluster, recorder)
    safety = SafetyChecker(cluster)
    injector = FaultInjector(cluster, recorder)
    schedule_faults(scenario, injector)
    sampler = Sampler(cluster, recorder, warmup_s=scenario.warmup_s)
    bar = _progress_bar(scenario, n, progress)
    try:
        with frozen_heap():
            for until in _boundaries(scenario.virtual_s, scenario.warmup_s):
                cluster.run(until)
                sampler.sample(until)
                if bar is not None:
                    bar.update(until - bar.n)
    finally:
        if bar is not None:
            bar.close()
    wall_s = time.perf_counter() - started
    result: dict[str, Any] = {"scenario": scenario.name, "seed": run_seed, "members": n,
                              "spares": spares}
    result.update(scenario_metrics(cluster, recorder, injector, sampler, safety,
                                   virtual_s=scenario.virtual_s, warmup_s=scenario.warmup_s,
                                   wall_s=wall_s, series=series))
    result.update(_invariant_figures(checker, scenario.check_convergence))
    if series:
        result["series"] = result.pop("series")  # keep the big lists last in the JSON
    return result


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Run the block with every object that exists now out of the cyclic collector's reach
    (``gc.freeze``), and hand them back after (``gc.unfreeze``).

    Wrap the run of a cluster that was just built: its members, configurations and rings live
    as long as the run, yet each full collection rescanned all of them. The crash phase of a
    large run allocates fast enough to trigger several (4,096 members: 3.9 s of its 15 s went
    to the collector; 1.1 s frozen). Nothing the simulation computes depends on the collector.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _boundaries(virtual_s: float, warmup_s: float) -> list[float]:
    """Slice ends: every whole virtual second, the end of the warmup and the horizon."""
    ends = {float(s) for s in range(1, int(virtual_s) + 1)}
    ends.update((warmup_s, virtual_s))
    return sorted(t for t in ends if 0 < t <= virtual_s)


def _invariant_figures(checker: InvariantChecker, check_convergence: bool) -> dict[str, Any]:
    """``invariant_violations`` (how many, all rules) and the first few violation messages,
    ``invariant_examples``."""
    if check_convergence:
        checker.check_end()
    # ``count`` keeps counting after the checker stops keeping messages.
    return {"invariant_violations": checker.count,
            "invariant_examples": list(checker.violations[:_EXAMPLES])}


def _progress_bar(scenario: Scenario, members: int, progress: bool) -> Any | None:
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=scenario.virtual_s, desc=f"{scenario.name} ({members} members)",
                unit="virtual s", file=sys.stderr, delay=1.0, leave=False,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} virtual s "
                           "[{elapsed}<{remaining}]")
