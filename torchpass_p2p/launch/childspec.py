"""Pure planning: member ids, roles, addresses, configuration 0 and each child's environment.

Nothing here touches a socket, a file or the clock; :mod:`.launcher` supplies the ports and paths.
Process ``i`` of ``N + S`` holds rank ``i`` when ``i < N`` and is spare ``i - N`` otherwise;
configuration 0 lists the ranks in that order and the spares in start order (docs/design.md section
2). A child started later (a respawn) or on a host that joins through seeds is a spare that joins:
it gets ``TORCHPASS_SEEDS`` and no ``TORCHPASS_CONFIGURATION`` (``AgentSettings.joining``).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from torchpass_p2p.core.configuration import Address, Configuration, Role
from torchpass_p2p.core.messages import MemberId, Topology, format_member_id

__all__ = [
    "ChildSpec",
    "RunContext",
    "child_environment",
    "configuration_zero",
    "format_address",
    "format_topology",
    "initial_children",
    "new_member_ids",
    "node_member_id",
    "nodes_configuration",
    "parse_topology",
]

MAX_LABEL_BYTES = 64
"""Longest host or domain label the wire codec carries (:mod:`torchpass_p2p.agent.bootstrap`)."""

OWNED_VARIABLES = (
    "TORCHPASS_CLUSTER", "TORCHPASS_KEY_FILE", "TORCHPASS_KEY", "TORCHPASS_MEMBER_ID",
    "TORCHPASS_BIND", "TORCHPASS_BIND_FDS", "TORCHPASS_CONFIGURATION", "TORCHPASS_SEEDS",
    "TORCHPASS_STATUS", "TORCHPASS_STATUS_FD",
    "TORCHPASS_PROFILE", "TORCHPASS_TOPOLOGY", "TORCHPASS_ROLE", "TORCHPASS_RUN_DIR",
    "TORCHPASS_LAUNCHER_PID", "TORCHPASS_STARTED", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)
"""Variables the launcher sets or deliberately leaves unset in a child. Values inherited from the
launcher's own environment are removed first, so that a spare never inherits a ``RANK`` and a
respawned child never inherits a ``TORCHPASS_CONFIGURATION`` (nor ``TORCHPASS_KEY``: only the
key file path travels). Other ``TORCHPASS_*`` settings (policy, hang timeout, health) pass."""


@dataclass(frozen=True)
class ChildSpec:
    """One process to start: its member id, role at start, rank (``None`` for a spare), the
    ``(host, port)`` of its gossip socket and the loopback port of its HTTP status page."""

    member_id: MemberId
    role: Role
    rank: int | None
    bind: Address
    status_port: int
    local_rank: int | None = None
    """The rank among this host's ranks (``LOCAL_RANK``); None: ``rank`` (one host)."""

    @property
    def name(self) -> str:
        """``rank 3 (00ab...)`` or ``spare (00ab...)``, for log lines."""
        where = f"rank {self.rank}" if self.rank is not None else "spare"
        return f"{where} ({format_member_id(self.member_id)})"


@dataclass(frozen=True)
class RunContext:
    """What every child of one launcher shares.

    ``configuration`` is the path of configuration 0, or ``None`` when the children join through
    seeds. ``world_size`` is N, the ranks started by this launcher (also ``LOCAL_WORLD_SIZE``:
    one launcher runs on one host). ``profile`` is a TOML parameter file or ``None``.
    """

    cluster: str
    key_file: str
    run_dir: str
    topology: Topology
    world_size: int
    configuration: str | None = None
    profile: str | None = None
    local_world_size: int | None = None
    """Ranks on this host (``LOCAL_WORLD_SIZE``); None: ``world_size`` (one host)."""


def new_member_ids(
    count: int,
    taken: Iterable[MemberId] = (),
    *,
    randbits: Callable[[int], int] = secrets.randbits,
) -> list[MemberId]:
    """``count`` fresh random 64-bit member ids, distinct from each other and from ``taken``
    (member ids are never reused, docs/design.md section 2)."""
    seen = set(taken)
    ids: list[MemberId] = []
    while len(ids) < count:
        member = randbits(64)
        if member not in seen:
            seen.add(member)
            ids.append(member)
    return ids


def initial_children(
    member_ids: Sequence[MemberId],
    host: str,
    ports: Sequence[int],
    status_ports: Sequence[int],
    nproc: int,
    *,
    joining: bool = False,
) -> list[ChildSpec]:
    """The launcher's first processes: process ``i`` holds rank ``i`` for ``i < nproc`` and is a
    spare after that; when ``joining`` (seeds mode) every process is a spare.

    Raises ``ValueError`` if the sequences differ in length or ``nproc`` exceeds them.
    """
    total = len(member_ids)
    if len(ports) != total or len(status_ports) != total or not 0 <= nproc <= total:
        raise ValueError("one member id, port and status port per process; nproc <= processes")
    out = []
    for i, (member, port, status) in enumerate(zip(member_ids, ports, status_ports, strict=True)):
        is_rank = i < nproc and not joining
        out.append(ChildSpec(member, "rank" if is_rank else "spare", i if is_rank else None,
                             (host, port), status))
    return out


def node_member_id(key: bytes, run_id: str, node: int, index: int) -> MemberId:
    """The member id of process ``index`` on node ``node`` of run ``run_id``: keyed BLAKE2b-64
    of the three, so that every host's launcher derives every member's id without talking to
    the others, only holders of the cluster key can, and another run id never reuses one."""
    data = f"{run_id}\0{node}\0{index}".encode()
    digest = hashlib.blake2b(data, key=key, digest_size=8, person=b"torchpass-node")
    return int.from_bytes(digest.digest(), "big")


def nodes_configuration(
    key: bytes, run_id: str, nodes: Sequence[str], *, nproc: int, spares: int, base_port: int,
    observers: int = 10,
) -> tuple[Configuration, list[list[ChildSpec]]]:
    """Configuration 0 of a job over several hosts, and each host's processes, computed alike
    by every host's launcher from the same arguments (no rendezvous host).

    Host ``n`` (``nodes[n]``, its address) runs ``nproc`` ranks, global ranks ``n * nproc ..
    (n + 1) * nproc - 1``, then ``spares`` spares, process ``i`` on port ``base_port + i``.
    Every member's topology host label is its node's address. Status ports are 0 here: each
    launcher picks its own.

    Raises ``ValueError`` for no node, a duplicate node, or two members with one id.
    """
    if not nodes or len(set(nodes)) != len(nodes):
        raise ValueError("nodes: one distinct address per host")
    per_node: list[list[ChildSpec]] = []
    for n, host in enumerate(nodes):
        specs = []
        for i in range(nproc + spares):
            member = node_member_id(key, run_id, n, i)
            is_rank = i < nproc
            specs.append(ChildSpec(member, "rank" if is_rank else "spare",
                                   n * nproc + i if is_rank else None, (host, base_port + i), 0,
                                   local_rank=i if is_rank else None))
        per_node.append(specs)
    everyone = [c for specs in per_node for c in specs]
    ranks = sorted((c for c in everyone if c.rank is not None), key=lambda c: c.rank or 0)
    config = Configuration(
        0, [c.member_id for c in ranks], [c.member_id for c in everyone if c.rank is None],
        {c.member_id: c.bind for c in everyone}, observers=observers,
        topology={c.member_id: Topology(c.bind[0]) for c in everyone})
    return config, per_node


def configuration_zero(
    children: Sequence[ChildSpec], topology: Topology, *, observers: int = 10
) -> Configuration:
    """Configuration 0 of ``children``: ranks in rank order, spares in start order, every
    member at its bind address and on ``topology`` (one launcher runs on one host).

    Raises ``ValueError`` for a duplicate member id (from :class:`Configuration`).
    """
    ranks = sorted((c for c in children if c.rank is not None), key=lambda c: c.rank or 0)
    spares = [c for c in children if c.rank is None]
    return Configuration(
        0,
        [c.member_id for c in ranks],
        [c.member_id for c in spares],
        {c.member_id: c.bind for c in children},
        observers=observers,
        topology={c.member_id: topology for c in children},
    )


def child_environment(
    spec: ChildSpec,
    run: RunContext,
    *,
    seeds: Sequence[Address] = (),
    base: Mapping[str, str] | None = None,
    bind_fds: tuple[int, ...] = (),
    status_fd: int | None = None,
    started: Mapping[MemberId, float] | None = None,
) -> dict[str, str]:
    """The environment of ``spec``'s process: ``base`` (the launcher's own) without
    :data:`OWNED_VARIABLES`, plus the contract of :mod:`torchpass_p2p.agent.settings`.
    ``bind_fds`` (UDP, TCP) and ``status_fd``: descriptors of the sockets already bound to
    ``spec``'s ports that the child inherits (:mod:`.ports`).

    ``TORCHPASS_CONFIGURATION`` is set only for a member of configuration 0 (``run.configuration``
    set and ``seeds`` empty); otherwise the child joins through ``seeds``. ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set only for a rank.
    ``started``: when the launcher started each process it has started so far
    (``time.monotonic()`` seconds), as ``TORCHPASS_STARTED``: the child's agent gives members
    it has not heard from yet a start-up grace from then (``Params.start_grace_s``).

    Raises ``ValueError`` for a child that has neither a configuration nor seeds.
    """
    env = {k: v for k, v in (base or {}).items() if k not in OWNED_VARIABLES}
    env.update({
        "TORCHPASS_CLUSTER": run.cluster,
        "TORCHPASS_KEY_FILE": run.key_file,
        "TORCHPASS_MEMBER_ID": format_member_id(spec.member_id),
        "TORCHPASS_BIND": format_address(spec.bind),
        "TORCHPASS_STATUS": format_address(("127.0.0.1", spec.status_port)),
        "TORCHPASS_TOPOLOGY": format_topology(run.topology),
        "TORCHPASS_ROLE": spec.role,
        "TORCHPASS_RUN_DIR": run.run_dir,
    })
    if bind_fds:
        env["TORCHPASS_BIND_FDS"] = ",".join(map(str, bind_fds))
    if status_fd is not None:
        env["TORCHPASS_STATUS_FD"] = str(status_fd)
    if started:
        env["TORCHPASS_STARTED"] = ",".join(f"{format_member_id(m)}@{t:.3f}"
                                            for m, t in started.items())
    if run.profile is not None:
        env["TORCHPASS_PROFILE"] = run.profile
    if seeds:
        env["TORCHPASS_SEEDS"] = ",".join(format_address(a) for a in seeds)
    elif run.configuration is not None:
        env["TORCHPASS_CONFIGURATION"] = run.configuration
    else:
        raise ValueError(f"{spec.name}: neither configuration 0 nor seeds to join through")
    if spec.rank is not None:
        env.update({
            "RANK": str(spec.rank),
            "WORLD_SIZE": str(run.world_size),
            "LOCAL_RANK": str(spec.rank if spec.local_rank is None else spec.local_rank),
            "LOCAL_WORLD_SIZE": str(run.world_size if run.local_world_size is None
                                    else run.local_world_size),
        })
    return env


def format_address(address: Address) -> str:
    """``host:port``, with brackets around an IPv6 host (the form ``parse_address`` reads)."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def format_topology(topology: Topology) -> str:
    """``host`` or ``host/domain``, the form of ``TORCHPASS_TOPOLOGY``."""
    return f"{topology.host}/{topology.domain}" if topology.domain else topology.host


def parse_topology(text: str) -> Topology:
    """``host`` or ``host/domain`` -> :class:`Topology`.

    Raises ``ValueError`` for an empty host or a label over :data:`MAX_LABEL_BYTES` bytes.
    """
    host, _, domain = text.strip().partition("/")
    if not host:
        raise ValueError(f"topology: expected host or host/domain, got {text!r}")
    for label in (host, domain):
        if len(label.encode()) > MAX_LABEL_BYTES:
            raise ValueError(f"topology: a label is at most {MAX_LABEL_BYTES} bytes: {label!r}")
    return Topology(host, domain)
