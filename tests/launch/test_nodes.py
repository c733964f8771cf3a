"""A job over two hosts: one launcher per host, each deriving the same configuration 0.

The two hosts are two loopback addresses (127.0.0.1 and 127.0.0.2), each with its own launcher
process, as on two machines; they share only the key file, the run id and the base port.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tests.launch.procs import REPO, clean_environ, finish, start_launcher, wait_for
from torchpass_p2p.launch.childspec import nodes_configuration
from torchpass_p2p.launch.keyfile import write_key_file

MEMBER = str(REPO / "tests" / "agent" / "mp_member.py")
NODES = ("127.0.0.1", "127.0.0.2")


def test_every_host_derives_the_same_configuration_zero():
    key = bytes(range(32))
    a, per_node_a = nodes_configuration(key, "run-7", NODES, nproc=2, spares=1, base_port=41000)
    b, _ = nodes_configuration(key, "run-7", NODES, nproc=2, spares=1, base_port=41000)
    assert a == b
    assert a.world_size == 4 and len(a.spares) == 2
    assert [c.rank for c in per_node_a[1]] == [2, 3, None]
    assert [c.local_rank for c in per_node_a[1]] == [0, 1, None]
    assert a.addresses[per_node_a[1][0].member_id] == ("127.0.0.2", 41000)
    other, _ = nodes_configuration(key, "run-8", NODES, nproc=2, spares=1, base_port=41000)
    assert not set(other.members) & set(a.members)  # a new run id, new member ids


def _records(logs: Path) -> dict[str, list[dict]]:
    out = {}
    for path in logs.glob("*.jsonl"):
        out[path.stem] = [json.loads(x) for x in path.read_text().splitlines() if x]
    return out


def test_two_hosts_form_one_cluster_and_a_spare_replaces_a_rank_across_them(tmp_path):
    from tests.launch.procs import free_ports_block

    key_file = tmp_path / "key"
    write_key_file(key_file)
    logs = tmp_path / "logs"
    logs.mkdir()
    base = free_ports_block(3, NODES)
    env = clean_environ() | {"MP_LOG_DIR": str(logs), "PYTHONPATH": str(REPO)}
    launchers = [start_launcher(
        ["--nodes", ",".join(NODES), "--node-rank", str(n), "--run-id", "t", "--base-port",
         str(base), "--key-file", str(key_file), "--nproc", "2", "--spares", "1", "--grace", "3",
         MEMBER], env=env) for n in range(2)]
    try:
        def all_up():
            recs = _records(logs)
            up = {m: r[0] for m, r in recs.items() if r and r[0]["event"] == "started"}
            return up if len(up) == 6 else None
        up = wait_for(all_up, 30, "six members on two hosts")
        assert all(r["members"] == 6 for r in up.values())
        ranks = sorted((r["env"]["RANK"], r["env"]["LOCAL_RANK"], r["address"][0])
                       for r in up.values() if r["role"] == "rank")
        assert ranks == [("0", "0", NODES[0]), ("1", "1", NODES[0]), ("2", "0", NODES[1]),
                         ("3", "1", NODES[1])]
        assert all(r["env"]["WORLD_SIZE"] == "4" for r in up.values() if r["role"] == "rank")
        victim = next(m for m, r in up.items() if r["rank"] == 3)
        pid = int(next(p for p in os.listdir("/proc") if p.isdigit()
                       and _environ_has(p, f"TORCHPASS_MEMBER_ID={victim}")))
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: any(r["event"] == "role" and r.get("rank") == 3
                             for recs in _records(logs).values() for r in recs), 20,
                 "a spare holding rank 3")
    finally:
        for launcher in launchers:
            launcher.send_signal(signal.SIGTERM)
        for launcher in launchers:
            finish(launcher, 20)


def _environ_has(pid: str, entry: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry.encode() in f.read().split(b"\0")
    except OSError:
        return False
