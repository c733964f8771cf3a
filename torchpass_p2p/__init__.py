"""torchpass_p2p: keep PyTorch training jobs running through hardware faults.

Layers (docs/design.md section 3): ``core`` is the sans-IO protocol (membership, wire format),
driven by the simulator in ``sims`` and by the agent runtime in ``agent`` (:func:`start`).
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


_TRAINING = frozenset({
    "DataLoader", "DistributedDataParallel", "DistributedSampler", "JobMismatch",
    "destroy_process_group", "epochs", "get_rank", "get_world_size", "init_process_group",
    "track",
})


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    """The training API (:mod:`.ddp`), imported on first use like :func:`start`."""
    if name in _TRAINING:
        import importlib

        return getattr(importlib.import_module("torchpass_p2p.ddp"), name)
    raise AttributeError(f"module 'torchpass_p2p' has no attribute {name!r}")
