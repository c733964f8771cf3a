"""The agent's counts, from the core, the sockets, its services and sources elsewhere in the
process: for ``/status`` (:meth:`Telemetry.counters`) and for ``/metrics``
(:meth:`Telemetry.refresh`, into :class:`~..metrics.AgentMetrics`).

What must stay true: counts are read, never kept twice (each lives where it is counted, and
is synced from there), and a counter source that raises is counted and logged once, never
allowed to break ``/status`` or the driver's once-a-second refresh.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torchpass_p2p.core.membership import Member
from torchpass_p2p.core.messages import MemberState

if TYPE_CHECKING:
    from ..transport import Transport

__all__ = ["COUNTER_SOURCES", "Telemetry"]

log = logging.getLogger("torchpass_p2p.agent")

COUNTER_SOURCES = ("transfer_refused",)
"""Counts that live outside the agent, in a part of this process that registers them
(:meth:`Telemetry.add_source`), each with its metric (``torchpass_<name>_total``,
:mod:`..metrics`): ``transfer_refused``, the trainer's state-transfer server's dropped
connections by reason (``TransferServer.refusals``)."""


class Telemetry:
    """Where one agent's counts are read, and its metrics kept up to date.

    Args:
        transport: the agent's transport (traffic, rejected datagrams and frames).
        member: the core, or None before it runs.
        fenced: whether the member is fenced now.
        stragglers: the history's straggler counts (``History.stragglers``).
        events: events by type (the event sink's counts); a failed counter source is counted
            there too, as ``counter_source_failed``.
        health_faults: GPU faults by kind.
        pulse: the pulse counters (prober's, and the responder's prefixed ``responder_``).
        keys: the key counters.
    """

    def __init__(self, transport: Transport, *, member: Callable[[], Member | None],
                 fenced: Callable[[], bool], stragglers: Callable[[], Any],
                 events: Counter[str], health_faults: Counter[str],
                 pulse: Callable[[], dict[str, int]], keys: Callable[[], dict[str, int]]) -> None:
        self.metrics: Any = None
        """The agent's :class:`~..metrics.AgentMetrics` once :meth:`start_metrics` built them
        (None without prometheus_client)."""
        self._transport = transport
        self._member = member
        self._fenced = fenced
        self._stragglers = stragglers
        self._events = events
        self._health_faults = health_faults
        self._pulse = pulse
        self._keys = keys
        self._sources: dict[str, Callable[[], Mapping[str, int]]] = {}
        """Counts kept elsewhere in this process (:meth:`add_source`)."""

    def start_metrics(self) -> None:
        """Build :attr:`metrics` (nothing when the metrics module cannot be imported)."""
        try:
            from ..metrics import AgentMetrics
        except ImportError:
            return
        self.metrics = AgentMetrics()

    def add_source(self, name: str, read: Callable[[], Mapping[str, int]]) -> None:
        """Read ``name``'s counts with ``read()`` from now on (see
        :meth:`~torchpass_p2p.agent.runtime.AgentRuntime.add_counter_source`).

        Raises:
            KeyError: ``name`` is not one of :data:`COUNTER_SOURCES`.
        """
        if name not in COUNTER_SOURCES:
            raise KeyError(f"no counter source named {name!r}; known: "
                           f"{', '.join(COUNTER_SOURCES)}")
        self._sources[name] = read

    def counters(self) -> dict[str, int]:
        """Every count, flat: the core's, the transport's (``rejected_``, ``rejected_frame_``
        prefixed), the pulse's (``pulse_``) and each source's (``<name>_``)."""
        out: dict[str, int] = {}
        member = self._member()
        if member is not None:
            out.update(member.counters)
        transport = self._transport
        out.update(transport.traffic)
        out.update({f"rejected_{k}": v for k, v in transport.rejected.items()})
        out.update({f"rejected_frame_{k}": v for k, v in transport.rejected_frames.items()})
        out.update({f"pulse_{k}": v for k, v in self._pulse().items()})
        for name, counts in self._source_counts().items():
            out.update({f"{name}_{k}": v for k, v in counts.items()})
        return out

    def refresh(self) -> None:
        """Bring :attr:`metrics` up to date with the core and the sockets; nothing before
        both exist."""
        metrics, member = self.metrics, self._member()
        if metrics is None or member is None:
            return
        by_state: Counter[str] = Counter()
        by_role: Counter[str] = Counter()
        config = member.configuration
        for m in config.members:
            by_state[MemberState(member.state_of(m)[0]).name.lower()] += 1
            by_role[config.role_of(m) or "removed"] += 1
        metrics.set_members(by_state, by_role)
        metrics.set_config(config.config_id)
        metrics.set_fenced(self._fenced())
        metrics.set_stragglers(self._stragglers())
        transport = self._transport
        traffic = transport.traffic
        metrics.sync_rejected(transport.rejected)
        metrics.sync_rejected_frames(transport.rejected_frames)
        metrics.sync_counters("bytes", {"sent": traffic["bytes_sent"],
                                        "received": traffic["bytes_received"]})
        metrics.sync_counters("datagrams", {"sent": traffic["datagrams_sent"],
                                            "received": traffic["datagrams_received"]})
        metrics.sync_counters("events", self._events)
        metrics.sync_counters("health_faults", self._health_faults)
        metrics.sync_counters("pulse", self._pulse())
        metrics.sync_counters("keys", self._keys())
        for name, counts in self._source_counts().items():
            metrics.sync_counters(name, counts)

    def _source_counts(self) -> dict[str, Mapping[str, int]]:
        out: dict[str, Mapping[str, int]] = {}
        for name, read in self._sources.items():
            try:
                out[name] = read()
            except Exception:  # the host's code: a failed read must not break /status
                self._events["counter_source_failed"] += 1
                if self._events["counter_source_failed"] == 1:  # logged once, then counted
                    log.exception("counter source %r failed", name)
        return out
