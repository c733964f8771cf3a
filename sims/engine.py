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
    """A min-heap of timed entries. Handlers are registered per kind by the owner.

    ``now`` only moves forward. ``events`` counts every entry popped and handled, the figure
    ``events_per_s`` is computed from.
    """

    __slots__ = ("now", "events", "_heap", "_seq", "_handlers")

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._handlers: dict[int, Callable[[Any], None]] = {}

    def on(self, kind: int, handler: Callable[[Any], None]) -> None:
        self._handlers[kind] = handler

    def push(self, at: float, kind: int, payload: Any) -> None:
        """Schedule ``payload`` for the ``kind`` handler at virtual time ``at`` (seconds)."""
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, payload))

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at virtual time ``at``: scripted faults and probes of the run."""
        self.push(at, CALL, fn)

    def run(self, until: float) -> None:
        """Pop and handle entries in time order until the next one is later than ``until``;
        then set the clock to ``until``."""
        heap = self._heap
        handlers = self._handlers
        pop = heapq.heappop
        count = 0
        while heap and heap[0][0] <= until:
            at, _, kind, payload = pop(heap)
            self.now = at
            count += 1
            if kind == CALL:
                payload()
            else:
                handlers[kind](payload)
        self.events += count
        self.now = max(self.now, until)

    def pop_due(self, until: float) -> tuple[float, int, int, Any] | None:
        """Pop the next entry due at or before ``until`` (advancing ``now`` to it and counting
        it), or None. For owners that dispatch entries themselves, then call :meth:`settle`."""
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
