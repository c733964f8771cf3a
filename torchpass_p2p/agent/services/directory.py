"""The service directory: which port of its host a member serves a named service on.

A member registers ``(name, config_id) -> port`` (the rendezvous store of a configuration, a
state server, its pulse responder); a peer asks for it over the authenticated TCP port
(``Kind.SERVICE_REQUEST``). A request for a port not registered yet is held at the serving
member, at most :data:`SERVICE_HOLD_S`, and answered the moment it is registered.

What must stay true: a held request waits on the event that the next registration sets, and
every registration replaces that event, so that no held request misses one; and a lookup never
sends a request it could not have answered before its own deadline.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgpack

from torchpass_p2p.core.configuration import Address
from torchpass_p2p.core.messages import MemberId, format_member_id

from ..transport import Kind, Reply, TransportError

if TYPE_CHECKING:
    from ..transport import Transport

__all__ = ["SERVICE_HOLD_S", "SERVICE_RETRY_S", "NotServed", "ServiceDirectory"]

SERVICE_HOLD_S = 1.0
"""Seconds a service request waits at the serving member for a registration before it is
answered "not registered" (the asker then asks again). A promoted spare asks its sources for
their state servers as soon as the change is decided, often before they have registered: held,
the answer leaves the moment the port is registered (polling every 50 ms cost 25 ms per fault
on average, in the recovery's critical path). Ours; inbound connections are bounded, and so
are the requests held."""
SERVICE_RETRY_S = 0.05
"""Pause before asking again after a failed service request (no connection, a bad reply); also
the margin a lookup keeps before its deadline (no request is sent with less time left)."""


class NotServed(TransportError):
    """A member registered a service as not served for a configuration (port 0): it will not
    serve it there, so waiting for it is pointless (:meth:`ServiceDirectory.register`)."""


class ServiceDirectory:
    """This member's registrations, the answers to peers' requests, and lookups at peers.

    Args:
        transport: the agent's transport; lookups go out through its ``request``.
        clock: monotonic seconds (the runtime's clock).
        rejected_frames: counts of refused frames by reason (the transport's); a malformed
            request counts ``bad_service_request``.
    """

    def __init__(self, transport: Transport, clock: Callable[[], float],
                 rejected_frames: Counter[str]) -> None:
        self._transport = transport
        self._clock = clock
        self._rejected_frames = rejected_frames
        self.services: dict[tuple[str, int], int] = {}
        """(name, config_id) -> port this process serves it on (:meth:`register`). Never
        replaced, only changed: the runtime shows this very dict as ``services``."""
        self._registered = asyncio.Event()
        """Set (and replaced) by every registration: wakes the requests held for one."""

    def register(self, name: str, config_id: int, port: int) -> None:
        """Serve ``name`` for ``config_id`` on ``port`` (0: not served there); requests held
        for it are answered at once. Only the last few configurations of a name are kept."""
        self.services[(name, config_id)] = port
        for old in [k for k in self.services if k[0] == name and k[1] < config_id - 2]:
            del self.services[old]
        self._registered.set()
        self._registered = asyncio.Event()

    def on_request(self, body: bytes) -> Reply | Coroutine[Any, Any, Reply] | None:
        """The reply to a ``Kind.SERVICE_REQUEST`` with ``body`` (msgpack ``[name, config_id,
        hold_s]``): the port now, a coroutine that answers once it is registered or after the
        hold (at most :data:`SERVICE_HOLD_S`), or None for a malformed body (counted)."""
        try:
            request = msgpack.unpackb(body, max_str_len=64, max_array_len=3)
            if type(request) is not list or len(request) < 2:
                raise ValueError("not [name, config_id, hold_s]")
            name, config_id, *hold = request
            key = (str(name), int(config_id))
            hold_s = min(float(hold[0]), SERVICE_HOLD_S) if hold else 0.0
            if not hold_s >= 0.0:  # also NaN
                raise ValueError(f"hold of {hold_s} s")
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException):
            self._rejected_frames["bad_service_request"] += 1
            return None
        port = self.services.get(key)
        if port is None and hold_s > 0.0:
            return self._held_reply(key, hold_s)
        return Kind.SERVICE_REPLY, msgpack.packb(port)

    async def _held_reply(self, key: tuple[str, int], hold_s: float) -> Reply:
        """The reply to a service request once ``key`` is registered, or ``None`` (not
        registered) after ``hold_s`` seconds."""
        try:
            async with asyncio.timeout(hold_s):
                while (port := self.services.get(key)) is None:
                    await self._registered.wait()
        except TimeoutError:
            port = None
        return Kind.SERVICE_REPLY, msgpack.packb(port)

    async def lookup(self, address: Address, member: MemberId, name: str, config_id: int,
                     timeout_s: float) -> Address:
        """(host, port) where ``member``, listening at ``address``, serves ``name`` for
        ``config_id``. Each request is held there until the port is registered or
        :data:`SERVICE_HOLD_S` passed; then this asks again, until ``timeout_s`` seconds passed.

        Raises:
            NotServed: ``member`` registered it as not served (port 0).
            TransportError: not registered within ``timeout_s`` seconds.
        """
        deadline = self._clock() + timeout_s
        while True:
            left = deadline - self._clock()
            hold_s = min(SERVICE_HOLD_S, left - SERVICE_RETRY_S)  # answered before our deadline
            if hold_s <= 0:  # (not a flurry of ever shorter holds at the end)
                raise TransportError(f"member {format_member_id(member)} serves no {name!r} "
                                     f"for config {config_id} after {timeout_s} s")
            body = msgpack.packb([name, config_id, hold_s])
            try:
                kind, reply = await self._transport.request(
                    address, Kind.SERVICE_REQUEST, body, timeout_s=min(left, hold_s + 2.0))
                port = msgpack.unpackb(reply) if kind == Kind.SERVICE_REPLY else None
            except (TransportError, ValueError, msgpack.UnpackException):
                await asyncio.sleep(SERVICE_RETRY_S)
                continue
            if type(port) is int and 0 < port < 65536:
                return address[0], port
            if type(port) is int and port == 0:
                raise NotServed(f"member {format_member_id(member)} does not serve {name!r} "
                                f"for config {config_id}")
