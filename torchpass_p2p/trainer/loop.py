"""The data-parallel step loop with the commit rule, and the spare's path into it.

A script adopts it in a few lines::

    agent = torchpass_p2p.start()
    model, optimizer = build()                 # spares build before they are needed
    trainer = Trainer(model, optimizer, agent=agent, scheduler=scheduler, seed=0)
    result = trainer.run(loss_fn, steps=200)   # loss_fn(step, rank) -> scalar loss tensor

Theory of operation (docs/design.md section 6 and 8).

* *Step k* (a rank): seed every generator from ``(seed, rank, k)``; forward and backward
  (``loss_fn``); the flattened gradient is averaged over the configuration's group, summed in
  rank order (bitwise independent of the backend's algorithm); a tiny commit all-reduce; the
  agent accepts ``k`` as committed; the optimizer (and scheduler) step. The agent refuses the
  commit once a decided change gave the ranks to others (this member's progress for that plan
  is fixed already; a group whose drained member is leaving can still commit): the step is
  not applied, and the commit rule settles it. A fenced member (no majority heard for its
  lease) votes against the commit in the commit all-reduce: nobody applies the step, and the
  ranks redo it once that member has its lease back, unless a change comes first.
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
  formed (:mod:`.group_transfer`: NVLink or RDMA on GPUs).
  A newer configuration during recovery restarts it.
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
* Changes that leave the rank map as it is (a spare joined or left) cost nothing: the group
  stays; only the services are announced under the new ``config_id``. A group is named after
  the first configuration of its rank map (``Change.group_id``), so that members that entered
  different configurations of one rank map (one was handed a change the other never was) meet
  in the same rendezvous.
* A member removed from the configuration (or fenced and then removed) stops at once with
  :class:`Removed`; it never writes to the new group.
* *No majority left.* A member fenced for ``give_up_s`` (the last resort, also counted during
  a group operation its peers never finish) that believes fewer than a majority of its
  configuration reachable stops with :class:`Stopped` and one line: how many of the
  configuration are reachable, how many a majority is, and that the job stops (resume it from
  the last checkpoint): no change can be decided without a majority, not even the admission
  of the processes restarted in the dead ones' place. One that still counts a majority
  reachable is the one cut off: :class:`Removed`, as before.
* A drained member (``torchpass-p2p drain``, a GPU fault, the hang watchdog: its agent has
  announced that it leaves) still holds its rank until the agreement decides the configuration
  without it, so it keeps training: leaving at once would fail its peers' collectives like a
  crash. The decision removes it and it stops with :class:`Drained`, a clean end; the spare
  taking its rank fetches the state from the survivors, who hold every step it committed.

The transferred state is rank-independent: model, optimizer, scheduler, ``extra`` objects, the
step and the data position (``step * world_size`` batches). Generators are not part of it: they
are a function of ``(seed, rank, step)``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from torchpass_p2p.agent.runtime import NotServed, Phase
from torchpass_p2p.collective import (
    CollectiveError,
    GroupSpec,
    ManagedGroup,
    StoreKeeper,
    Superseded,
    build_group,
    flatten,
    unflatten_into,
)
from torchpass_p2p.collective.rendezvous import store_service
from torchpass_p2p.core.messages import format_member_id
from torchpass_p2p.core.params import Params
from torchpass_p2p.launch.outcome import JOB_STOPS, no_majority_left
from torchpass_p2p.launch.plan import format_address
from torchpass_p2p.transfer import FetchResult, Snapshot, TransferError, TransferKeys

from .commit import resolve
from .events import EventLog
from .faults import FaultInjector
from .group_transfer import transfer_over_group
from .regroup import GIVE_UP_S, MAX_REGROUPS, next_attempt, regroup_resume
from .regroup import regroup_wait_s as default_regroup_wait_s
from .seeding import seed_step
from .service import StateService

__all__ = ["Drained", "Removed", "Stopped", "TrainResult", "Trainer"]

log = logging.getLogger(__name__)

TRANSFER_SERVICE = "transfer"
SLICE_S = 0.05
"""Seconds between checks of the agent while waiting for a configuration."""
WAIT_SLICE_S = 1.0
"""How often a waiting spare looks whether it is fenced (it wakes at once for a rank)."""
LOOKUP_TIMEOUT_S = 30.0
"""How long a spare waits for a source to announce its transfer server for the new
configuration (a survivor announces it once it holds the resume state: milliseconds after the
decision, plus any roll-forward)."""
LOOKUP_GRACE_S = 0.5
"""Once one source has announced, how much longer the others are waited for before the fetch
starts from those found. Survivors announce within milliseconds of each other; a source that
died after the decision, or a spare promoted earlier that is still fetching the state itself
(the plan names every rank holder), never does: waiting for every named source would stall
such a recovery for the full ``LOOKUP_TIMEOUT_S``. Ours."""
LOOKUP_SLICE_S = 0.25
"""Lookups run in rounds of this many seconds, with a look at the agent for a newer
configuration between rounds (each request is held by the source until it registers, so a
round costs no latency)."""
FETCH_ATTEMPTS = 5


class Removed(RuntimeError):
    """This member is no longer part of the training world (removed, or the agent stopped):
    stop at once and never touch a process group again. Scripts exit with code 3."""


class Incomplete(RuntimeError):
    """The configuration has vacant ranks (more ranks died than spares were left, under the
    ``wait`` policy): nobody trains in it; the members wait for the change that fills them
    (a spare joins, e.g. a process the launcher respawned with ``--respawn``)."""


class Stopped(RuntimeError):
    """The job cannot go on. Either the agreed plan stops it (action ``stop``,
    :mod:`torchpass_p2p.core.plan` rules 3 and 5): a vacant rank nobody can fill, because every
    holder of its state is gone (data parallel: every rank at once) or no spare is left under
    policy ``stop``; or no majority of the configuration is left (fenced for the trainer's
    ``give_up_s`` while it believes fewer than a majority of its configuration reachable: no
    change can be decided, not even the admission of a new process; the message says how
    many are left and how many a majority is); or a spare was not admitted, or cut off, for
    ``give_up_s``. No member trains again; resume from a checkpoint. Scripts exit with code
    5."""


class Drained(Removed):
    """This member was removed because it asked to leave (a drain): its rank went to a spare as
    planned. A clean end, not a failure: scripts exit with code 4
    (:data:`~torchpass_p2p.launch.outcome.EXIT_DRAINED`), which the launcher never counts as
    a failure."""


@dataclass
class TrainResult:
    """What :meth:`Trainer.run` returns.

    Attributes:
        steps: steps applied (the state is after this many steps).
        losses: mean loss over ranks per step this member ran, ``{step: loss}``.
        fingerprint: 32-byte fingerprint of the final state.
        rank: the rank this member held at the end (-1 before it held one).
        recoveries: configurations this member entered after the first.
        regroups: groups of the same configuration formed again after a collective failed
            with no member failing (:mod:`.regroup`).
    """

    steps: int
    losses: dict[int, float] = field(default_factory=dict)
    fingerprint: bytes = b""
    rank: int = -1
    recoveries: int = 0
    regroups: int = 0


class Trainer:
    """Data-parallel training that survives losing ranks (module docstring).

    Args:
        model: the replica (same on every member); gradients of its parameters (one dtype)
            are averaged.
        optimizer: steps the model's parameters.
        agent: this process's :class:`~torchpass_p2p.agent.api.Agent` (already started).
        scheduler: optional LR scheduler, stepped after each optimizer step.
        seed: the job's seed; step ``k`` of rank ``r`` draws from ``(seed, r, k)``.
        extra: more state to transfer, ``{name: Stateful}`` (rank-independent).
        backend: ``"gloo"`` or ``"nccl"``.
        state_transport: how a member that lacks the resume state gets it: ``"tcp"`` (the
            transfer servers, before the group forms), ``"pg"`` (the configuration's own group,
            once formed) or ``"auto"``: ``"pg"`` over NCCL, ``"tcp"`` over gloo (faster here:
            a MAC on every byte and a stalled source routed around; gloo closes the whole
            group on a timed-out wait).
        log_path: JSON-lines timeline (:mod:`.events`); None: no log.
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
                 agent: Any, scheduler: Any = None, seed: int = 0,
                 extra: Mapping[str, Any] | None = None, backend: str = "gloo",
                 state_transport: str = "auto",
                 log_path: str | os.PathLike[str] | None = None,
                 faults: FaultInjector | None = None,
                 regroup_wait_s: float | None = None,
                 give_up_s: float = GIVE_UP_S) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.agent = agent
        self.seed = seed
        self.backend = backend
        if state_transport not in ("auto", "tcp", "pg"):
            raise ValueError(f"state_transport {state_transport!r}: 'auto', 'tcp' or 'pg'")
        self.state_over_group = (state_transport == "pg"
                                 or (state_transport == "auto" and backend == "nccl"))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.objects: dict[str, Any] = {"model": model, "optimizer": optimizer}
        if scheduler is not None:
            self.objects["scheduler"] = scheduler
        self.objects.update(extra or {})
        self.me: int = agent.member_id
        # What the status page shows of recoveries and transfers (the agent's History); a
        # stand-in agent without one shows nothing.
        self.history = getattr(agent, "history", None)
        self.log = EventLog(log_path, self.me,
                            sink=None if self.history is None else self.history.record)
        self.faults = faults or FaultInjector.from_env(
            before=lambda f, **details: self.log("fault", kind=f.kind, step=f.step,
                                                 point=f.point, rank=f.rank,
                                                 seconds=f.seconds, fraction=f.fraction,
                                                 **details))
        if regroup_wait_s is None:
            params = getattr(getattr(agent, "settings", None), "params", None)
            regroup_wait_s = default_regroup_wait_s(
                params if isinstance(params, Params) else Params())
        self.regroup_wait_s = regroup_wait_s
        self.give_up_s = give_up_s
        self.keeper = StoreKeeper(agent.address[0])
        transfer_keys = TransferKeys.from_keyring(agent.settings.keyring)
        # A reloaded key file reaches the state transfer too (docs/running.md, "Keys").
        if hasattr(agent, "add_key_listener"):
            agent.add_key_listener(transfer_keys.rekey)
        self.service = StateService(
            transfer_keys, self._known_config_id,
            host=agent.address[0],
            on_served=self._served if self.faults.serving or self.history is not None
            else None)
        # Its refusals (bad input, floods) are drops of this member's: counted where its
        # others are, in the agent's /metrics and /status.
        agent.add_counter_source("transfer_refused", self.service.refusals)
        self.step = 0
        """Steps applied: the state is after this many steps; step ``self.step`` runs next."""
        self._holds_state = True
        """False for a spare until a fetched state is restored: a rank holder without it
        (its fetch failed) must never train on, or serve, what its tensors hold."""
        self.group: ManagedGroup | None = None
        self.config_id = -1
        """The configuration this member trains in (its group's, or newer with the same
        ranks)."""
        self._ranks: tuple[Any, ...] = ()
        self._spec: GroupSpec | None = None
        """The last group this member tried to form (its attempt numbers the next regroup)."""
        self._latest: Any = None  # newest Change seen
        self._reduced: tuple[int, torch.Tensor] | None = None
        self._draining = False  # the "draining" event is logged once
        self._fenced_since: float | None = None  # fenced without a break since (_watch)
        self.result = TrainResult(0)
        agent.on_change(self._wake_group)

    # ------------------------------------------------------------------ public

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

    # ------------------------------------------------------------------ steps

    def _begin(self) -> None:
        agent = self.agent
        self._log_start()
        if self._started_as_spare():
            self._enter_as_spare(self._await_first_rank())
            return
        started_in = agent.settings.configuration
        # Every rank enters the configuration it was started in, never "the current one": a
        # change decided while the ranks start up (a spare joined) would otherwise put them in
        # different groups' rendezvous. A later change arrives as usual (``_poll``).
        self.faults.at(0, "enter", started_in.rank_of(self.me))
        self._enter_configuration(started_in, group_id=started_in.config_id, resume=0,
                                  fetch_from=None)

    def _log_start(self) -> None:
        """The ``start`` record: this member's role, configuration, rank and addresses."""
        agent = self.agent
        status = agent.status_address
        self.log("start", role=agent.role, config_id=agent.config_id, rank=agent.rank,
                 address=format_address(agent.address),
                 status=None if status is None else format_address(status))

    def _started_as_spare(self) -> bool:
        """Started as a spare (or joining: a late spare), judged by the configuration it was
        started in, not by its role now: a slow start may find it already holding a dead
        rank's place in a later configuration; it takes the spare's way in all the same."""
        started_in = self.agent.settings.configuration
        return started_in is None or self.agent.member_id not in started_in.ranks

    def _await_first_rank(self) -> Any:
        """A spare's wait for its first rank (:meth:`_wait_for_rank`); returns that change."""
        self.log("spare_waiting", config_id=self.agent.config_id)
        self._holds_state = False
        change = self._wait_for_rank()
        self._latest = change
        return change

    def _enter_as_spare(self, change: Any) -> None:
        """Enter the newest configuration that changes the ranks since ``change`` (the one
        that gave this spare its rank), fetching the state."""
        self._drain_changes()
        self._enter_until_in(self._latest if self._changes_ranks() else change)

    def _wait_for_rank(self) -> Any:
        """A spare's wait for a rank, as long as it takes while the job lives. A spare that
        for ``give_up_s`` has reached no majority of its configuration (fenced: the job lost
        its majority, or this host its network) or has not been admitted (still joining:
        nobody decides its join) stops with :class:`Stopped`, and its launcher respawns
        nobody for it."""
        agent, stuck_since, was_fenced = self.agent, None, False
        while True:
            try:
                return agent.wait_for_rank(timeout_s=WAIT_SLICE_S)
            except TimeoutError:
                pass
            except Exception as exc:  # removed: a drained spare ends as Drained, not respawned
                raise self._out(f"no rank for this spare: {exc}") from None
            now, fenced = time.monotonic(), agent.fenced
            if fenced and not was_fenced:
                self.log("fenced", step=self.step, config_id=agent.config_id)
            was_fenced = fenced
            if not fenced and agent.role != "joining":
                stuck_since = None
            elif stuck_since is None:
                stuck_since = now
            elif now - stuck_since > self.give_up_s:
                lost = self._no_majority_left() if fenced else None
                why = str(lost) if lost is not None else (
                    f"no majority of configuration {agent.config_id} reachable" if fenced
                    else "not admitted") + f" for {self.give_up_s:g} s"
                self.log("gave_up", config_id=agent.config_id, reason=why)
                raise lost if lost is not None else Stopped(why)

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

    def _await_lease(self) -> None:
        """After a vetoed commit or final barrier: wait while this member is fenced. A member on
        the minority side of a partition stays fenced until the change that removes it
        (:class:`Superseded`); one that was merely paused (woken from SIGSTOP into a change
        decided at that moment, before its first probe was answered) regains its lease within
        a probe round, and the step (or barrier) is redone. Waiting for a change there would
        wait for one that never comes. The group stays: no operation failed. Raises
        :class:`Removed` after ``give_up_s``."""
        since = time.monotonic()
        while self.agent.fenced:
            if self._poll():
                raise Superseded
            if time.monotonic() - since > self.give_up_s:
                raise self._gave_up(f"fenced for {self.give_up_s:g} s after a vetoed commit")
            time.sleep(SLICE_S)

    def _apply(self, k: int, avg: torch.Tensor) -> None:
        unflatten_into(avg, self.params)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step = k + 1
        self._reduced = None

    def _capture(self) -> Snapshot:
        """The state at ``self.step`` (no copy of host memory)."""
        return Snapshot.capture(self.objects, self.step, self._metadata())

    def _fingerprint(self) -> bytes:
        """The fingerprint of the state at ``self.step`` (32 bytes)."""
        return self._capture().fingerprint()

    def _publish(self, snap: Snapshot | None = None) -> Snapshot:
        """Serve the state at ``self.step``: host tensors as they are in memory, GPU tensors
        copied to the host (a copy after every step cost 30 ms per 300 MB here, and on a GPU
        the whole state). Only at a configuration's entry, where this member waits for the
        group: every member that needs the state fetches before it joins, so nothing is
        trained on while it is served; :meth:`_withdraw` once everyone has joined. ``snap``:
        that state, already captured (a fetch's check captured it)."""
        snap = snap if snap is not None else self._capture()
        self.service.publish(snap)
        return snap

    def _withdraw(self) -> None:
        """Stop serving: every member of the group holds the state, and training is about
        to change the memory the snapshot refers to."""
        self.service.publish(None)

    def _metadata(self) -> dict[str, Any]:
        world = len(self._ranks)
        return {"seed": self.seed, "world_size": world, "data_position": self.step * world}

    # ------------------------------------------------------------------ configurations

    def _served(self, step: int, served_bytes: int, total_bytes: int) -> None:
        """The transfer server sent a chunk (its thread): the status page's progress, and a
        ``serve`` fault may fire."""
        if self.history is not None:
            self.history.transfer_progress("sending", step, served_bytes, total_bytes)
        if not self.faults.serving:
            return
        ranks = self._ranks
        self.faults.served(step, served_bytes, total_bytes,
                           ranks.index(self.me) if self.me in ranks else None)

    def _known_config_id(self) -> int:
        latest = self._latest
        return max(self.config_id, latest.configuration.config_id if latest else -1, 0)

    def _drain_changes(self) -> None:
        while (change := self.agent.next_change(0)) is not None:
            self._take(change)

    def _take(self, change: Any) -> None:
        if self._latest is None or change.configuration.config_id > \
                self._latest.configuration.config_id:
            self._latest = change

    def _changes_ranks(self) -> bool:
        latest = self._latest
        return (latest is not None and latest.configuration.config_id > self.config_id
                and tuple(latest.configuration.ranks) != self._ranks)

    def _poll(self) -> bool:
        """Take in the agent's changes; True when the newest one changes the rank map (the
        group must be rebuilt). Raises :class:`Removed` if this member was removed,
        ``RuntimeError`` if its agent failed.

        A draining member (role ``leaving``) trains on: it holds its rank until the decision
        that removes it (module docstring)."""
        self._drain_changes()
        role = self.agent.role
        if role == "failed":  # it stopped as if crashed; its log says why
            raise RuntimeError("this member's agent failed: the member is being replaced")
        draining = self.agent.draining
        if role == "removed" or (role == "leaving" and not draining):
            raise self._out(f"this member is {role}")
        if draining and not self._draining:
            self._draining = True
            self.log("draining", step=self.step, config_id=self.config_id, role=role)
        if self._changes_ranks():
            return True
        latest = self._latest
        if latest is not None and latest.configuration.config_id > self.config_id:
            self._log_change(latest, same_ranks=True)
            # Same ranks: keep the group (a spare still without the state serves none).
            self._announce(latest.configuration.config_id, serving=self._holds_state)
            self.config_id = latest.configuration.config_id
        return False

    def _out(self, why: str) -> Removed:
        """The end of a member out of the configuration: :class:`Drained` when it asked for it."""
        return Drained(f"{why} (drained)") if self.agent.draining else Removed(why)

    def _watch(self) -> bool:
        """Between the wait slices of a group operation: True when a newer configuration is
        due. Raises what :meth:`_gave_up` gives once this member has been fenced for
        ``give_up_s`` without a break (peers paused or dead with no majority left: nothing
        else would end the operation before the backend's 30-minute timeout)."""
        if self._poll():
            return True
        now = time.monotonic()
        if not self.agent.fenced:
            self._fenced_since = None
        elif self._fenced_since is None:
            self._fenced_since = now
        elif now - self._fenced_since > self.give_up_s:
            raise self._gave_up(f"fenced for {self.give_up_s:g} s in a collective operation")
        return False

    def _no_majority_left(self) -> Stopped | None:
        """The end of a fenced member that believes fewer than a majority of its configuration
        reachable: no change can be decided unless enough of the others come back, so the job
        stops; its one line says how many are left and how many a majority is
        (:func:`~torchpass_p2p.launch.outcome.no_majority_left`, the launcher's wording).
        None when it reaches a majority by count (it is the one cut off)."""
        agent = self.agent
        members, reachable = len(agent.configuration), agent.reachable
        if reachable >= agent.majority:
            return None
        return Stopped(f"{no_majority_left(agent.config_id, reachable, members, 'reachable')}; "
                       f"fenced for {self.give_up_s:g} s, {JOB_STOPS}")

    def _gave_up(self, why: str) -> Removed | Stopped:
        """The last resort after ``give_up_s``: :class:`Stopped` with the counts when no
        majority is left (:meth:`_no_majority_left`), else :class:`Removed` with ``why`` (cut
        off, or a collective failure nothing repaired: the others go on without it)."""
        lost = self._no_majority_left() if self.agent.fenced else None
        if lost is not None:
            self.log("gave_up", config_id=self.agent.config_id, reason=str(lost))
            return lost
        return Removed(why)

    def _wake_group(self, _change: Any) -> None:
        """On the agent's thread, for every ready change: the group's operation in flight
        runs :meth:`_watch` at once (a survivor stuck with a paused peer learns of the
        change that replaces it then, not up to a wait slice later)."""
        group = self.group
        if group is not None:
            group.wake()

    def _announce(self, config_id: int, *, serving: bool = True) -> None:
        """Tell peers where this member serves its state for ``config_id``, or (``serving``
        False: it holds none yet) that it serves none there: their lookups fail at once."""
        self.agent.register_service(TRANSFER_SERVICE, config_id,
                                    self.service.port if serving else 0)

    def _await_change(self, within_s: float | None = None, *,
                      since: float | None = None) -> Any:
        """Block until the agent delivers a configuration with another rank map and return
        it; None when ``within_s`` seconds passed first. Raise :class:`Removed` once
        ``give_up_s`` passed since ``since`` (``time.monotonic()`` of the failure that started
        the wait; default: now), the last resort."""
        waited = time.monotonic()
        give_up_at = (waited if since is None else since) + self.give_up_s
        fenced = False
        while not self._poll():
            if self.agent.fenced and not fenced:  # say why nothing moves (once per wait)
                fenced = True
                self.log("fenced", step=self.step, config_id=self.config_id)
                log.warning("member %s: fenced at step %d (no majority of configuration %d "
                            "reachable); waiting for a decided configuration", self.log.member,
                            self.step, self.config_id)
            # Block on the agent's next change, not a sleep: the decision that ends this wait
            # is in the recovery's critical path (a 50 ms sleep cost 25 ms per fault).
            if (change := self.agent.next_change(SLICE_S)) is not None:
                self._take(change)
            if within_s is not None and time.monotonic() - waited > within_s:
                return None
            if time.monotonic() > give_up_at:
                raise self._gave_up(f"no new configuration for {self.give_up_s:g} s after a "
                                    "collective failure")
        return self._latest

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
            RuntimeError: the ranks' states cannot be reconciled, or fingerprints differ
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
            # would roll back, or spread a half-received state (found by a chaos run: exit 0
            # with other weights).
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

    def _enter_configuration(self, configuration: Any, *, group_id: int, resume: int,
                             fetch_from: tuple[int, ...] | None, plan: Any = None) -> None:
        """Reach ``resume`` (fetching from ``fetch_from`` if given: over TCP first, or over
        the group once formed), then build the group of configuration ``group_id`` (the first
        with this rank map, the same for every member:
        :class:`~torchpass_p2p.agent.runtime.Change`) and check the fingerprints."""
        c = configuration.config_id
        spec = replace(GroupSpec.of(configuration, self.me), config_id=group_id)
        self._ranks = tuple(configuration.ranks)
        self._spec = spec
        if spec.rank == 0:  # host the store first: the others can connect while we fetch
            self.agent.register_service(store_service(), group_id,
                                        self.keeper.host_store(group_id).port)
        lacking = fetch_from is not None
        restored = None
        if fetch_from is not None and not self.state_over_group:
            restored = self._fetch(fetch_from, c, resume)
            lacking = False
        snap = None
        if not lacking:
            if self.step != resume:
                raise RuntimeError(f"state after {self.step} steps, resume step {resume}")
            snap = self._publish(restored)
            self._announce(c)
        self.config_id = c
        self.log("state_ready" if snap is not None else "state_lacking", config_id=c,
                 step=resume, fetched=fetch_from is not None)
        self.group = build_group(spec, self.agent, self.keeper, backend=self.backend,
                                 watch=self._watch)
        self.log("group_formed", config_id=c, group_id=group_id, rank=spec.rank,
                 world_size=spec.world_size, seconds=self.group.formed_s)
        if self._agree(self.group, configuration, resume) and snap is not None:
            snap = self._capture()  # the agreement changed the state (rank 0's broadcast)
        if self.state_over_group:
            received = transfer_over_group(
                self.group, configuration, plan, resume, snap, step=self.step,
                into=self.objects, restore=self._restored_over_group, watch=self._watch,
                on_served=self._served if self.faults.serving or self.history is not None
                else None, log=self.log)
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

    def _check_fingerprints(self, group: ManagedGroup, mine: bytes, what: str,
                            resume: int) -> None:
        """All-gather the 32-byte state fingerprints over ``group``; abandon it and raise
        ``RuntimeError`` (naming ``what``) unless every member's equals ``mine``."""
        prints = group.allgather(torch.frombuffer(bytearray(mine), dtype=torch.uint8),
                                 watch=self._watch)
        every = {bytes(p.tolist()) for p in prints}
        if every != {mine}:
            group.abandon()
            raise RuntimeError(f"{what}: state fingerprints differ at step {resume}: "
                               f"{sorted(f.hex()[:16] for f in every)}")

    def _fetch(self, members: tuple[int, ...], config_id: int, step: int) -> Snapshot:
        if not members:
            raise RuntimeError(f"no state source for configuration {config_id}")
        t0 = time.monotonic()
        self.log("fetch_started", config_id=config_id, step=step, sources=len(members))
        last: Exception | None = None
        for _ in range(FETCH_ATTEMPTS):
            found, withheld = self._find_sources(members, config_id)
            addresses = list(found)
            if not addresses and withheld == set(members):
                # Every source is a spare promoted before it received the state (their
                # sources died meanwhile): nobody can ever hand it on. Waiting for the next
                # change would wait, up to give_up_s, for one that no failure brings.
                self.log("job_stopped", config_id=config_id, step=self.step,
                         resume_step=step, reason="no member holds the state")
                raise Stopped(f"configuration {config_id}: no member holds the state (its "
                              "holders are spares promoted before they received it)")
            if not addresses:
                raise TransferError("no_sources", f"no source announced state for {config_id}")
            try:
                result = self.service.fetch(addresses, config_id, step=step, into=self.objects,
                                            on_progress=self._fetch_progress(config_id, step))
                break
            except TransferError as exc:
                # Kept without its traceback, whose frames would hold this attempt's locals
                # through the next attempt (the client clears its own; this covers the rest).
                last = exc.with_traceback(None)
                self.log("fetch_retry", config_id=config_id, error=str(exc)[:160])
                if self._poll():
                    raise Superseded from None
                time.sleep(0.2)
        else:
            assert last is not None
            raise last
        return self._restored(result, config_id, time.monotonic() - t0, len(addresses),
                              {format_member_id(found[a]): n
                               for a, n in result.bytes_by_source.items()})

    def _fetch_progress(self, config_id: int, step: int
                        ) -> Callable[[int, int], None] | None:
        """The status page's view of a fetch as chunks arrive (the service's thread)."""
        history = self.history
        if history is None:
            return None
        return lambda received, total: history.transfer_progress(
            "receiving", step, received, total, config_id)

    def _find_sources(self, members: tuple[int, ...], config_id: int
                      ) -> tuple[dict[Any, int], set[int]]:
        """Where ``members`` serve the state of ``config_id``: ``{(host, port): member}``, and
        the members that announced they serve none there (they hold no state). Waits for
        every other member to announce, but at most :data:`LOOKUP_GRACE_S` after the first
        did, and at most :data:`LOOKUP_TIMEOUT_S` in all. Raises :class:`Superseded` when a
        newer configuration changes the ranks meanwhile."""

        def lookup(member: int, timeout_s: float) -> tuple[str, int] | None:
            try:
                return self.agent.lookup_service(member, TRANSFER_SERVICE, config_id,
                                                 timeout_s=timeout_s)
            except NotServed:
                withheld.add(member)
                return None
            except Exception:  # noqa: BLE001 - not (yet) announced: asked again, or skipped
                return None

        found: dict[Any, int] = {}
        withheld: set[int] = set()
        pending = list(members)
        give_up_at = time.monotonic() + LOOKUP_TIMEOUT_S
        with ThreadPoolExecutor(len(members)) as pool:
            while pending:
                round_s = min(LOOKUP_SLICE_S, give_up_at - time.monotonic())
                if round_s <= 0:
                    break
                answers = list(pool.map(lookup, pending, [round_s] * len(pending)))
                for member, address in zip(pending, answers, strict=True):
                    if address is not None:
                        found[address] = member
                pending = [m for m, a in zip(pending, answers, strict=True)
                           if a is None and m not in withheld]
                if found and pending:
                    give_up_at = min(give_up_at, time.monotonic() + LOOKUP_GRACE_S)
                self._drain_changes()  # not _poll: nothing here may act on a same-rank change
                if self._changes_ranks():
                    raise Superseded
        return found, withheld

    def _restored_over_group(self, result: FetchResult, config_id: int, total_s: float,
                             sources: tuple[int, ...]) -> Snapshot:
        """:meth:`_restored` for a state received over the group from ranks ``sources``."""
        return self._restored(result, config_id, total_s, len(sources),
                              {f"rank {s}": n for s, n in result.bytes_by_source.items()},
                              over_group=True)

    def _restored(self, result: FetchResult, config_id: int, total_s: float, sources: int,
                  served_by: dict[str, int], **details: Any) -> Snapshot:
        """Load a fetched state into the live objects and check its fingerprint; returns the
        restored state as captured for that check. Raises ``RuntimeError`` if the state does
        not load into the live objects or the restored state's fingerprint differs from the
        sources'."""
        try:
            got_step, _metadata = result.snapshot.restore(self.objects)
        except (KeyError, ValueError) as e:
            raise RuntimeError(f"the received state does not load into this process's objects "
                               f"({e}): do all members build the same model, optimizer and "
                               "scheduler?") from e
        self.step = got_step
        self._reduced = None
        mine = self._capture()
        own = mine.fingerprint()
        self.log("state_fetched", config_id=config_id, step=got_step, seconds=result.seconds,
                 bytes=result.snapshot.total_bytes, sources=sources,
                 fingerprint=result.fingerprint.hex(), restored_fingerprint=own.hex(),
                 failures=dict(result.failures), total_s=total_s, served_by=served_by,
                 refetched_chunks=result.refetched_chunks, **details)
        if own != result.fingerprint:
            raise RuntimeError("the restored state's fingerprint differs from the sources'")
        self._holds_state = True
        if got_step > 0:
            # It holds every step up to got_step - 1 as committed: its vote must say so, or a
            # plan made after the last other holder died would resume at step 0 (a replaced
            # spare has committed nothing itself), below the only state left.
            self.agent.report_progress(got_step - 1)
        return mine

    def _log_change(self, change: Any, *, same_ranks: bool = False) -> None:
        """The ``change`` event: the plan this member follows, with its hash (every member of
        the configuration must log the same one). ``same_ranks``: the group is kept."""
        alerts = []
        try:
            for e in self.agent.status()["recent_events"]:
                if e["type"] in ("MemberSuspected", "AlertRaised", "MemberDead", "MemberLeft"):
                    alerts.append(e["at"])
        except Exception:  # noqa: BLE001 - status is only for the timeline
            pass
        plan = change.plan
        self.log("change", config_id=change.configuration.config_id,
                 plan_hash=f"{plan.hash:016x}", decided_at=change.decided_at,
                 ready_at=change.ready_at,
                 resume_step=plan.resume_step, removed=[format_member_id(m) for m in plan.removed],
                 joined=[format_member_id(m) for m in plan.joined],
                 assignments=[[r, format_member_id(m)] for r, m in plan.assignments],
                 same_ranks=same_ranks, alerts_at=alerts)

    # ------------------------------------------------------------------ the end

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
        self.result.steps = self.step
        self.result.rank = group.spec.rank
        self.result.fingerprint = self._fingerprint()
        self.log("finished", step=self.step, config_id=self.config_id,
                 fingerprint=self.result.fingerprint.hex())

    def _close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.keeper.close()
        self.service.close()
        self.log.close()
