"""The checkpoint-restart baseline's worker: ``examples/char_lm.py``'s training loop as a plain
gloo data-parallel job under ``torchrun`` (``torch.distributed.elastic``), with a synchronous
checkpoint every ``--every`` steps and resume from the newest one after a restart. Driven by
:mod:`benchmarks.vs_restart`.

Same model, data, seed, schedule and step as the example under torchpass_p2p: step ``k`` of
rank ``r`` takes the batch the example's DistributedSampler deals that rank
(:func:`~examples.char_lm.rank_batches`), seeds every generator from ``(seed, r, k)``
(:func:`~torchpass_p2p.trainer.seed_step`, as the example's DDP forward does), averages the
flattened gradient summed in rank order with ``ManagedGroup.mean_in_rank_order`` over the plain
gloo group (the element-wise arithmetic of the example's reduction: so a fault-free run here
ends with the same bits),
does the same tiny second all-reduce (mean loss), then the optimizer and scheduler step.

Checkpoint (rank 0 only, every rank holds the same state): model, optimizer, scheduler, step,
data position (``step * world_size`` batches) and the RNG states (torch, ``random``, numpy),
``torch.save`` to ``step-NNNNNNNN.pt.tmp``, fsync, atomic rename, fsync of the directory; the two
newest are kept. The others wait for it in the next step's all-gather: a synchronous
checkpoint, on the critical path.

Faults: the ``TORCHPASS_FAULTS`` spec (:mod:`torchpass_p2p.trainer.faults`) given as
``--faults``, each fired once per job (a marker file in ``--marker-dir`` is created before it
fires, so the restarted group redoing that step does not fault again). ``stop`` sends SIGCONT
from a helper in its own session, so the elastic agent's ``killpg`` of the stopped worker does
not take the helper with it (the stopped worker then dies of the pending SIGTERM when the helper
resumes it, as a hung process that recovers would).

Every rank writes a JSON-lines timeline ``--log-dir/rank<R>-attempt<A>.jsonl`` (CLOCK_MONOTONIC
``t``): ``start``, ``restored``, ``step``, ``checkpoint``, ``fault``, ``failed``, ``finished``;
and ``--out/final-<R>.json`` (weights sha256, state fingerprint) when training ends.

``python -m benchmarks.restart_worker --measure-checkpoint DIR`` times saving the state once
(after one optimizer step, so AdamW's moments exist) without any process group, and prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from examples.char_lm import (
    add_job_args,
    batch_loss,
    build,
    corpus,
    rank_batches,
    weights_digest,
    windows,
)
from torchpass_p2p.collective import GroupSpec, ManagedGroup
from torchpass_p2p.collective.reduce import flatten, unflatten_into
from torchpass_p2p.trainer.faults import Fault, parse_faults
from torchpass_p2p.trainer.seeding import seed_step
from torchpass_p2p.transfer import Snapshot

CHECKPOINTS_KEPT = 2
"""The newest two: a rank killed while renaming can never leave zero complete checkpoints."""


class Log:
    """Append-only JSON lines, flushed per record (a SIGKILL loses nothing written)."""

    def __init__(self, path: Path | None, rank: int, attempt: int) -> None:
        self.f = open(path, "a") if path else None  # noqa: SIM115 - lives as long as the process
        self.rank, self.attempt = rank, attempt

    def __call__(self, event: str, **fields: Any) -> None:
        if self.f is None:
            return
        rec = {"t": time.monotonic(), "event": event, "rank": self.rank,
               "attempt": self.attempt, **fields}
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


class OnceFaults:
    """Fires each fault of the spec once per job, at (step, point, rank); ``rank`` may change
    (:meth:`rank_is`; None: none)."""

    def __init__(self, faults: list[Fault], marker_dir: Path, rank: int | None,
                 log: Log) -> None:
        self.faults = list(enumerate(faults))
        self.marker_dir, self.log, self.rank = marker_dir, log, rank

    def rank_is(self, rank: int | None) -> None:
        self.rank = rank

    def at(self, step: int, point: str) -> None:
        for i, f in self.faults:
            if (f.step, f.point, f.rank) != (step, point, self.rank):
                continue
            try:
                os.close(os.open(self.marker_dir / f"fault-{i}", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue  # fired in an earlier attempt
            self.log("fault", kind=f.kind, step=f.step, point=f.point, target_rank=f.rank,
                     seconds=f.seconds)
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            subprocess.Popen(["sh", "-c", f"sleep {f.seconds}; kill -CONT {os.getpid()}"],
                             start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)


def checkpoint_state(model: Any, optimizer: Any, scheduler: Any, step: int, world: int,
                     seed: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "step": step, "data_position": step * world,
            "world_size": world, "seed": seed,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": np.random.get_state()}}


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` durably and atomically as ``step-NNNNNNNN.pt``; drop older ones."""
    final = directory / f"step-{state['step']:08d}.pt"
    tmp = final.with_suffix(".pt.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in sorted(directory.glob("step-*.pt"))[:-CHECKPOINTS_KEPT]:
        old.unlink(missing_ok=True)
    return final


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted(directory.glob("step-*.pt"))
    return found[-1] if found else None


def measure_checkpoint(args: argparse.Namespace) -> int:
    """Time ``--repeats`` saves of the state after one step; print JSON (median seconds)."""
    torch.set_num_threads(1)
    text = corpus(args.corpus_kib << 10)
    model, optimizer, scheduler = build(args)
    batch_loss(model, next(rank_batches(windows(text, args, 4), args, 4, 0))).backward()
    optimizer.step()
    scheduler.step()
    directory = Path(args.measure_checkpoint)
    directory.mkdir(parents=True, exist_ok=True)
    times, size = [], 0
    for i in range(args.repeats):
        t0 = time.perf_counter()
        path = save_checkpoint(directory, checkpoint_state(model, optimizer, scheduler, i + 1,
                                                           4, args.seed))
        times.append(time.perf_counter() - t0)
        size = path.stat().st_size
    print(json.dumps({"checkpoint_cost_s": statistics.median(times), "samples_s": times,
                      "checkpoint_bytes": size,
                      "parameters": sum(p.numel() for p in model.parameters())}))
    return 0


def init_group(rank: int, world: int, attempt: int, timeout: timedelta) -> None:
    """The gloo group of this attempt. The elastic agent's store outlives restarts and
    ``env://`` puts no attempt into its keys: a restarted group would read the dead group's
    gloo addresses ("connectFullMesh failed ... Connection refused", seen with torch 2.13), so
    the keys get an ``attempt-<A>/`` prefix here."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo", timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)


def train(args: argparse.Namespace) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log_dir = Path(args.log_dir) if args.log_dir else None
    for d in (log_dir, Path(args.marker_dir)):
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
    log = Log(log_dir / f"rank{rank}-attempt{attempt}.jsonl" if log_dir else None, rank, attempt)
    log("start", pid=os.getpid())
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    init_group(rank, world, attempt, timedelta(seconds=args.pg_timeout_s))
    # The trainer's rank-order mean on the plain group: the same collectives and arithmetic.
    # A failure raises CollectiveError, a RuntimeError like the backend's own.
    group = ManagedGroup(dist.group.WORLD, GroupSpec(attempt, rank, world, 0), "gloo")
    text = corpus(args.corpus_kib << 10)
    model, optimizer, scheduler = build(args)
    params = [p for p in model.parameters() if p.requires_grad]
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step = 0
    path = latest_checkpoint(ckpt_dir)
    if path is not None:
        t0 = time.monotonic()
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        step = state["step"]
        if state["data_position"] != step * world or state["world_size"] != world:
            raise RuntimeError(f"{path}: saved for another world size")
        log("restored", step=step, path=path.name, seconds=time.monotonic() - t0)
    faults = OnceFaults(parse_faults(args.faults), Path(args.marker_dir), rank, log)
    batches = rank_batches(windows(text, args, world), args, world, rank, step)

    log("ready", step=step)
    try:
        while step < args.steps:
            k = step
            faults.at(k, "compute")
            seed_step(args.seed, rank, k)
            optimizer.zero_grad(set_to_none=True)
            loss = batch_loss(model, next(batches))
            loss.backward()
            flat = flatten(params)
            faults.at(k, "grad")
            avg = group.mean_in_rank_order(flat)
            faults.at(k, "commit")
            vote = torch.tensor([1.0, float(loss.detach())], dtype=torch.float64)
            votes = group.mean_in_rank_order(vote)
            unflatten_into(avg, params)
            optimizer.step()
            scheduler.step()
            step = k + 1
            log("step", step=k, loss=votes[1].item())
            if args.every > 0 and step % args.every == 0 and step < args.steps and rank == 0:
                t0 = time.monotonic()
                save_checkpoint(ckpt_dir, checkpoint_state(model, optimizer, scheduler, step,
                                                           world, args.seed))
                log("checkpoint", step=step, seconds=time.monotonic() - t0)
        dist.barrier()
    except RuntimeError as exc:  # a peer died or hung past the timeout: elastic restarts us
        log("failed", step=step, error=f"{type(exc).__name__}: {exc}"[:200])
        traceback.print_exc()
        sys.stderr.flush()
        # At once: letting the exception unwind through interpreter teardown with the broken
        # group alive took ~9 s to exit here, a delay that belongs to no fault-tolerance scheme.
        os._exit(1)
    fingerprint = Snapshot.capture(
        {"model": model, "optimizer": optimizer, "scheduler": scheduler}, step,
        {"seed": args.seed, "world_size": world, "data_position": step * world}).fingerprint()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"final-{rank}.json").write_text(json.dumps({
        "rank": rank, "steps": step, "attempt": attempt, "fingerprint": fingerprint.hex(),
        "weights_sha256": weights_digest(model)}))
    log("finished", step=step)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure-checkpoint", metavar="DIR",
                    help="only time checkpoint saves into DIR and print JSON")
    ap.add_argument("--repeats", type=int, default=5, help="saves timed (--measure-checkpoint)")
    ap.add_argument("--out", help="directory for final-<rank>.json")
    ap.add_argument("--log-dir", help="directory for the per-rank timelines")
    ap.add_argument("--ckpt-dir", help="checkpoint directory (resumed from if not empty)")
    ap.add_argument("--marker-dir", help="directory for the faults' fired-once markers")
    ap.add_argument("--every", type=int, default=0, help="checkpoint every N steps; 0: never")
    ap.add_argument("--faults", default="", help="TORCHPASS_FAULTS-style spec")
    ap.add_argument("--pg-timeout-s", type=float, default=10.0,
                    help="gloo timeout: how long peers wait for a hung rank before failing")
    add_job_args(ap)
    args = ap.parse_args(argv)
    if args.measure_checkpoint:
        return measure_checkpoint(args)
    for name in ("out", "ckpt_dir", "marker_dir"):
        if not getattr(args, name):
            ap.error(f"--{name.replace('_', '-')} is required for training")
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
