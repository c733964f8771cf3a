"""A transfer into a receiver behind one rate-limited link (a network namespace and ``tc tbf``,
as ``benchmarks.throttled_transfer`` measures at full size): a source that is slow but moving
keeps its connection to the end, a source that stalls mid-chunk is dropped and its chunk is
finished by another, and no byte moves twice."""

from __future__ import annotations

import asyncio
import os

import pytest

from benchmarks import links
from benchmarks import throttled_transfer as bench
from torchpass_p2p.transfer import TransferKeys, fetch

pytestmark = pytest.mark.skipif(links.unavailable() is not None,
                                reason=f"links unavailable: {links.unavailable()}")

RATE_GBIT = 0.001
"""125 kB/s for every source together."""
CHUNK = 128 << 10


def test_a_slow_source_is_kept_and_a_stalled_one_dropped_behind_a_slow_link() -> None:
    key = os.urandom(32)
    # Each source's socket holds 8 KiB: a 128 KiB chunk leaves at the pace the link takes it
    # (~62 kB/s per source while both send: 2 s a chunk), twice its 1 s send deadline: a deadline
    # on progress, not on the whole chunk, must keep the moving source. The other source
    # stops its process (SIGSTOP) halfway through its first chunk. The link's queue
    # (``burst`` + 0.1 s) holds what both sockets send: no packet is dropped there, so no TCP
    # retransmission timeout (0.2 s and more) stalls a moving source.
    common = ["--state-mb", "0.5", "--chunk-bytes", str(CHUNK), "--send-timeout", "1.0",
              "--idle-timeout", "2.0", "--small-buffers"]
    with links.source_links(1, RATE_GBIT, prefix="tptt", burst="32kb",
                            subnet="10.78") as (link,):
        sources = bench.start_sources(link, 1, key, common)
        sources += bench.start_sources(link, 1, key, [*common, "--stall-after", str(CHUNK // 2)])
        try:
            res = asyncio.run(fetch([(link.address, info["port"]) for _, info in sources],
                                    TransferKeys(key), bench.CONFIG_ID, window=2,
                                    progress_timeout_s=1.0, keepalive_s=0.5))
        finally:
            counts = bench.stop_sources(sources)
    total = res.snapshot.total_bytes
    assert res.snapshot.fingerprint().hex() == sources[0][1]["fingerprint"]
    moving, stalled = [(link.address, info["port"]) for _, info in sources]
    assert res.failures == {"no_progress": 1}  # the stalled source, and only it
    assert res.bytes_by_source == {moving: total, stalled: 0}
    assert counts[1]["stats"]["stalled"] == 1
    # The moving source was never dropped, nor its connection closed.
    assert counts[0]["refused"] == {} and counts[0]["stats"].get("idle_timeouts", 0) == 0
    # It finished the stalled source's half chunk: every chunk byte moved once.
    assert res.resumed_chunks == 1
    assert counts[0]["stats"]["bytes"] == total - CHUNK // 2
    assert total < res.received_bytes < 1.01 * total
