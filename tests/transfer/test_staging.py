"""The staging buffers of the process-group transport (NCCL's path): a chunk's segments packed
into one buffer and unpacked into target memory are the same bytes; a buffer is handed out again
only once it was given back (one whose receive was given up on never is)."""

from __future__ import annotations

import torch

from torchpass_p2p.transfer import Snapshot
from torchpass_p2p.transfer.pg_transport import _Staging


def _snap(seed: int) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    state = {"a": torch.rand(1000, generator=g), "b": torch.randint(0, 255, (333,),
                                                                     dtype=torch.uint8,
                                                                     generator=g),
             "c": torch.rand(7, 9, generator=g).double()}
    return Snapshot.capture({"m": state}, 3, chunk_bytes=1024)


def test_every_chunk_packed_and_unpacked_lands_bitwise():
    src, dst = _snap(0), _snap(1)
    staging = _Staging(torch.device("cpu"), src.chunk_bytes)
    for i in range(src.num_chunks):
        buf, view = staging.take(src.chunk_range(i)[1])
        staging.pack(view, src.segment_tensors(i))
        staging.unpack(view, dst.segment_tensors(i))
        staging.give(buf)
    assert all(torch.equal(a, b) for a, b in zip(src.tensors, dst.tensors, strict=True))
    assert src.num_chunks == 5  # 4,837 bytes: chunks that span tensors, a short last one
    assert src.chunk_range(4) == (4096, 741)


def test_a_buffer_is_reused_only_after_it_is_given_back():
    staging = _Staging(torch.device("cpu"), 64)
    first, view = staging.take(10)
    assert view.numel() == 10 and view.data_ptr() == first.data_ptr()
    second, _ = staging.take(64)
    assert second.data_ptr() != first.data_ptr()  # the first is still out (a posted receive)
    staging.give(second)
    third, _ = staging.take(5)
    assert third.data_ptr() == second.data_ptr()
    fourth, _ = staging.take(5)
    assert fourth.data_ptr() not in (first.data_ptr(), second.data_ptr())
