"""The shared transport suite, run against TCP and the gloo process group, the latter both
sending snapshot memory and staging every message through buffers (NCCL's path), received by a
thread per source or, as over NCCL, by one; and against an NCCL group where three CUDA devices
are present (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import pytest
import torch

from .conformance import run_pg, run_tcp
from .states import CASES

_RUNNERS = {"tcp": run_tcp, "pg": run_pg, "pg_staged": lambda: run_pg(device="cpu"),
            "pg_staged_serial": lambda: run_pg(device="cpu-serial"),
            "pg_nccl": lambda: run_pg(device="nccl")}
_NO_NCCL = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 3,
                              reason="needs 3 CUDA devices")


# A gloo run starts three interpreters that import torch: 15-40 s on a shared 2-core host.
@pytest.fixture(scope="module", params=[pytest.param("pg", marks=pytest.mark.slow),
                                        pytest.param("pg_staged", marks=pytest.mark.slow),
                                        pytest.param("pg_staged_serial",
                                                     marks=pytest.mark.slow),
                                        pytest.param("pg_nccl", marks=[pytest.mark.slow, _NO_NCCL]),
                                        "tcp"])
def reports(request):
    return _RUNNERS[request.param]()


@pytest.mark.parametrize("case", CASES)
def test_transfer_is_exact(reports, case):
    r = reports[case]
    assert r["failures"] == {}
    assert r["tensors_bitwise_equal"]
    assert r["table_equal"]
    assert r["tree_equal"]
    assert r["metadata_repr"] == r["source_metadata_repr"]
    assert r["restored_fingerprint_equal"]
    assert r["result_fingerprint_equal"]


@pytest.mark.parametrize("case", CASES)
def test_stripes_over_both_sources(reports, case):
    r = reports[case]
    assert r["sources_used"] == min(2, r["num_chunks"])


def test_receiver_allocates_what_it_lacks(reports):
    # The receiver's Adam never stepped: its moments and step counters are allocated.
    assert reports["mlp_adam"]["allocated_bytes"] > 0
    assert reports["metadata_only"]["allocated_bytes"] == 0
