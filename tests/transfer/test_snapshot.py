"""Snapshot capture, restore, refusal of non-plain data, and manifest validation."""

from __future__ import annotations

import random
import tracemalloc
from collections import OrderedDict

import blake3
import msgpack
import numpy as np
import pytest
import torch
import xxhash

from torchpass_p2p.transfer import (
    PeerError,
    RNGState,
    Snapshot,
    SnapshotChanged,
    chunkmac,
    manifest,
)
from torchpass_p2p.transfer import tree as tree_codec
from torchpass_p2p.transfer.manifest import decode_manifest, encode_manifest
from torchpass_p2p.transfer.tree import EXT_TENSOR, decode_tree, pack

from .states import capture


@pytest.mark.parametrize(("bad", "where"), [
    ({1, 2}, "metadata.x"), (object(), "metadata.x"), (np.float64(1.0), "metadata.x"),
    (1 << 64, "metadata.x"), ({(1, 2): 3}, "metadata.x"),
    ([torch.empty(2, device="meta")], "metadata.x[0]"),
])
def test_non_plain_metadata_is_refused_with_its_path(bad, where):
    with pytest.raises(TypeError, match=where.replace("[", r"\[").replace("]", r"\]")):
        Snapshot.capture({}, step=0, metadata={"x": bad})


def test_round_trip_keeps_types_exactly():
    od = OrderedDict([("b", 1), ("a", (2, [3, (4,)]))])
    od._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    meta = {"od": od, "t": (), "f": float("-inf"), 5: b"\x00", "n": None}
    snap = Snapshot.capture({"obj": {"w": torch.ones(2)}}, step=4, metadata=meta)
    st = snap.state()
    assert st["metadata"] == meta
    assert type(st["metadata"]["od"]) is OrderedDict
    assert st["metadata"]["od"]._metadata == {"": {"version": 2}}
    assert type(st["metadata"]["od"]["a"][1][1]) is tuple


def test_rng_state_round_trip():
    rng = RNGState()
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    snap = Snapshot.capture({"rng": rng}, step=0, copy=True)
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    snap.restore({"rng": rng})
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def test_copy_snapshot_is_frozen_and_reference_is_live():
    w = torch.zeros(1000)
    frozen = Snapshot.capture({"m": {"w": w}}, step=1, copy=True)
    live = Snapshot.capture({"m": {"w": w}}, step=1)
    f0, l0 = frozen.fingerprint(), live.fingerprint()
    assert f0 == l0
    w.add_(1)
    assert Snapshot.capture({"m": {"w": w}}, step=1, copy=True).fingerprint() != f0
    assert frozen.fingerprint() == f0  # cached, and its bytes are a copy anyway
    assert Snapshot(1, frozen.table, frozen.tensors, frozen.tree).fingerprint() == f0


def _live_snapshot():
    """A snapshot of live tensors (``copy=False``), 3 chunks of 4 KiB, and its weights."""
    w = torch.arange(3 * 1024, dtype=torch.float32)
    return Snapshot.capture({"m": {"w": w}}, step=2, chunk_bytes=4096), w


def test_the_mac_pass_covers_the_bytes_the_digests_describe():
    snap, w = _live_snapshot()
    data = w.numpy().tobytes()
    digests = snap.digests("xxh3")
    assert digests == b"".join(xxhash.xxh3_128_digest(data[i:i + 4096])
                               for i in range(0, len(data), 4096))
    key, tags = snap.chunk_macs()
    assert tags == b"".join(chunkmac.inner_tag(key, i, [data[i * 4096:(i + 1) * 4096]])
                            for i in range(3))
    assert snap.digests("blake3") == b"".join(
        blake3.blake3(data[i:i + 4096]).digest() for i in range(0, len(data), 4096))
    assert snap.digests("xxh3") == digests and snap.chunk_macs() == (key, tags)


def test_bytes_changed_after_the_digests_are_never_maced():
    snap, w = _live_snapshot()
    before = snap.fingerprint()
    w[1500] += 1  # chunk 1: a live snapshot while training goes on
    with pytest.raises(SnapshotChanged, match="1 of 3 chunks differ.*first: chunk 1"):
        snap.chunk_macs()
    w[1500] -= 1  # once changed, never served again, even if the bytes come back
    with pytest.raises(SnapshotChanged):
        snap.chunk_macs()
    assert snap.fingerprint() == before  # what it announced stays on record


def test_bytes_changed_before_a_second_digest_algorithm_are_caught():
    snap, w = _live_snapshot()
    snap.digests("xxh3")
    w[0] = -1.0
    with pytest.raises(SnapshotChanged, match="first: chunk 0"):
        snap.digests("blake3")


def test_a_changed_snapshot_is_refused_afresh_and_never_maced_again():
    snap, w = _live_snapshot()
    snap.chunk_macs()  # tags of the bytes as they were
    w[0] += 1
    with pytest.raises(SnapshotChanged) as first:
        snap.digests("blake3")
    with pytest.raises(SnapshotChanged) as again:
        snap.chunk_macs()  # its cached tags describe other bytes
    # A new exception each time: one raised again keeps every raiser's frame alive.
    assert again.value is not first.value and str(again.value) == str(first.value)


def test_digests_recorded_by_a_receiver_are_the_reference():
    snap, w = _live_snapshot()
    data = w.numpy().tobytes()
    snap.set_digests("blake3", b"".join(blake3.blake3(data[i:i + 4096]).digest()
                                        for i in range(0, len(data), 4096)))
    w[2000] += 1  # after the process-group receiver verified its chunks
    with pytest.raises(SnapshotChanged, match="first: chunk 1"):
        snap.chunk_macs()


def test_a_state_dict_passed_as_an_object_loads_into_its_module():
    torch.manual_seed(0)
    src = torch.nn.Linear(4, 2)
    snap = Snapshot.capture({"model": src.state_dict(), "extra": {"a": {"t": torch.ones(3)}}}, 7)
    dst = torch.nn.Linear(4, 2)
    extra = {"a": {"t": torch.zeros(3)}, "gone": 1}
    held = extra["a"]["t"]
    assert snap.restore({"model": dst.state_dict(), "extra": extra}) == (7, {})
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
    assert extra == {"a": {"t": held}} and torch.equal(held, torch.ones(3))  # in place


def test_a_state_another_model_refuses_names_the_object():
    torch.manual_seed(0)
    source = {"model": torch.nn.Linear(4, 2), "extra": {"k": 1}}
    snap = Snapshot.capture(source, step=3)
    other = {"model": torch.nn.Linear(4, 3), "extra": {}}  # another model definition
    with pytest.raises(ValueError, match="model: the state does not load: RuntimeError") as e:
        snap.restore(other)
    assert isinstance(e.value.__cause__, RuntimeError)
    with pytest.raises(KeyError):
        snap.restore({"model": torch.nn.Linear(4, 2)})  # no "extra" here


def test_tied_tensors_are_one_entry():
    t = torch.rand(4, 4)
    snap = Snapshot.capture({"m": {"a": t, "b": t, "c": t[1]}}, step=0)
    assert [e.name for e in snap.table] == ["m.a", "m.c"]
    st = snap.state()["objects"]["m"]
    assert st["a"] is st["b"]


def test_colliding_paths_get_distinct_names():
    a, b, c, d = (torch.full((2,), float(k)) for k in range(4))
    snap = Snapshot.capture({"m": {1: a, "1": b}, "x": {"y.z": c, "y": {"z": d}}}, step=0)
    assert [e.name for e in snap.table] == ["m.1", "m.1#1", "x.y.z", "x.y.z#1"]
    again = Snapshot.capture({"m": {1: a, "1": b}, "x": {"y.z": c, "y": {"z": d}}}, step=0)
    assert again.table == snap.table  # the same state, the same names: receivers match them


def test_chunks_cover_every_byte_once():
    snap = capture("edge_tensors", "source")[0]
    joined = b"".join(bytes(v) for i in range(snap.num_chunks) for v in snap.segments(i))
    assert joined == b"".join(bytes(v) for v in snap._views)
    assert all(sum(len(v) for v in snap.segments(i)) == snap.chunk_range(i)[1]
               for i in range(snap.num_chunks))


def _manifest(**overrides):
    snap = capture("edge_tensors", "source")[0]
    m = msgpack.unpackb(encode_manifest(snap, "xxh3"))
    m.update(overrides)
    return msgpack.packb(m, use_bin_type=True), snap


def test_manifest_fingerprint_is_recomputed():
    data, snap = _manifest()
    assert decode_manifest(data, 1 << 30).fingerprint == snap.fingerprint()


def _rows(*rows):
    """Manifest overrides for a state of exactly ``rows`` (a table of tensors and nothing
    else), so that only the rows' own checks can refuse it."""
    total = int(sum(r[3] for r in rows))
    return {"table": msgpack.packb(list(rows)), "total_bytes": total, "chunk_bytes": 64 << 10,
            "step": 1, "tree": pack({"step": 1, "objects": {}, "metadata": {}}),
            "digests": bytes(16 * -(-total // (64 << 10)))}


def test_a_table_alone_is_a_valid_manifest():  # what the cases built with _rows change
    data, _ = _manifest(**_rows(["w", "float32", [1], 4, 0], ["v", "float32", [1], 4, 4]))
    assert [e.name for e in decode_manifest(data, 1 << 30).table] == ["w", "v"]


@pytest.mark.parametrize(("overrides", "reason"), [
    ({"total_bytes": 4 << 30}, "too_large"),
    ({"total_bytes": 12}, "bad_manifest"),
    ({"chunk_bytes": 1}, "bad_manifest"),
    ({"digests": b"x"}, "bad_manifest"),
    ({"algo": "md5"}, "bad_manifest"),
    ({"tree": b"\x80\x04\x95"}, "bad_manifest"),   # a pickle where the tree goes
    ({"table": msgpack.packb([["w", "float32", [1 << 40], 4, 0]])}, "bad_manifest"),
    ({"v": 2}, "bad_manifest"),
    ({"algo": ["xxh3"]}, "bad_manifest"),  # unhashable where a name goes
    ({"table": msgpack.packb([["w", ["float32"], [1], 4, 0]])}, "bad_manifest"),
    ({"table": msgpack.packb([["w", {"f": 1}, [1], 4, 0]])}, "bad_manifest"),
    # Each below must be refused as a bad manifest, not crash or hang the receiver.
    ({"step": 1 << 63}, "bad_manifest"),  # msgpack uint64; the fingerprint packs int64
    (_rows(["w", "float32", [4], 16.0, 0.0]), "bad_manifest"),  # 16.0 == 16, but a slice
    # of a float fails in the receiving thread
    (_rows(["w", "float32", [0, (1 << 64) - 1], 0, 0]), "bad_manifest"),  # no elements, but
    # torch.empty overflows
    (_rows(["w", "float32", [1], 4, 0], ["w", "float32", [1], 4, 4]), "bad_manifest"),  # one
    # name twice: both would be received into one tensor
    ({"x": [[]] * 64}, "bad_manifest"),  # no list in the outer map: each costs 64 bytes
    (_rows(["w", "float32", [[1]], 4, 0]), "bad_manifest"),  # a list where a dimension goes
    (_rows([["w"], "float32", [1], 4, 0]), "bad_manifest"),
    ({"table": msgpack.packb([[[]] * 5] * 3)}, "bad_manifest"),  # rows of shapes
    ({"table": msgpack.packb([[["w", "float32", [1], 4, 0]]])}, "bad_manifest"),  # a table
    # in a table
    ({"table": msgpack.packb([1, 2])}, "bad_manifest"),  # a shape where the table goes
])
def test_bad_manifest_is_refused(overrides, reason):
    data, _ = _manifest(**overrides)
    with pytest.raises(PeerError) as e:
        decode_manifest(data, 1 << 31)
    assert e.value.reason == reason


def test_a_table_of_nested_lists_is_refused_at_its_first_inner_list():
    table = msgpack.packb([[[] for _ in range(2000)] for _ in range(500)])  # 1 MB, 1M lists
    data, _ = _manifest(**{"table": table})
    tracemalloc.start()
    try:
        with pytest.raises(PeerError, match="bad_manifest"):
            decode_manifest(data, 1 << 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(data)  # ~60 MB when every list was decoded before any check


def test_an_empty_table_is_a_valid_manifest():
    data, _ = _manifest(**_rows())
    assert decode_manifest(data, 1 << 30).table == ()


@pytest.mark.parametrize("tree", [
    [], {"step": 1}, {"step": 1, "objects": 3, "metadata": {}},
    {"step": 1, "objects": {"m": [1]}, "metadata": {}},
    {"step": 1, "objects": {}, "metadata": {}, "more": 1},
    {"step": 999, "objects": {}, "metadata": {}},  # not the manifest's step
    {"step": True, "objects": {}, "metadata": {}},
])
def test_a_tree_restore_cannot_load_is_refused(tree):
    data, _ = _manifest(**{**_rows(), "tree": pack(tree)})
    with pytest.raises(PeerError, match="bad_manifest"):
        decode_manifest(data, 1 << 30)


def test_a_tree_of_nested_lists_is_refused_before_it_costs_memory(monkeypatch):
    monkeypatch.setattr(tree_codec, "MAX_TREE_CONTAINERS", 10_000)
    tree = pack({"step": 1, "objects": {}, "metadata": {"x": [[] for _ in range(200_000)]}})
    data, _ = _manifest(**{**_rows(), "tree": tree})
    tracemalloc.start()
    try:
        with pytest.raises(PeerError, match="more than 10000 lists and maps"):
            decode_manifest(data, 1 << 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 10_000  # 100 bytes per list decoded before the refusal; 12 MB without


def test_a_shape_whose_strides_overflow_is_refused():
    data, _ = _manifest(**_rows(["w", "float32", [0, 1 << 62, 1 << 62], 0, 0]))
    with pytest.raises(PeerError, match="shape of 'w'"):
        decode_manifest(data, 1 << 30)


@pytest.mark.parametrize(("objects", "match"), [
    ({"w": torch.zeros(1)}, "w: a Stateful object or a state dict"),
    ({"m": {"w": torch.zeros([1] * 33)}}, "m.w: 33 dimensions, over 32"),
    ({"m": {"k" * 1100: torch.zeros(1)}}, "a path of over 1024 bytes"),
])
def test_capture_refuses_what_a_receiver_would(objects, match):
    with pytest.raises(TypeError, match=match):
        Snapshot.capture(objects, step=0)


def test_capture_counts_containers_as_a_receiver_does(monkeypatch):
    # the tree's map, objects, metadata; m's [pairs, _metadata], pairs and its 2 pairs;
    # [1, (2,)], (2,) and {}: 10
    state = {"m": OrderedDict([("a", [1, (2,)]), ("b", {})])}
    monkeypatch.setattr(tree_codec, "MAX_TREE_CONTAINERS", 10)
    snap = Snapshot.capture(state, step=0)
    assert decode_tree(snap.tree, [], 1 << 20)["objects"] == state
    monkeypatch.setattr(tree_codec, "MAX_TREE_CONTAINERS", 9)
    with pytest.raises(TypeError, match="10 lists, tuples, dicts"):
        Snapshot.capture(state, step=0)
    with pytest.raises(ValueError, match="more than 9 lists and maps"):
        decode_tree(snap.tree, [], 1 << 20)


def test_a_tensor_where_the_trees_step_goes_is_refused():
    tree = msgpack.packb({"step": msgpack.ExtType(EXT_TENSOR, (0).to_bytes(4, "big")),
                          "objects": {}, "metadata": {}}, use_bin_type=True)
    data, _ = _manifest(**{**_rows(["w", "float32", [1], 4, 0]), "tree": tree})
    with pytest.raises(PeerError, match="tree step"):
        decode_manifest(data, 1 << 30)


def _nested(levels: int) -> object:
    x: object = 1
    for _ in range(levels):
        x = [x]
    return x


def test_a_tree_as_deep_as_capture_allows_is_accepted_and_no_deeper():
    snap = Snapshot.capture({"m": {"x": _nested(63)}}, step=1, metadata={"y": _nested(63)})
    with pytest.raises(TypeError, match="nested deeper than 64"):
        Snapshot.capture({"m": {"x": _nested(64)}}, step=1)
    data, _ = _manifest(**{**_rows(), "tree": snap.tree})
    assert decode_manifest(data, 1 << 30).tree == snap.tree
    deeper = pack({"step": 1, "objects": {"m": {"x": _nested(64)}}, "metadata": {}})
    data, _ = _manifest(**{**_rows(), "tree": deeper})
    with pytest.raises(PeerError, match="nested deeper than 64"):
        decode_manifest(data, 1 << 30)  # before: load_state_dict's RecursionError at ~1,000
    too_deep_to_pack = (b"\x83" + pack("step") + pack(1) + pack("objects") + b"\x80"
                        + pack("metadata") + b"\x81" + pack("y") + b"\x91" * 2000 + b"\x01")
    data, _ = _manifest(**{**_rows(), "tree": too_deep_to_pack})
    with pytest.raises(PeerError, match="StackError"):  # msgpack's own bound
        decode_manifest(data, 1 << 30)


def test_a_tree_over_its_byte_bound_is_refused_by_both_sides(monkeypatch):
    state = {"m": {"names": ["x" * 100] * 100}}
    tree = Snapshot.capture(state, step=1).tree
    monkeypatch.setattr(tree_codec, "MAX_TREE_BYTES", len(tree) - 1)
    with pytest.raises(TypeError, match=f"takes {len(tree)} bytes encoded"):
        Snapshot.capture(state, step=1)
    monkeypatch.setattr(manifest, "MAX_TREE_BYTES", len(tree) - 1)
    data, _ = _manifest(**{**_rows(), "tree": tree})
    with pytest.raises(PeerError, match=f"tree of {len(tree)} bytes exceeds"):
        decode_manifest(data, 1 << 30)


def test_a_str_that_is_not_utf8_is_refused_at_capture():
    with pytest.raises(TypeError, match="not valid UTF-8"):
        Snapshot.capture({"m": {"\udc80": torch.zeros(1)}}, step=1)
    with pytest.raises(TypeError, match="not valid UTF-8"):
        Snapshot.capture({"m": {"k": "\udc80"}}, step=1)


def test_an_empty_tensor_with_a_huge_dimension_round_trips():
    snap = Snapshot.capture({"m": {"w": torch.zeros((0, 1 << 61), dtype=torch.float64)}}, 1)
    data = encode_manifest(snap, "xxh3")
    m = decode_manifest(data, 1 << 30)
    assert m.table[0].shape == (0, 1 << 61)
    assert m.allocate(None, 1 << 30)[0].tensors[0].shape == (0, 1 << 61)


def test_pickle_as_manifest_is_refused():
    import pickle
    with pytest.raises(PeerError) as e:
        decode_manifest(pickle.dumps({"v": 1}), 1 << 30)
    assert e.value.reason == "bad_manifest"


def _by_name(snap: Snapshot) -> dict[str, torch.Tensor]:
    return {e.name.rsplit(".", 1)[-1]: t for e, t in zip(snap.table, snap.tensors, strict=True)}


def test_target_views_that_overlap_are_not_both_received_into():
    # The receiver's "a" and "e" are views of one buffer: were both received in place, e's
    # bytes would overwrite a's tail and the fetch still report the agreed fingerprint.
    source = Snapshot.capture({"m": {"a": torch.arange(1000.0), "e": torch.full((300,), 7.0)}},
                              step=1)
    m = decode_manifest(encode_manifest(source, "xxh3"), 1 << 30)
    buf = torch.zeros(1000)
    into = Snapshot.capture({"m": {"a": buf, "e": buf[700:]}}, step=0)
    snap, new = m.allocate(into, 1 << 30)
    got = _by_name(snap)
    assert new == 300 * 4
    assert got["a"].data_ptr() == buf.data_ptr()  # the first in address order, in place
    end = buf.data_ptr() + buf.numel() * 4
    assert not buf.data_ptr() <= got["e"].data_ptr() < end  # the other in memory of its own
    # Disjoint views of one buffer are both received into.
    whole = torch.zeros(1300)
    into = Snapshot.capture({"m": {"a": whole[:1000], "e": whole[1000:]}}, step=0)
    snap, new = m.allocate(into, 1 << 30)
    assert new == 0 and _by_name(snap)["e"].data_ptr() == whole[1000:].data_ptr()


@pytest.mark.parametrize("view", [torch.conj, torch._neg_view])
def test_a_conjugate_or_negative_view_is_captured_as_its_values(view):
    # x.conj() shares x's memory but must not share its table entry (and come back as x),
    # nor, captured first, raise RuntimeError instead of a named error or its values.
    x = torch.tensor([1 + 2j, 3 - 4j])
    for order in (("x", "v"), ("v", "x")):
        tensors = {"x": x, "v": view(x)}
        snap = Snapshot.capture({"m": {k: tensors[k] for k in order}}, step=1)
        got = snap.state()["objects"]["m"]
        assert torch.equal(got["x"], x) and torch.equal(got["v"], view(x).resolve_conj()
                                                               .resolve_neg())
        assert not got["v"].is_conj() and not got["v"].is_neg()


def test_a_meta_tensor_is_refused_with_its_path():
    with pytest.raises(TypeError, match="^m.w: a meta tensor holds no data"):
        Snapshot.capture({"m": {"w": torch.empty(3, device="meta")}}, step=1)
