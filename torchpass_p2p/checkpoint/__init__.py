"""Last-resort checkpoints (``docs/checkpoints.md``): when in-memory recovery is impossible
(the launcher or its host lost, every holder of a state gone, no majority left), a new
``torchpass-p2p launch`` with the same run id and directory resumes from the newest complete
checkpoint.

:mod:`.store` (the directory, torch-free), :mod:`.schedule` (when to save, Young's formula),
:mod:`.settings` (the launcher's contract with its children) and :mod:`.writer` (the saves
and the load, with ``torch.distributed.checkpoint``; imported on use).
"""

from .schedule import DEFAULT_MTBF_S, Every, Schedule, young_interval_s
from .settings import DEFAULT_KEEP, CheckpointSettings
from .store import Marker, NotSameJob, newest_complete, prune, read_marker, same_job

__all__ = [
    "DEFAULT_KEEP", "DEFAULT_MTBF_S", "CheckpointSettings", "Every", "Marker", "NotSameJob",
    "Schedule", "newest_complete", "prune", "read_marker", "same_job", "young_interval_s",
]
