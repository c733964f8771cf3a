"""The training script of :mod:`benchmarks.checkpoint_cost`: an adopted DDP script (an MLP,
AdamW, a DataLoader with a DistributedSampler) run under ``torchpass-p2p launch`` with
``--checkpoint-every``, whose rank 0 switches its checkpoints on and off in blocks of
``--block`` steps (``Checkpointer.enabled``: the same process, model, data and machine load on
both sides) and times every step.

Rank 0 reads ``time.perf_counter()`` before the first batch and after every
``optimizer.step()``; a step's time is the difference of consecutive readings. It writes
``--out`` as one JSON object: ``step_s`` (seconds per step, the ``--warmup`` steps dropped),
``cpu_step_s`` (the CPU time of rank 0's process in each, all its threads: the checkpoint
writer's too),
``on`` (per timed step, whether checkpoints were on), ``parameters``, ``state_bytes`` and the
arguments. After the warm-up, blocks go on, off, off, on, on, off, off, on, ...: each pair of
blocks has one of each, the pairs in alternate order, so a drift of the machine's load over the
run reaches both sides alike.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import torchpass_p2p as tp
from torchpass_p2p.ddp.session import current

CLASSES = 8


def build_model(dim: int, hidden: int, depth: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(dim, hidden), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(hidden, CLASSES))
    return torch.nn.Sequential(*layers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tp.init_process_group(backend="gloo")
    rank, world = tp.get_rank(), tp.get_world_size()
    torch.manual_seed(0)
    steps = args.warmup + args.blocks * args.block
    dim = 64
    data = torch.utils.data.TensorDataset(
        torch.randn(steps * args.batch_size * world, dim),
        torch.randint(0, CLASSES, (steps * args.batch_size * world,)))
    model = build_model(dim, args.hidden, args.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = tp.DataLoader(data, batch_size=args.batch_size,
                           sampler=tp.DistributedSampler(data, shuffle=True))
    ddp = tp.DistributedDataParallel(model)
    tp.track(optimizer)
    session = current()
    ends, cpu, on = [time.perf_counter()], [time.process_time()], []
    for epoch in tp.epochs(0, 1):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            timed = i - args.warmup
            enabled = timed >= 0 and (timed // args.block) % 4 in (0, 3)
            if session.checkpointer is not None:
                session.checkpointer.enabled = enabled
            optimizer.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            ends.append(time.perf_counter())
            cpu.append(time.process_time())
            on.append(enabled)
    if rank == 0:
        step_s = [b - a for a, b in zip(ends, ends[1:], strict=False)][args.warmup:]
        cpu_s = [b - a for a, b in zip(cpu, cpu[1:], strict=False)][args.warmup:]
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        state_bytes += sum(t.numel() * t.element_size() for s in optimizer.state.values()
                           for t in s.values() if isinstance(t, torch.Tensor))
        Path(args.out).write_text(json.dumps({
            "step_s": step_s, "cpu_step_s": cpu_s, "on": on[args.warmup:], "world_size": world,
            "parameters": sum(p.numel() for p in model.parameters()),
            "state_bytes": state_bytes, "args": vars(args)}))
    tp.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
