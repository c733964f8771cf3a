"""S18 and S05 with live agents and a fake NVML (docs/scenarios.md).

S18: NVML reports an uncorrectable ECC error on a GPU that still runs: its member drains and a
spare takes its rank proactively. S05: every NVML call of one member blocks; the hang is reported
as a health fault of that GPU, and the member's gossip stays on time (its peers never suspect it).
"""

from __future__ import annotations

import random

from tests.agent.cluster import LocalCluster
from torchpass_p2p.agent.health import HealthMonitor
from torchpass_p2p.agent.runtime import AgentRuntime
from torchpass_p2p.testing.fake_nvml import FakeNvml


def with_fake_gpu(cluster: LocalCluster, member: int, nvml: FakeNvml, **monitor) -> None:
    settings = cluster[member].settings
    cluster.agents[member] = AgentRuntime(
        settings.__class__(**{**settings.__dict__, "health": True}),
        rng=random.Random(member),
        health=HealthMonitor(nvml=nvml, device_index=0, **monitor))


async def test_s18_uncorrectable_ecc_drains_the_rank_to_a_spare():
    nvml = FakeNvml()
    cluster = LocalCluster(3, 1, seed=21)
    with_fake_gpu(cluster, 2, nvml, interval_s=0.1, call_deadline_s=1.0)
    await cluster.start()
    try:
        await cluster.until(lambda: cluster[2].status()["health"]["state"] == "running", 5)
        nvml.gpu.ecc_uncorrected = 1
        await cluster.until(lambda: cluster[4].rank == 1, timeout_s=15)
        faults = [e for e in cluster[2].status()["recent_events"] if e["type"] == "HealthFault"]
        assert faults and faults[0]["detail"].startswith("ecc_uncorrectable")
        assert cluster[1].configuration.rank_of(2) is None
    finally:
        await cluster.stop()


async def test_s05_a_hung_nvml_is_a_fault_and_gossip_stays_on_time():
    nvml = FakeNvml()
    cluster = LocalCluster(3, 1, seed=22)
    with_fake_gpu(cluster, 4, nvml, interval_s=0.1, call_deadline_s=0.5)  # a spare: no drain
    await cluster.start()
    try:
        await cluster.until(lambda: cluster[4].status()["health"]["state"] == "running", 5)
        nvml.hang(60.0)
        await cluster.until(lambda: any(
            e["type"] == "HealthFault" and e["detail"].startswith("nvml_hang")
            for e in cluster[4].status()["recent_events"]), timeout_s=5)
        acks = cluster[4].member.counters["probe_acks"]
        await cluster.until(lambda: cluster[4].member.counters["probe_acks"] >= acks + 3,
                            timeout_s=10)
        assert all(a.member.counters["alerts_raised"] == 0 for a in cluster.live())
        assert cluster[4].member.counters["stalls"] == 0
    finally:
        nvml.release()
        await cluster.stop()
