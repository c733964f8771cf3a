"""One live agent on an asyncio loop: the sans-IO core driven by sockets and a real clock.

:class:`AgentRuntime` is the async API. Many of them can share one loop (the tests run 16);
:func:`torchpass_p2p.start` runs one in a background thread of a training process.

This module holds the loop driver and the public surface; the services the runtime runs live
in :mod:`.services`, one a module, each given only the values and callbacks it needs:
the service directory, keys, pulse watching, the hang watchdog, GPU health, where peers are,
what events become, telemetry, joining through the seeds, the status page and the drain guard.
The parts below them keep their own modules (:mod:`.transport`, :mod:`.http`, :mod:`.metrics`,
:mod:`.history`, :mod:`.pulse`, :mod:`.health`).

The driving rule is aioquic's: every input (a datagram, a timer, a call from the host, a
service's finding such as a silent subject) goes into the core with ``now``, under
``_core_lock``, then everything the core queued is pulled at once (``_flush``): datagrams are
sealed and sent, events handed to the event sink. One task owns the timer (``_drive``); it
sleeps until ``Member.next_deadline()`` or until an input moved the deadline, and at each turn
also runs the hang watchdog, points the pulse prober and refreshes the metrics once a second.

Task ownership: every task of an agent (the driver, drains, key checks, pulse lookups, the stop
after a failure or a refused key) is held by one :class:`~torchpass_p2p.tasks.OwnedTasks`, made
here and handed to each service that starts tasks; :meth:`AgentRuntime.stop` closes it last.
Not an :class:`asyncio.TaskGroup`: a task group lives within one ``async with`` of one task,
while the services start in :meth:`~AgentRuntime.start` and end in :meth:`~AgentRuntime.stop`,
often called by another task, or by a task of the group itself (the stop after the driver
failed); a task group also cancels every task when one fails, while here a failed key check
or lookup is logged and only the driver's failure stops the member (``_driver_ended``); and
it holds any number of tasks, while an agent's are bounded (:data:`MAX_TASKS`).

Why one module of this size: :class:`AgentRuntime` is the agent's whole public surface, some
30 methods and properties whose docstrings are the contract (units, errors) and whose bodies
delegate to the services in a line or two.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import msgpack

from torchpass_p2p.core.agreement import classic_quorum
from torchpass_p2p.core.configuration import Address, Configuration
from torchpass_p2p.core.membership import Member
from torchpass_p2p.core.messages import Join, Joiner, MemberId, format_member_id
from torchpass_p2p.tasks import OwnedTasks

from .bootstrap import configuration_to_data
from .history import History
from .http import http_token
from .pulse_wire import PulseResponder
from .services.addresses import AddressBook
from .services.directory import NotServed, ServiceDirectory
from .services.drain_guard import drain_refusal
from .services.events import Change, EventSink, Listener
from .services.gpu_health import GpuHealth
from .services.keys import KeyKeeper, KeyNotAccepted
from .services.pulse_watch import PulseWatch
from .services.seeds import fetch_configuration, seed_members
from .services.status_page import StatusPage, member_rows
from .services.telemetry import COUNTER_SOURCES, Telemetry
from .services.watchdog import HangWatchdog, Phase
from .settings import AgentSettings
from .transport import Kind, Received, Reply, Transport, TransportError
from .wakeup import Wakeup

__all__ = ["COUNTER_SOURCES", "AgentRuntime", "Change", "KeyNotAccepted", "NotServed", "Phase"]

log = logging.getLogger("torchpass_p2p.agent")

MAX_TASKS = 1024
"""Tasks an agent holds at once: the driver, the stop after its failure or a refused key, key
checks (one a ``KEY_CHECK_INTERVAL_S`` at most, each over within ``KEY_CHECK_TIMEOUT_S``),
drains (over at their first step) and one pulse lookup per subject (at most K, the
configuration's observer rings). These add up to far less; reaching it is a bug, and fails the
driver (the member then stops as if crashed)."""
STOP_WAIT_S = 2.0
"""How long :meth:`AgentRuntime.stop` waits for the tasks it cancelled to end (seconds); each
ends at its next await, so this bounds a stop only if one is stuck."""


class AgentRuntime:
    """The core of member ``settings.member_id`` made live (module docstring).

    Args:
        settings: see :class:`~.settings.AgentSettings`.
        clock: monotonic seconds; the core's only notion of time.
        rng: the core's randomness (seeded in tests); default a fresh ``random.Random``.
        health: a started-later health monitor (:class:`~.health.HealthMonitor`), or None to
            build one when ``settings.health`` is true.
    """

    def __init__(self, settings: AgentSettings, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, health: Any = None) -> None:
        self.settings = settings
        self.member_id = settings.member_id
        self._clock = clock
        self._rng = rng or random.Random()
        self.member: Member | None = None
        self.transport = Transport(
            settings.cluster, settings.keyring, settings.member_id,
            on_message=self._on_message, on_send_error=self._on_send_error,
            on_request=self._on_request, on_unknown_key=self._on_unknown_key)
        self.address: Address | None = None
        self.status_address: Address | None = None
        self.http_token = http_token(settings.keyring)
        self.addresses = AddressBook()
        """Where former members and joiners are (the configuration says where members are)."""
        self.directory = ServiceDirectory(self.transport, clock, self.transport.rejected_frames)
        self.services = self.directory.services
        """(name, config_id) -> port this process serves it on (:meth:`register_service`)."""
        self.history = History(clock)
        """Configurations, recoveries and transfers seen, for the status page."""
        self.events = EventSink(
            settings.member_id, self.history, config_id=self._config_id,
            metrics=lambda: self.metrics, on_decided=self.addresses.decided)
        """What the core's events became: recent events, counts, changes handed over."""
        self.decided_at = self.events.decided_at
        """config_id -> when (clock seconds) this member learned the decision: timelines."""
        self._metrics_at = 0.0
        self._wake = Wakeup()
        self._driver: asyncio.Task[None] | None = None
        self._tasks = OwnedTasks(f"agent-{format_member_id(settings.member_id)}", MAX_TASKS)
        """Every task of this agent: the driver, drains, key checks, pulse lookups and the
        stop after a failure."""
        self.keys = KeyKeeper(settings.keyring, lambda: self.settings.key_file, self.transport,
                              clock=clock, tasks=self._tasks, running=self._running,
                              peers=self._peers, on_installed=self._keys_installed,
                              on_refused=self._stop_refused)
        self.status_page = StatusPage()
        """The status server (``settings.status``), once started."""
        self.gpu_health = GpuHealth(health, clock=clock, role=lambda: self.role,
                                    note=self.events.note, drain=self._ask_to_drain)
        """The health monitor (``settings.health``) and the faults it reported."""
        self.step = -1
        self.phase = Phase.COMPUTE
        self.watchdog = HangWatchdog(
            clock, timeout_s=lambda: self.settings.hang_timeout_s, role=lambda: self.role,
            on_fired=self._hang_fired, note=self.events.note, drain=self._ask_to_drain)
        self.stopped = False
        self.draining = False
        self._committed_ranks: tuple[MemberId | None, ...] | None = None
        """The rank map of the last group in which a step committed here (:meth:`report_commit`):
        every member in it held the state then. None until the host's first commit (:meth:`drain`
        then counts the ranks this member was started with)."""
        self._core_lock = threading.RLock()
        """Held by this loop while the core handles an input (a decision can only come from
        one) and by a training thread's :meth:`commit_now`: a commit is checked and recorded
        either wholly before a decision or wholly after it."""
        self.failure: BaseException | None = None
        """What ended the timer task other than :meth:`stop` (a bug in the core or in a
        callback). The member then stops as if it had crashed, so that its peers replace it,
        instead of living on unable to probe and fenced for good; ``role`` is ``failed``."""
        self.finished = asyncio.Event()
        """Set once :meth:`stop` completed, asked for or after a failure."""
        self.pulse_watch = PulseWatch(
            settings.member_id, settings.keyring, clock=clock, tasks=self._tasks,
            member=lambda: self.member, lookup=self.lookup_service,
            register=self.register_service, on_silent=self._on_silent,
            key_for=self.transport.peer_key_id)
        """This process's pulse responder and prober (``settings.pulse``)."""
        self.telemetry = Telemetry(
            self.transport, member=lambda: self.member, fenced=lambda: self.fenced,
            stragglers=self.history.stragglers, events=self.events.counts,
            health_faults=self.gpu_health.faults, pulse=self.pulse_watch.counters,
            keys=self.key_counters)
        """Counts for ``/status`` and ``/metrics``; the metrics once the core runs."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the sockets, join or enter configuration 0, start the timer task, the status
        page and the health monitor.

        Raises:
            OSError: the bind address is taken.
            TransportError: joining, and no seed gave a configuration within
                ``settings.join_timeout_s``.
        """
        s = self.settings
        self.address = await self.transport.start(s.bind, s.bind_fds)
        try:
            if s.pulse:
                self.pulse_watch.start_responder(self.address[0])
            await self._start_member()
        except BaseException:  # also cancelled: nothing stays bound (a retry must bind again)
            await self.stop(leave=False)
            raise
        log.info("member %016x up on %s:%d, config %d, role %s", self.member_id,
                 *self.address, self.configuration.config_id, self.role)

    async def _start_member(self) -> None:
        s = self.settings
        assert self.address is not None
        if s.configuration is not None:
            self.member = Member(s.member_id, s.configuration, params=s.params, rng=self._rng,
                                 now=self._clock(), policy=s.policy, started=s.started)
        else:
            config = await fetch_configuration(self.transport, s.seeds, s.join_timeout_s,
                                               self._clock, self.keys.not_accepted)
            seeds = seed_members(config, s.seeds)
            joiner = Joiner(s.member_id, self.address[0], self.address[1], s.topology)
            self.member = Member(s.member_id, config, params=s.params, rng=self._rng,
                                 now=self._clock(), policy=s.policy, joining=joiner, seeds=seeds)
        self.events.begin(self.member.configuration)
        self.telemetry.start_metrics()
        if s.status is not None:
            self.status_address = await self.status_page.start(
                self, self.metrics, s.status, token=self.http_token, keyring=self.keyring,
                fd=s.status_fd)
        if s.health:
            self.gpu_health.start()
        if self.settings.pulse:
            await self.pulse_watch.start_prober(self.address[0], self.keyring.primary_id)
        self._driver = self._tasks.spawn(self._drive(), name="driver",
                                         on_done=self._driver_ended)
        self._flush()

    async def stop(self, *, leave: bool = True) -> None:
        """Stop: announce a graceful leave first (``leave``), then close everything. Bounded."""
        if self.stopped:
            return
        if leave and self.member is not None and not self.member.removed:
            with self._core_lock:
                self.member.leave(self._clock())
            self._flush()
            await asyncio.sleep(0.05)  # let the Left datagrams out before the socket closes
        self.stopped = True
        if self._driver is not None:
            self._driver.cancel()
            await asyncio.gather(self._driver, return_exceptions=True)
        self.gpu_health.stop()
        await self.status_page.stop()
        await self.pulse_watch.close()
        await self.transport.close()
        await self._tasks.close(STOP_WAIT_S)  # not the calling task: it may be the failure's stop
        self.finished.set()

    def _driver_ended(self, task: asyncio.Task[None]) -> None:
        if self.stopped or task.cancelled():
            return
        self.failure = task.exception() or RuntimeError("the timer task returned")
        log.critical("member %016x: the agent's timer task failed; stopping as if crashed so "
                     "that the peers replace this member", self.member_id,
                     exc_info=self.failure)
        self._tasks.spawn(self.stop(leave=False), name="stop")

    # ------------------------------------------------------------------ queries

    @property
    def configuration(self) -> Configuration:
        assert self.member is not None, "start() first"
        return self.member.configuration

    @property
    def role(self) -> str:
        m = self.member
        if self.failure is not None:
            return "failed"
        if m is None or m.joining is not None:
            return "joining"
        if m.removed:
            return "removed"
        if m.left:
            return "leaving"
        return m.configuration.role_of(self.member_id) or "removed"

    @property
    def rank(self) -> int | None:
        m = self.member
        return None if m is None or m.removed else m.configuration.rank_of(self.member_id)

    @property
    def fenced(self) -> bool:
        """True while training must not go on: quorum lost (the core's lease), removed, or no
        probe of ours answered for ``lease_s`` (after a SIGSTOP this holds from the first
        instant the process runs again, before any timer has fired)."""
        m = self.member
        if m is None or m.removed or m.fenced or self.failure is not None:
            return True
        return m.joining is None and self._clock() - m.last_ack_at > m.params.lease_s

    @property
    def reachable(self) -> int:
        """Members of the current configuration this member believes reachable, itself
        included (``Member.reachable``); 0 before the core runs. With :attr:`majority`, what
        a fenced member tells its user."""
        m = self.member
        return 0 if m is None else m.reachable

    @property
    def majority(self) -> int:
        """Members of the current configuration a decision needs: ``floor(N / 2) + 1``."""
        m = self.member
        return 0 if m is None else classic_quorum(len(m.configuration))

    # ------------------------------------------------------------------ inputs from the host

    def report_progress(self, step: int, phase: str = Phase.COMMITTED) -> None:
        """The training loop is at ``step`` in ``phase`` (:class:`Phase`); a committed step goes
        into this member's vote and progress report (docs/design.md section 6)."""
        self.step = max(self.step, step) if phase == Phase.COMMITTED else self.step
        self.phase = phase
        self.watchdog.progressed()
        if phase == Phase.COMMITTED and self.member is not None:
            with self._core_lock:  # also reached from a training thread (commit_now)
                # Never lowered: a report posted from the training thread may arrive after
                # a later commit it made directly.
                self.member.report_progress(max(step, self.member.last_committed_step))
            if self.metrics is not None:
                self.metrics.set_step(step)

    def report_commit(self, step: int, ranks: tuple[MemberId | None, ...]) -> bool:
        """The commit all-reduce of ``step`` completed in the group whose rank map is ``ranks``:
        may the host apply the step? True, and ``step`` enters this member's vote and progress
        report, while the current configuration has that rank map. False once a decided change
        gave the ranks to others: this member's progress for that change's plan was already
        fixed at the step before, so applying ``step`` would put it past the plan's
        ``resume_step`` (a drained member still trains in the old group, so its peers can commit
        after the decision). Then the host keeps the averaged gradient and waits for the change:
        the commit rule rolls it forward if a peer applied the step before its agent knew.
        Atomic with the core's handling of decisions: both run on this loop."""
        member = self.member
        if member is None or member.removed or tuple(member.configuration.ranks) != ranks:
            self.report_progress(step, Phase.COLLECTIVE)  # alive, waiting for the change
            return False
        self._committed_ranks = ranks
        # Every rank voted in the commit: they all run, and none is owed a start-up grace.
        member.report_started(self._clock(), ranks)
        self.report_progress(step, Phase.COMMITTED)
        return True

    def commit_now(self, step: int, ranks: tuple[MemberId | None, ...],
                   timeout_s: float) -> bool:
        """:meth:`report_commit` from the training thread, without a round trip to this loop:
        under the lock the loop holds while the core handles an input. False too when the lock
        is not had within ``timeout_s`` seconds (not applying is always safe)."""
        if not self._core_lock.acquire(timeout=timeout_s):
            return False
        try:
            return self.report_commit(step, ranks)
        finally:
            self._core_lock.release()

    def report_unreachable(self, member_id: MemberId, reason: str, exited: bool = False) -> bool:
        """Fast evidence that ``member_id`` failed (a reset connection, a failed collective
        naming it): an observer alerts at once, anyone else probes it now. ``exited``: the
        launcher on its host reaped its process, a certain death, announced as its departure
        (:meth:`~torchpass_p2p.core.membership.Member.report_exited`). Returns True when an
        alert or the announcement was raised here. Never raises for an unknown member."""
        if self.member is None or self.stopped:
            return False
        log.info("evidence against %016x: %s", member_id, reason)
        now = self._clock()
        with self._core_lock:
            if exited:
                raised = self.member.report_exited(now, member_id)
            else:
                raised = self.member.report_unreachable(now, member_id)
        self._flush()
        return raised

    def report_error(self, exc: BaseException, *, peer_rank: int | None = None) -> bool:
        """A collective failed with ``exc``. With ``peer_rank`` (the rank it names, when known)
        this is evidence against that rank's holder; without, it is only counted and logged:
        probing finds the failed member. Returns True when an alert was raised."""
        log.warning("collective error reported: %r", exc)
        if self.member is None or peer_rank is None:
            return False
        ranks = self.member.configuration.ranks
        holder = ranks[peer_rank] if 0 <= peer_rank < len(ranks) else None
        if holder is None:
            return False
        return self.report_unreachable(holder, f"collective error: {exc!r:.80}")

    async def drain(self) -> dict[str, Any]:
        """An operator's request (``POST /drain``) to hand this member's rank to a spare:
        :meth:`_drain`, unless the rank would stay vacant. Refused (``draining`` False,
        ``reason`` ``no_spare``) when this member holds a rank, the policy is ``wait`` and the
        configuration has no spare: every rank would then wait for a spare to join, up to its
        give-up time. Refused (``reason`` ``last_holder``) when no other rank holder is alive
        in this member's view: the agreement counts a removed member's state as gone (plan rule
        3), so the job would stop although this member still holds the state. Two holders
        drained within one gossip round can still both be accepted; the job then stops cleanly
        (exit 5). (A drain the agent asks for itself, for a failing GPU or a hang, is not
        refused: that rank cannot train on.)

        Only rank holders known to hold the state count: those in the group of the host's last
        commit (:meth:`report_commit`), or before any, the ranks of the configuration this
        member was started in. A spare promoted since may still be receiving the state (from
        this member, which would stop serving it); it counts once a step commits in its group."""
        m = self.member
        if m is None or self.stopped or self.draining or self.rank is None:
            return await self._drain()
        known = self._committed_ranks
        if known is None:
            started = self.settings.configuration
            known = () if started is None else tuple(started.ranks)
        refusal = drain_refusal(m, self.member_id, known, self.settings.policy)
        return refusal if refusal is not None else await self._drain()

    async def _drain(self) -> dict[str, Any]:
        """Hand this member's rank to a spare (planned maintenance, a failing GPU): leave
        gracefully; the agreement decides the change and a spare takes the rank. This member
        stays up (a state source) until it is out of the configuration."""
        if self.member is None or self.stopped:
            return {"draining": False, "reason": "not running"}
        if not self.draining:
            self.draining = True
            with self._core_lock:
                self.member.leave(self._clock())
            self._flush()
        return {"draining": True, "member_id": format_member_id(self.member_id),
                "config_id": self.member.configuration.config_id, "rank": self.rank}

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(change)`` on the loop for every ready change from now on."""
        self.events.add_listener(listener)

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (schema in :mod:`.http`)."""
        m = self.member
        return {
            "member_id": format_member_id(self.member_id),
            "cluster": self.settings.cluster,
            "role": self.role,
            "rank": self.rank,
            "config_id": -1 if m is None else m.configuration.config_id,
            "world_size": 0 if m is None else m.configuration.world_size,
            "step": self.step,
            "phase": self.phase,
            "fenced": self.fenced,
            "reachable": self.reachable,
            "majority": self.majority,
            "draining": self.draining,
            "keys": {"primary_id": self.keyring.primary_id,
                     "key_ids": list(self.keyring.key_ids),
                     "reloads": self.keys.counts["reloads"], "reloaded_at": self.keys.reloaded_at},
            "members": member_rows(m),
            "recent_events": list(self.events.recent),
            "clock": self._clock(),
            **self.history.status(),
            "health": self.gpu_health.status(),
            "counters": self.counters(),
            "pulse": self.pulse_watch.status(),
        }

    def counters(self) -> dict[str, int]:
        """Every count of this agent, flat (``counters`` of ``/status``)."""
        return self.telemetry.counters()

    def add_counter_source(self, name: str, read: Callable[[], Mapping[str, int]]) -> None:
        """Show counts kept outside the agent, by reason, with its own: in ``/status``
        (``counters``, as ``<name>_<reason>``) and in ``/metrics`` (the metric of ``name``, one
        of :data:`COUNTER_SOURCES`). ``read()`` is called on this loop (each status, each
        metrics refresh): it must be quick and safe from this thread, and return totals since
        its source started. A second source of one name replaces the first.

        Raises:
            KeyError: ``name`` is not one of :data:`COUNTER_SOURCES`.
        """
        self.telemetry.add_source(name, read)

    @property
    def metrics(self) -> Any:
        """This agent's :class:`~.metrics.AgentMetrics` once started (None before, or without
        prometheus_client)."""
        return self.telemetry.metrics

    def refresh_metrics(self) -> None:
        """Bring ``metrics`` up to date with the core and the sockets (once a second, and
        before each scrape)."""
        self.telemetry.refresh()

    @property
    def pulse(self) -> PulseResponder | None:
        """This process's pulse responder (``settings.pulse`` and built), else None."""
        return self.pulse_watch.responder

    # ------------------------------------------------------------------ driving the core

    async def _drive(self) -> None:
        assert self.member is not None
        member = self.member
        while True:
            delay = min(member.next_deadline() - self._clock(), 1.0)
            if delay > 0:
                self._wake.clear()  # this loop's own _flush set it
                await self._wake.sleep(delay)
            now = self._clock()
            if now >= member.next_deadline():
                with self._core_lock:
                    member.handle_timer(now)
            self._watch_hang(now)
            self.pulse_watch.watch()
            self._flush()
            if now >= self._metrics_at:
                self._metrics_at = now + 1.0
                self.refresh_metrics()

    def _flush(self) -> None:
        member = self.member
        if member is None:
            return
        out = member.messages_to_send()
        if out:
            configuration = member.configuration
            incarnation = member.incarnation
            for dest, message in out:
                address = self.addresses.send_to(configuration, dest)
                if address is None:
                    self.transport.traffic["dropped_no_address"] += 1
                    continue
                self.transport.send(address, message, incarnation, dest)
        while (event := member.next_event()) is not None:
            self.events.on_event(event)
        self._wake.set()

    def _on_message(self, received: Received) -> None:
        member = self.member
        if member is None or self.stopped:
            return
        message = received.message
        if type(message) is Join and message.joiner.member not in member.configuration:
            # A joiner is in no configuration yet: its own Join says where it listens.
            self.addresses.heard_join(message.joiner)
        with self._core_lock:
            member.receive(self._clock(), received.sender, received.message)
        self._flush()

    def _on_send_error(self, address: Address, exc: OSError) -> None:
        member = self.member
        if member is None:
            return
        dest = self.addresses.member_at(member.configuration, address)
        if dest is not None:
            with self._core_lock:
                member.report_send_error(self._clock(), dest)
            self._flush()

    def _on_silent(self, subject: MemberId) -> None:
        member = self.member
        if member is None or self.stopped:
            return
        log.info("pulse: %016x silent", subject)
        with self._core_lock:
            member.report_silent(self._clock(), subject)
        self._flush()

    def _on_request(self, kind: int, body: bytes) -> Reply | Coroutine[Any, Any, Reply] | None:
        if self.member is None:
            return None
        if kind == Kind.KEY_CHECK:  # it opened: the key it came under is accepted here
            return Kind.KEY_CHECK_REPLY, b""
        if kind == Kind.CONFIG_REQUEST:
            data = configuration_to_data(self.member.configuration)
            return Kind.CONFIG_REPLY, msgpack.packb(data)
        if kind == Kind.SERVICE_REQUEST:
            return self.directory.on_request(body)
        return None

    # ------------------------------------------------------------------ service directory

    def register_service(self, name: str, config_id: int, port: int) -> None:
        """Announce that this process serves ``name`` for ``config_id`` on ``port`` of this
        member's host (e.g. the rendezvous store of a configuration; docs/design.md section 8).
        Peers find it with :meth:`lookup_service`, over the authenticated TCP port; requests that
        were waiting for it are answered at once. ``port`` 0 says this member will not serve
        ``name`` for ``config_id`` (a promoted spare that holds no state yet): lookups then
        raise :class:`NotServed` at once instead of waiting; a later registration replaces it."""
        self.directory.register(name, config_id, port)

    async def lookup_service(self, member: MemberId, name: str, config_id: int, *,
                             timeout_s: float = 30.0) -> Address:
        """(host, port) where ``member`` serves ``name`` for ``config_id``. Each request is
        held by ``member`` until the port is registered or
        :data:`~.services.directory.SERVICE_HOLD_S` passed; then
        this asks again, until ``timeout_s`` seconds passed.

        Raises:
            NotServed: ``member`` registered it as not served (port 0).
            TransportError: not registered within ``timeout_s`` seconds, or ``member`` has no
                known address.
        """
        address = self.addresses.ask_at(self.configuration, member)
        if address is None:
            raise TransportError(f"no address for member {format_member_id(member)}")
        if member == self.member_id:
            address = self.address or address
        return await self.directory.lookup(address, member, name, config_id, timeout_s)

    # ------------------------------------------------------------------ keys

    @property
    def keyring(self) -> Any:
        """The keys in use: ``settings.keyring`` until :meth:`reload_keys` replaces it."""
        return self.keys.keyring

    @property
    def refused(self) -> KeyNotAccepted | None:
        """Set when the members refused this member's key (a key check); it then stops."""
        return self.keys.refused

    def add_key_listener(self, listener: Callable[[Any], None]) -> None:
        """Call ``listener(keyring)`` on the loop with each keyring :meth:`reload_keys`
        installs (the state-transfer keys follow the agent's this way)."""
        self.keys.add_listener(listener)

    def key_counters(self) -> dict[str, int]:
        """``reloads``, ``reload_failed``, ``key_checks`` and the transport's key events
        (``refusals_sent``, ``unknown_key_lines``, ``unknown_key_lines_suppressed``): the
        ``torchpass_keys_total`` metric."""
        return self.keys.counters()

    def reload_keys(self) -> dict[str, Any]:
        """Read ``settings.key_file`` again and seal, open, answer pulses and accept status
        tokens under its keys from now on (``docs/running.md``, "Keys"): its first key becomes
        the primary, the others stay accepted, a key no longer listed is refused. Counters and
        replay windows are kept; nothing else changes. A file that cannot be read or parsed
        changes nothing.

        Returns ``{"reloaded": True, "primary_id", "key_ids"}`` or ``{"reloaded": False,
        "reason"}`` (never raises for a bad file)."""
        return self.keys.reload()

    # ------------------------------------------------------------------ what services call

    def _keys_installed(self, keyring: Any) -> None:
        """The runtime's own users of keys follow ``keyring`` (after the transport's)."""
        self.http_token = http_token(keyring)
        self.status_page.set_keys(keyring)
        self.pulse_watch.rekey(keyring)

    def _on_unknown_key(self, address: Address) -> None:
        self.keys.on_unknown_key(address)

    def _running(self) -> bool:
        return self.member is not None and not self.stopped

    def _peers(self) -> dict[MemberId, Address] | None:
        """The other members of the configuration that have an address, in its order."""
        if self.member is None:
            return None
        addresses = self.member.configuration.addresses
        return {m: addresses[m] for m in self.member.configuration.members
                if m != self.member_id and m in addresses}

    def _stop_refused(self, refused: KeyNotAccepted) -> None:
        log.debug("%s", refused)  # the host says it, once (torchpass_p2p.start)
        self._tasks.spawn(self.stop(leave=False), name="stop")

    def _watch_hang(self, now: float) -> None:
        """One turn of the hang watchdog (an attribute the driver looks up at each turn)."""
        self.watchdog.check(now, self.phase, self.step)

    def _hang_fired(self) -> None:
        if self.metrics is not None:
            self.metrics.hang_fired()

    def _ask_to_drain(self) -> None:
        """The agent's own drain (a hang, a failing GPU): never refused (:meth:`drain`)."""
        self._tasks.spawn(self._drain(), name="drain")

    def _config_id(self) -> int:
        return self.member.configuration.config_id if self.member else -1
