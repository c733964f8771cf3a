"""Ports on the bind host, held from the moment they are chosen until a child owns them.

An agent uses one number for its UDP gossip socket and its TCP stream port
(``TORCHPASS_BIND``), and a second TCP port for its status page (``TORCHPASS_STATUS``).
Configuration 0 names every address before any child starts, so the numbers are chosen first;
finding a free number, closing it and letting the child bind it later is a race with every
other ``bind(0)`` and ``connect()`` on the host (on a busy host a rank's own gloo listener or
TCP store could take a spare's port, and the spare dies at start). So the launcher binds the
sockets itself (:func:`reserve_ports`) and passes them to the child (``pass_fds``, named by
``TORCHPASS_BIND_FDS`` and ``TORCHPASS_STATUS_FD``); the child listens on them as they are.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

__all__ = ["Reservation", "reserve_ports"]

_MAX_TRIES_PER_PORT = 64
"""Attempts to find a number that is free for both UDP and TCP before giving up: a kernel hands
out ephemeral TCP ports that are busy for UDP only rarely, so 64 misses mean something is wrong."""


@dataclass
class Reservation:
    """One port held by bound, not yet listening sockets: ``(udp, tcp)`` or ``(tcp,)``."""

    port: int
    sockets: tuple[socket.socket, ...]

    @property
    def fds(self) -> tuple[int, ...]:
        """The sockets' descriptors, in :attr:`sockets` order."""
        return tuple(s.fileno() for s in self.sockets)

    def hand_over(self) -> tuple[int, ...]:
        """The descriptors, now owned by the caller (an agent in this process adopts them)."""
        return tuple(s.detach() for s in self.sockets)

    def close(self) -> None:
        """Release the port (after the child holding its own copies has started)."""
        for sock in self.sockets:
            sock.close()


def reserve_ports(count: int, host: str = "127.0.0.1", *, udp: bool = True,
                  ports: Sequence[int] | None = None) -> list[Reservation]:
    """``count`` distinct ports on ``host``, each held by a bound TCP socket (and a UDP socket
    of the same number when ``udp``): ``ports`` when given, else free ones the kernel picks.
    The caller owns the sockets (:meth:`Reservation.close`).

    Raises:
        OSError: ``host`` cannot be bound, a port of ``ports`` is taken, or no free number
            was found in a bounded number of tries.
        ValueError: ``ports`` is not ``count`` distinct numbers.
    """
    if ports is not None and (len(ports) != count or len(set(ports)) != count):
        raise ValueError(f"{count} distinct ports to reserve, {list(ports)} given")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held: list[Reservation] = []
    with ExitStack() as on_error:
        on_error.callback(_close_all, held)
        tries = 0
        while len(held) < count:
            tries += 1
            if tries > _MAX_TRIES_PER_PORT * max(count, 1):
                raise OSError(f"no port free for both TCP and UDP on {host}")
            wanted = 0 if ports is None else ports[len(held)]
            tcp = socket.socket(family, socket.SOCK_STREAM)
            try:
                # As asyncio's start_server would: a restarted job may rebind its base ports
                # while old connections sit in TIME_WAIT.
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind((host, wanted))
            except OSError as exc:
                tcp.close()
                raise OSError(f"TCP port {wanted} on {host}: {exc.strerror}") from exc
            port = tcp.getsockname()[1]
            sockets: tuple[socket.socket, ...] = (tcp,)
            if udp:
                dgram = socket.socket(family, socket.SOCK_DGRAM)
                try:
                    dgram.bind((host, port))
                except OSError as exc:
                    dgram.close()
                    tcp.close()
                    if ports is not None:
                        raise OSError(f"UDP port {port} on {host}: {exc.strerror}") from exc
                    continue  # busy for UDP only: draw another number
                sockets = (dgram, tcp)
            held.append(Reservation(port, sockets))
        on_error.pop_all()
    return held


def _close_all(reservations: list[Reservation]) -> None:
    for reservation in reservations:
        reservation.close()
