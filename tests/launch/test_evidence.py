"""Fast evidence to the siblings' status pages: delivered, refused or silent, never raised."""

from __future__ import annotations

import asyncio
import logging
import socket

import aiohttp
import pytest
from aiohttp import web

from torchpass_p2p.launch.evidence import notify_siblings

DEAD = 0xDEAD


async def page(handler: object) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_post("/evidence", handler)  # type: ignore[arg-type]
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_each_sibling_is_told_and_each_failure_is_named(
        caplog: pytest.LogCaptureFixture) -> None:
    got: list[tuple[str | None, object]] = []

    async def accept(request: web.Request) -> web.Response:
        got.append((request.headers.get("Authorization"), await request.json()))
        return web.json_response({"accepted": True})

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # past the 0.3 s deadline
        return web.json_response({})

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({}, status=401)

    runners = [await page(h) for h in (accept, hang, refuse)]
    try:
        async with aiohttp.ClientSession() as session:
            with caplog.at_level(logging.WARNING, "torchpass_p2p.launch.evidence"):
                told = await notify_siblings(
                    session, [("127.0.0.1", port) for _, port in runners], DEAD,
                    "exited with signal SIGKILL", "tok", exited=True, timeout_s=0.3)
    finally:
        for runner, _ in runners:
            await runner.cleanup()
    assert told == 1
    assert got == [("Bearer tok", {"member_id": f"{DEAD:016x}",
                                   "reason": "exited with signal SIGKILL", "exited": True})]
    hung, refused = (f"127.0.0.1:{port}" for _, port in runners[1:])
    lines = sorted(r.getMessage() for r in caplog.records)
    # A timeout has no message of its own: its type is named, never an empty reason.
    assert lines == sorted([
        f"evidence for {DEAD:016x} to {hung} not delivered: TimeoutError",
        f"evidence for {DEAD:016x} to {refused} not delivered: 401, message='Unauthorized', "
        f"url='http://{refused}/evidence'"])


async def test_a_page_still_starting_is_asked_again_until_it_listens(
        caplog: pytest.LogCaptureFixture) -> None:
    # A new user's run: a child killed while its siblings still imported torch; their status
    # ports were bound (by the launcher) but not listening, and the evidence was dropped.
    got: list[object] = []

    async def accept(request: web.Request) -> web.Response:
        got.append(await request.json())
        return web.json_response({"accepted": True})

    starting = socket.socket()
    starting.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    never = socket.socket()
    never.bind(("127.0.0.1", 0))
    app = web.Application()
    app.router.add_post("/evidence", accept)
    runner = web.AppRunner(app)
    await runner.setup()

    async def start_later() -> None:
        await asyncio.sleep(0.5)
        await web.SockSite(runner, starting).start()  # it listens now

    pages = [s.getsockname() for s in (starting, never)]
    try:
        async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tg:
            tg.create_task(start_later())
            with caplog.at_level(logging.WARNING, "torchpass_p2p.launch.evidence"):
                told = await notify_siblings(session, pages, DEAD, "exited with 3", "tok",
                                             exited=True, start_wait_s=2.0)
    finally:
        await runner.cleanup()
        never.close()
    assert told == 1
    assert got == [{"member_id": f"{DEAD:016x}", "reason": "exited with 3", "exited": True}]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"evidence for {DEAD:016x} to 127.0.0.1:{pages[1][1]} not delivered: "
                           "Cannot connect to host"), line
