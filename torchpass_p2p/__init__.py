"""torchpass_p2p: keep PyTorch training jobs running through hardware faults.

Layers (docs/design.md section 3): ``core`` is the sans-IO protocol (membership, wire format),
driven by the simulator in ``sims`` and by the agent runtime in ``agent`` (:func:`start`).

A training script imports what it uses from here: :func:`start`, the training API
(``init_process_group``, ``DistributedDataParallel``, ...), :class:`~.trainer.Trainer`, the ends
of training (``Removed``, ``Drained``, ``Stopped``) and their exit codes (``exit_code_for``,
``EXIT_*``). Each is imported on first use, so that importing this package loads neither torch
nor the runtime.
"""

from ._native import prefer_sources

prefer_sources()

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
"""The training API (:mod:`.ddp`)."""
_ENDS = frozenset({"EXIT_FAILED", "Drained", "Removed", "Stopped", "exit_code_for"})
"""How training ends and the exit code of each end (:mod:`.trainer.ends`)."""
_EXIT_CODES = frozenset({"EXIT_DRAINED", "EXIT_KEY_REFUSED", "EXIT_REMOVED", "EXIT_STOPPED"})
"""The launcher's exit codes (:mod:`.launch.outcome`); these import neither torch nor the
runtime."""
_AGENT = frozenset({"AgentError", "TrainingAgent"})
"""The agent as a script holds it (:mod:`.agent`): what :func:`start` raises, and the interface
:class:`~.trainer.Trainer` takes."""

_HOMES = {
    **dict.fromkeys(_TRAINING, "torchpass_p2p.ddp"),
    **dict.fromkeys(_ENDS, "torchpass_p2p.trainer.ends"),
    **dict.fromkeys(_EXIT_CODES, "torchpass_p2p.launch.outcome"),
    **dict.fromkeys(_AGENT, "torchpass_p2p.agent"),
    "Trainer": "torchpass_p2p.trainer",
}
"""Where each name a training script imports from here is defined."""


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    """The names a training script uses (:data:`_HOMES`), imported on first use like
    :func:`start`."""
    home = _HOMES.get(name)
    if home is not None:
        import importlib

        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'torchpass_p2p' has no attribute {name!r}")
