"""Each step's arrival figures, and what is done with a straggler, on the training thread.

Every rank measures two durations per step on its own clock (``docs/stragglers.md``):
``compute_s``, the time it worked from the step's opening to the end of its gradient reduction,
and ``wait_s``, the time it was blocked in that reduction's collectives
(:attr:`~.reduction.StepReduction.blocked_s`). They ride in the next step's commit vote (a
step's vote leaves with its last bucket, before its own wait is over), so after the vote every
rank holds every rank's figures of the step before, the same on all of them, and feeds them to
:class:`~torchpass_p2p.core.straggler.StragglerDetector`: every rank names the same straggler
at the same step. Nothing crosses to the agent's thread per step: the verdicts go to the
member's event log, whose records the agent's history already receives (``/status``,
``/metrics`` and the status page read them from there).

``TORCHPASS_STRAGGLER`` chooses what a named straggler causes:

* ``report`` (default): it is named in the event log, ``/status`` and ``/metrics``;
* ``migrate``: also, the straggler drains itself (as ``torchpass-p2p drain`` would): a spare
  takes its rank at a step boundary and it exits with code 4;
* ``off``: the figures still ride in the vote (every rank's vote has one layout), nothing is
  judged.

Figures of a step whose reduction was redone (a fault, a regroup, a vetoed vote) are not
measured (:data:`UNMEASURED`): they hold the recovery's time, not an arrival. The detector's
memory belongs to one group: a new group (another configuration's, or a regroup) starts it
afresh, since lags behind other ranks do not compare.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchpass_p2p.core.straggler import Arrival, StragglerDetector, StragglerNamed, Verdict

__all__ = ["POLICIES", "UNMEASURED", "ArrivalWatch", "policy_from_env"]

POLICIES = ("off", "report", "migrate")
UNMEASURED = -1.0
"""A figure not measured this step (its reduction was redone)."""
ENV = "TORCHPASS_STRAGGLER"


def policy_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``TORCHPASS_STRAGGLER`` (``report`` when unset or empty).

    Raises:
        ValueError: another value.
    """
    value = (os.environ if environ is None else environ).get(ENV, "").strip() or "report"
    if value not in POLICIES:
        raise ValueError(f"{ENV}={value!r}: one of {', '.join(POLICIES)}")
    return value


class ArrivalWatch:
    """One member's step figures and straggler verdicts (module docstring).

    Args:
        member_id: this member.
        policy: one of :data:`POLICIES`.
        log: the member's event log (``log(event, **fields)``).
        drain: asks this member's agent to hand its rank to a spare; returns the agent's reply
            (``{"draining": bool, ...}``).
        detector: the rule (default: :class:`StragglerDetector`'s defaults).
        clock: monotonic seconds.
    """

    def __init__(self, member_id: int, policy: str, log: Callable[..., None],
                 drain: Callable[[], dict[str, Any]], *,
                 detector: StragglerDetector | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in POLICIES:
            raise ValueError(f"straggler policy {policy!r}: one of {', '.join(POLICIES)}")
        self.me = member_id
        self.policy = policy
        self.detector = detector or StragglerDetector()
        self._log = log
        self._drain = drain
        self._clock = clock
        self._opened = 0.0
        self._spoiled = True
        self._group: tuple[int, int] | None = None
        self._carried: tuple[int, tuple[int, int], list[float]] | None = None

    def opened(self) -> None:
        """The step opened (its first training forward)."""
        self._opened = self._clock()
        self._spoiled = False

    def spoil(self) -> None:
        """The step's reduction is being redone: its figures are not an arrival."""
        self._spoiled = True

    def figures(self, blocked_s: float) -> list[float]:
        """``[compute_s, wait_s]`` of the step so far, its reduction just completed after
        ``blocked_s`` seconds blocked in it; :data:`UNMEASURED` twice for a spoiled step."""
        if self._spoiled:
            return [UNMEASURED, UNMEASURED]
        span = self._clock() - self._opened
        return [max(0.0, span - blocked_s), blocked_s]

    def carry(self, step: int, group: tuple[int, int], blocked_s: float) -> None:
        """Step ``step``'s reduction completed in ``group`` after ``blocked_s`` seconds blocked
        in it: its figures ride in the next step's vote (the vote is launched with a step's
        last bucket, before that step's own wait is known)."""
        self._carried = (step, group, self.figures(blocked_s))

    def carried(self, step: int, group: tuple[int, int]) -> list[float]:
        """The figures step ``step``'s vote carries: step ``step - 1``'s when it was reduced in
        ``group``, else :data:`UNMEASURED` twice (the detector's lags compare one group's)."""
        if self._carried is None or self._carried[:2] != (step - 1, group):
            return [UNMEASURED, UNMEASURED]
        return list(self._carried[2])

    def observe(self, step: int, group: tuple[int, int], ranks: Sequence[int | None],
                figures: Sequence[Sequence[float]]) -> tuple[Verdict, ...]:
        """Step ``step`` committed in ``group`` (its config id and attempt) with rank map
        ``ranks``; ``figures[r]`` is rank ``r``'s ``[compute_s, wait_s]`` from the vote. Logs
        each verdict and, under ``migrate``, drains this member if it was named. Returns the
        verdicts."""
        if self.policy == "off":
            return ()
        verdicts: list[Verdict] = []
        if group != self._group:
            if self._group is not None:
                verdicts += self.detector.reset(step, "new group")
            self._group = group
        arrivals: dict[int, Arrival] = {}
        for rank, (member, (compute_s, wait_s)) in enumerate(zip(ranks, figures, strict=True)):
            if member is None or compute_s < 0.0 or wait_s < 0.0:
                arrivals = {}  # a rank not measured: the step says nothing
                break
            arrivals[member] = Arrival(rank, compute_s, wait_s)
        if arrivals:
            verdicts += self.detector.observe(step, arrivals)
        for verdict in verdicts:
            self._report(group[0], verdict)
        return tuple(verdicts)

    def _report(self, config_id: int, verdict: Verdict) -> None:
        straggler = f"{verdict.member:016x}"
        if not isinstance(verdict, StragglerNamed):
            self._log("straggler_cleared", step=verdict.step, config_id=config_id,
                      rank=verdict.rank, straggler=straggler, reason=verdict.reason)
            return
        self._log("straggler_named", step=verdict.step, config_id=config_id,
                  rank=verdict.rank, straggler=straggler, lag_s=round(verdict.lag_s, 6),
                  reason=verdict.reason)
        if self.policy == "migrate" and verdict.member == self.me:
            try:
                reply = self._drain()
            except (TimeoutError, RuntimeError) as exc:  # the agent did not answer: it is dying
                reply = {"draining": False, "reason": "no_answer", "detail": str(exc)[:200]}
            self._log("straggler_migrate", step=verdict.step, config_id=config_id,
                      rank=verdict.rank, draining=bool(reply.get("draining")),
                      reason=reply.get("reason"), detail=reply.get("detail"))
