"""OwnedTasks: names, the bound, failures logged or handed over, close reaching every task."""

from __future__ import annotations

import asyncio
import logging

import pytest

from torchpass_p2p.tasks import OwnedTasks, TaskLimitReached


async def test_tasks_are_named_held_until_they_end_and_bounded():
    tasks = OwnedTasks("owner", 2)
    gate = asyncio.Event()
    a = tasks.spawn(gate.wait(), name="a")
    b = tasks.spawn(gate.wait(), name="b")
    assert (a.get_name(), b.get_name()) == ("owner/a", "owner/b")
    assert len(tasks) == 2 and a in tasks
    third = gate.wait()
    with pytest.raises(TaskLimitReached):
        tasks.spawn(third, name="c")
    assert third.cr_frame is None  # closed, never run
    gate.set()
    await asyncio.gather(a, b)
    assert len(tasks) == 0
    c = tasks.spawn(asyncio.sleep(0), name="c")  # room again
    await c


async def test_an_ended_task_whose_callback_has_not_run_leaves_room():
    tasks = OwnedTasks("owner", 1)
    first = tasks.spawn(asyncio.sleep(0), name="first")
    await asyncio.wait([first])  # done; the discard callback may still be queued
    second = tasks.spawn(asyncio.sleep(0), name="second")
    await second
    assert len(tasks) == 0


async def test_a_failure_is_logged_unless_on_done_takes_it(caplog):
    tasks = OwnedTasks("owner", 2)

    async def fail() -> None:
        raise ValueError("boom")

    caplog.set_level(logging.ERROR, "torchpass_p2p.tasks")
    logged = tasks.spawn(fail(), name="logged")
    handed: list[asyncio.Task[None]] = []
    taken = tasks.spawn(fail(), name="taken", on_done=handed.append)
    await asyncio.wait([logged, taken])
    await asyncio.sleep(0)  # done callbacks
    assert [r.getMessage() for r in caplog.records] == ["owner: task owner/logged failed"]
    assert handed == [taken]


async def test_close_cancels_and_waits_for_all_but_the_caller_and_what_follows():
    tasks = OwnedTasks("owner", 4)
    ended: list[str] = []

    async def hold(name: str) -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.append(name)

    async def closer() -> None:
        await tasks.close(1.0)
        ended.append("closer done")

    for name in ("x", "y"):
        tasks.spawn(hold(name), name=name)
    await asyncio.sleep(0)
    await tasks.spawn(closer(), name="closer")
    assert sorted(ended) == ["closer done", "x", "y"]
    late = tasks.spawn(hold("late"), name="late")
    await asyncio.wait([late])
    assert late.cancelled() and "late" not in ended  # cancelled before it ran
