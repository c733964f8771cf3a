"""A replica steered apart by its script is caught at the step after (torchpass_p2p/ddp/
steering.py): each rank counts its tracked optimizers' steps between two step openings and
digests their hyperparameters; the ranks that know the step before must agree.

Must hold: only tracked optimizers count; a step's figures become ``last`` when the next step
opens; a rank that received another's state (or the job's first step) reports UNKNOWN and is
left out; another learning rate or another number of steps is named, with the ranks on each
side; a GradScaler's skipped step counts on no rank."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from torchpass_p2p.ddp.steering import UNKNOWN, OptimizerSteps, disagreement, hyperparameters


@pytest.fixture
def model() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


def steps(model: torch.nn.Module, tracked: list[torch.optim.Optimizer]) -> Iterator[OptimizerSteps]:
    watch = OptimizerSteps(lambda: tracked)
    remove = watch.install()
    try:
        yield watch
    finally:
        remove()


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_tracked_steps_are_counted_and_become_last_when_the_next_step_opens(
        model: torch.nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    for watch in steps(model, [optimizer]):
        watch.opened()  # the job's first step: nothing known before it
        assert watch.last == (UNKNOWN, UNKNOWN)
        one_step(model, optimizer)
        other.step()  # not tracked: not the model's business here
        watch.opened()
        count, digest = watch.last
        assert count == 1.0 and digest > 0
        watch.opened()  # a step without an optimizer step (accumulation without no_sync)
        assert watch.last == (0.0, 0.0)
        one_step(model, optimizer)
        watch.opened()
        assert watch.last == (count, digest)  # the same hyperparameters: the same digest
        optimizer.param_groups[0]["lr"] = 0.05
        one_step(model, optimizer)
        watch.opened()
        assert watch.last[0] == 1.0 and watch.last[1] != digest
        one_step(model, optimizer)
        watch.forget()  # the state was replaced by another's
        assert watch.last == (UNKNOWN, UNKNOWN)
        watch.opened()
        assert watch.last == (UNKNOWN, UNKNOWN)


def test_a_learning_rate_tensor_is_digested_by_its_value(model: torch.nn.Module) -> None:
    a = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    b = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    assert hyperparameters(a) == hyperparameters(b)
    b.param_groups[0]["lr"].fill_(0.02)
    assert hyperparameters(a) != hyperparameters(b)


def test_an_object_among_the_hyperparameters_is_digested_by_its_type(
        model: torch.nn.Module) -> None:
    a = torch.optim.SGD(model.parameters(), lr=0.1)
    b = torch.optim.SGD(model.parameters(), lr=0.1)
    a.param_groups[0]["schedule"], b.param_groups[0]["schedule"] = object(), object()
    assert hyperparameters(a) == hyperparameters(b)  # not their addresses


def test_a_grad_scalers_skipped_step_is_not_counted(model: torch.nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for watch in steps(model, [optimizer]):
        watch.opened()
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        for p in model.parameters():
            assert p.grad is not None
            p.grad.fill_(float("inf"))
        scaler.step(optimizer)  # inf gradients: the step is skipped, on every rank alike
        scaler.update()
        watch.opened()
        assert watch.last == (0.0, 0.0)


def test_ranks_that_know_the_step_before_must_agree() -> None:
    same = (1.0, 12345.0)
    assert disagreement([same, same, same]) is None
    assert disagreement([same, (UNKNOWN, UNKNOWN), same]) is None  # a spare's first step
    assert disagreement([(UNKNOWN, UNKNOWN)] * 3) is None  # the job's first step
    assert disagreement([same, (1.0, 777.0), same]) == (
        "the optimizers' hyperparameters (the learning rate, ...) differ between ranks "
        "[0, 2], [1]")
    assert disagreement([(0.0, 0.0), same, (UNKNOWN, UNKNOWN), (0.0, 0.0)]) == (
        "optimizer steps 0 on ranks [0, 3], 1 on ranks [1]")
