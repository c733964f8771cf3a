"""``torchpass-p2p launch``: start N rank processes and S hot spares of a training script on
this host and supervise them (:mod:`torchpass_p2p.launch`).

Under Slurm, start one launcher per node (``srun --ntasks-per-node=1 torchpass-p2p launch
...``): --nodes, --node-rank and --run-id not given come from the job step's environment
(docs/running.md, "Slurm").

Exit code: 0 when the job completed (some process exited 0 and none failed afterwards); 1 when
it failed (the script failed on every rank, or a process failed after the job completed); 2 for
a usage or setup error; 5 when the job stopped because it cannot go on (a rank nobody can fill,
no majority of the configuration left: resume it from its last checkpoint; or a rank's script
describes another job than the others'); 6 when no process exited 0 and the cluster refused a
child's key; 128 + N when signal N stopped the launcher.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from torchpass_p2p.agent.settings import SettingsError, parse_address
from torchpass_p2p.checkpoint import DEFAULT_KEEP, DEFAULT_MTBF_S
from torchpass_p2p.cli import plain
from torchpass_p2p.core.configuration import Address
from torchpass_p2p.core.messages import Topology
from torchpass_p2p.launch.childspec import parse_topology
from torchpass_p2p.launch.launcher import (
    DEFAULT_GRACE_S,
    DEFAULT_MAX_RESPAWNS,
    LaunchError,
    LaunchOptions,
    launch,
)
from torchpass_p2p.launch.slurm import SlurmError, place

__all__ = ["add_parser", "run"]

log = logging.getLogger("torchpass_p2p.launch")


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register this command's parser (``set_defaults(func=run)``) and return it."""
    p = subparsers.add_parser(
        "launch", help="start and supervise the ranks and spares of a training script",
        description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="rank processes: the world size, or with --nodes those of each host "
                        "(default: 1)")
    p.add_argument("--spares", type=int, default=0, metavar="S",
                   help="hot-spare processes (with --nodes: on each host) (default: 0)")
    p.add_argument("--config", metavar="FILE",
                   help="TOML profile of protocol parameters, e.g. configs/lan.toml "
                        "(children get TORCHPASS_PROFILE)")
    p.add_argument("--respawn", action="store_true",
                   help="restart a process that failed as a new spare joining the live members")
    p.add_argument("--max-respawns", type=int, default=DEFAULT_MAX_RESPAWNS, metavar="K",
                   help=f"respawns at most (default: {DEFAULT_MAX_RESPAWNS})")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the agents bind and advertise; other hosts must reach it "
                        "(default: 127.0.0.1)")
    p.add_argument("--base-port", type=int, metavar="P",
                   help="process i uses UDP/TCP port P+i (default: free ports)")
    p.add_argument("--seeds", type=_seeds, default=(), metavar="HOST:PORT,...",
                   help="join an existing job through these members: every process starts as "
                        "a spare and no configuration 0 is written (needs --key-file)")
    p.add_argument("--topology", type=_topology, metavar="HOST[/DOMAIN]",
                   help="topology labels for spare affinity (default: this host's name)")
    p.add_argument("--key-file", metavar="F",
                   help="cluster key file, 64 hex digits a line, primary first (default: "
                        "$TORCHPASS_KEY_FILE, else $TORCHPASS_KEY, else a fresh random key)")
    p.add_argument("--cluster", default="torchpass", help="cluster name (default: torchpass)")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="time between SIGTERM and SIGKILL, and for processes still finishing "
                        f"after the job completed (default: {DEFAULT_GRACE_S:g})")
    p.add_argument("--nodes", type=_nodes, default=(), metavar="HOST,HOST,...",
                   help="a job over several hosts: every host's address, the same list on "
                        "every host; each host's launcher derives the same configuration 0 "
                        "(needs --node-rank, --run-id, --base-port and a shared --key-file; "
                        "default in a Slurm step over several nodes: the NodeAddr of each "
                        "node of SLURM_STEP_NODELIST)")
    p.add_argument("--node-rank", type=int, default=None, metavar="I",
                   help="this host's position in --nodes (default: $SLURM_NODEID, else 0)")
    p.add_argument("--run-id", default=None, metavar="ID",
                   help="a name for this run, the same on every host (member ids derive from "
                        "it and the key, so use a new one for each run; a resume from "
                        "--checkpoint-dir needs the run's own) (default in Slurm: "
                        "slurm-$SLURM_JOB_ID.$SLURM_STEP_ID)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="last-resort checkpoints (torch.distributed.checkpoint) go there; a "
                        "launch with the same --run-id and DIR resumes from the newest "
                        "complete one (docs/checkpoints.md; needs --run-id)")
    p.add_argument("--checkpoint-every", default="auto", metavar="N|Ts|auto",
                   help="steps (200) or seconds (90s, 15m, 2h) between checkpoints; auto: "
                        "Young's sqrt(2 x save cost x --mtbf-correlated), the cost measured "
                        "at the first save (default: auto)")
    p.add_argument("--checkpoint-keep", type=int, default=DEFAULT_KEEP, metavar="K",
                   help=f"complete checkpoints kept (default: {DEFAULT_KEEP})")
    p.add_argument("--mtbf-correlated", type=float, default=DEFAULT_MTBF_S, metavar="SECONDS",
                   help="mean time between failures in-memory recovery cannot cover (launcher "
                        "or host lost, no majority left), for auto (default: "
                        f"{DEFAULT_MTBF_S:g}, a placeholder: set your cluster's)")
    p.add_argument("script", metavar="SCRIPT", help="the Python training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments for the script")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[torchpass-p2p launch] %(message)s")
    try:
        placed = place(os.environ, nodes=args.nodes, node_rank=args.node_rank,
                       run_id=args.run_id)
        if placed.sources:
            log.info("from Slurm: %s", "; ".join(placed.sources))
        nodes, node_rank = placed.nodes, placed.node_rank
        options = LaunchOptions(
            script=args.script, script_args=tuple(args.script_args), nproc=args.nproc,
            spares=args.spares, base_port=args.base_port, seeds=args.seeds,
            host=nodes[node_rank] if 0 <= node_rank < len(nodes) else args.host,
            nodes=nodes, node_rank=node_rank, run_id=placed.run_id,
            topology=args.topology, key_file=args.key_file, profile=args.config,
            cluster=args.cluster, respawn=args.respawn, max_respawns=args.max_respawns,
            grace_s=args.grace, checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every, checkpoint_keep=args.checkpoint_keep,
            mtbf_correlated_s=args.mtbf_correlated)
        return asyncio.run(launch(options))
    except (LaunchError, SlurmError) as exc:
        log.error("error: %s", exc)
        return 2


def _nodes(text: str) -> tuple[str, ...]:
    nodes = tuple(n.strip() for n in text.split(",") if n.strip())
    if not nodes:
        raise argparse.ArgumentTypeError("--nodes: at least one host address")
    return nodes


def _seeds(text: str) -> tuple[Address, ...]:
    try:
        return tuple(parse_address(s, where="--seeds") for s in text.split(",") if s.strip())
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _topology(text: str) -> Topology:
    try:
        return parse_topology(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
