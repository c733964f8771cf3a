"""A real Slurm cluster on this machine for the launcher's tests: Debian's ``slurmctld``,
``slurmd`` and ``munge``, configured in a temporary folder.

:func:`slurm_or_skip` finds the daemons, and in CI (``CI=true``) installs them with apt first
when they are missing (as :func:`tests.agent.browser.chromium_or_skip` does for Chromium);
elsewhere the test is skipped with the command that installs them. :class:`SlurmCluster` writes
``slurm.conf`` for ``nodes`` virtual nodes sharing this host, a "multiple slurmd" set-up
(https://slurm.schedmd.com/programmer_guide.html#multiple_slurmd_support): every node has its
own ``slurmd -N NAME``, port and spool folder, and its own loopback address as ``NodeAddr``
(127.0.0.1, 127.0.0.2, ...), so that each node's launcher binds its own address as on separate
hosts. It starts ``munged`` on a private socket, ``slurmctld`` and the ``slurmd``s, waits until
every node is idle, and on exit cancels what is left and stops the daemons it started.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import pytest

from tests.launch.procs import free_ports_block

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
APT_INSTALL = ["apt-get", "install", "-y", "-q", "--no-install-recommends",
               "-o", "DPkg::Lock::Timeout=300", *PACKAGES]
INSTALL_TIMEOUT_S = 900.0
EXECUTABLES = ("munged", "slurmctld", "slurmd", "srun", "scontrol", "sinfo", "squeue",
               "scancel")
START_TIMEOUT_S = 60.0
"""Longest wait for every node to register idle (a few seconds on two loaded cores)."""
STOP_TIMEOUT_S = 15.0
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
"""Job states after which a job runs no more (squeue(1), JOB STATE CODES)."""


def slurm_or_skip() -> None:
    """Make sure the daemons and clients are installed: in CI (``CI=true``) with apt as root,
    failing the test if apt fails; elsewhere, or when not root, the test is skipped with the
    reason. Root is needed anyway: ``slurmd`` starts a step's tasks as the submitting user."""
    if os.geteuid() != 0:
        pytest.skip("needs root: slurmd starts a job step's tasks as the submitting user")
    if all(shutil.which(e) for e in EXECUTABLES):
        return
    if os.environ.get("CI") != "true":
        pytest.skip("needs Debian's Slurm (apt-get install --no-install-recommends "
                    f"{' '.join(PACKAGES)}); in CI (CI=true) the test installs it itself")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    output = ""
    for command in (APT_INSTALL, ["apt-get", "update", "-q"], APT_INSTALL):
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S, check=False)
        output += f"$ {' '.join(command)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        if done.returncode == 0 and command is APT_INSTALL:
            break  # installed (the update only runs when the lists were missing or stale)
    missing = [e for e in EXECUTABLES if not shutil.which(e)]
    if missing:
        pytest.fail(f"Slurm could not be installed (missing {missing}):\n{output[-4000:]}")


class SlurmCluster:
    """A Slurm cluster of ``nodes`` virtual nodes ``n1``, ``n2``, ... on this host, node ``i``
    at address ``127.0.0.i``, under ``root`` (config, state, spool, logs). Use as a context
    manager; :meth:`env` is the environment for its clients (``srun``, ``scontrol``)."""

    def __init__(self, root: Path, nodes: int = 2, cpus: int = 2) -> None:
        self.root = root
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.addresses = [f"127.0.0.{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge.sock"

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` without any ``SLURM_*`` variable of an enclosing job, with ``SLURM_CONF``
        naming this cluster's configuration."""
        out = {k: v for k, v in base.items() if not k.startswith("SLURM_")}
        out["SLURM_CONF"] = str(self.conf)
        return out

    def __enter__(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop()

    def wait(self, job: str, timeout_s: float) -> tuple[str, int]:
        """Wait for batch job ``job`` to end; its final state (``COMPLETED``, ``FAILED``...)
        and its batch script's exit code. Polled every 0.5 s (``sbatch --wait`` backs off to
        half a minute between polls).

        Raises:
            AssertionError: still running after ``timeout_s`` seconds (the job is cancelled).
        """
        env = self.env(dict(os.environ))
        deadline = time.monotonic() + timeout_s
        while True:
            done = subprocess.run(["scontrol", "show", "job", "--oneliner", job], env=env,
                                  capture_output=True, text=True, timeout=30, check=True)
            found = re.search(r"\bJobState=(\S+).*?\bExitCode=(\d+):(\d+)", done.stdout)
            if found and found[1] in ENDED:
                return found[1], int(found[2])
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job], env=env, timeout=30, check=False)
                raise AssertionError(f"job {job} still {found and found[1]} after "
                                     f"{timeout_s} s\n{self.logs()}")
            time.sleep(0.5)

    def logs(self, chars: int = 3000) -> str:
        """The daemons' logs, each cut to its last ``chars`` characters (for a failure)."""
        out = []
        for path in sorted((self.root / "log").glob("*")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    # --- internals ---

    def _start(self) -> None:
        root = self.root
        for sub in ("state", "log", *(f"spool/{n}" for n in self.names)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        # -f: run although the temporary folder's permissions are not munged's own choice.
        self._daemon("munged", ["munged", "-F", "-f", f"--socket={self.munge_socket}",
                                f"--key-file={key}", f"--pid-file={root / 'munged.pid'}",
                                f"--log-file={root / 'log' / 'munged.log'}",
                                f"--seed-file={root / 'munged.seed'}"])
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.munge_socket.exists():
            self._check(deadline, "munged's socket")
        ports = free_ports_block(1 + len(self.names), self.addresses)
        self.conf.write_text(self._slurm_conf(ports))
        env = self.env(dict(os.environ))
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)], env)
        for name in self.names:
            self._daemon(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)],
                         env)
        while True:
            done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env,
                                  capture_output=True, text=True, timeout=30, check=False)
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            if sorted(states) == self.names and set(states.values()) == {"idle"}:
                return
            self._check(deadline, f"every node idle (sinfo: {states or done.stderr.strip()})")

    def _slurm_conf(self, ports: int) -> str:
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=torchpass-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ports}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'spool'}/%n/slurmd.pid",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log'}/slurmd-%n.log",
            # No cgroups in a container: processes tracked by parentage, tasks not bound.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "KillWait=5",
            "InactiveLimit=0",
        ]
        for i, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr={address} "
                         f"Port={ports + 1 + i} CPUs={self.cpus} State=UNKNOWN")
        lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _daemon(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.root / "log" / f"{name}.out", "wb") as out:
            self.daemons.append(subprocess.Popen(argv, env=env, stdout=out,
                                                 stderr=subprocess.STDOUT,
                                                 start_new_session=True))

    def _check(self, deadline: float, what: str) -> None:
        for daemon in self.daemons:
            if daemon.poll() is not None:
                raise AssertionError(f"{daemon.args[0]} exited {daemon.returncode} while "
                                     f"waiting for {what}\n{self.logs()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
        time.sleep(0.2)

    def _stop(self) -> None:
        """Cancel every job left (its steps' processes end with it), then SIGTERM each daemon
        this cluster started, in reverse order, SIGKILL after :data:`STOP_TIMEOUT_S`."""
        if self.conf.exists() and any(d.poll() is None for d in self.daemons):
            env = self.env(dict(os.environ))
            subprocess.run(["scancel", "--full", "--user", "root", "--signal", "KILL"],
                           env=env, capture_output=True, timeout=30, check=False)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while time.monotonic() < deadline:
                done = subprocess.run(["squeue", "-h"], env=env, capture_output=True,
                                      text=True, timeout=30, check=False)
                if done.returncode != 0 or not done.stdout.strip():
                    break
                time.sleep(0.2)
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        self.daemons.clear()
