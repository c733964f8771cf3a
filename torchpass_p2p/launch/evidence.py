"""Fast evidence: tell live siblings at once that a child died, instead of letting them wait
for their failure detector (docs/design.md section 4).

``POST http://<status address>/evidence`` with ``Authorization: Bearer <token>``
(:func:`.keyfile.http_token` of the primary key) and the JSON body
``{"member_id": "<16 hex digits>", "reason": "exited with 3", "exited": true}`` (``exited``:
the launcher reaped the process, so the death is certain and needs no refutation window).
Each request has a short
deadline; a sibling that does not answer is logged and skipped, never an error of the launcher.
A sibling whose page refuses the connection is still starting (the launcher bound its port; its
agent serves it once the script has imported its modules, seconds): it is asked again until
``START_WAIT_S`` has passed, so a child that dies while its siblings start is not left to their
failure detectors (a new user's run).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from torchpass_p2p.core.configuration import Address
from torchpass_p2p.core.messages import MemberId, format_member_id

from .childspec import format_address

__all__ = ["EVIDENCE_TIMEOUT_S", "START_WAIT_S", "notify_siblings", "post_evidence"]

log = logging.getLogger(__name__)

EVIDENCE_TIMEOUT_S = 2.0
"""Deadline of one evidence request. A live agent answers on loopback in milliseconds; one that
takes seconds is busy or hung, and its own failure detector will learn of the death anyway."""
START_WAIT_S = 30.0
"""How long a sibling whose status page refuses connections (its agent still starting) is asked
again: a script importing torch took 6-11 s to serve it on a shared 2-core host."""
_RETRY_S = (0.1, 1.0)
"""First and longest pause between two attempts at a page still starting, doubling between."""


async def post_evidence(
    session: aiohttp.ClientSession,
    status: Address,
    member_id: MemberId,
    reason: str,
    token: str,
    *,
    exited: bool = False,
    timeout_s: float = EVIDENCE_TIMEOUT_S,
) -> None:
    """POST one piece of evidence to the status page at ``status``.

    Raises:
        aiohttp.ClientError: no connection, or a reply other than 2xx.
        TimeoutError: no reply within ``timeout_s`` seconds.
    """
    url = f"http://{format_address(status)}/evidence"
    body = {"member_id": format_member_id(member_id), "reason": reason, "exited": exited}
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {token}"},
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
        reply.raise_for_status()


async def notify_siblings(
    session: aiohttp.ClientSession,
    siblings: Sequence[Address],
    member_id: MemberId,
    reason: str,
    token: str,
    *,
    exited: bool = False,
    timeout_s: float = EVIDENCE_TIMEOUT_S,
    start_wait_s: float = START_WAIT_S,
) -> int:
    """Post the evidence to every status page in ``siblings`` concurrently; returns how many
    accepted it. A page that refuses the connection is asked again for up to ``start_wait_s``
    seconds (its agent still starting). Failures are logged (one line each), never raised."""
    loop = asyncio.get_running_loop()

    async def one(status: Address) -> bool:
        deadline, pause = loop.time() + start_wait_s, _RETRY_S[0]
        while True:
            try:
                await post_evidence(session, status, member_id, reason, token, exited=exited,
                                    timeout_s=timeout_s)
                return True
            except aiohttp.ClientConnectorError as exc:  # nothing listens there yet
                if loop.time() + pause < deadline:
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, _RETRY_S[1])
                    continue
                error: BaseException = exc
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                error = exc
            log.warning("evidence for %s to %s not delivered: %s", format_member_id(member_id),
                        format_address(status), str(error) or type(error).__name__)
            return False

    results = await asyncio.gather(*(one(s) for s in siblings))
    return sum(results)
