"""What the training API refuses at construction, and that each message names what to do
instead. No process is started: the refusals of ``init_process_group`` and of DDP's arguments
come before anything needs a session; the others run against a real :class:`Session` built on
a scripted agent (``tests/trainer/test_drain.py``: this member holds rank 1 of 2 in
configuration 0, no group formed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.data as tud

import torchpass_p2p
from tests.trainer.test_drain import ScriptedAgent
from torchpass_p2p import DataLoader, DistributedDataParallel, DistributedSampler
from torchpass_p2p.ddp.session import Session, current, install


class Squares(tud.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([float(i)])
        return x, x * x


class Stream(tud.IterableDataset[torch.Tensor]):
    def __len__(self) -> int:
        return 12

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(12.0).unbind())


@pytest.fixture
def no_session() -> Iterator[None]:
    install(None)
    yield
    install(None)


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    install(None)
    s = Session(ScriptedAgent(), seed=0, exact=True, backend="gloo",
                log_path=tmp_path / "me.jsonl")
    install(s)
    try:
        yield s
    finally:
        install(None)
        s._close()


# ------------------------------------------------------------------ init_process_group

@pytest.mark.parametrize(("name", "value"), [
    ("rank", 0), ("rank", 2), ("world_size", 3), ("init_method", "env://"),
    ("init_method", "tcp://127.0.0.1:29500"), ("store", dist.HashStore()),
])
def test_init_process_group_leaves_ranks_and_rendezvous_to_the_launcher(
        no_session: None, name: str, value: Any) -> None:
    with pytest.raises(ValueError) as caught:
        torchpass_p2p.init_process_group("gloo", **{name: value})
    assert str(caught.value) == (f"init_process_group({name}=...): run under `torchpass-p2p "
                                 "launch`, which decides ranks and rendezvous")
    with pytest.raises(RuntimeError, match="init_process_group"):
        current()  # nothing was started


@pytest.mark.parametrize("backend", ["mpi", "ucc", "GLOO"])
def test_an_unknown_backend_is_refused_naming_the_known_ones(no_session: None,
                                                             backend: str) -> None:
    with pytest.raises(ValueError) as caught:
        torchpass_p2p.init_process_group(backend)
    assert str(caught.value) == f"backend {backend!r}: 'gloo' or 'nccl'"


def test_an_unknown_state_transport_is_refused_naming_the_known_ones(no_session: None) -> None:
    with pytest.raises(ValueError) as caught:
        torchpass_p2p.init_process_group("gloo", state_transport="rdma")
    assert str(caught.value) == "state_transport 'rdma': 'auto', 'tcp' or 'pg'"


@pytest.mark.parametrize(("nccl", "cuda", "why"), [
    (False, False, "torch.distributed.is_nccl_available() is False here"),
    (False, True, "torch.distributed.is_nccl_available() is False here"),
    (True, False, "torch.cuda.is_available() is False here"),
])
def test_nccl_without_nccl_or_cuda_is_refused_before_anything_starts(
        no_session: None, monkeypatch: pytest.MonkeyPatch, nccl: bool, cuda: bool,
        why: str) -> None:
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torchpass_p2p, "start", _no_agent)
    monkeypatch.setenv("TORCHPASS_KEY_FILE", "/launcher/key")
    with pytest.raises(ValueError) as caught:
        torchpass_p2p.init_process_group(backend="nccl")
    assert str(caught.value) == (f'backend="nccl" needs a torch build with NCCL and a CUDA '
                                 f'device ({why}): use backend="gloo"')
    with pytest.raises(RuntimeError, match="init_process_group"):
        current()  # nothing was started


class AgentStarted(Exception):
    """What the stand-in for :func:`torchpass_p2p.start` raises: the refusals were passed."""


def _no_agent(*_args: Any, **_kwargs: Any) -> Any:
    raise AgentStarted


def test_a_script_not_started_by_the_launcher_is_told_to_use_it(
        no_session: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHPASS_KEY_FILE", raising=False)
    monkeypatch.delenv("TORCHPASS_KEY", raising=False)
    monkeypatch.setenv("RANK", "0")  # as torchrun sets it
    monkeypatch.setattr(torchpass_p2p, "start", _no_agent)
    with pytest.raises(RuntimeError) as caught:
        torchpass_p2p.init_process_group("gloo")
    assert str(caught.value) == ("init_process_group(): run this script under `torchpass-p2p "
                                 "launch` (not python or torchrun): no TORCHPASS_KEY_FILE or "
                                 "TORCHPASS_KEY is set, so no launcher started it")
    with pytest.raises(RuntimeError, match="init_process_group"):
        current()  # nothing was started


@pytest.mark.parametrize("variable", ["TORCHPASS_KEY_FILE", "TORCHPASS_KEY"])
def test_an_agent_configured_by_hand_is_started(no_session: None,
                                                monkeypatch: pytest.MonkeyPatch,
                                                variable: str) -> None:
    monkeypatch.delenv("TORCHPASS_KEY_FILE", raising=False)
    monkeypatch.delenv("TORCHPASS_KEY", raising=False)
    monkeypatch.setenv(variable, "set by hand")
    monkeypatch.setattr(torchpass_p2p, "start", _no_agent)
    with pytest.raises(AgentStarted):
        torchpass_p2p.init_process_group("gloo")


# ------------------------------------------------------------------ DistributedDataParallel

@pytest.mark.parametrize(("name", "value", "instead"), [
    ("process_group", object(), "leave process_group out"),
    ("device_mesh", object(), "leave device_mesh out"),
    ("mixed_precision", object(), "use torch.autocast (with a GradScaler) around the forward"),
])
def test_ddp_refuses_what_the_configuration_decides(no_session: None, name: str, value: Any,
                                                    instead: str) -> None:
    with pytest.raises(ValueError) as caught:
        DistributedDataParallel(torch.nn.Linear(2, 2), **{name: value})
    message = str(caught.value)
    assert message.startswith(f"DistributedDataParallel({name}=...): ")
    assert message.endswith(instead)


@pytest.mark.parametrize("name", ["broadcast_buffers", "forward_sync_buffers"])
def test_ddp_refuses_rank_local_buffers(no_session: None, name: str) -> None:
    with pytest.raises(ValueError) as caught:
        DistributedDataParallel(torch.nn.BatchNorm1d(2), **{name: False})
    assert str(caught.value) == (f"DistributedDataParallel({name}=False): buffers that differ "
                                 "between ranks cannot move to a spare; every rank takes rank "
                                 "0's buffers after each step, as DDP's default does")


def test_ddp_refuses_sparse_gradients_naming_the_dense_ones(no_session: None) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError) as caught:
        DistributedDataParallel(model)
    assert str(caught.value) == ("sparse gradients (an Embedding with sparse=True) are not "
                                 "supported: use sparse=False")


def test_ddp_needs_init_process_group(no_session: None) -> None:
    with pytest.raises(RuntimeError) as caught:
        DistributedDataParallel(torch.nn.Linear(2, 2))
    assert str(caught.value) == "call torchpass_p2p.init_process_group() first"


def test_one_replica_per_process_trained_inside_the_epochs_loop(session: Session) -> None:
    with pytest.raises(RuntimeError) as caught:
        next(torchpass_p2p.epochs(0, 2))
    assert str(caught.value) == ("wrap the model in torchpass_p2p.DistributedDataParallel "
                                 "before the epochs loop")
    model = DistributedDataParallel(torch.nn.Linear(2, 2))
    assert session.ddp is model
    with pytest.raises(RuntimeError) as caught:
        DistributedDataParallel(torch.nn.Linear(2, 2))
    assert str(caught.value) == "one torchpass_p2p.DistributedDataParallel per process"
    with pytest.raises(RuntimeError) as caught:
        model(torch.ones(1, 2))
    assert str(caught.value) == ("train inside `for epoch in torchpass_p2p.epochs(start, "
                                 "stop)`: a spare joins there")
    model.eval()
    with torch.no_grad():
        assert model(torch.ones(1, 2)).shape == (1, 2)  # evaluation opens no step


# ------------------------------------------------------------------ data

def test_a_distributed_sampler_with_a_batch_sampler_is_refused(session: Session) -> None:
    dataset = Squares()
    sampler = DistributedSampler(dataset)
    batches = tud.BatchSampler(tud.SequentialSampler(dataset), 4, drop_last=False)
    with pytest.raises(ValueError) as caught:
        DataLoader(dataset, sampler=sampler, batch_sampler=batches)
    assert str(caught.value) == ("a DistributedSampler with a batch_sampler is not supported: "
                                 "give batch_size (and drop_last) to the DataLoader instead")
    assert session.loaders == []


class Wrapper(tud.Sampler[int]):
    """A sampler over another, naming it ``sampler`` as torch's ``BatchSampler`` does."""

    def __init__(self, sampler: tud.Sampler[Any]) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[int]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_batch_sampler_over_a_distributed_sampler_is_refused_where_made(
        session: Session, depth: int) -> None:
    dataset = Squares()
    inner: tud.Sampler[Any] = DistributedSampler(dataset)
    for _ in range(depth):
        inner = Wrapper(inner)
    batches = tud.BatchSampler(inner, 4, drop_last=False)
    for args, kwargs in [((), {"batch_sampler": batches}),
                         ((1, False, None, batches), {})]:
        with pytest.raises(ValueError) as caught:
            DataLoader(dataset, *args, **kwargs)
        assert str(caught.value) == ("a batch_sampler over a torchpass_p2p.DistributedSampler "
                                     "is not supported: give the DistributedSampler as "
                                     "sampler=, and batch_size (and drop_last) to the "
                                     "DataLoader")
    assert session.loaders == []
    # a batch_sampler over torch's own samplers stays torch's
    plain = tud.BatchSampler(Wrapper(tud.SequentialSampler(dataset)), 4, drop_last=False)
    assert len(list(DataLoader(dataset, batch_sampler=plain))) == 3


def test_an_iterable_dataset_with_a_distributed_sampler_is_refused(session: Session) -> None:
    dataset = Stream()
    with pytest.raises(ValueError) as caught:
        DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset))
    assert str(caught.value) == ("an IterableDataset has no sampler: a replacement could not "
                                 "start at the dead rank's batch; use a map-style Dataset "
                                 "(__getitem__ and __len__) with the DistributedSampler")
    assert session.loaders == []


def test_a_distributed_sampler_iterated_by_a_torch_data_loader_is_refused(
        session: Session) -> None:
    dataset = Squares()
    sampler = DistributedSampler(dataset, shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (2, 1)  # this member's place
    loader = tud.DataLoader(dataset, batch_size=2, sampler=sampler)
    with pytest.raises(RuntimeError) as caught:
        next(iter(loader))
    assert str(caught.value) == ("torchpass_p2p.DistributedSampler must be given to a "
                                 "torchpass_p2p.DataLoader: a torch DataLoader does not say which "
                                 "batches the training loop took")
    # given to a torchpass_p2p.DataLoader, the same sampler serves rank 1's batches
    ours = DataLoader(dataset, batch_size=2, sampler=sampler)
    assert [x.flatten().tolist() for x, _ in ours] == [[1.0, 3.0], [5.0, 7.0], [9.0, 11.0]]
    assert session.loaders == [ours]


# ------------------------------------------------------------------ track

def test_track_refuses_what_it_cannot_move(session: Session) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = {"steps": 0}
    with pytest.raises(TypeError) as caught:
        torchpass_p2p.track(counter)
    assert str(caught.value) == "name the dict: track(name=obj)"
    with pytest.raises(TypeError) as caught:
        torchpass_p2p.track(counter=counter)
    assert str(caught.value) == ("counter: dict has no state_dict/load_state_dict; wrap what "
                                 "it holds in an object that has")
    torchpass_p2p.track(optimizer)
    assert session.objects["optimizer"] is optimizer
    with pytest.raises(ValueError) as caught:
        torchpass_p2p.track(optimizer=torch.optim.SGD(model.parameters(), lr=0.2))
    assert str(caught.value) == "'optimizer' is tracked already"
