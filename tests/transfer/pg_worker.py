"""One rank of the process-group conformance run: ``python -m tests.transfer.pg_worker RANK
WORLD STORE_PATH OUT_JSON [DEVICE]``. Ranks 0..WORLD-2 are sources, the last rank receives.
``DEVICE``: stage every message through buffers there (``cpu`` here: the path NCCL takes);
``nccl``: an NCCL group, rank ``r`` on CUDA device ``r``, staging inferred from the backend."""

from __future__ import annotations

import asyncio
import datetime
import json
import sys

import torch
import torch.distributed as dist

from torchpass_p2p.transfer.pg_transport import PgTransport
from torchpass_p2p.transfer.state_transport import TransferPlan

from .states import CASES, build, capture, report


async def main(rank: int, world: int, out: str, device: str | None) -> None:
    sources = tuple(range(world - 1))
    receiver = world - 1
    transport = PgTransport(device=device)
    reports = {}
    for case in CASES:
        plan = TransferPlan(sources=sources, config_id=1, receiver=receiver,
                            progress_timeout_s=60.0)
        if rank == receiver:
            objs = build(case, "receiver")[0]
            result = await transport.receive(plan, into=objs)
            reports[case] = report(case, result, objs)
            reports[case]["failures"] = dict(result.failures)
            reports[case]["sources_used"] = sum(1 for b in result.bytes_by_source.values() if b)
        else:
            snap, _ = capture(case, "source")
            await transport.provide(snap, plan)
        dist.barrier()
    if rank == receiver:
        with open(out, "w") as f:
            json.dump(reports, f)


if __name__ == "__main__":
    r, w, store_path, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    device = sys.argv[5] if len(sys.argv) > 5 else None
    backend = "gloo"
    if device == "cpu-serial":  # staged on the CPU, one receiving thread: NCCL's path
        device = "cpu"
        PgTransport.staged_lanes = lambda self: False  # type: ignore[method-assign]
    if device == "nccl":
        backend, device = "nccl", None
        torch.cuda.set_device(r)
    store = dist.FileStore(store_path, w)
    dist.init_process_group(backend, store=store, rank=r, world_size=w,
                            timeout=datetime.timedelta(seconds=60))
    try:
        asyncio.run(main(r, w, out_path, device))
    finally:
        dist.destroy_process_group()
