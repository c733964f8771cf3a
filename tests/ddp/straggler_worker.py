"""A small DDP script adopted by torchpass_p2p for the straggler tests
(``tests/ddp/test_stragglers_job.py``), run under the launcher: one epoch of ``--steps`` steps
of a two-layer net on random blobs.

* ``--slow-rank R --slow-s S``: the process started as rank ``R`` sleeps ``S`` seconds before
  each ``loss.backward()``, i.e. before each step's gradient collectives (a spare that takes
  its rank does not);
* ``--figures PATH``: the process started as rank 0 writes every committed step's figures
  from the vote (every rank's ``[compute_s, wait_s]``, :mod:`torchpass_p2p.ddp.stragglers`)
  to ``PATH`` as JSON, ``{"steps": [[step, [[c, w], ...]], ...]}``;
* ``--out DIR``: each process writes ``DIR/<member id>.json`` at its start, before its agent
  starts (a spare's ``init_process_group`` returns only once it holds a rank):
  ``{"member", "role", "rank", "status"}`` from the launcher's environment.
"""

import argparse
import json
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
from torchpass_p2p.ddp.session import current

DIM, HIDDEN, CLASSES, BATCH = 8, 16, 4, 4


class Blobs(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, DIM, generator=g)
        self.y = torch.randint(0, CLASSES, (size,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--slow-rank", type=int)
    ap.add_argument("--slow-s", type=float, default=0.2)
    ap.add_argument("--figures")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.out:
        me = os.environ["TORCHPASS_MEMBER_ID"]
        rank = os.environ.get("RANK")
        tmp = os.path.join(args.out, f"{me}.tmp")
        with open(tmp, "w") as f:
            json.dump({"member": me, "role": os.environ["TORCHPASS_ROLE"],
                       "rank": None if rank is None else int(rank),
                       "status": os.environ["TORCHPASS_STATUS"]}, f)
        os.rename(tmp, os.path.join(args.out, f"{me}.json"))
    started_as = None if os.environ.get("TORCHPASS_ROLE") == "spare" else os.environ.get("RANK")
    slow = started_as is not None and args.slow_rank is not None \
        and int(started_as) == args.slow_rank
    record = args.figures if started_as == "0" else None
    torch.set_num_threads(1)
    init_process_group(backend="gloo")
    dataset = Blobs(args.steps * args.world * BATCH)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(),
                              torch.nn.Linear(HIDDEN, CLASSES))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset))
    model = DDP(net)
    track(optimizer)
    session = current()
    figures = []
    for _epoch in epochs(0, 1):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            if slow:
                time.sleep(args.slow_s)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if record and session.step >= 2:  # the vote of step s carries step s - 1's
                figures.append([session.step - 2, session.step_figures])
    if record:
        with open(record, "w") as f:
            json.dump({"steps": figures}, f)
    destroy_process_group()


if __name__ == "__main__":
    main()
