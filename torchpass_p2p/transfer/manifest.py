"""The manifest: what a source tells a receiver before any tensor byte moves.

msgpack map ``{v, step, algo, total_bytes, chunk_bytes, table, tree, digests}`` where ``table``
and ``tree`` are the snapshot's exact encoded bytes and ``digests`` the concatenated chunk
digests. The receiver recomputes the fingerprint from these bytes (a source cannot claim one),
validates every field against hard limits, and builds its receive target from the table:
tensors it already holds with the same name, dtype and shape are received into in place;
the others (e.g. Adam's moments before the spare's first step) are allocated.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from . import fingerprint as fp
from .errors import PeerError
from .frames import no_ext
from .snapshot import Snapshot, TensorEntry
from .tree import DTYPES, MAX_DIMS, MAX_NAME_BYTES, MAX_TREE_BYTES, MAX_TREE_DEPTH, decode_tree

VERSION = 1
MAX_TENSORS = 1 << 20
"""A million tensors: far above any model's state (a 1T-parameter model has ~1e5)."""
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 1 << 30
_I64 = 1 << 63
"""Steps, dimensions and byte counts are int64 on both sides (``fingerprint`` packs ``>q``,
torch sizes are int64)."""
_OUTER_LIMITS = {"max_map_len": 16, "max_array_len": 0, "max_str_len": 64}
"""msgpack bounds for the manifest's outer map (8 fields, bins and scalars; bins are bounded by
the manifest's length). Without them a manifest of empty lists costs ~64x its size in memory."""
_TABLE_LIMITS = {"max_map_len": 0, "max_array_len": MAX_TENSORS, "max_str_len": MAX_NAME_BYTES,
                 "max_bin_len": 0}


class _Shape(tuple):
    """A list of at most ``MAX_DIMS`` ints, as the table's list hook found it."""


class _Row(tuple):
    """A list ``[str, str, _Shape, int, int]``, as the table's list hook found it."""


def _table_list(items: list[Any]) -> Any:
    """msgpack ``list_hook`` of the table: each list is checked as soon as it is decoded and must
    be a shape, a row, or the table (a list of rows). A table of nested lists is refused at its
    first inner list that is none of them, so it never holds more than one list's elements at a
    time: without this check a 60 MB table of empty lists took 3.9 GB to decode."""
    if len(items) <= MAX_DIMS and all(type(d) is int for d in items):
        return _Shape(items)
    if (len(items) == 5 and type(items[0]) is str and type(items[1]) is str
            and type(items[2]) is _Shape and type(items[3]) is int and type(items[4]) is int):
        return _Row(items)
    if all(type(r) is _Row for r in items):
        return items
    raise ValueError("not a table")


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int
    algo: str
    total_bytes: int
    chunk_bytes: int
    table: tuple[TensorEntry, ...]
    table_bytes: bytes
    tree: bytes
    digests: bytes
    fingerprint: bytes

    @property
    def num_chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_bytes)

    def digest(self, index: int) -> bytes:
        n = fp.DIGEST_BYTES[self.algo]
        return self.digests[index * n:(index + 1) * n]

    def chunk_range(self, index: int) -> tuple[int, int]:
        off = index * self.chunk_bytes
        return off, min(self.chunk_bytes, self.total_bytes - off)

    def allocate(self, target: Snapshot | None, max_alloc_bytes: int) -> tuple[Snapshot, int]:
        """The receive snapshot: ``target``'s tensors where name, dtype and shape match (in
        place), new ones elsewhere, and for those whose memory overlaps another's taken in
        place (views of one buffer: receiving into both would overwrite one with the other).
        Returns ``(snapshot, bytes_allocated)``. Raises :class:`PeerError` ``too_large`` when
        new allocations would exceed ``max_alloc_bytes`` or do not fit in memory."""
        have: dict[str, torch.Tensor] = {}
        if target is not None:
            have = {e.name: t for e, t in zip(target.table, target.tensors, strict=True)}
        matched: list[torch.Tensor | None] = []
        for e in self.table:
            t = have.get(e.name)
            if (t is None or t.dtype != DTYPES[e.dtype] or tuple(t.shape) != e.shape
                    or not t.is_contiguous() or t.device.type != "cpu"):
                t = None
            matched.append(t)
        for i in _overlapping(matched):
            matched[i] = None
        tensors, new = [], 0
        for e, t in zip(self.table, matched, strict=True):
            dtype = DTYPES[e.dtype]
            if t is None:
                new += e.nbytes
                if new > max_alloc_bytes:
                    raise PeerError("too_large", f"needs more than {max_alloc_bytes} new bytes")
                try:
                    t = torch.empty(e.shape, dtype=dtype)
                except (RuntimeError, MemoryError) as err:
                    raise PeerError("too_large", f"allocating {e.name!r}: {err}"[:200]) from None
            tensors.append(t)
        snap = Snapshot(self.step, list(self.table), tensors, self.tree, self.chunk_bytes)
        return snap, new


def _overlapping(tensors: list[torch.Tensor | None]) -> set[int]:
    """Indices of ``tensors`` (contiguous, host memory) whose bytes overlap those of one kept
    before it in address order; the others are pairwise disjoint. O(n log n)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
                   for i, t in enumerate(tensors) if t is not None and t.numel())
    out, reach = set(), 0
    for start, end, i in spans:
        if start < reach:
            out.add(i)
        else:
            reach = end
    return out


def encode_manifest(snap: Snapshot, algo: str) -> bytes:
    """Manifest bytes of ``snap`` (computes its digests if not done: blocking)."""
    return msgpack.packb({
        "v": VERSION, "step": snap.step, "algo": algo, "total_bytes": snap.total_bytes,
        "chunk_bytes": snap.chunk_bytes, "table": snap.table_bytes, "tree": snap.tree,
        "digests": snap.digests(algo)}, use_bin_type=True)


def _depth(tree: Any) -> int:
    """Nesting depth of the tree's values, the top map being 1, as capture counts it (leaves
    too), up to ``MAX_TREE_DEPTH + 4``. Iterative: the tree may be deeper than Python's
    recursion limit (msgpack alone admits ~1,000 levels)."""
    deepest, stack = 0, [(tree, 1)]
    while stack and deepest <= MAX_TREE_DEPTH + 3:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(node, (list, tuple, dict)):
            stack.extend((c, d + 1) for c in (node.values() if isinstance(node, dict) else node))
    return deepest


def _bad(what: str) -> PeerError:
    return PeerError("bad_manifest", what)


def decode_manifest(data: bytes, max_state_bytes: int) -> Manifest:
    """Parse and validate untrusted manifest bytes. Raises :class:`PeerError`
    ``bad_manifest`` (or ``too_large`` for a state above ``max_state_bytes``), and nothing
    else: a check that some input gets past and that then fails (say, a tensor reference where
    the tree's step should be, whose comparison raises RuntimeError) is a bad manifest too."""
    try:
        return _decode_manifest(data, max_state_bytes)
    except PeerError:
        raise
    except Exception as e:
        raise _bad(f"{type(e).__name__}: {e}"[:200]) from None


def _decode_manifest(data: bytes, max_state_bytes: int) -> Manifest:
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=no_ext,
                            **_OUTER_LIMITS)
        rows = msgpack.unpackb(m["table"], raw=False, strict_map_key=True, ext_hook=no_ext,
                               list_hook=_table_list, **_TABLE_LIMITS)
    except Exception as e:
        raise _bad(type(e).__name__) from None
    if type(m) is not dict or m.get("v") != VERSION:
        raise _bad("version")
    step, algo = m.get("step"), m.get("algo")
    total, chunk = m.get("total_bytes"), m.get("chunk_bytes")
    tree, digests = m.get("tree"), m.get("digests")
    if (type(step) is not int or not 0 <= step < _I64
            or type(algo) is not str or algo not in fp.ALGORITHMS
            or type(total) is not int
            or type(chunk) is not int or type(tree) is not bytes or type(digests) is not bytes):
        raise _bad("fields")
    if not 0 <= total <= max_state_bytes:
        raise PeerError("too_large", f"state of {total} bytes > {max_state_bytes}")
    if not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
        raise _bad("chunk_bytes")
    if rows == ():  # an empty table passes the list hook as an empty shape
        rows = []
    if type(rows) is not list:
        raise _bad("table")
    table, offset, names = [], 0, set()
    for name, dtype, shape, nbytes, off in rows:  # rows, shapes and field types: _table_list
        if (len(name) > MAX_NAME_BYTES or dtype not in DTYPES
                or any(not 0 <= d < _I64 for d in shape) or off != offset):
            raise _bad(f"table row {name!r}")
        if name in names:  # the receiver matches its own tensors by name
            raise _bad(f"duplicate name {name!r}")
        names.add(name)
        numel, span = 1, 1
        for d in shape:
            numel *= d
            span *= max(d, 1)
        if span >= _I64:  # torch's strides (in elements) overflow even with no elements
            raise _bad(f"shape of {name!r}")
        if nbytes != numel * DTYPES[dtype].itemsize:
            raise _bad(f"byte length of {name!r}")
        offset += nbytes
        if offset > total:
            raise _bad("table exceeds total_bytes")
        table.append(TensorEntry(name, dtype, tuple(shape), nbytes, off))
    if offset != total:
        raise _bad("total_bytes")
    n_chunks = -(-total // chunk)
    if len(digests) != n_chunks * fp.DIGEST_BYTES[algo]:
        raise _bad("digests")
    # The tree must decode against this table (tensor references in range, plain data) with
    # capture's bounds and layout. What a state dict's own load_state_dict accepts is the
    # trainer's to check: it restores only a state whose fingerprint the members agreed on.
    try:
        st = decode_tree(tree, [torch.empty(0)] * len(table), MAX_TREE_BYTES)
    except (ValueError, TypeError, RecursionError) as e:
        raise _bad(f"tree: {e}") from None
    if (type(st) is not dict or st.keys() != {"step", "objects", "metadata"}
            or type(st["objects"]) is not dict or type(st["metadata"]) is not dict
            or any(type(k) is not str or type(v) not in (dict, OrderedDict)
                   for k, v in st["objects"].items())):
        raise _bad("tree layout")
    if type(st["step"]) is not int or st["step"] != step:
        raise _bad(f"tree step {st['step']!r}, manifest step {step}")
    if _depth(st) > MAX_TREE_DEPTH + 3:  # capture's, from each state dict (3 below the top)
        raise _bad(f"tree nested deeper than {MAX_TREE_DEPTH}")
    fpr = fp.fingerprint(algo, step, total, chunk, m["table"], tree, digests)
    return Manifest(step, algo, total, chunk, tuple(table), m["table"], tree, digests, fpr)


