"""How many bytes a TCP socket has sent and not yet seen acknowledged: the peer taking them.

A sender whose socket buffer is full is woken (``POLLOUT``) only once a third of it is free, so
between two sends that move bytes the peer may take megabytes: behind a 2 MB/s link shared by 7
sources, a 4 MiB buffer drains a third in ~5 s. Deadlines of the form "no progress for T" count
the queue going down as progress (:meth:`.frames.Conn.poll_sent`, :func:`.splice.send_pages`).
"""

from __future__ import annotations

import fcntl
import struct
import termios

__all__ = ["queued"]

_OUTQ = getattr(termios, "TIOCOUTQ", None)  # == SIOCOUTQ for a TCP socket (Linux)
_INT = struct.Struct("i")


def queued(fd: int) -> int | None:
    """Bytes in socket ``fd``'s send queue, sent or not, not yet acknowledged (``SIOCOUTQ``);
    None where that cannot be read (not Linux, a closed descriptor)."""
    if _OUTQ is None or fd < 0:
        return None
    try:
        return int(_INT.unpack(fcntl.ioctl(fd, _OUTQ, b"\0" * _INT.size))[0])
    except (OSError, ValueError):
        return None
