"""The status page's files and its ``/events`` stream, on loopback with aiohttp's client: each
change pushed once, a client that reads nothing dropped and counted while the others go on, a
bound on open streams, and a stop that ends every stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.agent.test_http import TOKEN, metric_samples
from torchpass_p2p.agent import sse
from torchpass_p2p.agent.http import StatusServer
from torchpass_p2p.agent.metrics import AgentMetrics
from torchpass_p2p.agent.page import SECURITY_HEADERS

FAST = {"interval_s": 0.01, "keepalive_s": 0.05}
"""Pushes every 10 ms, a keepalive after 50 ms without a change: the tests see many pushes."""


class ChangingSource:
    """A status source whose document changes when ``version`` does; ``ballast`` bytes of
    padding make each frame that large."""

    def __init__(self, ballast: int = 0) -> None:
        self.version = 0
        self.reads = 0
        self.ballast = "x" * ballast
        self.changing = False  # True: every read is a new version
        self.fail = False  # True: every read raises (a runtime bug)

    def status(self) -> dict[str, Any]:
        self.reads += 1
        if self.fail:
            raise RuntimeError("runtime bug")
        if self.changing:
            self.version += 1
        return {"version": self.version, "members": [], "ballast": self.ballast}

    async def drain(self) -> dict[str, Any]:
        return {}

    def report_unreachable(self, member_id: int, reason: str, exited: bool = False) -> bool:
        return False


async def started(source: ChangingSource, **options: Any) -> StatusServer:
    server = StatusServer(source, AgentMetrics(), token=TOKEN,
                          stream_options={**FAST, **options})
    await server.start()
    return server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def base(server: StatusServer) -> str:
    assert server.address is not None
    return f"http://{server.address[0]}:{server.address[1]}"


async def frames(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str]]:
    """``(field, value)`` of each non-empty line: ``event``, ``data``, ``retry`` or ``""`` for
    a comment."""
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line:
            field, _, value = line.partition(":")
            yield field, value.strip()


async def documents(response: aiohttp.ClientResponse, count: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    event = None
    async for field, value in frames(response):
        if field == "event":
            event = value
        elif field == "data":
            assert event == "status"
            out.append(json.loads(value))
            if len(out) == count:
                break
    return out


async def test_the_page_and_its_files_are_served_with_a_strict_policy(
        session: aiohttp.ClientSession) -> None:
    server = await started(ChangingSource())
    try:
        for path, media_type, needle in (("/", "text/html", b'<script src="/page.js"'),
                                         ("/page.js", "text/javascript", b"new EventSource"),
                                         ("/page.css", "text/css", b".state-dead")):
            async with session.get(base(server) + path) as r:
                body = await r.read()
                assert r.status == 200, path
                assert r.content_type == media_type
                assert needle in body
                for header, value in SECURITY_HEADERS.items():
                    assert r.headers[header] == value
        assert "script-src 'self';" in SECURITY_HEADERS["Content-Security-Policy"]
        assert "unsafe" not in SECURITY_HEADERS["Content-Security-Policy"]
        # The script never hands data to the HTML parser.
        async with session.get(base(server) + "/page.js") as r:
            script = await r.text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                     "new Function"):
            assert sink not in script, sink
        assert not server.rejected
    finally:
        await server.stop()


async def test_each_change_is_pushed_once_and_a_quiet_stream_gets_keepalives(
        session: aiohttp.ClientSession) -> None:
    source = ChangingSource()
    server = await started(source)
    try:
        async with session.get(base(server) + "/events") as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            lines = frames(r)
            assert await anext(lines) == ("retry", str(sse.RETRY_MS))
            assert await anext(lines) == ("event", "status")
            field, value = await anext(lines)
            assert field == "data" and json.loads(value)["version"] == 0
            # Unchanged: no second copy of the document, but keepalive comments.
            seen: list[tuple[str, str]] = []
            while len([f for f in seen if f == ("", "keepalive")]) < 2:
                seen.append(await anext(lines))
            assert all(f == ("", "keepalive") for f in seen), seen
            source.version = 7
            while (f := await anext(lines)) == ("", "keepalive"):
                pass
            assert f == ("event", "status")
            field, value = await anext(lines)
            assert field == "data" and json.loads(value)["version"] == 7
        assert not server.rejected
    finally:
        await server.stop()


async def test_a_client_that_reads_nothing_is_dropped_and_counted_and_the_others_go_on(
        session: aiohttp.ClientSession) -> None:
    # Frames of 256 KiB, a new one each push: the reader that stopped fills its socket
    # buffers, then its queue, and is dropped; the one that reads gets every push.
    source = ChangingSource(ballast=256 << 10)
    source.changing = True
    server = await started(source, queue_frames=4)
    stream = server.stream
    try:
        async with session.get(base(server) + "/events") as stalled:
            assert stalled.status == 200
            async with session.get(base(server) + "/events") as reading:
                got: list[int] = []
                async for field, value in frames(reading):
                    if field == "data":
                        got.append(json.loads(value)["version"])
                        if server.rejected["slow_client"] == 1 and len(got) >= 10:
                            break
                assert stream.clients == 1  # the reading one; the stalled one is gone
                assert got == sorted(got) and len(set(got)) == len(got)
                # Still pushed to after the drop.
                after = await documents(reading, 3)
                assert [d["version"] for d in after] == sorted(d["version"] for d in after)
                assert after[0]["version"] > got[-1]
            # The dropped stream ends (its connection aborted) after what it had buffered.
            with pytest.raises(aiohttp.ClientPayloadError):
                await stalled.content.read()
        assert server.rejected == {"slow_client": 1}
        async with session.get(base(server) + "/metrics") as r:
            samples = metric_samples(await r.text())
        assert samples[("torchpass_http_rejected_total", (("reason", "slow_client"),))] == 1
    finally:
        await server.stop()


async def test_streams_past_the_limit_are_refused_and_counted(
        session: aiohttp.ClientSession) -> None:
    server = await started(ChangingSource(), max_clients=2)
    try:
        async with session.get(base(server) + "/events") as first, \
                session.get(base(server) + "/events") as second:
            assert (first.status, second.status) == (200, 200)
            await documents(first, 1)
            await documents(second, 1)
            async with session.get(base(server) + "/events") as third:
                assert third.status == 503
                assert (await third.json())["error"] == "too_many_clients"
            assert server.stream.clients == 2
        assert server.rejected == {"too_many_clients": 1}
        # Closed streams free their places.
        async with asyncio.timeout(10):
            while server.stream.clients:
                await asyncio.sleep(0.01)
        async with session.get(base(server) + "/events") as again:
            assert again.status == 200
    finally:
        await server.stop()


async def test_stop_ends_every_open_stream(session: aiohttp.ClientSession) -> None:
    server = await started(ChangingSource())
    async with session.get(base(server) + "/events") as r:
        await documents(r, 1)
        await server.stop()
        rest = await r.content.read()  # EOF: the stream ended with the server
        assert b"event: status" not in rest
    assert server.stream.clients == 0
    assert not server.rejected


async def test_a_failing_document_is_a_counted_500_and_pushes_skip_it(
        session: aiohttp.ClientSession) -> None:
    source = ChangingSource()
    server = await started(source)
    try:
        source.fail = True
        async with session.get(base(server) + "/events") as r:
            assert r.status == 500
        assert server.rejected == {"internal_error": 1}
        source.fail = False
        async with session.get(base(server) + "/events") as r:
            assert [d["version"] for d in await documents(r, 1)] == [0]
            source.fail = True  # from the next push on
            async with asyncio.timeout(10):
                while server.rejected["internal_error"] < 3:
                    await asyncio.sleep(0.01)
            source.fail = False
            source.version = 1
            assert [d["version"] for d in await documents(r, 1)] == [1]
    finally:
        await server.stop()
