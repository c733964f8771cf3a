"""``torchpass-p2p drain`` against a real aiohttp server standing in for an agent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from torchpass_p2p.agent.http import http_token
from torchpass_p2p.cli.main import main
from torchpass_p2p.launch.keyfile import write_key_file

pytestmark = pytest.mark.timeout(20)

KEY = b"\x11" * 32


@pytest.fixture
async def agent() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A status page whose ``/drain`` takes the token of :data:`KEY` only; it accepts the first
    drain and refuses the others (``no_spare``)."""
    seen: list[dict[str, Any]] = []
    accepted: list[int] = []
    token = http_token(KEY)

    async def drain(request: web.Request) -> web.Response:
        seen.append({"auth": request.headers.get("Authorization"),
                     "body": await request.read()})
        if request.headers.get("Authorization") != f"Bearer {token}":
            return web.json_response({"error": "bad_token"}, status=403)
        accepted.append(1)
        if len(accepted) > 1:  # then as when no spare could take the rank
            return web.json_response({"draining": False, "reason": "no_spare",
                                      "detail": "no spare to take the rank"})
        return web.json_response({"draining": True, "member_id": "00000000000000aa"})

    app = web.Application()
    app.router.add_post("/drain", drain)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_drain_posts_the_token_and_prints_the_reply(
        agent: tuple[str, list[dict[str, Any]]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    address, seen = agent
    write_key_file(tmp_path / "k", KEY)
    code = await asyncio.to_thread(main, ["drain", address, "--key-file", str(tmp_path / "k")])
    assert code == 0
    assert json.loads(capsys.readouterr().out) == {"draining": True,
                                                   "member_id": "00000000000000aa"}
    assert seen == [{"auth": "Bearer " + http_token(KEY), "body": b"{}"}]
    code = await asyncio.to_thread(main, ["drain", address, "--key-file", str(tmp_path / "k")])
    out, err = capsys.readouterr()
    assert code == 1 and json.loads(out)["reason"] == "no_spare"
    assert "refused: no spare to take the rank" in err


async def test_drain_fails_on_refusal_unreachable_agent_or_missing_key(
        agent: tuple[str, list[dict[str, Any]]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    address, _ = agent
    write_key_file(tmp_path / "wrong", b"\x22" * 32)
    code = await asyncio.to_thread(main, ["drain", address, "--key-file",
                                          str(tmp_path / "wrong")])
    assert code == 1 and "refused: HTTP 403" in capsys.readouterr().err
    unreachable = address.rsplit(":", 1)[0] + ":1"
    code = await asyncio.to_thread(main, ["drain", unreachable, "--key-file",
                                          str(tmp_path / "wrong"), "--timeout", "2"])
    assert code == 2 and "unreachable" in capsys.readouterr().err  # as status says it
    for name in ("TORCHPASS_KEY_FILE", "TORCHPASS_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert await asyncio.to_thread(main, ["drain", address]) == 2
    assert "no cluster key" in capsys.readouterr().err
    monkeypatch.setenv("TORCHPASS_KEY", "11" * 32)
    assert await asyncio.to_thread(main, ["drain", address]) == 0
