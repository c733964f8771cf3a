"""Die with the launcher: a child of ``torchpass-p2p launch`` must not outlive it.

The launcher forwards SIGINT and SIGTERM and reaps its children, but a launcher that is itself
SIGKILLed (an OOM kill, a scheduler's hard timeout) cannot; its children, each the leader of its
own session, would train on as orphans holding ports and CPU. Linux's ``PR_SET_PDEATHSIG``
(prctl(2)) makes the kernel SIGKILL this process when its parent dies. The launcher names
itself in ``TORCHPASS_LAUNCHER_PID``; the request is made only when that process is our parent
(a script started through a wrapper shell has another parent, and is left alone).

A launched child also prints every thread's Python stack to its standard error on ``SIGUSR1``
(:mod:`faulthandler`), so a hung job can be read before it is killed: ``kill -USR1 PID``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import os
import signal
import sys
from collections.abc import Mapping

__all__ = ["LAUNCHER_PID_VARIABLE", "STACKS_SIGNAL", "die_with_launcher", "prctl"]

LAUNCHER_PID_VARIABLE = "TORCHPASS_LAUNCHER_PID"
STACKS_SIGNAL = signal.SIGUSR1
"""Dumps every thread's stack in a launched child (the signal of the example in
:func:`faulthandler.register`'s documentation). Harmless if sent for another reason (SLURM's
``--signal`` often uses it): the child prints its stacks and trains on."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """Ask the kernel to SIGKILL this process when its launcher dies.

    Also registers :data:`STACKS_SIGNAL` to print every thread's stack to standard error.
    Returns True when the request is in place; False when no launcher is named, the launcher is
    not our parent, or the platform has no ``prctl`` (then nothing changes). If the launcher
    died before the request was made we are already orphaned, and exit at once with status 1.
    """
    value = environ.get(LAUNCHER_PID_VARIABLE, "")
    if not value.isdigit() or not sys.platform.startswith("linux"):
        return False
    launcher = int(value)
    if os.getppid() != launcher:
        return False
    if not prctl(_PR_SET_PDEATHSIG, signal.SIGKILL):
        return False
    if os.getppid() != launcher:  # it died between the check and the request
        os._exit(1)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    return True


def prctl(option: int, value: int) -> bool:
    """Linux prctl(2) ``option`` set to ``value``; False where it failed or does not exist."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return bool(libc.prctl(option, value, 0, 0, 0) == 0)
