"""When to save: every N steps, every T seconds, or at the interval Young's formula gives.

Young's formula (J. W. Young, "A first order approximation to the optimum checkpoint
interval", Communications of the ACM 17(9), 1974): with a checkpoint costing ``C`` seconds and
failures arriving with mean time ``M`` between them, the interval ``sqrt(2 C M)`` minimizes the
expected loss (the cost of saving plus the work redone after a failure). Here ``M`` is the mean
time between *correlated* failures, those in-memory recovery cannot cover (a launcher or its
host lost, every holder of a state gone, no majority left): a single rank's death costs no
work at all. ``C`` is what a save costs training: the training thread's copy of the state; the
write itself runs in the background, so the interval is also at least the write's duration
(saves never overlap). Both are measured at the first save, at the first step boundary after
the job starts or resumes. Pure: the clock is passed in.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["DEFAULT_MTBF_S", "Every", "Schedule", "young_interval_s"]

DEFAULT_MTBF_S = 86400.0
"""A day between correlated failures: a placeholder, not a measurement. Set it from the
cluster's own record of lost launchers, hosts and racks (``--mtbf-correlated``)."""
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_SPEC = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*$")


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """``sqrt(2 * cost_s * mtbf_s)`` seconds (module docstring). Raises ``ValueError`` for a
    negative cost or a non-positive MTBF."""
    if cost_s < 0 or not mtbf_s > 0:
        raise ValueError("the save cost must be >= 0 and the MTBF > 0 seconds")
    return math.sqrt(2.0 * cost_s * mtbf_s)


@dataclass(frozen=True)
class Every:
    """``--checkpoint-every``: ``steps`` (an integer), ``seconds`` (a number with ``s``, ``m``
    or ``h``), or neither: ``auto``, Young's formula."""

    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> Every:
        """``"auto"``, ``"200"`` (steps), ``"90s"``, ``"15m"``, ``"2h"``. Raises
        ``ValueError`` for anything else, or for zero."""
        if text.strip().lower() == "auto":
            return cls()
        m = _SPEC.match(text.lower())
        if m is None:
            raise ValueError(f"checkpoint interval {text!r}: a number of steps (200), of "
                             "seconds, minutes or hours (90s, 15m, 2h), or auto")
        number, unit = m.groups()
        if not unit:
            if "." in number or int(number) < 1:
                raise ValueError(f"checkpoint interval {text!r}: steps must be an integer >= 1")
            return cls(steps=int(number))
        seconds = float(number) * _UNITS[unit]
        if not seconds > 0:
            raise ValueError(f"checkpoint interval {text!r}: must be > 0")
        return cls(seconds=seconds)

    @property
    def auto(self) -> bool:
        return self.steps is None and self.seconds is None

    def __str__(self) -> str:
        if self.steps is not None:
            return str(self.steps)
        if self.seconds is not None:
            return f"{self.seconds:g}s"
        return "auto"

    def describe(self, mtbf_s: float) -> str:
        if self.steps is not None:
            return f"every {self.steps} steps"
        if self.seconds is not None:
            return f"every {self.seconds:g} s"
        return (f"at Young's interval sqrt(2 x save cost x MTBF {mtbf_s:g} s), the save cost "
                "measured at the first save")


class Schedule:
    """Whether a step boundary is due for a save, for the member that writes (rank 0).

    Args:
        every: the interval.
        mtbf_s: mean time between correlated failures, seconds (for ``auto``).
        start_step: the step the job started or resumed at (never saved again: it is on disk
            or it is step 0).
        now: the clock's reading at the start, seconds.
    """

    def __init__(self, every: Every, mtbf_s: float, start_step: int, now: float) -> None:
        self.every = every
        self.mtbf_s = mtbf_s
        self.start_step = start_step
        self.last_step = start_step
        self.last_at = now
        self.interval_s = every.seconds
        """Seconds between saves: ``every.seconds``, or for ``auto`` Young's once measured."""

    def due(self, step: int, now: float) -> bool:
        """Whether to save the state after ``step`` steps, at time ``now``."""
        if step <= self.last_step:
            return False
        if self.every.steps is not None:
            return step % self.every.steps == 0
        if self.interval_s is None:  # auto, not measured yet: the first boundary measures
            return True
        return now - self.last_at >= self.interval_s

    def started(self, step: int, now: float) -> None:
        """A save of ``step`` began at ``now``."""
        self.last_step, self.last_at = step, now

    def measured(self, stage_s: float, save_s: float) -> float | None:
        """The first save's cost: ``stage_s`` seconds on the training thread, ``save_s`` from
        its start to its commit. For ``auto``, fixes the interval at
        ``max(young_interval_s(stage_s, mtbf_s), save_s)`` and returns it; otherwise None."""
        if not self.every.auto or self.interval_s is not None:
            return None
        self.interval_s = max(young_interval_s(stage_s, self.mtbf_s), save_s)
        return self.interval_s
