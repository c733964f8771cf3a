"""The training side of straggler naming (:mod:`torchpass_p2p.ddp.stragglers`): the figures a
rank puts in its vote, the verdicts it logs from every rank's figures, a new group starting the
detector afresh, and the migrate policy draining the straggler itself, once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torchpass_p2p.core.straggler import StragglerDetector
from torchpass_p2p.ddp.stragglers import UNMEASURED, ArrivalWatch, policy_from_env
from torchpass_p2p.trainer.joblog import EventLog

ME, PEER = 0xA1, 0xB2
RANKS = (PEER, ME)
GROUP = (0, 0)
ME_LATE = [[0.25, 0.5], [0.75, 0.0]]  # rank 1 (this member) arrived 0.5 s after rank 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def log(tmp_path: Path) -> Iterator[EventLog]:
    log = EventLog(tmp_path / "me.jsonl", ME)
    yield log
    log.close()


def watch(log: EventLog, tmp_path: Path, policy: str,
          replies: list[dict[str, Any]] | None = None) -> tuple[ArrivalWatch, Path, list[int]]:
    path = tmp_path / "me.jsonl"
    drained: list[int] = []

    def drain() -> dict[str, Any]:
        drained.append(1)
        return (replies or [{"draining": True}]).pop(0)

    w = ArrivalWatch(ME, policy, log, drain,
                     detector=StragglerDetector(window=2, hits=2))
    return w, path, drained


def test_the_policy_comes_from_the_environment() -> None:
    assert policy_from_env({}) == "report"
    assert policy_from_env({"TORCHPASS_STRAGGLER": " migrate "}) == "migrate"
    assert policy_from_env({"TORCHPASS_STRAGGLER": "off"}) == "off"
    with pytest.raises(ValueError, match="TORCHPASS_STRAGGLER='drop': one of off, report"):
        policy_from_env({"TORCHPASS_STRAGGLER": "drop"})


def test_figures_are_work_and_wait_on_this_clock_and_a_redone_step_has_none() -> None:
    clock = Clock()
    w = ArrivalWatch(ME, "report", lambda *a, **k: None, dict, clock=clock)
    assert w.figures(0.0) == [UNMEASURED, UNMEASURED]  # no step opened
    w.opened()
    clock.now += 0.75
    assert w.figures(0.5) == [0.25, 0.5]
    w.spoil()
    assert w.figures(0.5) == [UNMEASURED, UNMEASURED]
    w.opened()
    assert w.figures(0.0) == [0.0, 0.0]


def test_named_in_the_log_then_cleared_by_a_new_group(log: EventLog, tmp_path: Path) -> None:
    w, path, drained = watch(log, tmp_path, "report")
    assert w.observe(0, GROUP, RANKS, ME_LATE) == ()
    [named] = w.observe(1, GROUP, RANKS, ME_LATE)
    assert (named.member, named.rank, named.lag_s) == (ME, 1, 0.5)
    assert w.observe(2, GROUP, RANKS, [[0.25, UNMEASURED], [0.75, 0.0]]) == ()  # not judged
    [cleared] = w.observe(3, (0, 1), RANKS, ME_LATE)  # a regroup: attempt 1
    assert (cleared.member, cleared.step, cleared.reason) == (ME, 3, "new group")
    got = [{k: v for k, v in r.items() if k not in ("t", "reason")} for r in records(path)]
    assert got == [
        {"event": "straggler_named", "member": f"{ME:016x}", "step": 1, "config_id": 0,
         "rank": 1, "straggler": f"{ME:016x}", "lag_s": 0.5},
        {"event": "straggler_cleared", "member": f"{ME:016x}", "step": 3, "config_id": 0,
         "rank": 1, "straggler": f"{ME:016x}"}]
    assert drained == []  # report only


def test_migrate_drains_the_named_straggler_itself_once(log: EventLog, tmp_path: Path) -> None:
    w, path, drained = watch(log, tmp_path, "migrate",
                             [{"draining": False, "reason": "no_spare", "detail": "no spare"}])
    for k in range(4):
        w.observe(k, GROUP, RANKS, ME_LATE)
    assert drained == [1]
    [migrate] = [r for r in records(path) if r["event"] == "straggler_migrate"]
    assert {k: migrate[k] for k in ("step", "rank", "draining", "reason", "detail")} == {
        "step": 1, "rank": 1, "draining": False, "reason": "no_spare", "detail": "no spare"}


def test_migrate_leaves_a_peer_that_straggles_to_its_own_process(log: EventLog,
                                                                tmp_path: Path) -> None:
    w, path, drained = watch(log, tmp_path, "migrate")
    peer_late = [[0.75, 0.0], [0.25, 0.5]]
    w.observe(0, GROUP, RANKS, peer_late)
    [named] = w.observe(1, GROUP, RANKS, peer_late)
    assert (named.member, named.rank) == (PEER, 0)
    assert drained == []


def test_off_judges_nothing(log: EventLog, tmp_path: Path) -> None:
    w, path, drained = watch(log, tmp_path, "off")
    for k in range(4):
        assert w.observe(k, GROUP, RANKS, ME_LATE) == ()
    assert not path.exists() or records(path) == []
