"""The trainer's gradient mean, sharded against gathering whole buffers, in one run.

Run ``python -m benchmarks.rank_order_mean [--json] [--world 4] [--mb 1 10 100]``. ``--world``
gloo processes on this machine each hold a float32 buffer of ``MB`` megabytes and compute
``(t_0 + ... + t_{n-1}) / n`` summed in rank order three ways, each timed ``--repeats`` times
behind a barrier (median seconds, rank 0's clock):

* ``sharded``: :meth:`ManagedGroup.mean_in_rank_order` above its threshold (all-to-all of
  shards, a rank-order sum of one shard, all-gather of the sums);
* ``gather``: :meth:`ManagedGroup.allgather` of whole buffers, then the rank-order sum of all
  (what ``mean_in_rank_order`` does below the threshold);
* ``allreduce``: the backend's own sum (:meth:`ManagedGroup.allreduce_sum`), whose order is
  gloo's: the floor, not reproducible bit for bit.

Also checked on every rank: the sharded and gathered results are bitwise equal. Figures only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchpass_p2p.collective import GroupSpec, ManagedGroup, sum_in_rank_order
from torchpass_p2p.collective.group import SHARDED_MIN_BYTES


def _worker(rank: int, world: int, port: int, sizes_mb: list[float], repeats: int,
            results: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=120))
    group = ManagedGroup(pg, GroupSpec(1, rank, world, 0), "gloo")
    for mb in sizes_mb:
        n = int(mb * 1e6) // 4
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        methods = {
            "sharded": lambda x=x: group.mean_in_rank_order(x),
            "gather": lambda x=x: sum_in_rank_order(group.allgather(x)).div_(world),
            "allreduce": lambda x=x: group.allreduce_sum(x).div_(world),
        }
        equal = torch.equal(methods["sharded"](), methods["gather"]())
        times: dict[str, list[float]] = {k: [] for k in methods}
        for _ in range(repeats):
            for name, run in methods.items():  # interleaved: drift hits every method alike
                group.allgather(torch.zeros(1))  # barrier
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        if rank == 0:
            results.put({"mb": mb, "bitwise_equal": equal,
                         **{f"{k}_s": statistics.median(v) for k, v in times.items()}})
        elif not equal:
            results.put({"mb": mb, "bitwise_equal": False, "rank": rank})
    group.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--mb", type=float, nargs="+", default=[0.4, 1.0, 10.0, 100.0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args.world, port, args.mb, args.repeats, results),
                       nprocs=args.world, start_method="spawn")
    rows = []
    while not results.empty():
        rows.append(results.get())
    sizes = [r for r in rows if "rank" not in r]
    for row in sizes:
        row["bitwise_equal"] = row["bitwise_equal"] and not any(
            r["mb"] == row["mb"] for r in rows if "rank" in r)
        row["speedup_sharded_vs_gather"] = row["gather_s"] / row["sharded_s"]
        row["sharded_vs_allreduce"] = row["sharded_s"] / row["allreduce_s"]
    out = {"benchmark": "rank_order_mean", "world_size": args.world, "repeats": args.repeats,
           "dtype": "float32", "backend": "gloo", "sharded_min_bytes": SHARDED_MIN_BYTES,
           "sizes": sorted(sizes, key=lambda r: r["mb"])}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.world} gloo processes, float32, median of {args.repeats} (seconds)")
    print(f"{'MB':>8} {'sharded':>9} {'gather':>9} {'allreduce':>9} {'gather/sharded':>15} "
          f"{'bitwise':>8}")
    for r in out["sizes"]:
        print(f"{r['mb']:>8.1f} {r['sharded_s']:>9.4f} {r['gather_s']:>9.4f} "
              f"{r['allreduce_s']:>9.4f} {r['speedup_sharded_vs_gather']:>15.2f} "
              f"{str(r['bitwise_equal']):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
