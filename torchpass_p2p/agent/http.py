"""The HTTP status server of one agent (docs/design.md section 10), bound to loopback by default.

=========  ==============  ======  =============================================================
method     path            token   answer
=========  ==============  ======  =============================================================
GET        ``/``           no      the live status page (:mod:`.page`; with ``/page.js`` and
                                   ``/page.css``)
GET        ``/events``     no      ``source.status()`` pushed as server-sent events on each
                                   change (:mod:`.sse`)
GET        ``/status``     no      ``source.status()`` as JSON
GET        ``/metrics``    no      Prometheus text (:meth:`.metrics.AgentMetrics.render`)
GET        ``/healthz``    no      ``ok``
POST       ``/drain``      yes     ``await source.drain()`` as JSON; body empty or ``{}``
POST       ``/evidence``   yes     ``{"accepted": source.report_unreachable(id, reason, exited)}``;
                                   body ``{"member_id": "<16 hex digits>", "reason": "<text>"}``
                                   and optionally ``"exited": true`` (the launcher reaped it)
POST       ``/keys/reload`` yes    ``source.reload_keys()`` as JSON: read the key file again
                                   (``docs/running.md``, "Keys"); body empty or ``{}``
=========  ==============  ======  =============================================================

Threat model. Reads are open to whoever reaches the port: they reveal the membership, which
every member already gossips, and no key material. Writes change the cluster (a drain hands a
rank away, evidence speeds up a removal), so they need ``Authorization: Bearer <token>``, where
the token is :func:`http_token` of the cluster key: every process holding the key derives it and
it is never sent anywhere but in that header (on loopback, by default); while a key rotation
keeps an old key accepted, so is its token (:func:`http_tokens`). A browser page cannot
forge the header without a CORS preflight, which this server never grants. Before reading a
body the server checks the token, and it reads at most :data:`MAX_BODY_BYTES`. A refused
request gets 4xx with a reason and is counted in :attr:`StatusServer.rejected`; nothing a
client sends raises out of a handler. Exceptions raised by the source are local bugs: logged,
answered 500 and counted as ``internal_error``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from torchpass_p2p.core.seal import Keyring

from .metrics import CONTENT_TYPE, AgentMetrics
from .page import FILES, serve_file
from .sockets import adopt_socket
from .sse import StatusStream

__all__ = [
    "DRAIN_TIMEOUT_S",
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "MAX_REASON_CHARS",
    "STOP_TIMEOUT_S",
    "StatusServer",
    "StatusSource",
    "http_token",
    "http_tokens",
]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
"""Open connections served at once; a new one past this closes the oldest. A scraper, the
launcher and ``torchpass-p2p status`` need a handful; unbounded, a flood of idle connections
from a local process would take the file descriptors that the agent, the state transfer and the
process group share."""
KEEPALIVE_TIMEOUT_S = 15.0
"""An idle kept-alive connection is closed after this (seconds; aiohttp's default is an
hour). Prometheus scrapes every 15 s or more and reconnects at no cost on loopback."""
MAX_BODY_BYTES = 4096
"""Largest POST body read. The largest valid body (evidence with a 64-character reason) is under
120 bytes; 4 KiB leaves room for whitespace and keeps a flood of requests cheap."""
MAX_REASON_CHARS = 64
"""Longest evidence reason: a short word from the launcher (``exited:-9``, ``oom``)."""
DRAIN_TIMEOUT_S = 10.0
"""Longest wait for ``source.drain()``. It should return as soon as the request is accepted
(the hand-over itself is reported in ``/status``); past this the call is cancelled and the
client gets 504."""
STOP_TIMEOUT_S = 5.0
"""Longest :meth:`StatusServer.stop` waits for requests in flight before closing them."""
BAD_HTTP_LOG_INTERVAL_S = 10.0
"""At most one warning per this many seconds for malformed HTTP (a port scanner, a TLS client);
every one is counted as ``bad_http`` and logged at DEBUG."""

_TOKEN_LABEL = b"torchpass http token v1"
_HEX = frozenset("0123456789abcdefABCDEF")


def http_token(key: bytes | Keyring) -> str:
    """The bearer token of the status servers of the cluster whose key (or keyring) is ``key``.

    A secret derived from the primary key (HKDF-SHA256, :meth:`Keyring.derive_secret`), as 64
    hex digits: the launcher and every agent derive the same token, and it reveals nothing
    about the key.

    Raises:
        ValueError: ``key`` is not a 32-byte cluster key.
    """
    keyring = key if isinstance(key, Keyring) else Keyring(bytes(key))
    return keyring.derive_secret(_TOKEN_LABEL).hex()


def http_tokens(keyring: Keyring) -> tuple[str, ...]:
    """The token of each key of ``keyring``, the primary's first: what a status server of a
    member holding that ring accepts (:meth:`StatusServer.set_tokens`)."""
    secrets = keyring.derive_secrets(_TOKEN_LABEL)
    return tuple(secrets[kid].hex() for kid in keyring.key_ids)


class StatusSource(Protocol):
    """What the status server asks of the runtime (all called on the server's loop)."""

    def status(self) -> dict[str, Any]:
        """The JSON-able status of this agent (schema in :mod:`torchpass_p2p.cli.status`)."""
        ...

    def drain(self) -> Awaitable[dict[str, Any]]:
        """Ask this member to hand its rank to a spare; returns once accepted or refused."""
        ...

    def report_unreachable(self, member_id: int, reason: str, exited: bool = False) -> bool:
        """Fast evidence from the local launcher; ``exited``: it reaped the member's process,
        so the death is certain. ``False`` if not taken."""
        ...

    def reload_keys(self) -> dict[str, Any]:
        """Read the key file again; ``{"reloaded": bool, ...}``, never raises."""
        ...


class _Rejected(Exception):
    """A request refused: HTTP ``status`` and a short ``reason`` (also the counter label)."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.detail = detail


class StatusServer:
    """The status page and ``/events``, ``/status``, ``/metrics``, ``/healthz``, ``/drain`` and
    ``/evidence`` of one agent.

    Lifecycle: :meth:`start` binds and returns the bound address (``port=0`` picks a free one),
    :meth:`stop` closes within :data:`STOP_TIMEOUT_S` (plus a short grace) and may be called
    again. ``rejected`` counts refused requests by reason (``no_token``, ``bad_token``,
    ``too_large``, ``bad_json``, ``bad_body``, ``not_found``, ``method_not_allowed``,
    ``drain_timeout``, ``internal_error``, ``bad_http`` for requests that are not valid
    HTTP/1.1, which aiohttp answers 400 before any route, and from ``/events``
    ``too_many_clients`` and ``slow_client``); it is synced into ``metrics`` as
    ``torchpass_http_rejected_total`` at each ``/metrics`` request. ``stream`` is the
    ``/events`` endpoint (:class:`.sse.StatusStream`), built with ``stream_options``.

    Raises:
        ValueError: an empty ``token``.
    """

    def __init__(
        self,
        source: StatusSource,
        metrics: AgentMetrics,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str,
        stream_options: dict[str, Any] | None = None,
    ) -> None:
        if not token:
            raise ValueError("the status server needs a non-empty token (see http_token)")
        self.source = source
        self.metrics = metrics
        self.host = host
        self.port = port
        self.rejected: Counter[str] = Counter()
        self.stream = StatusStream(source.status, self.rejected, **(stream_options or {}))
        self._tokens: tuple[bytes, ...] = (token.encode("utf-8"),)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.address: tuple[str, int] | None = None
        """The bound ``(host, port)`` once started."""

    async def start(self, fd: int | None = None) -> tuple[str, int]:
        """Bind and serve, or serve on the inherited TCP socket ``fd`` already bound to
        ``port``; returns the bound ``(host, port)``.

        Raises:
            RuntimeError: already started.
            OSError: the address cannot be bound, or listening on ``fd`` failed.
            :class:`.sockets.NotInherited`: ``fd`` is not such a socket (left open).
        """
        if self._runner is not None:
            raise RuntimeError("status server already started")
        app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[self._middleware], logger=log
        )
        for path in FILES:
            app.router.add_get(path, self._page)
        app.router.add_get("/events", self._events)
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_post("/drain", self._drain)
        app.router.add_post("/evidence", self._evidence)
        app.router.add_post("/keys/reload", self._reload_keys)
        # access_log=None: no line per request (a Prometheus scrape every few seconds would
        # drown the event log).
        runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=STOP_TIMEOUT_S, logger=_ProtocolLog(self),
            keepalive_timeout=KEEPALIVE_TIMEOUT_S,
        )
        await runner.setup()
        # Served through our own listener rather than an aiohttp site, to bound connections.
        loop = asyncio.get_running_loop()
        sock = None
        try:
            if fd is not None:
                sock = adopt_socket(fd, socket.SOCK_STREAM, (self.host, self.port))
                listener = await loop.create_server(self._capped(runner.server), sock=sock)
            else:
                listener = await loop.create_server(self._capped(runner.server), self.host,
                                                    self.port, reuse_address=True)
        except BaseException:
            if sock is not None:
                sock.close()
            await runner.cleanup()
            raise
        self._runner, self._listener = runner, listener
        host, port = listener.sockets[0].getsockname()[:2]
        self.address = (host, port)
        log.debug("status server on %s:%d", host, port)
        return self.address

    async def stop(self) -> None:
        """Stop serving: waits at most :data:`STOP_TIMEOUT_S` for requests in flight, then
        closes them. Does nothing if not started."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if self._listener is not None:
            self._listener.close()  # no new connections; the runner closes the open ones
            self._listener = None
        await self.stream.close()  # event streams end now instead of holding the shutdown
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S + 1.0):
                await runner.cleanup()
        except TimeoutError:
            log.warning("status server did not stop within %.1f s", STOP_TIMEOUT_S + 1.0)

    def _capped(self, server: Any) -> Callable[[], Any]:
        """aiohttp's protocol factory, closing the oldest open connection first once
        :data:`MAX_CONNECTIONS` are open (counted as ``evicted_connection``)."""
        def factory() -> Any:
            open_now = server.connections  # oldest first
            if len(open_now) >= MAX_CONNECTIONS:
                self.rejected["evicted_connection"] += 1
                open_now[0].force_close()
            return server()
        return factory

    # middleware: every refusal is answered and counted in one place

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except _Rejected as exc:
            return self._refuse(exc.status, exc.reason, exc.detail)
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(413, "too_large", f"body over {MAX_BODY_BYTES} bytes")
        except web.HTTPNotFound:
            return self._refuse(404, "not_found", f"no route {request.path!r}")
        except web.HTTPMethodNotAllowed as exc:
            response = self._refuse(405, "method_not_allowed", f"{request.method} not allowed")
            response.headers["Allow"] = ",".join(sorted(exc.allowed_methods))
            return response
        except web.HTTPException:
            raise
        except Exception:
            log.exception("status server: %s %s failed", request.method, request.path)
            return self._refuse(500, "internal_error", "internal error")

    def _refuse(self, status: int, reason: str, detail: str) -> web.Response:
        self.rejected[reason] += 1
        response = web.json_response({"error": reason, "detail": detail}, status=status)
        if status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        return response

    # routes

    async def _page(self, request: web.Request) -> web.Response:
        return serve_file(request.path)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self.stream.handle(request)
        except web.HTTPServiceUnavailable:
            raise _Rejected(503, "too_many_clients",
                            f"{self.stream.max_clients} event streams are open") from None

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.source.status())

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics.sync_counters("http_rejected", self.rejected)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _drain(self, request: web.Request) -> web.Response:
        self._authorize(request)
        body = await self._json_body(request, allow_empty=True)
        if body is not None and body != {}:
            raise _Rejected(400, "bad_body", "drain takes no fields: send no body or {}")
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                result = await self.source.drain()
        except TimeoutError:
            raise _Rejected(
                504, "drain_timeout", f"drain did not answer within {DRAIN_TIMEOUT_S} s"
            ) from None
        return web.json_response(result)

    async def _evidence(self, request: web.Request) -> web.Response:
        self._authorize(request)
        body = await self._json_body(request, allow_empty=False)
        member_id, reason, exited = _parse_evidence(body)
        accepted = bool(self.source.report_unreachable(member_id, reason, exited))
        return web.json_response({"accepted": accepted})

    async def _reload_keys(self, request: web.Request) -> web.Response:
        self._authorize(request)
        body = await self._json_body(request, allow_empty=True)
        if body is not None and body != {}:
            raise _Rejected(400, "bad_body", "keys/reload takes no fields: send no body or {}")
        return web.json_response(self.source.reload_keys())

    # checks

    def set_tokens(self, tokens: tuple[str, ...]) -> None:
        """Accept any of ``tokens`` from now on (a reloaded keyring: :func:`http_tokens`).

        Raises:
            ValueError: no token, or an empty one.
        """
        if not tokens or not all(tokens):
            raise ValueError("the status server needs non-empty tokens (see http_tokens)")
        self._tokens = tuple(t.encode("utf-8") for t in tokens)

    def _authorize(self, request: web.Request) -> None:
        header = request.headers.get("Authorization")
        if header is None:
            raise _Rejected(401, "no_token", "Authorization: Bearer <token> required")
        scheme, _, given = header.partition(" ")
        # compare_digest on bytes: constant time in the token's content; every accepted
        # token is compared, so the time does not say which one matched
        raw = given.strip().encode("utf-8", "replace")
        matched = [hmac.compare_digest(raw, token) for token in self._tokens]
        if scheme.lower() != "bearer" or not any(matched):
            raise _Rejected(401, "bad_token", "wrong token")

    async def _json_body(self, request: web.Request, *, allow_empty: bool) -> Any:
        raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
        if not raw.strip():
            if allow_empty:
                return None
            raise _Rejected(400, "bad_body", "a JSON body is required")
        try:
            return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except _Rejected:
            raise
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise _Rejected(400, "bad_json", f"body is not JSON: {exc}") from None


class _ProtocolLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's per-connection logger. It logs each malformed request at ERROR with a
    traceback; here each is counted as ``bad_http`` and logged at DEBUG, plus one warning per
    :data:`BAD_HTTP_LOG_INTERVAL_S`. Everything else passes through unchanged."""

    def __init__(self, server: StatusServer) -> None:
        super().__init__(log, {})
        self._server = server
        self._next_warning = 0.0

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            rejected = self._server.rejected
            rejected["bad_http"] += 1
            now = time.monotonic()
            if now >= self._next_warning:
                self._next_warning = now + BAD_HTTP_LOG_INTERVAL_S
                log.warning("status server: malformed HTTP request (%s); %d so far",
                            type(exc).__name__, rejected["bad_http"])
            level = logging.DEBUG
        super().log(level, msg, *args, **kwargs)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Rejected(400, "bad_json", f"duplicate field {key!r}")
        out[key] = value
    return out


def _parse_evidence(body: Any) -> tuple[int, str, bool]:
    if not isinstance(body, dict):
        raise _Rejected(400, "bad_body", "evidence is a JSON object")
    fields = {"member_id", "reason"}
    missing = sorted(fields - set(body))
    extra = sorted(set(body) - fields - {"exited"})
    if missing or extra:
        detail = "; ".join(
            part for part in (
                f"missing {', '.join(missing)}" if missing else "",
                f"unknown {', '.join(extra)}" if extra else "",
            ) if part
        )
        raise _Rejected(400, "bad_body",
                        f"evidence fields are member_id, reason and exited: {detail}")
    member_id, reason, exited = body["member_id"], body["reason"], body.get("exited", False)
    if not (isinstance(member_id, str) and len(member_id) == 16 and set(member_id) <= _HEX):
        raise _Rejected(400, "bad_body", "member_id is a string of 16 hex digits")
    if not (isinstance(reason, str) and 0 < len(reason) <= MAX_REASON_CHARS
            and reason.isprintable()):
        raise _Rejected(
            400, "bad_body", f"reason is 1 to {MAX_REASON_CHARS} printable characters"
        )
    if not isinstance(exited, bool):
        raise _Rejected(400, "bad_body", "exited is true or false")
    return int(member_id, 16), reason, exited
