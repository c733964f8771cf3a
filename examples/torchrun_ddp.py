"""An ordinary DDP training script as PyTorch's DDP tutorials teach it: a Dataset, a
DataLoader with a DistributedSampler (shuffled, two workers), DDP, bf16 autocast with a
GradScaler, an LR scheduler, gradient clipping, epochs and a periodic snapshot that a restarted
job resumes from.
``examples/torchrun_ddp.py`` runs under torchrun; ``examples/torchpass_ddp.py`` is the same
script adopted by torchpass_p2p (``diff`` the two; ``docs/training.md``):

    torchrun --nproc-per-node 4 examples/torchrun_ddp.py --epochs 4
    torchpass-p2p launch --nproc 4 --spares 2 examples/torchpass_ddp.py --epochs 4
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class NoisyBlobs(Dataset):
    """``size`` samples ``(x [dim] float32, label int64)`` around ``classes`` fixed centres;
    each fetch adds fresh noise from torch's generator (a random augmentation)."""

    def __init__(self, size, dim=32, classes=8):
        g = torch.Generator().manual_seed(0)
        self.centres = torch.randn(classes, dim, generator=g)
        self.labels = torch.randint(0, classes, (size,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        label = self.labels[i]
        return self.centres[label] + 0.5 * torch.randn(self.centres.shape[1]), label


def build_model(dim=32, hidden=256, classes=8):
    return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.BatchNorm1d(hidden),
                               torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))


class Trainer:
    def __init__(self, model, loader, optimizer, scheduler, scaler, save_every, snapshot_path):
        self.rank = int(os.environ["RANK"])
        self.model, self.loader = model, loader
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.save_every, self.snapshot_path = save_every, snapshot_path
        self.epochs_run = 0
        if snapshot_path and os.path.exists(snapshot_path):
            self.load_snapshot()
        self.model = DDP(self.model)

    def load_snapshot(self):
        snapshot = torch.load(self.snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.scheduler.load_state_dict(snapshot["scheduler"])
        self.scaler.load_state_dict(snapshot["scaler"])
        self.epochs_run = snapshot["epochs_run"]
        print(f"rank {self.rank}: resuming at epoch {self.epochs_run}")

    def save_snapshot(self, epoch):
        snapshot = {"model": self.model.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "scaler": self.scaler.state_dict(), "epochs_run": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"epoch {epoch}: snapshot saved at {self.snapshot_path}")

    def run_batch(self, source, targets):
        device = next(self.model.parameters()).device
        source, targets = source.to(device), targets.to(device)
        self.optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(self.model(source), targets)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.item()

    def run_epoch(self, epoch):
        self.loader.sampler.set_epoch(epoch)
        losses = [self.run_batch(source, targets) for source, targets in self.loader]
        self.scheduler.step()
        print(f"rank {self.rank} epoch {epoch}: {len(losses)} steps, "
              f"mean loss {sum(losses) / len(losses):.4f}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self.run_epoch(epoch)
            if self.rank == 0 and self.snapshot_path and (
                    epoch % self.save_every == 0 or epoch == max_epochs - 1):
                self.save_snapshot(epoch)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--snapshot", default="")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (every process shares it)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    dataset = NoisyBlobs(args.samples)
    model = build_model(hidden=args.hidden).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler(torch.device(args.device).type)
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=2,
                        sampler=DistributedSampler(dataset, shuffle=True))
    trainer = Trainer(model, loader, optimizer, scheduler, scaler, args.save_every,
                      args.snapshot)
    trainer.train(args.epochs)
    destroy_process_group()


if __name__ == "__main__":
    main()
