"""Straggler detection from per-step compute times: one pure rule for the simulator and runtime.

The rule
--------
After each completed step every rank's compute time for that step is known (today the simulator
hands it in as shared knowledge; later it travels on the gossip path). For each member ``m`` that
reported at step ``k``::

    slow(m, k)  <=>  compute_s[m] > factor * median(compute_s of every other member at step k)

A member that is slow at ``steps`` consecutive reported steps is flagged once, at the step that
completes the run (so a rank slow from step ``k0`` on is flagged at ``k0 + steps - 1``). A step at
which it is not slow ends the run and clears the flag, so a rank that recovers and slows again is
flagged again; a step it did not report (it left the world) forgets it entirely. Fewer than two
reporting members, or a median of zero, decide nothing.

Why the median of the *others*: a synchronous job runs at the pace of its slowest rank, so the
baseline must be what the healthy crowd needs, unaffected by the suspect itself (with two ranks the
median of the others is simply the other one). NVIDIA's nvidia-resiliency-ext straggler detector
scores each rank against the best rank ("relative performance score"); the median is less
sensitive to one unusually fast rank. ``steps`` consecutive steps keep one noisy step (a garbage
collection, a data-loader hiccup) from moving a rank.

Sans-IO (DESIGN section 3): no clock, no randomness; the caller passes step numbers and seconds.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass

from .messages import MemberId


@dataclass(frozen=True, slots=True)
class StragglerFlag:
    """``member`` was flagged at ``step``; ``ratio`` is its compute time over the others' median
    at that step, and ``reason`` says why in words (tests and logs assert on it)."""

    member: MemberId
    step: int
    ratio: float
    reason: str


class StragglerDetector:
    """Feed one :meth:`observe` per completed step; it returns the members newly flagged.

    Args:
        factor: slow means compute time > ``factor`` x the others' median (1.5: a rank that
            makes every step 50 % longer is worth a spare; smaller factors catch ordinary
            jitter between ranks).
        steps: consecutive slow steps before a flag (5: rides out a single slow step such as a
            garbage collection or a checkpoint write, yet flags within seconds at 1 s steps).

    Raises:
        ValueError: ``factor`` <= 1 or ``steps`` < 1.
    """

    def __init__(self, factor: float = 1.5, steps: int = 5) -> None:
        if not factor > 1.0:
            raise ValueError("factor must be greater than 1")
        if steps < 1:
            raise ValueError("steps must be at least 1")
        self.factor = factor
        self.steps = steps
        self._streak: dict[MemberId, int] = {}
        self.flagged: dict[MemberId, StragglerFlag] = {}
        """Members flagged in their current slow run, with the flag."""

    def streak(self, member: MemberId) -> int:
        """Consecutive slow steps of ``member`` up to the last observed step."""
        return self._streak.get(member, 0)

    def forget(self, member: MemberId) -> None:
        """Drop ``member``'s history (it was migrated or left the world)."""
        self._streak.pop(member, None)
        self.flagged.pop(member, None)

    def observe(self, step: int, compute_s: Mapping[MemberId, float]) -> tuple[StragglerFlag, ...]:
        """Apply the rule to one step's compute times (seconds per member).

        Returns the members flagged at this step, in ascending member id order.
        """
        for gone in [m for m in self._streak if m not in compute_s]:
            self.forget(gone)
        if len(compute_s) < 2:
            return ()
        ordered = sorted(compute_s.values())
        flags: list[StragglerFlag] = []
        for member in sorted(compute_s):
            seconds = compute_s[member]
            baseline = _median_without(ordered, seconds)
            if baseline <= 0.0 or not seconds > self.factor * baseline:
                self._streak.pop(member, None)
                self.flagged.pop(member, None)
                continue
            streak = self._streak.get(member, 0) + 1
            self._streak[member] = streak
            if streak >= self.steps and member not in self.flagged:
                ratio = seconds / baseline
                flag = StragglerFlag(
                    member, step, ratio,
                    f"compute {seconds:.3f} s > {self.factor:g} x others' median "
                    f"{baseline:.3f} s for {streak} consecutive steps")
                self.flagged[member] = flag
                flags.append(flag)
        return tuple(flags)


def _median_without(ordered: list[float], value: float) -> float:
    """Median of ``ordered`` (sorted, length >= 2) with one occurrence of ``value`` removed.

    O(log n): the others' list is ``ordered`` with index ``i`` skipped, so its j-th element is
    ``ordered[j]`` for ``j < i`` and ``ordered[j + 1]`` otherwise.
    """
    i = bisect_left(ordered, value)
    n = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j] if j < i else ordered[j + 1]

    if n % 2:
        return at(n // 2)
    return 0.5 * (at(n // 2 - 1) + at(n // 2))
