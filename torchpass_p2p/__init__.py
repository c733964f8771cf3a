"""torchpass_p2p: keep PyTorch training jobs running through hardware faults.

Layers (DESIGN section 3): ``core`` is the sans-IO protocol (membership, wire format), driven by
the simulator in ``sims`` and by the agent runtime in ``agent`` (:func:`start`).
"""

from ._native import drop_stale_extensions, prefer_sources

prefer_sources()
drop_stale_extensions(__path__[0])

__version__ = "0.1.0"


def start(config=None, **settings):  # type: ignore[no-untyped-def]
    """Start this process's agent in a background thread: see :func:`.agent.api.start`.

    Imported on first use, so that the simulator and the core never load the runtime."""
    from .agent.api import start as _start

    return _start(config, **settings)
