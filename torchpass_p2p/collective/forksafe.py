"""Process groups' sockets are not inherited by forked children.

A gloo group's connections close, and its peers' operations fail at once, only when this
process drops the group (``docs/design.md`` section 13). A child forked while the group lived
(a DataLoader's worker, forked at every epoch by default) holds copies of its sockets, so the
close reaches nobody: the kernel ends a TCP connection only once every descriptor of it is
closed. The peers of a member whose collective failed while it lives on (a regroup's case)
would wait for the worker to exit, or for the group's 30-minute timeout. Measured: with a
forked child alive, a peer's operation failed only when the child exited, 15 s later.

So the sockets a group opens (:func:`sockets_made_by`, around its creation) are closed in
every child right after ``fork``: the child never uses them (its copy of the group is not
usable: the threads that drive it are not forked). A descriptor is closed there only if it is
still the same socket (its inode), so a number reused since for a pipe the child needs is left
alone.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["sockets_made_by"]

T = TypeVar("T")
_FD_DIR = "/proc/self/fd"
_LOCK = threading.Lock()
_SOCKETS: dict[int, str] = {}  # fd -> "socket:[inode]" of every group's sockets, bounded below
_MAX = 4096
"""At most this many descriptors remembered (a long job forms a group per configuration; the
oldest, long closed, are forgotten first)."""


def _sockets() -> dict[int, str]:
    """This process's socket descriptors, by number (empty where ``/proc`` is not mounted)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def sockets_made_by(create: Callable[[], T]) -> T:
    """``create()``, remembering the sockets that appeared while it ran as a process group's:
    each child forked from now on closes them (module docstring). A socket another thread
    opened meanwhile is remembered too, and closed in the children only, which use none of
    their parent's."""
    before = _sockets()
    made = create()
    new = {fd: t for fd, t in _sockets().items() if before.get(fd) != t}
    with _LOCK:
        _SOCKETS.update(new)
        while len(_SOCKETS) > _MAX:
            del _SOCKETS[next(iter(_SOCKETS))]
    return made


def _close_in_child() -> None:
    for fd, target in list(_SOCKETS.items()):
        try:
            if os.readlink(f"{_FD_DIR}/{fd}") == target:
                os.close(fd)
        except OSError:
            pass
    _SOCKETS.clear()


os.register_at_fork(after_in_child=_close_in_child)
