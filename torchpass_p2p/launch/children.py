"""One child process: started in its own session, so its whole process group can be signalled.

``start_new_session`` makes the child the leader of a new process group (and session): a signal
forwarded with ``killpg`` reaches the script and everything it started (data loader workers),
the terminal's Ctrl-C does not reach children directly (the launcher forwards it), and the
grandchildren left behind after the child exits can still be killed through the group.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping, Sequence

from ..agent.lifeline import LAUNCHER_PID_VARIABLE
from .plan import ChildSpec

__all__ = ["Child"]


class Child:
    """A started process for ``spec``. Create with :meth:`start`."""

    def __init__(self, spec: ChildSpec, process: asyncio.subprocess.Process) -> None:
        self.spec = spec
        self.process = process
        self.pgid = process.pid  # leader of its own group (start_new_session)
        self.signalled = False
        """Whether the launcher has signalled this child (its exit is then no failure)."""

    @classmethod
    async def start(cls, spec: ChildSpec, argv: Sequence[str], env: Mapping[str, str]) -> Child:
        """Start ``argv`` with ``env`` in a new session; stdin is ``/dev/null``, stdout and
        stderr are the launcher's. ``TORCHPASS_LAUNCHER_PID`` names this process, so that the
        child's agent can ask to die with it (:mod:`torchpass_p2p.agent.lifeline`).

        Raises:
            OSError: the executable could not be started.
        """
        process = await asyncio.create_subprocess_exec(
            *argv, env={**env, LAUNCHER_PID_VARIABLE: str(os.getpid())},
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        return cls(spec, process)

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    async def wait(self) -> int:
        """The exit status: the exit code, or ``-N`` after death by signal ``N``."""
        return await self.process.wait()

    def send(self, sig: int) -> None:
        """Send ``sig`` to the child's process group if the child still runs."""
        if not self.running:
            return
        self.signalled = True
        _killpg(self.pgid, sig)

    def kill_group(self) -> None:
        """SIGKILL whatever is left in the child's process group (orphans after it exited).

        Only call this while the child is running or just after it was reaped by this launcher,
        before the group id could be reused."""
        _killpg(self.pgid, signal.SIGKILL)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty (or its id was taken by someone we may not signal)
