"""The discrete-event engine: timed entries popped in (time, insertion) order, and a virtual clock.

Everything the simulator does is an entry here: a datagram arriving, a member's timer, a scripted
fault. Entries due at the same time pop in insertion order, so two runs with the same seed pop the
same entries in the same order. There is no asyncio, no thread and no wall clock here.

Layout (for speed, the order is exactly that of a heap of ``(time, sequence, entry)``): a heap of
*distinct* times as bare floats, and a dict from each time to its first entry (plus, for the rare
times that several entries share, a FIFO of the others). Comparing bare floats costs heapq a third
of what comparing tuples does, and the engine pops every entry the simulator makes.
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush
from collections.abc import Callable
from typing import Any

DELIVER = 0
TIMER = 1
CALL = 2

Entry = tuple[int, Any, Any, Any]
"""``(kind, a, b, c)``: DELIVER (target, sender, data), TIMER (member, deadline, None),
CALL (fn, None, None). Flat, so one tuple is allocated per entry."""


class Engine:
    """Timed entries and the virtual clock. The owner pops due entries with :meth:`pop_due` and
    dispatches them itself (direct calls, which the compiled build turns into native calls), then
    calls :meth:`settle`.

    ``now`` only moves forward. ``events`` counts every entry popped, the figure ``events_per_s``
    is computed from.
    """

    __slots__ = ("now", "events", "_times", "_first", "_more", "_size")

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._times: list[float] = []  # heap of the distinct times that have entries
        self._first: dict[float, Entry] = {}  # time -> its oldest entry
        self._more: dict[float, deque[Entry]] = {}  # time -> its later entries, oldest first
        self._size = 0

    def push(self, at: float, kind: int, a: Any, b: Any = None, c: Any = None) -> None:
        """Schedule entry ``(kind, a, b, c)`` at virtual time ``at`` (seconds)."""
        entry = (kind, a, b, c)
        self._size += 1
        first = self._first
        if at in first:
            more = self._more.get(at)
            if more is None:
                self._more[at] = deque((entry,))
            else:
                more.append(entry)
            return
        first[at] = entry
        heappush(self._times, at)

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """Schedule ``fn()`` at virtual time ``at``: scripted faults and probes of the run."""
        self.push(at, CALL, fn)

    def pop_due(self, until: float) -> Entry | None:
        """Pop the next entry due at or before ``until`` (advancing ``now`` to its time and
        counting it), or None."""
        times = self._times
        if not times:
            return None
        at = times[0]
        if at > until:
            return None
        first = self._first
        entry = first[at]
        more = self._more
        if more and at in more:
            later = more[at]
            first[at] = later.popleft()
            if not later:
                del more[at]
        else:
            del first[at]
            heappop(times)
        self.now = at
        self.events += 1
        self._size -= 1
        return entry

    def settle(self, until: float) -> None:
        """After dispatching everything up to ``until``, set the clock to ``until``."""
        self.now = max(self.now, until)

    def __len__(self) -> int:
        return self._size
