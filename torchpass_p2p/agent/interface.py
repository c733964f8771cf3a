"""What the training layers use of this process's agent: :class:`TrainingAgent`, and the typed
records it hands them (:class:`AgentEvent`).

:mod:`torchpass_p2p.trainer` and :mod:`torchpass_p2p.ddp` reach the agent only through
:class:`TrainingAgent`; :class:`~.api.Agent` satisfies it structurally (mypy checks that at the
end of this module), and the tests drive the trainer with stand-ins that have the same members.
A member the training layers start to use is added here first, so that both stay in step.

Imports nothing at run time beyond the core's events: the simulator and the launcher import
the agent package, and must not load the runtime (or torch) through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torchpass_p2p.core import events as ev

if TYPE_CHECKING:
    from torchpass_p2p.core.configuration import Address, Configuration
    from torchpass_p2p.core.messages import MemberId
    from torchpass_p2p.core.seal import Keyring

    from .api import Agent
    from .history import History
    from .runtime import Change
    from .settings import AgentSettings

__all__ = ["ACCUSATIONS", "AgentEvent", "TrainingAgent"]

ACCUSATIONS = frozenset(kind.__name__ for kind in (
    ev.MemberSuspected, ev.AlertRaised, ev.MemberDead, ev.MemberLeft))
"""The ``type`` of the events that accuse a member: the first alert or suspicion of it, its
confirmed death, its leaving. The same kinds mark a recovery's *detected* phase in the agent's
:class:`~.history.History`; they are named after the core's classes so that a renamed event
fails here, at import, rather than matching nothing."""


@dataclass(frozen=True, slots=True)
class AgentEvent:
    """One of the agent's recent events, as ``/status`` lists them (``recent_events``).

    Attributes:
        at: when it happened, the agent's clock (CLOCK_MONOTONIC seconds, the clock of the
            trainer's timeline too).
        type: the name of the core's event class (:mod:`torchpass_p2p.core.events`), or one
            the runtime adds of its own (``HangDetected``, ``HealthFault``).
        detail: its fields, in words, as ``/status`` shows them.
    """

    at: float
    type: str
    detail: str

    @property
    def accuses(self) -> bool:
        """True for an event that accuses a member (:data:`ACCUSATIONS`)."""
        return self.type in ACCUSATIONS

    @classmethod
    def from_status(cls, record: Mapping[str, Any]) -> AgentEvent:
        """The event of one entry of ``/status``'s ``recent_events``.

        Raises:
            KeyError: ``at``, ``type`` or ``detail`` is missing.
            ValueError, TypeError: ``at`` is not a number.
        """
        return cls(float(record["at"]), str(record["type"]), str(record["detail"]))


class TrainingAgent(Protocol):
    """The agent as the trainer and the DDP session see it: every member they use, and only
    those. Any thread may use any of them; what they return is an immutable value, or (the
    history) thread-safe. The full documentation of each is on :class:`~.api.Agent`."""

    @property
    def settings(self) -> AgentSettings:
        """What the agent was started with; the trainer reads ``configuration`` (configuration
        0, None for a process that joined as a spare), ``keyring`` and ``params``."""

    @property
    def member_id(self) -> MemberId:
        """This member's id, an unsigned 64-bit integer."""

    @property
    def configuration(self) -> Configuration:
        """The current configuration."""

    @property
    def config_id(self) -> int:
        """The current configuration's id."""

    @property
    def role(self) -> str:
        """``rank``, ``spare``, ``joining``, ``leaving``, ``removed`` or ``failed``."""

    @property
    def rank(self) -> int | None:
        """This member's rank in the current configuration; None for a spare."""

    @property
    def fenced(self) -> bool:
        """True while this member must not train: quorum lost, or removed."""

    @property
    def reachable(self) -> int:
        """Members of the current configuration believed reachable, this one included."""

    @property
    def majority(self) -> int:
        """Members of the current configuration a decision needs: ``floor(N / 2) + 1``."""

    @property
    def draining(self) -> bool:
        """True once this member asked to hand its rank to a spare."""

    @property
    def address(self) -> Address:
        """(host, port) of the agent's sockets; the trainer serves on the same host."""

    @property
    def status_address(self) -> Address | None:
        """(host, port) of the HTTP status page; None when disabled."""

    @property
    def history(self) -> History | None:
        """Where the trainer's timeline records go for ``/status``; None: nowhere (a
        stand-in without a status page)."""

    def recent_events(self, timeout_s: float = 5.0) -> Sequence[AgentEvent]:
        """The agent's recent events, oldest first (the last 64).

        Raises:
            TimeoutError: the agent did not answer within ``timeout_s`` seconds.
            AgentError: the agent is not running.
        """

    def report_progress(self, step: int, phase: str = ...) -> None:
        """The training loop reached ``phase`` (:class:`~.runtime.Phase`, default
        ``committed``) of ``step``. Never blocks."""

    def report_commit(self, step: int, ranks: tuple[int | None, ...],
                      timeout_s: float = ...) -> bool:
        """True when the commit vote of ``step`` in the group of rank map ``ranks`` may be
        applied."""

    def report_error(self, exc: BaseException, *, peer_rank: int | None = None) -> None:
        """A collective failed with ``exc``: fast evidence."""

    def drain(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Ask to hand this member's rank to a spare; the agent's reply."""

    def register_service(self, name: str, config_id: int, port: int) -> None:
        """Announce ``port`` for ``name`` in ``config_id`` (0: not served there)."""

    def lookup_service(self, member: int, name: str, config_id: int, *,
                       timeout_s: float = 30.0) -> Address:
        """(host, port) where ``member`` serves ``name`` for ``config_id``.

        Raises:
            NotServed: ``member`` announced it as not served.
            TransportError: not announced within ``timeout_s`` seconds.
        """

    def add_counter_source(self, name: str, read: Callable[[], Mapping[str, int]]) -> None:
        """Show the counts ``read()`` returns in ``/status`` and ``/metrics`` under ``name``.

        Raises:
            KeyError: ``name`` is not one of :data:`~.runtime.COUNTER_SOURCES`.
        """

    def add_key_listener(self, listener: Callable[[Keyring], None]) -> None:
        """Call ``listener(keyring)`` with each keyring a reload of the key file installs."""

    def next_change(self, timeout_s: float | None = None) -> Change | None:
        """The next ready change, oldest first; None if none came within ``timeout_s``
        seconds."""

    def wait_for_rank(self, timeout_s: float | None = None) -> Change:
        """For a spare: the change that gives it a rank, or stops the job.

        Raises:
            TimeoutError: no rank within ``timeout_s`` seconds.
            AgentError: this member was removed, or the agent stopped.
        """

    def on_change(self, callback: Callable[[Change], None]) -> None:
        """Call ``callback(change)`` on the agent's thread for every ready change."""

    def stop(self, *, leave: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the agent (a graceful leave first when ``leave``); idempotent."""


if TYPE_CHECKING:
    def _agent_is_a_training_agent(agent: Agent) -> TrainingAgent:
        """Never called: mypy proves here that :class:`~.api.Agent` has every member of
        :class:`TrainingAgent`, typed compatibly."""
        return agent
