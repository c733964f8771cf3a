"""What the trainer's parts share: this member's agent, timeline and live objects, and the step
its state is at.

:class:`~.loop.Trainer` is built in layers, each a class in a module of its own that adds one
job to the layer below it:

* :class:`MemberBase` (here): the shared state below;
* :class:`~.changes.ChangeFollower`: following the agent's configuration changes, the waits,
  and the ends of a member that is out, fenced too long, or sees no majority left;
* :class:`~.exchange.StateExchange`: serving and fetching the training state, and checking
  that every member holds the same one;
* :class:`~.recovery.Recovery`: entering a configuration (the commit rule, the group) and
  regrouping after a failed collective;
* :class:`~.loop.Trainer`: the step loop with its commit vote, and the final barrier.

:class:`~torchpass_p2p.ddp.session.Session` subclasses the last and replaces its step.

Invariants of the shared state (every layer relies on them and keeps them):

* ``step`` counts the steps applied: the live objects hold the state after ``step`` steps and
  step ``step`` runs next. Only applying a step (the loop, or a roll forward) and restoring a
  fetched state change it.
* ``_reduced`` is ``(k, avg)``, ``k == step``: step ``k``'s averaged gradient, held from its
  all-reduce until the step is applied, redone, or replaced by a fetched state. It is what a
  roll forward applies; None when no reduction is held.
* ``_holds_state`` is False only for a spare that has not restored a fetched state yet: such a
  member never trains on, serves or fingerprints what its tensors hold.
* ``group`` is None or the group of the rank map ``_ranks``; ``config_id`` is the
  configuration this member trains in (its group's, or a newer one with the same ranks).
* ``_latest`` is the newest change the agent delivered (None before the first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from torchpass_p2p.agent import Change, TrainingAgent
from torchpass_p2p.collective import ManagedGroup

from .faults import FaultInjector
from .joblog import EventLog

__all__ = ["MemberBase", "TrainResult"]


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


class MemberBase:
    """The state the trainer's layers share (module docstring); not used on its own.

    Args:
        agent: this process's started agent (:class:`~torchpass_p2p.agent.TrainingAgent`).
        objects: the live objects whose state moves, ``{name: Stateful}``.
        seed: the job's seed.
        backend: ``"gloo"`` or ``"nccl"``.
        log_path: JSON-lines timeline (:mod:`.joblog`); None: no log.
        faults: fault injector (default: from ``TORCHPASS_FAULTS``).
    """

    def __init__(self, agent: TrainingAgent, *, objects: dict[str, Any], seed: int, backend: str,
                 log_path: str | os.PathLike[str] | None,
                 faults: FaultInjector | None) -> None:
        self.agent = agent
        self.seed = seed
        self.backend = backend
        self.objects = objects
        self.me: int = agent.member_id
        # What the status page shows of recoveries and transfers (the agent's History); an
        # agent without one (a stand-in) shows nothing.
        self.history = agent.history
        self.log = EventLog(log_path, self.me,
                            sink=None if self.history is None else self.history.record)
        self.faults = faults or FaultInjector.from_env(
            before=lambda f, **details: self.log("fault", kind=f.kind, step=f.step,
                                                 point=f.point, rank=f.rank,
                                                 seconds=f.seconds, fraction=f.fraction,
                                                 **details))
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
        self._latest: Change | None = None  # newest Change seen
        self._reduced: tuple[int, torch.Tensor] | None = None
        self.result = TrainResult(0)
