"""The trainer's timeline: one JSON line per event, for recovery timelines and tests.

Each record has ``t`` (``time.monotonic()`` seconds: CLOCK_MONOTONIC, one clock for every
process on a host, the same clock as the agent's event times), ``event``, ``member`` (16 hex
digits) and whatever the event adds. Each record also goes to ``sink``, if given (the
agent's :class:`~torchpass_p2p.agent.history.History`, which the status page shows).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchpass_p2p.core.messages import format_member_id

__all__ = ["EventLog"]


class EventLog:
    """Appends to ``path`` (line buffered; its folder is made if missing); ``path`` None:
    keeps nothing. Thread-safe: the training thread and the state service's thread (a
    ``serve`` fault) both log. ``sink(record)``, if given, is called with every record, also
    without a ``path``; it must be quick and thread-safe, and what it raises is the caller's."""

    def __init__(self, path: str | os.PathLike[str] | None, member: int, *,
                 sink: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.member = format_member_id(member)
        self._sink = sink
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the run
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        if self._file is None and self._sink is None:
            return
        record = {"t": time.monotonic(), "event": event, "member": self.member, **fields}
        if self._sink is not None:
            self._sink(record)
        if self._file is None:
            return
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
