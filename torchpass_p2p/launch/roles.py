"""Which running children still hold a rank, as the agents see it.

Once the job has completed (a training script exited 0), the launcher waits only for children
that may still be finishing the last step. ``GET http://<status address>/status``
(:mod:`torchpass_p2p.agent.http`) answers the agent's own ``role`` and its configuration's
``members`` with theirs. An idle spare (``spare``, or ``joining`` for a respawned one) or a
member the agreement removed (``removed``) finishes nothing, so the launcher can stop it at once
instead of after its grace period. A child stopped by a signal cannot answer; the others'
``members`` say whether it still holds a rank (a rank paused for a moment at the very end
does; a rank paused past its lease was removed). A child that does not answer in time, or
answers anything else, is assumed to hold a rank: the grace period remains the bound for it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from torchpass_p2p.core.configuration import Address

from .plan import format_address

__all__ = ["IDLE_ROLES", "MAX_STATUS_BYTES", "ROLE_TIMEOUT_S", "StatusView", "ask_status"]

IDLE_ROLES = frozenset({"spare", "joining", "removed"})
"""Roles that hold no rank and take no part in training (``leaving`` still holds its rank
until the change that removes it is decided)."""
ROLE_TIMEOUT_S = 1.0
"""Deadline of one status request. An agent answers on loopback in milliseconds; one that does
not is busy or gone, and the grace period decides for it."""
MAX_STATUS_BYTES = 1 << 20
"""A status page larger than this is not read (the document of a 1,000-member cluster is about
200 KB)."""


@dataclass(frozen=True)
class StatusView:
    """One agent's answer: its own ``role``, and the members (16 hex digits) that hold a rank
    in its configuration."""

    role: str
    rank_holders: frozenset[str]


async def ask_status(session: aiohttp.ClientSession, statuses: Sequence[Address], *,
                     timeout_s: float = ROLE_TIMEOUT_S) -> list[StatusView | None]:
    """Each status page's view, asked concurrently, in the order of ``statuses``; ``None`` for
    a page that did not answer within ``timeout_s`` seconds, or whose answer is not a status
    document. Never raises for a child's failure."""

    async def one(status: Address) -> StatusView | None:
        try:
            async with session.get(f"http://{format_address(status)}/status",
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
                body = await reply.content.read(MAX_STATUS_BYTES + 1)
                if reply.status != 200 or len(body) > MAX_STATUS_BYTES:
                    return None
            document = json.loads(body)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        return _view(document)

    return list(await asyncio.gather(*(one(s) for s in statuses)))


def _view(document: object) -> StatusView | None:
    if not isinstance(document, dict):
        return None
    role, members = document.get("role"), document.get("members")
    if not isinstance(role, str) or not isinstance(members, list):
        return None
    holders = frozenset(m["member_id"] for m in members
                        if isinstance(m, dict) and isinstance(m.get("member_id"), str)
                        and m.get("role") == "rank")
    return StatusView(role, holders)
