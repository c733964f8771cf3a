"""The job-level event model: one training job over weeks of virtual time, one method.

The job must do ``job.work_s`` seconds of plain-DDP work. Wall time advances from event to event
(a failure, the end of a checkpoint write or of a recovery phase, failed hardware returning to
the spare pool, a replica group coming back); between events the job is in one mode:

* ``run``: progress at ``active / ratio`` work-seconds per wall second (``ratio``: the method's
  fault-free step time over plain DDP's; ``active``: the fraction of replica groups training);
* ``write``: a blocking checkpoint write;
* ``down``: a recovery, a list of phases run in order (detection, decision, waiting for spares,
  restart, transfer, rejoin).

Accounting, which must stay exact (the tests check it): ``wall = work + sum(lost)``. Wall time
in ``run`` that made no progress is lost to ``step_overhead`` (the ratio) or ``degraded`` (groups
out); progress undone by a failure is lost to ``lost_work`` (back to the last checkpoint) or
``redo`` (back to the start of the step in flight); ``write`` and each ``down`` phase count
under their own names. ``ettr = work / wall``.

A failure while the job is down starts its recovery again from that moment (Daly's model for
restarts; conservative for a rank replacement, whose second decision could overlap the first
transfer). Failed hardware leaves for ``job.repair_s`` and then joins the spare pool; a
recovery that needs more spares than the pool holds waits (``spare_wait``).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from .costs import Job, Method, transfer_s
from .failures import Failure, FailureModel
from .formulas import daly_interval

CAUSES = ("step_overhead", "degraded", "checkpoint_write", "lost_work", "redo", "detection",
          "decision", "spare_wait", "restart", "transfer", "rejoin")
"""Every name lost time is split by."""

_INF = math.inf


@dataclass(slots=True)
class RunResult:
    """One simulated job: its wall time and where the time went (seconds)."""

    method: str
    seed: int
    gpus: int
    work_s: float
    wall_s: float
    lost_s: dict[str, float]
    failures: dict[str, int]
    checkpoint_interval_s: float | None
    spares_min: int
    """The fewest spare GPUs the pool held at any moment."""

    @property
    def ettr(self) -> float:
        """Effective training time ratio: plain-DDP work over wall time."""
        return self.work_s / self.wall_s


@dataclass(slots=True)
class _State:
    t: float = 0.0
    done: float = 0.0
    ckpt: float = 0.0
    next_ckpt: float = _INF
    mode: str = "run"
    mode_end: float = _INF
    phases: list[tuple[str, float]] = field(default_factory=list)
    """Phases of the recovery still to run after the current one: (cause, seconds)."""
    phase: str = ""
    owed: int = 0
    """Spare GPUs the recovery in progress must take before it can go on."""
    pool: int = 0
    repairs: list[tuple[float, int]] = field(default_factory=list)
    groups_out: int = 0
    groups_back: list[float] = field(default_factory=list)
    groups_waiting: list[int] = field(default_factory=list)
    """Replica groups waiting for spares: the GPUs each needs."""


def checkpoint_interval(job: Job, method: Method, failures: FailureModel) -> float | None:
    """Compute seconds between checkpoints for ``method`` (None: it never checkpoints).

    The given ``method.restart.interval_s``, else Daly's optimum for the failures that send the
    job back to a checkpoint: all of them under checkpoint-restart; for the others, ``job``-scope
    failures only, unless no other rank holds a rank's state (then all of them).
    """
    if method.restart.interval_s is not None:
        return method.restart.interval_s
    if method.name == "checkpoint_restart" or job.state_holders < 2:
        rate = 1.0 / failures.mean_gap_s(job.gpus)
    else:
        rate = failures.scope_rate_per_s(job.gpus, "job")
    if rate <= 0:
        return None
    return daly_interval(method.restart.write.value, 1.0 / rate)


def simulate(job: Job, method: Method, failures: FailureModel, seed: int,
             max_wall_factor: float = 1000.0) -> RunResult:
    """Run ``job`` under ``method`` until its work is done; failures drawn with ``seed``.

    ``max_wall_factor``: give up (``wall_s`` = inf) past this many times the work; a job that
    loses more than it gains never finishes.
    """
    # The same seed draws the same failures for every method (common random numbers: the
    # methods' differences are less noisy than their values).
    stream = failures.stream(job.gpus, random.Random(f"fleetmodel-{seed}"))
    ratio = method.ratio
    tau = checkpoint_interval(job, method, failures)
    lost = dict.fromkeys(CAUSES, 0.0)
    counts = {"gpu": 0, "host": 0, "job": 0}
    s = _State(pool=job.spare_gpus)
    s.next_ckpt = _INF if tau is None else tau
    spares_min = s.pool
    groups = max(1, job.gpus // job.replica_group_gpus)
    write_s = method.restart.write.value
    limit = max_wall_factor * job.work_s
    fail: Failure = next(stream)

    def active() -> float:
        return max(0.0, 1.0 - s.groups_out / groups) if method.replica is not None else 1.0

    def start_phases(now: float) -> None:
        """Enter the next recovery phase (or run, when none is left)."""
        while True:
            if s.owed and s.pool >= s.owed:
                s.pool -= s.owed
                s.owed = 0
            if s.owed:
                s.mode, s.phase, s.mode_end = "down", "spare_wait", _INF
                return
            if not s.phases:
                s.mode, s.phase, s.mode_end = "run", "", _INF
                return
            cause, seconds = s.phases.pop(0)
            s.mode, s.phase, s.mode_end = "down", cause, now + seconds
            return

    def recover(now: float, phases: list[tuple[str, float]], spares: int) -> None:
        """Start a recovery whose spares are taken after its first phase."""
        s.owed += spares
        first, rest = phases[0], phases[1:]
        s.phases = rest
        s.mode, s.phase, s.mode_end = "down", first[0], now + first[1]

    def step_back(cause: str) -> None:
        """Undo the step in flight (never past the last checkpoint)."""
        start = max(s.ckpt, math.floor(s.done / job.step_s) * job.step_s)
        lost[cause] += s.done - start
        s.done = start

    def to_checkpoint() -> None:
        lost["lost_work"] += s.done - s.ckpt
        s.done = s.ckpt
        if tau is not None:
            s.next_ckpt = s.ckpt + tau

    def group_ready(now: float) -> None:
        """Start replica groups that waited for spares."""
        while s.groups_waiting and s.pool >= s.groups_waiting[0]:
            s.pool -= s.groups_waiting.pop(0)
            assert method.replica is not None
            back = now + method.replica.group_restart.value + transfer_s(job, None)
            heapq.heappush(s.groups_back, back)

    def on_failure(f: Failure) -> None:
        counts[f.scope] += 1
        gpus = {"gpu": 1, "host": job.gpus_per_host, "job": 0}[f.scope]
        if gpus:
            heapq.heappush(s.repairs, (f.at_s + job.repair_s, gpus))
        restart = method.restart
        restart_phases = [("detection", restart.detection.value),
                          ("restart", restart.restart.value)]
        in_memory = f.scope != "job" and job.state_holders >= 2
        if method.torchpass is not None and in_memory:
            if s.mode != "down":
                step_back("redo")
            tp = method.torchpass
            recover(f.at_s, [("decision", tp.decided.at(job.gpus, f.scope)),
                             ("transfer", transfer_s(job, tp.receiver)),
                             ("rejoin", tp.rejoin.value)], gpus)
        elif method.replica is not None and in_memory:
            s.groups_out = min(groups, s.groups_out + 1)
            s.groups_waiting.append(gpus)
            group_ready(f.at_s)
            if s.mode == "down":
                return  # the job is already stopped; the group recovers on its own
            step_back("redo")
            recover(f.at_s, [("detection", method.replica.heartbeat_timeout.value)], 0)
        else:
            to_checkpoint()
            recover(f.at_s, restart_phases, gpus)

    while s.done < job.work_s - 1e-9:
        if s.t > limit:
            return RunResult(method.name, seed, job.gpus, job.work_s, _INF, lost, counts, tau,
                             spares_min)
        rate = active() / ratio if s.mode == "run" else 0.0
        t_work = _INF
        if rate > 0:
            target = min(job.work_s, s.next_ckpt)
            t_work = s.t + max(0.0, target - s.done) / rate
        t_repair = s.repairs[0][0] if s.repairs else _INF
        t_group = s.groups_back[0] if s.groups_back else _INF
        t_next = min(fail.at_s, t_work, s.mode_end, t_repair, t_group)
        dt = t_next - s.t
        if s.mode == "run":
            s.done = min(job.work_s, s.done + dt * rate) if t_next != t_work else min(
                job.work_s, s.next_ckpt)
            lost["step_overhead"] += dt * (1.0 - 1.0 / ratio)
            lost["degraded"] += dt * (1.0 - active()) / ratio
        elif s.mode == "write":
            lost["checkpoint_write"] += dt
        else:
            lost[s.phase] += dt
        s.t = t_next
        if t_next == t_work:
            if s.done >= job.work_s - 1e-9:
                break
            if write_s > 0:
                s.mode, s.mode_end = "write", s.t + write_s
            else:
                s.ckpt = s.done
                s.next_ckpt = s.done + (tau or _INF)
        elif t_next == s.mode_end:
            if s.mode == "write":
                s.ckpt = s.done
                s.next_ckpt = s.done + (tau or _INF)
                s.mode, s.mode_end = "run", _INF
            else:
                start_phases(s.t)
        elif t_next == t_repair:
            _, gpus = heapq.heappop(s.repairs)
            s.pool += gpus
            group_ready(s.t)
            if s.mode == "down" and s.phase == "spare_wait":
                start_phases(s.t)
        elif t_next == t_group:
            heapq.heappop(s.groups_back)
            s.groups_out = max(0, s.groups_out - 1)
        else:
            if s.mode == "write":
                s.mode, s.mode_end = "run", _INF  # the write is lost; done stays
            on_failure(fail)
            fail = next(stream)
        spares_min = min(spares_min, s.pool)
    return RunResult(method.name, seed, job.gpus, job.work_s, s.t, lost, counts, tau, spares_min)
