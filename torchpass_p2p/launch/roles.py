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

The same pages tell a launcher whose job cannot go on at all (:func:`majority_lost`): every
agent that answers is fenced in one configuration, all of whose members this launcher started,
and too many of them have exited. And a launcher without ``--respawn`` can say why its job
waits (:func:`vacant_without_spare`): a rank is vacant and no spare is left to take it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from torchpass_p2p.core.agreement import classic_quorum
from torchpass_p2p.core.configuration import Address

from .childspec import format_address
from .outcome import no_majority_left

__all__ = ["IDLE_ROLES", "MAX_STATUS_BYTES", "ROLE_TIMEOUT_S", "StatusView", "ask_status",
           "majority_lost", "vacant_without_spare"]

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
    """One agent's answer: its own ``role``; the ``members`` (16 hex digits) of its
    configuration ``config_id`` and those of them that hold a rank (``rank_holders``);
    ``fenced``: it has not reached a majority of that configuration for its lease;
    ``world_size``: the configuration's ranks, vacant ones included (0: unknown);
    ``reachable``: how many of the members it believes reachable, itself included, and
    ``majority`` how many a decision needs (0: unknown)."""

    role: str
    rank_holders: frozenset[str]
    config_id: int = -1
    members: frozenset[str] = frozenset()
    fenced: bool = False
    world_size: int = 0
    reachable: int = 0
    majority: int = 0

    def no_majority(self) -> str | None:
        """How this agent, fenced, counts fewer than a majority of its configuration
        reachable (:func:`~.outcome.no_majority_left`), or None: not fenced, or still
        counting a majority (it is the one cut off), or the counts are unknown."""
        if not self.fenced or self.config_id < 0 or not 0 < self.reachable < self.majority:
            return None
        return no_majority_left(self.config_id, self.reachable, len(self.members), "reachable")


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
    entries = [m for m in members if isinstance(m, dict) and isinstance(m.get("member_id"), str)]
    holders = frozenset(m["member_id"] for m in entries if m.get("role") == "rank")
    config_id, fenced = document.get("config_id"), document.get("fenced")
    world_size = document.get("world_size")
    reachable, majority = document.get("reachable"), document.get("majority")
    return StatusView(role, holders,
                      config_id if isinstance(config_id, int) else -1,
                      frozenset(m["member_id"] for m in entries),
                      fenced is True, world_size if isinstance(world_size, int) else 0,
                      reachable if type(reachable) is int else 0,
                      majority if type(majority) is int else 0)


def majority_lost(views: Sequence[StatusView | None], gone: frozenset[str],
                  ours: frozenset[str]) -> str | None:
    """Why no configuration can ever be decided again, or None if one may be.

    ``views``: the answers of every running child that can answer (not stopped by a signal);
    ``ours``: the members (16 hex digits) this launcher started; ``gone``: those of them whose
    process exited. A member id never comes back (a respawned process is a new member), so once
    fewer members of a configuration than its classic quorum (``floor(N/2) + 1``,
    :func:`~torchpass_p2p.core.agreement.classic_quorum`) are left, that configuration decides
    nothing more: no join, no replacement, no stop (docs/design.md section 5). The configuration is
    the one every answer names, and only while every answer is fenced (no majority heard for a
    lease); a missing answer or a mixed view says nothing. Answers of members still joining
    (``role == "joining"``, a respawned spare) are left out: they belong to no configuration.
    Only a configuration whose members are all this launcher's counts: elsewhere a newer
    configuration may have been decided that a partition kept from these agents, and deaths
    there are not seen here (the agents' own deadline covers that case)."""
    if any(v is None for v in views):
        return None
    # A member still joining is in no configuration (its view is its seed's, and it is never
    # fenced): it decides nothing, so it says nothing either way.
    members = [v for v in views if v is not None and v.role != "joining"]
    if not members or any(not v.fenced for v in members):
        return None
    first = members[0]
    if first.config_id < 0 or any(v.config_id != first.config_id for v in members):
        return None
    n, dead = len(first.members), len(first.members & gone)
    if n == 0 or not first.members <= ours or n - dead >= classic_quorum(n):
        return None
    return no_majority_left(first.config_id, dead, n, "exited")


def vacant_without_spare(views: Sequence[StatusView | None]) -> str | None:
    """Why the newest configuration the answers name cannot fill a rank by itself, or None:
    it has vacant ranks (``world_size`` above its rank holders) and every member holds a rank,
    so no spare is left to promote. Under policy ``wait`` its members then wait for a spare
    that joins from elsewhere (a respawn, another host) until their give-up time. A hint for
    the user, never a verdict: a spare may still come."""
    answers = [v for v in views if v is not None and v.role != "joining" and v.config_id >= 0]
    if not answers:
        return None
    newest = max(answers, key=lambda v: v.config_id)
    vacant = newest.world_size - len(newest.rank_holders)
    if vacant <= 0 or newest.members - newest.rank_holders:
        return None
    return (f"configuration {newest.config_id} has {vacant} vacant rank(s) and no spare left "
            f"to fill them")
