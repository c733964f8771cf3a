"""One member for the collective tests, configurations driven by hand (no agents).

``python -m tests.collective.mp_worker DIR MEMBER``: configuration ``c`` is the JSON file
``DIR/config-<c>.json`` (``{"ranks": [member, ...]}``). The member joins configuration 1, then
loops: all-gather a tensor stamped with (config, rank, iteration), check it, log one JSON line
per iteration to ``DIR/<member>.jsonl``. When an operation fails or the next configuration file
appears, it moves to the newest configuration (if it holds a rank there) and goes on;
``DIR/stop`` ends it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from tests.collective.files_directory import FileDirectory
from torchpass_p2p.collective import (
    CollectiveError,
    GroupSpec,
    StoreKeeper,
    Superseded,
    build_group,
    exit_process,
)


def newest(root: Path) -> tuple[int, list[int]] | None:
    found = sorted(int(p.stem.split("-")[1]) for p in root.glob("config-*.json"))
    if not found:
        return None
    c = found[-1]
    return c, json.loads((root / f"config-{c}.json").read_text())["ranks"]


def main(root: Path, member: int) -> int:
    torch.set_num_threads(1)
    log = open(root / f"{member:016x}.jsonl", "a", buffering=1)  # noqa: SIM115

    def emit(**rec: object) -> None:
        rec["t"] = time.time()
        log.write(json.dumps(rec) + "\n")

    directory, keeper = FileDirectory(root, member), StoreKeeper()
    config_id, group, it = 0, None, 0
    emit(event="up")
    while not (root / "stop").exists():
        latest = newest(root)
        if latest is None or latest[0] == config_id and group is None:
            time.sleep(0.01)
            continue
        if latest[0] != config_id:
            c, ranks = latest
            if group is not None:
                group.abandon()
                group = None
            config_id = c
            if member not in ranks:
                emit(event="not_a_rank", config_id=c)
                continue
            spec = GroupSpec(c, ranks.index(member), len(ranks), ranks[0])
            try:
                group = build_group(spec, directory, keeper,
                                    watch=lambda c=c: newest(root)[0] != c)
            except (Superseded, CollectiveError) as exc:
                emit(event="rendezvous_failed", config_id=c, error=type(exc).__name__)
                continue
            emit(event="formed", config_id=c, rank=spec.rank, seconds=group.formed_s)
            it = 0
        assert group is not None
        rank, world = group.spec.rank, group.spec.world_size
        x = torch.tensor([config_id, rank, it], dtype=torch.float64)
        try:
            got = group.allgather(x, watch=lambda c=config_id: newest(root)[0] != c)
            mean = group.mean_in_rank_order(torch.full((1000,), rank + 0.1, dtype=torch.float32),
                                            watch=lambda c=config_id: newest(root)[0] != c)
        except CollectiveError as exc:
            emit(event="failed", config_id=config_id, error=str(exc)[:120])
            group = None
            time.sleep(0.01)
            continue
        except Superseded:
            emit(event="superseded", config_id=config_id)
            group = None
            continue
        expect = [[config_id, r, it] for r in range(world)]
        ok = [g.tolist() for g in got] == expect
        emit(event="op", config_id=config_id, rank=rank, it=it, ok=ok,
             mean=mean[0].item(), mean_bits=mean.view(torch.int32)[:4].tolist())
        it += 1
        time.sleep(0.005)
    if group is not None:
        group.close()
    keeper.close()
    emit(event="done")
    return 0


if __name__ == "__main__":
    exit_process(main(Path(sys.argv[1]), int(sys.argv[2])))
