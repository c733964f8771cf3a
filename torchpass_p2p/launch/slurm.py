"""A job step of Slurm: ``--nodes``, ``--node-rank`` and ``--run-id`` from its environment.

``srun --ntasks-per-node=1 torchpass-p2p launch ...`` starts one launcher on every node of
the step. Each reads what Slurm exports to a task (``srun(1)``, OUTPUT ENVIRONMENT VARIABLES):

- the step's nodes, ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``) in Slurm's compressed
  hostlist form (``gpu[01-03,07],login1``), expanded by ``scontrol show hostnames`` when
  ``scontrol`` is on ``PATH``, else by :func:`expand_hostlist`; their count is checked against
  ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES``, ``SLURM_JOB_NUM_NODES``);
- each node's address: its ``NodeAddr`` (``scontrol show node``; Slurm's own way to reach it,
  the node name unless slurm.conf says otherwise), resolved to an IP address here, since
  configuration 0 carries addresses and a host name would be looked up at every send;
- this node's position among them, ``SLURM_NODEID``;
- the run id ``slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>``: the same on every node of the step,
  a new one for every step (member ids derive from it: :func:`.plan.node_member_id`).

Nothing else is taken from Slurm: ``--nproc`` (ranks per node), ``--base-port`` and the shared
``--key-file`` stay the user's (docs/running.md, "Slurm"). Explicit options win over the
environment. A step of one node launches as on one host, without ``--nodes``.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "SCONTROL_TIMEOUT_S",
    "SlurmError",
    "SlurmStep",
    "Placement",
    "expand_hostlist",
    "node_addresses",
    "place",
    "read_step",
    "resolve_address",
    "step_hostnames",
]

SCONTROL_TIMEOUT_S = 30.0
"""Longest wait for one ``scontrol`` call: ``show hostnames`` is local, ``show node`` asks
slurmctld, which answers within ``MessageTimeout`` (slurm.conf default 10 s) unless it is down."""

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class SlurmError(Exception):
    """Slurm's environment cannot place this launcher (inconsistent variables, a launcher
    outside a job step of a multi-node job, an unresolvable node); the message is for the
    user."""


@dataclass(frozen=True)
class SlurmStep:
    """What Slurm exported to this task: the job and step ids (``step_id`` None outside a
    step, in the batch script), the step's compressed node list and the variable it came from,
    the node count Slurm states, this node's index in the list, and the step's task count
    (None when not exported)."""

    job_id: str
    step_id: str | None
    nodelist: str
    nodelist_from: str
    num_nodes: int | None
    node_id: int
    tasks: int | None

    @property
    def run_id(self) -> str:
        """``slurm-<job>.<step>``, or ``slurm-<job>`` outside a step."""
        return f"slurm-{self.job_id}" + (f".{self.step_id}" if self.step_id is not None else "")


@dataclass(frozen=True)
class Placement:
    """The launcher's multi-node options after Slurm's environment filled those not given:
    ``nodes`` (addresses, empty for one host), ``node_rank``, ``run_id``, and ``sources``:
    one ``--option value (VARIABLE)`` line per value that came from Slurm, for the log."""

    nodes: tuple[str, ...]
    node_rank: int
    run_id: str
    sources: tuple[str, ...]


def read_step(environ: Mapping[str, str]) -> SlurmStep | None:
    """This task's Slurm job step from ``environ``, or None outside a Slurm job (no
    ``SLURM_JOB_ID``).

    Raises:
        SlurmError: a variable the step needs is missing or not a number.
    """
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None
    step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or None
    nodelist, nodelist_from = "", ""
    for name in (("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                 if step_id is not None else ("SLURM_JOB_NODELIST", "SLURM_NODELIST")):
        if environ.get(name):
            nodelist, nodelist_from = environ[name], name
            break
    if not nodelist:
        raise SlurmError(f"SLURM_JOB_ID={job_id} but no SLURM_STEP_NODELIST or "
                         "SLURM_JOB_NODELIST")
    counts = (("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
              if step_id is not None else ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"))
    return SlurmStep(job_id, step_id, nodelist, nodelist_from,
                     _number(environ, counts), _number(environ, ("SLURM_NODEID",)) or 0,
                     _number(environ, ("SLURM_STEP_NUM_TASKS",) if step_id is not None else ()))


def place(
    environ: Mapping[str, str],
    *,
    nodes: Sequence[str] = (),
    node_rank: int | None = None,
    run_id: str | None = None,
    scontrol: str | None = None,
) -> Placement:
    """``nodes``, ``node_rank`` and ``run_id`` as given (None or empty: not given), the rest
    from Slurm's environment ``environ`` when this is a Slurm job step. ``scontrol``: its path,
    run with ``environ`` (default: found on ``PATH``; ``""``: none, the node list is expanded
    here and each node's name is its address).

    Outside Slurm, or in a step of one node, nothing is filled but the run id (node rank 0).

    Raises:
        SlurmError: the environment names several nodes but this is not one launcher per node
            of a job step, or a node's address cannot be had (see :func:`node_addresses`).
    """
    step = read_step(environ)
    sources: list[str] = []
    if step is None:
        return Placement(tuple(nodes), node_rank or 0, run_id or "", ())
    if not run_id:
        run_id = step.run_id
        sources.append(f"--run-id {run_id} (SLURM_JOB_ID"
                       + (", SLURM_STEP_ID)" if step.step_id is not None else ")"))
    if nodes:
        if node_rank is None:
            node_rank = step.node_id
            sources.append(f"--node-rank {node_rank} (SLURM_NODEID)")
        return Placement(tuple(nodes), node_rank, run_id, tuple(sources))
    scontrol = scontrol if scontrol is not None else shutil.which("scontrol")
    names = step_hostnames(step, scontrol, environ)
    if len(names) < 2:
        return Placement((), node_rank or 0, run_id, tuple(sources))
    if step.step_id is None:
        raise SlurmError(f"{step.nodelist_from} names {len(names)} nodes but this is the batch "
                         "script, not a job step: start one launcher per node with "
                         "'srun --ntasks-per-node=1 torchpass-p2p launch ...'")
    if step.tasks is not None and step.tasks != len(names):
        raise SlurmError(f"{step.tasks} tasks on {len(names)} nodes (SLURM_STEP_NUM_TASKS): "
                         "one launcher per node, 'srun --ntasks-per-node=1'")
    if not 0 <= step.node_id < len(names):
        raise SlurmError(f"SLURM_NODEID={step.node_id} outside {step.nodelist}")
    addresses = node_addresses(names, scontrol, environ)
    how = "NodeAddr, scontrol show node" if scontrol else "node names resolved"
    sources.append(f"--nodes {','.join(addresses)} ({step.nodelist_from}={step.nodelist}; {how})")
    if node_rank is None:
        node_rank = step.node_id
        sources.append(f"--node-rank {node_rank} (SLURM_NODEID; node {names[node_rank]})")
    return Placement(tuple(addresses), node_rank, run_id, tuple(sources))


def step_hostnames(step: SlurmStep, scontrol: str | None,
                   env: Mapping[str, str] | None = None) -> list[str]:
    """The step's node names in Slurm's order: ``scontrol show hostnames`` when ``scontrol``
    is given (run with ``env``, default this process's), else :func:`expand_hostlist`.

    Raises:
        SlurmError: the list does not parse, ``scontrol`` fails, or the count differs from the
            one Slurm states.
    """
    try:
        if scontrol:
            names = _scontrol(scontrol, env, "show", "hostnames", step.nodelist).split()
        else:
            names = expand_hostlist(step.nodelist)
    except ValueError as exc:
        raise SlurmError(f"{step.nodelist_from}: {exc}") from None
    if not names:
        raise SlurmError(f"{step.nodelist_from}={step.nodelist} names no node")
    if step.num_nodes is not None and step.num_nodes != len(names):
        raise SlurmError(f"{step.nodelist_from}={step.nodelist} names {len(names)} nodes, "
                         f"Slurm says {step.num_nodes}")
    if len(set(names)) != len(names):
        raise SlurmError(f"{step.nodelist_from}={step.nodelist} names a node twice")
    return names


def node_addresses(names: Sequence[str], scontrol: str | None,
                   env: Mapping[str, str] | None = None) -> list[str]:
    """Each node's IP address: its ``NodeAddr`` from ``scontrol show node`` (run with ``env``,
    default this process's; without ``scontrol``, its name), resolved by
    :func:`resolve_address`.

    Raises:
        SlurmError: ``scontrol`` fails or omits a node, a name does not resolve, or a node name
            resolves to a loopback address (a host's own name often does, in ``/etc/hosts``:
            every host would then put another address for it in configuration 0), or two
            nodes share an address.
    """
    addrs = {name: name for name in names}
    if scontrol:
        try:
            text = _scontrol(scontrol, env, "show", "node", "--oneliner", ",".join(names))
        except ValueError as exc:
            raise SlurmError(str(exc)) from None
        found = dict(re.findall(r"(?:^|\s)NodeName=(\S+).*?\sNodeAddr=(\S+)", text, re.M))
        missing = [n for n in names if n not in found]
        if missing:
            raise SlurmError(f"scontrol show node: no NodeAddr for {', '.join(missing)}")
        addrs = {name: found[name] for name in names}
    out = []
    for name in names:
        address = resolve_address(addrs[name])
        if address != addrs[name] and ipaddress.ip_address(address).is_loopback:
            raise SlurmError(f"node {name} ({addrs[name]}) resolves to {address} here, a "
                             "loopback address other hosts cannot reach: fix the name's "
                             "entry (e.g. in /etc/hosts) or give --nodes with addresses")
        out.append(address)
    if len(set(out)) != len(out):
        raise SlurmError(f"two nodes share an address: {', '.join(out)}")
    return out


def resolve_address(host: str) -> str:
    """``host`` as an IP address: itself if it is one, else its first IPv4 address from the
    resolver (``getaddrinfo``), else its first IPv6 one.

    Raises:
        SlurmError: the name does not resolve.
    """
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise SlurmError(f"node {host}: {exc}") from None
    ordered = sorted(infos, key=lambda info: info[0] != socket.AF_INET)  # stable
    return str(ordered[0][4][0])


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> names, in order: comma-separated entries, each a name
    with bracketed ranges, ``a[1-3,07]`` -> a1 a2 a3 a07 (zero padding of a range's start
    kept), several brackets multiplying out left to right, ``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1
    r2n2 (as ``scontrol show hostnames`` writes them: ``hostlist_expression(5)``).

    Raises:
        ValueError: unbalanced brackets, an empty bracket or a range that is not ``lo[-hi]``
            with ``lo <= hi``.
    """
    names: list[str] = []
    for entry in _split_top(text):
        if not entry:
            continue  # "a,,b": scontrol skips it too
        expanded = [""]
        for m in re.finditer(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", entry):
            literal, inner = m[1], m[2]
            choices = [literal] if inner is None else [literal + n for n in _ranges(inner, text)]
            expanded = [e + c for e in expanded for c in choices]
        names += expanded
    return names


def _split_top(text: str) -> list[str]:
    """``text`` split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in host list {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in host list {text!r}")
    parts.append(text[start:].strip())
    return parts


def _ranges(inner: str, text: str) -> list[str]:
    out = []
    for item in inner.split(","):
        m = _RANGE.match(item.strip())
        if not m or (m[2] is not None and int(m[2]) < int(m[1])):
            raise ValueError(f"bad range {item!r} in host list {text!r}")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        width = len(m[1])
        out += [str(n).zfill(width) for n in range(lo, hi + 1)]
    return out


def _number(environ: Mapping[str, str], names: Sequence[str]) -> int | None:
    for name in names:
        value = environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise SlurmError(f"{name}={value!r} is not a number") from None
    return None


def _scontrol(scontrol: str, env: Mapping[str, str] | None, *args: str) -> str:
    try:
        done = subprocess.run([scontrol, *args], capture_output=True, text=True,
                              env=None if env is None else dict(env),
                              timeout=SCONTROL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"{scontrol} {' '.join(args)}: {exc}") from None
    # show hostnames exits 0 after "Invalid hostlist: ..." (Slurm 22.05)
    if done.returncode != 0 or "Invalid hostlist" in done.stderr:
        raise ValueError(f"{scontrol} {' '.join(args)}: exit {done.returncode}: "
                         f"{done.stderr.strip()[:200]}")
    return done.stdout
