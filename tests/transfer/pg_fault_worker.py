"""One rank of a process-group transfer with a source that fails halfway:
``python -m tests.transfer.pg_fault_worker RANK WORLD STORE_PATH OUT_JSON FAULT [DEVICE]``
(``DEVICE``: every rank stages its messages through buffers there, NCCL's path; ``cpu-serial``:
on the CPU, the receiver taking every source's chunks from one thread, as over NCCL).

Ranks 0..WORLD-2 are sources of a deterministic 16 MiB state in 1 MiB chunks; the last rank
receives. Rank 0, the victim, injects ``FAULT`` right after the second chunk of its stripe has
left: ``kill`` (SIGKILL itself) or ``stop`` (SIGSTOP itself: a hung source; the test kills it
afterwards); or ``kill_at_manifest``: SIGKILL itself once its manifest has left, while the
receiver waits ``LATE_POST_S`` before posting its receives (the post itself then fails); or
``kill_one_shot``: as ``kill``, with a receiver that follows NCCL's rule (no repair round); or
``alloc``: no fault at the sources, a receiver that holds no tensors and cannot allocate any; or
``wrong_step``: the victim serves the state at step 6 where the plan asks for step 5; or
``layout``: the victim stages its messages where the others do not, or the reverse (a
mismatched ``device``); or ``corrupt``: the victim flips a byte of chunk 0 once its manifest
(its digests) has left; or
``slow`` / ``slower``: the victim takes ``SLOW_CHUNK_S`` / ``SLOWER_CHUNK_S`` (under T) after each
chunk, so its stripe takes longer than a healthy source's status wait (``STATUS_WAIT_FACTOR * T``)
once the other's has arrived; or ``cancel``: the victim as ``slow``, and a receiver that cancels its
receive once the first bytes have landed, then records whether the target changed before every
source has ended. The receiver writes its outcome as JSON (with ``detail``, a ``TransferFailed``'s
text) and every rank leaves with ``os._exit`` (a group with a dead or stopped peer is not torn down:
destroying it can block)."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from torchpass_p2p.transfer import Snapshot, TransferFailed, manifest
from torchpass_p2p.transfer.pg_transport import PgTransport
from torchpass_p2p.transfer.state_transport import TransferPlan

from .source_proc import state

SIZE_MIB = 16
CHUNK_BYTES = 1 << 20
PROGRESS_TIMEOUT_S = 2.0
LATE_POST_S = 1.5
"""``kill_at_manifest``: how long the receiver waits before posting the stripes' receives, so
that gloo has seen the victim's connection reset first."""
SLOW_CHUNK_S = 1.0
"""``slow``: half of T per chunk (every chunk well within T), 8 s for the victim's 8 chunks,
more than the 6 s a healthy source waits without a word from the receiver."""
SLOWER_CHUNK_S = 1.6
"""``slower``: as ``slow``, at 0.8 T per chunk: a receiver taking chunks in posting order only
hears from the healthy source's last chunks after up to four of the victim's, late enough for
the healthy source to conclude receiver_lost after 3T."""
GROUP_TIMEOUT_S = 600.0
"""Far above the transfer's own deadline: only ``progress_timeout_s`` may end a wait."""


class Victim(PgTransport):
    def __init__(self, fault: str, device: str | None) -> None:
        super().__init__(device=device)
        self.fault = fault
        self.sent = 0

    def chunk_sent(self, index: int) -> None:
        self.sent += 1
        if self.fault in ("slow", "cancel", "slower"):
            # Slow but moving: each chunk within T.
            time.sleep(SLOWER_CHUNK_S if self.fault == "slower" else SLOW_CHUNK_S)
            return
        if self.sent != 2:
            return
        if self.fault in ("kill", "kill_one_shot"):
            os.kill(os.getpid(), signal.SIGKILL)  # never returns
            return
        if self.fault != "stop":
            return
        # Hung for good: a SIGCONT from elsewhere (in one local run of the suite something
        # resumed the stopped victim within 2 s, which then sent its whole stripe) stops it
        # again at once, and says so.
        while True:
            os.kill(os.getpid(), signal.SIGSTOP)
            print("victim: continued by a stray SIGCONT; stopping again", file=sys.stderr,
                  flush=True)


    def manifest_sent(self) -> None:
        if self.fault == "kill_at_manifest":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "corrupt":  # after its digests were announced: chunk 0 fails its own
            self.served.tensors[0].view(-1).view(torch.uint8)[0] ^= 1


class OneShotReceiver(PgTransport):
    """Ends the transfer at the first lost source, as over NCCL."""

    def routes_around_failures(self) -> bool:
        return False


class LateReceiver(PgTransport):
    """Posts its first receives only after the victim is surely dead (its pair closed)."""

    def posting(self, round_: int) -> None:
        if round_ == 0:
            time.sleep(LATE_POST_S)


class _NoMemoryTorch:
    """torch, with an ``empty`` that fails as for a state larger than memory (but for
    ``decode_manifest``'s placeholders)."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def empty(*shape: object, **kw: object) -> torch.Tensor:
        if shape != (0,):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return torch.empty(0, **kw)  # type: ignore[arg-type]


async def cancelled(receiver: PgTransport, plan: TransferPlan, into: Snapshot,
                    store: dist.Store) -> dict:
    """Cancel ``receiver.receive`` once bytes have landed in ``into``; then, once every source
    has ended (each says so in ``store``), whether ``into`` changed after the cancel."""
    task = asyncio.ensure_future(receiver.receive(plan, into=into))
    while not any(bool(t.any()) for t in into.tensors) and not task.done():
        await asyncio.sleep(0.01)
    complete = task.done()
    task.cancel()
    try:
        await task
        outcome = "completed"
    except asyncio.CancelledError:
        outcome = "cancelled"
    at_cancel = [t.clone() for t in into.tensors]
    sources = [f"done{k}" for k in plan.sources]
    await asyncio.to_thread(store.wait, sources, datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    expected = state(SIZE_MIB)
    return {"outcome": outcome, "complete_at_cancel": complete,
            "changed_after_cancel": any(not a.equal(t) for a, t in zip(at_cancel, into.tensors,
                                                                        strict=True)),
            "partial_at_cancel": not all(t.equal(expected[e.name.split(".", 1)[1]])
                                         for e, t in zip(into.table, at_cancel, strict=True))}


async def main(rank: int, world: int, out: str, fault: str, device: str | None,
               store: dist.Store) -> None:
    sources = tuple(range(world - 1))
    receiver = world - 1
    plan = TransferPlan(sources=sources, config_id=1, receiver=receiver,
                        progress_timeout_s=PROGRESS_TIMEOUT_S,
                        step=5 if fault == "wrong_step" else None)
    snap = Snapshot.capture({"model": state(SIZE_MIB)}, step=5, chunk_bytes=CHUNK_BYTES)
    if rank != receiver:
        mine = ("cpu" if device is None else None) if fault == "layout" else device
        transport = Victim(fault, mine) if rank == 0 else PgTransport(device=device)
        served = snap
        if rank == 0 and fault == "wrong_step":
            served = Snapshot.capture({"model": state(SIZE_MIB)}, step=6, chunk_bytes=CHUNK_BYTES)
        transport.served = served  # type: ignore[attr-defined]
        await transport.provide(served, plan)
        return
    into = Snapshot.capture({"model": {k: t.zero_() for k, t in state(SIZE_MIB).items()}},
                            step=0, chunk_bytes=CHUNK_BYTES)
    if fault == "alloc":
        into = None
        manifest.torch = _NoMemoryTorch()  # type: ignore[assignment]
    report: dict = {}
    if fault == "cancel":
        assert into is not None
        report = await cancelled(PgTransport(device=device), plan, into, store)
        with open(out, "w") as f:
            json.dump(report, f)
        return
    try:
        cls = {"kill_at_manifest": LateReceiver,
               "kill_one_shot": OneShotReceiver}.get(fault, PgTransport)
        receiver = cls(device=device)
        res = await receiver.receive(plan, into=into)
    except TransferFailed as e:
        report = {"error": type(e).__name__, "reason": e.reason, "failures": dict(e.failures),
                  "detail": e.detail}
        print(f"receiver: {e!r}", file=sys.stderr, flush=True)
    else:
        s = res.snapshot
        fresh = Snapshot(s.step, s.table, s.tensors, s.tree, s.chunk_bytes)
        expected = state(SIZE_MIB)
        report = {
            "failures": dict(res.failures),
            "refetched": res.refetched_chunks,
            "bytes_by_source": {str(k): v for k, v in res.bytes_by_source.items()},
            "total_bytes": s.total_bytes,
            "num_chunks": s.num_chunks,
            "in_place": res.allocated_bytes == 0,
            "fingerprint_equal": fresh.fingerprint() == snap.fingerprint() == res.fingerprint,
            "tensors_equal": all(t.equal(expected[e.name.split(".", 1)[1]])
                                 for e, t in zip(s.table, s.tensors, strict=True)),
        }
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    r, w, store_path, out_path, fault = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                         sys.argv[4], sys.argv[5])
    device = sys.argv[6] if len(sys.argv) > 6 else None
    if device == "cpu-serial":
        device = "cpu"
        PgTransport.staged_lanes = lambda self: False  # type: ignore[method-assign]
    store = dist.FileStore(store_path, w)
    dist.init_process_group("gloo", store=store, rank=r, world_size=w,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    code = 0
    try:
        asyncio.run(main(r, w, out_path, fault, device, store))
    except TransferFailed as e:
        print(f"rank {r}: {e!r}", file=sys.stderr, flush=True)
        code = 3
        if r == 0 and fault in ("corrupt", "layout"):  # the victim's own outcome, for the test
            with open(f"{out_path}.victim", "w") as f:
                f.write(e.reason)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # The receiver stays until the surviving sources are through (its exit would close
        # their connections before they read its last status); the store is not the group.
        # With no victim (``slow``), every source, so the test sees every exit code.
        if r == w - 1:
            first = 0 if fault in ("slow", "corrupt", "layout") else 1
            store.wait([f"done{k}" for k in range(first, w - 1)],
                       datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        else:
            store.set(f"done{r}", str(code))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
