"""Sockets inherited from the launcher, already bound (:mod:`torchpass_p2p.launch.ports`)."""

from __future__ import annotations

import socket

from torchpass_p2p.core.configuration import Address

__all__ = ["INHERITED_VARIABLES", "NotInherited", "adopt_socket"]

INHERITED_VARIABLES = ("TORCHPASS_BIND_FDS", "TORCHPASS_STATUS_FD")
"""The variables naming inherited descriptors: consumed by the first agent of the process."""

LISTEN_BACKLOG = 128
"""Pending connections per listening socket (aiohttp's default)."""


class NotInherited(OSError):
    """The descriptor is not the socket the launcher handed over: a wrapper process between
    the launcher and the training script did not pass it on (Python's ``subprocess`` closes
    descriptors by default; the wrapper still holds the port, so binding it again would fail
    too), or the variables were copied into another process."""


_HINT = ("the launcher hands its child these sockets, bound; a wrapper process must pass them "
         "on (exec, or subprocess with pass_fds or close_fds=False)")


def adopt_socket(fd: int, kind: socket.SocketKind, address: Address) -> socket.socket:
    """The socket of inherited descriptor ``fd``, checked to be of ``kind`` (``SOCK_DGRAM`` or
    ``SOCK_STREAM``) and bound to ``address``'s port (any port when it is 0); made
    non-blocking and not inherited further (a training script's own subprocesses must not
    hold the agent's ports). A ``SOCK_STREAM`` socket is listening on return: uvloop's
    ``start_server(sock=...)`` would swallow a failed ``listen()`` (another socket with
    ``SO_REUSEADDR`` bound to the same port and listening first) instead of raising it.

    Raises:
        NotInherited: ``fd`` is not an open socket, or not of that kind or port (left open).
        OSError: ``listen()`` failed (``fd`` is then closed).
    """
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise NotInherited(f"descriptor {fd}: not an open socket ({exc.strerror}); "
                           f"{_HINT}") from exc
    port = sock.getsockname()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else None
    if sock.type != kind or port is None or address[1] not in (0, port):
        sock.detach()  # not ours to close
        raise NotInherited(f"descriptor {fd}: not a {kind.name} socket bound to port "
                           f"{address[1]}; {_HINT}")
    try:
        if kind == socket.SOCK_STREAM:
            sock.listen(LISTEN_BACKLOG)
        sock.set_inheritable(False)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
