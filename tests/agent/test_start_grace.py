"""The launcher's start record (``TORCHPASS_STARTED``) reaches the core: live agents give a member
whose process starts late its start-up grace (``Params.start_grace_s``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from tests.agent.cluster import LocalCluster
from torchpass_p2p.agent.settings import SettingsError, load_settings
from torchpass_p2p.core.messages import MemberState

KEY = {"TORCHPASS_KEY": "ab" * 32, "TORCHPASS_SEEDS": "127.0.0.1:9"}


def test_the_environment_carries_the_launchers_start_record():
    assert load_settings(environ=KEY).started is None
    settings = load_settings(environ={
        **KEY, "TORCHPASS_STARTED": "00000000000000a1@12.5,00000000000000b2@13.250"})
    assert settings.started == {0xA1: 12.5, 0xB2: 13.25}
    for bad in ("a1@12.5", "00000000000000a1", "00000000000000a1@x", "00000000000000a1@inf",
                "00000000000000a1@1,", "zz00000000000000@1"):
        with pytest.raises(SettingsError, match="TORCHPASS_STARTED"):
            load_settings(environ={**KEY, "TORCHPASS_STARTED": bad})


async def late_start(started: bool) -> LocalCluster:
    """Members 1 and 2 of three start; member 3 starts 3 s later. ``started``: with the
    launcher's record (every process started now); without it, no grace."""
    cluster = LocalCluster(3, 0, seed=5)
    if started:
        now = time.monotonic()
        for agent in cluster.agents.values():
            agent.settings = replace(agent.settings, started={1: now, 2: now, 3: now})
    await cluster[1].start()
    await cluster[2].start()
    await asyncio.sleep(3.0)
    await cluster[3].start()
    await asyncio.sleep(3.0)
    return cluster


async def test_a_member_starting_3_s_late_is_accused_by_nobody_with_the_start_record():
    cluster = await late_start(True)
    try:
        (observer,) = cluster.configuration.observers_of(3)
        member = cluster[observer].member
        assert member is not None
        assert member.counters["rounds_in_start_grace"] >= 2  # it probed 3 before it ran
        for agent in cluster.live():
            assert agent.member is not None
            assert agent.member.counters["alerts_raised"] == 0
            assert agent.member.state_of(3) == (MemberState.ALIVE, 0)
            assert agent.configuration.config_id == 0
    finally:
        await cluster.stop()


async def test_without_the_start_record_the_late_member_is_accused_before_it_runs():
    cluster = await late_start(False)
    try:
        (observer,) = cluster.configuration.observers_of(3)
        member = cluster[observer].member
        assert member is not None and member.counters["alerts_raised"] >= 1
        assert "rounds_in_start_grace" not in member.counters
    finally:
        await cluster.stop()
