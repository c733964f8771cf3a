"""The data-parallel step loop with the commit rule, and the spare's path into it.

A script adopts it in a few lines::

    agent = torchpass_p2p.start()
    model, optimizer = build()                 # spares build before they are needed
    trainer = Trainer(model, optimizer, agent=agent, scheduler=scheduler, seed=0)
    result = trainer.run(loss_fn, steps=200)   # loss_fn(step, rank) -> scalar loss tensor

:class:`Trainer` is the top of a stack of layers, each in a module of its own
(:mod:`.member` lists them and the invariants of the state they share): following the
agent's changes (:mod:`.changes`), the state exchange (:mod:`.exchange`) and recovery
(:mod:`.recovery`). This module holds the step itself (docs/design.md section 6):

* *Step k* (a rank): seed every generator from ``(seed, rank, k)``; forward and backward
  (``loss_fn``); the flattened gradient is averaged over the configuration's group, summed in
  rank order (bitwise independent of the backend's algorithm); a tiny commit all-reduce; the
  agent accepts ``k`` as committed; the optimizer (and scheduler) step. The agent refuses the
  commit once a decided change gave the ranks to others (this member's progress for that plan
  is fixed already; a group whose drained member is leaving can still commit): the step is
  not applied, and the commit rule settles it. A fenced member (no majority heard for its
  lease) votes against the commit in the commit all-reduce: nobody applies the step, and the
  ranks redo it once that member has its lease back, unless a change comes first.
* Any fault in a step or in the final barrier raises :class:`CollectiveError` or
  :class:`Superseded` out of it; :meth:`Trainer.run` hands it to the recovery and runs on from
  the step the recovery resumed at.

Invariants: the loop applies step ``k`` only after every rank voted for it and the agent
accepted it as committed (any other application is a roll forward, the commit rule's, in
:mod:`.recovery`); the final barrier passes only when no member is fenced.

The exceptions and constants of the layers below stay importable from here, as before the
split (``from .x import N as N``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torchpass_p2p.agent import Phase, TrainingAgent, format_address
from torchpass_p2p.collective import CollectiveError, Superseded, flatten, unflatten_into

from .changes import SLICE_S as SLICE_S
from .changes import WAIT_SLICE_S as WAIT_SLICE_S
from .ends import Drained, Removed, Stopped
from .ends import Incomplete as Incomplete
from .exchange import FETCH_ATTEMPTS as FETCH_ATTEMPTS
from .exchange import LOOKUP_GRACE_S as LOOKUP_GRACE_S
from .exchange import LOOKUP_SLICE_S as LOOKUP_SLICE_S
from .exchange import LOOKUP_TIMEOUT_S as LOOKUP_TIMEOUT_S
from .exchange import TRANSFER_SERVICE as TRANSFER_SERVICE
from .faults import FaultInjector
from .member import TrainResult
from .recovery import Recovery
from .regroup import GIVE_UP_S
from .seeding import seed_step

__all__ = ["Drained", "Removed", "Stopped", "TrainResult", "Trainer"]


class Trainer(Recovery):
    """Data-parallel training that survives losing ranks (module docstring).

    Args:
        model: the replica (same on every member); gradients of its parameters (one dtype)
            are averaged.
        optimizer: steps the model's parameters.
        agent: this process's :class:`~torchpass_p2p.agent.api.Agent` (already started), or
            anything else with the members of :class:`~torchpass_p2p.agent.TrainingAgent`.
        scheduler: optional LR scheduler, stepped after each optimizer step.
        seed: the job's seed; step ``k`` of rank ``r`` draws from ``(seed, r, k)``.
        extra: more state to transfer, ``{name: Stateful}`` (rank-independent).
        backend: ``"gloo"`` or ``"nccl"``.
        state_transport: how a member that lacks the resume state gets it: ``"tcp"`` (the
            transfer servers, before the group forms), ``"pg"`` (the configuration's own group,
            once formed) or ``"auto"``: ``"pg"`` over NCCL, ``"tcp"`` over gloo (faster here:
            a MAC on every byte and a stalled source routed around; gloo closes the whole
            group on a timed-out wait).
        log_path: JSON-lines timeline (:mod:`.joblog`); None: no log.
        faults: fault injector (default: from ``TORCHPASS_FAULTS``).
        regroup_wait_s: after a collective failure, how long to wait for a configuration
            change before regrouping in the same configuration (default:
            :func:`~.regroup.regroup_wait_s` of the agent's protocol parameters).
        give_up_s: the last resort, in seconds: a member fenced this long (also inside a
            group operation) that counts fewer than a majority of its configuration reachable
            stops with :class:`Stopped`, saying how many are left; otherwise a rank whose
            failed collective nothing repaired, or that is cut off, stops after this long with
            :class:`Removed`, a spare that reached no majority with :class:`Stopped` (default
            :data:`~.regroup.GIVE_UP_S`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 agent: TrainingAgent, scheduler: Any = None, seed: int = 0,
                 extra: Mapping[str, Any] | None = None, backend: str = "gloo",
                 state_transport: str = "auto",
                 log_path: str | os.PathLike[str] | None = None,
                 faults: FaultInjector | None = None,
                 regroup_wait_s: float | None = None,
                 give_up_s: float = GIVE_UP_S) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.params = [p for p in model.parameters() if p.requires_grad]
        objects: dict[str, Any] = {"model": model, "optimizer": optimizer}
        if scheduler is not None:
            objects["scheduler"] = scheduler
        objects.update(extra or {})
        super().__init__(agent, objects=objects, seed=seed, backend=backend,
                         state_transport=state_transport, log_path=log_path, faults=faults,
                         regroup_wait_s=regroup_wait_s, give_up_s=give_up_s)

    @property
    def rank(self) -> int:
        assert self.group is not None
        return self.group.spec.rank

    @property
    def world_size(self) -> int:
        assert self.group is not None
        return self.group.spec.world_size

    def run(self, loss_fn: Callable[[int, int], torch.Tensor], steps: int) -> TrainResult:
        """Train until ``steps`` steps are applied; returns the :class:`TrainResult`.

        ``loss_fn(step, rank)`` returns the scalar loss of this rank's batch of ``step``; it
        must depend only on its arguments, the model and generators seeded for the step.
        A spare first waits for a rank.

        Raises:
            Removed: this member was removed (or its agent stopped) before training ended.
            Drained: it was removed after it asked to leave (its rank went to a spare).
            Stopped: the agreed plan stops the job (a vacant rank nobody can fill).
        """
        self.service.start()
        try:
            try:
                self._begin()
            except (CollectiveError, Superseded) as exc:  # a member failed while starting
                self._recover(exc)
            while True:  # a failure in the last barrier is recovered from like one in a step
                try:
                    if self.step < steps:
                        self._one_step(loss_fn)
                        continue
                    self._finish()
                    return self.result
                except (CollectiveError, Superseded) as exc:
                    self._recover(exc)
        except Removed as exc:
            self.log("removed", step=self.step, config_id=self.config_id,
                     drained=isinstance(exc, Drained), reason=str(exc)[:160])
            raise
        finally:
            self._close()

    def _begin(self) -> None:
        self._log_start()
        if self._started_as_spare():
            self._enter_as_spare(self._await_first_rank())
            return
        started_in, rank = self._started_rank()
        # Every rank enters the configuration it was started in, never "the current one": a
        # change decided while the ranks start up (a spare joined) would otherwise put them in
        # different groups' rendezvous. A later change arrives as usual (``_poll``).
        self.faults.at(0, "enter", rank)
        self._enter_configuration(started_in, group_id=started_in.config_id, resume=0,
                                  fetch_from=None)

    def _log_start(self) -> None:
        """The ``start`` record: this member's role, configuration, rank and addresses."""
        agent = self.agent
        status = agent.status_address
        self.log("start", role=agent.role, config_id=agent.config_id, rank=agent.rank,
                 address=format_address(agent.address),
                 status=None if status is None else format_address(status))

    def _one_step(self, loss_fn: Callable[[int, int], torch.Tensor]) -> None:
        if self._poll():
            raise Superseded
        group = self.group
        assert group is not None
        k, rank, agent = self.step, group.spec.rank, self.agent
        self.faults.at(k, "compute", rank)
        seed_step(self.seed, rank, k)
        agent.report_progress(k, Phase.COMPUTE)
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(k, rank)
        loss.backward()
        flat = flatten(self.params)
        self.faults.at(k, "grad", rank)
        agent.report_progress(k, Phase.COLLECTIVE)
        avg = group.mean_in_rank_order(flat, watch=self._watch)
        self._reduced = (k, avg)
        self.faults.at(k, "commit", rank)
        vote = torch.tensor([0.0 if agent.fenced else 1.0, float(loss.detach())],
                            dtype=torch.float64)
        votes = group.mean_in_rank_order(vote, watch=self._watch)
        if votes[0].item() != 1.0:  # a member is fenced: nobody commits step k
            self.log("commit_vetoed", step=k, config_id=group.config_id, fenced=agent.fenced)
            self._await_lease()
            return  # every rank saw the veto: all redo step k in this group, same batch
        # Every rank's loss is in; kept even when the step is applied only by a roll forward.
        self.result.losses[k] = votes[1].item()
        if not agent.report_commit(k, self._ranks):  # a decided change took the ranks meanwhile
            self.log("commit_refused", step=k, config_id=group.config_id)
            group.abandon()
            raise Superseded
        self._apply(k, avg)
        self.log("step", step=k, loss=votes[1].item(), config_id=self.config_id, rank=rank)

    def _apply(self, k: int, avg: torch.Tensor) -> None:
        unflatten_into(avg, self.params)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step = k + 1
        self._reduced = None

    def _finish(self) -> None:
        group = self.group
        assert group is not None
        # Everyone holds the final state before anyone leaves (no late promotion of a spare),
        # and nobody was fenced as it said so: a member woken from a pause past its lease
        # (replaced meanwhile, perhaps) must not finish as if it still held its rank. Like a
        # commit's vote (``_one_step``): every rank sees the veto and waits, then all try again.
        self.faults.at(self.step, "finish", group.spec.rank)
        while True:
            vote = torch.tensor([0.0 if self.agent.fenced else 1.0])
            votes = group.allgather(vote, watch=self._watch)
            if all(v.item() == 1.0 for v in votes):
                break
            self.log("finish_vetoed", step=self.step, config_id=group.config_id,
                     fenced=self.agent.fenced)
            self._await_lease()
        # The final states must be one: a replica that a script steered by state of its own
        # (not moved to a spare) ends elsewhere, and the job must not end with exit 0 then.
        mine = self._fingerprint()
        self._check_fingerprints(group, mine, f"configuration {self.config_id}, the final "
                                 "barrier", self.step)
        self.result.steps = self.step
        self.result.rank = group.spec.rank
        self.result.fingerprint = mine
        self.log("finished", step=self.step, config_id=self.config_id,
                 fingerprint=mine.hex())

    def _close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.keeper.close()
        self.service.close()
        self.log.close()
