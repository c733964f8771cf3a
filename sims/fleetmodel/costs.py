"""The job, and what each recovery method costs: every figure a :class:`Sourced`.

Three methods (:data:`METHODS`):

* ``checkpoint_restart``: every failure stops the job; after the detection delay and the
  restart overhead it resumes from the last checkpoint, written every Daly-optimal interval
  (or a given one). The restart needs replacement hardware from the spare pool.
* ``replica_group`` (torchft's kind): the job's data-parallel replica groups train on; a
  failure stalls every group for the heartbeat timeout and drops the fault step's batch, then the
  failed group is out (the job trains with fewer samples per step) while it restarts on a spare
  and pulls its state from a peer group.
* ``torchpass_p2p``: the job stalls for the decided-configuration latency at its size (from
  protocol-level simulator runs), a spare takes each failed rank, pulls its state, rejoins, and
  the interrupted step is redone; every step pays the measured fault-free step ratio against
  plain DDP.

What in-memory recovery cannot cover (``job``-scope failures, or a rank whose state has no other
holder) falls back, for the last two methods, to the same restart path as checkpoint-restart,
with a last-resort checkpoint whose Daly interval follows the rate of such failures only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .decided import DecidedLatency
from .sources import Sourced, recovery_figure, restart_component, source_of, step_ratio

METHODS = ("checkpoint_restart", "replica_group", "torchpass_p2p")


@dataclass(frozen=True, slots=True)
class Job:
    """The training job and its fleet.

    Args:
        gpus: training GPUs (ranks), constant: a lost one is replaced.
        steps: optimizer steps to train.
        step_s: one step of plain torch DDP, fault-free (seconds).
        state_bytes: training state per rank (bytes): what a replacement must receive.
        state_holders: ranks holding each rank's state, itself included (data-parallel or
            replica-group copies); 1 leaves nothing to pull from, every failure then falls back
            to the last-resort checkpoint.
        link_gbit: each GPU's network link (Gbit/s).
        gpus_per_host: GPUs a host failure takes down.
        spare_fraction: spare GPUs as a fraction of ``gpus`` (rounded to whole hosts).
        repair_s: seconds until failed hardware returns to the spare pool.
        replica_group_gpus: GPUs per replica group (``replica_group`` method).
    """

    gpus: int
    steps: int
    step_s: float
    state_bytes: float
    state_holders: int = 2
    link_gbit: float = 400.0
    gpus_per_host: int = 8
    spare_fraction: float = 0.02
    repair_s: float = 2.2 * 3600.0
    replica_group_gpus: int = 64
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    """Where job parameters come from (name -> text), for reports."""

    @property
    def work_s(self) -> float:
        """Fault-free seconds of plain DDP: the work the job must do."""
        return self.steps * self.step_s

    @property
    def spare_gpus(self) -> int:
        """Spare GPUs in the pool at the start, whole hosts."""
        hosts = round(self.spare_fraction * self.gpus / self.gpus_per_host)
        return hosts * self.gpus_per_host


@dataclass(frozen=True, slots=True)
class RestartCosts:
    """The checkpoint-restart path (also the other methods' last resort).

    ``interval_s``: compute seconds between checkpoints; None: Daly's optimum for the rate of
    failures this path serves.
    """

    detection: Sourced
    restart: Sourced
    write: Sourced
    interval_s: float | None = None


@dataclass(frozen=True, slots=True)
class TorchpassCosts:
    """What a rank replacement costs under torchpass_p2p."""

    step_ratio: Sourced
    decided: DecidedLatency
    receiver: Sourced
    rejoin: Sourced


@dataclass(frozen=True, slots=True)
class ReplicaGroupCosts:
    """What a replica group's loss costs (torchft's kind)."""

    heartbeat_timeout: Sourced
    group_restart: Sourced
    step_ratio: Sourced


@dataclass(frozen=True, slots=True)
class Method:
    """One recovery method with its costs (``torchpass``/``replica`` set for those methods)."""

    name: str
    restart: RestartCosts
    torchpass: TorchpassCosts | None = None
    replica: ReplicaGroupCosts | None = None

    @property
    def ratio(self) -> float:
        """Fault-free step time over plain DDP's."""
        if self.torchpass is not None:
            return self.torchpass.step_ratio.value
        if self.replica is not None:
            return self.replica.step_ratio.value
        return 1.0


def transfer_s(job: Job, receiver: Sourced | None) -> float:
    """Seconds to move one rank's state to its replacement: ``state_bytes / min(sources x link,
    receiver)``, sources being the other holders of that state (``receiver`` None: the links
    alone bound it)."""
    sources = max(1, job.state_holders - 1)
    link = sources * job.link_gbit / 8.0
    rate = (link if receiver is None else min(link, receiver.value)) * 1e9
    return job.state_bytes / rate


def _minutes(name: str) -> Sourced:
    entry = restart_component(name)
    return Sourced(60.0 * float(entry["value_min"]), "s",
                   f"{entry['component']}: {entry['source']}")


def default_restart(detection: str = "watchdog", interval_s: float | None = None) -> RestartCosts:
    """Checkpoint-restart costs from the published figures (``data/failure_rates.json``).

    ``detection``: ``"watchdog"`` (PyTorch's NCCL collective timeout, 10 min by default) or
    ``"health_check"`` (Meta RSC's 5-minute health checks).

    Raises:
        ValueError: an unknown ``detection``.
    """
    if detection == "watchdog":
        det = _minutes("detection: PyTorch NCCL collective timeout")
    elif detection == "health_check":
        det = _minutes("detection: health checks (Meta RSC)")
    else:
        raise ValueError(f"detection must be 'watchdog' or 'health_check', got {detection!r}")
    init = restart_component("framework init breakdown")
    restart = Sourced(60.0 * float(init["value_min"]["total incl. infra"]), "s",
                      "TrainMover Table 1: an 8,192-GPU production job's restart per "
                      f"interruption, infrastructure and framework init: {init['source']}")
    saves = restart_component("checkpoint save, blocking part")
    write = Sourced(float(saves["value_s"]["PyTorch DCP async 7B"]), "s",
                    "blocking part of an asynchronous PyTorch DCP save of a 7B model: "
                    "data/failure_rates.json restart_cost_components 'checkpoint save, "
                    "blocking part', 'PyTorch DCP async 7B'")
    return RestartCosts(det, restart, write, interval_s)


def default_torchpass(overhead: str | None = None,
                      decided: DecidedLatency | None = None) -> TorchpassCosts:
    """torchpass_p2p's costs from this project's measurements (``measured_costs.json``) and the
    decided-latency table (``decided_latency.json``). ``overhead``: a step-ratio key (None:
    the file's default)."""
    return TorchpassCosts(step_ratio(overhead), decided or DecidedLatency.load(),
                          recovery_figure("receiver_gb_per_s"), recovery_figure("rejoin_s"))


def default_replica(restart: RestartCosts) -> ReplicaGroupCosts:
    """Replica-group recovery: torchft's lighthouse heartbeat timeout, the group's restart taken
    as checkpoint-restart's (a new process on new hardware, its framework init), its state
    pulled at the links' rate (no receiver bound: not measured), no fault-free overhead (not
    measured). The unmeasured parts are all taken in the replica group's favour."""
    hb = Sourced(5.0, "s", "torchft src/lighthouse.rs LighthouseOpt heartbeat_timeout_ms "
                           "default 5000 (github.com/pytorch/torchft)")
    return ReplicaGroupCosts(hb, restart.restart,
                             Sourced(1.0, "x torch DDP's step", "not measured; taken as 1"))


def default_methods(overhead: str | None = None, detection: str = "watchdog",
                    interval_s: float | None = None,
                    decided: DecidedLatency | None = None) -> list[Method]:
    """The three methods with their default, sourced costs."""
    restart = default_restart(detection, interval_s)
    return [Method("checkpoint_restart", restart),
            Method("replica_group", restart, replica=default_replica(restart)),
            Method("torchpass_p2p", restart, torchpass=default_torchpass(overhead, decided))]


def sources_table(job: Job, methods: list[Method]) -> list[tuple[str, str, str]]:
    """(input, value with unit, source) rows for every input the methods use."""
    rows: list[tuple[str, str, str]] = [(k, "", v) for k, v in job.sources.items()]
    seen: set[str] = set()

    def add(name: str, s: Sourced) -> None:
        if name not in seen:
            seen.add(name)
            rows.append((name, f"{s.value:g} {s.unit}", s.source))

    for m in methods:
        add("restart.detection", m.restart.detection)
        add("restart.restart", m.restart.restart)
        add("restart.checkpoint_write", m.restart.write)
        if m.torchpass is not None:
            tp = m.torchpass
            add("torchpass.step_ratio", tp.step_ratio)
            add("torchpass.receiver_rate", tp.receiver)
            add("torchpass.rejoin", tp.rejoin)
            d = tp.decided
            add("torchpass.decided_gpu", Sourced(d.at(job.gpus, "gpu"), f"s at {job.gpus} members",
                                                 d.source))
            add("torchpass.decided_host", Sourced(d.at(job.gpus, "host"),
                                                  f"s at {job.gpus} members", d.source))
        if m.replica is not None:
            add("replica.heartbeat_timeout", m.replica.heartbeat_timeout)
            add("replica.group_restart", m.replica.group_restart)
            add("replica.step_ratio", m.replica.step_ratio)
    rows.append(("failure categories", "", source_of("llama3")))
    return rows
