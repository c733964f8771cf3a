"""The trainer's side of a drain and of start-up, against a scripted agent (no process group).

A drained member keeps its rank, and trains, until the decision that removes it; then it stops
with ``Drained``, not as a failure. Every rank enters the configuration it was started in even
when a change was decided meanwhile, and the group of a configuration is named after the first
configuration of its rank map; a late spare (still joining) waits for a rank; a promoted
spare whose first entry fails (its sources failed) waits for the next configuration instead of
crashing.

Why one file of this size: every test plays the same scripted agent against a real trainer;
the scripts, not the tests, are most of its length.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from torchpass_p2p.agent import AgentEvent, Change, NotServed, TrainingAgent, TransportError
from torchpass_p2p.collective import GroupSpec, Superseded
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.messages import Cut, Joiner
from torchpass_p2p.core.params import Params
from torchpass_p2p.core.plan import next_configuration, with_resume_step
from torchpass_p2p.core.seal import Keyring
from torchpass_p2p.trainer import Drained, FaultInjector, Removed, Stopped, Trainer, loop
from torchpass_p2p.trainer.timeline import read_events
from torchpass_p2p.transfer import TransferError

ME, PEER, SPARE, LATE = 0xA1, 0xB2, 0xC3, 0xD4
ZERO = Configuration(0, [PEER, ME], [SPARE], {m: ("127.0.0.1", 9000 + m) for m in
                                             (ME, PEER, SPARE)})
ZERO_AS_SPARE = Configuration(0, [PEER, SPARE], [ME], ZERO.addresses)
"""Configuration 0 of a run in which this member started as the spare."""


def change(config: Configuration, cut: Cut, committed: int, group_id: int | None = None
           ) -> Change:
    following, plan, _ = next_configuration(config, cut, policy="wait")
    return Change(following, with_resume_step(plan, committed), 0, 1.0, 1.1,
                  following.config_id if group_id is None else group_id)


JOINED = change(ZERO, Cut(joined=(Joiner(LATE, "127.0.0.1", 9999),)), 4)
DRAINED = change(ZERO, Cut(removed=(ME,)), 4)


class ScriptedAgent:
    """What the trainer uses of the agent (every member of
    :class:`~torchpass_p2p.agent.TrainingAgent`), set by the test."""

    member_id = ME
    address = ("127.0.0.1", 9000 + ME)
    status_address = None
    history = None  # no status page: the trainer's records go nowhere
    fenced = False
    reachable = 3  # of ZERO's three members
    majority = 2

    def __init__(self) -> None:
        self.settings = SimpleNamespace(keyring=Keyring(b"\x11" * 32), configuration=ZERO,
                                        params=Params())
        self.configuration = ZERO
        self.role = "rank"
        self.draining = False
        self.changes: list[Change] = []
        self.services: list[tuple[str, int]] = []
        self.ports: list[int] = []
        self.waited = 0
        self.assigned: Change | None = None
        self.fenced_for: list[bool] = []  # `fenced` after each empty wait, then a rank
        self.callbacks: list[Any] = []
        self.announced: set[int] = set()
        self.withheld: set[int] = set()  # announced port 0: they serve no state
        self.lookups: list[tuple[int, float]] = []
        self.arrives_in_lookup: list[Change] = []
        self.counter_sources: dict[str, Any] = {}
        self.key_listeners: list[Any] = []
        self.events: list[AgentEvent] = []  # what recent_events() returns
        self.stopped = False

    @property
    def config_id(self) -> int:
        return self.configuration.config_id

    @property
    def rank(self) -> int | None:
        return self.configuration.rank_of(ME)

    def next_change(self, timeout_s: float | None = None) -> Change | None:
        if self.changes:
            return self.changes.pop(0)
        time.sleep(timeout_s or 0.0)  # the agent waits this long for one
        return None

    def on_change(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def register_service(self, name: str, config_id: int, port: int) -> None:
        self.services.append((name, config_id))
        self.ports.append(port)

    def add_counter_source(self, name: str, read: Any) -> None:
        self.counter_sources[name] = read

    def drain(self, timeout_s: float = 5.0) -> dict[str, Any]:
        self.draining = True  # as the agent does once it accepts a drain
        return {"draining": True}

    def lookup_service(self, member: int, name: str, config_id: int, *,
                       timeout_s: float = 30.0) -> tuple[str, int]:
        """Announced members answer at once; the others are waited for ``timeout_s``, as the
        agent does, and may bring a change (``arrives_in_lookup``) meanwhile."""
        self.lookups.append((member, timeout_s))
        if member in self.announced:
            return ("127.0.0.1", 7000 + member)
        if member in self.withheld:
            raise NotServed(f"member {member:016x} does not serve {name!r}")
        if self.arrives_in_lookup:
            self.changes.append(self.arrives_in_lookup.pop())
        time.sleep(timeout_s)
        raise TransportError(f"member {member:016x} serves no {name!r}")

    def recent_events(self, timeout_s: float = 5.0) -> list[AgentEvent]:
        return list(self.events)

    def report_progress(self, step: int, phase: str = "committed") -> None:
        pass

    def report_commit(self, step: int, ranks: tuple[int | None, ...],
                      timeout_s: float = 30.0) -> bool:
        return not self.fenced

    def report_error(self, exc: BaseException, *, peer_rank: int | None = None) -> None:
        pass

    def add_key_listener(self, listener: Any) -> None:
        self.key_listeners.append(listener)

    def stop(self, *, leave: bool = True, timeout_s: float = 10.0) -> None:
        self.stopped = True

    def wait_for_rank(self, timeout_s: float | None = None) -> Change:
        self.waited += 1
        if self.fenced_for:  # no majority reachable: nothing comes within the slice
            self.fenced = self.fenced_for.pop(0)
            time.sleep(timeout_s or 0.0)
            raise TimeoutError(f"no rank assigned within {timeout_s} s")
        if self.assigned is None:
            raise RuntimeError("the agent stopped")
        return self.assigned


@pytest.fixture
def trainer(tmp_path: Path) -> Any:
    model = torch.nn.Linear(2, 1)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), agent=ScriptedAgent(),
                log_path=tmp_path / "me.jsonl", faults=FaultInjector([], started_as=0))
    yield t
    t._close()


def events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in read_events(tmp_path) if r["event"] == name]


def in_zero(trainer: Trainer) -> None:
    """As after ``_enter_configuration(ZERO)``, without a process group."""
    trainer._ranks, trainer.config_id = tuple(ZERO.ranks), 0


def test_a_draining_member_trains_on_until_it_is_removed(trainer: Trainer,
                                                         tmp_path: Path) -> None:
    in_zero(trainer)
    agent = trainer.agent
    agent.role, agent.draining = "leaving", True
    assert trainer._poll() is False and trainer._poll() is False  # keeps its rank and group
    [draining] = events(tmp_path, "draining")
    assert (draining["config_id"], draining["role"]) == (0, "leaving")
    agent.role = "removed"  # the decision
    with pytest.raises(Drained, match="drained"):
        trainer._poll()


def test_the_change_that_removes_a_drained_member_ends_it_as_drained(trainer: Trainer,
                                                                     tmp_path: Path) -> None:
    in_zero(trainer)
    trainer.agent.draining = True
    with pytest.raises(Drained):
        trainer._enter(DRAINED)
    [logged] = events(tmp_path, "change")
    assert logged["plan_hash"] == f"{DRAINED.plan.hash:016x}"
    assert logged["removed"] == [f"{ME:016x}"] and logged["assignments"] == [[1, f"{SPARE:016x}"]]


def test_leaving_or_removed_without_a_drain_is_a_plain_removal(trainer: Trainer) -> None:
    in_zero(trainer)
    for role in ("leaving", "removed"):
        trainer.agent.role = role
        with pytest.raises(Removed) as caught:
            trainer._poll()
        assert type(caught.value) is Removed


def test_a_member_whose_agent_failed_stops_training_even_while_draining(trainer: Trainer) -> None:
    in_zero(trainer)
    trainer.agent.role, trainer.agent.draining = "failed", True
    with pytest.raises(RuntimeError, match="^this member's agent failed"):
        trainer._poll()


def test_a_source_that_never_announces_is_waited_for_only_briefly(trainer: Trainer) -> None:
    # A survivor killed just after the decision, or a spare promoted earlier that is still
    # fetching itself: the fetch starts from the sources that did announce.
    in_zero(trainer)
    trainer.agent.announced = {PEER, SPARE}
    found, withheld = trainer._find_sources((PEER, LATE, SPARE), 0)
    assert found == {("127.0.0.1", 7000 + PEER): PEER, ("127.0.0.1", 7000 + SPARE): SPARE}
    assert withheld == set()
    waited = [t for m, t in trainer.agent.lookups if m == LATE]
    # One round, then the rest of LOOKUP_GRACE_S (the whole LOOKUP_TIMEOUT_S before).
    assert sum(waited) <= loop.LOOKUP_SLICE_S + loop.LOOKUP_GRACE_S + 1e-9
    assert all(t <= loop.LOOKUP_SLICE_S for t in waited)


def test_a_source_that_holds_no_state_is_not_waited_for(trainer: Trainer) -> None:
    in_zero(trainer)
    trainer.agent.announced, trainer.agent.withheld = {PEER}, {SPARE}
    found, withheld = trainer._find_sources((PEER, SPARE), 0)
    assert found == {("127.0.0.1", 7000 + PEER): PEER} and withheld == {SPARE}
    assert trainer.agent.lookups == [(PEER, loop.LOOKUP_SLICE_S), (SPARE, loop.LOOKUP_SLICE_S)]


def test_no_source_announcing_is_waited_for_in_rounds_until_a_change_supersedes(
        trainer: Trainer) -> None:
    in_zero(trainer)
    trainer.agent.arrives_in_lookup = [DRAINED]  # other ranks: the fetch is moot
    with pytest.raises(Superseded):
        trainer._find_sources((PEER,), 0)
    assert trainer.agent.lookups == [(PEER, loop.LOOKUP_SLICE_S)]


def test_a_join_keeps_the_group_and_its_plan_is_logged(trainer: Trainer, tmp_path: Path) -> None:
    in_zero(trainer)
    trainer.agent.changes.append(JOINED)
    assert trainer._poll() is False
    assert trainer.config_id == 1 and ("transfer", 1) in trainer.agent.services
    [logged] = events(tmp_path, "change")
    assert logged["same_ranks"] is True and logged["joined"] == [f"{LATE:016x}"]
    assert logged["plan_hash"] == f"{JOINED.plan.hash:016x}"


def test_ranks_enter_the_configuration_they_started_in(trainer: Trainer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A spare joined while the ranks started: the agent's current configuration is 1, but
    every rank builds configuration 0's group (and learns of 1 as a change), else ranks that
    started before and after the decision would wait in different rendezvous."""
    trainer.agent.configuration = JOINED.configuration
    entered = []

    def enter(configuration: Configuration, **_: Any) -> None:
        entered.append(configuration.config_id)

    monkeypatch.setattr(trainer, "_enter_configuration", enter)
    trainer._begin()
    assert entered == [0]


def test_a_late_spare_still_joining_waits_for_a_rank(trainer: Trainer, tmp_path: Path) -> None:
    agent = trainer.agent
    agent.role, agent.settings.configuration = "joining", None
    with pytest.raises(Removed, match="no rank for this spare"):
        trainer.run(lambda step, rank: torch.zeros(()), steps=1)
    assert agent.waited == 1
    assert [r["event"] for r in read_events(tmp_path)] == ["start", "spare_waiting", "removed"]
    assert events(tmp_path, "removed")[0]["drained"] is False


def test_a_drained_spare_ends_as_drained(trainer: Trainer, tmp_path: Path) -> None:
    # A spare drained while it waits for a rank ends as Drained (exit 4, never respawned), not
    # as Removed: its script would exit 3 and the launcher respawn it (--respawn).
    agent = trainer.agent
    agent.settings.configuration = agent.configuration = ZERO_AS_SPARE
    agent.role, agent.draining = "removed", True
    with pytest.raises(Drained, match=r"^no rank for this spare: the agent stopped \(drained\)$"):
        trainer.run(lambda step, rank: torch.zeros(()), steps=1)
    assert events(tmp_path, "removed")[0]["drained"] is True


@pytest.mark.parametrize("role, fenced, reachable, why", [
    ("spare", True, 3, "no majority of configuration 0 reachable for 0.05 s"),
    ("spare", True, 1, "no majority of configuration 0 is left: 1 of its 3 members is "
                       "reachable and a majority is 2; fenced for 0.05 s, the job stops: "
                       "resume it from its last checkpoint"),
    ("joining", False, 3, "not admitted for 0.05 s"),
])
def test_a_spare_that_reaches_no_majority_gives_up_after_its_deadline(
        trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str,
        fenced: bool, reachable: int, why: str) -> None:
    # Every rank died and the spares are too few to decide anything: nothing will ever give
    # this spare a rank, nor admit a joining one. It waited forever before; now it stops after
    # ``give_up_s`` (Stopped: its launcher respawns nobody for it).
    monkeypatch.setattr("torchpass_p2p.trainer.changes.WAIT_SLICE_S", 0.01)
    agent = trainer.agent
    agent.role, agent.reachable, trainer.give_up_s = role, reachable, 0.05
    agent.settings.configuration = ZERO_AS_SPARE if role == "spare" else None
    agent.fenced_for = [fenced] * 100
    with pytest.raises(Stopped, match=f"^{why}$"):
        trainer.run(lambda step, rank: torch.zeros(()), steps=1)
    assert 2 <= agent.waited < 100  # stuck from the first empty wait on
    logged = read_events(tmp_path)
    assert [r["event"] for r in logged] == [
        "start", "spare_waiting", *(["fenced"] if fenced else []), "gave_up"]
    assert logged[-1]["reason"] == why


def test_a_spare_fenced_for_a_while_waits_on(trainer: Trainer, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Fenced for less than the deadline each time (a partition that heals): the spare keeps
    # waiting, and takes the rank it is finally given.
    monkeypatch.setattr("torchpass_p2p.trainer.changes.WAIT_SLICE_S", 0.02)
    agent = trainer.agent
    agent.role, trainer.give_up_s = "spare", 0.1
    agent.settings.configuration = ZERO_AS_SPARE
    agent.fenced_for = ([True] * 3 + [False]) * 3
    agent.assigned = JOINED
    entered: list[int] = []
    monkeypatch.setattr(trainer, "_enter_until_in",
                        lambda change: entered.append(change.configuration.config_id))
    trainer._begin()
    assert entered == [1] and agent.waited == 13
    assert [r["event"] for r in read_events(tmp_path)] == [
        "start", "spare_waiting", "fenced", "fenced", "fenced"]


def test_after_a_veto_a_member_waits_for_its_lease_and_redoes_the_step(
        trainer: Trainer) -> None:
    # Woken from a pause into a change decided at that moment, it is fenced until its first
    # probe is answered: the group stays and the step is redone, no change is awaited.
    in_zero(trainer)
    agent = trainer.agent
    agent.fenced = True
    threading.Timer(0.2, setattr, (agent, "fenced", False)).start()
    t0 = time.monotonic()
    trainer._await_lease()
    assert time.monotonic() - t0 >= 0.2 and agent.fenced is False


def test_after_a_veto_a_change_of_the_rank_map_supersedes_the_wait(trainer: Trainer) -> None:
    # On the minority side of a partition it stays fenced until the change that removes it.
    in_zero(trainer)
    agent = trainer.agent
    agent.fenced = True
    agent.changes = [DRAINED]  # another rank map: ME's rank goes to the spare
    with pytest.raises(Superseded):
        trainer._await_lease()


def test_after_a_veto_a_member_fenced_for_give_up_s_stops(trainer: Trainer) -> None:
    in_zero(trainer)
    trainer.agent.fenced, trainer.give_up_s = True, 0.1
    with pytest.raises(Removed, match=r"^fenced for 0.1 s after a vetoed commit$"):
        trainer._await_lease()


NO_MAJORITY = ("no majority of configuration 0 is left: 1 of its 3 members is reachable and a "
               "majority is 2; fenced for 0.1 s, the job stops: resume it from its last "
               "checkpoint")
"""Issue 32, item 3: the one line of a member left without a majority."""


def test_a_member_fenced_without_a_majority_says_how_many_are_left(
        trainer: Trainer, tmp_path: Path) -> None:
    # Its two peers are suspected or convicted: it counts itself alone of three. Whether it
    # waited on a vetoed commit or for a change after a failed collective, it stops the job
    # (Stopped: exit 5, nobody respawned) and says how many are left and how many are needed.
    # Counting a majority it is the one cut off, and removed as before (the cases above).
    in_zero(trainer)
    agent = trainer.agent
    agent.fenced, agent.reachable, trainer.give_up_s = True, 1, 0.1
    with pytest.raises(Stopped) as after_veto:
        trainer._await_lease()
    assert str(after_veto.value) == NO_MAJORITY
    with pytest.raises(Stopped) as after_failure:
        trainer._await_change(since=time.monotonic() - 0.1)
    assert str(after_failure.value) == NO_MAJORITY
    assert [r["reason"] for r in events(tmp_path, "gave_up")] == [NO_MAJORITY] * 2
    agent.reachable = 2
    with pytest.raises(Removed, match=r"^no new configuration for 0.1 s after a collective"):
        trainer._await_change(since=time.monotonic() - 0.1)


def test_an_operation_whose_peers_never_answer_ends_once_fenced_for_give_up_s(
        trainer: Trainer) -> None:
    # Its peers paused (SIGSTOP) or dead in the middle of a collective: nothing ends the
    # operation but the backend's 30-minute timeout, unless the watch gives up. It does, once
    # the member has been fenced for give_up_s without a break; a member back in contact
    # meanwhile starts counting again.
    in_zero(trainer)
    agent = trainer.agent
    agent.fenced, agent.reachable, trainer.give_up_s = True, 1, 0.1
    assert trainer._watch() is False  # fenced from now on
    time.sleep(0.06)
    agent.fenced = False
    assert trainer._watch() is False  # the lease came back: the count restarts
    agent.fenced = True
    assert trainer._watch() is False
    time.sleep(0.06)
    assert trainer._watch() is False  # 0.06 s since the count restarted
    time.sleep(0.06)
    with pytest.raises(Stopped) as stopped:
        trainer._watch()
    assert str(stopped.value) == NO_MAJORITY
    agent.reachable = 2  # cut off instead: removed
    trainer._fenced_since = time.monotonic() - 0.2
    with pytest.raises(Removed, match=r"^fenced for 0.1 s in a collective operation$"):
        trainer._watch()


@pytest.mark.timeout(15)  # a fresh give_up_s would wait 60 s
def test_the_last_resort_counts_from_the_collective_failure(trainer: Trainer) -> None:
    # Regroups after a failure may take minutes (rendezvous timeouts): the final wait for a
    # change gets what is left of give_up_s, not a fresh give_up_s.
    in_zero(trainer)
    trainer.give_up_s = 60.0
    with pytest.raises(Removed, match=r"^no new configuration for 60 s after a collective"):
        trainer._await_change(since=time.monotonic() - 59.9)


def test_a_spare_already_holding_a_rank_when_its_trainer_starts_still_fetches_its_state(
        trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A slow start: a rank died before this spare's trainer began, and its agent already holds
    # the rank. It must take the spare's way in (fetch the state, enter configuration 1), not
    # the ranks' (enter configuration 0, where it holds no rank).
    first = change(ZERO_AS_SPARE, Cut(removed=(SPARE,)), 9)  # this spare takes rank 1
    agent = trainer.agent
    agent.settings.configuration, agent.configuration = ZERO_AS_SPARE, first.configuration
    agent.role, agent.assigned = "rank", first
    entered = []
    monkeypatch.setattr(trainer, "_enter", lambda change: entered.append(change))
    trainer._begin()
    assert entered == [first]
    assert [r["event"] for r in read_events(tmp_path)] == ["start", "spare_waiting"]
    assert events(tmp_path, "start")[0]["role"] == "rank"


def test_a_spare_whose_first_entry_fails_enters_the_next_configuration(
        trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    start = ZERO_AS_SPARE
    first = change(start, Cut(removed=(SPARE,)), 9)  # this spare takes rank 1
    second = change(first.configuration, Cut(removed=(PEER,)), 9)  # a source failed
    agent = trainer.agent
    agent.role, agent.settings.configuration, agent.assigned = "spare", start, first
    entered = []

    def enter(change: Change) -> None:
        entered.append(change.configuration.config_id)
        if len(entered) == 1:
            agent.changes.append(second)
            raise TransferError("no_sources", "every source failed")

    monkeypatch.setattr(trainer, "_enter", enter)
    trainer._begin()
    assert entered == [1, 2]
    [restarted] = events(tmp_path, "recovery_restarted")
    assert restarted["config_id"] == 1 and "every source failed" in restarted["error"]


def test_the_group_is_named_after_the_first_configuration_of_its_rank_map(
        trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This member was handed only the join (2) that followed the handover (1): it must meet
    the members that were handed the handover in the rendezvous of 1, not of 2."""
    handover = change(ZERO, Cut(removed=(PEER,)), 4)  # the spare takes rank 0
    joined = change(handover.configuration, Cut(joined=(Joiner(LATE, "127.0.0.1", 9999),)), 4,
                    group_id=1)
    in_zero(trainer)
    trainer.step = 5
    built = []

    def build_group(spec: GroupSpec, *args: Any, **kwargs: Any) -> None:
        built.append(spec)
        raise Superseded

    monkeypatch.setattr("torchpass_p2p.trainer.recovery.build_group", build_group)
    with pytest.raises(Superseded):
        trainer._enter(joined)
    assert built == [GroupSpec(1, 1, 2, SPARE)]
    assert trainer.config_id == 2 and ("transfer", 2) in trainer.agent.services
    [rule] = events(tmp_path, "commit_rule")
    assert (rule["action"], rule["config_id"]) == ("redo", 2)


def test_a_promoted_spare_whose_fetch_failed_stops_the_job_when_no_holder_is_left(
        trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The only member holding the state dies while this spare, just promoted, is still
    fetching it. The survivors (this spare alone) report no step, so the next plan resumes at
    step 0: training on would roll back 41 steps, or spread the half received state (the job
    would exit 0 with other weights). The job stops instead."""
    trainer._holds_state = False  # started as the spare (``_begin``)
    promoted = change(ZERO_AS_SPARE, Cut(removed=(SPARE,)), 40)  # rank 1 -> this spare
    assert dict(promoted.plan.assignments) == {1: ME} and promoted.plan.resume_step == 41
    fetches: list[tuple[int, ...] | None] = []

    def enter_configuration(configuration: Any, *, fetch_from: Any, **kwargs: Any) -> None:
        fetches.append(fetch_from)
        raise TransferError("no_sources_left: 1 chunks missing")  # its source died

    monkeypatch.setattr(trainer, "_enter_configuration", enter_configuration)
    with pytest.raises(TransferError):
        trainer._enter(promoted)
    assert fetches == [(PEER,)]
    orphaned = change(promoted.configuration, Cut(removed=(PEER,)), -1)
    assert orphaned.plan.resume_step == 0 and orphaned.plan.action == "wait"
    with pytest.raises(Stopped, match="^configuration 2: no member holds the state"):
        trainer._enter(orphaned)
    assert fetches == [(PEER,)]
    [stopped] = events(tmp_path, "job_stopped")
    assert (stopped["config_id"], stopped["resume_step"]) == (2, 0)


def test_a_spare_promoted_and_orphaned_before_it_took_its_rank_stops_the_job(
        trainer: Trainer, tmp_path: Path) -> None:
    """As above, with both deaths decided before this spare took its rank: it is handed the
    promotion (resuming at 41) and then the change that resumes at 0, and enters only the
    latter."""
    promoted = change(ZERO_AS_SPARE, Cut(removed=(SPARE,)), 40)
    orphaned = change(promoted.configuration, Cut(removed=(PEER,)), -1)
    trainer.agent.assigned, trainer.agent.changes = promoted, [orphaned]
    trainer.agent.settings.configuration = ZERO_AS_SPARE
    with pytest.raises(Stopped, match="^configuration 2: no member holds the state"):
        trainer._begin()
    [stopped] = events(tmp_path, "job_stopped")
    assert (stopped["config_id"], stopped["resume_step"]) == (2, 0)


def test_promoted_spares_without_the_state_stop_the_job_instead_of_waiting_for_each_other(
        trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spare promoted to rank 1 fetches from the member on rank 0, which dies; the spare
    promoted to rank 0 then fetches from the first, and the first from it. Each announces it
    serves none, and a member whose every source says so stops the job, instead of each
    waiting for the other to announce the state until give_up_s (600 s)."""
    trainer._holds_state = False  # started as a spare (``_begin``)
    addresses = {m: ("127.0.0.1", 9000 + m) for m in (ME, PEER, SPARE, LATE)}
    start = Configuration(0, [PEER, SPARE], [ME, LATE], addresses)
    promoted = change(start, Cut(removed=(SPARE,)), 40)  # rank 1 -> one spare
    orphaned = change(promoted.configuration, Cut(removed=(PEER,)), 40)  # rank 0 -> the other
    assert set(orphaned.configuration.ranks) == {ME, LATE} and orphaned.plan.action != "stop"
    trainer.agent.withheld = {LATE}  # the other promoted spare announced port 0
    trainer.agent.configuration = orphaned.configuration
    fetched: list[Any] = []
    monkeypatch.setattr(trainer.service, "fetch", lambda *a, **kw: fetched.append(a))
    with pytest.raises(Stopped, match="^configuration 2: no member holds the state"):
        trainer._enter(orphaned)
    assert fetched == []
    announced = list(zip(trainer.agent.services, trainer.agent.ports, strict=True))
    assert [a for a in announced if a[0][0] == "transfer"] == [(("transfer", 2), 0)]
    [stopped] = events(tmp_path, "job_stopped")
    assert (stopped["config_id"], stopped["reason"]) == (2, "no member holds the state")


def test_the_state_services_refusals_show_with_the_agents_counts(trainer: Trainer) -> None:
    read = trainer.agent.counter_sources["transfer_refused"]  # registered by the trainer
    trainer.service.start()
    with socket.create_connection(("127.0.0.1", trainer.service.port)) as s:
        s.sendall(b"\x00\x00\x00\x03abc")  # not msgpack: refused
        s.settimeout(10.0)
        assert s.recv(1) == b""  # closed by the server
    end = time.monotonic() + 10.0
    while read() != {"bad_frame": 1}:
        assert time.monotonic() < end, read()
        time.sleep(0.01)


def test_the_scripted_agent_has_every_member_of_the_interface() -> None:
    agent = ScriptedAgent()
    for name in vars(TrainingAgent):
        if not name.startswith("_"):
            assert hasattr(agent, name), name


def test_a_change_is_logged_with_the_times_of_the_accusations_before_it(
        trainer: Trainer, tmp_path: Path) -> None:
    in_zero(trainer)
    trainer.agent.events = [AgentEvent(9.0, "MemberSuspected", "member=b2"),
                            AgentEvent(9.5, "QuorumLost", ""),
                            AgentEvent(10.2, "AlertRaised", "subject=b2"),
                            AgentEvent(10.6, "MemberDead", "member=b2"),
                            AgentEvent(10.7, "ConfigurationDecided", "config 1")]
    trainer._log_change(JOINED, same_ranks=True)
    [logged] = events(tmp_path, "change")
    assert logged["alerts_at"] == [9.0, 10.2, 10.6] and logged["same_ranks"] is True
