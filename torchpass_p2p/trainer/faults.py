"""Seeded fault injection keyed by (rank, step, point) for end-to-end tests and the main job
(STYLE 11; torchft's ``EventInjector``).

Spec (environment ``TORCHPASS_FAULTS``, comma separated)::

    kill@37:grad:rank=1          SIGKILL itself at step 37, just before the gradient all-reduce
    stop@80:commit:rank=2:8      SIGSTOP itself at step 80 before the commit all-reduce; a helper
                                 process sends SIGCONT 8 seconds later
    orphan@37:grad:rank=1        start a grandchild in this process group that ignores SIGTERM
                                 and holds every socket of this process (its ports stay bound),
                                 then SIGKILL itself: what a dead rank's data loader worker
                                 leaves behind

Points: ``compute`` (before forward), ``grad`` (forward and backward done, peers already in the
all-reduce: mid-step), ``commit`` (gradient all-reduce done, before the commit all-reduce).
A fault fires only in a process started as a rank (``TORCHPASS_ROLE`` is not ``spare``), once:
the replacement redoing that step must not fault again. ``before(fault, **details)`` is called
just before one fires, to log it; an ``orphan`` passes ``orphan_pid`` and ``orphan_ports`` (the
local ports of the sockets it holds), so a test can check the orphan held the rank's port and is
gone after the run.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Fault", "FaultInjector", "parse_faults", "start_orphan"]

POINTS = ("compute", "grad", "commit")
KINDS = ("kill", "stop", "orphan")
ORPHAN_SLEEP_S = 3600
"""How long an orphan lives unless killed: far past any test, so only its reaping ends it."""


@dataclass(frozen=True, slots=True)
class Fault:
    """``kind`` ``kill``, ``stop`` or ``orphan``; ``seconds``: how long a ``stop`` lasts."""

    kind: str
    step: int
    point: str
    rank: int
    seconds: float = 0.0


def parse_faults(text: str) -> list[Fault]:
    """Faults from the spec above. Raises ``ValueError`` naming the bad entry."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            head, point, rank, *rest = item.split(":")
            kind, step = head.split("@")
            if kind not in KINDS or point not in POINTS or not rank.startswith(
                    "rank="):
                raise ValueError
            out.append(Fault(kind, int(step), point, int(rank[5:]),
                             float(rest[0]) if rest else 0.0))
        except ValueError:
            raise ValueError(f"bad fault {item!r}: expected kind@step:point:rank=R[:seconds]"
                             ) from None
    return out


class FaultInjector:
    """Fires the faults meant for this process. ``before(fault, **details)`` is called just
    before one fires (to log it; module docstring)."""

    def __init__(self, faults: list[Fault], *, started_as_rank: bool,
                 before: Callable[..., None] | None = None) -> None:
        self.faults = list(faults) if started_as_rank else []
        self.before = before

    @classmethod
    def from_env(cls, before: Callable[..., None] | None = None) -> FaultInjector:
        return cls(parse_faults(os.environ.get("TORCHPASS_FAULTS", "")),
                   started_as_rank=os.environ.get("TORCHPASS_ROLE", "rank") != "spare",
                   before=before)

    def at(self, step: int, point: str, rank: int) -> None:
        """Fire any fault for (``rank``, ``step``, ``point``)."""
        for f in self.faults:
            if (f.step, f.point, f.rank) == (step, point, rank):
                self.faults.remove(f)
                details: dict[str, Any] = {}
                if f.kind == "orphan":
                    orphan, ports = start_orphan()
                    details = {"orphan_pid": orphan.pid, "orphan_ports": ports}
                if self.before is not None:
                    self.before(f, **details)
                if f.kind in ("kill", "orphan"):
                    os.kill(os.getpid(), signal.SIGKILL)
                else:
                    subprocess.Popen(["sh", "-c", f"sleep {f.seconds}; kill -CONT {os.getpid()}"])
                    os.kill(os.getpid(), signal.SIGSTOP)
                return


def start_orphan() -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start a grandchild in this process group (the launcher's ``killpg`` reaches it) that
    ignores SIGTERM and inherits every socket of this process: listening ports stay bound and
    peers' connections stay open after this process dies. Returns it and the local ports of the
    IP sockets it holds."""
    fds, ports = [], set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:  # the directory listing's own descriptor, closed by now
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                ports.add(sock.getsockname()[1])
        finally:
            sock.detach()
        fds.append(fd)
    orphan = subprocess.Popen(
        ["sh", "-c", f"trap '' TERM; exec sleep {ORPHAN_SLEEP_S}"], pass_fds=fds,
        stdin=subprocess.DEVNULL)
    return orphan, sorted(ports - {0})  # 0: not bound
