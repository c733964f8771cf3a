"""One child process: started in its own session, so its whole process group can be signalled.

``start_new_session`` makes the child the leader of a new process group (and session): a signal
forwarded with ``killpg`` reaches the script and everything it started (data loader workers),
the terminal's Ctrl-C does not reach children directly (the launcher forwards it), and the
grandchildren left behind after the child exits can still be killed through the group.

A descendant that left the group (its own ``setsid``) escapes ``killpg``. The launcher is
therefore a child subreaper (prctl(2) ``PR_SET_CHILD_SUBREAPER``, Linux): such an orphan is
re-parented to the launcher rather than to init, and :func:`kill_strays` finds and kills it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from ..agent.lifeline import LAUNCHER_PID_VARIABLE, prctl
from .childspec import ChildSpec

__all__ = ["Child", "become_subreaper", "children_of", "kill_strays"]

_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


class Child:
    """A started process for ``spec``. Create with :meth:`start`."""

    def __init__(self, spec: ChildSpec, process: asyncio.subprocess.Process) -> None:
        self.spec = spec
        self.process = process
        self.pgid = process.pid  # leader of its own group (start_new_session)
        self.signalled = False
        """Whether the launcher has signalled this child (its exit is then no failure)."""

    @classmethod
    async def start(cls, spec: ChildSpec, argv: Sequence[str], env: Mapping[str, str], *,
                    pass_fds: Sequence[int] = ()) -> Child:
        """Start ``argv`` with ``env`` in a new session; stdin is ``/dev/null``, stdout and
        stderr are the launcher's, ``pass_fds`` (its reserved sockets) are inherited under the
        same numbers. ``TORCHPASS_LAUNCHER_PID`` names this process, so that the
        child's agent can ask to die with it (:mod:`torchpass_p2p.agent.lifeline`).

        Raises:
            OSError: the executable could not be started.
        """
        process = await asyncio.create_subprocess_exec(
            *argv, env={**env, LAUNCHER_PID_VARIABLE: str(os.getpid())},
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True, pass_fds=tuple(pass_fds))
        return cls(spec, process)

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    async def wait(self) -> int:
        """The exit status: the exit code, or ``-N`` after death by signal ``N``."""
        return await self.process.wait()

    @property
    def stopped(self) -> bool:
        """Whether the child is stopped by a signal (SIGSTOP, SIGTSTP; ``T`` in
        ``/proc/PID/stat``, Linux; False where that cannot be read). A stopped process runs no
        code, so it can finish nothing and act on no signal but SIGKILL until it is continued."""
        if not self.running:
            return False
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as f:
                # "pid (comm) state ...": comm may hold spaces or parentheses; state follows
                # the last ")".
                return f.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
        except (OSError, IndexError):
            return False

    def send(self, sig: int) -> None:
        """Send ``sig`` to the child's process group if the child still runs. A termination
        request (SIGTERM, SIGINT, SIGHUP) is followed by SIGCONT, as systemd does when it stops a
        unit: a stopped process would otherwise act on it only when continued, after the
        caller's grace period."""
        if not self.running:
            return
        self.signalled = True
        _killpg(self.pgid, sig)
        if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            _killpg(self.pgid, signal.SIGCONT)

    def kill_group(self) -> list[int]:
        """SIGKILL whatever is left in the child's process group (orphans after it exited);
        returns the pids that were in it (Linux; empty elsewhere).

        Only call this while the child is running or just after it was reaped by this launcher,
        before the group id could be reused."""
        left = [pid for pid, _, pgrp, state in _processes()
                if pgrp == self.pgid and state != "Z"]
        _killpg(self.pgid, signal.SIGKILL)
        return left


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (module docstring). False where the
    platform has no such thing; then :func:`kill_strays` finds nothing."""
    return prctl(_PR_SET_CHILD_SUBREAPER, 1)


def kill_strays(known: Collection[int]) -> list[int]:
    """SIGKILL this process's children that are not in ``known`` (the launcher's own children):
    descendants of a dead child that had left its process group and were re-parented here.
    Returns their pids. Strays already dead are reaped (they are ours to reap: asyncio waits
    only for the children it started)."""
    me = os.getpid()
    killed = []
    for pid, ppid, _, state in _processes():
        if ppid != me or pid in known:
            continue
        try:
            if state != "Z":
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            # Never block on a process stuck in the kernel: a later call, or init once we
            # have exited, reaps what is left.
            os.waitpid(pid, os.WNOHANG)
        except (ProcessLookupError, ChildProcessError):
            pass
    return killed


def children_of(parent: int) -> list[int]:
    """Pids of the live (not zombie) processes whose parent is ``parent`` (``/proc``; empty
    elsewhere)."""
    return [pid for pid, ppid, _, state in _processes() if ppid == parent and state != "Z"]


def _processes() -> list[tuple[int, int, int, str]]:
    """(pid, parent pid, process group, state) of every process, from ``/proc`` (empty
    elsewhere); state ``Z`` is a zombie."""
    out = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue  # it exited meanwhile
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        out.append((int(stat[:stat.index(" ")]), int(fields[1]), int(fields[2]), fields[0]))
    return out


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty (or its id was taken by someone we may not signal)
