"""One transport interface, two implementations (docs/design.md section 7).

A transfer has sources (every one holds the same snapshot) and one receiver. The source side
calls :meth:`Transport.provide`, the receiver :meth:`Transport.receive`; both take the same
:class:`TransferPlan`. Implementations:

* :class:`TcpTransport` (here): works before any process group exists; ``provide`` publishes
  to the member's :class:`TransferServer` and returns at once (the server keeps serving);
  ``receive`` is :func:`fetch` (striping, failover, a MAC over every chunk's bytes).
* ``pg_transport.PgTransport``: a process group's send/recv (gloo on CPU; NCCL where a group
  connects GPUs). ``provide`` returns once the receiver has verified every chunk (a source
  also sends the chunks of a source that died). A source that stalls ends the transfer with
  ``TransferFailed("no_progress")`` (gloo closes the group on a timed-out wait): the group
  must be abandoned (the trainer restarts recovery in the next configuration, with a new
  group).

``tests/transfer/conformance.py`` is the one suite both must pass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .auth import TransferKeys
from .client import PROGRESS_TIMEOUT_S, FetchResult, fetch
from .server import TransferServer
from .snapshot import Snapshot


@dataclass(frozen=True)
class TransferPlan:
    """Who sends to whom. ``sources``: TCP ``(host, port)`` pairs or process-group ranks, in
    the plan's order; ``receiver``: the receiving rank (process groups only). ``config_id``:
    the configuration the transfer belongs to (older ones are refused). ``step``: the step
    the state must be at, if known. ``expected_fingerprint``: the fingerprint the survivors
    agreed on, if known (else the sources' majority). ``progress_timeout_s``: seconds without
    progress before a source is given up."""

    sources: tuple[Any, ...]
    config_id: int
    receiver: Any = None
    step: int | None = None
    expected_fingerprint: bytes | None = None
    progress_timeout_s: float = PROGRESS_TIMEOUT_S


class Transport(ABC):
    """Moves one snapshot from its sources to a receiver, exactly."""

    name: ClassVar[str]

    @abstractmethod
    async def provide(self, snapshot: Snapshot, plan: TransferPlan) -> None:
        """Source side: make ``snapshot`` available to the plan's receiver."""

    @abstractmethod
    async def receive(self, plan: TransferPlan,
                      into: Snapshot | Mapping[str, Any] | None = None) -> FetchResult:
        """Receiver side: the verified snapshot, received in place into ``into``'s tensors
        where they match. Raises ``TransferFailed`` when no source can complete it."""


class TcpTransport(Transport):
    """TCP: ``server`` serves this member's published snapshot (may be ``None`` on a
    receive-only spare); ``keys`` authenticate; ``algo`` is the fingerprint's digest."""

    name = "tcp"

    def __init__(self, keys: TransferKeys, server: TransferServer | None = None, *,
                 algo: str = "xxh3") -> None:
        self.keys = keys
        self.server = server
        self.algo = algo

    async def provide(self, snapshot: Snapshot, plan: TransferPlan) -> None:
        if self.server is None:
            raise ValueError("this TcpTransport has no server to provide from")
        self.server.publish(snapshot)

    async def receive(self, plan: TransferPlan,
                      into: Snapshot | Mapping[str, Any] | None = None) -> FetchResult:
        return await fetch(list(plan.sources), self.keys, plan.config_id, into=into,
                           expected_fingerprint=plan.expected_fingerprint, step=plan.step,
                           algo=self.algo, progress_timeout_s=plan.progress_timeout_s)
