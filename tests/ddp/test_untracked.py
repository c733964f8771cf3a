"""An optimizer or LR scheduler stepping the model's parameters without being tracked is
refused at its first ``step()`` (torchpass_p2p/ddp/untracked.py): a spare would start it over
and the job would end with exit 0 and weights unlike the fault-free run's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from torchpass_p2p.ddp.untracked import UntrackedState, install, untracked

NOT_TRACKED = ("this AdamW steps the model's parameters but is not tracked: a spare would start "
               "it over; call torchpass_p2p.track(optimizer, scheduler, scaler) before the "
               "epochs loop")
NO_SCHEDULER = ("an LR scheduler drives this AdamW but is not tracked: a spare would start its "
                "schedule over; track the scheduler too")


@pytest.fixture
def model() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


@pytest.fixture
def tracked(model: torch.nn.Module) -> Iterator[dict[str, object]]:
    objects: dict[str, object] = {"model": model}
    remove = install(objects, model)
    yield objects
    remove()


def loss_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()


def test_an_untracked_optimizer_of_the_model_is_refused_before_it_steps(
        model: torch.nn.Module, tracked: dict[str, object]) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UntrackedState) as caught:
        loss_step(model, optimizer)
    assert str(caught.value) == NOT_TRACKED
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.state == {}


def test_a_tracked_optimizer_steps_and_one_of_other_parameters_is_not_checked(
        model: torch.nn.Module, tracked: dict[str, object]) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    tracked["optimizer"] = optimizer
    loss_step(model, optimizer)
    loss_step(model, optimizer)
    assert optimizer.state[next(iter(model.parameters()))]["step"].item() == 2
    other = torch.nn.Linear(1, 1)
    own = torch.optim.SGD(other.parameters(), lr=0.1)
    loss_step_other = other(torch.ones(1, 1)).sum()
    loss_step_other.backward()
    own.step()  # the script's own optimizer of something else: its business


def test_an_untracked_scheduler_of_a_tracked_optimizer_is_refused(
        model: torch.nn.Module, tracked: dict[str, object]) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    tracked["optimizer"] = optimizer
    with pytest.raises(UntrackedState) as caught:
        loss_step(model, optimizer)
    assert str(caught.value) == NO_SCHEDULER
    tracked["scheduler"] = scheduler
    loss_step(model, optimizer)


def test_the_check_ends_when_removed(model: torch.nn.Module) -> None:
    remove = install({"model": model}, model)
    remove()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_step(model, optimizer)
    assert untracked(optimizer, {}, {id(p) for p in model.parameters()}) == NOT_TRACKED.replace(
        "AdamW", "SGD")
