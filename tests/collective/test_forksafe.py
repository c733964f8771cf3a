"""A process group's connections close for its peers when its member drops it, even with a
forked child alive (torchpass_p2p/collective/forksafe.py): a DataLoader worker forked after the
group formed holds copies of its sockets, and the kernel ends a connection only once every
copy is closed.

Two processes form a gloo group; rank 1 forks a child that lives 30 s, then drops the group.
Must hold: rank 0's next operation fails within a few seconds (measured without the remedy:
only when the child exited), and the child still has the descriptors it made itself (a pipe).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from torchpass_p2p.collective.forksafe import sockets_made_by

CHILD_LIFE_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _member(rank: int, port: int, out: Connection) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    pg = sockets_made_by(lambda: dist.ProcessGroupGloo(store, rank, 2,
                                                       datetime.timedelta(seconds=60)))
    pg.allreduce([torch.ones(1)]).wait()
    if rank == 1:
        read, write = os.pipe()  # made before the fork: the child must keep it
        child = os.fork()
        if child == 0:
            os.write(write, b"ok")
            time.sleep(CHILD_LIFE_S)
            os._exit(0)
        out.send(os.read(read, 2).decode())
        del pg  # its connections close
        time.sleep(CHILD_LIFE_S)
        os.kill(child, 9)
        return
    began = time.monotonic()
    try:
        pg.allreduce([torch.ones(1)]).wait()
        out.send("completed")
    except RuntimeError:
        out.send(time.monotonic() - began)


def test_a_dropped_group_fails_its_peers_at_once_with_a_forked_child_alive() -> None:
    ctx = mp.get_context("spawn")
    port = _free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    members = [ctx.Process(target=_member, args=(r, port, pipes[r][1]), daemon=True)
               for r in range(2)]
    for p in members:
        p.start()
    try:
        assert pipes[1][0].poll(60) and pipes[1][0].recv() == "ok"
        assert pipes[0][0].poll(CHILD_LIFE_S / 2), "rank 0 still waits on the dropped group"
        failed_after = pipes[0][0].recv()
        assert isinstance(failed_after, float) and failed_after < CHILD_LIFE_S / 2
    finally:
        for p in members:
            p.kill()
