"""This member's state service: a transfer server on its own event loop thread, and the client.

The training thread publishes its state when it enters a configuration, and withdraws it once
the group has formed (:meth:`StateService.publish`); as a promoted spare it
fetches one (:meth:`StateService.fetch`). Both hand work to the service's loop, so the agent's
loop and the training thread never wait on transfers.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchpass_p2p.transfer import (
    FetchResult,
    Snapshot,
    TransferFailed,
    TransferKeys,
    TransferServer,
    fetch,
)
from torchpass_p2p.transfer.client import STOP_TIMEOUT_S

__all__ = ["StateService"]

START_TIMEOUT_S = 10.0
CANCEL_GRACE_S = 2 * STOP_TIMEOUT_S
"""Seconds past a fetch's ``timeout_s`` that its cancellation may take (the client ends its
receiving threads within ``STOP_TIMEOUT_S``)."""


class StateService:
    """A :class:`~torchpass_p2p.transfer.TransferServer` on ``host`` (ephemeral port) serving
    to holders of ``keys`` whose configuration is at least ``current_config_id()``.
    ``on_served(step, served_bytes, total_bytes)``: the server's progress callback, called on
    the service's thread after each chunk sent (fault injection)."""

    def __init__(self, keys: TransferKeys, current_config_id: Callable[[], int], *,
                 host: str = "127.0.0.1",
                 on_served: Callable[[int, int, int], None] | None = None) -> None:
        self.keys = keys
        self._loop = asyncio.new_event_loop()
        self._server = TransferServer(keys, current_config_id, host=host, on_served=on_served)
        self._thread = threading.Thread(target=self._loop.run_forever, name="state-service",
                                        daemon=True)

    def start(self) -> None:
        """Start the loop thread and bind. Raises ``OSError`` if binding fails."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(
            START_TIMEOUT_S)

    @property
    def port(self) -> int:
        return self._server.port

    def refusals(self) -> dict[str, int]:
        """The server's dropped connections by reason (``TransferServer.refusals``); callable
        from any thread (the agent reads it for ``/metrics`` and ``/status``)."""
        return self._server.refusals()

    def publish(self, snapshot: Snapshot | None) -> None:
        """Serve ``snapshot`` from now on (transfers in progress finish on the old one)."""
        self._loop.call_soon_threadsafe(self._server.publish, snapshot)

    def fetch(self, sources: Sequence[tuple[str, int]], config_id: int, *, step: int,
              into: Mapping[str, Any] | Snapshot | None = None,
              timeout_s: float = 600.0,
              on_progress: Callable[[int, int], None] | None = None) -> FetchResult:
        """Pull the snapshot of ``step`` from ``sources`` (``(host, port)`` list) with failover
        (see :func:`~torchpass_p2p.transfer.fetch`); blocks the calling thread.
        ``on_progress(received_bytes, total_bytes)`` is called on the service's thread as
        chunks arrive; it must not block.

        Raises:
            TransferFailed: no source could serve it, or (reason ``timeout``) no result within
                ``timeout_s`` seconds (a backstop: the client's own deadline is "no progress
                for 10 s"); the fetch was cancelled first, so nothing writes into ``into``
                any more.
        """
        async def bounded() -> FetchResult:
            # The deadline runs on the loop: cancelling there shuts the sources' sockets and
            # waits for the receiving threads, so no late chunk lands in live tensors.
            async with asyncio.timeout(timeout_s):
                return await fetch(list(sources), self.keys, config_id, step=step, into=into,
                                   on_progress=on_progress)

        future = asyncio.run_coroutine_threadsafe(bounded(), self._loop)
        try:
            return future.result(timeout_s + CANCEL_GRACE_S)
        except TimeoutError:
            future.cancel()
            raise TransferFailed("timeout", f"no state within {timeout_s:g} s") from None

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the server, stop the loop thread (bounded by ``timeout_s``) and close the loop
        (an unclosed one warns when collected). Idempotent."""
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(
                    timeout_s)
            except Exception:  # noqa: BLE001 - teardown is best effort
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
