"""Sockets inherited from the launcher, already bound (:mod:`torchpass_p2p.launch.ports`)."""

from __future__ import annotations

import socket

from torchpass_p2p.core.configuration import Address

__all__ = ["adopt_socket"]


def adopt_socket(fd: int, kind: socket.SocketKind, address: Address) -> socket.socket:
    """The socket of inherited descriptor ``fd``, checked to be of ``kind`` (``SOCK_DGRAM`` or
    ``SOCK_STREAM``) and bound to ``address``'s port (any port when it is 0); made
    non-blocking and not inherited further (a training script's own subprocesses must not
    hold the agent's ports).

    Raises:
        OSError: ``fd`` is not an open socket, or not of that kind or port (a stale
            ``TORCHPASS_BIND_FDS`` or ``TORCHPASS_STATUS_FD`` outside the launcher).
    """
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise OSError(f"descriptor {fd}: not an open socket ({exc.strerror})") from exc
    port = sock.getsockname()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else None
    if sock.type != kind or port is None or address[1] not in (0, port):
        sock.detach()  # not ours to close
        raise OSError(f"descriptor {fd}: not a {kind.name} socket bound to port {address[1]}")
    sock.set_inheritable(False)
    sock.setblocking(False)
    return sock
