"""Fixtures of the agent's tests: headless Chromium for the status page's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.agent.browser import Browser, chromium_or_skip


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's Chromium, installed in CI when missing (:func:`.browser.chromium_or_skip`)."""
    return chromium_or_skip()


@pytest.fixture
async def browser(chromium: str, tmp_path: Path) -> AsyncIterator[Browser]:
    """A started headless Chromium with a fresh profile, closed after the test."""
    started = await Browser.start(chromium, tmp_path / "chromium-profile")
    try:
        yield started
    finally:
        await started.close()
