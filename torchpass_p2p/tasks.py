"""Every task an owner: the one way this package holds asyncio tasks (``docs/design.md``, 3).

A scope whose tasks end with it uses :class:`asyncio.TaskGroup` (the launcher's supervisor, the
agent thread's main). An object whose tasks outlive any one call (the agent runtime, its
transport, the transfer server and client, the pulse prober) holds an :class:`OwnedTasks`:
it starts each task under a name, refuses to hold more than its bound, logs a task's failure
as the task ends (or hands the ended task to the caller's ``on_done``), and on :meth:`close`
cancels every task it holds and waits for them, at most a given time.

What must stay true: a task created through an :class:`OwnedTasks` is in it until it ends,
so :meth:`close` reaches every one still running; a task started after :meth:`close` is
cancelled before it runs, so nothing outlives its owner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["OwnedTasks", "TaskLimitReached"]

log = logging.getLogger("torchpass_p2p.tasks")

T = TypeVar("T")


class TaskLimitReached(RuntimeError):
    """An :class:`OwnedTasks` already holds its ``limit`` of running tasks."""


class OwnedTasks:
    """The running tasks of one long-lived owner, at most ``limit`` at a time.

    ``owner`` names the owner in task names and log lines. A task that ends with an exception
    (not a cancellation) is logged at error level with its traceback, unless it was started
    with ``on_done``, which then receives every ended task instead and handles its outcome.
    """

    def __init__(self, owner: str, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self.owner = owner
        self.limit = limit
        self.closed = False
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def __contains__(self, task: object) -> bool:
        return task in self._tasks

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str,
              on_done: Callable[[asyncio.Task[T]], None] | None = None) -> asyncio.Task[T]:
        """Run ``coro`` as a task named ``owner/name``, held until it ends.

        Raises:
            TaskLimitReached: ``limit`` tasks are running (``coro`` is closed, never run).
        """
        try:
            self._make_room()
        except TaskLimitReached:
            coro.close()
            raise
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.owner}/{name}")
        self._hold(task, on_done)
        return task

    def adopt(self, task: asyncio.Task[T], *,
              on_done: Callable[[asyncio.Task[T]], None] | None = None) -> None:
        """Hold ``task``, made by someone else (a handler task of ``asyncio.start_server``).

        Raises:
            TaskLimitReached: ``limit`` tasks are running (``task`` is not held).
        """
        self._make_room()
        self._hold(task, on_done)

    def cancel(self) -> None:
        """Cancel every task held (except the calling one, which may be closing its owner); a
        task started from now on is cancelled before it runs. Idempotent."""
        self.closed = True
        for task in self._others():
            task.cancel()

    async def wait(self, timeout_s: float) -> set[asyncio.Task[Any]]:
        """Wait until every task held (except the calling one) has ended, at most ``timeout_s``
        seconds; cancels nothing. Returns the tasks still running."""
        others = self._others()
        if not others or timeout_s <= 0:
            return set(others)
        _, pending = await asyncio.wait(others, timeout=timeout_s)
        return pending

    async def close(self, timeout_s: float) -> None:
        """:meth:`cancel`, then :meth:`wait` at most ``timeout_s`` seconds (0: do not wait);
        a task still running then is logged (a bug: each ends at its next await)."""
        self.cancel()
        if timeout_s > 0:
            pending = await self.wait(timeout_s)
            if pending:
                log.warning("%s: %d task(s) still running %.1f s after being cancelled: %s",
                            self.owner, len(pending), timeout_s,
                            ", ".join(sorted(t.get_name() for t in pending)))

    # ------------------------------------------------------------------ inside

    def _others(self) -> list[asyncio.Task[Any]]:
        current = asyncio.current_task()
        return [t for t in self._tasks if t is not current and not t.done()]

    def _make_room(self) -> None:
        if len(self._tasks) >= self.limit:  # ended tasks whose callbacks have not run yet
            self._tasks.difference_update([t for t in self._tasks if t.done()])
        if len(self._tasks) >= self.limit:
            raise TaskLimitReached(f"{self.owner}: {self.limit} tasks running")

    def _hold(self, task: asyncio.Task[T], on_done: Callable[[asyncio.Task[T]], None] | None
              ) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)  # the one set, never replaced
        task.add_done_callback(self._report if on_done is None else on_done)
        if self.closed:
            task.cancel()

    def _report(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("%s: task %s failed", self.owner, task.get_name(), exc_info=exc)
