"""Agreement safety, checked on every decision event as the simulation runs (docs/design.md sections
5, 6).

A :class:`SafetyChecker` joins ``cluster.listeners`` and keeps the global history of decided
configurations. Each rule's name starts its violation message:

* [one-decision] at most one decision per ``config_id``: every member that decides it computes
  the same plan (equal ``plan.hash``, which covers the cut, the assignments and the sources).
* [same-sequence] every member sees the same sequence of configurations: each decision a member
  makes follows the one it holds (``previous_config_id`` is its current ``config_id``).
* [quorum] the certificate a member decided on holds a quorum of the previous configuration:
  a fast quorum for round 0, a majority otherwise. So a side without a majority of the previous
  configuration never decides.
* [one-rank] in every decided configuration no member holds two ranks, no rank is held twice, and
  no spare also holds a rank.
* [same-plan] every member that holds the plan of a ``config_id`` with its ``resume_step``
  (``PlanReady``) holds the same one.
* [no-empty] no decided change is empty: each removes or admits a member (a change of nothing
  costs every member a configuration and holds up the real change behind it;
  :mod:`torchpass_p2p.core.agreement`).
"""

from __future__ import annotations

from torchpass_p2p.core import Configuration, MemberId
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.agreement import classic_quorum, fast_quorum
from torchpass_p2p.core.plan import Plan

from .cluster import Cluster, SimMember


class SafetyChecker:
    """Checks agreement safety on every event of ``cluster``; attach before running."""

    def __init__(self, cluster: Cluster, *, max_kept: int = 100) -> None:
        self.cluster = cluster
        self.max_kept = max_kept
        self.violations: list[str] = []
        self.count = 0
        self.decisions = 0
        self.configurations: dict[int, Configuration] = {0: cluster.configuration}
        self.plans: dict[int, Plan] = {}
        """config_id -> the plan of its first decision (members of one simulation share plan
        objects, so the hash is compared only when the object differs)."""
        self.ready: dict[int, Plan] = {}
        self.first_round: dict[int, int] = {}
        """config_id -> the round of the first decision of it anywhere (0: fast path)."""
        self.decided_at: dict[int, float] = {}
        self.empty_changes = 0
        """Distinct configurations decided that removed nobody and admitted nobody."""
        self._holds: dict[MemberId, int] = {}
        self._one_rank_checked: tuple[Configuration, bool] | None = None  # last config, verdict
        cluster.listeners.append(self)

    @property
    def ok(self) -> bool:
        return self.count == 0

    def fast_path_fraction(self) -> float | None:
        """Decided changes whose first decision came from the fast round; None if none."""
        if not self.first_round:
            return None
        fast = sum(1 for r in self.first_round.values() if r == 0)
        return fast / len(self.first_round)

    def _fail(self, rule: str, text: str) -> None:
        self.count += 1
        if len(self.violations) < self.max_kept:
            self.violations.append(f"[{rule}] {text}")

    def __call__(self, sm: SimMember, event: ev.Event) -> None:
        if isinstance(event, ev.ConfigurationDecided):
            self._decided(sm, event)
        elif isinstance(event, ev.PlanReady):
            plan = event.plan
            known = self.ready.setdefault(plan.config_id, plan)
            if known is not plan and known.hash != plan.hash:
                self._fail("same-plan", f"t={event.at:.3f} #{sm.index} holds plan {plan.hash:x} "
                                        f"for {plan.config_id}, others {known.hash:x}")

    def _decided(self, sm: SimMember, event: ev.ConfigurationDecided) -> None:
        self.decisions += 1
        config, plan = event.configuration, event.plan
        cid = config.config_id
        who = f"t={event.at:.3f} #{sm.index} config {cid}"
        known = self.plans.setdefault(cid, plan)
        if known is not plan and known.hash != plan.hash:
            self._fail("one-decision", f"{who}: plan {plan.hash:x}, others decided "
                                       f"{known.hash:x}")
        if cid not in self.configurations:
            self.configurations[cid] = config
            self.first_round[cid] = event.round
            self.decided_at[cid] = event.at
            if not plan.removed and not plan.joined:
                self.empty_changes += 1
                self._fail("no-empty", f"{who} removes nobody and admits nobody")
        held = self._holds.get(sm.id)
        if held is None:
            held = self._initial(sm)
        if plan.previous_config_id != held or cid != held + 1:
            self._fail("same-sequence", f"{who} follows {plan.previous_config_id}, but it held "
                                        f"{held}")
        self._holds[sm.id] = cid
        previous = self.configurations.get(plan.previous_config_id)
        if previous is not None:
            n = len(previous)
            need = fast_quorum(n) if event.round == 0 else classic_quorum(n)
            if event.votes < need:
                self._fail("quorum", f"{who} decided in round {event.round} on {event.votes} "
                                     f"votes of {n}; needs {need}")
        if not self._one_rank(config):
            self._fail("one-rank", f"{who}: ranks {config.ranks}, spares {config.spares}")

    def _one_rank(self, config: Configuration) -> bool:
        """Whether no member holds two ranks, no rank is held twice and no spare holds a rank.
        A walk over every rank: done once per configuration object (members that decide the
        same change share it), not once per member (16k members: 16k walks of 16k ranks)."""
        checked = self._one_rank_checked
        if checked is not None and checked[0] is config:
            return checked[1]
        holders = [m for m in config.ranks if m is not None]
        ok = len(set(holders)) == len(holders) and not set(holders) & set(config.spares)
        self._one_rank_checked = (config, ok)
        return ok

    def _initial(self, sm: SimMember) -> int:
        # A member that never decided holds the configuration it started in: 0, or for a
        # joiner the one it joined from (the cluster records it).
        return self.cluster.started_in.get(sm.id, 0)
