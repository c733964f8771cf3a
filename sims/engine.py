"""The discrete-event engine: timed entries popped in (time, sequence) order, and a virtual clock.

Everything the simulator does is an entry here: a datagram arriving, a member's timer, a
scripted fault. Entries pop in (time, sequence) order; the sequence number breaks ties in insertion
order, so two runs with the same seed pop the same entries in the same order. There is no asyncio,
no thread and no wall clock here.

Two implementations of the same heaps, chosen at import (the order is fully fixed by the unique
(time, sequence) keys, so both pop the same entries in the same order):

* compiled by mypyc (scripts/build-native): binary heaps of :class:`Entry` written out below,
  where each comparison is two native double/int compares. heapq would call back through
  Python's rich comparison for every step (several thousand instructions per entry).
* pure Python: heapq over ``(time, sequence, entry)`` tuples, since a sift loop in interpreted
  Python is slower than heapq's C loop.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any, Final

DELIVER: Final = 0
TIMER: Final = 1
CALL: Final = 2

_COMPILED: Final = not __file__.endswith(".py")
"""True when this module runs as a mypyc extension."""


class Entry:
    """One scheduled entry: ``kind`` and up to three operands. DELIVER: (target, sender, data);
    TIMER: (member, deadline, None); CALL: (fn, None, None)."""

    __slots__ = ("at", "seq", "kind", "a", "b", "c")

    def __init__(self, at: float, seq: int, kind: int, a: Any, b: Any, c: Any) -> None:
        self.at = at
        self.seq = seq
        self.kind = kind
        self.a = a
        self.b = b
        self.c = c


class Engine:
    """Timed entries and the virtual clock. The owner pops due entries with :meth:`pop_due` and
    dispatches them itself (direct calls, which the compiled build turns into native calls), then
    calls :meth:`settle`.

    Two heaps, merged at the top by the same (at, seq) order: deliveries (due within a few
    milliseconds, a few dozen in flight) and everything else (one timer per member, so about
    as many as members). Two thirds of the entries are deliveries, and popping one from a heap
    of dozens takes half the steps of popping it from a heap of a thousand.

    ``now`` only moves forward. ``events`` counts every entry popped, the figure ``events_per_s``
    is computed from.
    """

    __slots__ = ("now", "events", "_near", "_far", "_near_tuples", "_far_tuples", "_seq")

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        # compiled build: deliveries, the rest
        self._near: list[Entry] = []
        self._far: list[Entry] = []
        # pure Python (heapq): deliveries, the rest
        self._near_tuples: list[tuple[float, int, Entry]] = []
        self._far_tuples: list[tuple[float, int, Entry]] = []
        self._seq = 0

    def push(self, at: float, kind: int, a: Any, b: Any = None, c: Any = None) -> None:
        """Schedule entry ``(kind, a, b, c)`` at virtual time ``at`` (seconds)."""
        self._seq += 1
        entry = Entry(at, self._seq, kind, a, b, c)
        if _COMPILED:
            _sift_in(self._near if kind == DELIVER else self._far, entry)
        else:
            heappush(self._near_tuples if kind == DELIVER else self._far_tuples,
                     (at, self._seq, entry))

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """Schedule ``fn()`` at virtual time ``at``: scripted faults and probes of the run."""
        self.push(at, CALL, fn)

    def pop_due(self, until: float) -> Entry | None:
        """Pop the next entry due at or before ``until`` (advancing ``now`` to it and counting
        it), or None."""
        entry: Entry
        if _COMPILED:
            near = self._near
            far = self._far
            heap = near
            if not near:
                if not far:
                    return None
                heap = far
            elif far:
                n = near[0]
                f = far[0]
                if f.at < n.at or (f.at == n.at and f.seq < n.seq):
                    heap = far
            if heap[0].at > until:
                return None
            entry = _take_first(heap)
        else:
            near_t = self._near_tuples
            far_t = self._far_tuples
            tuples = near_t if near_t and (not far_t or near_t[0] < far_t[0]) else far_t
            if not tuples or tuples[0][0] > until:
                return None
            entry = heappop(tuples)[2]
        self.now = entry.at
        self.events += 1
        return entry

    def settle(self, until: float) -> None:
        """After dispatching everything up to ``until``, set the clock to ``until``."""
        self.now = max(self.now, until)

    def __len__(self) -> int:
        return (len(self._near) + len(self._far) + len(self._near_tuples)
                + len(self._far_tuples))


def _sift_in(heap: list[Entry], entry: Entry) -> None:
    """Add ``entry`` to ``heap``, moving it up past every parent that sorts after it."""
    at = entry.at
    seq = entry.seq
    heap.append(entry)
    pos = len(heap) - 1
    while pos > 0:
        up = (pos - 1) >> 1
        parent = heap[up]
        if parent.at < at or (parent.at == at and parent.seq < seq):
            break
        heap[pos] = parent
        pos = up
    heap[pos] = entry


def _take_first(heap: list[Entry]) -> Entry:
    """Remove and return the smallest entry of a non-empty ``heap``. As heapq does: move the
    smaller child up all the way to a leaf, put the last entry there, and sift it back up."""
    last = heap.pop()
    if not heap:
        return last
    first = heap[0]
    n = len(heap)
    pos = 0
    child = 1
    while child < n:
        smaller = heap[child]
        right = child + 1
        if right < n:
            other = heap[right]
            if other.at < smaller.at or (other.at == smaller.at and other.seq < smaller.seq):
                child = right
                smaller = other
        heap[pos] = smaller
        pos = child
        child = 2 * pos + 1
    at = last.at
    seq = last.seq
    while pos > 0:
        up = (pos - 1) >> 1
        parent = heap[up]
        if parent.at < at or (parent.at == at and parent.seq < seq):
            break
        heap[pos] = parent
        pos = up
    heap[pos] = last
    return first
