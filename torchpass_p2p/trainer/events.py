"""The trainer's timeline: one JSON line per event, for recovery timelines and tests.

Each record has ``t`` (``time.monotonic()`` seconds: CLOCK_MONOTONIC, one clock for every
process on a host, the same clock as the agent's event times), ``event``, ``member`` (16 hex
digits) and whatever the event adds.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

__all__ = ["EventLog"]


class EventLog:
    """Appends to ``path`` (line buffered); ``path`` None: keeps nothing."""

    def __init__(self, path: str | os.PathLike[str] | None, member: int) -> None:
        self.member = f"{member:016x}"
        self._file = open(path, "a", buffering=1) if path is not None else None  # noqa: SIM115

    def __call__(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"t": time.monotonic(), "event": event, "member": self.member, **fields}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
