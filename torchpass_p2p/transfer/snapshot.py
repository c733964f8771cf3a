"""A snapshot: the complete training state as an ordered table of tensors plus plain metadata.

Layout
------
* **table**: one :class:`TensorEntry` per distinct tensor (name, dtype, shape, byte length,
  byte offset), in capture order. Offsets are the running sum of byte lengths: the snapshot's
  bytes are every tensor's bytes concatenated, ``total_bytes`` long. Tensors that share memory
  (tied weights) appear once; every place that held them refers to the same entry.
* **tree**: the state dicts of the captured objects with each tensor replaced by a reference to
  its table entry, plus ``step`` and user ``metadata``, encoded as msgpack (:mod:`.tree`: plain
  data only, anything else raises ``TypeError`` naming its path; nothing is ever pickled).

Memory and consistency
----------------------
``capture(copy=False)`` references the live tensors (contiguous ones are not copied): cheap, but
the snapshot changes when training does, so publish such a snapshot only while the trainer is
paused (e.g. at the resume step during recovery). ``capture(copy=True)`` copies every tensor:
**one extra copy of the state** (``total_bytes``), and the snapshot stays
exactly the step-k state however long it is served. A server keeps a published snapshot alive
until every transfer reading it ends, so while a newer one is published the source briefly holds
two copies.

RNG state is captured by including :class:`RNGState` among the objects.
"""

from __future__ import annotations

import bisect
import os
import random
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from . import chunkmac
from . import fingerprint as fp
from .errors import SnapshotChanged
from .tree import DTYPE_NAMES, TreeEncoder, decode_tree, pack

_Sliceable = TypeVar("_Sliceable", memoryview, torch.Tensor)

DEFAULT_CHUNK_BYTES = 16 << 20
"""16 MiB, the top of docs/design.md section 7's 4-16 MiB. Per-chunk costs (a header, a tag, a
thread hand-off) vanish against ~8 ms of loopback transfer; a lost source still costs little
re-sending. Measured (benchmarks.transfer, 1 GiB, quiet 2-core machine): one source ran at the
same 0.83 of a raw socket as with 8 MiB, two sources went from 0.93 to 1.14 of one source.
Every member must use the same value: the fingerprint covers the chunk layout."""

MAC_THREADS = 4
"""Threads computing a snapshot's inner chunk tags or digests (GMAC, xxh3 and BLAKE3 release the
GIL): the source's one-time cost, ~0.2 s of CPU per GB, is on the path of the first transfer it
serves."""
SCAN_PIECE_BYTES = 256 << 10
"""A pass that computes two things over a chunk (a digest and the MAC) feeds both each 256 KiB
piece in turn, so the second reads it from cache."""
REFERENCE_ALGO = "xxh3"
"""Every pass over a snapshot's bytes digests them under this algorithm too, unless digests
under another were recorded first, and checks them against the first pass's
(:meth:`Snapshot._scan`). It costs the source's MAC pass 0.20 s per GiB against 0.13 without
(2 cores, median of 5 paired runs), once per snapshot."""

@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint's convention: ``state_dict()`` / ``load_state_dict(sd)``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class RNGState:
    """Stateful wrapper for the process's random number generators: torch's CPU generator
    (``uint8[5056]`` tensor), CUDA generators when CUDA is available, Python's ``random`` and
    numpy's legacy global generator (its key as a ``uint32[624]`` tensor)."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        sd: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": (version, internal, gauss),
            "numpy": (str(name), torch.from_numpy(np.array(keys, dtype=np.uint32)), int(pos),
                      int(has_gauss), float(cached)),
        }
        if torch.cuda.is_available():
            sd["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        torch.set_rng_state(sd["torch"])
        random.setstate(tuple(sd["python"]))
        name, keys, pos, has_gauss, cached = sd["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda"])


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One row of the table. ``nbytes`` and ``offset`` in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int

    def encode(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.nbytes, self.offset]


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable ``memoryview`` (format ``B``) of a contiguous CPU tensor's bytes; no copy."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def load_plain(obj: dict[Any, Any], sd: Mapping[Any, Any]) -> None:
    """Make the dict ``obj`` equal ``sd`` in place: a tensor of ``obj`` with the dtype and shape
    of its new value is copied into (so the dicts of ``module.state_dict()``, which hold the
    module's own tensors, load into the module), a dict of both is loaded the same way, anything
    else is replaced; keys ``sd`` lacks are removed."""
    for k in [k for k in obj if k not in sd]:
        del obj[k]
    for k, v in sd.items():
        cur = obj.get(k)
        if (isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor)
                and cur.dtype == v.dtype and cur.shape == v.shape):
            if cur.data_ptr() != v.data_ptr() or cur.stride() != v.stride():  # else: it is v
                with torch.no_grad():
                    cur.copy_(v)
        elif isinstance(cur, dict) and isinstance(v, dict):
            load_plain(cur, v)
        else:
            obj[k] = v


def _tensor_leaves(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensor_leaves(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensor_leaves(v)


class Snapshot:
    """The complete training state at ``step``: table, tensors (one per entry, CPU,
    contiguous), the encoded tree, and lazily the chunk digests and fingerprint.

    Build one with :meth:`capture` (source, or receiver's own objects as a receive target) or
    receive one with the transfer client. Treat it as immutable once published.
    """

    def __init__(self, step: int, table: list[TensorEntry], tensors: list[torch.Tensor],
                 tree: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be >= 1")
        self.step = step
        self.table = table
        self.tensors = tensors
        self.tree = tree
        self.chunk_bytes = chunk_bytes
        self.total_bytes = sum(e.nbytes for e in table)
        self._starts = [e.offset for e in table]
        self._flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
        self._views: list[memoryview] = [byte_view(f) for f in self._flat]
        self._lock = threading.Lock()
        self._digests: dict[str, bytes] = {}
        self._chunk_macs: tuple[bytes, bytes] | None = None
        self._changed: str | None = None  # why the bytes are not those first digested
        self.table_bytes = pack([e.encode() for e in table])

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def capture(cls, objects: Mapping[str, Any], step: int,
                metadata: Mapping[str, Any] | None = None, *, copy: bool = False,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Snapshot:
        """Snapshot of ``objects`` (name -> Stateful object, or a state dict) at ``step``.

        ``metadata``: plain data (data position, anything small). ``copy``: copy every tensor
        (memory: ``total_bytes`` more); otherwise
        live contiguous tensors are referenced. Raises ``TypeError`` for state that is not plain
        data or a supported dense tensor, with the offending path."""
        if type(step) is not int:
            raise TypeError("step must be an int")
        enc = TreeEncoder()
        objs: dict[str, Any] = {}
        for name, obj in objects.items():
            if type(name) is not str:
                raise TypeError(f"object name {name!r} must be a str")
            sd = obj.state_dict() if isinstance(obj, Stateful) else obj
            if type(sd) is not dict and type(sd) is not OrderedDict:
                raise TypeError(f"{name}: a Stateful object or a state dict (dict), got "
                                f"{type(sd).__qualname__}")
            objs[name] = enc.encode(sd, name)
        tree = enc.finish(step, objs, enc.encode(dict(metadata or {}), "metadata"))
        tensors = enc.tensors
        if copy:
            tensors = [t.clone(memory_format=torch.contiguous_format) for t in tensors]
        return cls.of_tensors(step, enc.names, tensors, tree, chunk_bytes)

    @classmethod
    def of_tensors(cls, step: int, names: list[str], tensors: list[torch.Tensor], tree: bytes,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Snapshot:
        """The snapshot whose table names ``tensors`` (CPU, contiguous) ``names`` in this
        order, laid out end to end, with ``tree`` (as :meth:`capture` encoded it): how a
        snapshot saved as its named tensors and tree is put together again
        (:mod:`torchpass_p2p.checkpoint`). Raises ``ValueError`` when the counts differ."""
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        table, offset = [], 0
        for name, t in zip(names, tensors, strict=True):
            n = t.numel() * t.element_size()
            table.append(TensorEntry(name, DTYPE_NAMES[t.dtype], tuple(t.shape), n, offset))
            offset += n
        return cls(step, table, tensors, tree, chunk_bytes)

    # -- reading ----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """``{"step", "objects": {name: state_dict}, "metadata"}`` with this snapshot's
        tensors in place (not copies)."""
        return decode_tree(self.tree, self.tensors, max(len(self.tree), 1 << 20))

    def restore(self, objects: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Load the state into live objects (``load_state_dict`` of each Stateful; a plain dict
        is loaded by :func:`load_plain`, so ``module.state_dict()`` passed as an object loads
        into the module's tensors). Returns ``(step, metadata)``. Raises ``KeyError`` if an object
        of the snapshot is missing from ``objects``, ``ValueError`` naming the object if its
        ``load_state_dict`` refuses the state (another model, say: whatever it raised is the
        cause); objects before it are already loaded."""
        st = self.state()
        for name, sd in st["objects"].items():
            obj = objects[name]
            try:
                if isinstance(obj, Stateful):
                    obj.load_state_dict(sd)
                else:
                    load_plain(obj, sd)
            except Exception as e:  # load_state_dict raises what it likes (RuntimeError, ...)
                raise ValueError(f"{name}: the state does not load: {type(e).__name__}: "
                                 f"{e}"[:500]) from e
        return st["step"], st["metadata"]

    @property
    def num_chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_bytes)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` in bytes of chunk ``index``."""
        off = index * self.chunk_bytes
        return off, min(self.chunk_bytes, self.total_bytes - off)

    def segments(self, index: int) -> list[memoryview]:
        """The chunk's bytes as memoryviews into the tensors (writable, no copy)."""
        return self._pieces(index, self._views)

    def segment_tensors(self, index: int) -> list[torch.Tensor]:
        """Like :meth:`segments`, as flat ``uint8`` tensor views (for torch.distributed)."""
        return self._pieces(index, self._flat)

    def _pieces(self, index: int, whole: Sequence[_Sliceable]) -> list[_Sliceable]:
        """Chunk ``index`` cut from ``whole`` (one byte-indexed view per table entry)."""
        off, n = self.chunk_range(index)
        end = off + n
        out = []
        i = bisect.bisect_right(self._starts, off) - 1
        while off < end:
            e = self.table[i]
            lo = off - e.offset
            hi = min(e.nbytes, end - e.offset)
            if hi > lo:
                out.append(whole[i][lo:hi])
                off = e.offset + hi
            i += 1
        return out

    def set_digests(self, algo: str, digests: bytes) -> None:
        """Record digests already verified chunk by chunk (the process-group receiver's)."""
        with self._lock:
            self._digests[algo] = digests

    def digests(self, algo: str) -> bytes:
        """Concatenated chunk digests under ``algo``, computed once (thread-safe, blocking:
        call from a worker thread; ~0.05 s per GiB for xxh3, ~0.4 s for blake3 here, on up to
        ``MAC_THREADS`` threads). Raises :class:`SnapshotChanged` (see :meth:`_scan`)."""
        with self._lock:
            d = self._digests.get(algo)
            if d is None:
                d, _ = self._scan(algo, None)
            return d

    def chunk_macs(self) -> tuple[bytes, bytes]:
        """``(key, inner_tags)``: this snapshot's chunk-MAC key ``R`` (drawn once) and every
        chunk's 16-byte inner tag (``chunkmac``), concatenated in chunk order; computed once
        from the snapshot's bytes (thread-safe, blocking: call from a worker thread; ~0.2 s of
        CPU per GB, on up to ``MAC_THREADS`` threads since GMAC releases the GIL). Raises
        :class:`SnapshotChanged` (see :meth:`_scan`)."""
        with self._lock:
            if self._changed is not None:  # even with tags from before: not these bytes
                raise SnapshotChanged("snapshot_changed", self._changed)
            if self._chunk_macs is None:
                key = chunkmac.new_key()
                _, tags = self._scan(None, key)
                self._chunk_macs = (key, tags)
            return self._chunk_macs

    def _scan(self, algo: str | None, mac_key: bytes | None) -> tuple[bytes, bytes]:
        """One pass over every chunk's bytes: ``(digests under algo, inner tags under
        mac_key)`` (``b""`` for what is not asked). Caller holds ``_lock``.

        Every pass also digests under the reference algorithm: the first one digests were
        recorded under (:meth:`set_digests` included), else ``REFERENCE_ALGO``. The first pass
        records those digests and every later one must find them again, so the digests a
        manifest announces and the bytes the chunk MACs cover are the same bytes. A snapshot
        captured without ``copy`` changes when its objects do; if it did between two passes,
        :class:`SnapshotChanged` is raised, now and by every later pass or :meth:`chunk_macs`
        (the snapshot is not served any more). A write racing a pass is not caught: publish a
        snapshot of live tensors only while nothing writes them."""
        if self._changed is not None:
            raise SnapshotChanged("snapshot_changed", self._changed)
        ref_algo = next(iter(self._digests), REFERENCE_ALGO)
        algos = [ref_algo] + ([algo] if algo not in (None, ref_algo) else [])

        def chunk(i: int) -> tuple[list[bytes], bytes]:
            hashers = [fp.new_hasher(a) for a in algos]
            mac = chunkmac.Gmac(chunkmac.chunk_key(mac_key, i)) if mac_key else None
            for seg in self.segments(i):
                for lo in range(0, len(seg), SCAN_PIECE_BYTES):  # each piece read from cache
                    piece = seg[lo:lo + SCAN_PIECE_BYTES]
                    for h in hashers:
                        h.update(piece)
                    if mac is not None:
                        mac.update(piece)
            return [h.digest() for h in hashers], mac.digest() if mac is not None else b""

        n = self.num_chunks
        with ThreadPoolExecutor(max(1, min(MAC_THREADS, os.cpu_count() or 1, n)),
                                thread_name_prefix="snapshot-scan") as pool:
            results = list(pool.map(chunk, range(n)))
        ref = [r[0][0] for r in results]
        known = self._digests.get(ref_algo)
        if known is not None and b"".join(ref) != known:
            size = fp.DIGEST_BYTES[ref_algo]
            bad = [i for i, d in enumerate(ref) if d != known[i * size:(i + 1) * size]]
            # Kept as text: a stored exception raised again would grow its traceback and hold
            # every refused connection's frame.
            self._changed = (f"step {self.step}: {len(bad)} of {n} chunks differ from their "
                             f"first digests (first: chunk {bad[0]})")
            raise SnapshotChanged("snapshot_changed", self._changed)
        self._digests[ref_algo] = b"".join(ref)
        if algo is not None:
            self._digests[algo] = b"".join(r[0][-1] for r in results)
        digests = self._digests[algo] if algo is not None else b""
        return digests, b"".join(r[1] for r in results)

    def fingerprint(self, algo: str = "xxh3") -> bytes:
        """32-byte fingerprint of this state (see ``fingerprint``); blocking like
        :meth:`digests`."""
        return fp.fingerprint(algo, self.step, self.total_bytes, self.chunk_bytes,
                              self.table_bytes, self.tree, self.digests(algo))

    def __repr__(self) -> str:
        return (f"Snapshot(step={self.step}, tensors={len(self.table)}, "
                f"total_bytes={self.total_bytes})")


def tensors_by_name(snap: Snapshot) -> dict[str, torch.Tensor]:
    """Name of each table entry -> its tensor."""
    return {e.name: t for e, t in zip(snap.table, snap.tensors, strict=True)}


def tree_leaf_tensors(snap: Snapshot) -> list[torch.Tensor]:
    """Every tensor reachable in the decoded tree (with repeats for shared ones)."""
    return list(_tensor_leaves(snap.state()))
