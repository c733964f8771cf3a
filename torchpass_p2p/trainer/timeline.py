"""Reading the trainers' timelines (:mod:`.joblog`) back: recovery timelines per fault, steps
lost, and whether two runs ended with bitwise-equal state.

All times are CLOCK_MONOTONIC seconds (the trainers' ``t`` and the agents' event times), so
records from every process of one host line up.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FaultTimeline", "final_states", "read_events", "recoveries"]


def read_events(directory: str | Path) -> list[dict[str, Any]]:
    """Every record of every ``*.jsonl`` in ``directory``, sorted by time."""
    out: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        with open(path) as f:
            out.extend(json.loads(line) for line in f if line.endswith("\n"))
    out.sort(key=lambda r: r["t"])
    return out


@dataclass(frozen=True)
class FaultTimeline:
    """One fault and the recovery that followed. Seconds after the fault (None: not seen).

    Attributes:
        kind, step, point, rank: the fault (:mod:`.faults`).
        config_id: the configuration that replaced the faulty rank.
        detected_s: first alert, suspicion or reported exit (a departure) at any agent.
        decided_s: first member learning the decision.
        transferred_s: the replacement holding the verified state.
        rebuilt_s: the last member's group of ``config_id`` formed.
        resumed_s: the last member committing the resume step in ``config_id``, or in a later
            configuration when ``config_id`` was superseded before it trained.
        resume_step: where training went on.
        last_committed: highest step any member committed before ``config_id``.
        steps_lost: committed steps not kept (``last_committed + 1 - resume_step``, at least 0).
        action: the survivors' commit rule actions (``redo``/``roll_forward``), distinct.
    """

    kind: str
    step: int
    point: str
    rank: int
    config_id: int | None
    detected_s: float | None
    decided_s: float | None
    transferred_s: float | None
    rebuilt_s: float | None
    resumed_s: float | None
    resume_step: int | None
    last_committed: int
    steps_lost: int
    action: tuple[str, ...]


def _after(values: Iterable[float], t0: float) -> float | None:
    later = [v - t0 for v in values if v >= t0]
    return min(later) if later else None


def recoveries(events: list[dict[str, Any]]) -> list[FaultTimeline]:
    """One :class:`FaultTimeline` per ``fault`` record, in time order."""
    out = []
    for fault in (r for r in events if r["event"] == "fault"):
        t0 = fault["t"]
        # The first change that removed the faulty member (a spare removed: no rank).
        changes = [r for r in events if r["event"] == "change" and r["t"] >= t0
                   and fault["member"] in r["removed"] and not r.get("same_ranks")]
        c = changes[0]["config_id"] if changes else None
        mine = [r for r in changes if r["config_id"] == c]
        alerts = [a for r in mine for a in r["alerts_at"]]
        formed = [r["t"] for r in events if r["event"] == "group_formed" and r["config_id"] == c]
        fetched = [r["t"] for r in events if r["event"] == "state_fetched"
                   and r["config_id"] == c]
        resume = mine[0]["resume_step"] if mine else None
        # Training resumed at the resume step in configuration c, or in a later one when c
        # was superseded before it trained (another fault during the recovery).
        resumed = [r["t"] for r in events if r["event"] == "step" and c is not None
                   and r["config_id"] is not None and r["config_id"] >= c
                   and r["step"] == resume]
        before = [r["step"] for r in events if r["event"] == "step"
                  and r["config_id"] is not None and c is not None and r["config_id"] < c]
        last = max(before, default=-1)
        actions = tuple(sorted({r["action"] for r in events if r["event"] == "commit_rule"
                                and r["config_id"] == c}))
        out.append(FaultTimeline(
            fault["kind"], fault["step"], fault["point"], fault["rank"], c,
            _after(alerts, t0), _after((r["decided_at"] for r in mine), t0),
            max(fetched) - t0 if fetched else None, max(formed) - t0 if formed else None,
            max(resumed) - t0 if resumed else None, resume, last,
            max(0, last + 1 - resume) if resume is not None else 0, actions))
    return out


def final_states(out_dir: str | Path) -> list[dict[str, Any]]:
    """The ``final-<member>.json`` records of a run, by rank."""
    found = [json.loads(p.read_text()) for p in Path(out_dir).glob("final-*.json")]
    return sorted(found, key=lambda r: r["rank"])
