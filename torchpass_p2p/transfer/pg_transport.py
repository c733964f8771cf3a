"""State transfer over a process group's send/recv (gloo here; NCCL where GPUs are linked).

Imports on CPU-only machines (torch.distributed is always present in torch wheels). The group
is the one the members built for the current ``config_id``: membership gating happened when it
formed, so no handshake is run here; integrity is the same as over TCP minus the keyed tags:
every chunk's digest must equal the manifest's, and the manifest's fingerprint (recomputed by
the receiver) must be the agreed one.

Protocol (ranks from the plan; source ``j`` of ``n``):

1. each source sends its manifest: an ``int64[1]`` length, then ``uint8[length]`` bytes;
2. the receiver checks the sources agree (or match ``expected_fingerprint``) and builds its
   target, receiving in place where it holds matching tensors;
3. source ``j`` sends chunks ``i`` with ``i % n == j`` (each as its tensor segments, straight
   from snapshot memory, ``isend``), the receiver posts the matching ``irecv`` into target
   memory, all outstanding at once so every source streams concurrently;
4. the receiver hashes every chunk (worker threads) and compares with the manifest.

Limits: a process group cannot move a dead source's stripe to another source mid-transfer
(gloo operations cannot be aborted, DESIGN section 13): a failure or a wait longer than
``progress_timeout_s`` raises ``TransferFailed`` and the caller falls back to TCP. Snapshot
tensors are host memory, so with NCCL they would first need device staging: only gloo is
exercised here.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from . import fingerprint as fp
from .client import FetchResult
from .errors import TransferError, TransferFailed
from .frames import DEFAULT_MAX_MANIFEST_BYTES
from .manifest import decode_manifest, encode_manifest
from .snapshot import Snapshot
from .transport import TransferPlan, Transport

_TAG_MANIFEST = 1
_TAG_DATA = 2


class PgTransport(Transport):
    """Transfer over ``group`` (``None``: the default group). ``algo``: chunk digest."""

    name = "pg"

    def __init__(self, group: Any = None, *, algo: str = "xxh3",
                 max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES,
                 max_state_bytes: int = 1 << 40) -> None:
        self.group = group
        self.algo = algo
        self.max_manifest_bytes = max_manifest_bytes
        self.max_state_bytes = max_state_bytes

    def _timeout(self, plan: TransferPlan) -> datetime.timedelta:
        return datetime.timedelta(seconds=plan.progress_timeout_s)

    async def provide(self, snapshot: Snapshot, plan: TransferPlan) -> None:
        """Send this rank's manifest and stripe to ``plan.receiver``; returns when sent.
        Raises ``TransferFailed`` (``send_failed``) if the group errs or times out."""
        await asyncio.to_thread(self._provide, snapshot, plan)

    def _provide(self, snap: Snapshot, plan: TransferPlan) -> None:
        me = dist.get_rank(self.group)
        j, n = plan.sources.index(me), len(plan.sources)
        body = encode_manifest(snap, self.algo)
        dst, g, timeout = plan.receiver, self.group, self._timeout(plan)
        try:
            dist.send(torch.tensor([len(body)], dtype=torch.int64), dst, g, tag=_TAG_MANIFEST)
            dist.send(torch.frombuffer(bytearray(body), dtype=torch.uint8), dst, g,
                      tag=_TAG_MANIFEST)
            works = []
            for i in range(j, snap.num_chunks, n):
                for seg in snap.segment_tensors(i):
                    works.append(dist.isend(seg, dst, g, tag=_TAG_DATA))
            for w in works:
                w.wait(timeout)
        except RuntimeError as e:
            raise TransferFailed("send_failed", str(e)[:200]) from None

    async def receive(self, plan: TransferPlan,
                      into: Snapshot | Mapping[str, Any] | None = None) -> FetchResult:
        """Receive from ``plan.sources`` (ranks). Raises ``TransferFailed``:
        ``source_failed`` (group error or no progress), ``sources_disagree``, ``bad_chunk``,
        ``bad_manifest``."""
        return await asyncio.to_thread(self._receive, plan, into)

    def _receive(self, plan: TransferPlan, into: Any) -> FetchResult:
        t0 = time.monotonic()
        g, timeout = self.group, self._timeout(plan)
        failures: Counter[str] = Counter()
        manifests = []
        try:
            for src in plan.sources:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, src, g, tag=_TAG_MANIFEST)
                if not 0 < int(size) <= self.max_manifest_bytes:
                    raise TransferFailed("bad_manifest", f"size {int(size)}")
                buf = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(buf, src, g, tag=_TAG_MANIFEST)
                manifests.append(decode_manifest(buf.numpy().tobytes(), self.max_state_bytes))
        except TransferError as e:
            raise TransferFailed(e.reason, e.detail) from None
        except RuntimeError as e:
            raise TransferFailed("source_failed", str(e)[:200]) from None
        fps = [m.fingerprint for m in manifests]
        want = plan.expected_fingerprint
        if want is None:
            if len(set(fps)) != 1:
                raise TransferFailed("sources_disagree", "sources hold different states")
            want = fps[0]
        if any(f != want for f in fps):
            # Every source already streams its stripe: a mismatch cannot be routed around.
            raise TransferFailed("fingerprint_mismatch", "a source holds another state")
        m = manifests[0]
        if m.algo != self.algo:
            raise TransferFailed("bad_manifest", "algorithm")
        own = into if into is None or isinstance(into, Snapshot) else Snapshot.capture(into, 0)
        target, allocated = m.allocate(own, self.max_state_bytes)
        n = len(plan.sources)
        works = []
        try:
            for i in range(m.num_chunks):
                src = plan.sources[i % n]
                for seg in target.segment_tensors(i):
                    works.append(dist.irecv(seg, src, g, tag=_TAG_DATA))
            for w in works:
                w.wait(timeout)
        except RuntimeError as e:
            raise TransferFailed("source_failed", str(e)[:200]) from None
        with ThreadPoolExecutor(max_workers=2) as pool:
            digests = list(pool.map(lambda i: fp.digest_buffers(m.algo, target.segments(i)),
                                    range(m.num_chunks)))
        bad = [i for i, d in enumerate(digests) if d != m.digest(i)]
        if bad:
            failures["bad_chunk"] += len(bad)
            raise TransferFailed("bad_chunk", f"chunks {bad[:8]}", failures)
        target.set_digests(m.algo, m.digests)
        per_src: dict[Any, int] = {s: 0 for s in plan.sources}
        for i in range(m.num_chunks):
            per_src[plan.sources[i % n]] += m.chunk_range(i)[1]
        return FetchResult(target, m.fingerprint, failures, per_src, 0, allocated,
                           time.monotonic() - t0)
