"""What the kernel dropped on one socket before this process could read it.

A UDP socket whose receive buffer is full when a datagram arrives loses that datagram in the
kernel (a burst of datagrams faster than the agent reads them loses most that way); a listening
TCP socket whose accept queue is full drops the connection attempt's packets. Neither reaches
the program, so no reason of its own can count them: the kernel does, per socket, in
``sk_drops``.

Read here with ``getsockopt(SOL_SOCKET, SO_MEMINFO)`` (Linux 4.12 and later): nine 32-bit
values, ``SK_MEMINFO_DROPS`` the last (``include/uapi/linux/sock_diag.h``). Chosen over the two
other readings of the same counter: ``SO_RXQ_OVFL`` hands it over only as ancillary data of
``recvmsg``, which asyncio's and uvloop's datagram transports never ask for; the ``drops``
column of ``/proc/net/udp`` needs the socket's inode found among every UDP socket of the
network namespace (and has no TCP counterpart). ``SO_MEMINFO`` is one system call on the socket
itself, for any socket kind, from any thread.

What ``sk_drops`` counts: for UDP, datagrams refused because the receive buffer was full (by far
the most), failed the checksum (which the NIC usually checked already) or a socket filter; for a
listening TCP socket, SYNs and handshake completions dropped because its accept queue was full
(each retransmission again: a count of packets, not of connections). It is cumulative since the
socket was created and 32 bits wide (it wraps after 4.3 billion drops).
"""

from __future__ import annotations

import socket
import struct
import sys
from typing import Protocol

__all__ = ["SO_MEMINFO", "socket_drops"]

SO_MEMINFO: int = getattr(socket, "SO_MEMINFO", 55)
"""The option's number: 55 in ``asm-generic/socket.h`` (x86, Arm, RISC-V, PowerPC, s390); Python
does not name it."""
_SK_MEMINFO_DROPS = 8  # index in the array (sock_diag.h)
_VALUES = struct.Struct("=9I")


class _Socket(Protocol):
    def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes: ...


def socket_drops(sock: _Socket) -> int | None:
    """Packets the kernel dropped on ``sock`` (a ``socket.socket``, or the wrapper an asyncio or
    uvloop transport hands out as ``get_extra_info("socket")``) since it was created; None where
    that cannot be read: not Linux, a kernel before 4.12, or a closed socket. Never raises."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _VALUES.size)
    except (OSError, TypeError, ValueError):
        return None
    if len(raw) < _VALUES.size:
        return None
    return int(_VALUES.unpack_from(raw)[_SK_MEMINFO_DROPS])
