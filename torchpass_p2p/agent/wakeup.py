"""A timer loop's sleep: until the next deadline, or until something changed it.

The agent's timer loops (the core's driver, the pulse prober) wake on every deadline, some
twenty times a second while a job trains, in processes whose cores the training needs.
``asyncio.timeout`` around ``Event.wait`` costs a cancellation per timed-out sleep (the task is
cancelled and the exception turned into ``TimeoutError``); :class:`Wakeup` costs a future and
a timer handle, about a quarter of that (``docs/benchmarks.md``, "The agent's timer loops").

Loop-thread only, as ``asyncio.Event`` is: :meth:`set` from another thread goes through
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio

__all__ = ["Wakeup"]


class Wakeup:
    """A flag one task sleeps on: :meth:`sleep` returns once :meth:`set` was called since the
    last :meth:`sleep` returned, or after its delay, whichever is first."""

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        """Wake the sleeper now, or make its next :meth:`sleep` return at once."""
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def sleep(self, delay_s: float) -> None:
        """Sleep at most ``delay_s`` seconds (none if :meth:`set` was called since the last
        sleep returned). Raises ``RuntimeError`` if another task is sleeping on it."""
        if self._waiter is not None:
            raise RuntimeError("another task sleeps on this Wakeup")
        if not self._set:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(delay_s, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        self._set = False

    def clear(self) -> None:
        """Forget a :meth:`set` not slept on yet."""
        self._set = False


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
