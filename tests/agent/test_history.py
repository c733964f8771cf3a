"""What the status page draws as history (:mod:`torchpass_p2p.agent.history`): live agents on
loopback replace a crashed rank and admit a joiner, and each member's ``/status`` names the
configurations, the one recovery and its phases; the trainer's records and a transfer's
progress fill in the rest; every collection stays bounded."""

from __future__ import annotations

from dataclasses import replace

from tests.agent.cluster import LocalCluster
from torchpass_p2p.agent.history import (
    ACCUSED_KEPT,
    CONFIGURATIONS_KEPT,
    RECOVERIES_KEPT,
    STRAGGLERS_KEPT,
    History,
)
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.plan import Plan

CRASHED, HEIR = 2, 4  # member 2 holds rank 1; member 4 is the only spare


def hex_id(member: int) -> str:
    return f"{member:016x}"


async def test_a_crash_and_a_join_as_each_member_saw_them() -> None:
    cluster = LocalCluster(3, 1, seed=7)
    await cluster.start()
    try:
        await cluster[CRASHED].stop(leave=False)
        survivors = [cluster[m] for m in (1, 3, HEIR)]
        await cluster.until(lambda: all(
            a.configuration.config_id == 1 and a.history.status()["recoveries"]
            and a.history.status()["recoveries"][0]["resume_step"] is not None
            for a in survivors), timeout_s=30)
        await cluster.join(5)
        await cluster.until(lambda: all(
            len(a.history.status()["configurations"]) == 2 for a in survivors), timeout_s=30)

        for agent in survivors:
            doc = agent.status()
            assert doc["clock"] >= doc["recoveries"][0]["decided_at"]
            first, second = doc["configurations"]
            assert first == {
                "config_id": 1, "decided_at": agent.decided_at[1], "round": first["round"],
                "world_size": 3, "ranks": [hex_id(1), hex_id(HEIR), hex_id(3)], "spares": [],
                "removed": [hex_id(CRASHED)], "joined": [], "assignments": [[1, hex_id(HEIR)]],
                "action": "continue", "resume_step": 0}
            assert first["round"] in (0, 1)  # fast or classic: either is a decision
            assert second["config_id"] == 2 and second["joined"] == [hex_id(5)]
            assert second["ranks"] == first["ranks"] and second["spares"] == [hex_id(5)]
            assert second["assignments"] == [] and second["removed"] == []
            # Only the change that moved a rank is a recovery; the join is not.
            [recovery] = doc["recoveries"]
            detected = recovery.pop("detected_at")
            assert detected is not None and detected <= agent.decided_at[1]
            assert recovery == {
                "config_id": 1, "removed": [hex_id(CRASHED)],
                "assignments": [[1, hex_id(HEIR)]], "vacant": [], "action": "continue",
                "resume_step": 0, "decided_at": agent.decided_at[1],
                "transferred_at": None, "transferred_by": None, "rebuilt_at": None,
                "resumed_at": None}
            assert doc["transfer"] is None  # no trainer: nothing was transferred
    finally:
        await cluster.stop()


def decision(at: float, config_id: int, ranks: list[int | None], spares: list[int], *,
             removed: tuple[int, ...] = (), assignments: tuple[tuple[int, int], ...] = (),
             joined: tuple[int, ...] = ()) -> ev.ConfigurationDecided:
    plan = Plan(config_id - 1, config_id, removed, joined, assignments, (), "continue", (),
                len(ranks), tuple((r, (1,)) for r, _ in assignments))
    return ev.ConfigurationDecided(at, Configuration(config_id, ranks, spares), 1, 3, plan)


def ready(at: float, decided: ev.ConfigurationDecided, resume_step: int) -> ev.PlanReady:
    return ev.PlanReady(at, replace(decided.plan, resume_step=resume_step))


def test_the_trainer_and_the_transfer_fill_in_the_phases() -> None:
    now = [100.0]
    history = History(clock=lambda: now[0])
    history.on_event(ev.MemberSuspected(10.0, 2, 0, 1))
    history.on_event(ev.AlertRaised(10.5, 3, 2, 0))
    decided = decision(11.0, 1, [1, 4, 3], [], removed=(2,), assignments=((1, 4),))
    history.on_event(decided)
    history.on_event(ready(11.1, decided, 42))
    history.record({"t": 11.2, "event": "fetch_started", "config_id": 1, "step": 42,
                    "sources": 2, "member": hex_id(4)})
    now[0] = 11.25
    history.transfer_progress("receiving", 42, 4096, 16384, 1)
    assert history.status()["transfer"] == {
        "direction": "receiving", "config_id": 1, "step": 42, "done_bytes": 4096,
        "total_bytes": 16384, "sources": 2, "started_at": 11.2, "updated_at": 11.25,
        "finished_at": None}
    history.record({"t": 11.3, "event": "state_fetched", "config_id": 1, "step": 42,
                    "bytes": 16384, "seconds": 0.09, "sources": 2})
    history.record({"t": 11.4, "event": "group_formed", "config_id": 1, "rank": 1})
    history.record({"t": 11.5, "event": "joined", "config_id": 1, "rank": 1})  # received: kept
    history.record({"t": 11.6, "event": "step", "config_id": 1, "step": 42})
    history.record({"t": 11.7, "event": "step", "config_id": 1, "step": 43})  # first one only
    status = history.status()
    assert status["recoveries"] == [{
        "config_id": 1, "removed": [hex_id(2)], "assignments": [[1, hex_id(4)]], "vacant": [],
        "action": "continue", "resume_step": 42, "detected_at": 10.0, "decided_at": 11.0,
        "transferred_at": 11.3, "transferred_by": "received", "rebuilt_at": 11.4,
        "resumed_at": 11.6}]
    assert status["transfer"] == {
        "direction": "receiving", "config_id": 1, "step": 42, "done_bytes": 16384,
        "total_bytes": 16384, "sources": 2, "started_at": 11.2, "updated_at": 11.3,
        "finished_at": 11.3}
    assert status["configurations"][0]["resume_step"] == 42


def test_a_source_sees_its_share_sent_and_a_refuted_suspicion_detects_nothing() -> None:
    now = [0.0]
    history = History(clock=lambda: now[0])
    history.on_event(ev.MemberSuspected(1.0, 3, 0, 1))
    history.on_event(ev.MemberAlive(1.5, 3, 1))  # refuted
    history.on_event(ev.MemberLeft(2.0, 2, 0))  # an exit the launcher reported
    decided = decision(3.0, 1, [1, 4, 3], [], removed=(2,), assignments=((1, 4),))
    history.on_event(decided)
    history.on_event(ready(3.0, decided, 7))
    for t, sent in ((3.2, 1000), (3.3, 2000)):
        now[0] = t
        history.transfer_progress("sending", 7, sent, 4000)
    status = history.status()
    [recovery] = status["recoveries"]
    assert (recovery["detected_at"], recovery["transferred_at"],
            recovery["transferred_by"]) == (2.0, 3.3, "sent")
    assert status["transfer"] == {
        "direction": "sending", "config_id": None, "step": 7, "done_bytes": 2000,
        "total_bytes": 4000, "sources": None, "started_at": 3.2, "updated_at": 3.3,
        "finished_at": None}
    # A later suspicion of member 3 is a new accusation, from its own time; this member is no
    # source there: the new group's fingerprint check is what shows the state transferred.
    history.on_event(ev.MemberSuspected(9.0, 3, 1, 1))
    decided = decision(9.5, 2, [1, 4, 5], [], removed=(3,), assignments=((2, 5),))
    history.on_event(decided)
    history.record({"t": 9.8, "event": "group_formed", "config_id": 2, "rank": 0})
    history.record({"t": 9.9, "event": "joined", "config_id": 2, "rank": 0})
    second = history.status()["recoveries"][1]
    assert (second["detected_at"], second["rebuilt_at"], second["transferred_at"],
            second["transferred_by"]) == (9.0, 9.8, 9.9, "verified")


def test_everything_kept_is_bounded() -> None:
    history = History()
    for member in range(ACCUSED_KEPT + 500):
        history.on_event(ev.MemberSuspected(float(member), member + 100, 0, 1))
    assert len(history._accused) == ACCUSED_KEPT
    assert next(iter(history._accused)) == 500 + 100  # the oldest went first
    for c in range(1, 41):
        history.on_event(decision(float(c), c, [1, c + 1000], [], removed=(c + 999,),
                                  assignments=((1, c + 1000),)))
    status = history.status()
    assert [c["config_id"] for c in status["configurations"]] == list(
        range(41 - CONFIGURATIONS_KEPT, 41))
    assert [r["config_id"] for r in status["recoveries"]] == list(range(41 - RECOVERIES_KEPT, 41))


def test_records_without_a_time_or_a_configuration_are_ignored() -> None:
    history = History()
    decided = decision(1.0, 1, [1, 4], [], removed=(2,), assignments=((1, 4),))
    history.on_event(decided)
    for record in ({"event": "group_formed", "config_id": 1},
                   {"t": "soon", "event": "group_formed", "config_id": 1},
                   {"t": 2.0, "event": "group_formed", "config_id": None},
                   {"t": 2.0, "event": "step"}):
        history.record(record)
    assert history.status()["recoveries"][0]["rebuilt_at"] is None
    assert history.status()["recoveries"][0]["resumed_at"] is None


def test_stragglers_named_and_cleared_by_the_trainers_records() -> None:
    history = History()
    assert history.status()["stragglers"] is None  # nothing trained here yet: a spare
    history.record({"t": 1.0, "event": "step", "config_id": 0, "step": 0})
    assert history.stragglers() == []
    named = {"t": 2.0, "event": "straggler_named", "config_id": 0, "step": 7,
             "rank": 3, "straggler": hex_id(9), "lag_s": 0.203, "reason": "..."}
    history.record(named)
    history.record({**named, "rank": 1, "straggler": hex_id(5), "lag_s": 0.5})
    assert history.status()["stragglers"] == [
        {"rank": 1, "member_id": hex_id(5), "lag_s": 0.5},
        {"rank": 3, "member_id": hex_id(9), "lag_s": 0.203}]
    history.record({"t": 3.0, "event": "straggler_cleared", "config_id": 1, "step": 9,
                    "rank": 1, "straggler": hex_id(5), "reason": "new group"})
    for malformed in ({**named, "straggler": 9}, {**named, "rank": "3"},
                      {**named, "straggler": hex_id(6), "lag_s": None}):
        history.record(malformed)
    assert history.stragglers() == [{"rank": 3, "member_id": hex_id(9), "lag_s": 0.203}]


def test_stragglers_kept_are_bounded() -> None:
    history = History()
    for m in range(STRAGGLERS_KEPT + 10):
        history.record({"t": 1.0, "event": "straggler_named", "config_id": 0, "step": 7,
                        "rank": m, "straggler": hex_id(m), "lag_s": 0.1})
    found = history.stragglers()
    assert found is not None and len(found) == STRAGGLERS_KEPT
    assert found[-1]["rank"] == STRAGGLERS_KEPT - 1
