"""The snapshot's tree: every captured object's state dict with each tensor replaced by a
reference to its row of the table, plus ``step`` and user ``metadata``, as msgpack.

Plain data only: ``None``, ``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes``, ``list``,
``dict`` (keys ``str`` or ``int``), and, kept distinct so a round trip is exact, ``tuple`` and
``OrderedDict`` (with a module state dict's ``_metadata``) as msgpack extension types.
:class:`TreeEncoder` raises ``TypeError`` naming the path of anything else; nothing is ever
pickled. :func:`decode_tree` reads untrusted bytes under the hard limits below, which the
encoder enforces too, so a source cannot capture a state its receivers would refuse.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgpack
import torch

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "complex64": torch.complex64, "complex128": torch.complex128,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32,
    "uint64": torch.uint64, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

EXT_TENSOR = 1
EXT_TUPLE = 2
EXT_ODICT = 3
_I64_MIN, _U64_MAX = -(1 << 63), (1 << 64) - 1
MAX_TREE_DEPTH = 64
"""Nesting depth of the metadata tree; real state dicts are under 10 deep."""
MAX_TREE_BYTES = 16 << 20
"""The encoded tree (everything but tensor bytes): a Transformer with AdamW and a scheduler takes
a few KB, ~50 bytes per tensor. A decoded leaf costs up to ~21 times its encoded bytes (2-char
strings), so this bound also bounds a hostile tree's decoding."""
MAX_TREE_CONTAINERS = 2 << 20
"""Lists, tuples, dicts and OrderedDict entries of the tree: ~5 per tensor in real state dicts
(195 for a Transformer, AdamW and LambdaLR), so 2M admits ~400k tensors. A decoded empty
container costs ~70 times its encoded byte: without the bound a 4 MB tree of empty lists took
296 MB. With both bounds the worst tree found (2M empty maps, then 2-char
strings up to 16 MiB) took 492 MiB and 1.1 s to decode here."""
MAX_NAME_BYTES = 1024
"""A tensor's table name (its path in the state, UTF-8)."""
MAX_DIMS = 32


def check_tensor(t: torch.Tensor, path: str) -> None:
    """Raises ``TypeError`` naming ``path`` unless ``t`` is a dense tensor of a dtype in
    :data:`DTYPES`."""
    if t.device.type == "meta":
        raise TypeError(f"{path}: a meta tensor holds no data to transfer")
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"{path}: only dense tensors can be transferred, got {t.layout}"
                        f"{' (quantized)' if t.is_quantized else ''}")
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"{path}: dtype {t.dtype} is not supported")


class TreeEncoder:
    """Turns a state tree into msgpack-ready data, collecting tensors into the table."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self._named: set[str] = set()
        self._seen: dict[tuple, int] = {}
        self.containers = 2  # as decode_tree counts them: the tree's map, its objects' map

    def tensor_ref(self, t: torch.Tensor, path: str) -> msgpack.ExtType:
        check_tensor(t, path)
        if t.dim() > MAX_DIMS:
            raise TypeError(f"{path}: {t.dim()} dimensions, over {MAX_DIMS}")
        t = t.detach()
        # A conjugate or negative view shares its base's memory but not its values.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype, t.device, t.is_conj(), t.is_neg())
        index = self._seen.get(key) if t.numel() else None
        if index is None:
            index = len(self.tensors)
            if t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg()  # its values, in memory of their own
            if t.device.type != "cpu":
                t = t.to("cpu")  # the TCP path stages accelerator tensors through host memory
            elif not t.is_contiguous():
                t = t.contiguous()
            name = self._unique(path)
            if len(name.encode(errors="replace")) > MAX_NAME_BYTES:
                raise TypeError(f"{name[:64]}...: a path of over {MAX_NAME_BYTES} bytes")
            self.tensors.append(t)
            self.names.append(name)
            if t.numel():
                self._seen[key] = index
        return msgpack.ExtType(EXT_TENSOR, index.to_bytes(4, "big"))

    def finish(self, step: int, objects: dict[str, Any], metadata: Any) -> bytes:
        """The tree of ``step``, ``objects`` (name -> encoded state dict) and ``metadata``
        (encoded), packed. Raises ``TypeError`` when it would exceed
        ``MAX_TREE_CONTAINERS`` or ``MAX_TREE_BYTES``, or holds a str that is not UTF-8."""
        if self.containers > MAX_TREE_CONTAINERS:
            raise TypeError(f"the state has {self.containers} lists, tuples, dicts and "
                            f"OrderedDict entries, over {MAX_TREE_CONTAINERS}: keep bulk data "
                            "in tensors")
        try:
            tree = pack({"step": step, "objects": objects, "metadata": metadata})
        except UnicodeEncodeError as e:
            raise TypeError(f"a str of the state is not valid UTF-8: {e}") from None
        if len(tree) > MAX_TREE_BYTES:
            raise TypeError(f"the state's plain data takes {len(tree)} bytes encoded, over "
                            f"{MAX_TREE_BYTES}: keep bulk data in tensors")
        return tree

    def _unique(self, path: str) -> str:
        """``path``, or ``path#k`` with the first free ``k``: paths can collide (keys ``1`` and
        ``"1"`` both give ``m.1``; so do a key ``"a.b"`` and ``a`` -> ``b``), and the receiver
        matches its tensors to the table by name. The same state gives the same names."""
        name, k = path, 1
        while name in self._named:
            name, k = f"{path}#{k}", k + 1
        self._named.add(name)
        return name

    def encode(self, obj: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_TREE_DEPTH:
            raise TypeError(f"{path}: nested deeper than {MAX_TREE_DEPTH}")
        t = type(obj)
        if obj is None or t is bool or t is float or t is str or t is bytes:
            return obj
        if t is int:
            if not _I64_MIN <= obj <= _U64_MAX:
                raise TypeError(f"{path}: int {obj} does not fit 64 bits")
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor_ref(obj, path)
        if t is list or t is tuple or t is dict:
            self.containers += 1
        elif t is OrderedDict:
            self.containers += len(obj) + 2  # its pairs and the list of them, each a list
        if t is list:
            return [self.encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
        if t is tuple:
            items = [self.encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
            return msgpack.ExtType(EXT_TUPLE, pack(items))
        if t is dict or t is OrderedDict:
            pairs = []
            for k, v in obj.items():
                if type(k) is not str and type(k) is not int:
                    raise TypeError(f"{path}: dict key {k!r} must be str or int")
                pairs.append((k, self.encode(v, f"{path}.{k}", depth + 1)))
            if t is dict:
                return dict(pairs)
            meta = getattr(obj, "_metadata", None)
            meta_enc = None if meta is None else self.encode(meta, f"{path}._metadata",
                                                            depth + 1)
            return msgpack.ExtType(EXT_ODICT, pack([[list(p) for p in pairs], meta_enc]))
        raise TypeError(
            f"{path}: {t.__module__}.{t.__qualname__} is not plain data (allowed: None, bool, "
            "int, float, str, bytes, list, tuple, dict, OrderedDict, torch.Tensor)")


def pack(obj: Any) -> bytes:
    """msgpack of plain data, binary kept apart from str; ``strict_types``: a subclass (an
    ``OrderedDict`` not taken apart by :class:`TreeEncoder`) raises ``TypeError``."""
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


def decode_tree(data: bytes, tensors: list[torch.Tensor], max_bytes: int) -> Any:
    """Decode a tree encoded by :meth:`Snapshot.capture`, with tensor references resolved to
    ``tensors``. Raises ``ValueError`` on malformed input (untrusted bytes are safe: msgpack
    with size limits, no object construction beyond plain data)."""
    if len(data) > max_bytes:
        raise ValueError(f"tree of {len(data)} bytes exceeds {max_bytes}")
    depth = [0]
    containers = [0]

    def counted(container: Any) -> Any:  # every list and map, as soon as it is decoded
        containers[0] += 1
        if containers[0] > MAX_TREE_CONTAINERS:
            raise ValueError(f"more than {MAX_TREE_CONTAINERS} lists and maps")
        return container

    def hook(code: int, payload: bytes) -> Any:
        if code == EXT_TENSOR:
            if len(payload) != 4:
                raise ValueError("bad tensor reference")
            i = int.from_bytes(payload, "big")
            if i >= len(tensors):
                raise ValueError("tensor reference out of range")
            return tensors[i]
        depth[0] += 1
        try:
            if depth[0] > MAX_TREE_DEPTH:
                raise ValueError("tree too deep")
            inner = _unpack(payload)
        finally:
            depth[0] -= 1
        if code == EXT_TUPLE:
            if type(inner) is not list:
                raise ValueError("bad tuple")
            return tuple(inner)
        if code == EXT_ODICT:
            if type(inner) is not list or len(inner) != 2 or type(inner[0]) is not list:
                raise ValueError("bad OrderedDict")
            od: OrderedDict = OrderedDict()
            for pair in inner[0]:
                if type(pair) is not list or len(pair) != 2:
                    raise ValueError("bad OrderedDict pair")
                od[pair[0]] = pair[1]
            if inner[1] is not None:
                od._metadata = inner[1]  # type: ignore[attr-defined]
            return od
        raise ValueError(f"unknown ext type {code}")

    def _unpack(b: bytes) -> Any:
        return msgpack.unpackb(b, ext_hook=hook, raw=False, strict_map_key=False,
                               use_list=True, list_hook=counted, object_hook=counted)

    try:
        return _unpack(data)
    except Exception as e:  # msgpack's ExtraData, FormatError, StackError, TypeError...
        raise ValueError(f"malformed tree: {type(e).__name__}: {e}") from None
