"""Regrouping after a transient collective failure (issue #7): the pure decisions
(:mod:`torchpass_p2p.trainer.regroup`), the ``reset`` fault, the rendezvous namespace of an
attempt, and the trainer's recovery path against a scripted agent and fake groups (no process
group): the attempt numbers it picks, the resume step, and that a configuration change wins."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.trainer.test_drain import PEER, SPARE, ZERO, ScriptedAgent, change, events, in_zero
from torchpass_p2p.collective import CollectiveError, GroupSpec, Superseded
from torchpass_p2p.collective.rendezvous import StoreKeeper, store_prefix, store_service
from torchpass_p2p.core.messages import Cut
from torchpass_p2p.core.params import Params
from torchpass_p2p.trainer import Fault, FaultInjector, Trainer, parse_faults
from torchpass_p2p.trainer.faults import InjectedReset
from torchpass_p2p.trainer.regroup import (
    GIVE_UP_S,
    MAX_REGROUPS,
    next_attempt,
    regroup_resume,
    regroup_wait_s,
)

# ------------------------------------------------------------------ pure parts


def test_the_wait_is_the_longest_normal_decision_of_a_death() -> None:
    # detection 0.5 + 1 * 1.0, conviction max(1.6, 6.0), decision 0.6 + 1.5 + 1.0
    assert regroup_wait_s(Params()) == pytest.approx(10.6)
    slower = Params(suspicion_max_s=12.0, classic_timeout_s=3.0)
    assert regroup_wait_s(slower) == pytest.approx(18.1)
    # Longer than a crash takes to be decided (about 3.5 s, params.py: the exact 10.6 above),
    # and far below the last resort, 600 s: both exact constants of Params and the trainer.
    assert GIVE_UP_S == 600.0


def test_attempts_count_up_from_the_configuration_s_first_group() -> None:
    assert [next_attempt(a) for a in range(3)] == [1, 2, 3]
    with pytest.raises(ValueError):
        next_attempt(-1)


@pytest.mark.parametrize(("progress", "resume", "reason"), [
    ([(20, -1)] * 4, 20, "nobody committed step 20: every rank redoes it"),
    ([(40, 40)] * 3 + [(40, -1)], 40, "nobody committed step 40: every rank redoes it"),
    ([(41, -1), (40, 40), (41, -1), (40, 40)], 41,
     "step 40 was committed: ranks [1, 3] roll forward, resume at 41"),
    ([(40, -1), (41, -1)], None,
     "ranks [0] cannot reach step 41: rank 0 applied 40 holds gradient -1"),
    ([(39, 39), (41, -1)], None,
     "ranks [0] cannot reach step 41: rank 0 applied 39 holds gradient 39"),
    ([], None, "no ranks"),
])
def test_the_resume_step_is_the_highest_applied(progress: list[tuple[int, int]],
                                                resume: int | None, reason: str) -> None:
    assert regroup_resume(progress) == (resume, reason)


def test_reset_fault_specs() -> None:
    assert parse_faults("reset@20:grad:rank=1,reset@3:commit:rank=0,reset@0:compute:rank=2") \
        == [Fault("reset", 20, "grad", 1), Fault("reset", 3, "commit", 0),
            Fault("reset", 0, "compute", 2)]
    for bad in ("reset@20:serve:rank=1:0.5", "reset@20:grad:rank=1:3", "reset@x:grad:rank=1"):
        with pytest.raises(ValueError, match="bad fault"):
            parse_faults(bad)


def test_a_reset_raises_a_collective_error_once() -> None:
    fired = []
    injector = FaultInjector(parse_faults("reset@20:grad:rank=1"), started_as=1,
                             before=lambda f, **details: fired.append((f, details)))
    injector.at(20, "grad", 0)
    injector.at(19, "grad", 1)
    with pytest.raises(CollectiveError, match="injected reset at step 20") as caught:
        injector.at(20, "grad", 1)
    assert isinstance(caught.value, InjectedReset) and caught.value.config_id == -1
    assert fired == [(Fault("reset", 20, "grad", 1), {})]
    injector.at(20, "grad", 1)  # once only: the redone step goes through


def test_each_attempt_has_its_own_store_and_namespace() -> None:
    assert (store_prefix(3), store_service()) == ("torchpass/3", "store")  # as before
    assert (store_prefix(3, 1), store_service(1)) == ("torchpass/3r1", "store.r1")
    assert len({store_prefix(c, a) for c in (1, 11) for a in (0, 1, 2)}) == 6
    with pytest.raises(ValueError):
        store_service(-1)
    keeper = StoreKeeper()
    try:
        first, again = keeper.host_store(3), keeper.host_store(3, 1)
        assert first.port != again.port and keeper.host_store(3, 1) is again
        keeper.host_store(3, 2)
        assert sorted(keeper._stores) == [(3, 1), (3, 2)]  # KEEP_STORES
    finally:
        keeper.close()


# ------------------------------------------------------------------ the trainer's path


class Agent(ScriptedAgent):
    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str] = []
        self.progress: list[int] = []

    def report_error(self, exc: BaseException, *, peer_rank: int | None = None) -> None:
        self.errors.append(str(exc))

    def report_progress(self, step: int, phase: str = "committed") -> None:
        self.progress.append(step)


class FakeGroup:
    """A formed group whose all-gathers return the peer's part from ``peer`` (progress) or
    this rank's own tensor (the fingerprints: equal)."""

    formed_s = 0.001

    def __init__(self, spec: GroupSpec, peer: tuple[int, int]) -> None:
        self.spec, self.peer, self.state = spec, peer, "ready"

    def allgather(self, tensor: torch.Tensor, **_: Any) -> list[torch.Tensor]:
        if tensor.dtype == torch.int64:  # (applied, reduced)
            other = torch.tensor(self.peer, dtype=torch.int64)
            return [other, tensor] if self.spec.rank == 1 else [tensor, other]
        return [tensor.clone(), tensor.clone()]

    def abandon(self) -> None:
        self.state = "failed"

    def close(self) -> None:
        self.state = "closed"


@pytest.fixture
def trainer(tmp_path: Path) -> Any:
    model = torch.nn.Linear(2, 1)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), agent=Agent(),
                log_path=tmp_path / "me.jsonl", faults=FaultInjector([], started_as=0),
                regroup_wait_s=0.0)
    in_zero(t)
    t._spec = GroupSpec(0, 1, 2, PEER)  # as after entering configuration 0 at rank 1
    yield t
    t._close()


def builds(monkeypatch: pytest.MonkeyPatch, *outcomes: Any) -> list[GroupSpec]:
    """Script ``build_group``: each call takes the next outcome (an exception to raise, or the
    peer's progress for a :class:`FakeGroup`); returns the specs asked for."""
    built: list[GroupSpec] = []
    left = list(outcomes)

    def build_group(spec: GroupSpec, *args: Any, **kwargs: Any) -> FakeGroup:
        built.append(spec)
        outcome = left.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return FakeGroup(spec, outcome)

    monkeypatch.setattr("torchpass_p2p.trainer.recovery.build_group", build_group)
    return built


def test_no_change_comes_so_the_ranks_regroup_with_the_next_attempt(
        trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer.step = 20
    built = builds(monkeypatch, (20, -1), (21, -1))
    trainer._recover(CollectiveError("connection reset", 0))
    assert built == [GroupSpec(0, 1, 2, PEER, attempt=1)]
    assert trainer.step == 20 and trainer.result.regroups == 1
    assert trainer.result.recoveries == 0 and trainer.config_id == 0
    # A later transient failure in that group: attempt 2. The peer applied step 20 (it
    # committed it), this rank holds its gradient: it rolls forward.
    trainer._reduced = (20, torch.zeros(3))
    trainer._recover(CollectiveError("connection reset", 0))
    assert built[-1] == GroupSpec(0, 1, 2, PEER, attempt=2)
    assert trainer.step == 21 and trainer._reduced is None and trainer.agent.progress == [20]
    started = events(tmp_path, "regroup_started")
    assert [(r["attempt"], r["step"], r["reduced"]) for r in started] == [(1, 20, -1),
                                                                          (2, 20, 20)]
    done = events(tmp_path, "regroup_done")
    assert [(r["attempt"], r["resume_step"], r["action"]) for r in done] == [
        (1, 20, "redo"), (2, 21, "roll_forward")]
    rules = events(tmp_path, "commit_rule")
    assert rules[-1]["regroup"] == "step 20 was committed: ranks [1] roll forward, resume at 21"


def test_a_failed_regroup_is_retried_with_the_next_attempt_then_only_a_change_helps(
        trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failures = [CollectiveError("rendezvous failed", 0) for _ in range(MAX_REGROUPS)]
    built = builds(monkeypatch, *failures)
    handover = change(ZERO, Cut(removed=(PEER,)), 4)  # the peer really died

    waits: list[tuple[float | None, float | None]] = []

    def await_change(within_s: float | None = None, *, since: float | None = None) -> Any:
        waits.append((within_s, since))
        return None if within_s is not None else handover

    entered = []
    monkeypatch.setattr(trainer, "_await_change", await_change)
    monkeypatch.setattr(trainer, "_enter_until_in", entered.append)
    reads = itertools.count(100.0)  # a hand clock: the trainer's first read is the failure
    monkeypatch.setattr("torchpass_p2p.trainer.recovery.time",
                        SimpleNamespace(monotonic=lambda: next(reads), sleep=lambda s: None))
    trainer._recover(CollectiveError("connection reset", 0))
    # The last resort's clock started at the failure, before the regroups.
    assert waits == [(trainer.regroup_wait_s, None)] * MAX_REGROUPS + [(None, 100.0)]
    assert [s.attempt for s in built] == list(range(1, MAX_REGROUPS + 1))
    assert entered == [handover] and trainer.result.recoveries == 1
    assert [r["attempt"] for r in events(tmp_path, "regroup_failed")] == [1, 2, 3]


def test_a_change_during_the_wait_or_the_regroup_wins(
        trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    handover = change(ZERO, Cut(removed=(PEER,)), 4)
    entered: list[Any] = []
    monkeypatch.setattr(trainer, "_enter_until_in", entered.append)
    # Decided within the wait: no regroup at all.
    built = builds(monkeypatch)
    trainer.agent.changes.append(handover)
    trainer._recover(CollectiveError("connection reset", 0))
    assert built == [] and entered == [handover]
    assert not events(tmp_path, "regroup_started")
    # Decided while the regroup's rendezvous waits: superseded, no second try.
    trainer.config_id, trainer._latest, trainer._spec = 0, None, GroupSpec(0, 1, 2, PEER)
    built = builds(monkeypatch, Superseded())
    monkeypatch.setattr(trainer, "_await_change",
                        lambda within_s=None, since=None: None if within_s is not None
                        else handover)
    trainer._recover(CollectiveError("connection reset", 0))
    assert [s.attempt for s in built] == [1] and entered == [handover, handover]
    [failed] = events(tmp_path, "regroup_failed")
    assert failed["superseded"] is True and failed["attempt"] == 1


def test_a_superseded_step_never_regroups(trainer: Trainer,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    handover = change(ZERO, Cut(removed=(SPARE,)), 4)
    built = builds(monkeypatch)
    entered: list[Any] = []
    monkeypatch.setattr(trainer, "_enter_until_in", entered.append)
    monkeypatch.setattr(trainer, "_await_change", lambda within_s=None, since=None: handover)
    trainer._recover(Superseded())
    assert built == [] and entered == [handover]


def test_a_spec_of_attempt_zero_is_the_old_spec() -> None:
    assert GroupSpec(1, 1, 2, SPARE) == replace(GroupSpec(1, 1, 2, SPARE, 3), attempt=0)
