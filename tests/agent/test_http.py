"""The status server on loopback with a real HTTP client, and the ``status`` CLI against it."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from torchpass_p2p.agent import http
from torchpass_p2p.agent.http import MAX_BODY_BYTES, StatusServer, http_token
from torchpass_p2p.agent.metrics import CONTENT_TYPE, AgentMetrics
from torchpass_p2p.cli import status as status_cli

KEY = bytes(range(32))
TOKEN = http_token(KEY)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ME = 0x00000000000000A1

STATUS: dict[str, Any] = {
    "member_id": f"{ME:016x}",
    "cluster": "testcluster",
    "role": "rank",
    "rank": 0,
    "config_id": 3,
    "world_size": 2,
    "step": 1200,
    "fenced": False,
    "members": [
        {"member_id": "00000000000000c3", "role": "spare", "rank": None, "state": "alive",
         "incarnation": 0, "address": "127.0.0.1:40003"},
        {"member_id": "00000000000000b2", "role": "rank", "rank": 1, "state": "suspect",
         "incarnation": 2, "address": "127.0.0.1:40002"},
        {"member_id": f"{ME:016x}", "role": "rank", "rank": 0, "state": "alive",
         "incarnation": 1, "address": "127.0.0.1:40001"},
    ],
    "recent_events": [
        {"at": 1_700_000_000.25, "type": "suspected", "detail": "00000000000000b2 [by a1]"},
    ],
    "health": {"gpu": "ok"},
    "counters": {"datagrams_sent": 10},
}


class FakeSource:
    """A runtime stand-in: fixed status, records drains and evidence."""

    def __init__(self) -> None:
        self.evidence: list[tuple[int, str, bool]] = []
        self.drains = 0
        self.known = {ME, 0xB2, 0xC3}
        self.drain_gate: asyncio.Event | None = None  # set: drain waits for it
        self.drain_cancelled = False
        self.fail = False

    def status(self) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("runtime bug")
        return STATUS

    async def drain(self) -> dict[str, Any]:
        self.drains += 1
        if self.drain_gate is not None:
            try:
                await self.drain_gate.wait()
            except asyncio.CancelledError:
                self.drain_cancelled = True
                raise
        return {"accepted": True, "rank": 0, "spare": "00000000000000c3"}

    def report_unreachable(self, member_id: int, reason: str, exited: bool = False) -> bool:
        self.evidence.append((member_id, reason, exited))
        return member_id in self.known


class Harness:
    def __init__(self, server: StatusServer, source: FakeSource, metrics: AgentMetrics,
                 session: aiohttp.ClientSession) -> None:
        self.server, self.source, self.metrics, self.session = server, source, metrics, session
        host, port = server.address or ("", 0)
        self.base = f"http://{host}:{port}"
        self.hostport = f"{host}:{port}"

    async def get(self, path: str, **kw: Any) -> tuple[int, bytes, aiohttp.ClientResponse]:
        async with self.session.get(self.base + path, **kw) as r:
            return r.status, await r.read(), r

    async def post(self, path: str, **kw: Any) -> tuple[int, Any]:
        async with self.session.post(self.base + path, **kw) as r:
            body = await r.read()
            try:
                return r.status, json.loads(body)
            except ValueError:
                return r.status, body


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    source, metrics = FakeSource(), AgentMetrics()
    server = StatusServer(source, metrics, token=TOKEN)
    await server.start()
    async with aiohttp.ClientSession() as session:
        yield Harness(server, source, metrics, session)
    await server.stop()


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# token


def test_token_is_derived_from_the_key() -> None:
    assert TOKEN == http_token(bytearray(KEY))
    assert len(TOKEN) == 64 and int(TOKEN, 16) >= 0
    assert http_token(bytes(32)) != TOKEN
    for bad in (b"", bytes(31), bytes(33)):
        with pytest.raises(ValueError):
            http_token(bad)


def test_empty_token_is_refused() -> None:
    with pytest.raises(ValueError, match="token"):
        StatusServer(FakeSource(), AgentMetrics(), token="")


# lifecycle


async def test_start_binds_loopback_and_stop_is_idempotent() -> None:
    server = StatusServer(FakeSource(), AgentMetrics(), token=TOKEN)
    await server.stop()  # not started: nothing to do
    host, port = await server.start()
    assert host == "127.0.0.1" and port > 0 and server.address == (host, port)
    with pytest.raises(RuntimeError):
        await server.start()
    await server.stop()
    await server.stop()
    with pytest.raises(OSError):
        socket.create_connection((host, port), timeout=1).close()


async def test_stop_is_bounded_with_a_request_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "STOP_TIMEOUT_S", 0.2)
    source = FakeSource()
    source.drain_gate = asyncio.Event()  # never set: drain hangs
    server = StatusServer(source, AgentMetrics(), token=TOKEN)
    host, port = await server.start()
    async with aiohttp.ClientSession() as session:

        async def hanging() -> None:
            async with session.post(f"http://{host}:{port}/drain", headers=AUTH) as r:
                await r.read()

        request = asyncio.create_task(hanging())
        while source.drains == 0:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await server.stop()
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(aiohttp.ClientError):
            await asyncio.wait_for(request, 5)
    assert source.drain_cancelled


# GET routes


async def test_healthz(h: Harness) -> None:
    status, body, _ = await h.get("/healthz")
    assert (status, body) == (200, b"ok")


async def test_status_is_the_source_document(h: Harness) -> None:
    status, body, r = await h.get("/status")
    assert status == 200
    assert r.content_type == "application/json"
    assert json.loads(body) == STATUS


async def test_metrics_text(h: Harness) -> None:
    h.metrics.set_step(1200)
    h.metrics.set_config(3)
    h.metrics.decided("fast")
    status, body, r = await h.get("/metrics")
    assert status == 200
    assert r.headers["Content-Type"] == CONTENT_TYPE
    s = metric_samples(body.decode())
    assert s[("torchpass_step", ())] == 1200
    assert s[("torchpass_config_id", ())] == 3
    assert s[("torchpass_decisions_total", ())] == 1
    assert s[("torchpass_configuration_changes_total", (("path", "fast"),))] == 1


async def test_source_failure_is_a_counted_500(h: Harness) -> None:
    h.source.fail = True
    status, body, _ = await h.get("/status")
    assert status == 500
    assert json.loads(body)["error"] == "internal_error"
    assert h.server.rejected["internal_error"] == 1


async def test_unknown_route_and_method_are_counted(h: Harness) -> None:
    status, body, _ = await h.get("/nope")
    assert status == 404 and json.loads(body)["error"] == "not_found"
    status, body, r = await h.get("/drain")
    assert status == 405 and json.loads(body)["error"] == "method_not_allowed"
    assert "POST" in r.headers["Allow"]
    status, _ = await h.post("/status", headers=AUTH)
    assert status == 405
    assert h.server.rejected == {"not_found": 1, "method_not_allowed": 2}


# token on POST routes


@pytest.mark.parametrize("path", ["/drain", "/evidence"])
async def test_post_needs_the_token(h: Harness, path: str) -> None:
    body = {"member_id": "00000000000000b2", "reason": "exited"}
    status, answer = await h.post(path, json=body)
    assert (status, answer["error"]) == (401, "no_token")
    for header in (f"Bearer {TOKEN[:-1]}0" if TOKEN[-1] != "0" else f"Bearer {TOKEN[:-1]}1",
                   f"Bearer {http_token(bytes(32))}", TOKEN, f"Basic {TOKEN}", "Bearer ",
                   "Bearer tökén"):
        status, answer = await h.post(path, json=body, headers={"Authorization": header})
        assert (status, answer["error"]) == (401, "bad_token"), header
    assert h.server.rejected == {"no_token": 1, "bad_token": 6}
    assert h.source.drains == 0 and h.source.evidence == []


async def test_token_is_checked_before_the_body_is_read(h: Harness) -> None:
    status, answer = await h.post("/evidence", data=b"x" * (2 * MAX_BODY_BYTES))
    assert (status, answer["error"]) == (401, "no_token")
    assert h.server.rejected == {"no_token": 1}


# drain


async def test_drain(h: Harness) -> None:
    status, answer = await h.post("/drain", headers=AUTH)
    assert status == 200
    assert answer == {"accepted": True, "rank": 0, "spare": "00000000000000c3"}
    status, _ = await h.post("/drain", headers=AUTH, json={})
    assert status == 200
    assert h.source.drains == 2
    status, answer = await h.post("/drain", headers=AUTH, json={"now": True})
    assert (status, answer["error"]) == (400, "bad_body")
    assert h.source.drains == 2


async def test_drain_timeout(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "DRAIN_TIMEOUT_S", 0.1)
    h.source.drain_gate = asyncio.Event()
    status, answer = await h.post("/drain", headers=AUTH)
    assert (status, answer["error"]) == (504, "drain_timeout")
    assert h.source.drain_cancelled
    assert h.server.rejected == {"drain_timeout": 1}


# evidence


async def test_evidence_is_forwarded_with_the_parsed_member_id(h: Harness) -> None:
    status, answer = await h.post(
        "/evidence", headers=AUTH, json={"member_id": "00000000000000b2", "reason": "exited:-9"})
    assert (status, answer) == (200, {"accepted": True})
    status, answer = await h.post(
        "/evidence", headers=AUTH, json={"reason": "oom", "member_id": "00000000000000C3"})
    assert (status, answer) == (200, {"accepted": True})
    status, answer = await h.post(
        "/evidence", headers=AUTH, json={"member_id": "ffffffffffffffff", "reason": "x" * 64})
    assert (status, answer) == (200, {"accepted": False})
    status, answer = await h.post("/evidence", headers=AUTH, json={
        "member_id": "00000000000000b2", "reason": "exited with -9", "exited": True})
    assert (status, answer) == (200, {"accepted": True})
    assert h.source.evidence == [(0xB2, "exited:-9", False), (0xC3, "oom", False),
                                 (2**64 - 1, "x" * 64, False), (0xB2, "exited with -9", True)]
    assert not h.server.rejected


@pytest.mark.parametrize(
    ("body", "reason", "detail"),
    [
        (b"", "bad_body", "required"),
        (b"{not json", "bad_json", "not JSON"),
        (b"\xff\xfe{}", "bad_json", "not JSON"),
        (b"[" * 2000 + b"]" * 2000, "bad_json", "not JSON"),  # nesting past the recursion limit
        (b'{"member_id": "00000000000000b2", "member_id": "00000000000000c3", "reason": "a"}',
         "bad_json", "duplicate"),
        (b'["00000000000000b2", "a"]', "bad_body", "object"),
        (b'{"member_id": "00000000000000b2"}', "bad_body", "missing reason"),
        (b'{"member_id": "00000000000000b2", "reason": "a", "x": 1}', "bad_body", "unknown x"),
        (b'{"member_id": "b2", "reason": "a"}', "bad_body", "16 hex"),
        (b'{"member_id": "00000000000000g2", "reason": "a"}', "bad_body", "16 hex"),
        (b'{"member_id": "+0000000000000b2", "reason": "a"}', "bad_body", "16 hex"),
        (b'{"member_id": 178, "reason": "a"}', "bad_body", "16 hex"),
        (b'{"member_id": "00000000000000b2", "reason": ""}', "bad_body", "reason"),
        (b'{"member_id": "00000000000000b2", "reason": "' + b"x" * 65 + b'"}', "bad_body",
         "reason"),
        (b'{"member_id": "00000000000000b2", "reason": "a\\nb"}', "bad_body", "printable"),
        (b'{"member_id": "00000000000000b2", "reason": 5}', "bad_body", "reason"),
        (b'{"member_id": "00000000000000b2", "reason": "a", "exited": 1}', "bad_body", "exited"),
    ],
)
async def test_bad_evidence_is_a_counted_400(
    h: Harness, body: bytes, reason: str, detail: str
) -> None:
    status, answer = await h.post("/evidence", headers=AUTH, data=body)
    assert status == 400
    assert answer["error"] == reason
    assert detail in answer["detail"]
    assert h.server.rejected == {reason: 1}
    assert h.source.evidence == []


async def test_oversized_body_is_a_counted_413(h: Harness) -> None:
    big = {"member_id": "00000000000000b2", "reason": "a", "pad": "x" * MAX_BODY_BYTES}
    status, answer = await h.post("/evidence", headers=AUTH, json=big)
    assert (status, answer["error"]) == (413, "too_large")
    status, answer = await h.post("/drain", headers=AUTH, data=b" " * (MAX_BODY_BYTES + 1))
    assert (status, answer["error"]) == (413, "too_large")
    assert h.server.rejected == {"too_large": 2}
    assert h.source.evidence == [] and h.source.drains == 0
    # the server still answers
    status, body, _ = await h.get("/healthz")
    assert (status, body) == (200, b"ok")


async def test_malformed_http_is_counted_and_logged_once(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = h.server.address  # type: ignore[misc]
    payloads = [
        b"GARBAGE\r\n\r\n",
        b"GET /status HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS ClientHello
    ]
    with caplog.at_level("DEBUG", logger="torchpass_p2p.agent.http"):
        for payload in payloads:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(payload)
            answer = await reader.read(64)
            writer.close()
            await writer.wait_closed()
            assert answer.startswith(b"HTTP/1.0 400"), answer
    assert h.server.rejected == {"bad_http": 3}
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "malformed HTTP" in warnings[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= 40]  # no ERROR tracebacks
    status, _, _ = await h.get("/healthz")
    assert status == 200


async def test_rejections_reach_the_metrics(h: Harness) -> None:
    await h.post("/drain")
    await h.post("/drain", headers={"Authorization": "Bearer nope"})
    await h.post("/drain", headers={"Authorization": "Bearer nope"})
    await h.post("/evidence", headers=AUTH, data=b"{")
    await h.post("/evidence", headers=AUTH, json={"member_id": "00000000000000b2", "reason": "a"})
    _, body, _ = await h.get("/metrics")
    s = metric_samples(body.decode())
    assert s[("torchpass_http_rejected_total", (("reason", "no_token"),))] == 1
    assert s[("torchpass_http_rejected_total", (("reason", "bad_token"),))] == 2
    assert s[("torchpass_http_rejected_total", (("reason", "bad_json"),))] == 1
    # a second scrape does not count them again
    _, body, _ = await h.get("/metrics")
    s = metric_samples(body.decode())
    assert s[("torchpass_http_rejected_total", (("reason", "bad_token"),))] == 2


async def test_two_servers_in_one_process(h: Harness) -> None:
    other_metrics = AgentMetrics()
    other = StatusServer(FakeSource(), other_metrics, token=http_token(bytes(32)))
    host, port = await other.start()
    try:
        assert port != h.server.address[1]  # type: ignore[index]
        h.metrics.set_step(5)
        other_metrics.set_step(9)
        async with h.session.get(f"http://{host}:{port}/metrics") as r:
            s = metric_samples((await r.read()).decode())
        assert s[("torchpass_step", ())] == 9
        _, body, _ = await h.get("/metrics")
        assert metric_samples(body.decode())[("torchpass_step", ())] == 5
        # each server takes its own token only
        async with h.session.post(f"http://{host}:{port}/drain", headers=AUTH) as r:
            assert r.status == 401
    finally:
        await other.stop()


# the status CLI


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchpass-p2p")
    status_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["status", *argv])
    assert args.func is status_cli.run
    return args


async def test_cli_prints_the_cluster_table(h: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    code = await asyncio.to_thread(status_cli.run, cli_args(h.hostport))
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    header = lines[0]
    for part in ("testcluster", "config_id 3", "step 1200", "world_size 2",
                 f"member {ME:016x} (rank 0)"):
        assert part in header
    table = [line.split() for line in lines[1:] if line.split()[:1] and len(line.split()[0]) == 16]
    rows = {row[0]: row for row in table}
    assert rows[f"{ME:016x}"] == [f"{ME:016x}", "rank", "0", "alive", "1", "127.0.0.1:40001"]
    assert rows["00000000000000b2"] == ["00000000000000b2", "rank", "1", "suspect", "2",
                                        "127.0.0.1:40002"]
    assert rows["00000000000000c3"] == ["00000000000000c3", "spare", "-", "alive", "0",
                                        "127.0.0.1:40003"]
    # ranks in rank order, then spares
    order = [row[0] for row in table]
    assert order == [f"{ME:016x}", "00000000000000b2", "00000000000000c3"]
    # peer text is printed as text, never as rich markup
    assert "00000000000000b2 [by a1]" in out


async def test_cli_says_how_many_a_fenced_member_reaches(
        h: Harness, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # A member fenced without a majority (issue 32, item 3): the header says how many of the
    # configuration it reaches and how many a majority is.
    monkeypatch.setattr(h.source, "status",
                        lambda: dict(STATUS, fenced=True, reachable=1, majority=2))
    code = await asyncio.to_thread(status_cli.run, cli_args(h.hostport))
    assert code == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith("FENCED (1 of 3 reachable, a majority is 2)"), header


async def test_cli_json(h: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    code = await asyncio.to_thread(status_cli.run, cli_args(h.hostport, "--json"))
    assert code == 0
    assert json.loads(capsys.readouterr().out) == STATUS


async def test_cli_unreachable_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = await asyncio.to_thread(
        status_cli.run, cli_args(f"127.0.0.1:{port}", "--timeout", "2"))
    captured = capsys.readouterr()
    assert code == 2
    assert f"cannot reach 127.0.0.1:{port}" in captured.err
    assert captured.out == ""


async def test_cli_timeout_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    # a listener that accepts and never answers
    writers: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: writers.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        code = await asyncio.to_thread(
            status_cli.run, cli_args(f"127.0.0.1:{port}", "--timeout", "0.3"))
    finally:
        for w in writers:
            w.close()
        server.close()
        await server.wait_closed()
    assert code == 2
    assert "no answer" in capsys.readouterr().err


def test_cli_bad_address_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert status_cli.run(cli_args("localhost")) == 2
    assert "host:port" in capsys.readouterr().err


async def test_cli_wrong_server_exits_1(h: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    h.source.fail = True  # /status answers 500
    code = await asyncio.to_thread(status_cli.run, cli_args(h.hostport))
    assert code == 1
    assert "HTTP 500" in capsys.readouterr().err


async def test_connections_past_the_cap_close_the_oldest(h: Harness) -> None:
    host, port = h.server.address
    opened = http.MAX_CONNECTIONS + 5
    idle = [await asyncio.open_connection(host, port) for _ in range(opened)]  # say nothing
    server = h.server._runner.server
    async with asyncio.timeout(10):  # until the server accepted every one of them
        while len(server.connections) + h.server.rejected["evicted_connection"] < opened:
            await asyncio.sleep(0.01)
    assert len(server.connections) == http.MAX_CONNECTIONS
    assert h.server.rejected["evicted_connection"] == 5
    status, body, _ = await h.get("/healthz")  # a newcomer is served
    assert (status, body) == (200, b"ok")
    assert h.server.rejected["evicted_connection"] == 6
    for reader, _ in idle[:6]:  # the six oldest were closed
        assert await asyncio.wait_for(reader.read(), 10) == b""
    for _, writer in idle:
        writer.close()

