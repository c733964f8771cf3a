"""The checkpoint settings a launcher hands its children, by environment variable.

* ``TORCHPASS_CHECKPOINT_DIR``: where checkpoints go; unset: no checkpoints.
* ``TORCHPASS_CHECKPOINT_EVERY``: :class:`~.schedule.Every` (default ``auto``).
* ``TORCHPASS_CHECKPOINT_KEEP``: complete checkpoints kept (default 3).
* ``TORCHPASS_MTBF_CORRELATED``: seconds between correlated failures, for ``auto``
  (default :data:`~.schedule.DEFAULT_MTBF_S`).
* ``TORCHPASS_RUN_ID``: the run's id, recorded in each checkpoint and checked at a resume.
* ``TORCHPASS_RESUME_STEP``: the step of the checkpoint the ranks of configuration 0 resume
  from (the launcher chose the newest complete one); unset: they start at step 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .schedule import DEFAULT_MTBF_S, Every

__all__ = ["DEFAULT_KEEP", "VARIABLES", "CheckpointSettings"]

DEFAULT_KEEP = 3
"""Complete checkpoints kept: the newest may be cut short by the failure it is for; two more
survive one bad one."""
VARIABLES = ("TORCHPASS_CHECKPOINT_DIR", "TORCHPASS_CHECKPOINT_EVERY",
             "TORCHPASS_CHECKPOINT_KEEP", "TORCHPASS_MTBF_CORRELATED", "TORCHPASS_RUN_ID",
             "TORCHPASS_RESUME_STEP")


@dataclass(frozen=True)
class CheckpointSettings:
    """Where, how often and how many; ``resume_step``: the checkpoint to start from."""

    directory: str
    run_id: str
    every: Every = Every()
    keep: int = DEFAULT_KEEP
    mtbf_s: float = DEFAULT_MTBF_S
    resume_step: int | None = None

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError("--checkpoint-keep must be >= 1")
        if not self.mtbf_s > 0:
            raise ValueError("--mtbf-correlated must be > 0 seconds")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> CheckpointSettings | None:
        """The settings in ``environ``; None when ``TORCHPASS_CHECKPOINT_DIR`` is unset.
        Raises ``ValueError`` for a malformed value (naming the variable)."""
        directory = environ.get("TORCHPASS_CHECKPOINT_DIR", "")
        if not directory:
            return None
        try:
            resume = environ.get("TORCHPASS_RESUME_STEP", "")
            return cls(directory, environ.get("TORCHPASS_RUN_ID", ""),
                       Every.parse(environ.get("TORCHPASS_CHECKPOINT_EVERY", "auto")),
                       int(environ.get("TORCHPASS_CHECKPOINT_KEEP", DEFAULT_KEEP)),
                       float(environ.get("TORCHPASS_MTBF_CORRELATED", DEFAULT_MTBF_S)),
                       int(resume) if resume else None)
        except ValueError as exc:
            raise ValueError(f"checkpoint settings (TORCHPASS_CHECKPOINT_*): {exc}") from None

    def to_env(self) -> dict[str, str]:
        env = {"TORCHPASS_CHECKPOINT_DIR": self.directory, "TORCHPASS_RUN_ID": self.run_id,
               "TORCHPASS_CHECKPOINT_EVERY": str(self.every),
               "TORCHPASS_CHECKPOINT_KEEP": str(self.keep),
               "TORCHPASS_MTBF_CORRELATED": repr(self.mtbf_s)}
        if self.resume_step is not None:
            env["TORCHPASS_RESUME_STEP"] = str(self.resume_step)
        return env
