"""Garbage on a live agent's real UDP and TCP ports: dropped, counted in /metrics, no crash.

Covers random bytes, truncated and oversized datagrams, datagrams and frames sealed with another
key (forged), a replayed datagram, a frame header claiming 4 GB, and a configuration request
from a process without the key. After all of it the agent still answers its peers and its view
of the cluster has not changed.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.agent.cluster import LocalCluster
from torchpass_p2p.agent.transport import REQUEST_LABEL, Channel, Kind
from torchpass_p2p.core.codec import encode
from torchpass_p2p.core.messages import Ping
from torchpass_p2p.core.seal import Keyring, Sealer


def udp_send(address, payloads):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for p in payloads:
            s.sendto(p, address)


async def tcp_send(address, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(data)
    await writer.drain()
    try:
        async with asyncio.timeout(1.0):
            return await reader.read(1024)
    except TimeoutError:
        return b""
    finally:
        writer.close()


def request(keyring: Keyring, sender: int, kind: int, body: bytes) -> bytes:
    sealer = Sealer("torchpass", keyring.derive(REQUEST_LABEL), sender)
    sealed = sealer.seal(bytes((kind,)) + body, 0)
    return struct.pack(">I", 1 + len(sealed)) + bytes((Channel.REQUEST,)) + sealed


def rejected_in_metrics(text: str, metric: str) -> dict[str, float]:
    for family in text_string_to_metric_families(text):
        if family.name == metric:
            return {s.labels["reason"]: s.value for s in family.samples
                    if s.name.endswith("_total")}
    return {}


async def test_garbage_on_both_ports_is_dropped_counted_and_changes_nothing():
    cluster = LocalCluster(3, 0, seed=11, status=True)
    await cluster.start()
    target = cluster[1]
    rng = random.Random(0)
    try:
        view = target.status()["members"]
        address = target.address
        rogue = Keyring(bytes(range(32)))
        forged = Sealer("torchpass", rogue, 2).seal(encode(Ping(1, ())), 0)
        genuine = Sealer("torchpass", cluster.keyring, 77).seal(encode(Ping(9, ())), 0, to=1)
        udp_send(address, [
            bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 1400))) for _ in range(50)])
        udp_send(address, [b"", b"\x01", genuine[:20], b"x" * 1500, forged, genuine, genuine])
        replies = await asyncio.gather(
            tcp_send(address, struct.pack(">I", (4 << 30) - 1)),  # claims 4 GB
            tcp_send(address, b"\x00\x00\x01\x00" + bytes(256)),  # garbage body
            tcp_send(address, request(rogue, 2, Kind.CONFIG_REQUEST, b"")),  # no key
            tcp_send(address, request(cluster.keyring, 2, 9, b"")),  # an unknown kind
            tcp_send(address, b"\x00\x00\x00\x05abc"),  # shorter than any sealed frame
            tcp_send(address, b"\x00\x00\x01\x00" + bytes(100)),  # truncated, then closed
        )
        # Nobody without the key gets a configuration: the keyless request is answered only
        # with the key ids this member accepts (so a process left on a dropped key can say
        # why it is refused), the rest with nothing.
        ids = bytes(cluster.keyring.key_ids)
        refusal = struct.pack(">I", 1 + len(ids)) + bytes((Channel.REFUSED,)) + ids
        assert replies == [b"", b"", refusal, b"", b"", b""]
        await asyncio.sleep(0.2)

        rejected = target.transport.rejected
        assert rejected["too_large"] >= 1 and rejected["too_short"] >= 2
        # 50 random datagrams + 7 crafted, minus the one genuine accepted: all rejected.
        assert rejected.total() == 56
        assert rejected["auth_failed"] + rejected["unknown_key"] >= 1  # the forged one
        assert rejected["replay"] == 1  # the second copy of the genuine datagram
        frames = target.transport.rejected_frames
        assert frames["too_large"] == 1
        assert frames["too_short"] == 1
        await asyncio.sleep(0.1)
        assert frames["truncated"] == 1
        assert frames["bad_version"] == 1  # the garbage body
        assert frames["unknown_key"] + frames["auth_failed"] == 1  # the rogue's request
        assert frames["unknown_kind"] == 1

        async with aiohttp.ClientSession() as http:
            host, port = target.status_address
            target.refresh_metrics()
            async with http.get(f"http://{host}:{port}/metrics") as response:
                text = await response.text()
        datagrams = rejected_in_metrics(text, "torchpass_rejected_datagrams")
        assert datagrams["replay"] == 1 and datagrams["too_large"] == rejected["too_large"]
        assert rejected_in_metrics(text, "torchpass_rejected_frames")["too_large"] == 1

        # Still a working member: its peers still get acks, its view is unchanged.
        acks = target.member.counters["probe_acks"]
        await cluster.until(lambda: target.member.counters["probe_acks"] > acks, timeout_s=5)
        assert target.status()["members"] == view
        assert target.configuration.config_id == 0
    finally:
        await cluster.stop()


async def test_status_page_serves_the_live_agent_and_takes_evidence_with_the_token():
    cluster = LocalCluster(3, 1, seed=12, status=True)
    await cluster.start()
    try:
        host, port = cluster[1].status_address
        url = f"http://{host}:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/status") as response:
                doc = await response.json()
            assert doc["member_id"] == f"{1:016x}" and doc["role"] == "rank"
            assert len(doc["members"]) == 4
            body = {"member_id": f"{2:016x}", "reason": "exited with -9"}
            async with http.post(url + "/evidence", json=body) as response:
                assert response.status == 401
            headers = {"Authorization": f"Bearer {cluster[1].http_token}"}
            async with http.post(url + "/evidence", json=body, headers=headers) as response:
                assert response.status == 200
        assert cluster[1].member.counters["evidence_reported"] == 1
    finally:
        await cluster.stop()
