"""Joining: the configuration a process joins, asked of its seeds over the authenticated TCP
port (``Kind.CONFIG_REQUEST``), and the seeds' member ids in it.

What must stay true: asking ends by ``timeout_s`` (each request is bounded by the time left);
and when every seed refused this process's key, it stops asking at once (asking again for
the rest of the timeout would only repeat that).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgpack

from torchpass_p2p.core.configuration import Address, Configuration
from torchpass_p2p.core.messages import MemberId

from ..bootstrap import MAX_MEMBERS, BootstrapError, configuration_from_data
from ..transport import KeyRefused, Kind, TransportError

if TYPE_CHECKING:
    from ..transport import Transport

__all__ = ["fetch_configuration", "seed_members"]

log = logging.getLogger("torchpass_p2p.agent")

SEED_REQUEST_S = 5.0
"""Longest wait for one seed's answer (seconds), within the time left to join."""
SEED_ROUND_PAUSE_S = 0.5
"""Pause between two rounds over the seeds (seconds)."""


async def fetch_configuration(transport: Transport, seeds: tuple[Address, ...],
                              timeout_s: float, clock: Callable[[], float],
                              refused: Callable[[list[KeyRefused], str, int], Exception]
                              ) -> Configuration:
    """The current configuration, from the first of ``seeds`` that gives one; the seeds are
    asked in turn, round after round, for ``timeout_s`` seconds of ``clock``.

    Raises:
        Exception: ``refused(refusals, "seed(s)", n)`` (a
            :class:`~.keys.KeyNotAccepted`) when every seed refused this process's key in one
            round.
        TransportError: no seed gave a configuration within ``timeout_s``.
    """
    deadline = clock() + timeout_s
    last: Exception | None = None
    while clock() < deadline:
        refusals: list[KeyRefused] = []
        for seed in seeds:
            left = deadline - clock()
            if left <= 0:
                break
            try:
                kind, body = await transport.request(seed, Kind.CONFIG_REQUEST, b"",
                                                     timeout_s=min(SEED_REQUEST_S, left))
                if kind != Kind.CONFIG_REPLY:
                    raise TransportError(f"unexpected reply kind {kind}")
                return configuration_from_data(msgpack.unpackb(
                    body, raw=False, strict_map_key=False, max_array_len=MAX_MEMBERS,
                    max_map_len=MAX_MEMBERS, max_str_len=1024, max_bin_len=0,
                    max_ext_len=0))
            except KeyRefused as exc:
                refusals.append(exc)  # said once, by the exit line, if every seed does
            except (TransportError, BootstrapError, ValueError) as exc:
                last = exc
                log.warning("seed %s:%d gave no configuration: %s", *seed, exc)
        if refusals and len(refusals) == len(seeds):
            # Every seed answered that it holds none of our keys: asking again for 30 s
            # would only repeat that.
            raise refused(refusals, "seed(s)", len(refusals))
        await asyncio.sleep(SEED_ROUND_PAUSE_S)
    raise TransportError(f"no seed gave a configuration within {timeout_s} s: {last}")


def seed_members(config: Configuration, seeds: tuple[Address, ...]) -> tuple[MemberId, ...]:
    """The members of ``config`` listening at ``seeds``; its first three if none does."""
    at = {addr: m for m, addr in config.addresses.items()}
    chosen = tuple(at[s] for s in seeds if s in at)
    return chosen or config.members[:3]
