"""Free ports on the bind host.

An agent uses one number for its UDP gossip socket and its TCP stream port
(``TORCHPASS_BIND``), so a gossip port must be free for both protocols. The ports are found by
binding port 0 and are released before the children bind them: another process may take one in
between (a narrow race; pass ``--base-port`` on hosts where that matters).
"""

from __future__ import annotations

import socket
from collections.abc import Collection
from contextlib import ExitStack

__all__ = ["free_ports"]

_MAX_TRIES_PER_PORT = 64
"""Attempts to find a number that is free for both UDP and TCP before giving up: a kernel hands
out ephemeral TCP ports that are busy for UDP only rarely, so 64 misses mean something is wrong."""


def free_ports(
    count: int, host: str = "127.0.0.1", *, udp: bool = True, avoid: Collection[int] = ()
) -> list[int]:
    """``count`` distinct ports free on ``host`` for TCP (and for UDP too when ``udp``), none
    of them in ``avoid`` (ports already handed out but not yet bound by their process).

    Raises:
        OSError: ``host`` cannot be bound, or no such port was found in a bounded number of tries.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ports: list[int] = []
    with ExitStack() as held:  # hold every socket until all are found: no duplicates
        tries = 0
        while len(ports) < count:
            tries += 1
            if tries > _MAX_TRIES_PER_PORT * max(count, 1):
                raise OSError(f"no port free for both TCP and UDP on {host}")
            tcp = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
            tcp.bind((host, 0))
            port = tcp.getsockname()[1]
            if port in avoid:
                continue
            if udp:
                sock = held.enter_context(socket.socket(family, socket.SOCK_DGRAM))
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            ports.append(port)
    return ports
