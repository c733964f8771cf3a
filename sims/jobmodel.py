"""A training-step model on top of a simulated fleet: how long a fault stalls training.

The ranks of ``cluster.configuration.ranks`` run a synchronous data-parallel loop (docs/design.md
section 6). Every step each rank computes for ``step_time_s`` x its slowdown x a small seeded
jitter, then all ranks meet in an all-reduce: the step completes when the last rank finished
computing, plus ``allreduce_s``. The all-reduce needs every rank of the world, so it cannot
complete while a rank is crashed, removed, left, or cut off by the network (deaf, mute, clogged,
or a cut link to another rank); it waits, and completes as soon as that ends (a clog that lifts).

Replacement follows the agreement layer: the world is the ranks of the newest configuration any
member decided. The first decision of a new configuration abandons the step in flight (the commit
rule redoes it, docs/design.md section 6); the new world trains ``replace_s`` after every one of its
rank holders holds that configuration (group rebuild and state transfer). A vacant rank (no spare
left, policy ``wait``) keeps the job waiting.

Stragglers: each rank's figures of a step (its compute time, and its wait in the all-reduce:
from its own arrival to the slowest rank's plus ``allreduce_s``), which the runtime carries in
the commit vote, go through :class:`torchpass_p2p.core.straggler.StragglerDetector`. With
``policy="migrate"`` a flagged rank leaves gracefully at the next step boundary, so agreement
hands its rank to a spare (proactive: the slow member is its own state source, docs/design.md
section 4).

Times are virtual seconds of the cluster's engine; nothing here reads a clock.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from torchpass_p2p.core import MemberId
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.straggler import Arrival, StragglerDetector, StragglerNamed

from .cluster import Cluster, SimMember

POLICIES = ("report", "migrate")


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One completed step: when it began and ended, and each rank's compute seconds."""

    step: int
    started_at: float
    ended_at: float
    compute_s: tuple[float, ...]
    """[world_size] seconds, by rank."""


@dataclass(slots=True)
class Replacement:
    """A rank handed from ``old`` to ``new`` by a decided configuration (None: no spare was
    left, the rank is vacant)."""

    rank: int
    old: MemberId
    new: MemberId | None
    reason: str
    """``"migrate"``: the straggler policy moved it; ``"left"``: it left on its own;
    ``"dead"``: agreement removed it as failed."""
    config_id: int
    """The decided configuration that made the change."""
    decided_at: float
    """When the first member decided it."""
    ready_at: float | None = None
    """When the new world trained again (None: not yet)."""


@dataclass(slots=True)
class _Slow:
    start: float
    factor: float
    ramp_s: float

    def at(self, t: float) -> float:
        if t <= self.start:
            return 1.0
        frac = 1.0 if self.ramp_s <= 0 else min(1.0, (t - self.start) / self.ramp_s)
        return 1.0 + (self.factor - 1.0) * frac


class TrainingJob:
    """Synchronous training on ``cluster``'s ranks, driven by the cluster's engine.

    Args:
        cluster: the fleet; its ranks train, its spares wait.
        step_time_s: nominal compute time of one step on a healthy rank (seconds).
        replace_s: from the decision to replace a rank until the job trains again: group
            rebuild plus state transfer (seconds; docs/design.md section 13 measured a 4-rank gloo
            group re-forming in ~0.2 s after a kill, state transfer of a large model takes longer).
        allreduce_s: the all-reduce after the slowest rank finished (seconds).
        jitter: each step's compute time is scaled by a uniform draw in [1 - jitter, 1 + jitter]
            (seeded from the cluster's seed, not its generator, so adding a job does not change
            the membership trace).
        straggler_factor, straggler_window, straggler_hits: the detector's rule
            (:mod:`torchpass_p2p.core.straggler`).
        policy: ``"report"`` (flag only) or ``"migrate"`` (flagged ranks move to a spare).
        start_at: when step 0 begins (seconds).
        poll_s: how often a stalled all-reduce rechecks whether it can complete (seconds); the
            resolution of stalls that end without a replacement.

    Raises:
        ValueError: an unknown policy or a non-positive step time.
    """

    def __init__(
        self,
        cluster: Cluster,
        step_time_s: float,
        *,
        replace_s: float = 5.0,
        allreduce_s: float = 0.0,
        jitter: float = 0.0,
        straggler_factor: float = 1.5,
        straggler_window: int = 10,
        straggler_hits: int = 8,
        policy: str = "report",
        start_at: float = 0.0,
        poll_s: float = 0.05,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not step_time_s > 0:
            raise ValueError("step_time_s must be positive")
        self.cluster = cluster
        self.step_time_s = step_time_s
        self.replace_s = replace_s
        self.allreduce_s = allreduce_s
        self.jitter = jitter
        self.policy = policy
        self.poll_s = poll_s
        self.detector = StragglerDetector(factor=straggler_factor, window=straggler_window,
                                          hits=straggler_hits)
        self.world: list[MemberId | None] = list(cluster.configuration.ranks)
        self.spares: list[MemberId] = list(cluster.configuration.spares)
        self.step = 0
        """The step being computed (= steps completed so far)."""
        self.history: list[StepRecord] = []
        self.replacements: list[Replacement] = []
        self.flags: list[tuple[float, int, StragglerNamed]] = []
        """(time, rank, verdict) for every straggler named."""
        self.faults: list[tuple[float, str]] = []
        """(time, label) of the faults :meth:`slow` injected; see :meth:`stalls`."""
        self._rng = random.Random(f"jobmodel-{cluster.seed}")
        self._slow: dict[MemberId, _Slow] = {}
        self._epoch = 0
        self._started_at = start_at
        self._compute: tuple[float, ...] = ()
        self.config_id = cluster.configuration.config_id
        """The newest configuration any member decided."""
        self._world_config = self.config_id  # the one that last changed the world
        self._waiting = False  # a decided world is re-forming its group
        self._migrating: set[MemberId] = set()
        cluster.listeners.append(self._on_event)
        cluster.at(start_at, lambda: self._start_step(cluster.now))

    # ------------------------------------------------------------------ faults

    def slow(self, sm: SimMember, at: float, factor: float = 3.0, ramp_s: float = 180.0) -> None:
        """From ``at`` on, ``sm``'s compute time ramps linearly to ``factor`` x nominal over
        ``ramp_s`` seconds and stays there (thermal throttling: no error, just slower)."""
        self._slow[sm.id] = _Slow(at, factor, ramp_s)
        self.cluster.at(at, lambda: self.faults.append((at, f"slow #{sm.index}")))

    def slowdown(self, member: MemberId, t: float) -> float:
        """``member``'s compute-time multiplier at time ``t``."""
        slow = self._slow.get(member)
        return 1.0 if slow is None else slow.at(t)

    # ------------------------------------------------------------------ the step loop

    def _start_step(self, now: float) -> None:
        self._epoch += 1
        epoch = self._epoch
        self._started_at = now
        jitter = self.jitter
        rng = self._rng
        compute = []
        for member in self.world:
            scale = 1.0 + jitter * (2.0 * rng.random() - 1.0) if jitter else 1.0
            # A vacant rank (a decision before ``start_at`` can leave one) runs at nominal
            # speed: _finish waits for it to be filled anyway.
            slow = 1.0 if member is None else self.slowdown(member, now)
            compute.append(self.step_time_s * slow * scale)
        self._compute = tuple(compute)
        end = now + max(compute) + self.allreduce_s
        self.cluster.at(end, lambda: self._finish(epoch))

    def _finish(self, epoch: int) -> None:
        if epoch != self._epoch:
            return  # abandoned: a replacement restarted the step
        now = self.cluster.now
        world: list[MemberId] = []
        for member in self.world:
            if member is None or not self._can_train(member):  # vacant or stalled
                self.cluster.at(now + self.poll_s, lambda: self._finish(epoch))
                return
            world.append(member)
        self.history.append(StepRecord(self.step, self._started_at, now, self._compute))
        for member in world:  # the commit all-reduce completed on every rank
            self.cluster.by_id[member].core.report_progress(self.step)
        end = max(self._compute) + self.allreduce_s
        arrivals = {m: Arrival(rank, c, end - c)
                    for rank, (m, c) in enumerate(zip(world, self._compute, strict=True))}
        verdicts = self.detector.observe(self.step, arrivals)
        self.step += 1
        for flag in verdicts:
            if not isinstance(flag, StragglerNamed):
                continue
            rank = self.world.index(flag.member)
            self.flags.append((now, rank, flag))
            if self.policy == "migrate" and flag.member not in self._migrating:
                self._migrating.add(flag.member)
                self.cluster.leave(self.cluster.by_id[flag.member])
        self._start_step(now)

    # ------------------------------------------------------------------ replacement

    def _on_event(self, sm: SimMember, event: ev.Event) -> None:
        if type(event) is not ev.ConfigurationDecided:
            return
        config = event.configuration
        if config.config_id <= self.config_id:
            return
        self.config_id = config.config_id
        if list(config.ranks) == self.world:
            return  # the world is unchanged (spares only, or an empty cut): keep training
        # The first member to decide leaves the old group: the step in flight is abandoned.
        self._epoch += 1
        self._world_config = config.config_id
        for rank, new in enumerate(config.ranks):
            old = self.world[rank] if rank < len(self.world) else None
            if new != old and old is not None:
                reason = ("migrate" if old in self._migrating
                          else "left" if self.cluster.by_id[old].core.left else "dead")
                self.replacements.append(Replacement(rank, old, new, reason, config.config_id,
                                                     event.at))
        self.world = list(config.ranks)
        self.spares = list(config.spares)
        self._waiting = True
        self._await_world(config.config_id)

    def _await_world(self, config_id: int) -> None:
        """Train again ``replace_s`` after every rank holder holds ``config_id``."""
        if config_id != self._world_config:
            return  # a newer world superseded this one
        ready = all(m is not None and self._can_train(m)
                    and self.cluster.by_id[m].core.configuration.config_id >= config_id
                    for m in self.world)
        if not ready:
            self.cluster.at(self.cluster.now + self.poll_s, lambda: self._await_world(config_id))
            return

        def resume() -> None:
            if config_id != self._world_config:
                return
            self._waiting = False
            now = self.cluster.now
            for rec in self.replacements:
                if rec.config_id == config_id and rec.ready_at is None:
                    rec.ready_at = now
            self._start_step(now)

        self.cluster.at(self.cluster.now + self.replace_s, resume)

    def _can_train(self, member: MemberId | None) -> bool:
        if member is None:
            return False  # a vacant rank: the job waits for a spare
        sm = self.cluster.by_id[member]
        if sm.crashed or sm.core.removed or sm.core.left or sm.core.fenced:
            return False
        net = self.cluster.network
        if member in net.deaf or member in net.mute or member in net.clogged:
            return False
        if net.cut:
            world = self.world
            return not any((a == member and b in world) or (b == member and a in world)
                           for a, b in net.cut)
        return True

    # ------------------------------------------------------------------ reports

    def completions(self) -> list[float]:
        """End time of every completed step, in step order."""
        return [rec.ended_at for rec in self.history]

    def stalls(self, faults: Iterable[tuple[float, object]] | None = None) -> list[
            tuple[float, str, float | None]]:
        """Seconds of training each fault cost: from the fault to the first step completed
        after it, minus one nominal step (a fault that costs nothing still waits for the step in
        flight; clamped at zero). None: no step completed after it.

        ``faults``: (time, label) pairs, e.g. a FaultInjector's ``log`` (its third field is a
        member index) or this job's own :attr:`faults` (the default).
        """
        ends = self.completions()
        out: list[tuple[float, str, float | None]] = []
        for item in (self.faults if faults is None else faults):
            at, label = item[0], " ".join(str(x) for x in item[1:])
            after = next((t for t in ends if t > at), None)
            stall = None if after is None else max(0.0, after - at - self.step_time_s)
            out.append((at, label, stall))
        return out

    def summary(self, horizon_s: float | None = None) -> dict[str, object]:
        """Plain numbers for a report: steps, nominal steps, replacements, flags."""
        horizon = self.cluster.now if horizon_s is None else horizon_s
        return {
            "steps": self.step,
            "nominal_steps": int(horizon // self.step_time_s),
            "replacements": [(r.rank, r.config_id, round(r.decided_at, 3)) for r in
                             self.replacements],
            "straggler_flags": [(rank, f.step, round(t, 3)) for t, rank, f in self.flags],
            "stalls_s": [(round(at, 3), label, None if s is None else round(s, 3))
                         for at, label, s in self.stalls()],
        }
