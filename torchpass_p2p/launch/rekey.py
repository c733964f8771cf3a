"""Key rotation on a running job: the launcher reads its key file again on SIGHUP and asks each
child's agent to do the same (``POST /keys/reload``, :mod:`torchpass_p2p.agent.http`).

Why HTTP and not a forwarded SIGHUP: the launcher already reaches its children through their
status pages with the bearer token (:mod:`.evidence`); a signal would also reach a child still
importing torch, whose default action for SIGHUP is to die, and its data-loader workers. The
key file itself never travels: each agent reads the path it was started with
(``TORCHPASS_KEY_FILE``), so a key never appears on a socket, a command line or in an
environment.

A rotation keeps the cluster whole only if every step keeps a key that both the old and the
new key lists hold: :func:`check_rotation` refuses a file that shares none (the members that
reloaded could no longer reach those that had not, nor a spare started from the old file).
The request to reload is authenticated with the token of such a shared key, which every agent
accepts before and after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp

from torchpass_p2p.agent.http import http_tokens
from torchpass_p2p.core.configuration import Address
from torchpass_p2p.core.seal import Keyring

from .childspec import format_address

__all__ = ["RELOAD_TIMEOUT_S", "check_rotation", "describe_keys", "reload_children",
           "shared_token"]

log = logging.getLogger(__name__)

RELOAD_TIMEOUT_S = 5.0
"""Deadline of one child's ``/keys/reload`` (it reads a small file: milliseconds)."""


def describe_keys(keyring: Keyring) -> str:
    """``primary key id 42, accepted key ids 42, 17``: ids only, never key bytes."""
    return (f"primary key id {keyring.primary_id}, accepted key ids "
            f"{', '.join(map(str, keyring.key_ids))}")


def check_rotation(old: Keyring, new: Keyring) -> str | None:
    """Why the members must not move from ``old`` to ``new``, or None: the two share no key
    (module docstring)."""
    if set(old.key_ids) & set(new.key_ids):
        return None
    return (f"the key file shares no key with the keys in use ({describe_keys(old)}; the file "
            f"has {describe_keys(new)}): members that reloaded could not reach the others. "
            "List the new key first and the old one after it, reload, and drop the old key "
            "in a second reload")


def shared_token(old: Keyring, new: Keyring) -> str:
    """The status-page token of a key both rings hold (the new primary if the old ring has it,
    else the old primary if the new one has it, else any shared key). Raises ``ValueError``
    when they share none (:func:`check_rotation`)."""
    tokens = dict(zip(old.key_ids, http_tokens(old), strict=True))
    for kid in (new.primary_id, old.primary_id, *new.key_ids):
        if kid in tokens and kid in new.key_ids:
            return tokens[kid]
    raise ValueError("the two keyrings share no key")


async def reload_children(session: aiohttp.ClientSession, statuses: Sequence[Address],
                          token: str, *, timeout_s: float = RELOAD_TIMEOUT_S,
                          ) -> list[dict[str, Any] | str]:
    """``POST /keys/reload`` to every status page concurrently: each agent's answer
    (``{"reloaded": ...}``), or why there is none (one line). Never raises."""

    async def one(status: Address) -> dict[str, Any] | str:
        url = f"http://{format_address(status)}/keys/reload"
        try:
            async with session.post(url, headers={"Authorization": f"Bearer {token}"},
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
                reply.raise_for_status()
                answer = await reply.json()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            return str(exc) or type(exc).__name__
        return answer if isinstance(answer, dict) else f"unexpected answer {answer!r:.80}"

    return list(await asyncio.gather(*(one(s) for s in statuses)))
