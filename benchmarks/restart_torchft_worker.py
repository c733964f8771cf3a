"""torchft 0.2.0's worker for :mod:`benchmarks.vs_restart`: ``examples/char_lm.py``'s training
loop as one torchft replica group of one process, with a :class:`torchft.Manager` talking to a
``torchft_lighthouse`` started by the harness.

The job runs ``--active`` (4) participating replicas plus spares, in torchft's
``WorldSizeMode.FIXED_WITH_SPARES`` (spares contribute zero gradients and apply every committed
step, so they hold the state; when a participant drops out of the quorum a spare takes its
place). A spare skips the forward and backward pass, whose result torchft would zero: idle like
torchpass_p2p's spares, it leaves the machine's cores to the participants.

Step ``k`` of participating rank ``r``: quorum, every generator seeded from ``(seed, r, k)``,
the same batch as under torchpass_p2p, ``manager.allreduce`` of the flattened gradient
(torchft's average: a gloo SUM over the quorum divided by the participants), then
``manager.should_commit()`` (torchft's commit vote) and, if it holds, the optimizer and
scheduler step. A failed or timed-out collective makes ``should_commit`` false and the step is
redone with the next quorum. The summation order is gloo's, not the rank order, so bitwise
equality with the other methods is not expected.

Faults (``--faults``, the ``TORCHPASS_FAULTS`` spec) are keyed by participating rank and fire
once per job (marker files, as :mod:`benchmarks.restart_worker`). A timeline goes to
``--log-dir/replica<I>.jsonl`` and ``--out/final-<I>.json`` when training ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft.manager import WorldSizeMode

from benchmarks.restart_worker import Log, OnceFaults
from examples.char_lm import (
    add_job_args,
    batch_loss,
    build,
    corpus,
    rank_batches,
    weights_digest,
    windows,
)
from torchpass_p2p.collective.reduce import flatten, unflatten_into
from torchpass_p2p.trainer.faults import parse_faults
from torchpass_p2p.trainer.seeding import seed_step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--lighthouse", required=True, help="http://host:port")
    ap.add_argument("--active", type=int, default=4, help="participating replicas")
    ap.add_argument("--out", required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--marker-dir", required=True)
    ap.add_argument("--faults", default="")
    ap.add_argument("--timeout-s", type=float, default=10.0,
                    help="torchft collective timeout (a hung participant fails the step)")
    add_job_args(ap)
    args = ap.parse_args(argv)
    for d in (args.log_dir, args.marker_dir, args.out):
        Path(d).mkdir(parents=True, exist_ok=True)
    log = Log(Path(args.log_dir) / f"replica{args.replica}.jsonl", args.replica, 0)
    log("start", pid=os.getpid())
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    text = corpus(args.corpus_kib << 10)
    dataset = windows(text, args, args.active)
    model, optimizer, scheduler = build(args)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optimizer"])
        scheduler.load_state_dict(sd["scheduler"])
        log("healed")

    timeout = timedelta(seconds=args.timeout_s)
    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=args.active,
        load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"replica{args.replica}", store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=args.lighthouse, timeout=timeout,
        quorum_timeout=timedelta(seconds=120), connect_timeout=timedelta(seconds=60),
        world_size_mode=WorldSizeMode.FIXED_WITH_SPARES, hostname="127.0.0.1")
    faults = OnceFaults(parse_faults(args.faults), Path(args.marker_dir), None, log)
    log("ready")
    while manager.current_step() < args.steps:
        optimizer.zero_grad(set_to_none=True)
        manager.start_quorum()
        manager.wait_quorum()
        k, rank = manager.current_step(), manager.participating_rank()
        faults.rank_is(rank)
        faults.at(k, "compute")
        if rank is None:  # a spare: torchft zeroes its contribution, so it computes none
            flat = torch.zeros(numel)
        else:
            tokens = next(rank_batches(dataset, args, args.active, rank, k))
            seed_step(args.seed, rank, k)
            batch_loss(model, tokens).backward()
            flat = flatten(params)
        faults.at(k, "grad")
        manager.allreduce(flat).wait()
        faults.at(k, "commit")
        if manager.should_commit():
            unflatten_into(flat, params)
            optimizer.step()
            scheduler.step()
            log("step", step=k, participating_rank=rank)
        else:
            log("step_failed", step=k, participating_rank=rank)
    Path(args.out, f"final-{args.replica}.json").write_text(json.dumps({
        "rank": args.replica, "steps": manager.current_step(),
        "weights_sha256": weights_digest(model)}))
    log("finished", step=manager.current_step())
    sys.stdout.flush()
    sys.stderr.flush()
    manager.shutdown(wait=False)
    os._exit(0)  # the manager's threads and the store need no orderly teardown here


if __name__ == "__main__":
    sys.exit(main())
