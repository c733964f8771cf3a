"""A small job for the status page's end-to-end test (``tests/agent/test_status_page_job.py``),
run under ``torchpass-p2p launch``: a linear model trained by the step-loop Trainer, each step
slowed by ``--step-s`` seconds of sleep so that the job lasts while a browser watches it and
leaves the two shared cores to the browser. ``--state-kib`` KiB of optimizer-like ballast make
the transferred state big enough to show a transfer. Exit codes as ``examples/char_lm.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import torchpass_p2p
from torchpass_p2p.collective import exit_process
from torchpass_p2p.launch.outcome import EXIT_DRAINED, EXIT_REMOVED, EXIT_STOPPED
from torchpass_p2p.trainer import Drained, Removed, Stopped, Trainer, step_generator


class Ballast:
    """``kib`` KiB of fixed bytes in the state (a Stateful): transferred, never trained."""

    def __init__(self, kib: int) -> None:
        self.data = torch.arange(kib * 256, dtype=torch.float32)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"data": self.data}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.data.copy_(state["data"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--state-kib", type=int, default=0)
    ap.add_argument("--log-dir", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)

    agent = torchpass_p2p.start()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    me = f"{agent.member_id:016x}"
    os.makedirs(args.log_dir, exist_ok=True)
    trainer = Trainer(model, optimizer, agent=agent, seed=0,
                      extra={"ballast": Ballast(args.state_kib)},
                      log_path=os.path.join(args.log_dir, f"{me}.jsonl"))

    def loss_fn(step: int, rank: int) -> torch.Tensor:
        time.sleep(args.step_s)
        g = step_generator(0, rank, step)
        return model(torch.randn(8, 16, generator=g)).pow(2).mean()

    try:
        trainer.run(loss_fn, args.steps)
    except (Removed, Stopped) as exc:
        print(f"member {me}: {exc}; exiting", file=sys.stderr, flush=True)
        agent.stop(leave=False, timeout_s=2.0)
        return (EXIT_STOPPED if isinstance(exc, Stopped) else
                EXIT_DRAINED if isinstance(exc, Drained) else EXIT_REMOVED)
    agent.stop(leave=False, timeout_s=2.0)
    return 0


if __name__ == "__main__":
    exit_process(main())
