"""A character-level transformer language model on the text of Python's own standard library,
trained data-parallel under torchpass_p2p: run it with the launcher,

    python -m torchpass_p2p.cli.main launch --nproc 4 --spares 2 examples/char_lm.py --out OUT

Every process (ranks and spares) builds the model first; spares then wait for a rank inside
``Trainer.run``. The data needs no download: the ``.py`` files of the running interpreter's
standard library (sorted by name, first ``--corpus-kib`` KiB, bytes above 127 mapped to ``?``).
Rank ``r``'s batch of step ``k`` is ``--batch`` windows of ``--context + 1`` characters at
offsets drawn from a generator seeded by ``(seed, r, k)``. Each rank writes
``OUT/final-<member>.json`` (rank, steps, state fingerprint, weights digest, loss curve) when
training ends. A member removed from the job exits with code 3, one drained (``torchpass-p2p
drain``: it trains until a spare holds its rank) with 4, and every member with 5 once the
agreement stops the job (a vacant rank nobody can fill: every holder of its state died).

The model's size is ``--dim``, ``--heads`` and ``--layers`` (default 64, 4, 2: 0.1M parameters,
1.3 MB of state with AdamW); ``--dim 512 --layers 8 --batch 2`` is the scale of issue #7's
reference job (25.4M parameters, 305 MB of state, about 1.5 s a step with 4 ranks on 2 cores).
:func:`add_job_args`, :func:`build` and :func:`batch_loss` are shared with the baselines in
``benchmarks/``, so every method trains exactly this job.

``--extra-state-mb N`` adds N MiB of ballast to the training state (a :class:`Ballast` among the
trainer's ``extra`` objects): deterministic bytes drawn from ``--seed``, never changed by a step,
but part of every snapshot, transfer and state fingerprint like the weights. It makes a small
model's state as large as a real one's, so a transfer lasts long enough for faults to land in
its middle (S10). It costs nothing per step: the state is captured only when a spare needs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import torchpass_p2p
from torchpass_p2p.collective import exit_process
from torchpass_p2p.launch.outcome import EXIT_DRAINED, EXIT_REMOVED, EXIT_STOPPED
from torchpass_p2p.trainer import Drained, Removed, Stopped, Trainer, step_generator
from torchpass_p2p.trainer.regroup import GIVE_UP_S

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
    (``state_dict`` / ``load_state_dict``), so the trainer captures, transfers and fingerprints
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
    cosine decay to 0."""
    torch.manual_seed(args.seed)
    model = CharLM(args.context, args.dim, args.heads, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def batch_loss(model: nn.Module, text: torch.Tensor, args: argparse.Namespace, step: int,
               rank: int) -> torch.Tensor:
    """Rank ``rank``'s mean cross-entropy at step ``step`` (a scalar float32 tensor): ``--batch``
    windows at offsets drawn from a generator seeded by ``(seed, rank, step)``."""
    g = step_generator(args.seed, rank, step, salt=1)
    starts = torch.randint(0, len(text) - args.context - 1, (args.batch,), generator=g)
    window = torch.stack([text[s:s + args.context + 1] for s in starts.tolist()])
    logits = model(window[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for final-<member>.json")
    ap.add_argument("--log-dir", help="directory for the trainers' timelines")
    add_job_args(ap)
    ap.add_argument("--extra-state-mb", type=int, default=0,
                    help="MiB of ballast in the training state (module docstring)")
    ap.add_argument("--state-transport", choices=("auto", "tcp", "pg"), default="auto",
                    help="how a spare gets the state: TCP before the group forms, or over "
                         "the new process group (auto: pg over NCCL, tcp over gloo)")
    ap.add_argument("--give-up-s", type=float, default=GIVE_UP_S,
                    help="the trainer's last resort: seconds fenced (or a failure unrepaired) "
                         "before a member stops (default %(default)g)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    agent = torchpass_p2p.start()
    text = corpus(args.corpus_kib << 10)
    model, optimizer, scheduler = build(args)
    me = f"{agent.member_id:016x}"
    log_path = None
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        log_path = os.path.join(args.log_dir, f"{me}.jsonl")
    extra = {"ballast": Ballast(args.extra_state_mb, args.seed)} if args.extra_state_mb else {}
    trainer = Trainer(model, optimizer, agent=agent, scheduler=scheduler, seed=args.seed,
                      extra=extra, state_transport=args.state_transport, log_path=log_path,
                      give_up_s=args.give_up_s)

    def loss_fn(step: int, rank: int) -> torch.Tensor:
        return batch_loss(model, text, args, step, rank)

    try:
        result = trainer.run(loss_fn, args.steps)
    except (Removed, Stopped) as exc:
        print(f"member {me}: {exc}; exiting", file=sys.stderr, flush=True)
        agent.stop(leave=False, timeout_s=2.0)
        return (EXIT_STOPPED if isinstance(exc, Stopped) else
                EXIT_DRAINED if isinstance(exc, Drained) else EXIT_REMOVED)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"final-{me}.json").write_text(json.dumps({
        "member": me, "rank": result.rank, "steps": result.steps,
        "fingerprint": result.fingerprint.hex(), "weights_sha256": weights_digest(model),
        "recoveries": result.recoveries,
        "losses": {str(k): v for k, v in sorted(result.losses.items())},
    }))
    agent.stop(leave=False, timeout_s=2.0)
    return 0


if __name__ == "__main__":
    exit_process(main())
