"""The hang watchdog: a rank holder whose training loop made no progress for
``settings.hang_timeout_s`` asks to be replaced (docs/design.md section 6).

The training loop reports where it is (:class:`Phase`) at each step; the loop driver calls
:meth:`HangWatchdog.check` at each turn. Stuck in its own compute, this process is the one that
hangs: it asks to hand its rank to a spare. Stuck inside a collective, it is waiting on peers:
it only says so, and probing and the peers' own watchdogs find the one that hangs.

What must stay true: the watchdog fires at most once per stall (a new report re-arms it), and
never for a member that holds no rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["HangWatchdog", "Phase"]

log = logging.getLogger("torchpass_p2p.agent")


class Phase:
    """Where the training loop is within a step (``report_progress``), docs/design.md section 6."""

    COMPUTE = "compute"
    """Forward and backward: no peer involved; a hang here is this process's fault."""
    COLLECTIVE = "collective"
    """Inside the gradient or commit all-reduce: waiting on peers."""
    COMMITTED = "committed"
    """The commit all-reduce of ``step`` completed: the step rolls forward."""


class HangWatchdog:
    """Time since the training loop's last report, and what to do once it is too long.

    Args:
        clock: monotonic seconds.
        timeout_s: the hang timeout in seconds, or None for no watchdog (asked at each check:
            the host may replace the settings until the agent starts).
        role: this member's role (``rank``, ``spare``, ...) now.
        on_fired: called each time the watchdog fires (the hang metric).
        note: records an event for the status page (``{"at", "type", "detail"}``).
        drain: asks to hand this member's rank to a spare.
    """

    def __init__(self, clock: Callable[[], float], *, timeout_s: Callable[[], float | None],
                 role: Callable[[], str], on_fired: Callable[[], None],
                 note: Callable[[dict[str, Any]], None], drain: Callable[[], None]) -> None:
        self._clock = clock
        self._timeout_s = timeout_s
        self._role = role
        self._on_fired = on_fired
        self._note = note
        self._drain = drain
        self._progress_at = clock()
        self._reported = False

    def progressed(self) -> None:
        """The training loop reported progress now: the watchdog is re-armed."""
        self._progress_at = self._clock()
        self._reported = False

    def check(self, now: float, phase: str, step: int) -> None:
        """Fire if the loop, last at ``step`` in ``phase``, made no progress for the timeout
        by ``now`` (clock seconds) and this member holds a rank."""
        timeout = self._timeout_s()
        if (timeout is None or self._reported or self._role() != "rank"
                or now - self._progress_at < timeout):
            return
        self._reported = True
        self._on_fired()
        if phase == Phase.COLLECTIVE:
            # Waiting on peers: probing and their own watchdogs find the one that hangs.
            log.warning("no progress for %.1f s inside a collective at step %d", timeout, step)
            return
        log.error("training loop made no progress for %.1f s in %s: asking to be replaced",
                  timeout, phase)
        self._note({"at": now, "type": "HangDetected", "detail": phase})
        self._drain()
