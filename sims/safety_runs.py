"""Seeded agreement-safety runs: one seed draws a cluster, a lossy link and a mix of faults.

Issue 4: safety is checked after every simulated event, over many seeds. :func:`safety_run` builds
a :class:`~sims.cluster.Cluster` of real cores from one seed, attaches the
:class:`~sims.safety.SafetyChecker` (at most one decision per ``config_id``, the same sequence of
configurations everywhere, quorum certificates, one rank per member) and the
:class:`~sims.invariants.InvariantChecker`, injects faults at random virtual times, heals
everything and lets the cluster settle. It adds one rule of its own, checked per partition:

* [minority-decided] a member on a side that held fewer than a majority of the configuration
  live at the moment of the cut installs, during the cut, only configurations that some member
  off that side installs too (a decision whose last votes were already in flight at the cut, or
  that some member had installed before the cut, is fine; one the side reached on its own is
  not).

What one seed draws (all from ``random.Random(f"safety_run:{seed}")``; the cluster's own
randomness comes from ``seed``):

======================  ========================================================================
cluster                 8..24 members (or ``members``), 1..3 of them spares
link                    loss 0..5 %, duplication 0..5 %, latency jitter 0.2..5 ms (reordering)
crash_many              1..min(10, members // 3) members crash within 50 ms of each other
crash_promoted_spare    a rank holder crashes; the first spare promoted after it crashes at the
                        moment it learns its rank (``RankAssigned``)
crash_in_agreement      a member crashes; a second one crashes the moment the first fast vote
                        is cast (``votes_cast`` counter) or the first member decides
halves                  symmetric partition of the live members into halves for 3..12 s
one_way                 a group's datagrams to the rest are dropped (not the reverse), 2..10 s
flapping                a random split is cut and healed 3..6 times, 1..3 s each
======================  ========================================================================

Each fault is drawn with probability one half (at least one per seed). Partitions take disjoint
slots of the fault window, so each cut period has well-defined sides; crashes fall anywhere in
it. At ``fault_window_s`` every link is healed and the run goes on for ``settle_s``.

Liveness is reported, not required: ``converged`` says whether every live, non-removed member
ended in the same configuration; ``majority_lost`` says a partition left no side with a majority
(then the cluster may legitimately stall or drop half its members).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from torchpass_p2p.core import Configuration, MemberId
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.agreement import classic_quorum
from torchpass_p2p.core.plan import Plan

from .cluster import Cluster, SimMember
from .invariants import InvariantChecker
from .network import LinkModel
from .safety import SafetyChecker

FAULT_KINDS = ("crash_many", "crash_promoted_spare", "crash_in_agreement", "halves", "one_way",
               "flapping")

MEMBERS_RANGE = (8, 24)
"""Cluster sizes a seed draws from (inclusive): small enough for 10,000 seeds in hours on two
cores, large enough for 10 simultaneous crashes (members // 3) at the top."""

FAULT_WINDOW_S = 40.0
"""Virtual seconds during which faults happen; every link heals at the end."""

SETTLE_S = 20.0
"""Virtual seconds run after the final heal (two anti-entropy intervals)."""

MAX_SIMULTANEOUS_CRASHES = 10
"""Issue 4: "up to 10 simultaneous failures"."""

CRASH_SPREAD_S = 0.05
"""Simultaneous crashes fall within this many seconds of each other ("nearly" at once)."""

VOTE_POLL_S = 0.005
"""How often crash_in_agreement looks at the votes_cast counters (seconds); votes go out at most
every ``vote_push_interval_s`` = 10 ms, so 5 ms catches a change in its first push."""

VOTE_WAIT_S = 15.0
"""crash_in_agreement gives up waiting for a vote after this long (seconds)."""


@dataclass(frozen=True, slots=True)
class SafetyResult:
    """Outcome of one seed. ``violations`` holds the first messages of every checker."""

    seed: int
    members: int
    spares: int
    loss: float
    duplicate: float
    jitter_s: float
    faults: tuple[str, ...]
    """What happened, in time order (``t=12.345 crash_many #3,#7``)."""
    decisions: int
    """Distinct configurations decided (changes), not member-level decision events."""
    fast_path_fraction: float | None
    safety_violations: int
    """SafetyChecker violations plus [minority-decided] ones."""
    violations: tuple[str, ...]
    invariant_violations: int
    final_config_ids: tuple[int, ...]
    """config_id held by each live, non-removed member at the end, sorted."""
    converged: bool
    majority_lost: bool
    events: int
    wall_s: float
    """Wall-clock seconds of the run (for scale only; everything else is virtual)."""

    @property
    def ok(self) -> bool:
        return self.safety_violations == 0 and self.invariant_violations == 0


@dataclass(slots=True)
class _Cut:
    """One symmetric partition period and its sides."""

    start: float
    sides: tuple[frozenset[MemberId], frozenset[MemberId]]
    minority: tuple[bool, bool]
    end: float = float("inf")
    votes: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] = field(default_factory=dict)
    """(config_id, removed, joined) -> members that had voted that cut when the cut began
    (a crashed member's vote counts: it was cast before it crashed)."""


@dataclass(slots=True)
class _Decision:
    member: MemberId
    at: float
    config_id: int
    plan: Plan


@dataclass(slots=True)
class _Watch:
    """Run-time hooks: decisions by member, and the one-shot crash triggers."""

    decisions: list[_Decision] = field(default_factory=list)
    on_rank: list[Callable[[SimMember, ev.RankAssigned], None]] = field(default_factory=list)
    on_decided: list[Callable[[SimMember, ev.ConfigurationDecided], None]] = field(
        default_factory=list)

    def __call__(self, sm: SimMember, event: ev.Event) -> None:
        kind = type(event)
        if kind is ev.ConfigurationDecided:
            assert isinstance(event, ev.ConfigurationDecided)
            self.decisions.append(_Decision(sm.id, event.at, event.configuration.config_id,
                                            event.plan))
            for hook in list(self.on_decided):
                hook(sm, event)
        elif kind is ev.RankAssigned:
            assert isinstance(event, ev.RankAssigned)
            for rank_hook in list(self.on_rank):
                rank_hook(sm, event)


class _SafetyRun:
    def __init__(self, seed: int, members: int | None, members_range: tuple[int, int],
                 fault_window_s: float, settle_s: float, kinds: tuple[str, ...] | None) -> None:
        rng = self.rng = random.Random(f"safety_run:{seed}")
        self.seed = seed
        self.n = members if members is not None else rng.randint(*members_range)
        if self.n < 4:
            raise ValueError("a safety run needs at least 4 members")
        self.spares = rng.randint(1, min(3, self.n - 3))
        self.loss = round(rng.uniform(0.0, 0.05), 4)
        self.duplicate = round(rng.uniform(0.0, 0.05), 4)
        self.jitter_s = round(rng.uniform(0.0002, 0.005), 5)
        self.fault_window_s = fault_window_s
        self.settle_s = settle_s
        link = LinkModel(jitter_s=self.jitter_s, loss=self.loss, duplicate=self.duplicate)
        self.cluster = Cluster(self.n, spares=self.spares, seed=seed, link=link,
                               keep_events=False)
        self.safety = SafetyChecker(self.cluster, max_kept=10)
        self.invariants = InvariantChecker(self.cluster, max_kept=10)
        self.watch = _Watch()
        self.cluster.listeners.append(self.watch)
        self.log: list[str] = []
        self.cuts: list[_Cut] = []
        self.majority_lost = False
        if kinds is None:
            kinds = (tuple(k for k in FAULT_KINDS if rng.random() < 0.5)
                     or (rng.choice(FAULT_KINDS),))
        self.kinds = kinds

    # ------------------------------------------------------------------ helpers

    def _note(self, text: str) -> None:
        self.log.append(f"t={self.cluster.now:.3f} {text}")

    def _names(self, sms: list[SimMember]) -> str:
        return ",".join(f"#{sm.index}" for sm in sms)

    def _crash(self, sm: SimMember, why: str) -> None:
        if not sm.crashed:
            self._note(f"{why} #{sm.index}")
            self.cluster.crash(sm)

    def _live(self) -> list[SimMember]:
        return self.cluster.live()

    def _current_config(self) -> Configuration:
        """The configuration most live members hold (ties: the newest)."""
        live = self._live()
        if not live:
            return self.cluster.configuration
        tally = Counter(sm.core.configuration.config_id for sm in live)
        best = max(tally, key=lambda cid: (tally[cid], cid))
        return next(sm.core.configuration for sm in live
                    if sm.core.configuration.config_id == best)

    # ------------------------------------------------------------------ faults

    def schedule(self) -> None:
        rng = self.rng
        window = self.fault_window_s
        partitions = [k for k in self.kinds if k in ("halves", "one_way", "flapping")]
        rng.shuffle(partitions)
        # Disjoint slots for the partitions, so each cut period has clear sides.
        slot = (window - 2.0) / max(1, len(partitions))
        for i, kind in enumerate(partitions):
            lo = 1.0 + i * slot
            if kind == "halves":
                span = min(rng.uniform(3.0, 12.0), slot - 0.5)
                start = lo + rng.uniform(0.0, max(0.0, slot - span - 0.5))
                self.cluster.at(start, partial(self._halves, span))
            elif kind == "one_way":
                span = min(rng.uniform(2.0, 10.0), slot - 0.5)
                start = lo + rng.uniform(0.0, max(0.0, slot - span - 0.5))
                self.cluster.at(start, partial(self._one_way, span))
            else:
                flaps = rng.randint(3, 6)
                t = lo
                frac = rng.uniform(0.25, 0.75)
                for _ in range(flaps):
                    cut_s, heal_s = rng.uniform(1.0, 3.0), rng.uniform(1.0, 3.0)
                    if t + cut_s > lo + slot - 0.5:
                        break
                    self.cluster.at(t, partial(self._split, frac, cut_s, "flap"))
                    t += cut_s + heal_s
        if "crash_many" in self.kinds:
            self.cluster.at(rng.uniform(1.0, window - 5.0), self._crash_many)
        if "crash_promoted_spare" in self.kinds:
            self.cluster.at(rng.uniform(1.0, window - 10.0), self._crash_rank_holder)
        if "crash_in_agreement" in self.kinds:
            self.cluster.at(rng.uniform(1.0, window - 10.0), self._crash_then_in_agreement)
        self.cluster.at(window, self._heal_all)

    def _crash_many(self) -> None:
        live = self._live()
        if not live:
            return
        k = self.rng.randint(1, min(MAX_SIMULTANEOUS_CRASHES, max(1, self.n // 3), len(live)))
        victims = self.rng.sample(live, k)
        self._note(f"crash_many k={k} {self._names(victims)}")
        now = self.cluster.now
        for sm in victims:
            self.cluster.at(now + self.rng.uniform(0.0, CRASH_SPREAD_S),
                            partial(self.cluster.crash, sm))

    def _crash_rank_holder(self) -> None:
        holders = [sm for sm in self._live()
                   if sm.core.configuration.rank_of(sm.id) is not None]
        if not holders:
            return
        victim = self.rng.choice(holders)
        fired = False

        def on_rank(sm: SimMember, event: ev.RankAssigned) -> None:
            nonlocal fired
            if fired:
                return
            fired = True
            self.watch.on_rank.remove(on_rank)
            # After the event drains (a crash inside the drain would make the events that
            # follow in the same call look like a crashed member's).
            self.cluster.at(self.cluster.now,
                            lambda: self._crash(sm, f"crash_promoted_spare rank={event.rank}"))

        self.watch.on_rank.append(on_rank)
        self._crash(victim, "crash_rank_holder")

    def _crash_then_in_agreement(self) -> None:
        live = self._live()
        if len(live) < 3:
            return
        first = self.rng.choice(live)
        self._crash(first, "crash_before_agreement")
        if self.rng.random() < 0.5:
            self._crash_at_first_vote()
        else:
            self._crash_at_first_decision()

    def _crash_at_first_vote(self) -> None:
        cluster = self.cluster
        baseline = sum(sm.core.counters["votes_cast"] for sm in cluster.members)
        give_up = cluster.now + VOTE_WAIT_S

        def poll() -> None:
            votes = sum(sm.core.counters["votes_cast"] for sm in cluster.members
                        if not sm.crashed)
            if votes > baseline:
                live = self._live()
                if live:
                    self._crash(self.rng.choice(live), "crash_at_first_vote")
            elif cluster.now < give_up:
                cluster.at(cluster.now + VOTE_POLL_S, poll)

        cluster.at(cluster.now + VOTE_POLL_S, poll)

    def _crash_at_first_decision(self) -> None:
        target = self._current_config().config_id + 1

        def on_decided(sm: SimMember, event: ev.ConfigurationDecided) -> None:
            if event.configuration.config_id != target:
                return
            self.watch.on_decided.remove(on_decided)
            # A member that has not decided yet: it holds the older configuration.
            behind = [m for m in self._live() if m is not sm
                      and m.core.configuration.config_id < target]
            if behind:
                victim = self.rng.choice(behind)
                self.cluster.at(self.cluster.now,
                                lambda: self._crash(victim, "crash_at_first_decision"))

        self.watch.on_decided.append(on_decided)

    def _halves(self, span_s: float) -> None:
        self._split(0.5, span_s, "halves")

    def _split(self, fraction: float, span_s: float, what: str) -> None:
        """Cut the members (every process not crashed) in two, ``fraction`` on side A."""
        alive = [sm for sm in self.cluster.members if not sm.crashed]
        if len(alive) < 2:
            return
        self.rng.shuffle(alive)
        k = min(len(alive) - 1, max(1, round(len(alive) * fraction)))
        a, b = alive[:k], alive[k:]
        config = self._current_config()
        need = classic_quorum(len(config))
        strength = [sum(1 for sm in side if sm.id in config and not sm.core.removed)
                    for side in (a, b)]
        minority = (strength[0] < need, strength[1] < need)
        if all(minority):
            self.majority_lost = True
        self._note(f"{what} {len(a)}|{len(b)} of config {config.config_id} "
                   f"(strength {strength[0]}|{strength[1]}, need {need}) for {span_s:.2f} s")
        ids_a, ids_b = [sm.id for sm in a], [sm.id for sm in b]
        self.cluster.network.partition(ids_a, ids_b)
        cut = _Cut(self.cluster.now, (frozenset(ids_a), frozenset(ids_b)), minority)
        for sm in self.cluster.members:
            consensus = sm.core._consensus  # the checker reads the cores' state, never writes
            voted = consensus.voted_cut
            if voted is not None:
                key = (consensus.config_id, voted.removed, tuple(j.member for j in voted.joined))
                cut.votes[key] = cut.votes.get(key, 0) + 1
        self.cuts.append(cut)

        def heal() -> None:
            cut.end = self.cluster.now
            net = self.cluster.network
            for x in ids_a:
                for y in ids_b:
                    net.cut.discard((x, y))
                    net.cut.discard((y, x))
            self._note(f"{what} healed")

        self.cluster.at(self.cluster.now + span_s, heal)

    def _one_way(self, span_s: float) -> None:
        alive = [sm for sm in self.cluster.members if not sm.crashed]
        if len(alive) < 2:
            return
        self.rng.shuffle(alive)
        k = self.rng.randint(1, max(1, len(alive) // 2))
        a, b = [sm.id for sm in alive[:k]], [sm.id for sm in alive[k:]]
        self._note(f"one_way {self._names(alive[:k])} -> the other {len(b)} dropped for "
                   f"{span_s:.2f} s")
        net = self.cluster.network
        pairs = [(x, y) for x in a for y in b]
        net.cut.update(pairs)

        def heal() -> None:
            net.cut.difference_update(pairs)
            self._note("one_way healed")

        self.cluster.at(self.cluster.now + span_s, heal)

    def _heal_all(self) -> None:
        self.cluster.network.heal()
        for cut in self.cuts:
            cut.end = min(cut.end, self.cluster.now)
        self._note("heal_all")

    # ------------------------------------------------------------------ the checks

    def check_sides(self) -> list[str]:
        """[minority-decided]: see the module docstring."""
        out = []
        by_key: dict[tuple[int, int], set[MemberId]] = {}
        first_at: dict[tuple[int, int], float] = {}
        for d in self.watch.decisions:
            key = (d.config_id, d.plan.hash)
            by_key.setdefault(key, set()).add(d.member)
            first_at[key] = min(first_at.get(key, d.at), d.at)
        for cut in self.cuts:
            for side, minority in zip(cut.sides, cut.minority, strict=True):
                if not minority:
                    continue
                for d in self.watch.decisions:
                    if d.member not in side or not cut.start <= d.at <= cut.end:
                        continue
                    if first_at[(d.config_id, d.plan.hash)] < cut.start:
                        continue  # decided before the cut; this member learned it during it
                    elsewhere = by_key[(d.config_id, d.plan.hash)] - side
                    # Legitimate if a quorum of the previous configuration had voted this
                    # cut before the partition began: its bits were already in flight.
                    cut_key = (d.config_id - 1, d.plan.removed, d.plan.joined)
                    before = cut.votes.get(cut_key, 0)
                    previous = self.safety.configurations.get(d.config_id - 1)
                    in_flight = previous is not None and before >= classic_quorum(len(previous))
                    if not elsewhere and not in_flight:
                        sm = self.cluster.by_id[d.member]
                        out.append(f"[minority-decided] t={d.at:.3f} #{sm.index} installed "
                                   f"config {d.config_id} on a minority side of the cut at "
                                   f"t={cut.start:.3f}; nobody off that side installed it")
        return out

    def run(self) -> SafetyResult:
        started = time.perf_counter()
        self.schedule()
        self.cluster.run(self.fault_window_s + self.settle_s)
        side = self.check_sides()
        live = [sm for sm in self.cluster.members if not sm.crashed and not sm.core.removed
                and sm.core.joining is None]
        final = tuple(sorted(sm.core.configuration.config_id for sm in live))
        fast = self.safety.fast_path_fraction()
        return SafetyResult(
            seed=self.seed,
            members=self.n,
            spares=self.spares,
            loss=self.loss,
            duplicate=self.duplicate,
            jitter_s=self.jitter_s,
            faults=tuple(self.log),
            decisions=len(self.safety.first_round),
            fast_path_fraction=None if fast is None else round(fast, 4),
            safety_violations=self.safety.count + len(side),
            violations=tuple(self.safety.violations + side[:10] + self.invariants.violations),
            invariant_violations=self.invariants.count,
            final_config_ids=final,
            converged=bool(final) and len(set(final)) == 1,
            majority_lost=self.majority_lost,
            events=self.cluster.engine.events,
            wall_s=round(time.perf_counter() - started, 3),
        )


def safety_run(seed: int, *, members: int | None = None,
               members_range: tuple[int, int] = MEMBERS_RANGE,
               fault_window_s: float = FAULT_WINDOW_S, settle_s: float = SETTLE_S,
               kinds: tuple[str, ...] | None = None) -> SafetyResult:
    """One seeded safety run (see the module docstring for what the seed draws).

    Args:
        seed: fixes everything: cluster, link, faults and their times.
        members: cluster size; None draws it from ``members_range`` (inclusive).
        members_range: the sizes drawn when ``members`` is None.
        fault_window_s: virtual seconds during which faults happen; every link heals at its end.
        settle_s: virtual seconds run after the heal.
        kinds: the faults to inject (names from :data:`FAULT_KINDS`); None draws them.

    Raises:
        ValueError: ``members`` below 4, or an unknown fault kind.
    """
    if kinds is not None and any(k not in FAULT_KINDS for k in kinds):
        raise ValueError(f"unknown fault kind in {kinds}; known: {FAULT_KINDS}")
    return _SafetyRun(seed, members, members_range, fault_window_s, settle_s, kinds).run()
