"""What the core's events become at the agent: a log line, the status page's recent events and
history, counts and metrics, and for a ready plan, a :class:`Change` handed to the host.

The loop driver hands each event here as it pulls it from the core (``Member.next_event``), in
the order the core queued them.

What must stay true: a :class:`Change` is handed over only once its plan is ready, with the
decision it belongs to; ``group_id`` is derived from the decisions alone (every member derives
the same); a listener that raises ends nothing (it is the host's code, run on the driver's
task). Every map is bounded (:data:`MAX_GROUP_IDS`, :data:`RECENT_EVENTS`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchpass_p2p.core import events as ev
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.messages import MemberId, format_member_id
from torchpass_p2p.core.plan import Plan

from ..history import History

__all__ = ["MAX_GROUP_IDS", "RECENT_EVENTS", "Change", "EventSink", "Listener", "describe"]

log = logging.getLogger("torchpass_p2p.agent")
events_log = logging.getLogger("torchpass_p2p.events")

RECENT_EVENTS = 64
"""Events kept for ``/status``."""
MAX_GROUP_IDS = 256
"""Group ids (and decision times) of recent configurations kept; a change is handed over
within a few decisions."""


@dataclass(frozen=True, slots=True)
class Change:
    """A decided configuration change, handed to the host once its plan is ready.

    ``plan.resume_step`` is set: every member of ``configuration`` resumes there. ``group_id``:
    the configuration whose process group this one uses, the first of the consecutive decided
    configurations with this rank map (a change that only admits or removes spares keeps the
    group). Every member derives it from the same decisions, so members handed different
    changes of one rank map (a plan that was not ready yet when the next change was decided
    is never handed over) still meet in one rendezvous.
    """

    configuration: Configuration
    plan: Plan
    round: int
    decided_at: float
    ready_at: float
    group_id: int


Listener = Callable[[Change], None]


class EventSink:
    """The events of one member's core, turned into what the agent shows and hands over.

    Args:
        member_id: this member (named in each log line).
        history: the status page's history; it sees every event.
        config_id: the current configuration's id, -1 before the core runs (for log lines).
        metrics: the agent's metrics (:class:`~..metrics.AgentMetrics`), or None (asked at each
            event: they are built once the core runs).
        on_decided: called with the last decided configuration and the new one at each
            decision (where former members were is remembered from it).
    """

    def __init__(self, member_id: MemberId, history: History, *,
                 config_id: Callable[[], int], metrics: Callable[[], Any],
                 on_decided: Callable[[Configuration, Configuration], None]) -> None:
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        """``{"at", "type", "detail"}`` of the last events, for ``/status`` (the agent notes
        its own there too: hangs, health faults)."""
        self.counts: Counter[str] = Counter()
        """Events by type, and ``counter_source_failed``: the ``events`` metric."""
        self.decided_at: dict[int, float] = {}
        """config_id -> when (clock seconds) this member learned the decision: timelines."""
        self.changes: deque[Change] = deque(maxlen=64)
        """The last changes handed over."""
        self._member_id = member_id
        self._history = history
        self._config_id = config_id
        self._metrics = metrics
        self._on_decided = on_decided
        self._listeners: list[Listener] = []
        self._decided: dict[int, ev.ConfigurationDecided] = {}
        self._group_ids: dict[int, int] = {}
        """config_id -> the configuration whose group it uses (:class:`Change`)."""
        self._accused_at: dict[MemberId, float] = {}
        self._seen: Configuration | None = None
        """The last configuration decided (or started in): decisions come in config_id
        order."""

    def begin(self, configuration: Configuration) -> None:
        """The core runs, in ``configuration`` (the first, or the one joined)."""
        self._seen = configuration

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(change)`` for every ready change from now on."""
        self._listeners.append(listener)

    def note(self, entry: dict[str, Any]) -> None:
        """Add ``entry`` (``{"at", "type", "detail"}``) to :attr:`recent`."""
        self.recent.append(entry)

    def on_event(self, event: ev.Event) -> None:
        """Log, show, count and measure ``event``; hand over a change whose plan is ready."""
        kind = type(event).__name__
        detail = describe(event)
        self.recent.append({"at": event.at, "type": kind, "detail": detail})
        self._history.on_event(event)
        events_log.info("%s %s", kind, detail,
                        extra={"member_id": format_member_id(self._member_id),
                               "config_id": self._config_id()})
        self.counts[kind] += 1
        if isinstance(event, (ev.MemberSuspected, ev.AlertRaised)):
            subject = event.member if isinstance(event, ev.MemberSuspected) else event.subject
            self._accused_at.setdefault(subject, event.at)
        elif isinstance(event, ev.MemberAlive):
            self._accused_at.pop(event.member, None)  # refuted: a later accusation starts anew
        elif isinstance(event, ev.ConfigurationDecided):
            self._on_configuration_decided(event)
        elif isinstance(event, ev.PlanReady):
            self._on_plan_ready(event)

    def _on_configuration_decided(self, event: ev.ConfigurationDecided) -> None:
        new = event.configuration
        old, self._seen = self._seen, new
        self._track_group(old, new)
        if old is not None:
            self._on_decided(old, new)
        self._decided[new.config_id] = event
        self.decided_at[new.config_id] = event.at
        while len(self.decided_at) > MAX_GROUP_IDS:
            self.decided_at.pop(next(iter(self.decided_at)))
        metrics = self._metrics()
        if metrics is not None:
            metrics.decided("fast" if event.round == 0 else "classic")
            metrics.set_config(new.config_id)
        for gone in event.plan.removed:
            accused = self._accused_at.pop(gone, None)
            if accused is not None and metrics is not None:
                metrics.observe_detection(event.at - accused)

    def _on_plan_ready(self, event: ev.PlanReady) -> None:
        decided = self._decided.pop(event.plan.config_id, None)
        if decided is None:
            return
        change = Change(decided.configuration, event.plan, decided.round, decided.at,
                        event.at, self._group_ids.get(event.plan.config_id,
                                                      event.plan.config_id))
        self.changes.append(change)
        for listener in list(self._listeners):
            try:
                listener(change)
            except Exception:  # the host's code: it must not end the timer task
                log.exception("a change listener failed on configuration %d",
                              change.configuration.config_id)

    def _track_group(self, old: Configuration | None, new: Configuration) -> None:
        """``group_id`` of ``new`` (see :class:`Change`), decided after ``old``."""
        groups = self._group_ids
        if old is not None and old.ranks == new.ranks:
            groups[new.config_id] = groups.get(old.config_id, old.config_id)
        else:
            groups[new.config_id] = new.config_id
        while len(groups) > MAX_GROUP_IDS:
            groups.pop(next(iter(groups)))


def describe(event: ev.Event) -> str:
    """``event``'s fields but its time, as ``name=value`` words (member ids in hex)."""
    parts = []
    for field in dataclasses.fields(event):  # compiled events have no __slots__
        name = field.name
        if name == "at":
            continue
        value = getattr(event, name)
        if isinstance(value, Configuration):
            value = f"config {value.config_id} ({value.world_size} ranks, " \
                    f"{len(value.spares)} spares)"
        elif isinstance(value, Plan):
            assigned = ", ".join(f"rank {r} -> {format_member_id(m)}"
                                 for r, m in value.assignments)
            removed = ", ".join(format_member_id(m) for m in value.removed)
            value = (f"plan {value.config_id}: removed [{removed}], assignments [{assigned}], "
                     f"resume {value.resume_step}")
        elif isinstance(value, int) and name in ("member", "observer", "subject", "confirmer"):
            value = format_member_id(value)
        parts.append(f"{name}={value}")
    return " ".join(parts)
