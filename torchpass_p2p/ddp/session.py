"""This process's place in the job, driven from inside the user's own training loop.

Why one module of this size: the step's phases (open, hook, vote, commit, redo, roll forward)
share one step record and run from torch's callbacks in an order only this class sees whole;
the reduction (:mod:`.reduction`), the hand-off (:mod:`.handoff`), the data (:mod:`.data`) and
the recovery layers (:mod:`torchpass_p2p.trainer`) live apart.

:class:`Session` is the recovery machinery of :class:`~torchpass_p2p.trainer.Trainer` (entering
configurations, the commit rule, the state exchange, regroups) with the step taken apart and
driven by the parts a training script already calls (``docs/training.md``):

* a training ``forward`` with no step open opens step ``k``: a configuration that is due is
  entered there (the state is at a step boundary), every generator is seeded from
  ``(seed, rank, k)``, the module's buffers are kept as they were;
* DDP's communication hook fills the step's reduction (:mod:`.reduction`) bucket by bucket; at
  the last bucket it launches the commit vote behind it, waits for the reduction and the
  votes, and takes rank 0's buffers; the commit (the agent accepts ``k``) closes the step. DDP
  then writes the averaged gradients, and the script clips, scales and steps its optimizer as
  it always did;
* a fault inside the step is recovered from inside the last hook: the step's reduction is done
  again on the new group from the kept local gradients (*redo*, the spare computing its own for
  the same batch), or, when another member committed it, the member joins the new group,
  receives the committed gradient and buffers there if it lacks them (:mod:`.handoff`), and
  the script applies them; the entry is settled at the next step's start (*roll forward*).
  ``loss.backward()`` returns only with the gradients every rank agrees on, so nothing in the
  script ever sees a fault.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch

from torchpass_p2p.agent import Change, TrainingAgent
from torchpass_p2p.checkpoint import CheckpointSettings, NotSameJob
from torchpass_p2p.collective import CollectiveError, ManagedGroup, Superseded, exit_process
from torchpass_p2p.trainer.ends import STEERED, Diverged, exit_code_for
from torchpass_p2p.trainer.loop import Drained, Removed, Stopped, Trainer
from torchpass_p2p.trainer.regroup import GIVE_UP_S
from torchpass_p2p.trainer.seeding import seed_step
from torchpass_p2p.transfer import Snapshot

from . import untracked
from .handoff import hand_off, pack, unpack
from .reduction import (
    BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    Ballot,
    Layout,
    StepReduction,
    flat_tensors,
    unflat_into,
)
from .steering import OptimizerSteps, disagreement
from .stragglers import ArrivalWatch, policy_from_env

if TYPE_CHECKING:
    from torchpass_p2p.checkpoint.writer import Checkpointer

    from .data import DataLoader

__all__ = ["JobMismatch", "Session", "current", "install"]

T = TypeVar("T")
EXIT_SAVE_WAIT_S = 5.0
"""How long a member that stops waits for its checkpoint in flight to commit: within the
launcher's grace (``DEFAULT_GRACE_S``) before SIGKILL."""
_SESSION: Session | None = None
_HEAD = 6
"""A vote's leading values: yes (1.0, or 0.0 when fenced), the step, the step before's
optimizer steps and their digest (:mod:`.steering`), ``compute_s``, ``wait_s``; the module's
buffers follow."""


def current() -> Session:
    """This process's session. Raises ``RuntimeError`` before
    :func:`torchpass_p2p.init_process_group`."""
    if _SESSION is None:
        raise RuntimeError("call torchpass_p2p.init_process_group() first")
    return _SESSION


def install(session: Session | None) -> None:
    global _SESSION
    _SESSION = session


class JobMismatch(Stopped):
    """This member's script describes another job than the majority of its configuration
    (another number of epochs, dataset, model, seed, ...). It stops (exit code 5) and is not
    respawned: a respawn would run the same script again."""


class _RollForward(Exception):
    """Internal: the commit rule says apply the held step; the script applies it."""


class _Progress:
    """The epoch and the loaders' positions at the step boundary, as a Stateful."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def state_dict(self) -> dict[str, Any]:
        s = self.session
        return {"epoch": s.epoch, "loaders": s.positions()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        s = self.session
        loaders = list(sd["loaders"])
        if len(loaders) != len(s.loaders):
            raise ValueError(f"the state tracks {len(loaders)} data loaders, this script "
                             f"made {len(s.loaders)}")
        s.epoch = int(sd["epoch"])
        for loader, position in zip(s.loaders, loaders, strict=True):
            loader.restore([int(v) for v in position])


class Session(Trainer):
    """The training side of one member (module docstring). Made by
    :func:`torchpass_p2p.init_process_group`.

    Args:
        agent: this process's started agent.
        seed: the job's seed: step ``k`` of rank ``r`` draws from ``(seed, r, k)``, sample
            ``i`` of epoch ``e`` from ``(seed, e, i)``.
        exact: rank-order sums (bitwise equal to a fault-free run) or the backend's own.
        backend: ``"gloo"`` or ``"nccl"``.
        log_path: the JSON-lines timeline, or None.
        state_transport: ``"tcp"``, ``"pg"`` or ``"auto"``, as for
            :class:`~torchpass_p2p.trainer.Trainer`.
        give_up_s: the last resort, seconds, as for :class:`~torchpass_p2p.trainer.Trainer`
            (None: :data:`~torchpass_p2p.trainer.regroup.GIVE_UP_S`).
    """

    def __init__(self, agent: TrainingAgent, *, seed: int, exact: bool, backend: str,
                 log_path: str | os.PathLike[str] | None,
                 state_transport: str = "auto", give_up_s: float | None = None) -> None:
        super().__init__(torch.nn.Module(), None, agent=agent,  # type: ignore[arg-type]
                         seed=seed, backend=backend, log_path=log_path,
                         state_transport=state_transport,
                         give_up_s=GIVE_UP_S if give_up_s is None else give_up_s)
        self.objects = {}
        self.exact = exact
        self.ddp: Any = None
        self.loaders: list[DataLoader] = []
        self.epoch = 0
        self.epochs_stop: int | None = None
        self.layout: Layout | None = None
        self.reduction: StepReduction | None = None
        self._index: dict[int, int] = {}
        self._params: list[torch.nn.Parameter] = []
        self._used: torch.Tensor | None = None  # parameters this rank used in the step
        self._buffers: list[torch.Tensor] = []
        self._at_start: list[torch.Tensor] = []
        self._open = False
        self._frozen: list[list[int]] | None = None
        self._last_handed: tuple[DataLoader, list[int]] | None = None
        self._step_error: BaseException | None = None
        # what a roll forward left for the next step's start (_catch_up): the entry of a
        # configuration joined behind, or a regroup's fingerprint check
        self._settle_next: Callable[[], None] | None = None
        self._entering: Any = None
        self._in_regroup = False
        self._joined = False
        self._unwatch_optimizers: Callable[[], None] = lambda: None
        self.steering = OptimizerSteps(lambda: [o for o in self.objects.values()
                                                if isinstance(o, torch.optim.Optimizer)])
        self._first_change: Change | None = None
        self.stragglers = ArrivalWatch(self.me, policy_from_env(), self.log, self.agent.drain)
        self.step_figures: list[list[float]] = []
        """Every rank's ``[compute_s, wait_s]`` from the last vote, by rank: those of the step
        before the voted one (seconds, each on that rank's clock;
        :data:`~.stragglers.UNMEASURED` where not measured)."""
        self._ballot: Ballot | None = None  # this step's vote, launched
        self._results: list[torch.Tensor] = []  # the step's averaged gradient, per bucket
        self._held_step = -1  # the step whose averaged gradient self.reduction.held is
        self._committed_buffers: torch.Tensor | None = None  # handed over (_fill_gap)
        self.checkpoint_settings = CheckpointSettings.from_env(os.environ)
        """Where and how often rank 0 saves (``docs/checkpoints.md``); None: no checkpoints."""
        self.checkpointer: Checkpointer | None = None
        self._log_start()
        self.service.start()
        resume = None if self.checkpoint_settings is None else self.checkpoint_settings.resume_step
        if resume and not self._started_as_spare():
            # A rank resuming at step k holds every step before it as committed, from its
            # agent's start on: a change decided before the checkpoint is loaded (a member
            # suspected during the start-up) must not plan a resume at step 0, which nobody
            # holds (seen once under load: "no state source for configuration 1"). If the
            # load fails, this member stops (exit 5) and holds no rank any more.
            agent.report_progress(resume - 1)
        if self._started_as_spare():
            # What the script does once a spare holds a rank is on the recovery's critical
            # path; torch's DDP constructor imports torch._dynamo (seconds), so a spare
            # imports it while it waits.
            importlib.import_module("torch._dynamo")

            self._first_change = self.guard(self._await_first_rank)
            if self._first_change.plan.action == "stop":
                # The change that ended the spare's wait stops the job (every holder of a
                # vacant rank's state died together, or no spare is left under policy
                # ``stop``): Stopped and exit 5 here, before the script asks for a rank.
                first = self._first_change
                self.guard(lambda: self._enter(first))

    # ------------------------------------------------------------------ place

    @property
    def rank(self) -> int:
        if self.group is not None:
            return self.group.spec.rank
        configuration = self._configuration()
        rank = configuration.rank_of(self.me)
        if rank is None:
            raise RuntimeError("this member holds no rank")
        return int(rank)

    @property
    def world_size(self) -> int:
        if self.group is not None:
            return self.group.spec.world_size
        return int(self._configuration().world_size)

    def _configuration(self) -> Any:
        if self._first_change is not None:
            return self._first_change.configuration
        return self.agent.settings.configuration

    # ------------------------------------------------------------------ registration

    def attach_model(self, ddp: Any) -> None:
        """The DDP replica: its module's state moves, its gradients are reduced here.

        Raises:
            RuntimeError: a second model (one replica per process).
        """
        if self.ddp is not None:
            raise RuntimeError("one torchpass_p2p.DistributedDataParallel per process")
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.ddp = ddp
        self._params = params
        entries: list[torch.Tensor] = list(params)
        if getattr(ddp, "find_unused_parameters", False):
            # DDP finds the unused parameters over its own process group, of this process
            # alone: a parameter this rank did not use but another did would keep its stale
            # gradient here and the ranks would drift apart. The flags of which ones this
            # rank used ride, as entry 0 (the canonical layout's last place), in the step's
            # reduction: the step's result says which were used anywhere (_close_step).
            self._used = torch.zeros(len(params), dtype=params[0].dtype,
                                     device=params[0].device)
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(functools.partial(_mark_used,
                                                                       self._used, i))
            entries.insert(0, self._used)
        first = len(entries) - len(params)
        # DDP's own caps (its bucket_cap_mb), so that its rebuilt buckets are canonical ones
        config = getattr(ddp, "_bucket_config", None)
        self.layout = Layout.of(
            entries, first_bytes=getattr(config, "first_bucket_bytes_cap", FIRST_BUCKET_BYTES),
            bytes_cap=getattr(ddp, "bucket_bytes_cap", BUCKET_BYTES))
        self.reduction = StepReduction(self.layout, exact=self.exact)
        self._index = {id(p): first + i for i, p in enumerate(params)}
        self._buffers = list(ddp.module.buffers())
        self.objects["model"] = ddp.module

    def track(self, name: str, obj: Any) -> None:
        """Move ``obj`` (``state_dict``/``load_state_dict``) with the training state.

        Raises:
            TypeError: ``obj`` is not Stateful.
            ValueError: ``name`` taken, or the job has started (a spare would not know it).
        """
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"{name}: {type(obj).__name__} has no state_dict/load_state_dict; "
                            "wrap what it holds in an object that has")
        if name in self.objects or name == "progress":
            raise ValueError(f"{name!r} is tracked already")
        if self._joined:
            raise ValueError(f"{name!r}: track state before the epochs loop starts")
        self.objects[name] = obj

    def track_loader(self, loader: DataLoader) -> None:
        if self._joined:
            raise ValueError("make the data loaders before the epochs loop starts")
        self.loaders.append(loader)

    # ------------------------------------------------------------------ the job

    def join(self, start: int, stop: int) -> int:
        """Enter the job at the epochs loop: a rank its first configuration, a spare the one
        that gave it a rank (receiving the state). Returns the epoch to run first."""
        if self.ddp is None:
            raise RuntimeError("wrap the model in torchpass_p2p.DistributedDataParallel before "
                               "the epochs loop")
        if self._joined:
            return self.epoch
        self.epoch, self.epochs_stop = start, stop
        self.objects["progress"] = _Progress(self)
        self._joined = True
        unwatch, unsteer = untracked.install(self.objects, self.ddp.module), self.steering.install()

        def unwatch_optimizers() -> None:
            unwatch()
            unsteer()

        self._unwatch_optimizers = unwatch_optimizers
        self.guard(self._enter_job)
        return self.epoch

    def _enter_job(self) -> None:
        try:
            if self._first_change is not None:
                self._enter_as_spare(self._first_change)
            else:
                started_in, rank = self._started_rank()
                resume = self._resume(started_in)
                self.faults.at(resume, "enter", rank)
                self._enter_configuration(started_in, group_id=started_in.config_id,
                                          resume=resume, fetch_from=None)
        except (CollectiveError, Superseded) as exc:
            self._recover(exc)
        self._set_env()
        if self.checkpoint_settings is not None:
            from torchpass_p2p.checkpoint.writer import Checkpointer

            self.checkpointer = Checkpointer(
                self.checkpoint_settings, self.step, capture=self._copy, job=self.describe,
                log=self.log)

    def _resume(self, configuration: Any) -> int:
        """A rank of configuration 0 started by a launcher that found a complete checkpoint
        (``TORCHPASS_RESUME_STEP``): load it into the live objects and return its step; 0
        when there is none. Every rank loads the same one, from the same directory; the
        fingerprint check that follows (every configuration's entry) proves they hold the
        same state.

        Raises:
            JobMismatch: the checkpoint is of another run id, world size or job (exit code 5).
            Stopped: it cannot be read back as saved.
        """
        settings = self.checkpoint_settings
        if settings is None or settings.resume_step is None:
            return 0
        from torchpass_p2p.checkpoint.writer import CheckpointError, load

        self._ranks = tuple(configuration.ranks)  # describe() counts them
        try:
            marker = load(settings, settings.resume_step, self.objects,
                          world_size=len(self._ranks), job=self.describe())
        except NotSameJob as exc:
            raise JobMismatch(f"{exc}: resume with the job that wrote it, or start afresh "
                              "with another --checkpoint-dir or --run-id") from None
        except (CheckpointError, ValueError) as exc:
            raise Stopped(f"cannot resume from the checkpoint: {exc}") from None
        self.step = marker.step
        mine = self._fingerprint().hex()
        if mine != marker.fingerprint:
            raise Stopped(f"the state restored from the checkpoint of step {marker.step} is not "
                          "the one saved (its fingerprint differs)")
        if marker.step > 0:  # it holds every step before as committed (as after a fetch)
            self.agent.report_progress(marker.step - 1)
        self.log("resumed", step=marker.step, epoch=self.epoch, fingerprint=mine,
                 directory=settings.directory)
        return marker.step

    def _copy(self) -> Snapshot:
        """A copy of the state at this step boundary: what a spare would receive."""
        return Snapshot.capture(self.objects, self.step, self._metadata(), copy=True)

    def _set_env(self) -> None:
        """``RANK`` and ``WORLD_SIZE`` as torchrun sets them, for scripts that read them."""
        os.environ["RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        os.environ.setdefault("LOCAL_RANK", str(self.rank))

    def finish(self) -> None:
        """Every member holds the final state (the final barrier), then this member stops."""
        self._unwatch_optimizers()
        if not self._joined:
            self._close()
            return

        def barrier() -> None:
            while True:
                try:
                    self._catch_up()
                    self._finish()
                    return
                except (CollectiveError, Superseded) as exc:
                    self._recover(exc)

        self.guard(barrier)
        if self.checkpointer is not None:
            self.checkpointer.close()
        self._close()

    def guard(self, fn: Callable[[], T]) -> T:
        """Run ``fn``; a member that is out of the job stops the process with its exit code
        (:func:`~torchpass_p2p.trainer.ends.exit_code_for`, ``docs/running.md``): nothing of
        the script may run on after it."""
        try:
            return fn()
        except Removed as exc:
            self.log("removed", step=self.step, config_id=self.config_id,
                     drained=isinstance(exc, Drained), reason=str(exc)[:160])
            self._exit(exc, exit_code_for(exc))
        except Stopped as exc:
            self._exit(exc, exit_code_for(exc))

    def _exit(self, exc: BaseException, code: int) -> NoReturn:
        self.log("exit", code=code, reason=str(exc)[:200], step=self.step)
        # One write: the launcher's children share its stderr, and print() writes the line
        # and its newline apart, so another process's line could land between the two.
        sys.stderr.write(f"torchpass_p2p: member {self.log.member}: {exc}; exit code {code}\n")
        sys.stderr.flush()
        try:
            if self.checkpointer is not None:  # the last checkpoint in flight may be needed
                self.checkpointer.close(EXIT_SAVE_WAIT_S)
            self._close()
            self.agent.stop(leave=False, timeout_s=2.0)
        finally:
            exit_process(code)

    # ------------------------------------------------------------------ the data position

    def handing_out(self, loader: DataLoader) -> None:
        """``loader`` is about to hand out a batch: with no step open, this may be the next
        step's first batch, so its position before it is the boundary's."""
        if not self._open:
            self._last_handed = (loader, loader.position())

    def positions(self) -> list[list[int]]:
        """Every tracked loader's position at the current step boundary."""
        if self._frozen is not None:
            return self._frozen
        return self._boundary_positions()

    def _boundary_positions(self) -> list[list[int]]:
        out = []
        for loader in self.loaders:
            if self._last_handed is not None and self._last_handed[0] is loader:
                out.append(self._last_handed[1])
            else:
                out.append(loader.position())
        return out

    # ------------------------------------------------------------------ the step

    def step_starting(self) -> None:
        """A training forward with no step open: open step ``self.step`` (module docstring)."""
        if self._open:
            return
        if not self._joined:
            raise RuntimeError("train inside `for epoch in torchpass_p2p.epochs(start, stop)`: "
                               "a spare joins there")
        self._frozen = self._boundary_positions()
        self._open = True
        self.guard(self._catch_up)
        self.guard(self._fault_at_compute)
        self.steering.opened()
        k, rank = self.step, self.rank
        if self.checkpointer is not None and rank == 0:
            self.checkpointer.maybe_save(k)
        self.log("step_started", step=k, rank=rank, config_id=self.config_id,
                 epoch=self.epoch, positions=self._frozen)
        seed_step(self.seed, rank, k)
        self._at_start = [b.detach().clone() for b in self._buffers]
        if self._used is not None:
            self._used.zero_()
        assert self.reduction is not None
        self.reduction.reset(None if self.group is None else self.group.spec.world_size)
        self._step_error = None
        self._ballot = None
        self.stragglers.opened()

    def _catch_up(self) -> None:
        """At a step boundary: settle the entry of a configuration joined behind
        (:meth:`_join_behind`), finish a regroup's deferred fingerprint check, enter a
        configuration decided since."""
        while True:
            try:
                settle, self._settle_next = self._settle_next, None
                if settle is not None:
                    settle()
                if self._poll():
                    raise Superseded
                return
            except (CollectiveError, Superseded) as exc:
                self._recover(exc)

    def _fault_at_compute(self) -> None:
        """The ``compute`` fault point, before the forward (:mod:`~torchpass_p2p.trainer.faults`):
        a ``reset`` there fails this rank's group as a failed collective would, so its peers'
        reductions of the step fail too and the ranks regroup; the step then opens again."""
        try:
            self.faults.at(self.step, "compute", self.rank)
        except CollectiveError as exc:
            self._recover(exc)
            self._catch_up()

    def comm_hook(self, _state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """DDP's communication hook (module docstring). Its future completes when the step
        is committed, with the averaged gradients of the bucket."""
        reduction = self.reduction
        assert reduction is not None
        if not self._open:
            raise RuntimeError("a backward without a forward of the torchpass_p2p "
                               "DistributedDataParallel")
        indices = [self._index[id(p)] for p in bucket.parameters()]
        future = reduction.fill_bucket(indices, bucket.gradients(), bucket.buffer())
        if bucket.is_last() and self._used is not None:
            # every parameter this rank used was accumulated before DDP's last bucket
            reduction.fill(0, self._used)
        if self._step_error is None and self.group is not None:
            try:
                if bucket.is_last():  # a fault here: nobody can commit the step (a redo)
                    self.faults.at(self.step, "grad", self.group.spec.rank)
                    self._ballot = reduction.launch_ready(
                        self.group, self._watch, self._vote(self.group, self.step))
                else:
                    reduction.launch_ready(self.group, self._watch)
            except (CollectiveError, Superseded, RuntimeError) as exc:
                self._step_error = exc
        if bucket.is_last():
            if not reduction.filled:
                raise RuntimeError("DDP's buckets do not cover every trainable parameter")
            self.guard(self._end_step)
        return future

    def _end_step(self) -> None:
        k = self.step
        reduction = self.reduction
        assert reduction is not None
        error, self._step_error = self._step_error, None
        ballot, self._ballot = self._ballot, None
        relaunch = False
        while True:
            try:
                group = self.group
                if group is None:
                    raise Superseded
                if error is not None:
                    raise error
                if relaunch:
                    relaunch = False
                    ballot = reduction.relaunch(group, self._watch, self._vote(group, k))
                assert ballot is not None
                results = reduction.wait(group, self._watch)
                key = (group.config_id, group.spec.attempt)
                self.stragglers.carry(k, key, reduction.blocked_s)
                if ballot.work is not None:  # else it rode in the last bucket's, waited for
                    # (no local name for the vote's operation: it holds the group, see below)
                    group.complete(ballot.work, watch=self._watch)
                # here a fault leaves this rank inside step k without its averaged gradient
                # and rank 0's buffers, while the others commit k: the hand-off's case
                self.faults.at(k, "commit", group.spec.rank)
                voted = self._count(group, k, ballot.rows.to("cpu"))
                self._reduced, self._results = (k, results[0]), results
                if not voted:
                    relaunch = True
                    self.stragglers.spoil()
                    continue
                if not self.agent.report_commit(k, self._ranks):
                    self.log("commit_refused", step=k, config_id=group.config_id)
                    group.abandon()
                    raise Superseded
                self._close_step(k, results)
                self.stragglers.observe(k - 1, key, self._ranks, self.step_figures)
                return
            except (CollectiveError, Superseded, RuntimeError) as exc:
                if isinstance(exc, Removed | Stopped):  # the last resort (_watch): no retry
                    raise
                if not isinstance(exc, CollectiveError | Superseded):
                    if self.group is None or self.group.state == "ready":
                        raise
                # The vote's operation holds the group, even completed: kept, it would leave
                # the peers waiting on this member instead of failing at once
                # (StepReduction.forget).
                error, relaunch, ballot = None, True, None
                self.stragglers.spoil()
                if self._recover_in_step(exc):
                    self._close_step(k, self._results)
                    return

    def _vote(self, group: ManagedGroup, k: int) -> torch.Tensor:
        """This rank's commit vote for step ``k`` (1-d float64 on the CPU), launched with the
        step's last bucket (:meth:`StepReduction.launch_ready`; ``docs/training.md``,
        "Commit"). The vote carries the module's buffers as the forward left them, as float64
        (exact for the narrower dtypes, integers up to 2**53): every rank takes rank 0's, what
        DDP's ``broadcast_buffers`` gives the next forward. After the step number ride this
        rank's optimizer steps of the step before and their digest (:mod:`.steering`), and its
        ``[compute_s, wait_s]`` of the step before (:mod:`.stragglers`). :meth:`_count` reads
        every rank's once the step's reduction completed."""
        figures = self.stragglers.carried(k, (group.config_id, group.spec.attempt))
        head = torch.tensor([0.0 if self.agent.fenced else 1.0, float(k), *self.steering.last,
                             *figures], dtype=torch.float64)
        assert head.numel() == _HEAD
        # Built on the CPU whatever the buffers' device (a CUDA BatchNorm's statistics, say);
        # the reduction moves it to the group's device.
        return torch.cat([head, pack(self._buffers)])

    def _count(self, group: ManagedGroup, k: int, votes: torch.Tensor) -> bool:
        """The votes of step ``k`` (every rank's, as rows), counted once this rank's reduction
        of the step completed: True when every rank voted to commit it. Every rank reached
        the end of step ``k`` and sent all of it; a rank whose reduction fails is handed the
        averaged gradient by one that committed (:mod:`.handoff`). After a veto (a fenced
        member) this waits for the lease and the step is reduced again. Every rank's figures
        are kept in ``self.step_figures``. Raises :class:`JobMismatch` when the ranks are at
        different steps, :class:`Diverged` when they stepped their optimizers differently in
        the step before (:mod:`.steering`)."""
        head = votes[:, :_HEAD].tolist()  # one read of every rank's figures
        if {row[1] for row in head} != {float(k)}:
            group.abandon()
            raise JobMismatch(f"ranks of configuration {group.config_id} are not all at step "
                              f"{k}: not the same job")
        why = disagreement([(row[2], row[3]) for row in head])
        if why is not None:
            group.abandon()
            self.log("diverged", step=k - 1, config_id=group.config_id, reason=why)
            raise Diverged(f"step {k - 1}: {why}: {STEERED}")
        self.step_figures = [row[4:] for row in head]
        if not all(row[0] == 1.0 for row in head):
            self.log("commit_vetoed", step=k, config_id=group.config_id,
                     fenced=self.agent.fenced)
            self._await_lease()
            return False
        unpack(votes[0, _HEAD:], self._buffers)
        return True

    def _close_step(self, k: int, results: list[torch.Tensor]) -> None:
        """Step ``k`` is committed (or rolled forward): hand DDP the averaged gradients."""
        reduction = self.reduction
        assert reduction is not None
        reduction.hand_out(results)
        self._held_step = k
        if self._used is not None:
            # Used by another rank only: DDP leaves its gradient alone (it knows only this
            # process's use); in a torch DDP job every rank gets the average, as here.
            b, offset, n = reduction.layout.where[0]
            elsewhere = (results[b][offset:offset + n] > 0) & (self._used == 0)
            for i in elsewhere.nonzero().flatten().tolist():
                p = self._params[i]
                b, offset, n = reduction.layout.where[i + 1]
                p.grad = results[b][offset:offset + n].view_as(p).clone()
        self.log("step", step=k, config_id=self.config_id, rank=self.rank)
        self.step = k + 1
        self._reduced, self._results = None, []
        self._open = False
        self._frozen = None
        self._last_handed = None

    def _recover_in_step(self, exc: BaseException) -> bool:
        """Recover from a fault inside step ``self.step``'s reduction. The state served and
        fingerprinted is the step's start: the buffers go back to it meanwhile. Returns True
        when the step is rolled forward (its held result is applied by the script; the next
        configuration is entered at the next step's start), False when it is to be reduced
        again on ``self.group``."""
        assert self.reduction is not None
        self.reduction.forget()  # before the group is given up (StepReduction.forget)
        post = [b.detach().clone() for b in self._buffers]
        for b, start in zip(self._buffers, self._at_start, strict=True):
            b.detach().copy_(start)
        rolled = False
        try:
            self._recover(exc)
        except _RollForward:
            rolled = True
        finally:
            for b, p in zip(self._buffers, post, strict=True):
                b.detach().copy_(p)
        committed, self._committed_buffers = self._committed_buffers, None
        if committed is not None:  # the committed vote's, handed over (_fill_gap)
            unpack(committed, self._buffers)
        return rolled

    # ------------------------------------------------------------------ Trainer's seams

    def _enter(self, change: Any) -> None:
        self._entering = change
        try:
            super()._enter(change)
        finally:
            self._entering = None

    def _regroup(self) -> None:
        self._in_regroup = True
        try:
            super()._regroup()
        finally:
            self._in_regroup = False

    def _apply(self, k: int, avg: torch.Tensor) -> None:
        """The commit rule rolls step ``k`` forward: the script applies it once the hook
        returns; what the recovery would have done next happens at the next step's start.
        Entering a configuration, the member joins its group first to receive the committed
        buffers (:meth:`_join_behind`); in a regroup it received them already."""
        del avg
        if not self._in_regroup:
            self._join_behind()
        group = self.group
        assert group is not None

        def check() -> None:  # the regroup's last act (Recovery._regroup), one step later
            mine = self._fingerprint()
            self._check_fingerprints(group, mine, f"configuration {self.config_id}, regroup "
                                     f"{group.spec.attempt}", k + 1)
            self.log("regroup_done", config_id=self.config_id, group_id=group.config_id,
                     attempt=group.spec.attempt, rank=group.spec.rank, step=k + 1,
                     resume_step=k + 1, action="roll_forward", fingerprint=mine.hex())

        self._settle_next = check
        self.agent.report_progress(k)
        raise _RollForward

    def _metadata(self) -> dict[str, Any]:
        return {"seed": self.seed, "world_size": len(self._ranks)}

    def _enter_configuration(self, configuration: Any, *, group_id: int, resume: int,
                             fetch_from: tuple[int, ...] | None, plan: Any = None) -> None:
        if fetch_from is not None and self._open:
            # Inside step k, which others committed, without its averaged gradient (the
            # commit rule says fetch): it is handed over in the group. The state of a later
            # step would have the script run the rest of its step on it: never.
            if resume != self.step + 1:
                raise Removed(f"step {resume - 1} was committed by others while this member "
                              f"is inside step {self.step}: leaving so a spare takes the rank")
            self._join_behind()
        super()._enter_configuration(configuration, group_id=group_id, resume=resume,
                                     fetch_from=fetch_from, plan=plan)

    def _join_behind(self) -> NoReturn:
        """Inside step ``k`` of the configuration being entered, whose resume step is
        ``k + 1``: join its group behind, receive step ``k``'s averaged gradient and the
        committed buffers there (:meth:`_fill_gap`), and let the script apply the step. The
        entry is settled (the fingerprints, at step ``k + 1``) when the next step opens."""
        change = self._entering
        assert change is not None
        configuration, plan = change.configuration, change.plan
        self._form(configuration, group_id=change.group_id, resume=plan.resume_step,
                   fetch_from=None, behind=True)
        self._settle_next = lambda: self._settle(configuration, plan, plan.resume_step,
                                                 self._capture())
        self.agent.report_progress(self.step)
        raise _RollForward

    def _fill_gap(self, group: ManagedGroup, resume: int) -> tuple[int, ...]:
        """Hand step ``resume - 1``'s averaged gradient to the members inside it that lack it
        (:mod:`.handoff`). On such a member, the received gradient becomes the step's
        (``self._reduced``): the commit rule rolls it forward. Raises :class:`Removed` on it
        when no member holds the gradient, ``CollectiveError`` on the others then."""
        assert self.layout is not None and self.reduction is not None
        k = resume - 1
        behind = self._open and self.step == k
        held = self.reduction.held if self.step == resume and self._held_step == k else None
        gap = hand_off(group, self.layout, behind=behind, held=held, buffers=self._buffers,
                       watch=self._watch)
        if not gap.behind:
            return ()
        self.log("gradient_handed", step=k, config_id=group.config_id, behind=list(gap.behind),
                 source=gap.source)
        if gap.source is None:
            group.abandon()
            if behind:
                raise Removed(f"step {k} was committed by others and no member of "
                              f"configuration {group.config_id} holds its averaged gradient: "
                              "leaving so a spare takes the rank")
            raise CollectiveError(f"ranks {list(gap.behind)} lack the averaged gradient of "
                                  f"step {k} and nobody holds it", group.config_id)
        if gap.received is not None:
            self._reduced, self._results = (k, gap.received[0]), gap.received
            self._committed_buffers = gap.buffers
        return gap.behind

    def _restored(self, *args: Any, **kwargs: Any) -> Snapshot:
        self._held_step = -1  # the state is another's: its step's gradient is not held
        self.steering.forget()  # and so is the step before's history
        return super()._restored(*args, **kwargs)

    def _agree(self, group: ManagedGroup, configuration: Any, resume: int) -> bool:
        """Check that every member runs the same job; at step 0 every rank takes rank 0's
        model (as DDP's constructor does). Raises :class:`JobMismatch` on this member when
        its job is not the majority's, ``CollectiveError`` on the others (they wait for the
        change that removes it)."""
        mine = self.describe()
        blobs = _allgather_bytes(group, json.dumps(mine, sort_keys=True).encode(), self._watch)
        counts = Counter(blobs)
        top, n = counts.most_common(1)[0]
        if len(counts) > 1:
            others = [json.loads(b) for b in blobs]
            if blobs[group.spec.rank] != top or 2 * n <= len(blobs):
                majority = json.loads(top)
                diff = ", ".join(f"{key} {mine.get(key)!r} vs {majority.get(key)!r}"
                                 for key in sorted(set(mine) | set(majority))
                                 if mine.get(key) != majority.get(key))
                group.abandon()
                raise JobMismatch(f"configuration {configuration.config_id}: this member's job "
                                  f"differs from the others': {diff}")
            odd = [r for r, b in enumerate(blobs) if b != top]
            group.abandon()
            self.log("job_mismatch", config_id=configuration.config_id, ranks=odd,
                     theirs=[others[r] for r in odd][:1])
            raise CollectiveError(f"ranks {odd} run another job", group.config_id)
        if resume != 0 or self.step != 0:
            return False
        state = [t for t in self.ddp.module.state_dict().values() if isinstance(t, torch.Tensor)]
        for dtype, flat in flat_tensors(state).items():
            parts = group.allgather(flat, watch=self._watch)
            unflat_into({dtype: parts[0]}, [t for t in state if t.dtype == dtype])
        return True

    def describe(self) -> dict[str, Any]:
        """The job as this member's script describes it: what every member must agree on."""
        module = self.ddp.module
        shapes = hashlib.sha256(json.dumps(
            [[name, list(t.shape), str(t.dtype)] for name, t in module.state_dict().items()]
        ).encode()).hexdigest()[:16]
        return {
            "seed": self.seed, "exact": self.exact, "world_size": len(self._ranks),
            "epochs": self.epochs_stop, "model": shapes,
            "buckets": self.layout.describe() if self.layout else None,
            "data": [loader.describe() for loader in self.loaders],
            "state": {name: type(obj).__name__ for name, obj in self.objects.items()},
        }


def _allgather_bytes(group: ManagedGroup, data: bytes,
                     watch: Callable[[], bool]) -> list[bytes]:
    """Every rank's ``data``, by rank (two all-gathers: the lengths, then padded bytes)."""
    sizes = group.allgather(torch.tensor([len(data)], dtype=torch.int64), watch=watch)
    width = max(int(s.item()) for s in sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = group.allgather(buf, watch=watch)
    return [bytes(p[:int(s.item())].tolist()) for p, s in zip(parts, sizes, strict=True)]


def _mark_used(flags: torch.Tensor, index: int, _param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: parameter ``index`` received a gradient in this step."""
    flags[index] = 1
