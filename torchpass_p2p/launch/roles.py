"""Which running children still hold a rank, as their own agents see it.

Once the job has completed (a training script exited 0), the launcher waits only for children
that may still be finishing the last step. A child holds a rank only if its agent says so:
``GET http://<status address>/status`` answers ``{"role": ...}`` (:mod:`torchpass_p2p.agent.http`).
An idle spare (``spare``, or ``joining`` for a respawned one) or a member the agreement removed
(``removed``) finishes nothing, so the launcher can stop it at once instead of after its grace
period. A child that does not answer in time, or answers anything else, is assumed to hold a
rank: the grace period remains the bound for it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import aiohttp

from torchpass_p2p.core.configuration import Address

from .plan import format_address

__all__ = ["IDLE_ROLES", "ROLE_TIMEOUT_S", "ask_roles"]

IDLE_ROLES = frozenset({"spare", "joining", "removed"})
"""Roles that hold no rank and take no part in training (``leaving`` still holds its rank
until the change that removes it is decided)."""
ROLE_TIMEOUT_S = 1.0
"""Deadline of one status request. An agent answers on loopback in milliseconds; one that does
not is busy or gone, and the grace period decides for it."""
MAX_STATUS_BYTES = 1 << 20
"""A status page larger than this is not read (the document of a 1,000-member cluster is about
200 KB)."""


async def ask_roles(session: aiohttp.ClientSession, statuses: Sequence[Address | None], *,
                    timeout_s: float = ROLE_TIMEOUT_S) -> list[str | None]:
    """Each status page's ``role``, asked concurrently, in the order of ``statuses``; ``None``
    for a child without a status page, one that did not answer within ``timeout_s`` seconds,
    or an answer that is not a status document. Never raises for a child's failure."""

    async def one(status: Address | None) -> str | None:
        if status is None:
            return None
        try:
            async with session.get(f"http://{format_address(status)}/status",
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
                body = await reply.content.read(MAX_STATUS_BYTES + 1)
                if reply.status != 200 or len(body) > MAX_STATUS_BYTES:
                    return None
            document = json.loads(body)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        role = document.get("role") if isinstance(document, dict) else None
        return role if isinstance(role, str) else None

    return list(await asyncio.gather(*(one(s) for s in statuses)))
