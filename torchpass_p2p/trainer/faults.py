"""Seeded fault injection keyed by (rank, step, point) for end-to-end tests and the main job
(STYLE 11; torchft's ``EventInjector``).

Spec (environment ``TORCHPASS_FAULTS``, comma separated)::

    kill@37:grad:rank=1          SIGKILL itself at step 37, just before the gradient all-reduce
    stop@80:commit:rank=2:8      SIGSTOP itself at step 80 before the commit all-reduce; a helper
                                 process sends SIGCONT 8 seconds later

Points: ``compute`` (before forward), ``grad`` (forward and backward done, peers already in the
all-reduce: mid-step), ``commit`` (gradient all-reduce done, before the commit all-reduce).
A fault fires only in a process started as a rank (``TORCHPASS_ROLE`` is not ``spare``), once:
the replacement redoing that step must not fault again.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Fault", "FaultInjector", "parse_faults"]

POINTS = ("compute", "grad", "commit")


@dataclass(frozen=True, slots=True)
class Fault:
    """``kind`` ``kill`` or ``stop``; ``seconds``: how long a ``stop`` lasts."""

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
            if kind not in ("kill", "stop") or point not in POINTS or not rank.startswith(
                    "rank="):
                raise ValueError
            out.append(Fault(kind, int(step), point, int(rank[5:]),
                             float(rest[0]) if rest else 0.0))
        except ValueError:
            raise ValueError(f"bad fault {item!r}: expected kind@step:point:rank=R[:seconds]"
                             ) from None
    return out


class FaultInjector:
    """Fires the faults meant for this process. ``before(fault)`` is called just before one
    fires (to log it)."""

    def __init__(self, faults: list[Fault], *, started_as_rank: bool,
                 before: Callable[[Fault], None] | None = None) -> None:
        self.faults = list(faults) if started_as_rank else []
        self.before = before

    @classmethod
    def from_env(cls, before: Callable[[Fault], None] | None = None) -> FaultInjector:
        return cls(parse_faults(os.environ.get("TORCHPASS_FAULTS", "")),
                   started_as_rank=os.environ.get("TORCHPASS_ROLE", "rank") != "spare",
                   before=before)

    def at(self, step: int, point: str, rank: int) -> None:
        """Fire any fault for (``rank``, ``step``, ``point``)."""
        for f in self.faults:
            if (f.step, f.point, f.rank) == (step, point, rank):
                self.faults.remove(f)
                if self.before is not None:
                    self.before(f)
                if f.kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                else:
                    subprocess.Popen(["sh", "-c", f"sleep {f.seconds}; kill -CONT {os.getpid()}"])
                    os.kill(os.getpid(), signal.SIGSTOP)
                return
