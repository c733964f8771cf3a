"""The agent's status page: its HTTP server (:class:`~..http.StatusServer`: ``/status``,
``/events``, ``/metrics``, ``/drain``, ``/evidence``, ``/keys/reload``) and the member table
of the ``/status`` document.

What must stay true: the server accepts the token of every key of the keyring in use, and
follows each reload (:meth:`StatusPage.set_keys`).
"""

from __future__ import annotations

from typing import Any

from torchpass_p2p.core.configuration import Address
from torchpass_p2p.core.membership import Member
from torchpass_p2p.core.messages import MemberState, format_member_id

from ..http import StatusSource, http_tokens

__all__ = ["StatusPage", "member_rows"]


class StatusPage:
    """One agent's status server, once started."""

    def __init__(self) -> None:
        self.server: Any = None
        """The :class:`~..http.StatusServer` once :meth:`start` ran, else None."""

    async def start(self, source: StatusSource, metrics: Any, address: Address, *,
                    token: str, keyring: Any, fd: int | None) -> Address:
        """Serve ``source`` and ``metrics`` on ``address`` (or the inherited socket ``fd``),
        accepting ``token`` and the tokens of ``keyring``'s keys. Returns the bound address.

        Raises:
            OSError: the address is taken.
        """
        from ..http import StatusServer

        self.server = StatusServer(source, metrics, host=address[0], port=address[1],
                                   token=token)
        self.server.set_tokens(http_tokens(keyring))
        bound: Address = await self.server.start(fd)
        return bound

    def set_keys(self, keyring: Any) -> None:
        """Accept the tokens of ``keyring``'s keys from now on (none before :meth:`start`)."""
        if self.server is not None:
            self.server.set_tokens(http_tokens(keyring))

    async def stop(self) -> None:
        """Stop the server (bounded, :data:`~..http.STOP_TIMEOUT_S`), once started."""
        if self.server is not None:
            await self.server.stop()


def member_rows(member: Member | None) -> list[dict[str, Any]]:
    """The ``members`` table of ``/status``: each member of ``member``'s configuration with its
    role, rank, state in ``member``'s view, incarnation and address; empty before the core
    runs."""
    if member is None:
        return []
    rows = []
    config = member.configuration
    for m in config.members:
        state, inc = member.state_of(m)
        addr = config.addresses.get(m)
        rows.append({
            "member_id": format_member_id(m),
            "role": config.role_of(m),
            "rank": config.rank_of(m),
            "state": MemberState(state).name.lower(),
            "incarnation": inc,
            "address": f"{addr[0]}:{addr[1]}" if addr else "",
        })
    return rows
