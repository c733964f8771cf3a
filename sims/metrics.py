"""The figures a scenario run reports, each defined exactly, and the per-second sampler.

Vocabulary used below (all times virtual seconds):

* a *fault* is a member the :class:`~sims.recorder.DetectionRecorder` was told to expect removed
  (crash, hang, one-way, host loss, arrivals, gray with ``expected_removal``); a host failure is
  one fault per member of the host. ``at`` is when it was injected.
* a *live member* (at time t) is neither crashed, nor removed (it learned it was declared dead),
  nor a fault. Whole-run figures use the members live at the end of the run.

Percentiles are nearest-rank: the value at rank ``ceil(p/100 * n)`` of the ``n`` sorted values,
where "never" sorts last as +inf; a percentile that lands on "never" is ``None`` (JSON null).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from .cluster import Cluster
from .faults import FaultInjector
from .recorder import DetectionRecorder
from .safety import SafetyChecker


def nearest_rank(values: Sequence[float | None], pct: float) -> float | None:
    """The ``pct`` percentile (0 < pct <= 100) of ``values`` by nearest rank; ``None`` entries
    mean "never" and sort after every number. ``None`` for an empty input."""
    if not values:
        return None
    ordered = sorted(math.inf if v is None else v for v in values)
    value = ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]
    return None if value == math.inf else value


class Sampler:
    """Takes one sample per slice of the run (every virtual second): bytes and packets sent per
    live member per second during the slice, live members, and distinct membership views
    (live members grouped by ``core.view_digest()``). Also snapshots every member's counters at
    the end of the warmup, the baseline of the whole-run rates."""

    def __init__(self, cluster: Cluster, recorder: DetectionRecorder, warmup_s: float) -> None:
        self.cluster = cluster
        self.recorder = recorder
        self.warmup_s = warmup_s
        n = len(cluster.members)
        self._last_t = cluster.now
        self._last_bytes = [0] * n
        self._last_packets = [0] * n
        self.baseline: list[tuple[int, int, int, int]] | None = None
        if warmup_s <= cluster.now:
            self.baseline = self._counters()
        self.t_s: list[float] = []
        self.live: list[int] = []
        self.bytes_per_member_per_s: list[float] = []
        self.packets_per_member_per_s: list[float] = []
        self.views: list[int] = []

    def _counters(self) -> list[tuple[int, int, int, int]]:
        return [(sm.sent_bytes, sm.recv_bytes, sm.sent_packets, sm.recv_packets)
                for sm in self.cluster.members]

    def sample(self, t: float) -> None:
        """Record the slice that ends at ``t`` (the cluster has just run until ``t``)."""
        faults = self.recorder.faults
        members = self.cluster.members
        grown = len(members) - len(self._last_bytes)  # joiners spawned since the last sample
        if grown > 0:
            self._last_bytes += [0] * grown
            self._last_packets += [0] * grown
        live = [sm for sm in members
                if not sm.crashed and not sm.core.removed and sm.id not in faults]
        dt = t - self._last_t
        sent_bytes = sum(sm.sent_bytes - self._last_bytes[sm.index] for sm in live)
        sent_packets = sum(sm.sent_packets - self._last_packets[sm.index] for sm in live)
        per = len(live) * dt
        self.t_s.append(t)
        self.live.append(len(live))
        self.bytes_per_member_per_s.append(round(sent_bytes / per, 3) if per else 0.0)
        self.packets_per_member_per_s.append(round(sent_packets / per, 3) if per else 0.0)
        self.views.append(len({sm.core.view_digest() for sm in live}))
        self._last_bytes = [sm.sent_bytes for sm in self.cluster.members]
        self._last_packets = [sm.sent_packets for sm in self.cluster.members]
        self._last_t = t
        if self.baseline is None and t >= self.warmup_s:
            self.baseline = self._counters()


def scenario_metrics(cluster: Cluster, recorder: DetectionRecorder, injector: FaultInjector,
                     sampler: Sampler, safety: SafetyChecker, *, virtual_s: float,
                     warmup_s: float, wall_s: float, series: bool = False) -> dict[str, Any]:
    """Every figure of one finished run, as a JSON-ready dict.

    Detection (seconds after each fault's ``at``):
        * ``detect_first`` = until the first member convicted it (its first ``MemberDead``
          anywhere); per fault, then ``detect_first_p50_s``/``_p99_s`` over the run's faults.
        * ``detect_all`` = until the last member live at the end knew it dead (``None`` if one
          never did); ``detect_all_p50_s``/``_p99_s`` over the faults.
        * ``detect_member`` = until that member knew it dead, for every (fault, live member)
          pair; ``detect_member_p50_s``/``_p99_s`` over the pairs.
        * ``faults`` = how many; ``detected_by_all`` = how many every live member knew.
    Agreement (seconds after each fault's ``at``):
        * ``decided_all`` = until the last member live at the end that held a configuration with
          the fault in it at the fault's time held a decided one without it;
          ``decided_all_p50_s``/``_p99_s`` over the faults (None: never).
        * ``decisions`` = configuration changes decided; ``fast_path_fraction`` = those whose
          first decision anywhere came from the fast round (None without decisions);
          ``empty_changes`` = those that removed nobody and admitted nobody (each also a
          ``[no-empty]`` violation); ``safety_violations`` = violations of sims/safety.py's
          rules.
    Accuracy: ``false_removals`` = distinct members convicted (by anyone but a member a
    partition cut off and named expected removed, ever) or removed by a decision that were not
    a fault; ``suspicions``/``refutations`` = counts of those events over all members.
    Restarts (``restart`` faults): ``restarts`` = new processes started; ``rejoined`` = those a
    decided configuration admitted by the end (their own ``Joined``); ``rejoin_s`` = from the
    crash each replaces until it was admitted, ``rejoin_p50_s``/``_p99_s`` over the restarts
    (None: never).
    Cost (members live at the end, from ``warmup_s`` to ``virtual_s``):
        ``bytes_per_member_per_s`` = bytes they sent / (live members x measured seconds);
        ``recv_bytes_per_member_per_s``, ``packets_per_member_per_s`` and
        ``recv_packets_per_member_per_s`` likewise (bytes include the seal's overhead; ``None``
        when the run measured no sizes, ``count_bytes = false`` and unsealed).
        ``steady_bytes_per_member_per_s`` = the median over the measured seconds of each
        second's sampled rate: a typical second's cost. A configuration change sends vote and
        progress bitmaps of N bits (Rapid, ATC 2018, section 5: the certificate is a bitmap),
        so its few seconds cost O(N) bytes per member and lift the whole-run mean with N, while
        the median stays at the per-member probing and gossip cost, which is flat in N.
    Convergence: ``views_final`` / ``views_max`` = distinct membership views among live members
    at the end / at the worst sample.
    Fencing (members live at the end): ``fenced_final`` = those fenced (no majority of their
    configuration reachable for ``lease_s``: they must not train); ``reachable_min`` /
    ``reachable_max`` = the fewest / most members of its configuration one of them believes
    reachable, itself included (``Member.reachable``, what a fenced host reports).
    Speed: ``events`` = entries the engine handled; ``events_per_s`` = events / ``wall_s``.
    """
    live = set(recorder.live_ids())
    first: list[float | None] = []
    every: list[float | None] = []
    pairs: list[float | None] = []
    decided: list[float | None] = []
    for rec in recorder.faults.values():
        first.append(None if rec.first_dead is None else rec.first_dead - rec.at)
        every.append(rec.all_know_s(live))
        held = [m for m in live if cluster.started_in.get(m, 0) == 0 or m in rec.decided]
        decided.append(rec.all_decided_s(held))
        known = rec.dead_known
        pairs.extend(known[m] - rec.at if m in known else None for m in live)
    rejoin = [recorder.joined[m] - at if m in recorder.joined else None
              for m, at in recorder.restarts.items()]
    reachable = [cluster.by_id[m].core.reachable for m in live]
    measured_s = virtual_s - warmup_s
    base = sampler.baseline or [(0, 0, 0, 0)] * len(cluster.members)
    totals = [0, 0, 0, 0]
    for sm in cluster.members:
        if sm.id in live:
            b = base[sm.index] if sm.index < len(base) else (0, 0, 0, 0)
            totals[0] += sm.sent_bytes - b[0]
            totals[1] += sm.recv_bytes - b[1]
            totals[2] += sm.sent_packets - b[2]
            totals[3] += sm.recv_packets - b[3]
    per = len(live) * measured_s
    sized = cluster.count_bytes or cluster.sealed

    def rate(total: int, has_size: bool = True) -> float | None:
        return round(total / per, 3) if per and has_size else None

    measured = [b for t, b in zip(sampler.t_s, sampler.bytes_per_member_per_s, strict=True)
                if t > warmup_s]
    events = cluster.engine.events
    result: dict[str, Any] = {
        "virtual_s": virtual_s,
        "warmup_s": warmup_s,
        "loss": cluster.network.link.loss,
        "events": events,
        "wall_s": round(wall_s, 3),
        "events_per_s": round(events / wall_s) if wall_s > 0 else None,
        "faults": len(recorder.faults),
        "detected_by_all": sum(1 for x in every if x is not None),
        "detect_first_p50_s": _r(nearest_rank(first, 50)),
        "detect_first_p99_s": _r(nearest_rank(first, 99)),
        "detect_all_p50_s": _r(nearest_rank(every, 50)),
        "detect_all_p99_s": _r(nearest_rank(every, 99)),
        "detect_member_p50_s": _r(nearest_rank(pairs, 50)),
        "detect_member_p99_s": _r(nearest_rank(pairs, 99)),
        "decided_all_p50_s": _r(nearest_rank(decided, 50)),
        "decided_all_p99_s": _r(nearest_rank(decided, 99)),
        "decisions": len(safety.first_round),
        "fast_path_fraction": _r(safety.fast_path_fraction()),
        "empty_changes": safety.empty_changes,
        "safety_violations": safety.count,
        "false_removals": len(recorder.false_removals),
        "restarts": len(recorder.restarts),
        "rejoined": sum(1 for m in recorder.restarts if m in recorder.joined),
        "rejoin_p50_s": _r(nearest_rank(rejoin, 50)),
        "rejoin_p99_s": _r(nearest_rank(rejoin, 99)),
        "suspicions": recorder.suspicions,
        "refutations": recorder.refutations,
        "live_members": len(live),
        "bytes_per_member_per_s": rate(totals[0], sized),
        "recv_bytes_per_member_per_s": rate(totals[1], sized),
        "steady_bytes_per_member_per_s": (round(statistics.median(measured), 3)
                                          if sized and measured else None),
        "packets_per_member_per_s": rate(totals[2]),
        "recv_packets_per_member_per_s": rate(totals[3]),
        "views_final": sampler.views[-1] if sampler.views else None,
        "views_max": max(sampler.views, default=None),
        "fenced_final": sum(1 for m in live if cluster.by_id[m].core.fenced),
        "reachable_min": min(reachable, default=None),
        "reachable_max": max(reachable, default=None),
    }
    if series:
        result["series"] = {
            "t_s": sampler.t_s,
            "live": sampler.live,
            "bytes_per_member_per_s": sampler.bytes_per_member_per_s if sized else None,
            "packets_per_member_per_s": sampler.packets_per_member_per_s,
            "views": sampler.views,
            "faults": [[t, kind, arg] for t, kind, arg in injector.log],
            "detect_first_s": [_r(x) for x in first],
            "detect_all_s": [_r(x) for x in every],
            "decided_all_s": [_r(x) for x in decided],
            "detect_member_s": sorted(_r(x) for x in pairs if x is not None),
            "detect_member_never": sum(1 for x in pairs if x is None),
            "rejoin_s": [_r(x) for x in rejoin],
        }
    return result


def _r(x: float | None) -> float | None:
    """Microsecond resolution: enough for latencies, stable to print."""
    return None if x is None else round(x, 6)
