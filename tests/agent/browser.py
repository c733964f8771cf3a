"""Headless Chromium driven over the DevTools protocol, for the status page's tests.

Debian's ``chromium`` package is the browser (no download by a test library: selenium and
playwright fetch browsers from the internet). :func:`chromium_or_skip` finds it, and in CI
(``CI=true``) installs it with apt first when it is missing; elsewhere a test that needs it is
skipped with the command that installs it. :class:`Browser` starts it with remote debugging on
a port of its choosing (read back from ``DevToolsActivePort`` in its profile folder) and speaks
the protocol over a websocket with aiohttp: a page is opened as a target, the DOM is read with
``Runtime.evaluate`` and a screenshot taken with ``Page.captureScreenshot``
(https://chromedevtools.github.io/devtools-protocol/).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

APT_INSTALL = ["apt-get", "install", "-y", "-q", "--no-install-recommends",
               "-o", "DPkg::Lock::Timeout=300", "chromium", "fonts-dejavu-core"]
"""What CI installs: the browser and a font to draw the page with (not its 100 recommended
packages: 25 packages, about 40 s here)."""
INSTALL_TIMEOUT_S = 900.0
START_TIMEOUT_S = 60.0
"""The browser's first start on two loaded cores takes seconds."""
CALL_TIMEOUT_S = 60.0
"""Longest wait for one protocol call's answer (a screenshot of a busy page: about a second)."""


def chromium_executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def chromium_or_skip() -> str:
    """The Chromium executable. Missing: in CI installed with apt (as root, or with
    ``sudo -n``), failing the test if apt fails; elsewhere, or without the rights to install,
    the test is skipped with the reason."""
    found = chromium_executable()
    if found:
        return found
    if os.environ.get("CI") != "true":
        pytest.skip("needs Debian's chromium package (apt-get install --no-install-recommends "
                    "chromium); in CI (CI=true) the test installs it itself")
    prefix: list[str] = []
    if os.geteuid() != 0:
        can_sudo = shutil.which("sudo") is not None and subprocess.run(
            ["sudo", "-n", "true"], capture_output=True, check=False).returncode == 0
        if not can_sudo:
            pytest.skip("needs Debian's chromium package, and this CI job is neither root nor "
                        "allowed sudo to install it (apt-get install --no-install-recommends "
                        "chromium)")
        prefix = ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    output = ""
    for command in ([*prefix, *APT_INSTALL],
                    [*prefix, "apt-get", "update", "-q"], [*prefix, *APT_INSTALL]):
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S, check=False)
        output += f"$ {' '.join(command)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        if done.returncode == 0 and command[-1] == "fonts-dejavu-core":
            break  # installed (the update only runs when the lists were missing or stale)
    found = chromium_executable()
    if not found:
        pytest.fail(f"chromium could not be installed:\n{output[-4000:]}")
    return found


class Page:
    """One tab, attached over the browser's websocket (a flat session)."""

    def __init__(self, browser: Browser, session_id: str) -> None:
        self.browser, self.session_id = browser, session_id

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        return await self.browser.call(method, params, session_id=self.session_id)

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page. Raises ``RuntimeError`` if it
        threw."""
        answer = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True)
        if "exceptionDetails" in answer:
            raise RuntimeError(f"{expression[:80]!r} threw: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float, poll_s: float = 0.25) -> Any:
        """Evaluate ``expression`` until its value is truthy; return it.

        Raises:
            TimeoutError: not within ``timeout_s`` seconds (the message has the last value).
        """
        last: Any = None
        try:
            async with asyncio.timeout(timeout_s):
                while not (last := await self.evaluate(expression)):
                    await asyncio.sleep(poll_s)
        except TimeoutError:
            raise TimeoutError(f"not within {timeout_s} s: {expression[:120]!r} was {last!r}"
                               ) from None
        return last

    async def screenshot(self, path: Path) -> bytes:
        """Save the whole page as PNG at ``path``; returns the bytes."""
        metrics = await self.call("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        answer = await self.call("Page.captureScreenshot", format="png", clip=clip,
                                 captureBeyondViewport=True)
        data = base64.b64decode(answer["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return data


class Browser:
    """Headless Chromium with a throw-away profile in ``profile`` (module docstring)."""

    def __init__(self, process: asyncio.subprocess.Process, session: aiohttp.ClientSession,
                 ws: aiohttp.ClientWebSocketResponse) -> None:
        self.process, self.session, self.ws = process, session, ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(cls, executable: str, profile: Path, *, width: int = 1280,
                    height: int = 1000) -> Browser:
        profile.mkdir(parents=True, exist_ok=True)
        log = open(profile / "chromium.log", "wb")  # noqa: SIM115 - the child writes to it
        try:
            process = await asyncio.create_subprocess_exec(
                executable, "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--no-proxy-server",
                "--remote-debugging-port=0", f"--user-data-dir={profile}",
                f"--window-size={width},{height}", "about:blank",
                stdout=log, stderr=log)
        finally:
            log.close()
        active = profile / "DevToolsActivePort"
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                while not (active.exists() and len(active.read_text().splitlines()) >= 2):
                    if process.returncode is not None:
                        raise RuntimeError("chromium exited")
                    await asyncio.sleep(0.1)
            port, path = active.read_text().splitlines()[:2]
            session = aiohttp.ClientSession()
            ws = await session.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=64 << 20)
        except BaseException as exc:
            process.kill()
            await process.wait()
            detail = (profile / "chromium.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"chromium did not start: {exc!r}\n{detail}") from exc
        return cls(process, session, ws)

    async def call(self, method: str, params: dict[str, Any] | None = None, *,
                   session_id: str | None = None) -> dict[str, Any]:
        """Send one command and return its ``result``.

        Raises:
            RuntimeError: the browser answered with an error, or the connection ended.
            TimeoutError: no answer within :data:`CALL_TIMEOUT_S`.
        """
        call_id = next(self._ids)
        message: dict[str, Any] = {"id": call_id, "method": method, "params": params or {}}
        if session_id is not None:
            message["sessionId"] = session_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        try:
            await self.ws.send_json(message)
            async with asyncio.timeout(CALL_TIMEOUT_S):
                return await future
        finally:
            self._waiting.pop(call_id, None)

    async def open(self, url: str, timeout_s: float = START_TIMEOUT_S) -> Page:
        """A new tab showing ``url``, once it has loaded (its scripts have run).

        Raises:
            TimeoutError: not loaded within ``timeout_s`` seconds.
        """
        target = await self.call("Target.createTarget", {"url": url})
        attached = await self.call("Target.attachToTarget",
                                   {"targetId": target["targetId"], "flatten": True})
        page = Page(self, attached["sessionId"])
        await page.wait_for(f"location.href === {json.dumps(url)} "
                            "&& document.readyState === 'complete'", timeout_s)
        return page

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.call("Browser.close"), 5.0)
        await self.ws.close()
        await self.session.close()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        try:
            await asyncio.wait_for(self.process.wait(), 10.0)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()

    async def _read(self) -> None:
        """Hand each answer to its caller; events are not used here and are dropped."""
        try:
            async for message in self.ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = message.json()
                future = self._waiting.get(data.get("id", -1))
                if future is None or future.done():
                    continue
                if "error" in data:
                    future.set_exception(RuntimeError(f"DevTools error: {data['error']}"))
                else:
                    future.set_result(data.get("result", {}))
        finally:
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(RuntimeError("the DevTools connection ended"))
