"""Prometheus metrics of one agent (docs/design.md section 10), served as text by :mod:`.http`.

Each :class:`AgentMetrics` owns its own ``CollectorRegistry``: tests run several agents in one
process, and the global registry would make their metrics collide (or raise on the second
registration). Nothing here touches ``prometheus_client.REGISTRY``.

The runtime owns the truth as plain ``collections.Counter`` objects (drops by reason, bytes and
datagrams by direction, events by type, ...). Prometheus counters only go up, so
:meth:`AgentMetrics.sync_counters` raises each labelled counter to the runtime's total: call it
just before rendering (the status server does, for its own counter). A runtime total that goes
down (a bug, or a counter that was replaced) is ignored, never subtracted.

========================================  =========  =========  ==============================
metric                                    type       labels     set by
========================================  =========  =========  ==============================
``torchpass_members``                     gauge      state      ``set_members``
``torchpass_members_by_role``             gauge      role       ``set_members``
``torchpass_config_id``                   gauge                 ``set_config``
``torchpass_step``                        gauge                 ``set_step``
``torchpass_fenced``                      gauge                 ``set_fenced``
``torchpass_decisions_total``             counter               ``decided``
``torchpass_configuration_changes_total`` counter    path       ``decided``
``torchpass_detection_latency_seconds``   histogram             ``observe_detection``
``torchpass_hang_watchdog_fired_total``   counter               ``hang_fired``
``torchpass_stragglers``                  gauge                 ``set_stragglers``
``torchpass_straggler_lag_seconds``       gauge      rank,      ``set_stragglers``
                                                     member
``torchpass_rejected_datagrams_total``    counter    reason     ``sync_rejected`` (UDP)
``torchpass_rejected_frames_total``       counter    reason     ``sync_rejected_frames`` (TCP)
``torchpass_bytes_total``                 counter    direction  ``sync_counters("bytes")``
``torchpass_datagrams_total``             counter    direction  ``sync_counters("datagrams")``
``torchpass_events_total``                counter    type       ``sync_counters("events")``
``torchpass_health_faults_total``         counter    kind       ``sync_counters("health_faults")``
``torchpass_http_rejected_total``         counter    reason     ``sync_counters("http_rejected")``
``torchpass_pulse_total``                 counter    kind       ``sync_counters("pulse")``
``torchpass_transfer_refused_total``      counter    reason     ``sync_counters`` (a source)
``torchpass_keys_total``                  counter    event      ``sync_counters("keys")``
========================================  =========  =========  ==============================

``direction`` is ``sent`` or ``received``. Counters also expose prometheus_client's
``*_created`` samples (turning them off is process-global, so it is left to the launcher).

Not thread-safe by itself: call it from the agent's loop thread only (the sync bookkeeping is a
plain dict).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = [
    "CONTENT_TYPE",
    "DETECTION_BUCKETS_S",
    "MAX_LABEL_VALUES",
    "OTHER",
    "ROLES",
    "STATES",
    "SYNCED",
    "AgentMetrics",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Content type of :meth:`AgentMetrics.render`: ``generate_latest`` writes the 0.0.4 text format
(prometheus_client's own handler sends this type for it)."""

STATES = ("alive", "suspect", "dead", "left")
"""Member states, always exported (0 when none), so a dashboard sees a series drop to 0."""
ROLES = ("rank", "spare")
"""Member roles, always exported. Other roles passed to :meth:`AgentMetrics.set_members` (e.g.
``joining``) get a series of their own."""

DETECTION_BUCKETS_S = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0)
"""Upper bounds of the detection-latency histogram, seconds. A crash seen by the local launcher
is reported in ~0.1 s, SWIM with Lifeguard on a LAN detects in 1-5 s, a hang or a partition may
take up to the suspicion timeout (tens of seconds); beyond 30 s falls in +Inf."""

MAX_LABEL_VALUES = 64
"""Distinct label values kept per metric; later new values are folded into :data:`OTHER`.
Reasons, event types and fault kinds come from fixed sets in the code (a dozen or two each), so
this is never reached in practice; it bounds the series count should a caller ever pass a
label built from input."""
OTHER = "other"

_SYNCED: dict[str, tuple[str, str, str]] = {
    # name -> (metric name without _total, label, help)
    "rejected_datagrams": (
        "torchpass_rejected_datagrams", "reason", "Datagrams dropped before the core, by reason"),
    "rejected_frames": (
        "torchpass_rejected_frames", "reason", "TCP frames dropped, by reason"),
    "bytes": ("torchpass_bytes", "direction", "Bytes sent and received (UDP and TCP)"),
    "datagrams": ("torchpass_datagrams", "direction", "Datagrams sent and received"),
    "events": ("torchpass_events", "type", "Membership and runtime events, by type"),
    "health_faults": ("torchpass_health_faults", "kind", "Health faults seen, by kind"),
    "http_rejected": (
        "torchpass_http_rejected", "reason", "Status-server requests refused, by reason"),
    "pulse": ("torchpass_pulse", "kind",
              "Pulses: this member's pings, pongs, misses and withheld silences, and its "
              "responder's answers and drops (responder_*), by kind"),
    "transfer_refused": (
        "torchpass_transfer_refused", "reason",
        "State-transfer server connections refused or dropped, by reason"),
    "keys": ("torchpass_keys", "event",
             "Key file reloads (and failed ones), key checks, refusals sent to processes "
             "under a key not held, and sources under such a key logged (or suppressed)"),
}
SYNCED = tuple(_SYNCED)
"""Names accepted by :meth:`AgentMetrics.sync_counters`."""



class AgentMetrics:
    """The metrics of one agent, in a registry of its own (:attr:`registry`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._members = Gauge(
            "torchpass_members", "Members in this agent's view, by state", ["state"], registry=r)
        self._roles = Gauge(
            "torchpass_members_by_role", "Members in the current configuration, by role",
            ["role"], registry=r)
        self._config_id = Gauge(
            "torchpass_config_id", "Id of the configuration this agent is in", registry=r)
        self._step = Gauge("torchpass_step", "Last committed training step", registry=r)
        self._fenced = Gauge(
            "torchpass_fenced", "1 while this member is fenced (must not train)", registry=r)
        self._decisions = Counter(
            "torchpass_decisions", "Configuration changes decided", registry=r)
        self._changes = Counter(
            "torchpass_configuration_changes",
            "Configuration changes decided, by agreement path (fast or classic)", ["path"],
            registry=r)
        self._detection = Histogram(
            "torchpass_detection_latency_seconds",
            "Time from a member's failure (first missed probe or launcher report) to its removal",
            buckets=DETECTION_BUCKETS_S, registry=r)
        self._hang = Counter(
            "torchpass_hang_watchdog_fired", "Times the hang watchdog fired", registry=r)
        self._stragglers = Gauge(
            "torchpass_stragglers", "Ranks named stragglers now (docs/stragglers.md)",
            registry=r)
        self._straggler_lag = Gauge(
            "torchpass_straggler_lag_seconds",
            "Each named straggler's arrival at the gradient collective after the first rank's "
            "(median over its slow steps); a series exists only while it is named",
            ["rank", "member"], registry=r)
        self._synced: dict[str, Counter] = {
            name: Counter(metric, text, [label], registry=r)
            for name, (metric, label, text) in _SYNCED.items()
        }
        # (name, label value) -> total already added to the prometheus counter
        self._totals: dict[tuple[str, str], int] = {}
        # metric name -> label values seen (for the MAX_LABEL_VALUES cap)
        self._labels: dict[str, set[str]] = {}
        self._gauge_labels: dict[str, set[str]] = {"state": set(STATES), "role": set(ROLES)}
        for state in STATES:
            self._members.labels(state).set(0)
        for role in ROLES:
            self._roles.labels(role).set(0)
        for path in ("fast", "classic"):
            self._changes.labels(path).inc(0)

    # gauges

    def set_members(self, by_state: Mapping[str, int], by_role: Mapping[str, int]) -> None:
        """Members by state (``alive``/``suspect``/``dead``/``left``) and by role (``rank``/
        ``spare``). A state or role absent from the mapping is set to 0."""
        self._set_labelled(self._members, "state", by_state)
        self._set_labelled(self._roles, "role", by_role)

    def set_config(self, config_id: int) -> None:
        self._config_id.set(config_id)

    def set_step(self, step: int) -> None:
        """The last committed step."""
        self._step.set(step)

    def set_fenced(self, fenced: bool) -> None:
        self._fenced.set(1 if fenced else 0)

    def set_stragglers(self, stragglers: Sequence[Mapping[str, object]] | None) -> None:
        """The stragglers named now (:meth:`~.history.History.stragglers`: ``rank``,
        ``member_id``, ``lag_s``); None or empty: none. The lag series of the first
        :data:`MAX_LABEL_VALUES` by rank are exported, the rest only counted."""
        found = list(stragglers or ())
        self._stragglers.set(len(found))
        self._straggler_lag.clear()
        for s in found[:MAX_LABEL_VALUES]:
            lag = s.get("lag_s")
            if isinstance(lag, (int, float)):
                self._straggler_lag.labels(str(s.get("rank")), str(s.get("member_id"))).set(lag)

    # events

    def decided(self, path: str) -> None:
        """One configuration change decided, by ``path`` ``fast`` or ``classic``: counts it in
        ``torchpass_decisions_total`` and in ``torchpass_configuration_changes_total{path}``.

        Raises:
            ValueError: another path.
        """
        if path not in ("fast", "classic"):
            raise ValueError(f"path must be 'fast' or 'classic', got {path!r}")
        self._decisions.inc()
        self._changes.labels(path).inc()

    def observe_detection(self, seconds: float) -> None:
        """One failure detected ``seconds`` after it happened.

        Raises:
            ValueError: a negative or non-finite latency.
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"detection latency must be finite and >= 0, got {seconds!r}")
        self._detection.observe(seconds)

    def hang_fired(self) -> None:
        """The hang watchdog fired once."""
        self._hang.inc()

    # counters owned by the runtime

    def sync_counters(self, name: str, counter: Mapping[str, int]) -> None:
        """Raise the labelled counters of ``name`` (one of :data:`SYNCED`) to the totals in
        ``counter`` (label value -> total since the agent started). Totals below what was
        already synced are ignored: a Prometheus counter never goes down.

        Raises:
            KeyError: ``name`` is not one of :data:`SYNCED`.
        """
        metric = self._synced[name]
        for label in sorted(counter):
            total = int(counter[label])
            key = (name, label)
            delta = total - self._totals.get(key, 0)
            if delta > 0:
                self._totals[key] = total
                metric.labels(self._capped(name, label)).inc(delta)

    def sync_rejected(self, counter: Mapping[str, int]) -> None:
        """Rejected datagrams by reason: ``sync_counters("rejected_datagrams", counter)``."""
        self.sync_counters("rejected_datagrams", counter)

    def sync_rejected_frames(self, counter: Mapping[str, int]) -> None:
        """Rejected TCP frames by reason: ``sync_counters("rejected_frames", counter)``."""
        self.sync_counters("rejected_frames", counter)

    # exposition

    def render(self) -> bytes:
        """The Prometheus text exposition of this agent's registry (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    # helpers

    def _capped(self, name: str, label: str) -> str:
        seen = self._labels.setdefault(name, set())
        if label in seen:
            return label
        if len(seen) >= MAX_LABEL_VALUES:
            return OTHER
        seen.add(label)
        return label

    def _set_labelled(self, gauge: Gauge, kind: str, values: Mapping[str, int]) -> None:
        seen = self._gauge_labels[kind]
        folded: dict[str, int] = {}
        for label in sorted(values):
            if label not in seen:
                if len(seen) >= MAX_LABEL_VALUES:
                    folded[OTHER] = folded.get(OTHER, 0) + values[label]
                    seen.add(OTHER)
                    continue
                seen.add(label)
            folded[label] = folded.get(label, 0) + values[label]
        # every label ever exported is set, so one that is absent now drops to 0
        for label in sorted(seen):
            gauge.labels(label).set(folded.get(label, 0))
