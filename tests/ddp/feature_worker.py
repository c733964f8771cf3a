"""A small DDP training script adopted by torchpass_p2p, with one flag per feature a real
script uses (``tests/ddp/test_features.py`` runs it under the launcher, 3 ranks + 1 spare):

* ``--accum N``: gradient accumulation, ``N`` micro-batches per optimizer step, all but the
  last under ``model.no_sync()``;
* ``--groups``: an optimizer with two parameter groups (other lr and weight decay);
* ``--unused``: a submodule that forward never uses (``find_unused_parameters=True``);
* ``--compile BACKEND``: ``torch.compile(DDP(model), backend=BACKEND)``;
* ``--dcp DIR``: at the end of each epoch every rank saves the model and optimizer with
  ``torch.distributed.checkpoint`` (no process group: ``no_dist=True``) to
  ``DIR/epoch{E}/rank{R}``;
* ``--sleep S``: sleep ``S`` seconds after each optimizer step (a slower job, so that a test
  can act while it trains);
* ``--native --hidden H``: ``init_process_group(exact=False)`` (gloo's all-reduce) with a
  hidden layer of ``H`` units, so that a bucket is big enough to take the all-reduce (below
  1 MiB a bucket is gathered in both modes);
* ``--own-lr``: the learning rate set before each optimizer step from a step counter of the
  script's own (``1e-2 * 0.9 ** n``), which does not move to a spare: a replacement steps with
  another learning rate than the survivors (refused, ``torchpass_p2p/ddp/steering.py``);
* ``--odd-epochs N``: the process started as rank 2 (``RANK=2`` in its environment at start)
  runs ``N`` epochs instead of ``--epochs``: another job, refused at its join.

Otherwise an ordinary script: a Dataset of noisy blobs (fresh noise at each fetch), a
DataLoader with a shuffled DistributedSampler, AdamW, a StepLR scheduler, dropout, clipping
and epochs. It writes nothing for the test: each member's ``finished`` event carries the
fingerprint of the whole tracked state (model, optimizer, scheduler, data position).
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from torchpass_p2p import (
    DataLoader,
    DistributedSampler,
    destroy_process_group,
    epochs,
    init_process_group,
    track,
)
from torchpass_p2p import DistributedDataParallel as DDP

DIM, CLASSES = 8, 4


class Blobs(Dataset):
    """``size`` samples ``(x [DIM], label)`` around fixed centres, with fresh noise per fetch."""

    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.centres = torch.randn(CLASSES, DIM, generator=g)
        self.labels = torch.randint(0, CLASSES, (size,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        label = self.labels[i]
        return self.centres[label] + 0.5 * torch.randn(DIM), label


class Net(torch.nn.Module):
    def __init__(self, hidden, unused, sometimes=False):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(DIM, hidden), torch.nn.ReLU(),
                                        torch.nn.Dropout(0.1))
        self.head = torch.nn.Linear(hidden, CLASSES)
        self.spare_head = torch.nn.Linear(hidden, CLASSES) if unused else None
        self.sometimes = sometimes

    def forward(self, x):
        h = self.body(x)
        out = self.head(h)
        if self.sometimes and x[0, 0] > 0:  # data-dependent: some ranks use it, some not
            out = out + self.spare_head(h)
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--groups", action="store_true")
    ap.add_argument("--unused", action="store_true")
    ap.add_argument("--sometimes", action="store_true",
                    help="with --unused: the extra head is used for some batches only")
    ap.add_argument("--compile", default="")
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--dcp", default="")
    ap.add_argument("--odd-epochs", type=int)
    ap.add_argument("--own-lr", action="store_true")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--state-transport", default="auto")
    args = ap.parse_args()
    stop = args.epochs
    if args.odd_epochs is not None and os.environ.get("RANK") == "2":
        stop = args.odd_epochs
    torch.set_num_threads(1)
    init_process_group(backend="gloo", exact=not args.native,
                       state_transport=args.state_transport)
    torch.manual_seed(0)
    dataset = Blobs(args.samples)
    net = Net(args.hidden, args.unused, args.sometimes)
    if args.groups:
        optimizer = torch.optim.AdamW([
            {"params": net.body.parameters(), "lr": 3e-2, "weight_decay": 0.0},
            {"params": net.head.parameters(), "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6},
        ], lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(dataset, batch_size=args.batch_size,
                        sampler=DistributedSampler(dataset, shuffle=True))
    model = DDP(net, find_unused_parameters=args.unused)
    if args.compile:
        model = torch.compile(model, backend=args.compile)
    track(optimizer, scheduler)

    own_steps = 0  # --own-lr: the script's own counter, which a spare starts over
    for epoch in epochs(0, stop):
        rank = int(os.environ["RANK"])
        loader.sampler.set_epoch(epoch)
        losses = []
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % args.accum == 0
            if last:
                loss = F.cross_entropy(model(x), y) / args.accum
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                if args.own_lr:
                    for group in optimizer.param_groups:
                        group["lr"] = 1e-2 * 0.9 ** own_steps
                    own_steps += 1
                optimizer.step()
                optimizer.zero_grad()
                if args.sleep:
                    time.sleep(args.sleep)
            else:
                with model.no_sync():
                    loss = F.cross_entropy(model(x), y) / args.accum
                    loss.backward()
            losses.append(loss.item())
        scheduler.step()
        print(f"rank {rank} epoch {epoch}: {len(losses)} batches, "
              f"mean loss {sum(losses) / len(losses):.4f}", flush=True)
        if args.dcp:
            import torch.distributed.checkpoint as dcp

            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
            dcp.save(state, checkpoint_id=os.path.join(args.dcp, f"epoch{epoch}", f"rank{rank}"),
                     no_dist=True)
    destroy_process_group()


if __name__ == "__main__":
    main()
