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
    kill@37:serve:rank=2:0.25    SIGKILL itself while its transfer server serves the state
                                 after 37 or more steps to a fetching member (a promoted spare),
                                 as soon as one transfer has been sent a quarter of that
                                 state's bytes: a source dying mid-transfer (S10)
    kill@60:finish:rank=1        SIGKILL itself after the last of 60 steps, before the final
                                 barrier: its peers are in that barrier
    kill@37:enter:rank=3         SIGKILL itself as it enters a configuration that resumes at
                                 step 37 holding rank 3 there, just after its change was
                                 decided, before it announces its state: a survivor dying
                                 during the recovery, when the promoted spare counts on it as
                                 a source
    reset@20:grad:rank=1         a transient collective failure, no process dying: at step 20,
                                 just before the gradient all-reduce, rank 1's operation fails
                                 as if gloo had raised (:class:`InjectedReset`, a
                                 ``CollectiveError``); the trainer abandons the group like after
                                 any failed collective, and the dropped references close its
                                 connections, so its peers' operations fail too (docs/design.md
                                 section 13). No member is suspected: the ranks regroup in the same
                                 configuration (:mod:`.regroup`)

Points: ``compute`` (before forward), ``grad`` (forward and backward done, peers already in the
all-reduce: mid-step; a DDP session: before its last bucket and its vote leave, so nobody can
commit the step), ``commit`` (the step loop: gradient all-reduce done, before the commit
all-reduce; a DDP session, whose vote leaves with the last bucket: reduction and votes done,
before this rank takes the averaged gradient and rank 0's buffers, so that the others commit
the step while this rank is left inside it without either),
``enter`` (a rank holder entering a new configuration, its step the resume step and its rank
the one it holds there; also a rank entering the configuration it was started in, at step 0,
before its first group forms; not for ``reset``: no operation is in flight), ``finish``
(every step applied, before the final barrier that all ranks pass before any leaves: its step
is the number of steps trained), and ``serve``
(only for ``kill``; its number is the fraction of the snapshot, ``0 < f < 1``, that one
transfer has been sent over all its connections: checked after each chunk, so the kill lands
between two chunks, with the receiver's further requests unanswered). The step of a
``serve`` fault is the served snapshot's step (the state after that many steps), at least that;
its rank is this member's rank in the configuration it is entering or training in
(``rank_of()``). A ``reset`` takes no number and any point but ``serve``.

A fault fires only in a process started as a rank (``TORCHPASS_ROLE`` is not ``spare``), and
only in the one started as the fault's rank (``RANK``, when set), once: the replacement redoing
that step must not fault again, nor a survivor that policy ``shrink`` renumbered to that rank.
``before(fault, **details)`` is called just before one fires, to log it; an ``orphan`` passes
``orphan_pid`` and ``orphan_ports`` (the local ports of the sockets it holds), so a test can
check the orphan held the rank's port and is gone after the run; a ``serve`` fault passes
``snapshot_step``, ``served_bytes`` (sent to that transfer, over all its connections) and
``total_bytes``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchpass_p2p.collective import CollectiveError

__all__ = ["Fault", "FaultInjector", "InjectedReset", "continue_later", "parse_faults",
           "start_orphan"]

POINTS = ("compute", "grad", "commit", "enter", "finish", "serve")
KINDS = ("kill", "stop", "orphan", "reset")
ORPHAN_SLEEP_S = 3600
"""How long an orphan lives unless killed: far past any test, so only its reaping ends it."""


@dataclass(frozen=True, slots=True)
class Fault:
    """``kind`` ``kill``, ``stop``, ``orphan`` or ``reset``; ``seconds``: how long a ``stop`` lasts;
    ``fraction``: of the snapshot sent to one transfer before a ``serve`` fault fires."""

    kind: str
    step: int
    point: str
    rank: int
    seconds: float = 0.0
    fraction: float = 0.0


def parse_faults(text: str) -> list[Fault]:
    """Faults from the spec above. Raises ``ValueError`` naming the bad entry."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            head, point, rank, *rest = item.split(":")
            kind, step = head.split("@")
            if kind not in KINDS or point not in POINTS or not rank.startswith(
                    "rank=") or len(rest) > 1:
                raise ValueError
            number = float(rest[0]) if rest else 0.0
            if kind == "reset" and (rest or point in ("serve", "enter")):
                raise ValueError
            if point == "serve":
                if kind != "kill" or not 0.0 < number < 1.0:
                    raise ValueError
                out.append(Fault(kind, int(step), point, int(rank[5:]), fraction=number))
            else:
                out.append(Fault(kind, int(step), point, int(rank[5:]), number))
        except ValueError:
            raise ValueError(f"bad fault {item!r}: expected kind@step:point:rank=R[:seconds] "
                             "or kill@step:serve:rank=R:fraction "
                             "or reset@step:point:rank=R") from None
    return out


class InjectedReset(CollectiveError):
    """The ``reset`` fault: this rank's collective fails without any process dying (the
    trainer treats it as any :class:`CollectiveError`). ``config_id`` is -1: the injector does
    not know the group."""


class FaultInjector:
    """Fires the faults meant for this process: those of ``started_as``, the rank it was started
    as (None for a spare: a spare never faults, even once it holds a rank; a survivor that
    policy shrink renumbered does not fire the dead rank's fault again). ``before(fault,
    **details)`` is called just before one fires (to log it; module docstring). :meth:`at`
    runs on the training thread, :meth:`served` on the transfer server's; a lock keeps each
    fault firing once."""

    def __init__(self, faults: list[Fault], *, started_as: int | None,
                 before: Callable[..., None] | None = None) -> None:
        self.faults = [f for f in faults if f.rank == started_as]
        self.before = before
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, before: Callable[..., None] | None = None) -> FaultInjector:
        """From ``TORCHPASS_FAULTS``, ``TORCHPASS_ROLE`` and ``RANK`` (the launcher's)."""
        rank = os.environ.get("RANK", "")
        spare = os.environ.get("TORCHPASS_ROLE", "rank") == "spare"
        return cls(parse_faults(os.environ.get("TORCHPASS_FAULTS", "")),
                   started_as=None if spare or not rank.isdigit() else int(rank), before=before)

    @property
    def serving(self) -> bool:
        """Whether a ``serve`` fault is still armed."""
        return any(f.point == "serve" for f in self.faults)

    def served(self, step: int, served_bytes: int, total_bytes: int, rank: int | None) -> None:
        """After a chunk was sent: fire a ``serve`` fault of ``rank`` armed at ``step`` or
        earlier once ``served_bytes`` (of this transfer) reach its fraction of
        ``total_bytes`` (the transfer server's ``on_served``)."""
        with self._lock:
            for f in self.faults:
                if (f.point == "serve" and f.rank == rank and step >= f.step
                        and served_bytes >= f.fraction * total_bytes):
                    self.faults.remove(f)
                    break
            else:
                return
        if self.before is not None:
            self.before(f, snapshot_step=step, served_bytes=served_bytes,
                        total_bytes=total_bytes)
        os.kill(os.getpid(), signal.SIGKILL)

    def at(self, step: int, point: str, rank: int) -> None:
        """Fire any fault for (``rank``, ``step``, ``point``).

        Raises:
            InjectedReset: a ``reset`` fault fired (every other kind ends or stops the
                process).
        """
        with self._lock:
            due = [f for f in self.faults if (f.step, f.point, f.rank) == (step, point, rank)]
            if not due:
                return
            f = due[0]
            self.faults.remove(f)
        details: dict[str, Any] = {}
        if f.kind == "orphan":
            orphan, ports = start_orphan()
            details = {"orphan_pid": orphan.pid, "orphan_ports": ports}
        if self.before is not None:
            self.before(f, **details)
        if f.kind == "reset":
            raise InjectedReset(f"injected reset at step {step} ({point}) of rank {rank}", -1)
        if f.kind in ("kill", "orphan"):
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            continue_later(f.seconds)
            os.kill(os.getpid(), signal.SIGSTOP)


def continue_later(seconds: float) -> subprocess.Popen[bytes]:
    """Start the helper that sends this process SIGCONT after ``seconds`` (a ``stop`` fault).
    It dies with this process (``setpriv --pdeathsig KILL``, util-linux, where installed): a
    helper outliving a killed rank would send SIGCONT to whatever process gets the pid next."""
    command = ["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"]
    if shutil.which("setpriv"):
        command = ["setpriv", "--pdeathsig", "KILL", "--", *command]
    return subprocess.Popen(command)


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
