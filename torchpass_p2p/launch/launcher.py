"""The supervisor: start the children, watch them, report deaths, respawn, stop, clean up.

Why one module of this size: every step of the lifecycle below runs in the one ``TaskGroup``
of ``_Supervisor`` and reads the same children table; the parts that need no part of it live
apart (:mod:`.childspec`, :mod:`.children`, :mod:`.evidence`, :mod:`.outcome`, :mod:`.roles`,
:mod:`.rekey`, :mod:`.slurm`).

Lifecycle (one asyncio loop, every task owned by one ``TaskGroup``):

1. *Setup.* A private run directory (mode 0700) receives the key file (mode 0600, unless one is
   given) and, unless the children join through seeds, ``configuration-0.json``.
2. *Start.* One process per member (:mod:`.childspec`), each in its own session, each watched by a
   task that turns its exit into an event on one queue; SIGINT and SIGTERM become events too.
3. *Supervise.* Each exit is recorded. A failure (non-zero exit or death by signal) is posted
   as evidence to every live sibling's status page in a background task (bounded by a 2 s
   deadline per request, never awaited by the loop), and with ``respawn`` the dead process is
   replaced by a new spare joining through the live members; a member that exits
   ``EXIT_DRAINED`` handed its rank over on purpose and is neither reported nor replaced; nor is
   one that exits ``EXIT_STOPPED`` (the job cannot go on: the agreement stopped it, or a
   spare gave up without a majority). The rest get the grace period to exit too; at its end,
   a job in which an agent still holds a rank and reaches a majority goes on (a member whose
   script describes another job than the others' stops alone:
   :class:`torchpass_p2p.JobMismatch`). A second member that stops alone while the job goes
   on (the spare that replaced the first one, refused for the same script) stops the job at
   once: every replacement runs the same script and would be refused as well.
   :func:`.outcome.decide` says when the job is over. Every :data:`QUORUM_CHECK_S` the
   launcher reads the agents' status pages: after a failure, whether a majority of their
   configuration is still alive (:func:`.roles.majority_lost`); when it is not, no
   configuration can be decided again and it stops the job instead of leaving the spares to
   wait. A member that stops the job (``EXIT_STOPPED``) after its give-up time without a
   majority (its peers paused, or on other hosts) is quoted with the counts its page last gave
   (:meth:`.roles.StatusView.no_majority`). Either way the launcher exits ``EXIT_STOPPED``.
4. *Stop.* The signal received (or SIGTERM) goes to every running child's process group,
   followed by SIGCONT so that a stopped child acts on it; after ``grace_s`` seconds the rest
   get SIGKILL. Once the job has completed and every remaining child is idle, the grace ends
   at once: a child stopped by a signal (a member paused past its lease, already removed)
   finishes nothing, nor does one whose agent says it holds no rank (an idle spare, a removed
   member; :mod:`.roles`). A child's process group is killed as soon as the child itself is
   reaped, so its orphans never outlive it.
5. *Cleanup.* The run directory is removed; the exit code comes from :func:`.outcome.exit_code`.

SIGHUP: the key file is read again and every running child's agent asked to read it too
(:mod:`.rekey`; ``docs/running.md``, "Keys"); children started later read it as they start.
A child that exits ``EXIT_KEY_REFUSED`` (the cluster refused its key) is reported but never
respawned: the same key file would be refused again.

Several hosts: run the launcher on every host with the same ``--nodes`` list (every host's
address), ``--run-id``, ``--base-port`` and key file, and each host's ``--node-rank``: every
launcher derives the same configuration 0 (:func:`.plan.nodes_configuration`: member ids are
keyed hashes of run id, node and index) and starts its own host's part, without a rendezvous
host. To add hosts to a running job, run the launcher there with ``--seeds`` naming members of
the job: its children join as spares. Under Slurm, ``srun --ntasks-per-node=1`` starts one
launcher per node and the command line fills these options from the step (:mod:`.slurm`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import stat
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import aiohttp

from torchpass_p2p.agent.bootstrap import write_configuration
from torchpass_p2p.agent.settings import SettingsError, parse_key, read_keyring
from torchpass_p2p.checkpoint import DEFAULT_KEEP, DEFAULT_MTBF_S, CheckpointSettings, Every
from torchpass_p2p.checkpoint.settings import VARIABLES as CHECKPOINT_VARIABLES
from torchpass_p2p.checkpoint.store import (
    NotSameJob,
    checkpoint_path,
    newest_complete,
    same_job,
    steps_on_disk,
)
from torchpass_p2p.config import ConfigError, load_params
from torchpass_p2p.core.configuration import Address
from torchpass_p2p.core.messages import MemberId, Topology, format_member_id
from torchpass_p2p.core.params import Params
from torchpass_p2p.core.seal import Keyring

from .children import Child, become_subreaper, kill_strays
from .childspec import (
    MAX_LABEL_BYTES,
    ChildSpec,
    RunContext,
    child_environment,
    configuration_zero,
    initial_children,
    new_member_ids,
    nodes_configuration,
)
from .evidence import notify_siblings
from .keyfile import (
    KEY_FILE_NAME,
    KeyFileError,
    http_token,
    make_run_dir,
    read_primary_key,
    remove_run_dir,
    sweep_run_dirs,
    write_key_file,
)
from .outcome import (
    EXIT_KEY_REFUSED,
    EXIT_STOPPED,
    JOB_STOPS,
    ChildExit,
    Verdict,
    decide,
    describe_exit,
    exit_code,
    is_failure,
    script_failed,
)
from .ports import Reservation, reserve_ports
from .rekey import check_rotation, describe_keys, reload_children, shared_token
from .roles import (
    IDLE_ROLES,
    ROLE_TIMEOUT_S,
    StatusView,
    ask_status,
    majority_lost,
    vacant_without_spare,
)

__all__ = ["DEFAULT_GRACE_S", "DEFAULT_MAX_RESPAWNS", "LaunchError", "LaunchOptions", "launch"]

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 10.0
"""Seconds between the polite signal and SIGKILL, and the time finishing processes get after
the job completed: enough for a training script to write a last checkpoint shard."""
DEFAULT_MAX_RESPAWNS = 3
"""Respawns per launcher: a script that dies at start would otherwise be restarted forever."""
KILL_WAIT_S = 5.0
"""Seconds to wait for the kernel to reap processes after SIGKILL; past it they are reported
and abandoned (a process in uninterruptible sleep, e.g. stuck in a GPU driver)."""
QUORUM_CHECK_S = 2.0
"""How often the launcher reads its children's status pages: after a failure, whether a
majority of their configuration is still alive (:func:`.roles.majority_lost`), so a job whose
majority died stops within the agents' lease plus this instead of idling until someone kills
it; always, what a fenced member counts reachable, to quote if it stops the job."""
TICK_S = 0.25
STALL_S = 2.0
"""The launcher looks at the clock every ``TICK_S``; a gap over ``STALL_S`` means it did not
run (SIGSTOP, a frozen VM; a busy 2-core host delays a tick by well under a second), so the
exits it reaps within ``STALL_S`` after are of unknown order (:class:`.outcome.ChildExit`)."""
CONFIGURATION_FILE = "configuration-0.json"


class LaunchError(Exception):
    """The launch cannot start (bad options, unreadable key or profile, a script that cannot
    be executed); the message is for the user."""


@dataclass(frozen=True)
class LaunchOptions:
    """What ``torchpass-p2p launch`` was asked to do (see :mod:`torchpass_p2p.cli.launch`).

    ``base_port``: process ``i`` binds ``base_port + i`` (respawns continue the count); ``None``
    picks free ports. ``seeds``: join through these members instead of writing configuration 0.
    ``topology``: ``None`` is this host's name with no domain. ``grace_s`` in seconds.
    ``nodes``: every host's address, the same list on every host, for a job over several hosts
    (this one is ``nodes[node_rank]``; needs ``base_port``, a shared ``key_file`` and ``run_id``).
    ``checkpoint_dir``: last-resort checkpoints there (``docs/checkpoints.md``; needs
    ``run_id``), every ``checkpoint_every`` (:class:`~torchpass_p2p.checkpoint.Every`), keeping
    ``checkpoint_keep``; ``mtbf_correlated_s``: seconds between correlated failures, for
    Young's interval.
    """

    script: str
    script_args: tuple[str, ...] = ()
    nproc: int = 1
    spares: int = 0
    host: str = "127.0.0.1"
    base_port: int | None = None
    seeds: tuple[Address, ...] = ()
    topology: Topology | None = None
    key_file: str | None = None
    profile: str | None = None
    cluster: str = "torchpass"
    respawn: bool = False
    max_respawns: int = DEFAULT_MAX_RESPAWNS
    grace_s: float = DEFAULT_GRACE_S
    nodes: tuple[str, ...] = ()
    node_rank: int = 0
    run_id: str = ""
    checkpoint_dir: str | None = None
    checkpoint_every: str = "auto"
    checkpoint_keep: int = DEFAULT_KEEP
    mtbf_correlated_s: float = DEFAULT_MTBF_S
    python: str = field(default=sys.executable)

    def __post_init__(self) -> None:
        if self.nproc < 0 or self.spares < 0 or self.nproc + self.spares < 1:
            raise LaunchError("--nproc and --spares must be >= 0 and start at least one process")
        if self.nproc < 1 and not self.seeds:
            raise LaunchError("--nproc must be >= 1 (without --seeds there is no job to join)")
        if self.max_respawns < 0 or not self.grace_s >= 0:
            raise LaunchError("--max-respawns and --grace must be >= 0")
        last = (self.base_port or 1) + self.nproc + self.spares + self.max_respawns
        if self.base_port is not None and not (0 < self.base_port and last <= 65536):
            raise LaunchError("--base-port: every process's port must be in 1..65535")
        if self.nodes:
            if self.seeds:
                raise LaunchError("--nodes and --seeds exclude each other")
            if not 0 <= self.node_rank < len(self.nodes):
                raise LaunchError(f"--node-rank must be in 0..{len(self.nodes) - 1}")
            if self.host != self.nodes[self.node_rank]:
                raise LaunchError("--host must be this host's entry in --nodes")
            if self.base_port is None or not self.run_id or self.key_file is None:
                raise LaunchError("--nodes needs --base-port, --run-id and --key-file, the "
                                  "same on every host")
        if self.checkpoint_dir is not None:
            if not self.run_id:
                raise LaunchError("--checkpoint-dir needs --run-id: a resume checks that the "
                                  "checkpoints are of the same run")
            try:
                self.checkpoints(None)
            except ValueError as exc:
                raise LaunchError(str(exc)) from None

    def checkpoints(self, resume_step: int | None) -> CheckpointSettings:
        """The children's checkpoint settings. Raises ``ValueError`` for a bad interval, keep
        count or MTBF."""
        assert self.checkpoint_dir is not None
        return CheckpointSettings(os.path.abspath(self.checkpoint_dir), self.run_id,
                                  Every.parse(self.checkpoint_every), self.checkpoint_keep,
                                  self.mtbf_correlated_s, resume_step)

    @property
    def joining(self) -> bool:
        return bool(self.seeds)


async def launch(options: LaunchOptions, *, environ: Mapping[str, str] | None = None) -> int:
    """Run the job described by ``options`` until it is over; returns the exit code
    (:func:`.outcome.exit_code`). ``environ`` (default ``os.environ``) is the base of every
    child's environment and may supply ``TORCHPASS_KEY_FILE`` or ``TORCHPASS_KEY``.

    Raises:
        LaunchError: the job could not start; every child already started has been killed.
    """
    supervisor = _Supervisor(options, dict(os.environ if environ is None else environ))
    try:
        return await supervisor.run()
    except BaseExceptionGroup as group:  # the TaskGroup wraps what its body raised
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], LaunchError):
            raise group.exceptions[0] from None
        raise


@dataclass(frozen=True)
class _Exited:
    child: Child
    returncode: int


@dataclass(frozen=True)
class _Signalled:
    signum: int


class _Supervisor:
    def __init__(self, options: LaunchOptions, environ: dict[str, str]) -> None:
        self.options = options
        # The checkpoint settings come from the options alone (_checkpoints).
        self.environ = {k: v for k, v in environ.items() if k not in CHECKPOINT_VARIABLES}
        self.events: asyncio.Queue[_Exited | _Signalled] = asyncio.Queue()
        # Unbounded but finite: at most one exit per child (N + S + max_respawns) plus the
        # signals a person sends.
        self.children: list[Child] = []
        self.watchers: dict[Child, asyncio.Task[None]] = {}
        self.ticked_at = time.monotonic()  # the launcher ran then (_tick)
        self.stalled_until = -math.inf  # exits reaped before then are of unknown order
        self.exits: list[ChildExit] = []
        self.recorded: set[int] = set()  # pids whose exit is in ``exits``
        self.said: set[str] = set()  # hints logged once
        self.respawns = 0
        self.stopped_by: int | None = None
        self.gave_up: str | None = None  # why no majority can form again (roles.majority_lost)
        self.stopped_alone: list[str] = []  # members that exited EXIT_STOPPED as the job went on
        self.mismatch: str | None = None  # why every replacement would be refused (_supervise)
        self.views: dict[int, StatusView] = {}  # each child's last status answer, by pgid
        self.evidence: set[asyncio.Task[int]] = set()
        self.reserved: dict[MemberId, tuple[Reservation, Reservation]] = {}
        """Each child's gossip and status ports, bound until the child holds them (ports.py)."""
        self.rekeying: asyncio.Task[None] | None = None
        """The key reload a SIGHUP started (:meth:`_reload_keys`), if any."""
        self.started: dict[MemberId, float] = {}
        """When each child was started (``time.monotonic()`` as its start began:
        ``CLOCK_MONOTONIC``, which its agent reads too). Each child is told those up to its own
        (``TORCHPASS_STARTED``): its agent accuses none of them before
        ``Params.start_grace_s`` after their start unless it has heard from them, nor one started
        after it before that long after its own agent started (a loaded host starts one
        process seconds after another)."""

    # --- setup ---

    async def run(self) -> int:
        if not os.path.isfile(self.options.script):
            raise LaunchError(f"{self.options.script}: no such script")
        for gone in sweep_run_dirs():
            log.info("removed %s, left by a launcher that was killed", gone)
        self.run_dir = make_run_dir()
        become_subreaper()  # descendants that leave their group come back to us (children.py)
        loop = asyncio.get_running_loop()
        try:
            key, self.key_file = self._key()
            self.token = http_token(key)
            self.keyring = self._keyring()
            self.run_context, specs = self._plan()
            self._checkpoints()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.events.put_nowait, _Signalled(sig))
            loop.add_signal_handler(signal.SIGHUP, self._hangup)
            async with aiohttp.ClientSession() as self.session, asyncio.TaskGroup() as tasks:
                self.tasks = tasks
                ticker = tasks.create_task(self._tick(), name="tick")
                for spec in specs:
                    await self._start(spec, seeds=self.options.seeds)
                await self._supervise()
                ticker.cancel()
                for task in self.evidence:  # nobody is left to tell
                    task.cancel()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            await self._kill_all()  # only does something when an error cut the run short
            for held in self.reserved.values():  # children never started
                for reservation in held:
                    reservation.close()
            strays = self._kill_strays()
            if strays:
                log.warning("killed %d stray process(es) left by the children: pid(s) %s",
                            len(strays), ", ".join(map(str, strays)))
            remove_run_dir(self.run_dir)
        code, reason = exit_code(self.exits, stopped_by=self.stopped_by, gave_up=self.gave_up,
                                 mismatch=self.mismatch)
        log.info("exit code %d: %s", code, reason)
        return code

    def _key(self) -> tuple[bytes, str]:
        """The primary key and the key file path the children read."""
        path = self.options.key_file or self.environ.get("TORCHPASS_KEY_FILE") or None
        try:
            if path is not None:
                path = os.path.abspath(path)
                key = read_primary_key(path)
                if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                    log.warning("key file %s is readable by others; use mode 0600", path)
                return key, path
            own = str(self.run_dir / KEY_FILE_NAME)
            text = self.environ.get("TORCHPASS_KEY")
            if text:
                return write_key_file(own, _hex_key(text)), own
        except (OSError, KeyFileError) as exc:
            raise LaunchError(f"cluster key: {exc}") from exc
        if self.options.joining:
            raise LaunchError("joining through --seeds needs the cluster's key: --key-file")
        return write_key_file(own), own

    def _keyring(self) -> Keyring:
        try:
            return read_keyring(self.key_file)
        except (OSError, SettingsError, ValueError) as exc:
            raise LaunchError(f"cluster key: {exc}") from exc

    # --- key rotation ---

    def _hangup(self) -> None:
        """SIGHUP: reload the keys (:mod:`.rekey`), in an owned task; one at a time."""
        tasks = getattr(self, "tasks", None)
        if tasks is None:
            log.warning("SIGHUP before the children started: their agents read the key file as "
                        "they start")
            return
        if self.rekeying is not None and not self.rekeying.done():
            log.warning("SIGHUP: a key reload is still in progress; send it again after it")
            return
        self.rekeying = tasks.create_task(self._reload_keys(), name="reload-keys")

    async def _reload_keys(self) -> None:
        """Read the key file; if it keeps a key shared with the keys in use, ask every running
        child's agent to reload it and say, in one line, how many did."""
        try:
            new = read_keyring(self.key_file)
        except (OSError, SettingsError, ValueError) as exc:
            log.error("SIGHUP: key file not reloaded, the members keep %s: %s",
                      describe_keys(self.keyring), exc)
            return
        refused = check_rotation(self.keyring, new)
        if refused is not None:
            log.error("SIGHUP: key file not reloaded: %s", refused)
            return
        token = shared_token(self.keyring, new)
        asked = [c for c in self._running() if not c.stopped]
        answers = await reload_children(self.session, [("127.0.0.1", c.spec.status_port)
                                                      for c in asked], token)
        self.keyring, self.token = new, http_token(new)
        failed = []
        for child, answer in zip(asked, answers, strict=True):
            if isinstance(answer, str) or not answer.get("reloaded"):
                why = answer if isinstance(answer, str) else answer.get("reason")
                failed.append(f"{child.spec.name}: {why}")
        log.info("key file reloaded: %s; %d of %d running process(es) reloaded it%s",
                 describe_keys(new), len(asked) - len(failed), len(asked),
                 "" if not failed else " (not: " + "; ".join(failed) + ")")

    def _checkpoints(self) -> None:
        """Say where checkpoints go and whether the job resumes, and from which step: the
        newest complete checkpoint in ``--checkpoint-dir``, when it is of this run id and
        world size (the ranks check the rest of the job when they load it).

        Raises:
            LaunchError: the directory cannot be made or read, or its newest complete
                checkpoint is of another run or world size.
        """
        o = self.options
        if o.checkpoint_dir is None:
            return
        settings = o.checkpoints(None)
        directory = settings.directory
        try:
            os.makedirs(directory, exist_ok=True)
            marker = newest_complete(directory)
            on_disk = steps_on_disk(directory)
        except OSError as exc:
            raise LaunchError(f"--checkpoint-dir: {exc}") from exc
        log.info("checkpoints: to %s %s, keeping the newest %d", directory,
                 settings.every.describe(settings.mtbf_s), settings.keep)
        skipped = [s for s in on_disk if marker is None or s > marker.step]
        if skipped:
            log.warning("ignoring %d incomplete checkpoint(s) in %s (step(s) %s): no marker, "
                        "never resumed from", len(skipped), directory,
                        ", ".join(map(str, skipped)))
        if marker is None:
            log.info("no complete checkpoint in %s: run %s starts at step 0", directory,
                     o.run_id)
        elif o.joining:
            log.info("joining through --seeds: the members hold the state; the checkpoint of "
                     "step %d is not loaded", marker.step)
            marker = None
        else:
            try:
                same_job(marker, run_id=o.run_id, world_size=self.run_context.world_size)
            except NotSameJob as exc:
                raise LaunchError(f"--checkpoint-dir {directory}: {exc}; use another "
                                  "--checkpoint-dir, or the run's own --run-id and size") from None
            log.info("resuming run %s at step %d from %s (saved %s, %d bytes)", o.run_id,
                     marker.step, checkpoint_path(directory, marker.step),
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(marker.saved_at)),
                     marker.total_bytes)
        settings = o.checkpoints(None if marker is None else marker.step)
        self.environ.update(settings.to_env())

    def _plan(self) -> tuple[RunContext, list[ChildSpec]]:
        o = self.options
        params = Params()
        profile = None
        if o.profile is not None:
            profile = os.path.abspath(o.profile)
            try:
                params = load_params(profile)
            except (ConfigError, OSError) as exc:
                raise LaunchError(f"--config: {exc}") from exc
        topology = o.topology or Topology(_host_label())
        total = o.nproc + o.spares
        if o.nodes:
            return self._plan_nodes(params, profile)
        ports = [0 if o.base_port is None else o.base_port + i for i in range(total)]
        held = self._reserve([(o.host, port) for port in ports])
        specs = initial_children(new_member_ids(total), o.host, [g.port for g, _ in held],
                                 [s.port for _, s in held], o.nproc, joining=o.joining)
        self.reserved = {spec.member_id: h for spec, h in zip(specs, held, strict=True)}
        configuration = None
        if not o.joining:
            configuration = str(self.run_dir / CONFIGURATION_FILE)
            config = configuration_zero(specs, topology, observers=params.observers)
            write_configuration(configuration, config)
            log.info("configuration 0: %d rank(s), %d spare(s) in %s", o.nproc, o.spares,
                     configuration)
        run = RunContext(o.cluster, self.key_file, str(self.run_dir), topology, o.nproc,
                         configuration=configuration, profile=profile)
        return run, specs

    def _plan_nodes(self, params: Params,
                    profile: str | None) -> tuple[RunContext, list[ChildSpec]]:
        """This host's part of a job over ``--nodes``: configuration 0 as every launcher
        computes it, and the processes of node ``--node-rank``."""
        o = self.options
        assert o.base_port is not None
        try:
            config, per_node = nodes_configuration(
                read_primary_key(self.key_file), o.run_id, o.nodes, nproc=o.nproc,
                spares=o.spares, base_port=o.base_port, observers=params.observers)
        except (ValueError, OSError, KeyFileError) as exc:
            raise LaunchError(f"--nodes: {exc}") from exc
        configuration = str(self.run_dir / CONFIGURATION_FILE)
        write_configuration(configuration, config)
        log.info("configuration 0: %d rank(s), %d spare(s) on %d host(s); this is host %d (%s)",
                 config.world_size, len(config.spares), len(o.nodes), o.node_rank,
                 o.nodes[o.node_rank])
        specs = per_node[o.node_rank]
        held = self._reserve([spec.bind for spec in specs])
        mine = [replace(spec, status_port=s.port) for spec, (_, s) in zip(specs, held, strict=True)]
        self.reserved = {spec.member_id: h for spec, h in zip(mine, held, strict=True)}
        run = RunContext(o.cluster, self.key_file, str(self.run_dir),
                         Topology(o.nodes[o.node_rank]), config.world_size,
                         configuration=configuration, profile=profile, local_world_size=o.nproc)
        return run, mine

    @staticmethod
    def _reserve(binds: Sequence[Address]) -> list[tuple[Reservation, Reservation]]:
        """For each child to start at ``(host, port)`` (port 0: any free one), its gossip port
        there and a status port on loopback, held until :meth:`_start` hands them over (or
        :meth:`run` ends). Nothing stays held when one cannot be had.

        Raises:
            LaunchError: a port is taken or none is free.
        """
        held: list[Reservation] = []
        try:
            for host, port in binds:
                held += reserve_ports(1, host, ports=None if port == 0 else [port])
            held += reserve_ports(len(binds), "127.0.0.1", udp=False)
        except OSError as exc:
            for reservation in held:
                reservation.close()
            raise LaunchError(f"ports: {exc}") from exc
        return list(zip(held[:len(binds)], held[len(binds):], strict=True))

    async def _start(self, spec: ChildSpec, *, seeds: Sequence[Address]) -> None:
        """Start ``spec``'s process with its reserved sockets (then released here)."""
        gossip, status = self.reserved.pop(spec.member_id)
        self.started[spec.member_id] = time.monotonic()  # (the record is never empty)
        env = child_environment(spec, self.run_context, seeds=seeds, base=self.environ,
                                bind_fds=gossip.fds, status_fd=status.fds[0],
                                started=self.started)
        argv = [self.options.python, self.options.script, *self.options.script_args]
        try:
            child = await Child.start(spec, argv, env, pass_fds=(*gossip.fds, *status.fds))
        except OSError as exc:
            raise LaunchError(f"cannot start {self.options.python}: {exc}") from exc
        finally:
            gossip.close()
            status.close()
        self.children.append(child)
        self.watchers[child] = self.tasks.create_task(self._watch(child),
                                                      name=f"watch {spec.name}")
        log.info("started %s: pid %d, %s:%d, status page 127.0.0.1:%d", spec.name,
                 child.process.pid, *spec.bind, spec.status_port)

    async def _watch(self, child: Child) -> None:
        returncode = await child.wait()
        # Orphans of a dead child are of no use and may hold a GPU or a port (scenario S13).
        left = sorted({*child.kill_group(), *self._kill_strays()})
        if left:
            log.warning("%s left %d process(es) behind; killed pid(s) %s", child.spec.name,
                        len(left), ", ".join(map(str, left)))
        self.events.put_nowait(_Exited(child, returncode))

    def _kill_strays(self) -> list[int]:
        return kill_strays({c.process.pid for c in self.children})

    # --- supervise ---

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        finish_at: float | None = None
        # Next look at the agents: for a lost majority (after a failure), and for what a
        # member without a majority will say it stops for (its peers may only be paused).
        check_at: float | None = loop.time() + QUORUM_CHECK_S
        stop_grace = False  # finish_at is the grace after an EXIT_STOPPED
        while True:
            try:
                async with asyncio.timeout_at(_earliest(finish_at, check_at)):
                    event = await self.events.get()
            except TimeoutError:
                if check_at is not None and loop.time() >= check_at:
                    self.gave_up = await self._majority_lost()
                    if self.gave_up is None:
                        check_at = loop.time() + QUORUM_CHECK_S
                        continue
                    failed = None if any(c.spec.rank is not None for c in self._running()) \
                        else script_failed(self.exits)
                    log.warning("%s; %s; stopping the remaining processes", self.gave_up,
                                JOB_STOPS if failed is None else failed)
                else:
                    if stop_grace and (training := await self._training()) is not None:
                        # A member stopped alone (its script described another job than
                        # the others': refused at its join); the others train on. The look
                        # at the agents resumes: a rank it left vacant may have no spare.
                        alone = self.stopped_alone[-1]
                        log.info("%s stopped alone (refused at its join: its script describes "
                                 "another job than the others', as its last line says); %s: "
                                 "the job goes on", alone, training)
                        finish_at, stop_grace, self.gave_up = None, False, None
                        check_at = loop.time() + QUORUM_CHECK_S
                        continue
                    log.info("grace period over; stopping the remaining processes")
                await self._stop(signal.SIGTERM)
                return
            if isinstance(event, _Signalled):
                self.stopped_by = event.signum
                log.info("received %s; forwarding it to every process",
                         signal.Signals(event.signum).name)
                await self._stop(event.signum)
                return
            self._record(event)
            if (event.returncode == EXIT_STOPPED and finish_at is None
                    and not any(e.returncode == 0 for e in self.exits)):
                # The job cannot go on: when the agreement stopped it every member learns it
                # and exits on its own; what is left after the grace (a spare respawned
                # meanwhile, say) would only wait. A member left without a majority said
                # so in its last status answer: say it here too, with its counts.
                view = self.views.get(event.child.pgid)
                lost = None if view is None else view.no_majority()
                if lost is None and self.stopped_alone:
                    # A member stopped alone before and the job went on: this one (most
                    # likely the spare that took its rank) is refused too. Every
                    # replacement runs the same script with the same arguments and the
                    # refusal is deterministic, so waiting for another only hangs the job.
                    self.mismatch = (
                        f"{self.stopped_alone[0]} and then {event.child.spec.name}, which "
                        "replaced it, were refused at their join: the script describes "
                        "another job on that rank than on the others (their last lines above "
                        "say what differs); every replacement runs the same script and would "
                        "be refused too: the job stops; make every rank describe the same "
                        "job (epochs, dataset, model, seed, ...)")
                    log.warning("%s; stopping the remaining processes", self.mismatch)
                    await self._stop(signal.SIGTERM)
                    return
                self.stopped_alone.append(event.child.spec.name)
                if lost is not None:
                    self.gave_up = lost
                    log.warning("%s stopped the job: %s; %s; waiting up to %.1f s for the "
                                "rest", event.child.spec.name, lost, JOB_STOPS,
                                self.options.grace_s)
                else:
                    log.info("%s stopped the job; waiting up to %.1f s for the rest (unless "
                             "it stopped alone: refused at its join, the others train on)",
                             event.child.spec.name, self.options.grace_s)
                finish_at = loop.time() + self.options.grace_s
                stop_grace = True
            if is_failure(event.returncode) and not event.child.signalled:
                self._report(event)
                if finish_at is None:
                    await self._maybe_respawn(event.child)
            verdict, reason = decide(
                self.exits, running=len(self._running()),
                running_ranks=sum(c.spec.rank is not None for c in self._running()),
                joining=self.options.joining)
            if verdict is Verdict.DONE:
                log.info("%s", reason)
                await self._collect_exits(self.options.grace_s)  # reaped, not yet recorded
                return
            completed = any(e.returncode == 0 for e in self.exits)
            check_at = None if completed or finish_at is not None else (
                check_at or loop.time() + QUORUM_CHECK_S)
            if completed:
                # The job completed. Checked again at every exit: once the last process still
                # finishing is done, the rest (idle spares, members removed or paused past
                # their lease) finish nothing and would hold the launcher for the whole grace.
                idle = await self._idle(roles_known=verdict is not Verdict.FINISH)
                if idle:
                    log.info("%s; %s, stopping them now", reason, idle)
                    await self._stop(signal.SIGTERM)
                    return
                if verdict is not Verdict.RUN and finish_at is None:
                    log.info("%s; waiting up to %.1f s", reason, self.options.grace_s)
                    finish_at = loop.time() + self.options.grace_s

    def _running(self) -> list[Child]:
        return [c for c in self.children if c.running]

    async def _idle(self, *, roles_known: bool) -> str | None:
        """Why every running child is idle, or None if one may still be finishing
        (:mod:`.roles`). A child that answers is idle if its own agent holds no rank; a child
        stopped by a signal, if the agents that answer no longer give it a rank. A child nobody
        can vouch for (no answer; stopped with nobody to ask) is presumed by how it started
        while roles are known (a spare is idle, a rank is not), and after a failure only a
        stopped one is (most likely a member paused past its lease and removed)."""
        running = self._running()
        asked = [c for c in running if not c.stopped]
        views = dict(zip((c.pgid for c in asked), await ask_status(
            self.session, [("127.0.0.1", c.spec.status_port) for c in asked]), strict=True))
        answers = [v for v in views.values() if v is not None]
        holders = frozenset().union(*(v.rank_holders for v in answers))
        labels = []
        for c in running:
            view = views.get(c.pgid)
            if view is not None:
                idle, label = view.role in IDLE_ROLES, f"{view.role} (per its agent)"
            elif c.stopped and answers:
                idle = format_member_id(c.spec.member_id) not in holders
                label = "stopped by a signal, holding no rank"
            else:
                idle = c.spec.rank is None if roles_known else c.stopped
                label = "stopped by a signal" if c.stopped else "spare (started as one)"
            if not idle:
                return None
            labels.append(label)
        return "idle: " + ", ".join(f"{n} {label}" for label, n in sorted(Counter(labels).items()))

    async def _training(self) -> str | None:
        """Which running child's agent still holds a rank and reaches a majority (a job the
        agreement stopped has none left once its grace is over), or None."""
        asked = [c for c in self._running() if not c.stopped]
        # The grace, not ROLE_TIMEOUT_S, bounds the answer: a member busy in a step on a loaded
        # host answers late, and a page left unanswered must not end a job that goes on.
        views = await ask_status(self.session, [("127.0.0.1", c.spec.status_port)
                                                for c in asked],
                                 timeout_s=max(ROLE_TIMEOUT_S, self.options.grace_s))
        for c, view in zip(asked, views, strict=True):
            if view is not None and view.role == "rank" and not view.fenced:
                return f"{c.spec.name} still holds a rank in configuration {view.config_id}"
        return None

    async def _majority_lost(self) -> str | None:
        """Why no configuration can be decided again (:func:`.roles.majority_lost`), or None.
        It concludes only about a configuration of its own children: with members on other
        hosts, the agents' own deadline ends the wait (:class:`~torchpass_p2p.trainer.Trainer`
        ``give_up_s``). Without ``--respawn``, or with its respawns used, it also says, once,
        why a job waits with a vacant rank and no spare (:func:`.roles.vacant_without_spare`)."""
        asked = [c for c in self._running() if not c.stopped]
        views = await ask_status(self.session, [("127.0.0.1", c.spec.status_port)
                                                for c in asked])
        for c, view in zip(asked, views, strict=True):
            if view is not None:
                self.views[c.pgid] = view
        # A rank is vacant after a failure or a member that stopped alone (EXIT_STOPPED is no
        # failure): the hint is due in either case.
        respawning = self.options.respawn and self.respawns < self.options.max_respawns
        vacant = None if respawning else vacant_without_spare(views)
        if vacant is not None and vacant not in self.said:
            self.said.add(vacant)
            why = (f"and the {self.respawns} respawn(s) of --max-respawns are used"
                   if self.options.respawn else "and --respawn is off")
            log.warning("%s, %s: under policy wait the members wait for a spare to join (start "
                        "one, or launch with --respawn; TORCHPASS_POLICY=shrink trains on with "
                        "fewer ranks) for up to their give-up time, then stop", vacant, why)
        if not any(is_failure(e.returncode) for e in self.exits):
            return None  # nobody exited: every member may still come back (SIGCONT)
        ours = {c.pgid: format_member_id(c.spec.member_id) for c in self.children}
        gone = frozenset(m for pgid, m in ours.items() if pgid in self.recorded)
        return majority_lost(views, gone, frozenset(ours.values()))

    def _record(self, event: _Exited) -> None:
        child = event.child
        if child.pgid in self.recorded:
            return
        self.recorded.add(child.pgid)
        now = time.monotonic()  # before _tick saw the gap, or within STALL_S after it did
        unordered = now - self.ticked_at > STALL_S or now < self.stalled_until
        self.exits.append(ChildExit(child.spec.member_id, child.spec.rank is not None,
                                    event.returncode, by_launcher=child.signalled,
                                    unordered=unordered, name=child.spec.name))
        log.info("%s %s", child.spec.name, describe_exit(event.returncode))

    async def _tick(self) -> None:
        """Notice when this process did not run for a while (module constants TICK_S and
        STALL_S)."""
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            if now - self.ticked_at > STALL_S:
                self.stalled_until = now + STALL_S
                log.warning("the launcher did not run for %.1f s (stopped?): the order of the "
                            "exits it reaps now is unknown", now - self.ticked_at - TICK_S)
            self.ticked_at = now

    def _report(self, event: _Exited) -> None:
        """Post the death as evidence to the live siblings, in the background: certain evidence
        (``exited``), since this launcher reaped the process itself."""
        siblings = [("127.0.0.1", c.spec.status_port) for c in self._running()]
        if not siblings:
            return
        task = self.tasks.create_task(notify_siblings(
            self.session, siblings, event.child.spec.member_id,
            describe_exit(event.returncode), self.token, exited=True))
        self.evidence.add(task)
        task.add_done_callback(self.evidence.discard)

    async def _maybe_respawn(self, dead: Child) -> None:
        o = self.options
        if not o.respawn:
            return
        if dead.process.returncode == EXIT_KEY_REFUSED:
            log.warning("not respawning %s: the cluster refused its key (exit %d), and a "
                        "respawn would read the same key file", dead.spec.name,
                        EXIT_KEY_REFUSED)
            return
        if self.respawns >= o.max_respawns:
            log.warning("not respawning %s: %d respawn(s) used", dead.spec.name, self.respawns)
            return
        seeds = [c.spec.bind for c in self._running()] + list(o.seeds)
        if not seeds:
            log.warning("not respawning %s: no live member to join through", dead.spec.name)
            return
        self.respawns += 1
        port = 0 if o.base_port is None else o.base_port + o.nproc + o.spares + self.respawns - 1
        try:
            [(gossip, status)] = self._reserve([(o.host, port)])
        except LaunchError as exc:
            log.warning("not respawning %s: %s", dead.spec.name, exc)
            return
        (member,) = new_member_ids(1, taken=(c.spec.member_id for c in self.children))
        spec = ChildSpec(member, "spare", None, (o.host, gossip.port), status.port)
        self.reserved[member] = (gossip, status)
        log.info("respawning %s as new %s (%d of %d)", dead.spec.name, spec.name,
                 self.respawns, o.max_respawns)
        try:
            await self._start(spec, seeds=seeds)
        except LaunchError as exc:
            log.warning("respawn failed: %s", exc)

    # --- stop ---

    async def _stop(self, sig: int) -> None:
        """Send ``sig`` to every running child's group, wait up to ``grace_s`` for them, then
        SIGKILL. A second SIGINT or SIGTERM meanwhile skips the rest of the wait."""
        for child in self._running():
            child.send(sig)
        await self._collect_exits(self.options.grace_s)
        await self._kill_all()

    async def _collect_exits(self, within_s: float) -> None:
        """Record exits until every child's is, for at most ``within_s`` seconds or until a
        signal arrives. A child is reaped before its watcher queues the exit (it kills the
        child's group first), so "nothing running" does not mean "every exit recorded": the
        last ones would stay queued, never logged nor counted."""
        deadline = asyncio.get_running_loop().time() + within_s
        while any(c.pgid not in self.recorded for c in self.children):
            try:
                async with asyncio.timeout_at(deadline):
                    event = await self.events.get()
            except TimeoutError:
                return
            if isinstance(event, _Signalled):
                log.info("received %s: waiting no longer", signal.Signals(event.signum).name)
                return
            self._record(event)

    async def _kill_all(self) -> None:
        """SIGKILL every running child's group and wait (at most :data:`KILL_WAIT_S`)."""
        running = self._running()
        if not running:
            return
        for child in running:
            log.info("killing %s", child.spec.name)
            child.send(signal.SIGKILL)
        # Wait on the processes, not on the queue: after an error the watchers are cancelled.
        try:
            async with asyncio.timeout(KILL_WAIT_S), asyncio.TaskGroup() as waits:
                for child in running:
                    waits.create_task(child.wait(), name=f"reap {child.spec.name}")
        except TimeoutError:
            pass  # the survivors are reported below
        for child in running:
            returncode = child.process.returncode
            if returncode is None:
                log.error("%s (pid %d) survived SIGKILL for %.0f s; abandoned",
                          child.spec.name, child.process.pid, KILL_WAIT_S)
                watcher = self.watchers.get(child)
                if watcher is not None:  # else the launch would wait for it forever
                    watcher.cancel()
            else:
                self._record(_Exited(child, returncode))


def _earliest(*deadlines: float | None) -> float | None:
    return min((d for d in deadlines if d is not None), default=None)


def _host_label() -> str:
    name = socket.gethostname() or "localhost"
    return name.encode()[:MAX_LABEL_BYTES].decode(errors="ignore")


def _hex_key(text: str) -> bytes:
    try:
        return parse_key(text.strip(), "TORCHPASS_KEY")
    except SettingsError as exc:
        raise KeyFileError(str(exc)) from None

