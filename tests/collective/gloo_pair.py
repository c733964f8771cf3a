"""Both ranks of a gloo process group of two, built in two threads of one process: for tests
that need a real peer without starting processes."""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch.distributed as dist


def gloo_pair(timeout_s: float) -> list[Any]:
    """``[rank 0's, rank 1's]`` ``ProcessGroupGloo`` over one ``HashStore``, with the group
    timeout ``timeout_s`` seconds."""
    store, pgs = dist.HashStore(), [None, None]

    def connect(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=connect, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return pgs
