"""A character-level transformer language model on the text of Python's own standard library,
trained data-parallel under torchpass_p2p with its DDP API (``docs/training.md``): the script's
own loop over a DataLoader, run with the launcher,

    python -m torchpass_p2p.cli.main launch --nproc 4 --spares 2 examples/char_lm.py --out OUT

Every process (ranks and spares) reads the corpus and builds the model first; a spare then waits
inside ``init_process_group`` until it holds a rank, and receives the state where the loop
starts (``epochs``). The data needs no download: the ``.py`` files of the running interpreter's
standard library (sorted by name, first ``--corpus-kib`` KiB, bytes above 127 mapped to ``?``).
The dataset is ``--steps * --batch * world size`` windows of ``--context + 1`` characters at
offsets drawn once from a generator seeded by ``--seed`` (:class:`Windows`): one epoch, which a
shuffled ``DistributedSampler`` deals out as ``--steps`` batches of ``--batch`` windows per rank.
The step count is the LR scheduler's (``last_epoch``): it moves to a spare with the scheduler.

Each member that finishes writes ``OUT/final-<member>.json``: its member id (the launcher's
``TORCHPASS_MEMBER_ID``), rank, steps, the model's weights digest and the losses of its rank's
batches for the steps this member trained. A member out of the job stops inside the library's
call where it learns it (exit codes in ``docs/training.md``: 3 removed, 4 drained, 5 stopped).

The model's size is ``--dim``, ``--heads`` and ``--layers`` (default 64, 4, 2: 0.1M parameters,
1.3 MB of state with AdamW); ``--dim 512 --layers 8 --batch 2`` is the scale of issue #7's
reference job (25.4M parameters, 305 MB of state, about 1.5 s a step with 4 ranks on 2 cores).
:func:`add_job_args`, :func:`build`, :func:`windows`, :func:`rank_batches` and
:func:`batch_loss` are shared with the baselines in ``benchmarks/``, so every method trains
exactly this job.

``--extra-state-mb N`` adds N MiB of ballast to the training state (a :class:`Ballast`, given to
``track``): deterministic bytes drawn from ``--seed``, never changed by a step, but part of every
snapshot, transfer and state fingerprint like the weights. It makes a small model's state as
large as a real one's, so a transfer lasts long enough for faults to land in its middle (S10).
It costs nothing per step: the state is captured only when a spare needs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.data as tud
from torch import nn

import torchpass_p2p as tp

VOCAB = 128


def corpus(max_bytes: int) -> torch.Tensor:
    """``[n] int64`` character codes (0..127) of the standard library's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    raw = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)
    return torch.where(raw < VOCAB, raw, ord("?")).long()


class Windows(tud.Dataset):  # type: ignore[type-arg]
    """``count`` windows ``[context + 1] int64`` of ``text``, at offsets drawn once from a
    generator seeded by ``seed`` (the same in every process): item ``i`` is the window at
    offset ``i``; a window's first ``context`` characters are the input, the last
    ``context`` the targets."""

    def __init__(self, text: torch.Tensor, context: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.text, self.context = text, context
        self.starts = torch.randint(0, len(text) - context - 1, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        s = int(self.starts[i])
        return self.text[s:s + self.context + 1]


def windows(text: torch.Tensor, args: argparse.Namespace, world_size: int) -> Windows:
    """The job's dataset: one epoch of ``--steps`` batches of ``--batch`` windows per rank."""
    return Windows(text, args.context, args.steps * args.batch * world_size, args.seed)


def rank_batches(dataset: Windows, args: argparse.Namespace, world_size: int, rank: int,
                 start: int = 0) -> Iterator[torch.Tensor]:
    """``[batch, context + 1]`` token batches of rank ``rank`` from step ``start`` on: what the
    job's shuffled ``DistributedSampler`` (torch's order of indices, seeded by ``--seed``) and
    a DataLoader of ``--batch`` hand that rank. For loops that keep their own data position
    (the baselines)."""
    sampler: tud.DistributedSampler[int] = tud.DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    indices = list(sampler)
    for k in range(start, len(indices) // args.batch):
        yield torch.stack([dataset[i] for i in indices[k * args.batch:(k + 1) * args.batch]])


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)


class CharLM(nn.Module):
    """Tokens ``[batch, context] int64`` -> logits ``[batch, context, 128] float32``."""

    def __init__(self, context: int, dim: int = 64, heads: int = 4, layers: int = 2,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.ln(self.blocks(x)))


class Ballast:
    """``[mib * 2**17] int64`` of deterministic bytes (a generator seeded by ``seed``), Stateful
    (``state_dict`` / ``load_state_dict``), so the library captures, transfers and fingerprints
    it with the rest of the state."""

    def __init__(self, mib: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.empty(mib << 17, dtype=torch.int64).random_(generator=g)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"data": self.data}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        data = state_dict["data"]
        if data.dtype != self.data.dtype or data.shape != self.data.shape:
            raise ValueError(f"ballast of {data.dtype} {tuple(data.shape)}, expected "
                             f"{self.data.dtype} {tuple(self.data.shape)}")
        self.data = data  # the received tensor itself (received in place: the same memory)


def weights_digest(model: nn.Module) -> str:
    """sha256 over every parameter and buffer's bytes, in state-dict order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def add_job_args(ap: argparse.ArgumentParser) -> None:
    """The job's own options (steps, data, model size, optimizer), shared with the baselines."""
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch", type=int, default=16, help="windows per rank and step")
    ap.add_argument("--context", type=int, default=64, help="characters per window")
    ap.add_argument("--dim", type=int, default=64, help="model width")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--corpus-kib", type=int, default=4096)


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer,
                                              torch.optim.lr_scheduler.LRScheduler]:
    """The model (the same initial weights in every process: seeded by ``--seed``), AdamW
    (weight decay 0.01) and a schedule of linear warmup over the first 10 % of the steps, then
    cosine decay to 0, stepped once per optimizer step."""
    torch.manual_seed(args.seed)
    model = CharLM(args.context, args.dim, args.heads, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def batch_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The mean next-character cross-entropy of a ``[batch, context + 1]`` token batch (a
    scalar float32 tensor)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for final-<member>.json")
    ap.add_argument("--log-dir", help="directory for the members' timelines (default: "
                                      "TORCHPASS_LOG_DIR)")
    add_job_args(ap)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    ap.add_argument("--extra-state-mb", type=int, default=0,
                    help="MiB of ballast in the training state (module docstring)")
    ap.add_argument("--state-transport", choices=("auto", "tcp", "pg"), default="auto",
                    help="how a spare gets the state: TCP before the group forms, or over "
                         "the new process group (auto: pg over NCCL, tcp over gloo)")
    ap.add_argument("--give-up-s", type=float,
                    help="the last resort: seconds fenced (or a failure unrepaired) before a "
                         "member stops (default: the library's)")
    ap.add_argument("--step-sleep", type=float, default=0.0, metavar="S",
                    help="sleep S seconds after each step: a job paced by the clock, for "
                         "tests that act while it trains")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.log_dir:
        os.environ["TORCHPASS_LOG_DIR"] = args.log_dir
    text = corpus(args.corpus_kib << 10)  # before a spare waits: off the recovery's path
    model, optimizer, scheduler = build(args)
    tp.init_process_group("gloo", seed=args.seed, state_transport=args.state_transport,
                          give_up_s=args.give_up_s)
    dataset = windows(text, args, tp.get_world_size())
    sampler = tp.DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = tp.DataLoader(dataset, batch_size=args.batch, num_workers=args.workers,
                           sampler=sampler)
    ddp = tp.DistributedDataParallel(model)
    tp.track(optimizer, scheduler)
    if args.extra_state_mb:
        tp.track(ballast=Ballast(args.extra_state_mb, args.seed))

    losses: dict[int, float] = {}
    for epoch in tp.epochs(0, 1):
        sampler.set_epoch(epoch)
        for tokens in loader:
            step = scheduler.last_epoch
            loss = batch_loss(ddp, tokens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses[step] = loss.item()
            if args.step_sleep:
                time.sleep(args.step_sleep)
    rank, steps = tp.get_rank(), scheduler.last_epoch
    tp.destroy_process_group()  # every member holds the final state; out of the job: exits
    me = os.environ.get("TORCHPASS_MEMBER_ID", f"rank{rank}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"final-{me}.json").write_text(json.dumps({
        "member": me, "rank": rank, "steps": steps, "weights_sha256": weights_digest(model),
        "losses": {str(k): v for k, v in sorted(losses.items())},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
