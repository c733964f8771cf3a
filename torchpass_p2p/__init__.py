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

    Imported on first use, and by name, so that neither the simulator nor the mypyc build of
    the core (which type-checks what it imports) loads the runtime."""
    import importlib

    return importlib.import_module("torchpass_p2p.agent.api").start(config, **settings)
