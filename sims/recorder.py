"""Measurements taken while a simulation runs: detection latencies and false removals.

A :class:`DetectionRecorder` listens to every member's events. For each injected fault it keeps
when the first alert, the first suspicion and the first conviction happened, when each live
member learned that the faulty member is dead, and when each held a decided configuration without
it. A conviction of a member that was never faulted, or a decision removing one that did not
leave, is a false removal, except a conviction reached by a member that a partition cut off and
that is expected removed itself (its side sees the rest as crashed; the rest decides).
For each restarted process it keeps when the crash it replaces happened and when it was
admitted (its own ``Joined``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torchpass_p2p.core import MemberId
from torchpass_p2p.core import events as ev

from .cluster import Cluster, SimMember


@dataclass(slots=True)
class FaultRecord:
    """Timeline of one fault, in virtual seconds."""

    member: MemberId
    at: float
    first_alert: float | None = None
    first_suspected: float | None = None
    first_dead: float | None = None
    """The first verdict (``MemberDead``), or the first decision removing it, whichever came
    first: a removal on silent alerts has no verdict."""
    dead_known: dict[MemberId, float] = field(default_factory=dict)
    """When each member first knew it dead: by a verdict or by a decision removing it."""
    decided: dict[MemberId, float] = field(default_factory=dict)
    """When each member first held a decided configuration without the faulty member."""

    def all_know_s(self, live: Iterable[MemberId]) -> float | None:
        """Seconds from the fault until every member in ``live`` knew it dead; None if some
        never did."""
        times = []
        for m in live:
            t = self.dead_known.get(m)
            if t is None:
                return None
            times.append(t)
        return max(times) - self.at if times else None

    def all_decided_s(self, live: Iterable[MemberId]) -> float | None:
        """Seconds from the fault until every member in ``live`` held a configuration without
        the faulty member; None if some never did."""
        times = []
        for m in live:
            t = self.decided.get(m)
            if t is None:
                return None
            times.append(t)
        return max(times) - self.at if times else None


class DetectionRecorder:
    """Attach to a cluster before running it; call :meth:`fault` when injecting a fault."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.faults: dict[MemberId, FaultRecord] = {}
        self.false_removals: dict[MemberId, float] = {}
        self.cut_off: set[MemberId] = set()
        """Faults whose own verdicts are not false removals (:meth:`fault` with ``cut_off``)."""
        self.restarts: dict[MemberId, float] = {}
        """New process -> when the member it replaces crashed (:meth:`restarted`)."""
        self.joined: dict[MemberId, float] = {}
        """New process -> when a decided configuration admitted it (its ``Joined``)."""
        self.suspicions = 0
        self.refutations = 0
        cluster.listeners.append(self._on_event)

    def fault(self, sm: SimMember, *, cut_off: bool = False) -> None:
        """Mark ``sm`` as faulty from now on (call right before crashing it). A member already
        marked keeps its first fault time: a second fault on a dead member changes nothing.
        ``cut_off``: ``sm`` stays up but a partition isolates it, so the members it convicts
        from now on (everyone it cannot reach) are not counted as false removals."""
        self.faults.setdefault(sm.id, FaultRecord(sm.id, self.cluster.now))
        if cut_off:
            self.cut_off.add(sm.id)

    def restarted(self, new: SimMember, crashed_at: float) -> None:
        """``new`` is the process started to replace a member that crashed at ``crashed_at``
        (virtual seconds); its admission time goes into ``joined``."""
        self.restarts[new.id] = crashed_at

    def _on_event(self, sm: SimMember, event: ev.Event) -> None:
        if isinstance(event, ev.AlertRaised):
            rec = self.faults.get(event.subject)
            if rec is not None and rec.first_alert is None:
                rec.first_alert = event.at
        elif isinstance(event, ev.MemberSuspected):
            self.suspicions += 1
            rec = self.faults.get(event.member)
            if rec is not None and rec.first_suspected is None:
                rec.first_suspected = event.at
        elif isinstance(event, ev.MemberDead):
            rec = self.faults.get(event.member)
            if rec is None:
                if sm.id not in self.cut_off:
                    self.false_removals.setdefault(event.member, event.at)
                return
            if rec.first_dead is None:
                rec.first_dead = event.at
            rec.dead_known.setdefault(sm.id, event.at)
        elif isinstance(event, ev.SelfRefuted):
            self.refutations += 1
        elif isinstance(event, ev.Joined):
            self.joined.setdefault(sm.id, event.at)
        elif isinstance(event, ev.ConfigurationDecided):
            config = event.configuration
            for member, rec in self.faults.items():
                if member not in config:
                    rec.decided.setdefault(sm.id, event.at)
                    # A removal decided on silent alerts comes with no verdict: the decision
                    # is when this member learns the faulty one is gone.
                    if rec.first_dead is None:
                        rec.first_dead = event.at
                    rec.dead_known.setdefault(sm.id, event.at)
            for member in event.plan.removed:
                gone = self.cluster.by_id.get(member)
                if member not in self.faults and gone is not None and not gone.core.left:
                    self.false_removals.setdefault(member, event.at)

    def live_ids(self) -> list[MemberId]:
        """Members that are neither faulty nor removed (joiners still joining excluded)."""
        return [sm.id for sm in self.cluster.members
                if sm.id not in self.faults and not sm.crashed and not sm.core.removed
                and sm.core.joining is None]
