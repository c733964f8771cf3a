"""Shared pytest configuration."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from torchpass_p2p._native import refusal, stale_extensions

# CI machines are shared and slow: no per-example deadline, a bounded example count.
settings.register_profile("ci", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compiled modules older than their sources would test the old code: refuse the run."""
    stale = stale_extensions(str(Path(__file__).resolve().parents[1]))
    if stale:
        pytest.exit(refusal(stale), returncode=4)
