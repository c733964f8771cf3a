"""Recovery: entering a configuration (the commit rule, the state, the group), and regrouping
after a collective that failed while no member did.

Theory of operation (docs/design.md sections 6 and 8).

* *A fault* ends a wait: the operation fails (:class:`CollectiveError`, a neighbour of a killed
  rank) or the agent delivers a configuration whose rank map differs (:class:`Superseded`, the
  others). The group is abandoned (dropped, or kept referenced when stuck).
* *Recovery* takes the newest such configuration ``c``: the commit rule
  (:func:`~.commit.resolve`) brings a survivor to ``resume_step`` (roll forward or redo; no
  step any member committed is ever lost); a promoted spare fetches the state of
  ``resume_step`` from the plan's sources. Every member that holds that state publishes it
  (host memory is not copied: it waits now) and announces its transfer server for ``c``; all
  build the group of ``c`` (:mod:`torchpass_p2p.collective`) and all-gather the 32-byte state
  fingerprints: training goes on only when they are all equal, and the state is withdrawn
  from the servers. The spare fetches over TCP before the group forms, or, with
  ``state_transport="pg"`` (the default over NCCL), over the new group itself once it has
  formed (:mod:`.group_transfer`: NVLink or RDMA on GPUs). How the state moves is
  :mod:`.exchange`'s. A newer configuration during recovery restarts it.
* *A regroup* (:mod:`.regroup`, issue #7) repairs a collective that failed while no member
  did (a connection reset by a network blip): no configuration change comes then. After a
  :class:`CollectiveError` a rank waits :func:`~.regroup.regroup_wait_s` (about the time a
  death takes to be decided) for a configuration with another rank map; if none came, the
  ranks form the group of the same configuration again (the next attempt: a store and key
  namespace of its own), all-gather their progress, resume at the highest step applied (those
  one behind roll forward, as with a plan's ``resume_step``), check the fingerprints and train
  on. A configuration change during the regroup wins; a regroup that fails is retried after
  another wait (at most :data:`~.regroup.MAX_REGROUPS`), then only a change helps, for at most
  :data:`~.regroup.GIVE_UP_S`.

Invariants: a member trains in a group only once every member of it has shown the same state
fingerprint at the same step; a failed group is abandoned before anything else is tried; the
last resort's clock (``give_up_s``) starts at the failure and counts the regroups; the step
itself is the step loop's (:meth:`Recovery._apply` is how a roll forward applies it).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

import torch

from torchpass_p2p.agent import TrainingAgent
from torchpass_p2p.collective import (
    CollectiveError,
    GroupSpec,
    ManagedGroup,
    StoreKeeper,
    Superseded,
    build_group,
)
from torchpass_p2p.collective.rendezvous import store_service
from torchpass_p2p.transfer import TransferError

from .commit import resolve
from .ends import Incomplete, Stopped
from .exchange import StateExchange
from .group_transfer import transfer_over_group
from .regroup import MAX_REGROUPS, next_attempt, regroup_resume
from .regroup import regroup_wait_s as default_regroup_wait_s

__all__ = ["Recovery"]


class Recovery(StateExchange):
    """The layer that brings a member into a configuration after a fault (module docstring).

    Args:
        agent: this process's started agent.
        regroup_wait_s: after a collective failure, how long to wait for a configuration
            change before regrouping (None: :func:`~.regroup.regroup_wait_s` of the agent's
            protocol parameters).
        **base: the lower layers' arguments (:class:`~.exchange.StateExchange`).
    """

    def __init__(self, agent: TrainingAgent, *, regroup_wait_s: float | None, **base: Any) -> None:
        super().__init__(agent, **base)
        if regroup_wait_s is None:
            regroup_wait_s = default_regroup_wait_s(agent.settings.params)
        self.regroup_wait_s = regroup_wait_s
        self.keeper = StoreKeeper(agent.address[0])
        self._spec: GroupSpec | None = None
        """The last group this member tried to form (its attempt numbers the next regroup)."""

    def _apply(self, k: int, avg: torch.Tensor) -> None:
        """Apply step ``k`` with its averaged gradient ``avg``: the step loop's
        (:meth:`~.loop.Trainer._apply`); the commit rule's roll forward calls it."""
        raise NotImplementedError

    def _recover(self, exc: BaseException) -> None:
        failed_at = time.monotonic()  # the regroups below count against give_up_s too
        failed = isinstance(exc, CollectiveError)
        kind = "collective_failed" if failed else "superseded"
        self.log(kind, step=self.step, config_id=self.config_id, error=str(exc)[:160])
        if failed:
            self.agent.report_error(exc)
        if self.group is not None:
            self.group.abandon()
            self.group = None
        del exc
        tries = 0
        while failed and tries < MAX_REGROUPS:
            # A member's death is normally decided within the wait: the normal path.
            if self._await_change(within_s=self.regroup_wait_s) is not None:
                break
            tries += 1
            try:
                self._regroup()
                self.result.regroups += 1
                return
            except (CollectiveError, Superseded) as again:
                superseded = isinstance(again, Superseded)
                self.log("regroup_failed", step=self.step, config_id=self.config_id,
                         attempt=None if self._spec is None else self._spec.attempt,
                         superseded=superseded,
                         error=f"{type(again).__name__}: {again}"[:160])
                if self.group is not None:
                    self.group.abandon()
                    self.group = None
                if superseded:  # a configuration with another rank map came: it wins
                    break
        self._enter_until_in(self._await_change(since=failed_at))
        self.result.recoveries += 1

    def _regroup(self) -> None:
        """Form the group of the current configuration again (the next attempt), agree on the
        resume step with the other ranks and check the fingerprints (:mod:`.regroup`).

        Raises:
            CollectiveError: the rendezvous or an operation failed (a member did not come).
            Superseded: a configuration with another rank map arrived meanwhile.
            Diverged: the fingerprints differ (:meth:`_check_fingerprints`).
            RuntimeError: the ranks' states cannot be reconciled
                (a bug: never expected).
        """
        last = self._spec
        assert last is not None
        spec = replace(last, attempt=next_attempt(last.attempt))
        self._spec = spec
        c, a = self.config_id, spec.attempt
        reduced = -1 if self._reduced is None else self._reduced[0]
        self.log("regroup_started", config_id=c, group_id=spec.config_id, attempt=a,
                 rank=spec.rank, step=self.step, reduced=reduced)
        if spec.rank == 0:  # host the store first: the others look it up meanwhile
            self.agent.register_service(store_service(a), spec.config_id,
                                        self.keeper.host_store(spec.config_id, a).port)
        group = self.group = build_group(spec, self.agent, self.keeper, backend=self.backend,
                                         watch=self._watch)
        self.log("group_formed", config_id=c, group_id=spec.config_id, attempt=a,
                 rank=spec.rank, world_size=spec.world_size, seconds=group.formed_s)
        mine = torch.tensor([self.step, reduced], dtype=torch.int64)
        progress = [(int(p[0]), int(p[1]))
                    for p in group.allgather(mine, watch=self._watch)]
        top = max(applied for applied, _ in progress)
        for r in self._fill_gap(group, top):  # they hold step top - 1's gradient now
            progress[r] = (top - 1, top - 1)
        reduced = -1 if self._reduced is None else self._reduced[0]
        resume, why = regroup_resume(progress)
        if resume is None:
            group.abandon()
            raise RuntimeError(f"configuration {c}, regroup {a}: {why}")
        action, reason = resolve(self.step, None if reduced < 0 else reduced, resume)
        self.log("commit_rule", action=action, reason=reason, step=self.step,
                 resume_step=resume, config_id=c, attempt=a, regroup=why)
        if action == "roll_forward":
            assert self._reduced is not None
            self._apply(self._reduced[0], self._reduced[1])
            # A peer committed it (that is why we resume past it): tell the agent, as the
            # commit would have (its vote and the hang watchdog).
            self.agent.report_progress(resume - 1)
        elif action == "redo":
            self._reduced = None
        else:  # regroup_resume checked every rank can reach resume
            raise AssertionError(reason)
        mine_print = self._fingerprint()  # nobody fetches in a regroup: nothing to serve
        self._check_fingerprints(group, mine_print, f"configuration {c}, regroup {a}", resume)
        self.log("regroup_done", config_id=c, group_id=spec.config_id, attempt=a,
                 rank=spec.rank, step=resume, resume_step=resume, action=action,
                 fingerprint=mine_print.hex())

    def _enter_as_spare(self, change: Any) -> None:
        """Enter the newest configuration that changes the ranks since ``change`` (the one
        that gave this spare its rank), fetching the state."""
        self._drain_changes()
        self._enter_until_in(self._latest if self._changes_ranks() else change)

    def _enter_until_in(self, change: Any) -> None:
        """Enter the configuration of ``change``; when that fails (a source or a peer failed
        meanwhile, a newer configuration came) wait for the next one with another rank map
        and enter that. A promoted spare's first entry goes through here too."""
        while True:
            try:
                self._enter(change)
                return
            except (CollectiveError, Superseded, TransferError, Incomplete) as again:
                self.log("recovery_restarted", config_id=change.configuration.config_id,
                         error=f"{type(again).__name__}: {again}"[:160])
                if self.group is not None:
                    self.group.abandon()
                    self.group = None
            change = self._await_change()

    def _enter(self, change: Any) -> None:
        """Join the configuration of ``change`` at its ``resume_step``."""
        configuration, plan = change.configuration, change.plan
        resume = plan.resume_step
        self._log_change(change)
        if plan.action == "stop":
            vacant = list(configuration.vacant_ranks)
            self.log("job_stopped", config_id=configuration.config_id, vacant=vacant,
                     step=self.step)
            raise Stopped(f"configuration {configuration.config_id} stops the job: nobody can "
                          f"take ranks {vacant} (every holder of their state is gone, or no "
                          "spare is left under policy 'stop')")
        rank = configuration.rank_of(self.me)
        if rank is None:
            raise self._out(f"no rank in configuration {configuration.config_id}")
        assignments = dict(plan.assignments)
        assigned = assignments.get(rank) == self.me
        # Rank holders that receive nothing in this change: they held the state before it.
        kept = tuple(m for r, m in enumerate(configuration.ranks)
                     if m is not None and m != self.me and r not in assignments)
        if not (assigned or self._holds_state or kept):
            # Every member that held the state died while this spare, just promoted, still
            # fetched it; the plan's resume step then counts no holder's step. Training on
            # would roll back, or spread a half-received state: a job that exits 0 with other
            # weights. It stops instead.
            self.log("job_stopped", config_id=configuration.config_id, step=self.step,
                     resume_step=resume, reason="no member holds the state")
            raise Stopped(f"configuration {configuration.config_id}: no member holds the "
                          "state (every holder died before this member received it)")
        if configuration.vacant_ranks:
            self.log("waiting_for_spare", config_id=configuration.config_id,
                     vacant=list(configuration.vacant_ranks))
            # Seen: the wait that follows is for a newer rank map, not this one again (it
            # returned at once and re-entered this change in a tight loop).
            self.config_id, self._ranks = configuration.config_id, tuple(configuration.ranks)
            raise Incomplete(f"configuration {configuration.config_id} has vacant ranks "
                             f"{list(configuration.vacant_ranks)}")
        self.faults.at(resume, "enter", rank)
        if not self._holds_state:
            self._announce(configuration.config_id, serving=False)
        fetch_from = None
        if assigned:
            fetch_from = dict(plan.sources).get(rank, ())
        else:
            reduced = None if self._reduced is None else self._reduced[0]
            action, reason = resolve(self.step, reduced, resume)
            if not self._holds_state:
                action, reason = "fetch", "promoted, its fetch not completed"
            self.log("commit_rule", action=action, reason=reason, step=self.step,
                     resume_step=resume, config_id=configuration.config_id)
            if action == "roll_forward":
                assert self._reduced is not None
                self._apply(self._reduced[0], self._reduced[1])
            elif action == "redo":
                self._reduced = None
            else:
                fetch_from = kept
        self._enter_configuration(configuration, group_id=change.group_id, resume=resume,
                                  fetch_from=fetch_from, plan=plan)
        if assigned:
            # The console's one word of a recovery (the timeline is in TORCHPASS_LOG_DIR): one
            # write, as the launcher's children share its stderr.
            sys.stderr.write(f"torchpass_p2p: member {self.log.member} took rank {rank} at "
                             f"step {resume} (configuration {configuration.config_id})\n")
            sys.stderr.flush()

    def _enter_configuration(self, configuration: Any, *, group_id: int, resume: int,
                             fetch_from: tuple[int, ...] | None, plan: Any = None) -> None:
        """Reach ``resume`` (fetching from ``fetch_from`` if given: over TCP first, or over
        the group once formed), then build the group of configuration ``group_id`` (the first
        with this rank map, the same for every member:
        :class:`~torchpass_p2p.agent.Change`) and check the fingerprints."""
        snap = self._form(configuration, group_id=group_id, resume=resume,
                          fetch_from=fetch_from)
        self._settle(configuration, plan, resume, snap)

    def _form(self, configuration: Any, *, group_id: int, resume: int,
              fetch_from: tuple[int, ...] | None, behind: bool = False) -> Any:
        """The first half of :meth:`_enter_configuration`: reach ``resume`` (unless
        ``behind``: this member is one step short of it, inside that step, and serves
        nothing), build the group, agree on the job and fill the gap of members behind
        (:meth:`_fill_gap`). Returns the state served (a ``Snapshot``), or None when this
        member lacks it."""
        c = configuration.config_id
        spec = replace(GroupSpec.of(configuration, self.me), config_id=group_id)
        self._ranks = tuple(configuration.ranks)
        self._spec = spec
        if spec.rank == 0:  # host the store first: the others can connect while we fetch
            self.agent.register_service(store_service(), group_id,
                                        self.keeper.host_store(group_id).port)
        lacking = fetch_from is not None or behind
        restored = None
        if fetch_from is not None and not self.state_over_group:
            restored = self._fetch(fetch_from, c, resume)
            lacking = False
        snap = None
        if behind:
            self._announce(c, serving=False)  # a spare's lookup of it fails at once
        elif not lacking:
            if self.step != resume:
                raise RuntimeError(f"state after {self.step} steps, resume step {resume}")
            snap = self._publish(restored)
            self._announce(c)
        self.config_id = c
        self.log("state_ready" if snap is not None else
                 "state_behind" if behind else "state_lacking", config_id=c,
                 step=resume, fetched=fetch_from is not None)
        self.group = build_group(spec, self.agent, self.keeper, backend=self.backend,
                                 watch=self._watch)
        self.log("group_formed", config_id=c, group_id=group_id, rank=spec.rank,
                 world_size=spec.world_size, seconds=self.group.formed_s)
        if self._agree(self.group, configuration, resume) and snap is not None:
            snap = self._capture()  # the agreement changed the state (rank 0's broadcast)
        self._fill_gap(self.group, resume)
        return snap

    def _fill_gap(self, group: ManagedGroup, resume: int) -> tuple[int, ...]:
        """Called by every member once a group has formed (:meth:`_form`, :meth:`_regroup`):
        a member one step behind ``resume`` without that step's averaged gradient receives it
        here from one that holds it, and rolls forward with it. Returns the ranks that
        received it. The step loop's vote follows the whole all-reduce, so no survivor of it
        is ever behind without the gradient: nothing to do."""
        del group, resume
        return ()

    def _settle(self, configuration: Any, plan: Any, resume: int, snap: Any) -> None:
        """The second half of :meth:`_enter_configuration`: every member holds the state at
        ``resume`` (one that lacks it receives it over the group now, with
        ``state_over_group``); check the fingerprints and stop serving."""
        c, spec = configuration.config_id, self._spec
        assert self.group is not None and spec is not None
        if self.state_over_group:
            try:
                received = transfer_over_group(
                    self.group, configuration, plan, resume, snap, step=self.step,
                    into=self.objects, restore=self._restored_over_group, watch=self._watch,
                    on_served=self._served if self.faults.serving or self.history is not None
                    else None, log=self.log)
            except TransferError as exc:
                self._sources_disagree(exc, c, resume)
                raise
            snap = snap if snap is not None else received
        assert snap is not None  # a member lacking the state received it over the group
        mine = snap.fingerprint()
        self._check_fingerprints(self.group, mine, f"configuration {c}", resume)
        self._withdraw()
        self.log("joined", config_id=c, rank=spec.rank, step=resume, fingerprint=mine.hex())

    def _agree(self, group: ManagedGroup, configuration: Any, resume: int) -> bool:
        """Called once the group of a configuration has formed, before the fingerprints are
        compared: a subclass checks here that its members run the same job. Returns whether
        it changed the state. The step loop agrees on nothing more: False."""
        del group, configuration, resume
        return False
