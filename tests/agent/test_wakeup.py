"""The timer loops' sleep (torchpass_p2p/agent/wakeup.py).

Must hold: a sleep ends at a set() or at its delay, whichever is first; a set() before the sleep
ends the next sleep at once, and clear() forgets it; one sleeper at a time; a cancelled sleep
leaves nothing behind.
"""

from __future__ import annotations

import asyncio

import pytest

from torchpass_p2p.agent.wakeup import Wakeup


async def test_a_sleep_ends_at_a_set_from_another_task() -> None:
    wakeup = Wakeup()
    sleeper = asyncio.ensure_future(wakeup.sleep(3600))
    await asyncio.sleep(0)
    assert not sleeper.done()
    wakeup.set()
    await asyncio.wait_for(sleeper, 5)
    # the set was slept on: the next sleep waits again
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(wakeup.sleep(3600), 0.05)


async def test_a_sleep_ends_at_its_delay() -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait_for(Wakeup().sleep(0.05), 5)
    assert loop.time() - began >= 0.04  # the loop's timers may fire a clock tick early


async def test_a_set_before_the_sleep_ends_it_at_once_and_clear_forgets_it() -> None:
    wakeup = Wakeup()
    wakeup.set()
    await asyncio.wait_for(wakeup.sleep(3600), 5)
    wakeup.set()
    wakeup.clear()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(wakeup.sleep(3600), 0.05)


async def test_one_sleeper_at_a_time_and_a_cancelled_sleep_leaves_nothing() -> None:
    wakeup = Wakeup()
    first = asyncio.ensure_future(wakeup.sleep(3600))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="another task sleeps"):
        await wakeup.sleep(1)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    wakeup.set()
    await asyncio.wait_for(wakeup.sleep(3600), 5)
