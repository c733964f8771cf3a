"""Key rotation in live agents (``docs/running.md``, "Keys"): reload, a process on the old key,
the refusal of a key no longer accepted, and what members log and count.

Real agents on loopback (:class:`tests.agent.cluster.LocalCluster`), real sealing, real key
files; the end-to-end run under the launcher is ``tests/launch/test_key_rotation.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.agent.cluster import HOST, LocalCluster
from torchpass_p2p.agent.runtime import AgentRuntime, KeyNotAccepted
from torchpass_p2p.agent.transport import UNKNOWN_KEY_LINES_PER_MINUTE
from torchpass_p2p.core.messages import Ping
from torchpass_p2p.core.seal import Keyring, key_id
from torchpass_p2p.core.wire import Wire
from torchpass_p2p.launch.keyfile import replace_key_file, rotated_keys
from torchpass_p2p.launch.outcome import EXIT_KEY_REFUSED

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


def _with_key_file(cluster: LocalCluster, path: Path) -> None:
    replace_key_file(path, [cluster.key])
    for agent in cluster.agents.values():
        agent.settings = replace(agent.settings, key_file=str(path))


def _joiner(cluster: LocalCluster, member: int, key: bytes, path: Path) -> AgentRuntime:
    replace_key_file(path, [key])
    seeds = tuple(cluster.configuration.addresses[m] for m in cluster.configuration.members[:2])
    settings = replace(cluster.template, member_id=member, configuration=None, seeds=seeds,
                       bind=(HOST, 0), keyring=Keyring(key), key_file=str(path),
                       join_timeout_s=30.0)
    agent = AgentRuntime(settings, rng=random.Random(member))
    cluster.agents[member] = agent
    return agent


async def test_a_spare_on_the_old_key_joins_while_it_is_accepted_and_is_refused_after(
        tmp_path: Path) -> None:
    cluster = LocalCluster(3, 0, seed=3)
    main = tmp_path / "main.key"
    _with_key_file(cluster, main)
    k1 = cluster.key
    await cluster.start()
    try:
        # New primary, old key accepted: every member reloads.
        keys = rotated_keys([k1])
        replace_key_file(main, keys)
        k2_id, k1_id = key_id(keys[0]), key_id(k1)
        answers = [a.reload_keys() for a in cluster.live()]
        assert answers == [{"reloaded": True, "primary_id": k2_id,
                            "key_ids": [k2_id, k1_id]}] * 3
        assert all(a.status()["keys"] == {"primary_id": k2_id, "key_ids": [k2_id, k1_id],
                                          "reloads": 1, "reloaded_at": a.keys.reloaded_at}
                   for a in cluster.live())
        # A process on the old key alone joins, and hears its peers under it.
        old = _joiner(cluster, 9, k1, tmp_path / "old.key")
        await old.start()
        await cluster.until(lambda: all(9 in a.configuration.spares
                                        for a in cluster.live()), 30)
        await cluster.until(lambda: cluster[1].transport.peer_key_id(9) == k1_id, 10)
        assert cluster[1].transport.peer_key_id(2) == k2_id
        assert old.role == "spare" and old.refused is None
        # The old key is dropped: the spare is refused and stops; members stay.
        replace_key_file(main, rotated_keys(keys, drop_old=True))
        for a in cluster.live():
            if a is not old:
                assert a.reload_keys()["key_ids"] == [k2_id]
        await asyncio.wait_for(old.finished.wait(), 10)
        assert str(old.refused) == (
            f"key not accepted: this process seals with key id {k1_id} (its keys: {k1_id}) "
            f"and 3 of 3 member(s) asked accept only key ids {k2_id}")
        await cluster.until(lambda: all(a.configuration.members == (1, 2, 3)
                                        for a in cluster.live()), 30)
        assert [a.refused for a in cluster.live()] == [None] * 3
        assert all(a.configuration.ranks == (1, 2, 3) for a in cluster.live())
        # Each member logged the refused source, and counts it.
        counts = [a.key_counters() for a in cluster.live()]
        assert all(c["unknown_key_lines"] >= 1 and c["reloads"] == 2 for c in counts), counts
        assert sum(c.get("refusals_sent", 0) for c in counts) >= 3, counts
        # A process started again on the old key is refused as it joins.
        again = _joiner(cluster, 10, k1, tmp_path / "old.key")
        with pytest.raises(KeyNotAccepted) as refused:
            await again.start()
        assert str(refused.value) == (
            f"key not accepted: this process seals with key id {k1_id} (its keys: {k1_id}) "
            f"and 2 of 2 seed(s) accept only key ids {k2_id}")
        assert again.stopped
    finally:
        await cluster.stop()


async def test_a_bad_key_file_changes_nothing(tmp_path: Path) -> None:
    cluster = LocalCluster(1, 0, pulse=False)
    path = tmp_path / "main.key"
    _with_key_file(cluster, path)
    await cluster.start()
    agent = cluster[1]
    try:
        path.write_text("not a key\n")
        answer = agent.reload_keys()
        assert answer["reloaded"] is False and "64 hex digits" in answer["reason"]
        assert agent.keyring.key_ids == (key_id(cluster.key),)
        assert agent.key_counters() == {"reload_failed": 1}
        path.unlink()
        assert agent.reload_keys()["reloaded"] is False
        assert agent.key_counters() == {"reload_failed": 2}
        agent.settings = replace(agent.settings, key_file=None)
        assert agent.reload_keys() == {
            "reloaded": False,
            "reason": "this agent's key came from TORCHPASS_KEY, not a key file"}
    finally:
        await cluster.stop()


async def test_a_source_under_an_unknown_key_is_logged_once_and_every_datagram_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    cluster = LocalCluster(1, 0, pulse=False)
    await cluster.start()
    agent = cluster[1]
    stranger = Wire("torchpass", Keyring(secrets.token_bytes(32)), 77)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(50):
                s.sendto(stranger.seal(Ping(1), 0), agent.address)
            # Other claimed senders are other sources: the lines a minute are capped.
            for sender in range(100, 100 + 2 * UNKNOWN_KEY_LINES_PER_MINUTE):
                s.sendto(Wire("torchpass", Keyring(b"\x07" * 32), sender).seal(Ping(1), 0),
                         agent.address)
        total = 50 + 2 * UNKNOWN_KEY_LINES_PER_MINUTE
        await cluster.until(lambda: agent.transport.rejected["unknown_key"] == total, 10)
        counts = agent.key_counters()
        assert counts["unknown_key_lines"] == UNKNOWN_KEY_LINES_PER_MINUTE
        assert counts["unknown_key_lines_suppressed"] == UNKNOWN_KEY_LINES_PER_MINUTE + 1
        lines = [r.getMessage() for r in caplog.records if "does not accept" in r.getMessage()]
        assert len(lines) == UNKNOWN_KEY_LINES_PER_MINUTE
        assert lines[0] == (
            f"dropping datagrams from 127.0.0.1 (member 000000000000004d): sealed under key id "
            f"{stranger._sealer._keyring.primary_id} this member does not accept (it accepts "
            f"key ids {key_id(cluster.key)}); logged once a minute per source, counted as "
            "unknown_key")
        assert agent.refused is None  # a single stranger proves nothing about our key
    finally:
        await cluster.stop()


CHILD = '''
import torchpass_p2p
torchpass_p2p.start()
print("started: must not happen")
'''


async def test_a_process_whose_key_is_refused_exits_6_with_one_line(tmp_path: Path) -> None:
    cluster = LocalCluster(2, 0, pulse=False)
    await cluster.start()
    try:
        theirs = tmp_path / "other.key"
        replace_key_file(theirs, [b"\x05" * 32])
        seeds = ",".join(f"{h}:{p}" for h, p in cluster.configuration.addresses.values())
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}
        env.update(PYTHONPATH=str(REPO), TORCHPASS_KEY_FILE=str(theirs),
                   TORCHPASS_SEEDS=seeds, TORCHPASS_STATUS="off", TORCHPASS_HEALTH="off",
                   TORCHPASS_MEMBER_ID="00000000000000aa", TORCHPASS_PULSE="off")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == EXIT_KEY_REFUSED
        mine, accepted = key_id(b"\x05" * 32), key_id(cluster.key)
        assert out == b""
        assert err.decode() == (
            f"torchpass_p2p: member 00000000000000aa: key not accepted: this process seals "
            f"with key id {mine} (its keys: {mine}) and 2 of 2 seed(s) accept only key ids "
            f'{accepted} (docs/running.md, "Keys"); exit code {EXIT_KEY_REFUSED}\n')
        assert all(a.key_counters()["refusals_sent"] == 1 for a in cluster.live())
    finally:
        await cluster.stop()
