"""The discrete-event engine: a heap of (time, sequence, kind, payload) and a virtual clock.

Everything the simulator does is an entry on this heap: a datagram arriving, a member's timer, a
scripted fault. The sequence number breaks ties in insertion order, so two runs with the same seed
pop the same entries in the same order. There is no asyncio, no thread and no wall clock here.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

DELIVER = 0
TIMER = 1
CALL = 2


class Engine:
    """A min-heap of timed entries and the virtual clock. The owner pops due entries with
    :meth:`pop_due` and dispatches them itself (direct calls, which the compiled build turns into
    native calls), then calls :meth:`settle`.

    ``now`` only moves forward. ``events`` counts every entry popped, the figure ``events_per_s``
    is computed from.
    """

    __slots__ = ("now", "events", "_heap", "_seq")

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0

    def push(self, at: float, kind: int, payload: Any) -> None:
        """Schedule ``payload`` of ``kind`` at virtual time ``at`` (seconds)."""
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, payload))

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """Schedule ``fn()`` at virtual time ``at``: scripted faults and probes of the run."""
        self.push(at, CALL, fn)

    def pop_due(self, until: float) -> tuple[float, int, int, Any] | None:
        """Pop the next entry due at or before ``until`` (advancing ``now`` to it and counting
        it), or None."""
        heap = self._heap
        if heap and heap[0][0] <= until:
            entry = heapq.heappop(heap)
            self.now = entry[0]
            self.events += 1
            return entry
        return None

    def settle(self, until: float) -> None:
        """After dispatching everything up to ``until``, set the clock to ``until``."""
        self.now = max(self.now, until)

    def __len__(self) -> int:
        return len(self._heap)
