"""The in-script start: one agent in a background thread of a training or spare process.

``agent = torchpass_p2p.start()`` returns once the sockets are bound and the member is in
configuration 0 (or has asked to join). The training thread then uses the small thread-safe API
of :class:`Agent`; everything it calls is handed to the agent's loop with
``call_soon_threadsafe``, and everything it reads is an immutable value (a
:class:`~torchpass_p2p.core.Configuration`, a :class:`~.runtime.Change`).

A process whose key the cluster does not accept (:class:`~.runtime.KeyNotAccepted`: its key
file was rotated past, or not yet) cannot take part in the job, and nothing the script does
can change that: the agent's thread writes one line on standard error, with key ids and never
keys, and ends the process with ``EXIT_KEY_REFUSED`` (6) at once, whatever the training thread
is doing (``docs/running.md``, "Keys"). Pass ``exit_on_refusal=False`` to :class:`Agent` to get
:class:`AgentError` instead (tests).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from os import PathLike
from typing import Any

from torchpass_p2p.core.configuration import Address, Configuration

from .history import History
from .interface import AgentEvent
from .lifeline import die_with_launcher
from .runtime import COUNTER_SOURCES, AgentRuntime, Change, KeyNotAccepted, Phase
from .settings import AgentSettings, load_settings
from .sockets import INHERITED_VARIABLES

__all__ = ["Agent", "AgentError", "start"]

log = logging.getLogger("torchpass_p2p.agent")

START_TIMEOUT_S = 60.0
"""Longest :func:`start` waits for the agent to be up (a joiner asks its seeds up to 30 s)."""
COMMIT_TIMEOUT_S = 30.0
"""Longest :meth:`Agent.report_commit` waits for the agent's loop (microseconds when it runs; a
loop stalled this long has lost its lease anyway)."""
CHANGES_KEPT = 64
"""Ready changes buffered for :meth:`Agent.next_change`; older ones are dropped first."""
EXIT_KEY_REFUSED = 6
"""The exit code of a process whose key is not accepted (the launcher's table:
:data:`torchpass_p2p.launch.outcome.EXIT_KEY_REFUSED`, which must stay equal)."""


class AgentError(RuntimeError):
    """The agent could not start, or its thread died; the message says why."""


def start(config: str | PathLike[str] | None = None, **settings: Any) -> Agent:
    """Start this process's agent and return it once it is up.

    Args:
        config: a TOML file (``[agent]`` table and protocol parameters, see
            :func:`~.settings.load_settings`); None: environment and arguments only.
        settings: fields of :class:`~.settings.AgentSettings` (and ``key`` as bytes); they win
            over the environment (``TORCHPASS_*``, set by ``torchpass-p2p launch``).

    Raises:
        SettingsError: the settings are incomplete or malformed (no key, no configuration and
            no seeds, ...).
        AgentError: the agent did not come up within 60 s (bind failed, no seed answered).
    """
    die_with_launcher()
    loaded = load_settings(config, **settings)
    for name in INHERITED_VARIABLES:  # the descriptors are this agent's now: no subprocess
        os.environ.pop(name, None)    # and no second start() may take them again
    agent = Agent(loaded)
    agent.start()
    return agent


class Agent:
    """A running agent, driven from any thread (module docstring)."""

    def __init__(self, settings: AgentSettings, *, exit_on_refusal: bool = True) -> None:
        self.settings = settings
        self.exit_on_refusal = exit_on_refusal
        self.member_id = settings.member_id
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runtime: AgentRuntime | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._leave = True
        self._error: BaseException | None = None
        self._changes: queue.Queue[Change] = queue.Queue(CHANGES_KEPT)
        self._callbacks: list[Callable[[Change], None]] = []
        self._rank_assigned = threading.Condition()
        self._last_change: Change | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the agent thread and wait until the agent is up.

        Raises:
            AgentError: it failed or did not come up within ``timeout_s`` seconds.
        """
        self._thread = threading.Thread(target=self._run, name="torchpass-agent", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.stop(leave=False, timeout_s=0)  # if it comes up later, it stops at once
            raise AgentError(f"the agent did not start within {timeout_s} s")
        if self._error is not None:
            raise AgentError(f"the agent failed to start: {self._error!r}") from self._error

    def stop(self, *, leave: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the agent: a graceful leave first (``leave``), then sockets closed. Idempotent;
        returns within about ``timeout_s`` seconds."""
        loop, stopping = self._loop, self._stopping
        if loop is None or stopping is None or self._thread is None:
            return
        self._leave = leave
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        self._thread.join(timeout_s)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ queries

    @property
    def configuration(self) -> Configuration:
        """The current configuration (an immutable value)."""
        return self._live().configuration

    @property
    def config_id(self) -> int:
        return self.configuration.config_id

    @property
    def role(self) -> str:
        """``rank``, ``spare``, ``joining``, ``leaving``, ``removed``, or ``failed`` (the
        agent's timer task failed: it stopped as if crashed, and its peers replace it)."""
        return self._live().role

    @property
    def rank(self) -> int | None:
        return self._live().rank

    @property
    def fenced(self) -> bool:
        """True while this member must not train: quorum lost (lease expired) or removed."""
        return self._live().fenced

    @property
    def reachable(self) -> int:
        """Members of the current configuration this member believes reachable, itself
        included: those its view holds neither suspected, convicted nor gone. Below
        :attr:`majority` for the lease, the member is fenced: no change of the configuration
        can be decided unless some of the others come back."""
        return self._live().reachable

    @property
    def majority(self) -> int:
        """Members of the current configuration a decision needs: ``floor(N / 2) + 1``."""
        return self._live().majority

    @property
    def draining(self) -> bool:
        """True once this member asked to hand its rank to a spare (:meth:`drain`, a GPU fault,
        the hang watchdog); it still holds the rank until a decided change removes it."""
        return self._live().draining

    @property
    def address(self) -> Address:
        """(host, port) of this agent's UDP and TCP sockets."""
        address = self._live().address
        assert address is not None
        return address

    @property
    def status_address(self) -> Address | None:
        """(host, port) of the HTTP status page, None when disabled."""
        return self._live().status_address

    @property
    def history(self) -> History:
        """What this member saw of configurations, recoveries and transfers
        (:class:`~.history.History`): the trainer hands it its timeline records and transfer
        progress from its own threads, and ``/status`` shows it."""
        return self._live().history

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The ``/status`` document, built on the agent's loop."""
        runtime = self._live()
        return self._call(lambda: _on_loop(runtime.status), timeout_s)

    def recent_events(self, timeout_s: float = 5.0) -> tuple[AgentEvent, ...]:
        """The ``/status`` document's ``recent_events`` (the last 64, oldest first) as typed
        records (:class:`~.interface.AgentEvent`).

        Raises:
            TimeoutError: the agent's loop did not answer within ``timeout_s`` seconds.
            AgentError: the agent is not running.
        """
        return tuple(AgentEvent.from_status(e) for e in self.status(timeout_s)["recent_events"])

    # ------------------------------------------------------------------ host -> agent

    def report_progress(self, step: int, phase: str = Phase.COMMITTED) -> None:
        """The training loop reached ``phase`` (:class:`~.runtime.Phase`) of ``step``; a
        committed step enters this member's vote and feeds the hang watchdog. Never blocks."""
        runtime = self._live()
        self._post(runtime.report_progress, step, phase)

    def report_commit(self, step: int, ranks: tuple[int | None, ...],
                      timeout_s: float = COMMIT_TIMEOUT_S) -> bool:
        """The commit vote of ``step`` completed in the group of rank map ``ranks``: True
        when the step may be applied (see :meth:`~.runtime.AgentRuntime.report_commit`).
        Checked on the calling thread under the lock the agent's loop holds while its core
        handles an input, so it is atomic with every decision and costs no round trip. False
        too when the lock is not had within ``timeout_s``: not applying is always safe, the
        commit rule redoes or rolls forward."""
        try:
            runtime = self._live()
        except AgentError:
            return False
        return runtime.commit_now(step, ranks, timeout_s)

    def report_error(self, exc: BaseException, *, peer_rank: int | None = None) -> None:
        """A collective failed with ``exc`` (naming ``peer_rank`` when known): fast evidence."""
        runtime = self._live()
        self._post(lambda: runtime.report_error(exc, peer_rank=peer_rank))

    def report_unreachable(self, member_id: int, reason: str) -> None:
        """Fast evidence that ``member_id`` failed (its process exited, a connection reset)."""
        runtime = self._live()
        self._post(runtime.report_unreachable, member_id, reason)

    def drain(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Ask to hand this member's rank to a spare (planned maintenance, a failing GPU)."""
        runtime = self._live()
        return self._call(runtime.drain, timeout_s)

    def register_service(self, name: str, config_id: int, port: int) -> None:
        """Announce a port this process serves ``name`` on for ``config_id``, or 0 for "not
        served there" (see :meth:`~.runtime.AgentRuntime.register_service`)."""
        runtime = self._live()
        self._post(runtime.register_service, name, config_id, port)

    def add_counter_source(self, name: str, read: Callable[[], Mapping[str, int]]) -> None:
        """Show the counts ``read()`` returns (reason -> total) in the agent's ``/status`` and
        ``/metrics`` under ``name`` (see :meth:`~.runtime.AgentRuntime.add_counter_source`);
        ``read`` is called on the agent's thread, so it must be safe from there.

        Raises:
            KeyError: ``name`` is not one of :data:`~.runtime.COUNTER_SOURCES`.
        """
        if name not in COUNTER_SOURCES:  # raised here, to the caller, not on the agent's loop
            raise KeyError(f"no counter source named {name!r}; known: "
                           f"{', '.join(COUNTER_SOURCES)}")
        runtime = self._live()
        self._post(runtime.add_counter_source, name, read)

    def add_key_listener(self, listener: Callable[[Any], None]) -> None:
        """Call ``listener(keyring)`` on the agent's thread with each keyring a reload of the
        key file installs (:meth:`~.runtime.AgentRuntime.reload_keys`)."""
        runtime = self._live()
        self._post(runtime.add_key_listener, listener)

    def lookup_service(self, member: int, name: str, config_id: int, *,
                       timeout_s: float = 30.0) -> Address:
        """(host, port) where ``member`` serves ``name`` for ``config_id``; waits until it is
        registered.

        Raises:
            NotServed: ``member`` registered it as not served (port 0, see
                :meth:`register_service`).
            TransportError: not registered within ``timeout_s`` seconds.
        """
        runtime = self._live()
        return self._call(lambda: runtime.lookup_service(member, name, config_id,
                                                         timeout_s=timeout_s), timeout_s + 5)

    # ------------------------------------------------------------------ agent -> host

    def next_change(self, timeout_s: float | None = None) -> Change | None:
        """The next decided change whose plan is ready (``plan.resume_step`` set), oldest first;
        None if none came within ``timeout_s`` seconds (None: until one comes, or None once
        the agent has stopped)."""
        if timeout_s is not None:
            try:
                return self._changes.get(timeout=timeout_s)
            except queue.Empty:
                return None
        while True:  # in slices: a stopped agent queues nothing more
            try:
                return self._changes.get(timeout=1.0)
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    return None

    def changes(self, timeout_s: float | None = None) -> Iterator[Change]:
        """Iterate over ready changes until none arrives within ``timeout_s`` seconds."""
        while (change := self.next_change(timeout_s)) is not None:
            yield change

    def on_change(self, callback: Callable[[Change], None]) -> None:
        """Call ``callback(change)`` on the agent's thread for every ready change from now on.
        It must return quickly: the agent's timers wait for it."""
        self._callbacks.append(callback)

    def wait_for_rank(self, timeout_s: float | None = None) -> Change:
        """For a spare: block until a decided change gives this member a rank, or stops the
        job; return it. ``change.configuration.rank_of(agent.member_id)`` is the rank,
        ``change.plan`` names the state sources and ``resume_step``; ``change.plan.action ==
        "stop"``: nobody will get a rank (the state of a vacant rank has no surviving replica,
        or no spare is left under policy ``stop``; :mod:`torchpass_p2p.core.plan`).

        Raises:
            TimeoutError: no rank within ``timeout_s`` seconds.
            AgentError: this member was removed, or the agent stopped.
        """
        with self._rank_assigned:
            ok = self._rank_assigned.wait_for(lambda: self._assignment() is not None
                                              or self._finished(), timeout_s)
            if not ok:
                raise TimeoutError(f"no rank assigned within {timeout_s} s")
            change = self._assignment()
            if change is None:
                raise AgentError("the agent stopped or this member was removed before a rank "
                                 "was assigned")
            return change

    # ------------------------------------------------------------------ the agent thread

    def _run(self) -> None:
        loop: asyncio.AbstractEventLoop
        try:
            import uvloop
            loop = uvloop.new_event_loop()
        except ImportError:  # uvloop is optional (no wheels on some platforms)
            loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # the thread's last word: recorded for the host
            self._error = exc
            if isinstance(exc, KeyNotAccepted) and self.exit_on_refusal:
                _exit_refused(self.member_id, exc)
        finally:
            self._ready.set()
            with self._rank_assigned:
                self._rank_assigned.notify_all()
            loop.run_until_complete(asyncio.sleep(0))  # close callbacks of failed transports
            loop.close()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        runtime = AgentRuntime(self.settings)
        await runtime.start()
        runtime.add_listener(self._on_change)
        self._runtime = runtime
        self._ready.set()
        try:
            async with asyncio.TaskGroup() as tasks:
                asked = tasks.create_task(self._stopping.wait(), name="stop-asked")
                # The runtime stopped by its own failure (or a refused key).
                ended = tasks.create_task(runtime.finished.wait(), name="agent-finished")
                await asyncio.wait((asked, ended), return_when=asyncio.FIRST_COMPLETED)
                asked.cancel()
                ended.cancel()
        finally:
            await runtime.stop(leave=self._leave)
        if runtime.refused is not None:
            raise runtime.refused
        if runtime.failure is not None:
            raise AgentError("the agent's timer task failed") from runtime.failure

    def _on_change(self, change: Change) -> None:
        if self._changes.full():
            self._changes.get_nowait()
        self._changes.put_nowait(change)
        self._last_change = change
        with self._rank_assigned:
            self._rank_assigned.notify_all()
        for callback in list(self._callbacks):
            try:
                callback(change)
            except Exception:  # the host's code: it must not stop the agent
                log.exception("on_change callback %r failed", callback)

    def _assignment(self) -> Change | None:
        change = self._last_change
        if change is None:
            return None
        if change.plan.action == "stop":
            return change
        return change if change.configuration.rank_of(self.member_id) is not None else None

    def _finished(self) -> bool:
        runtime = self._runtime
        thread = self._thread
        return (runtime is None or runtime.stopped or runtime.role == "removed"
                or thread is None or not thread.is_alive())

    def _live(self) -> AgentRuntime:
        runtime = self._runtime
        if runtime is None:
            raise AgentError(f"the agent is not running: {self._error!r}")
        return runtime

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            raise AgentError("the agent is not running")
        loop.call_soon_threadsafe(fn, *args)

    def _call(self, coro_fn: Callable[[], Any], timeout_s: float) -> Any:
        loop = self._loop
        if loop is None or loop.is_closed():
            raise AgentError("the agent is not running")
        future = asyncio.run_coroutine_threadsafe(coro_fn(), loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the agent did not answer within {timeout_s} s") from None


def _exit_refused(member_id: int, refused: KeyNotAccepted) -> None:
    """End the process: one line (one write: the launcher's children share its stderr), then
    ``os._exit`` without the interpreter's teardown, as a member out of the job does
    (:func:`torchpass_p2p.collective.exit_process`)."""
    sys.stderr.write(f"torchpass_p2p: member {member_id:016x}: {refused} (docs/running.md, "
                     f"\"Keys\"); exit code {EXIT_KEY_REFUSED}\n")
    sys.stderr.flush()
    logging.shutdown()
    sys.stdout.flush()
    os._exit(EXIT_KEY_REFUSED)


async def _on_loop(fn: Callable[[], Any]) -> Any:
    return fn()
