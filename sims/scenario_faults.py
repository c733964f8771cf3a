"""The ``[[faults]]`` tables of a scenario file: their keys, member selectors and scheduling.

Each table has ``kind`` (a :class:`~sims.faults.FaultInjector` method) and that method's
arguments; times are virtual seconds.

============  ==========================================================================
kind          keys (``?`` = optional)
============  ==========================================================================
crash         member, at, repeat_every_s?, count?
hang          member, at, repeat_every_s?, count?
one_way       member, at, direction ("deaf" | "mute"), repeat_every_s?, count?
pause         member, at, duration_s, repeat_every_s?, count?
stop          member, at, duration_s, expected_removal? (true), repeat_every_s?, count?
clog          member, at, duration_s, repeat_every_s?, count?
gray          member, at, loss, expected_removal? (false), repeat_every_s?, count?
delay         member, at, duration_s, delay_s, messages? ("all" | "acks"; "all"),
              expected_removal? (false), repeat_every_s?, count?
restart       member, at, after_s (seconds or [min, max]), lost_joins? (0),
              repeat_every_s?, count?
busy          member, start, until, chunk_s ([min, max]), duty
partition     side_a, side_b? ("rest"), at, heal_at?, expected_removed? (a selector)
host_failure  host (index or "random"), at, gpus_per_host? (the scenario's)
arrivals      rate_per_gpu_hour, start, until
============  ==========================================================================

``repeat_every_s``/``count`` inject ``count`` copies at ``at``, ``at + repeat_every_s``, ...;
the member selector is resolved again for each copy, so ``member = "random"`` with ``count = 10``
gives ten independent crashes of ten different members (percentiles over one run).

``delay``: from ``at`` for ``duration_s``, every datagram the member sends arrives ``delay_s``
seconds later than the link alone would deliver it; with ``messages = "acks"`` only its acks
(``Ack``, direct or relayed for an indirect probe, and pulse answers).

``restart``: each selected member crashes at ``at`` (an expected removal), and ``after_s``
seconds later a new process under a new member id asks to join as a spare. ``after_s = [min,
max]`` draws each member's delay uniformly (seeded), so ``member = "random:31"`` with
``after_s = [0.0, 2.0]`` restarts 31 members within 2 s. ``lost_joins = N`` is a join fault:
the network loses the new process's first N Join datagrams (it re-sends one every
``join_retry_s``). The run reports ``restarts``, ``rejoined`` and ``rejoin_p50_s``/``_p99_s``.

``partition`` with ``expected_removed``: those members (on either side) are faults from ``at``
on, so their removal counts as a detection, not a false removal, and the end-of-run
convergence check leaves them out; the verdicts they reach while cut off are not false
removals either.

Link duplication (``[link] duplicate``, ``duplicate_copies``) is in :mod:`sims.scenario`.

A member selector is an index into the cluster's members (sorted by id, as
:attr:`Cluster.members`), a string, or a list of either. One that names a member, rank, spare
or host the scenario's own ``members``/``spares``/``gpus_per_host`` do not have is an error when
the file is read (and again at run time for ``--members``):

``"random"`` / ``"random:K"``
    one / K distinct members drawn with the run's seed, never a member an earlier fault of the
    scenario already picked (so faults stay independent).
``"rank:R"``, ``"spare:I"``, ``"ranks"``, ``"spares"``
    by role in configuration 0.
``"host:H"``
    the ``gpus_per_host`` members ``H * gpus_per_host ..`` (as :meth:`FaultInjector.host_failure`).
``"fraction:F"``
    the first ``round(F * members)`` members by index (a partition side).
``"rest"``
    every member not in ``side_a`` (``side_b`` only).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .cluster import SimMember
from .faults import FaultInjector
from .tomlcheck import ScenarioError, boolean, check_keys, integer, number, string

if TYPE_CHECKING:
    from .scenario import Scenario

__all__ = ["FAULT_KINDS", "FaultSpec", "ScenarioError", "parse_fault", "schedule_faults"]

_REPEAT = ("repeat_every_s", "count")
FAULT_KINDS: dict[str, tuple[str, ...]] = {
    "crash": ("member", "at", *_REPEAT),
    "hang": ("member", "at", *_REPEAT),
    "one_way": ("member", "at", "direction", *_REPEAT),
    "pause": ("member", "at", "duration_s", *_REPEAT),
    "stop": ("member", "at", "duration_s", "expected_removal", *_REPEAT),
    "clog": ("member", "at", "duration_s", *_REPEAT),
    "gray": ("member", "at", "loss", "expected_removal", *_REPEAT),
    "delay": ("member", "at", "duration_s", "delay_s", "messages", "expected_removal",
              *_REPEAT),
    "restart": ("member", "at", "after_s", "lost_joins", *_REPEAT),
    "busy": ("member", "start", "until", "chunk_s", "duty"),
    "partition": ("side_a", "side_b", "at", "heal_at", "expected_removed"),
    "host_failure": ("host", "at", "gpus_per_host"),
    "arrivals": ("rate_per_gpu_hour", "start", "until"),
}
"""kind -> every key its table may hold besides ``kind``."""

_OPTIONAL = {"repeat_every_s", "count", "expected_removal", "side_b", "heal_at", "gpus_per_host",
             "messages", "lost_joins", "expected_removed"}
_SELECTOR_KEYS = ("member", "side_a", "side_b", "expected_removed")
_SELECTOR_FORMS = ('an index, "random", "random:K", "rank:R", "spare:I", "ranks", "spares", '
                   '"host:H", "fraction:F"')
_SELECTOR = re.compile(r"^(random(:\d+)?|rank:\d+|spare:\d+|ranks|spares|host:\d+|"
                       r"fraction:(0(\.\d+)?|1(\.0*)?)|rest)$")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One ``[[faults]]`` table, checked: ``args`` holds every key but ``kind``."""

    index: int
    kind: str
    args: Mapping[str, Any]
    where: str
    """``faults[i]`` plus the file, for error messages at resolve time."""

    @property
    def removes(self) -> bool:
        """Whether each copy is expected to end in the member's removal."""
        return self.kind in ("crash", "hang", "one_way", "restart") or (
            self.kind in ("gray", "delay") and bool(self.args.get("expected_removal", False))) or (
            self.kind == "stop" and bool(self.args.get("expected_removal", True)))


def parse_fault(index: int, raw: object, source: str, virtual_s: float, *,
                members: int | None = None, spares: int = 0,
                gpus_per_host: int = 8) -> FaultSpec:
    """Check one ``[[faults]]`` table's keys, types and times (``<= virtual_s``) and, given
    ``members``, that every selector names a member, rank, spare and host the scenario has
    (``spares`` of the ``members`` are spares; hosts hold ``gpus_per_host`` members).

    Raises:
        ScenarioError: naming the file and the key (``faults[i].key``).
    """
    prefix = f"faults[{index}]."
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"'faults' must be an array of tables ([[faults]]) in {source}")
    kind = string(raw, "kind", source, prefix=prefix, choices=FAULT_KINDS)
    allowed = FAULT_KINDS[kind]
    check_keys(raw, ("kind", *allowed), prefix, source)
    args: dict[str, Any] = {}
    for key in allowed:
        if key not in raw:
            if key not in _OPTIONAL:
                needs = ", ".join(k for k in allowed if k not in _OPTIONAL)
                raise ScenarioError(f"missing key {prefix + key!r} in {source} "
                                    f"(a {kind} fault needs {needs})")
            continue
        args[key] = _typed(raw, key, prefix, source, virtual_s)
    if kind in ("busy", "arrivals") and args["until"] <= args["start"]:
        raise ScenarioError(f"key {prefix + 'until'!r} in {source}: must be after start")
    if "heal_at" in args and args["heal_at"] <= args["at"]:
        raise ScenarioError(f"key {prefix + 'heal_at'!r} in {source}: must be after at")
    if ("count" in args) != ("repeat_every_s" in args):
        raise ScenarioError(f"{prefix[:-1]} in {source}: repeat_every_s and count go together")
    spec = FaultSpec(index, kind, args, f"{prefix[:-1]} in {source}")
    if members is not None:
        _check_bounds(spec, prefix, source, members, spares, gpus_per_host)
    if kind == "restart":
        after = args["after_s"]
        latest = args["at"] + (after[1] if isinstance(after, tuple) else after) + (
            args.get("count", 1) - 1) * args.get("repeat_every_s", 0.0)
        if latest > virtual_s:
            raise ScenarioError(f"key {prefix + 'after_s'!r} in {source}: a new process at "
                                f"{latest} s starts after the end of the run ({virtual_s} s); "
                                f"use kind = \"crash\" for a crash alone")
    count = args.get("count", 1)
    if count > 1:
        last = args["at"] + (count - 1) * args["repeat_every_s"]
        if last > virtual_s:
            raise ScenarioError(f"{spec.where}: the last copy at {last} s is after the end of "
                                f"the run ({virtual_s} s)")
        if spec.removes and not str(args["member"]).startswith("random"):
            raise ScenarioError(f"{spec.where}: a repeated {kind} needs member = \"random\" "
                                f"(a removed member cannot fail again)")
    return spec


def _typed(raw: Mapping[str, Any], key: str, prefix: str, source: str,
           virtual_s: float) -> Any:
    if key in ("at", "start", "until", "heal_at"):
        return number(raw, key, source, prefix=prefix, minimum=0.0, maximum=virtual_s)
    if key in ("repeat_every_s", "duration_s", "delay_s"):
        return number(raw, key, source, prefix=prefix, minimum=1e-9)
    if key == "after_s":
        return _seconds_or_range(raw, key, prefix, source)
    if key == "lost_joins":
        return integer(raw, key, source, prefix=prefix, minimum=0)
    if key == "messages":
        return string(raw, key, source, prefix=prefix, choices=("all", "acks"))
    if key in ("loss", "duty"):
        return number(raw, key, source, prefix=prefix, minimum=0.0, maximum=1.0)
    if key == "rate_per_gpu_hour":
        return number(raw, key, source, prefix=prefix, minimum=0.0)
    if key in ("count", "gpus_per_host"):
        return integer(raw, key, source, prefix=prefix, minimum=1)
    if key == "expected_removal":
        return boolean(raw, key, source, prefix=prefix)
    if key == "direction":
        return string(raw, key, source, prefix=prefix, choices=("deaf", "mute"))
    if key == "chunk_s":
        value = raw[key]
        if (not isinstance(value, list) or len(value) != 2
                or any(isinstance(x, bool) or not isinstance(x, int | float) or x <= 0
                       for x in value) or value[0] > value[1]):
            raise ScenarioError(f"key {prefix + key!r} in {source}: expected [min_s, max_s] "
                                f"with 0 < min_s <= max_s, got {value!r}")
        return (float(value[0]), float(value[1]))
    if key == "host":
        value = raw[key]
        if value != "random" and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ScenarioError(f"key {prefix + key!r} in {source}: expected a host index "
                                f"or \"random\", got {value!r}")
        return value
    # member, side_a, side_b: a selector, checked for syntax here and for bounds at run time.
    value = raw[key]
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ScenarioError(f"key {prefix + key!r} in {source}: an empty list selects no one")
    for item in items:
        ok = (isinstance(item, int) and not isinstance(item, bool) and item >= 0) or (
            isinstance(item, str) and _SELECTOR.match(item)
            and (item != "rest" or key == "side_b"))
        if not ok:
            forms = _SELECTOR_FORMS + (', "rest"' if key == "side_b" else "")
            raise ScenarioError(f"key {prefix + key!r} in {source}: {item!r} is not a member "
                                f"selector ({forms})")
    return value


def _seconds_or_range(raw: Mapping[str, Any], key: str, prefix: str,
                      source: str) -> float | tuple[float, float]:
    """Seconds (> 0), or ``[min, max]`` with 0 < min <= max to draw from."""
    value = raw[key]
    if not isinstance(value, list):
        return number(raw, key, source, prefix=prefix, minimum=1e-9)
    if (len(value) != 2 or any(isinstance(x, bool) or not isinstance(x, int | float) or x <= 0
                               for x in value) or value[0] > value[1]):
        raise ScenarioError(f"key {prefix + key!r} in {source}: expected seconds or [min_s, "
                            f"max_s] with 0 < min_s <= max_s, got {value!r}")
    return (float(value[0]), float(value[1]))


def _check_bounds(spec: FaultSpec, prefix: str, source: str, members: int, spares: int,
                  gpus_per_host: int) -> None:
    """Every selector of ``spec`` names members the scenario has (indices, ranks, spares,
    hosts, how many random ones); raises :class:`ScenarioError` naming the key."""
    a = spec.args
    ranks = members - spares
    g = a.get("gpus_per_host", gpus_per_host)
    hosts = members // g
    host = a.get("host")
    if isinstance(host, int) and host >= hosts:
        raise ScenarioError(f"key {prefix + 'host'!r} in {source}: host {host} does not exist "
                            f"({members} members fill {hosts} hosts of {g})")
    for key in _SELECTOR_KEYS:
        if key not in a:
            continue
        value = a[key]
        for item in value if isinstance(value, list) else [value]:
            problem = None
            if isinstance(item, int):
                if item >= members:
                    problem = f"member index {item} does not exist ({members} members: 0-" \
                              f"{members - 1})"
            else:
                name, _, arg = item.partition(":")
                if name == "rank" and int(arg) >= ranks:
                    problem = f"rank {arg} does not exist ({ranks} ranks)"
                elif name == "spare" and int(arg) >= spares:
                    problem = f"spare {arg} does not exist ({spares} spares)"
                elif name == "host" and int(arg) >= members // gpus_per_host:
                    problem = (f"host {arg} does not exist ({members} members fill "
                               f"{members // gpus_per_host} hosts of {gpus_per_host})")
                elif name == "random" and int(arg or 1) > members:
                    problem = f"{item!r} asks for more than the {members} members"
                elif name == "fraction" and round(float(arg) * members) == 0:
                    problem = f"{item!r} of {members} members selects no member"
                elif name in ("spares", "spare") and spares == 0:
                    problem = "the scenario has no spares"
            if problem is not None:
                raise ScenarioError(f"key {prefix + key!r} in {source}: {problem}")


class _Resolver:
    """Turns selectors into members for one run; remembers which members faults already hit."""

    def __init__(self, injector: FaultInjector, gpus_per_host: int) -> None:
        cluster = injector.cluster
        self.members = cluster.members
        self.gpus_per_host = gpus_per_host
        self.rng = random.Random(cluster.rng.getrandbits(64))
        config = cluster.configuration
        # All of them: configuration 0 has no vacant rank (the filter only narrows the type).
        self.ranks = [cluster.by_id[m] for m in config.ranks if m is not None]
        self.spares = [cluster.by_id[m] for m in config.spares]
        self.used: set[int] = set()

    def select(self, spec: FaultSpec, key: str, rest_of: list[SimMember] | None = None
               ) -> list[SimMember]:
        value = spec.args[key]
        picked: dict[int, SimMember] = {}
        for item in value if isinstance(value, list) else [value]:
            for sm in self._one(spec, key, item, rest_of):
                picked.setdefault(sm.index, sm)
        if not picked:
            raise ScenarioError(f"{spec.where}: {key} = {value!r} selects no member")
        return list(picked.values())

    def _one(self, spec: FaultSpec, key: str, item: int | str,
             rest_of: list[SimMember] | None) -> list[SimMember]:
        n = len(self.members)
        if isinstance(item, int):
            return [self._at(self.members, item, spec, key, "member index")]
        name, _, arg = item.partition(":")
        if name == "random":
            k = int(arg or 1)
            free = [sm for sm in self.members if sm.index not in self.used]
            if k > len(free):
                raise ScenarioError(f"{spec.where}: {key} = {item!r}: only {len(free)} "
                                    f"members are left unfaulted")
            return self.rng.sample(free, k)
        if name == "rank":
            return [self._at(self.ranks, int(arg), spec, key, "rank")]
        if name == "spare":
            return [self._at(self.spares, int(arg), spec, key, "spare")]
        if name == "ranks":
            return list(self.ranks)
        if name == "spares":
            return list(self.spares)
        if name == "host":
            return self.host(int(arg), self.gpus_per_host, spec, key)
        if name == "fraction":
            return list(self.members[:round(float(arg) * n)])
        assert name == "rest" and rest_of is not None
        taken = {sm.index for sm in rest_of}
        return [sm for sm in self.members if sm.index not in taken]

    def host(self, host: int, g: int, spec: FaultSpec, key: str) -> list[SimMember]:
        """The ``g`` members of host ``host`` (only whole hosts exist)."""
        hosts = len(self.members) // g
        if host >= hosts:
            raise ScenarioError(f"{spec.where}: {key} {host} is out of range: "
                                f"{len(self.members)} members fill {hosts} hosts of {g}")
        return list(self.members[host * g:(host + 1) * g])

    def random_host(self, spec: FaultSpec, gpus_per_host: int) -> int:
        hosts = [h for h in range(len(self.members) // gpus_per_host)
                 if not any(i in self.used
                            for i in range(h * gpus_per_host, (h + 1) * gpus_per_host))]
        if not hosts:
            raise ScenarioError(f"{spec.where}: no host is left without a fault")
        return self.rng.choice(hosts)

    @staticmethod
    def _at(seq: list[SimMember], i: int, spec: FaultSpec, key: str, what: str) -> SimMember:
        if i >= len(seq):
            raise ScenarioError(f"{spec.where}: {key}: {what} {i} is out of range "
                                f"(there are {len(seq)})")
        return seq[i]


def schedule_faults(scenario: Scenario, injector: FaultInjector) -> None:
    """Resolve every fault's selectors for this run (seeded) and schedule it on ``injector``.

    Raises:
        ScenarioError: a selector names a member, rank, spare or host the cluster lacks.
    """
    resolver = _Resolver(injector, scenario.gpus_per_host)
    for spec in scenario.faults:
        a = spec.args
        kind = spec.kind
        if kind == "partition":
            side_a = resolver.select(spec, "side_a")
            side_b = resolver.select(spec, "side_b", rest_of=side_a) if "side_b" in a else (
                [sm for sm in resolver.members if sm not in side_a])
            if not side_b:
                raise ScenarioError(f"{spec.where}: side_b is empty")
            expected: list[SimMember] = []
            if "expected_removed" in a:
                expected = _mark(resolver, resolver.select(spec, "expected_removed"))
                sides = {sm.index for sm in side_a} | {sm.index for sm in side_b}
                outside = sorted(sm.index for sm in expected if sm.index not in sides)
                if outside:
                    raise ScenarioError(f"{spec.where}: expected_removed names members "
                                        f"{outside}, on neither side of the partition")
            injector.partition(side_a, side_b, a["at"], a.get("heal_at"),
                               expected_removed=expected)
        elif kind == "host_failure":
            g = a.get("gpus_per_host", scenario.gpus_per_host)
            host = resolver.random_host(spec, g) if a["host"] == "random" else a["host"]
            _mark(resolver, resolver.host(host, g, spec, "host"))
            injector.host_failure(host, a["at"], gpus_per_host=g)
        elif kind == "arrivals":
            injector.arrivals(a["rate_per_gpu_hour"], a["start"], a["until"])
        elif kind == "busy":
            for sm in _mark(resolver, resolver.select(spec, "member")):
                injector.busy(sm, a["start"], a["until"], a["chunk_s"], a["duty"])
        else:
            for copy in range(a.get("count", 1)):
                at = a["at"] + copy * a.get("repeat_every_s", 0.0)
                for sm in _mark(resolver, resolver.select(spec, "member")):
                    if kind == "restart":
                        after = a["after_s"]
                        after_s = (resolver.rng.uniform(*after) if isinstance(after, tuple)
                                   else after)
                        injector.restart(sm, at, after_s, lost_joins=a.get("lost_joins", 0))
                    else:
                        _inject(injector, kind, sm, at, a)


def _mark(resolver: _Resolver, members: list[SimMember]) -> list[SimMember]:
    resolver.used.update(sm.index for sm in members)
    return members


def _inject(injector: FaultInjector, kind: str, sm: SimMember, at: float,
            a: Mapping[str, Any]) -> None:
    if kind == "crash":
        injector.crash(sm, at)
    elif kind == "hang":
        injector.hang(sm, at)
    elif kind == "one_way":
        injector.one_way(sm, at, a["direction"])
    elif kind == "pause":
        injector.pause(sm, at, a["duration_s"])
    elif kind == "stop":
        injector.stop(sm, at, a["duration_s"], expected_removal=a.get("expected_removal", True))
    elif kind == "clog":
        injector.clog(sm, at, a["duration_s"])
    elif kind == "delay":
        injector.delay(sm, at, a["duration_s"], a["delay_s"],
                       acks_only=a.get("messages", "all") == "acks",
                       expected_removal=a.get("expected_removal", False))
    else:
        injector.gray(sm, at, a["loss"], expected_removal=a.get("expected_removal", False))
