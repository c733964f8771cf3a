"""Straggler detection from each rank's arrival lag at the gradient collective: one pure rule
for the training runtime (:mod:`torchpass_p2p.ddp.stragglers`) and the simulator.

What is measured
----------------
A synchronous step ends at the same instant on every rank (the collective equalizes it), so
step times cannot tell who held the others up. What differs is *when each rank arrived*. After
each committed step every rank knows, for every rank ``j`` (the figures ride in the step's
commit vote, ``docs/training.md``), two durations measured on ``j``'s own clock:

* ``compute_s[j]``: time ``j`` spent working in the step (its own forward and backward), and
* ``wait_s[j]``: time ``j`` spent blocked in the step's gradient collectives, waiting for the
  others.

The collective completes at (nearly) the same instant everywhere, within its own latency, so a
rank that arrived later waited less by as much. Rank ``m``'s arrival after the first rank's::

    lag(m, k) = max_j wait_s[j] - wait_s[m]          (seconds, >= 0)

Every term is a duration on one host's clock: no two hosts' clocks are ever compared, so the
rule needs no clock synchronization (the error is the spread of the collective's completion
across ranks, about one network latency).

The rule
--------
::

    slow(m, k)  <=>  lag(m, k) > max(min_lag_s, (factor - 1) * median(compute_s of the others))

that is, ``m`` arrived as late as if its work took ``factor`` times the healthy crowd's, and by
more than ``min_lag_s`` (the floor keeps jitter on very short steps from counting). A member is
*named* once it was slow at ``hits`` or more of its last ``window`` observed steps, and no longer
named once it was slow at ``window - hits`` or fewer of them (hysteresis: one fast step does not
clear it, a few slow steps in a row of fast ones do not name it). A member missing from a step
(it left the world) is forgotten, and cleared if it was named. Fewer than two ranks decide
nothing.

Why these defaults: ``factor`` 1.5 is the rule this module used on compute times (a rank that
makes every step 50 % longer is worth a spare; NVIDIA's nvidia-resiliency-ext straggler
detector scores ranks against the best rank the same way); ``min_lag_s`` 0.1 s is above every
lag of a healthy job recorded on two shared cores (``docs/stragglers.md``: 4 ranks and a spare,
1,000 steps, largest lag 83 ms, 99th percentile 45 ms; a floor of 40 ms named a healthy rank
there); 8 of 10 steps names a persistent straggler within 8 steps and rides out a garbage
collection or a data-loader hiccup, which is one or two slow steps.

Sans-IO: no clock, no randomness; the caller passes step numbers and seconds. Every member that
observes the same steps' figures reaches the same verdicts at the same steps.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import median

from .messages import MemberId


@dataclass(frozen=True, slots=True)
class Arrival:
    """One rank's figures for one step, each measured on its own clock (seconds)."""

    rank: int
    compute_s: float
    """Time the rank worked in the step: from the step's opening to the reduction's end, less
    ``wait_s``."""
    wait_s: float
    """Time the rank was blocked in the step's gradient collectives."""


@dataclass(frozen=True, slots=True)
class StragglerNamed:
    """``member`` (holding ``rank``) was named at ``step``. ``lag_s`` is the median of its lags
    over the slow steps of its window; ``reason`` says why in words (logs and tests)."""

    member: MemberId
    rank: int
    step: int
    lag_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class StragglerCleared:
    """``member`` (holding ``rank``) is no longer named as of ``step``."""

    member: MemberId
    rank: int
    step: int
    reason: str


Verdict = StragglerNamed | StragglerCleared


class StragglerDetector:
    """Feed one :meth:`observe` per committed step; it returns the verdicts of that step.

    Args:
        factor: slow means a lag above ``(factor - 1)`` x the others' median compute time.
        min_lag_s: and above this many seconds.
        window: steps remembered per member.
        hits: slow steps among the last ``window`` that name a member.

    Raises:
        ValueError: ``factor`` <= 1, ``min_lag_s`` < 0, ``window`` < 1, or ``hits`` not in
            ``(window / 2, window]`` (at or below half, naming and clearing would overlap).
    """

    def __init__(self, *, factor: float = 1.5, min_lag_s: float = 0.1, window: int = 10,
                 hits: int = 8) -> None:
        if not factor > 1.0:
            raise ValueError("factor must be greater than 1")
        if not min_lag_s >= 0.0:
            raise ValueError("min_lag_s must be at least 0")
        if window < 1:
            raise ValueError("window must be at least 1")
        if not window < 2 * hits <= 2 * window:
            raise ValueError("hits must be more than half of window and at most window")
        self.factor = factor
        self.min_lag_s = min_lag_s
        self.window = window
        self.hits = hits
        self._seen: dict[MemberId, deque[float | None]] = {}
        """Per member, its last ``window`` steps: the lag of a slow step, None for the rest."""
        self._slow: dict[MemberId, int] = {}
        """Per member, the slow steps in ``_seen`` (kept, not counted, each step)."""
        self.named: dict[MemberId, StragglerNamed] = {}
        """Members named now, with the verdict that named them."""

    def slow_steps(self, member: MemberId) -> int:
        """Slow steps of ``member`` among its last ``window`` observed ones."""
        return self._slow.get(member, 0)

    def reset(self, step: int, reason: str) -> tuple[StragglerCleared, ...]:
        """Forget everything (a new group: lags across groups do not compare); returns the
        clearing of every member named, in member order."""
        cleared = tuple(StragglerCleared(m, self.named[m].rank, step, reason)
                        for m in sorted(self.named))
        self._seen.clear()
        self._slow.clear()
        self.named.clear()
        return cleared

    def lags(self, arrivals: Mapping[MemberId, Arrival]) -> dict[MemberId, float]:
        """Each member's lag (seconds) behind the first arrival, ``max wait - its wait``."""
        first = max(a.wait_s for a in arrivals.values())
        return {m: first - a.wait_s for m, a in arrivals.items()}

    def observe(self, step: int, arrivals: Mapping[MemberId, Arrival]) -> tuple[Verdict, ...]:
        """Apply the rule to one step's figures. Returns the members cleared (left the world,
        or no longer slow), then those named, each in ascending member id order."""
        verdicts: list[Verdict] = []
        for gone in sorted(m for m in self._seen if m not in arrivals):
            named = self.named.pop(gone, None)
            if named is not None:
                verdicts.append(StragglerCleared(gone, named.rank, step, "left the world"))
            del self._seen[gone]
            del self._slow[gone]
        if len(arrivals) < 2:
            return tuple(verdicts)
        first = max(a.wait_s for a in arrivals.values())
        computes = sorted(a.compute_s for a in arrivals.values())
        named_now: list[Verdict] = []
        floor, scale, window = self.min_lag_s, self.factor - 1.0, self.window
        for member in sorted(arrivals):
            arrival = arrivals[member]
            lag = first - arrival.wait_s
            seen = self._seen.get(member)
            if seen is None:
                seen = self._seen[member] = deque(maxlen=window)
            count = self._slow.get(member, 0)
            if len(seen) == window and seen[0] is not None:
                count -= 1  # about to fall out of the window
            threshold = max(floor, scale * _median_without(computes, arrival.compute_s))
            if lag > threshold:
                seen.append(lag)
                count += 1
            else:
                seen.append(None)
            self._slow[member] = count
            if member in self.named:
                if count <= window - self.hits:
                    del self.named[member]
                    verdicts.append(StragglerCleared(
                        member, arrival.rank, step,
                        f"slow at {count} of its last {len(seen)} steps"))
            elif count >= self.hits:
                lag_s = median([x for x in seen if x is not None])
                verdict = StragglerNamed(
                    member, arrival.rank, step, lag_s,
                    f"arrived {lag_s:.3f} s after the first rank (median) at {count} of "
                    f"its last {len(seen)} steps; threshold {threshold:.3f} s")
                self.named[member] = verdict
                named_now.append(verdict)
        return tuple(verdicts + named_now)


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
