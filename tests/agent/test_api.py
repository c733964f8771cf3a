"""The thread API: agents in background threads, driven from plain (non-async) code."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest

from tests.agent.cluster import HOST, LocalCluster
from torchpass_p2p.agent.api import Agent, AgentError, start
from torchpass_p2p.agent.bootstrap import write_configuration
from torchpass_p2p.agent.runtime import Phase
from torchpass_p2p.launch.ports import reserve_ports


def threaded(cluster: LocalCluster) -> dict[int, Agent]:
    return {m: Agent(a.settings) for m, a in cluster.agents.items()}


def test_a_spare_blocks_until_it_is_assigned_the_crashed_rank_and_learns_the_resume_step():
    agents = threaded(LocalCluster(3, 1, seed=7))
    for agent in agents.values():
        agent.start()
    try:
        for m in (1, 2, 3):
            agents[m].report_progress(41, Phase.COMMITTED)
        assert agents[4].role == "spare" and agents[4].rank is None
        agents[2].stop(leave=False)
        change = agents[4].wait_for_rank(timeout_s=20)
        assert change.configuration.rank_of(4) == 1
        assert change.plan.removed == (2,) and change.plan.assignments == ((1, 4),)
        assert sorted(dict(change.plan.sources)[1]) == [1, 3]  # every surviving replica
        assert change.plan.resume_step == 42  # every survivor committed step 41
        assert agents[4].rank == 1 and agents[4].role == "rank"
        seen = agents[1].next_change(timeout_s=5)
        assert seen is not None and seen.plan.hash == change.plan.hash
        status = agents[1].status()
        assert status["config_id"] == 1 and status["step"] == 41
    finally:
        for agent in agents.values():
            agent.stop()


def test_an_agent_whose_timer_task_fails_stops_as_if_crashed_and_is_replaced(caplog):
    agents = threaded(LocalCluster(3, 1, seed=7))
    for agent in agents.values():
        agent.start()
    try:
        def callback(change):
            raise ValueError("a bug in the host's callback")

        def timer_bug(now):
            raise RuntimeError("a bug in the timer task")

        agents[1].on_change(callback)  # raises on every change: it must end nothing
        agents[2]._runtime._watch_hang = timer_bug  # runs on member 2's next timer
        change = agents[4].wait_for_rank(timeout_s=20)
        assert change.plan.removed == (2,) and change.plan.assignments == ((1, 4),)
        assert agents[2].role == "failed" and agents[2].fenced
        assert not agents[2]._thread.is_alive()
        assert agents[2].next_change() is None  # no wait forever on a stopped agent
        seen = agents[1].next_change(timeout_s=5)
        assert seen is not None and seen.plan.hash == change.plan.hash
        assert agents[1].role == "rank" and not agents[1].fenced
        assert "the agent's timer task failed" in caplog.text
        deadline = time.monotonic() + 5  # the callbacks run just after the change is queued
        while "a bug in the host's" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "on_change callback" in caplog.text and "a bug in the host's" in caplog.text
    finally:
        for agent in agents.values():
            agent.stop()


def test_wait_for_rank_times_out_and_a_stopped_agent_refuses_calls():
    agents = threaded(LocalCluster(2, 1, seed=8))
    for agent in agents.values():
        agent.start()
    try:
        with pytest.raises(TimeoutError):
            agents[3].wait_for_rank(timeout_s=0.2)
    finally:
        for agent in agents.values():
            agent.stop()
    with pytest.raises(AgentError):
        agents[3].drain()


def test_start_reads_the_launchers_environment(tmp_path, monkeypatch):
    cluster = LocalCluster(1, 0)
    key_file = tmp_path / "key"
    key_file.write_text(cluster.key.hex() + "\n")
    config_file = tmp_path / "configuration.json"
    write_configuration(config_file, cluster.configuration)
    host, port = cluster.configuration.addresses[1]
    [gossip] = reserve_ports(1, ports=[port])  # bound already, as the launcher hands them
    udp, tcp = gossip.hand_over()
    [status] = reserve_ports(1, udp=False)
    (status_fd,) = status.hand_over()
    for name, value in {"KEY_FILE": str(key_file), "MEMBER_ID": f"{1:016x}",
                        "BIND": f"{host}:{port}", "BIND_FDS": f"{udp},{tcp}",
                        "STATUS": f"127.0.0.1:{status.port}", "STATUS_FD": str(status_fd),
                        "CONFIGURATION": str(config_file), "HEALTH": "off",
                        "CLUSTER": "t1"}.items():
        monkeypatch.setenv("TORCHPASS_" + name, value)
    agent = start()
    try:
        assert agent.member_id == 1 and agent.rank == 0 and agent.role == "rank"
        assert agent.address == (HOST, port)
        assert agent.status_address == ("127.0.0.1", status.port)
        # consumed: a subprocess of the script or a second start() never sees them
        assert not {"TORCHPASS_BIND_FDS", "TORCHPASS_STATUS_FD"} & set(os.environ)
        doc = agent.status()
        assert doc["cluster"] == "t1"
        json.dumps(doc)  # plain data
    finally:
        agent.stop()
    assert "TORCHPASS_KEY" not in os.environ


def test_start_fails_clearly_when_the_port_is_taken():
    cluster = LocalCluster(2, 0)
    first = Agent(cluster[1].settings)
    first.start()
    try:
        clash = Agent(replace(cluster[2].settings, bind=first.address))
        with pytest.raises(AgentError, match="failed to start"):
            clash.start(timeout_s=10)
    finally:
        first.stop()
