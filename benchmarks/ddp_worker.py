"""One DDP training script for :mod:`benchmarks.vs_ddp`, run as plain torch DDP or adopted by
torchpass_p2p; it times its own steps.

``--api torch`` imports ``init_process_group``, ``DistributedDataParallel``, ``DataLoader`` and
``DistributedSampler`` from torch and loops over ``range(0, 1)`` (run it under torchrun; with
``--hook``, DDP reduces through torch's own Python hook, ``default_hooks.allreduce_hook``);
``--api torchpass`` imports the same names from torchpass_p2p, loops over ``epochs(0, 1)`` and
calls ``track(optimizer)`` (run it under ``torchpass-p2p launch``), with ``exact=False`` when
``--native`` is given. Everything else is the same code: the model (:data:`SIZES`), the data, the
batch size, AdamW, gradient clipping, ``loss.item()`` every step, gloo, one thread per rank, on
``--device`` (``cuda``: every rank on the one visible GPU, gloo reducing its CUDA tensors).

The epoch holds exactly ``--warmup + --steps`` batches per rank. Rank 0 reads
``time.perf_counter()`` before the first batch and after every ``optimizer.step()``; a step's
time is the difference between consecutive readings (fetching the batch, forward, backward with
the gradient reduction, clipping, the optimizer). The first ``--warmup`` steps are dropped, and
rank 0 writes ``--out`` as one JSON object: ``step_s`` (the timed steps, seconds each),
``cpu_step_s`` (the CPU time of rank 0's process in each, all its threads: the agent's and the
backend's too; seconds), ``thread_cpu_step_s`` (the same per thread name over all the timed
steps, divided by their number, from ``/proc/self/task``: empty where that is not there; a
clock tick is 10 ms, so about 0.5 ms a step over 20 steps), ``parameters``, ``world_size``,
``final_loss`` and the arguments.

The script imports nothing from this repository but torchpass_p2p: the launchers run it by path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

SIZES: dict[str, dict[str, int]] = {
    "small": {"dim": 64, "hidden": 288, "depth": 1},  # 104,840 parameters
    "large": {"dim": 64, "hidden": 2048, "depth": 6},  # 25,331,720 parameters
}
"""Model shapes by name (:func:`build_model`)."""
CLASSES = 8


class NoisyBlobs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``size`` samples ``(x [dim] float32, label int64)`` around ``CLASSES`` fixed centres;
    each fetch adds fresh noise from torch's generator (a random augmentation)."""

    def __init__(self, size: int, dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.centres = torch.randn(CLASSES, dim, generator=g)
        self.labels = torch.randint(0, CLASSES, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        label = self.labels[i]
        return self.centres[label] + 0.5 * torch.randn(self.centres.shape[1]), label


def build_model(dim: int, hidden: int, depth: int) -> torch.nn.Sequential:
    """An MLP: ``dim`` -> ``hidden`` (BatchNorm, ReLU, dropout), ``depth`` more
    ``hidden`` x ``hidden`` layers, -> ``CLASSES``. The BatchNorm gives DDP a buffer to
    broadcast each step, as in ``examples/torchrun_ddp.py``."""
    layers: list[torch.nn.Module] = [torch.nn.Linear(dim, hidden), torch.nn.BatchNorm1d(hidden),
                                     torch.nn.ReLU(), torch.nn.Dropout(0.1)]
    for _ in range(depth):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(hidden, CLASSES))
    return torch.nn.Sequential(*layers)


def parameters(size: str) -> int:
    """Trainable parameters of the model named ``size``."""
    return sum(p.numel() for p in build_model(**SIZES[size]).parameters())


def _api(name: str, native: bool) -> dict[str, Any]:
    """The names the script takes from ``torch`` or from ``torchpass_p2p``, and its group
    started. ``epochs`` and ``track`` are what an adopted script calls in addition."""
    if name == "torch":
        import torch.distributed as dist
        import torch.utils.data as tud
        from torch.nn.parallel import DistributedDataParallel

        def track(*objects: Any) -> None:
            del objects

        def destroy_process_group() -> None:
            # Past the timing. Every rank leaves its last collective before any closes its
            # connections: torch 2.13's gloo aborts a rank (std::terminate in a gloo thread)
            # whose peer tore down first, now and then on this loaded host.
            dist.barrier()
            dist.destroy_process_group()

        dist.init_process_group(backend="gloo")
        return {"DataLoader": tud.DataLoader,
                "DistributedSampler": tud.DistributedSampler,
                "DDP": DistributedDataParallel,
                "destroy_process_group": destroy_process_group, "epochs": range,
                "track": track}
    import torchpass_p2p as tp

    tp.init_process_group(backend="gloo", exact=not native)
    return {"DataLoader": tp.DataLoader, "DistributedSampler": tp.DistributedSampler,
            "DDP": tp.DistributedDataParallel,
            "destroy_process_group": tp.destroy_process_group, "epochs": tp.epochs,
            "track": tp.track}


def _profiler(path: str, device: torch.device, warmup: int) -> Any:
    """torch's profiler over the timed steps (a schedule that skips ``warmup``), started, or
    None without ``path``. Each step is marked with ``step()`` at its start."""
    if not path:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, schedule=torch.profiler.schedule(
        wait=warmup, warmup=1, active=1 << 20))
    profiler.start()
    return profiler


def thread_cpu_s() -> dict[str, float]:
    """This process's CPU time (user + system, seconds) by thread: Python's name for the
    thread where it has one, else the kernel's (gloo's threads); threads of one name summed.
    Empty where ``/proc/self/task`` is not there."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        name = names.get(int(tid)) or stat[stat.index("(") + 1:stat.rindex(")")]
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    api = _api(args.api, args.native)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    shape = SIZES[args.size]
    batches = args.warmup + args.steps
    dataset = NoisyBlobs(batches * args.batch_size * world, shape["dim"])
    device = torch.device(args.device)
    model = build_model(**shape).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loader = api["DataLoader"](dataset, batch_size=args.batch_size, num_workers=args.workers,
                               sampler=api["DistributedSampler"](dataset, shuffle=True))
    ddp = api["DDP"](model)
    if args.hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    api["track"](optimizer)
    ends = [time.perf_counter()]
    cpu = [time.process_time()]
    threads_at = thread_cpu_s()  # taken again at the first timed step
    loss = torch.zeros(())
    profiler = _profiler(args.profile, device, args.warmup) if rank == 0 else None
    for epoch in api["epochs"](0, 1):
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            if profiler is not None:
                profiler.step()
            source, targets = source.to(device), targets.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(source), targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
            loss.item()
            ends.append(time.perf_counter())
            cpu.append(time.process_time())
            if len(ends) == args.warmup + 1:
                threads_at = thread_cpu_s()
    threads_end = thread_cpu_s()
    if profiler is not None:
        profiler.stop()
        Path(args.profile).write_text(profiler.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=80, max_name_column_width=60))
    steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    cpu_steps = [b - a for a, b in zip(cpu, cpu[1:], strict=False)]
    if len(steps) != batches:
        raise RuntimeError(f"rank {rank}: {len(steps)} steps, expected {batches}")
    if rank == 0:
        out = Path(args.out)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({
            "api": args.api, "native": args.native, "size": args.size, "device": args.device,
            "parameters": sum(p.numel() for p in model.parameters()), "world_size": world,
            "batch_size": args.batch_size, "warmup": args.warmup, "steps": args.steps,
            "step_s": steps[args.warmup:],
            "cpu_step_s": cpu_steps[args.warmup:],
            "thread_cpu_step_s": {name: (t - threads_at.get(name, 0.0)) / args.steps
                                  for name, t in threads_end.items()},
            "final_loss": loss.item()}) + "\n")
        os.replace(tmp, out)  # the benchmark never reads a half-written file
    api["destroy_process_group"]()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", choices=("torch", "torchpass"), required=True)
    ap.add_argument("--hook", action="store_true",
                    help="torch: reduce through torch's own Python hook (allreduce_hook)")
    ap.add_argument("--native", action="store_true",
                    help="torchpass: init_process_group(exact=False), gloo's all-reduce")
    ap.add_argument("--size", choices=tuple(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=50, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (every rank shares it)")
    ap.add_argument("--profile", default="",
                    help="rank 0 writes torch's profiler table of the timed steps here "
                         "(slows them: not for timing)")
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    args = ap.parse_args(argv)
    if args.native and args.api != "torchpass":
        ap.error("--native is a torchpass_p2p option")
    if args.hook and args.api != "torch":
        ap.error("--hook is a plain torch DDP option")
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
