"""``GET /events``: the status document pushed to browsers as server-sent events.

One task (the *pusher*, running only while a client is connected) reads ``read()`` (the
``/status`` document) every :data:`PUSH_INTERVAL_S`, and when its JSON differs from the last one
pushed, puts one ``event: status`` frame into every client's queue; an unchanged document is
followed by a comment line every :data:`KEEPALIVE_S`, so that a proxy or the browser sees the
stream alive. A new client gets the current document at once. Each client's request handler
writes its queue to its socket.

What must hold (the agent shares its loop with this): the pusher never waits on a client. A
client's queue holds :data:`QUEUE_FRAMES` frames; one that is full when the next frame comes is
a client that does not read (its socket buffers full, its handler stuck in a write): it is
dropped (its connection aborted) and counted as ``slow_client``. At most :data:`MAX_CLIENTS`
streams are open at once; one more is answered 503 and counted as ``too_many_clients``. Both
counts land in the status server's ``rejected`` counter, hence in ``/metrics`` as
``torchpass_http_rejected_total{reason=...}``. A dropped browser reconnects by itself (the
``retry`` field) and gets the current document again.

The frame format is the WHATWG HTML standard's (section 9.2, "Server-sent events"): ``event:``,
one ``data:`` line (JSON has no raw newline) and a blank line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from aiohttp import web

from torchpass_p2p.tasks import OwnedTasks

__all__ = ["KEEPALIVE_S", "MAX_CLIENTS", "PUSH_INTERVAL_S", "QUEUE_FRAMES", "RETRY_MS",
           "StatusStream"]

log = logging.getLogger(__name__)

PUSH_INTERVAL_S = 0.5
"""How often the document is read and compared while a client is connected (seconds): a human
watching a recovery sees each phase within half a second, and a document of 1,000 members
(about 150 KB) costs the loop a few milliseconds per read."""
KEEPALIVE_S = 15.0
"""A comment line after this long without a frame (seconds): below the 30 s or more that
proxies and browsers give an idle stream."""
QUEUE_FRAMES = 8
"""Frames waiting for one client: 4 s of pushes at :data:`PUSH_INTERVAL_S`. A client this far
behind does not read; a bigger queue would only hold more memory for it."""
MAX_CLIENTS = 8
"""Streams open at once: a few operators' browsers. Each costs one document per push, and its
queue's memory."""
RETRY_MS = 2000
"""The reconnection delay the browser is told (milliseconds)."""

_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
}


class _Client:
    __slots__ = ("queue", "request", "dropped", "last", "quiet_s")

    def __init__(self, request: web.Request, size: int, document: str) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(size)
        self.request = request
        self.dropped = False
        self.last = document
        """The document this client was last sent."""
        self.quiet_s = 0.0
        """Seconds since it was last sent anything."""


class StatusStream:
    """The ``/events`` endpoint (module docstring).

    Args:
        read: returns the document to push (called on the loop, must not block).
        rejected: where refusals and drops are counted (the status server's counter).
        interval_s, keepalive_s, queue_frames, max_clients: the module's defaults.
    """

    def __init__(self, read: Callable[[], dict[str, Any]], rejected: Counter[str], *,
                 interval_s: float = PUSH_INTERVAL_S, keepalive_s: float = KEEPALIVE_S,
                 queue_frames: int = QUEUE_FRAMES, max_clients: int = MAX_CLIENTS) -> None:
        self._read = read
        self.rejected = rejected
        self.interval_s = interval_s
        self.keepalive_s = keepalive_s
        self.queue_frames = queue_frames
        self.max_clients = max_clients
        self._clients: set[_Client] = set()
        self._pushing = OwnedTasks("status-events", 1)
        self._pusher: asyncio.Task[None] | None = None  # the one in _pushing, once started
        self._closed = False
        self.pushed = 0
        """Status frames put into client queues (one per client per change)."""

    @property
    def clients(self) -> int:
        """Streams open now."""
        return len(self._clients)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Serve one stream until the client leaves, is dropped or the server closes.

        Raises:
            web.HTTPServiceUnavailable: :data:`MAX_CLIENTS` streams are open, or closing
                (the caller counts it).
        """
        if self._closed or len(self._clients) >= self.max_clients:
            raise web.HTTPServiceUnavailable(reason="too many event streams")
        document = self._document()  # before prepare: a failing read is a 500
        response = web.StreamResponse(headers=_HEADERS)
        await response.prepare(request)
        client = _Client(request, self.queue_frames, document)
        client.queue.put_nowait(f"retry: {RETRY_MS}\n\n".encode())
        client.queue.put_nowait(self._frame(document))
        self._clients.add(client)
        self._start_pusher()
        try:
            while (data := await client.queue.get()) is not None:
                await response.write(data)
        except (ConnectionError, RuntimeError):
            pass  # the client went away, or was dropped mid-write (aiohttp: ConnectionError
            # subclasses; RuntimeError once the transport is closed)
        finally:
            self._clients.discard(client)
        return response

    async def close(self) -> None:
        """End every stream and the pusher (before the server stops: their handlers return
        at once instead of holding the shutdown). Idempotent."""
        self._closed = True
        for client in list(self._clients):
            self._end(client)
        self._pusher = None
        await self._pushing.close(1.0)  # it ends at its next await

    # ------------------------------------------------------------------ inside

    def _document(self) -> str:
        return json.dumps(self._read(), separators=(",", ":"), sort_keys=True)

    @staticmethod
    def _frame(document: str) -> bytes:
        return f"event: status\ndata: {document}\n\n".encode()

    def _start_pusher(self) -> None:
        if self._pusher is None or self._pusher.done():
            self._pusher = self._pushing.spawn(self._push(), name="pusher")

    async def _push(self) -> None:
        """Until the last client leaves: read, compare, fan out (module docstring)."""
        failed = False
        while self._clients:
            await asyncio.sleep(self.interval_s)
            try:
                document = self._document()
            except Exception:  # a runtime bug: counted each push, logged once a stream
                self.rejected["internal_error"] += 1
                if not failed:
                    failed = True
                    log.exception("status events: the status document failed")
                continue
            self._fan_out(document)

    def _fan_out(self, document: str) -> None:
        frame: bytes | None = None
        for client in list(self._clients):
            if document != client.last:
                frame = frame or self._frame(document)
                data = frame
            elif client.quiet_s + self.interval_s >= self.keepalive_s:
                data = b": keepalive\n\n"
            else:
                client.quiet_s += self.interval_s
                continue
            try:
                client.queue.put_nowait(data)
            except asyncio.QueueFull:
                self.rejected["slow_client"] += 1
                log.info("status events: dropped a client that read nothing for %d pushes",
                         self.queue_frames)
                client.dropped = True
                self._end(client)
                continue
            client.last, client.quiet_s = document, 0.0
            if data is frame:
                self.pushed += 1

    def _end(self, client: _Client) -> None:
        """Stop ``client``'s stream: its handler returns whether it waits on its queue or is
        stuck in a write (the connection is aborted under it)."""
        self._clients.discard(client)
        queue = client.queue
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)
        if client.dropped:
            transport = client.request.transport
            if transport is not None:
                with contextlib.suppress(Exception):  # already closed: nothing to abort
                    transport.abort()
