"""GPU health at the agent: the health monitor's faults (:mod:`..health`, NVML) handed to the
loop, counted, shown, and for a fault that calls for it, a request to be migrated.

The monitor runs its own thread; a fault crosses to the loop with ``call_soon_threadsafe``.

What must stay true: a fault is handled on the loop (never on the monitor's thread), and only a
rank holder asks to be migrated (a spare holds nothing to hand over).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["GpuHealth"]

log = logging.getLogger("torchpass_p2p.agent")


class GpuHealth:
    """One agent's health monitor and the faults it reported.

    Args:
        monitor: a started-later health monitor (:class:`~..health.HealthMonitor`), or None to
            build one at :meth:`start`.
        clock: monotonic seconds.
        role: this member's role (``rank``, ``spare``, ...) now.
        note: records an event for the status page (``{"at", "type", "detail"}``).
        drain: asks to hand this member's rank to a spare.
    """

    def __init__(self, monitor: Any, *, clock: Callable[[], float], role: Callable[[], str],
                 note: Callable[[dict[str, Any]], None], drain: Callable[[], None]) -> None:
        self.monitor: Any = monitor
        """The monitor (given or built at :meth:`start`), or None."""
        self.faults: Counter[str] = Counter()
        """Faults reported, by kind: the ``torchpass_health_faults_total`` metric."""
        self._clock = clock
        self._role = role
        self._note = note
        self._drain = drain

    def start(self) -> None:
        """Start the monitor (built first if none was given; nothing when the health module
        cannot be imported), its faults handed to the running loop."""
        if self.monitor is None:
            try:
                from ..health import HealthMonitor
            except ImportError:  # the health module is optional at this layer
                return
            self.monitor = HealthMonitor()
        loop = asyncio.get_running_loop()
        self.monitor.start(lambda fault: loop.call_soon_threadsafe(self._on_fault, fault))

    def stop(self) -> None:
        """Stop the monitor, waiting at most a second for its thread."""
        if self.monitor is not None:
            self.monitor.stop(1.0)

    def status(self) -> dict[str, Any]:
        """The ``health`` part of ``/status``."""
        if self.monitor is None:
            return {"enabled": False, "reason": "disabled by settings"}
        status: dict[str, Any] = self.monitor.status()
        return status

    def _on_fault(self, fault: Any) -> None:
        self._note({"at": self._clock(), "type": "HealthFault",
                    "detail": f"{fault.kind}: {fault.detail}"})
        self.faults[str(fault.kind)] += 1
        if fault.severity == "migrate" and self._role() == "rank":
            log.error("GPU fault %s (%s): asking to be migrated", fault.kind, fault.detail)
            self._drain()
