"""Pulses at the agent: this process's pulse responder, and the prober pointed at the core's
subjects (the mechanism is :mod:`..pulse` and :mod:`..pulse_wire`; docs/design.md section 4).

The responder is registered in the service directory as :data:`PULSE_SERVICE` under
configuration 0; an observer looks each new subject's port up there (one owned task per
subject, at most K per configuration change) and points its prober at the ports found. A
subject found silent is handed back (``on_silent``), and the runtime reports it to the core.

What must stay true: the prober watches exactly the current subjects whose port was found (a
lookup is cancelled when its member stops being a subject), and a subject with no responder is
still watched by the core's probes alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from torchpass_p2p.core.configuration import Address
from torchpass_p2p.core.membership import Member
from torchpass_p2p.core.messages import MemberId, format_member_id
from torchpass_p2p.tasks import OwnedTasks

from ..pulse import PulseProber
from ..pulse_wire import PulseResponder
from ..pulse_wire import available as pulse_available
from ..transport import TransportError

__all__ = ["PULSE_LABEL", "PULSE_LOOKUP_S", "PULSE_RELOOKUP_S", "PULSE_SERVICE", "PulseWatch"]

log = logging.getLogger("torchpass_p2p.agent")

PULSE_SERVICE = "pulse"
"""The service name of a member's pulse responder, registered under configuration 0 (it serves
every configuration of the process)."""
PULSE_LOOKUP_S = 5.0
"""How long an observer asks a new subject for its pulse port. A member without a responder
(not built) is answered "not registered" after ``SERVICE_HOLD_S``; it is watched the old way
meanwhile, and asked again after ``PULSE_RELOOKUP_S``."""
PULSE_RELOOKUP_S = 10.0
"""Pause before asking a subject whose pulse port was not found again (it may have been stopped
or starting): one held request per observer and subject every ~11 s at most."""
PULSE_LABEL = b"torchpass_p2p pulse v1"
"""HKDF label of the pulse secrets (``Keyring.derive_secrets``)."""

Lookup = Callable[..., Awaitable[Address]]
"""``lookup(member, name, config_id, *, timeout_s)``: the runtime's ``lookup_service``."""


class PulseWatch:
    """The responder and the prober of one agent, and the lookups of its subjects' ports.

    Args:
        member_id: this member.
        keyring: the keys at start (their pulse secrets are derived here, :data:`PULSE_LABEL`).
        clock: monotonic seconds.
        tasks: the runtime's task owner; the lookups run in it.
        member: the core, or None before it runs (asked at each use).
        lookup: finds a member's service port (the runtime's ``lookup_service``).
        register: registers a service port (the runtime's ``register_service``).
        on_silent: called with a subject the prober found silent, on the loop.
        key_for: the key id a peer's datagrams last came under (the transport's).
    """

    def __init__(self, member_id: MemberId, keyring: Any, *, clock: Callable[[], float],
                 tasks: OwnedTasks, member: Callable[[], Member | None], lookup: Lookup,
                 register: Callable[[str, int, int], None],
                 on_silent: Callable[[MemberId], None],
                 key_for: Callable[[MemberId], int]) -> None:
        self.member_id = member_id
        self.responder: PulseResponder | None = None
        """This process's pulse responder (started and built), else None."""
        self.prober: PulseProber | None = None
        """The prober of this member's subjects (started), else None."""
        self.lookups: dict[MemberId, asyncio.Task[None]] = {}
        """Subject -> its port lookup, while one runs."""
        self._ports: dict[MemberId, int | None] = {}
        """Subjects' pulse ports as looked up (None: not found yet)."""
        self._watched: tuple[int, tuple[MemberId, ...]] | None = None
        self._secrets = keyring.derive_secrets(PULSE_LABEL)
        """Key id -> pulse secret, for the responder and the prober alike."""
        self._clock = clock
        self._tasks = tasks
        self._member = member
        self._lookup = lookup
        self._register = register
        self._on_silent = on_silent
        self._key_for = key_for

    def start_responder(self, host: str) -> None:
        """Start this process's pulse responder on ``host`` and register its port (before
        joining: observers look it up as soon as we are in a configuration). Without the native
        responder, says so and starts nothing."""
        if not pulse_available():
            log.warning("pulse responder not built (./scripts/build-native): a stopped or "
                        "vanished member is removed after the 3.1 s a stalled one is owed")
            return
        self.responder = PulseResponder.start(host, self.member_id, self._secrets)
        self._register(PULSE_SERVICE, 0, self.responder.port)

    async def start_prober(self, host: str, primary_id: int) -> None:
        """Start the prober on ``host``, sealing under key ``primary_id``.

        Raises:
            OSError: no socket could be bound on ``host``.
        """
        self.prober = PulseProber(self.member_id, primary_id, self._secrets, self._on_silent,
                                  clock=self._clock, key_for=self._key_for)
        await self.prober.start(host)

    async def close(self) -> None:
        """Close the prober, then the responder (each once started)."""
        if self.prober is not None:
            await self.prober.close()
        if self.responder is not None:
            self.responder.close()

    def rekey(self, keyring: Any) -> None:
        """Answer and probe under ``keyring``'s pulse secrets from now on."""
        self._secrets = keyring.derive_secrets(PULSE_LABEL)
        if self.responder is not None:
            self.responder.rekey(self._secrets)
        if self.prober is not None:
            self.prober.rekey(keyring.primary_id, self._secrets)

    def watch(self) -> None:
        """Point the prober at the core's current subjects, looking up the pulse ports of new
        ones (owned tasks; at most K per configuration change). Cheap when nothing changed."""
        member, prober = self._member(), self.prober
        if member is None or prober is None:
            return
        watched = (member.configuration.config_id, member.subjects)
        if watched == self._watched:
            return
        self._watched = watched
        subjects = set(member.subjects) if not (member.removed or member.left) else set()
        for gone in [m for m in self._ports if m not in subjects]:
            del self._ports[gone]
            lookup = self.lookups.pop(gone, None)
            if lookup is not None:
                lookup.cancel()
        for subject in subjects:
            if subject not in self._ports:
                self._ports[subject] = None
                self.lookups[subject] = self._tasks.spawn(
                    self._look_up(subject), name=f"pulse-lookup-{format_member_id(subject)}")
        self._point_prober()

    def _point_prober(self) -> None:
        member, prober = self._member(), self.prober
        if member is None or prober is None:
            return
        addresses = member.configuration.addresses
        targets = {m: (addresses[m][0], port) for m, port in self._ports.items()
                   if port is not None and m in addresses}
        prober.watch(targets)

    async def _look_up(self, subject: MemberId) -> None:
        """Until ``subject``'s pulse port is found; cancelled when it stops being a subject."""
        while True:
            try:
                _, port = await self._lookup(subject, PULSE_SERVICE, 0, timeout_s=PULSE_LOOKUP_S)
            except TransportError as exc:
                log.info("no pulse responder found for %016x (%s): watched by probes alone, "
                         "asking again in %.0f s", subject, exc, PULSE_RELOOKUP_S)
                await asyncio.sleep(PULSE_RELOOKUP_S)
                continue
            self.lookups.pop(subject, None)
            self._ports[subject] = port
            self._point_prober()
            return

    def counters(self) -> dict[str, int]:
        """The prober's counters, and the responder's prefixed ``responder_``."""
        out = self.prober.counters() if self.prober is not None else {}
        if self.responder is not None:
            out.update({f"responder_{k}": v for k, v in self.responder.counts().items()})
        return out

    def status(self) -> dict[str, Any]:
        """The ``pulse`` part of ``/status``: the responder's port, the subjects watched and
        those found silent."""
        prober = self.prober
        return {
            "responder_port": self.responder.port if self.responder is not None else None,
            "watching": len(prober.tracker.targets) if prober else 0,
            "silent": sorted(format_member_id(m) for m in prober.tracker.silent)
            if prober else [],
        }
