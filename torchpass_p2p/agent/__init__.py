"""The agent runtime: the sans-IO core made live inside a training or spare process.

One asyncio loop in a background thread owns the sockets (UDP gossip, TCP for large messages),
the timers that drive the core, the HTTP status page and the NVML health monitor (docs/design.md
sections 3, 9, 10). The training thread talks to it through :class:`.api.Agent`, which the
training layers know as :class:`.interface.TrainingAgent`.

The names below are this package's public surface, what code outside the agent imports (the
trainer, the DDP session, scripts). Each is imported on first use: the simulator, the launcher
and the command line import modules of this package (settings, pulse, http) and must not load
the runtime through it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchpass_p2p.launch.childspec import format_address

    from .api import Agent, AgentError, start
    from .interface import ACCUSATIONS, AgentEvent, TrainingAgent
    from .services.directory import NotServed
    from .services.events import Change
    from .services.keys import KeyNotAccepted
    from .services.telemetry import COUNTER_SOURCES
    from .services.watchdog import Phase
    from .transport import TransportError

__all__ = ["ACCUSATIONS", "COUNTER_SOURCES", "Agent", "AgentError", "AgentEvent", "Change",
           "KeyNotAccepted", "NotServed", "Phase", "TrainingAgent", "TransportError",
           "format_address", "start"]

_HOMES = {
    "Agent": ".api", "AgentError": ".api", "start": ".api",
    "ACCUSATIONS": ".interface", "AgentEvent": ".interface", "TrainingAgent": ".interface",
    "COUNTER_SOURCES": ".services.telemetry", "Change": ".services.events",
    "KeyNotAccepted": ".services.keys", "NotServed": ".services.directory",
    "Phase": ".services.watchdog",
    "TransportError": ".transport",
    # The one spelling of an address (what parse_address reads), for the trainer's log.
    "format_address": "torchpass_p2p.launch.childspec",
}
"""Where each public name is defined; every name of ``__all__`` has an entry (a test checks)."""


def __getattr__(name: str) -> Any:
    """A public name (``__all__``), imported from its module on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
