"""A transfer source in its own process: ``python -m tests.transfer.source_proc KEY_HEX
CONFIG_ID SIZE_MIB``. Builds a deterministic state of SIZE_MIB MiB, serves it on loopback,
prints ``READY <port> <fingerprint hex>`` and serves until killed or stdin closes."""

from __future__ import annotations

import asyncio
import sys

import torch

from torchpass_p2p.transfer import Snapshot, TransferKeys, TransferServer

N_TENSORS = 8


def state(size_mib: int) -> dict[str, torch.Tensor]:
    n = size_mib * (1 << 20) // 4 // N_TENSORS
    g = torch.Generator().manual_seed(1234)
    noise = torch.rand(4099, generator=g)  # a period that no chunk size divides
    out = {}
    for k in range(N_TENSORS):
        t = torch.arange(n, dtype=torch.float32).mul_(k + 1)
        t.view(-1)[: n - n % 4099].view(-1, 4099).add_(noise)
        out[f"w{k}"] = t
    return out


async def main(key: bytes, config_id: int, size_mib: int) -> None:
    snap = Snapshot.capture({"model": state(size_mib)}, step=100, metadata={"pos": 77})
    fpr = await asyncio.to_thread(snap.fingerprint)
    async with TransferServer(TransferKeys(key), lambda: config_id) as server:
        server.publish(snap)
        print(f"READY {server.port} {fpr.hex()}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(main(bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
