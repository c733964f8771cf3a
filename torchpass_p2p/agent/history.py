"""What one member has seen of configurations, recoveries and state transfers: the part of its
``/status`` document that the status page (:mod:`.page`) draws as history.

Fed from three places, all in the member's own process:

* the agent's loop hands over the core's events (:meth:`History.on_event`): accusations, the
  decisions and their plans;
* the trainer hands over its timeline records (:meth:`History.record`, the same records it
  writes to its JSON-lines log, :mod:`torchpass_p2p.trainer.events`): the state fetched, the
  group formed, the steps committed, the stragglers named and cleared
  (:mod:`torchpass_p2p.ddp.stragglers`);
* the state service hands over a transfer's progress (:meth:`History.transfer_progress`).

A *recovery* is a decided configuration whose plan moves a rank (a spare promoted, a rank left
vacant, ranks renumbered by a shrink, or the job stopped). Its timeline has the five phases of
:class:`torchpass_p2p.trainer.timeline.FaultTimeline`, as this member saw them: *detected*
(the first accusation, alert or departure of a removed member this agent heard), *decided*
(this agent learnt the decision), *transferred* (this member received and verified the state;
on a source, the last chunk of the resume state it sent: the receiver has it soon after; on
any other member, the fingerprint check of the new group, which shows every member holds the
same state: a bound from above), *rebuilt* (this member's group of the configuration formed)
and *resumed* (this member committed its first step there, or in a later configuration when
this one was superseded). ``transferred_by`` says which of the three (``received``, ``sent``,
``verified``). A phase not seen stays None.

Times are the agent's clock (CLOCK_MONOTONIC seconds, the clock of the trainer's records too);
``/status`` carries the agent's ``clock`` beside them. Every collection is bounded, and every
method is thread-safe (the trainer and the state service call from their own threads) and
quick: none waits on anything but a lock held for microseconds.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any

from torchpass_p2p.core import events as ev
from torchpass_p2p.core.messages import MemberId, format_member_id

__all__ = ["ACCUSED_KEPT", "CONFIGURATIONS_KEPT", "History", "RECOVERIES_KEPT",
           "STRAGGLERS_KEPT"]

_TRANSFER_SEEN = {"received_at": "received", "sent_at": "sent", "verified_at": "verified"}
"""How a member saw the state transferred, the closest view first (module docstring)."""

CONFIGURATIONS_KEPT = 32
"""Decided configurations kept (oldest dropped first): a page shows the recent ones."""
RECOVERIES_KEPT = 16
"""Recoveries kept, likewise."""
STRAGGLERS_KEPT = 1024
"""Stragglers named at once that are kept (the lowest ranks): one per rank at most, and the
first rank to arrive is never one; this only bounds what a malformed record stream costs."""
ACCUSED_KEPT = 1024
"""Members with an open accusation kept (oldest dropped first): far above the members one
change removes; it bounds what a flood of suspicions costs."""

_ACCUSATIONS = (ev.MemberSuspected, ev.AlertRaised, ev.MemberDead, ev.MemberLeft)


def _hex(member: MemberId | None) -> str | None:
    return None if member is None else format_member_id(member)


class History:
    """The bounded history of one member (module docstring).

    Args:
        clock: the agent's clock (monotonic seconds), for progress reports, which carry no
            time of their own.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._configurations: deque[dict[str, Any]] = deque(maxlen=CONFIGURATIONS_KEPT)
        self._recoveries: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._accused: OrderedDict[MemberId, float] = OrderedDict()
        self._transfer: dict[str, Any] | None = None
        self._stragglers: dict[str, dict[str, Any]] | None = None
        """Member id -> ``{"rank", "member_id", "lag_s"}`` of each straggler named now; None
        until this member trained a step (a spare judges nobody)."""

    # ------------------------------------------------------------------ inputs

    def on_event(self, event: Any) -> None:
        """A core event (:mod:`torchpass_p2p.core.events`), on the agent's loop; others are
        ignored."""
        with self._lock:
            if isinstance(event, _ACCUSATIONS):
                subject = event.subject if isinstance(event, ev.AlertRaised) else event.member
                if subject not in self._accused:
                    self._accused[subject] = event.at
                    while len(self._accused) > ACCUSED_KEPT:
                        self._accused.popitem(last=False)
            elif isinstance(event, ev.MemberAlive):
                self._accused.pop(event.member, None)  # refuted: a later accusation starts anew
            elif isinstance(event, ev.ConfigurationDecided):
                self._decided(event)
            elif isinstance(event, ev.PlanReady):
                config_id = event.plan.config_id
                for entry in self._configurations:
                    if entry["config_id"] == config_id:
                        entry["resume_step"] = event.plan.resume_step
                recovery = self._recoveries.get(config_id)
                if recovery is not None:
                    recovery["resume_step"] = event.plan.resume_step

    def record(self, record: Mapping[str, Any]) -> None:
        """One trainer timeline record (``t``, ``event`` and the event's fields); those that
        mark a phase are kept, the others ignored. Any thread."""
        kind = record.get("event")
        if kind not in _TRAINER_EVENTS:
            return
        if kind in _STRAGGLER_EVENTS or kind == "step":
            self._straggler(kind, record)
            if kind != "step":
                return
        t = record.get("t")
        config_id = record.get("config_id")
        if not isinstance(t, (int, float)) or not isinstance(config_id, int):
            return
        with self._lock:
            if kind == "fetch_started":
                self._transfer = {
                    "direction": "receiving", "config_id": config_id,
                    "step": record.get("step"), "done_bytes": 0, "total_bytes": None,
                    "sources": record.get("sources"), "started_at": t, "updated_at": t,
                    "finished_at": None}
            elif kind == "state_fetched":
                total = record.get("bytes")
                transfer = self._transfer
                if transfer is None or transfer["direction"] != "receiving" \
                        or transfer["config_id"] != config_id:  # over the group: no start seen
                    seconds = record.get("seconds")
                    started = t - seconds if isinstance(seconds, (int, float)) else t
                    transfer = self._transfer = {
                        "direction": "receiving", "config_id": config_id,
                        "step": record.get("step"), "sources": record.get("sources"),
                        "started_at": started}
                transfer.update(done_bytes=total, total_bytes=total, updated_at=t,
                                finished_at=t)
                self._phase(config_id, "transferred_at", t)
            elif kind == "group_formed":
                self._phase(config_id, "rebuilt_at", t)
            elif kind == "joined":
                self._phase(config_id, "verified_at", t)
            elif kind == "step":
                step = record.get("step")
                for c, recovery in self._recoveries.items():
                    resume = recovery["resume_step"]
                    if (c <= config_id and recovery["resumed_at"] is None
                            and isinstance(step, int) and (resume is None or step >= resume)):
                        recovery["resumed_at"] = t

    def transfer_progress(self, direction: str, step: int, done_bytes: int,
                          total_bytes: int, config_id: int | None = None) -> None:
        """A state transfer moved: ``done_bytes`` of the ``total_bytes`` of the state after
        ``step`` steps, ``direction`` ``"receiving"`` (this member fetches it) or
        ``"sending"`` (this member's transfer server sent that much of it to one receiver: a
        share, when several sources serve one fetch). Any thread."""
        now = self._clock()
        with self._lock:
            transfer = self._transfer
            if (transfer is None or transfer["direction"] != direction
                    or transfer["step"] != step or transfer["finished_at"] is not None
                    or (config_id is not None and transfer["config_id"] != config_id)):
                transfer = self._transfer = {
                    "direction": direction, "config_id": config_id, "step": step,
                    "done_bytes": 0, "total_bytes": total_bytes, "sources": None,
                    "started_at": now, "finished_at": None}
            transfer.update(done_bytes=done_bytes, total_bytes=total_bytes, updated_at=now)
            if direction == "sending" and done_bytes >= total_bytes:  # the sole source
                transfer["finished_at"] = now
            if direction == "sending":
                for recovery in self._recoveries.values():
                    if recovery["resume_step"] == step and recovery["received_at"] is None:
                        recovery["sent_at"] = now

    # ------------------------------------------------------------------ output

    def status(self) -> dict[str, Any]:
        """``configurations``, ``recoveries`` (oldest first), ``transfer`` (the latest, or
        None) and ``stragglers`` (:meth:`stragglers`), JSON-able, for ``/status`` (schema in
        :mod:`torchpass_p2p.cli.status`)."""
        with self._lock:
            recoveries = []
            for recovery in self._recoveries.values():
                out = {k: v for k, v in recovery.items() if k not in _TRANSFER_SEEN}
                out["transferred_at"] = out["transferred_by"] = None
                for key, by in _TRANSFER_SEEN.items():  # the closest view first
                    if recovery[key] is not None:
                        out["transferred_at"], out["transferred_by"] = recovery[key], by
                        break
                recoveries.append(out)
            return {
                "configurations": [dict(c) for c in self._configurations],
                "recoveries": recoveries,
                "transfer": None if self._transfer is None else dict(self._transfer),
                "stragglers": self._straggler_list(),
            }

    def stragglers(self) -> list[dict[str, Any]] | None:
        """The stragglers named now, by rank: ``[{"rank": int, "member_id": "<16 hex>",
        "lag_s": float}, ...]`` (``lag_s``: seconds behind the first rank's arrival, the median
        over its slow steps); None until this member trained a step."""
        with self._lock:
            return self._straggler_list()

    # ------------------------------------------------------------------ inside

    def _decided(self, event: ev.ConfigurationDecided) -> None:
        config, plan = event.configuration, event.plan
        config_id = config.config_id
        removed = [format_member_id(m) for m in plan.removed]
        assignments = [[rank, format_member_id(m)] for rank, m in plan.assignments]
        self._configurations.append({
            "config_id": config_id, "decided_at": event.at, "round": event.round,
            "world_size": config.world_size, "ranks": [_hex(m) for m in config.ranks],
            "spares": [format_member_id(m) for m in config.spares], "removed": removed,
            "joined": [format_member_id(m) for m in plan.joined], "assignments": assignments,
            "action": plan.action, "resume_step": plan.resume_step})
        accused = [self._accused.pop(m) for m in plan.removed if m in self._accused]
        if not (plan.assignments or plan.vacant or plan.renumbered or plan.action != "continue"):
            return  # spares joined or left: no rank moved
        self._recoveries[config_id] = {
            "config_id": config_id, "removed": removed, "assignments": assignments,
            "vacant": list(plan.vacant), "action": plan.action,
            "resume_step": plan.resume_step, "detected_at": min(accused, default=None),
            "decided_at": event.at, "received_at": None, "sent_at": None,
            "verified_at": None, "rebuilt_at": None, "resumed_at": None}
        while len(self._recoveries) > RECOVERIES_KEPT:
            self._recoveries.popitem(last=False)

    def _straggler(self, kind: str, record: Mapping[str, Any]) -> None:
        with self._lock:
            if self._stragglers is None:
                self._stragglers = {}
            if kind == "step":
                return
            member, rank, lag = (record.get("straggler"), record.get("rank"),
                                 record.get("lag_s"))
            if not isinstance(member, str):
                return
            if kind == "straggler_cleared":
                self._stragglers.pop(member, None)
            elif (isinstance(rank, int) and isinstance(lag, (int, float))
                  and (member in self._stragglers or len(self._stragglers) < STRAGGLERS_KEPT)):
                self._stragglers[member] = {"rank": rank, "member_id": member,
                                            "lag_s": float(lag)}

    def _straggler_list(self) -> list[dict[str, Any]] | None:
        if self._stragglers is None:
            return None
        return sorted((dict(s) for s in self._stragglers.values()),
                      key=lambda s: (s["rank"], s["member_id"]))

    def _phase(self, config_id: int, name: str, t: float) -> None:
        recovery = self._recoveries.get(config_id)
        key = "received_at" if name == "transferred_at" else name
        if recovery is not None and recovery[key] is None:
            recovery[key] = t


_STRAGGLER_EVENTS = frozenset(("straggler_named", "straggler_cleared"))
_TRAINER_EVENTS = frozenset(("fetch_started", "state_fetched", "group_formed", "joined", "step",
                             *_STRAGGLER_EVENTS))
"""The trainer's records that mark a phase or name a straggler (:meth:`History.record`)."""
