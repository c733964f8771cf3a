"""The agent as the training layers see it: :class:`TrainingAgent`, the typed events, and the
public names of :mod:`torchpass_p2p.agent`.

mypy proves that :class:`~torchpass_p2p.agent.api.Agent` satisfies the protocol (the end of
``agent/interface.py``); these check the same at run time, that the events the trainer reads
are ``/status``'s, and that importing the agent package loads no runtime.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import torchpass_p2p.agent as agent_package
from tests.agent.cluster import LocalCluster
from torchpass_p2p.agent import ACCUSATIONS, Agent, AgentEvent, Phase, TrainingAgent
from torchpass_p2p.agent.settings import AgentSettings
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.seal import Keyring


def interface_members() -> set[str]:
    """Every member of :class:`TrainingAgent` (its properties and methods)."""
    return {name for name in vars(TrainingAgent) if not name.startswith("_")}


def unstarted_agent() -> Agent:
    config = Configuration(0, [1], [], {1: ("127.0.0.1", 9)})
    return Agent(AgentSettings(keyring=Keyring(b"\x11" * 32), member_id=1, configuration=config))


def test_the_interface_lists_what_the_trainer_uses() -> None:
    assert interface_members() >= {"settings", "member_id", "fenced", "next_change",
                                   "wait_for_rank", "recent_events", "report_commit", "stop"}
    assert "status" not in interface_members()  # the trainer reads typed events instead


def test_the_agent_has_every_member_of_the_interface() -> None:
    agent = unstarted_agent()
    for name in interface_members():  # static: its properties need a running agent
        inspect.getattr_static(agent, name)


def test_an_event_of_status_becomes_a_typed_record() -> None:
    event = AgentEvent.from_status({"at": 12, "type": "MemberDead", "detail": "member=00ab"})
    assert event == AgentEvent(12.0, "MemberDead", "member=00ab") and event.accuses
    assert not AgentEvent(1.0, "QuorumLost", "").accuses
    assert not AgentEvent(1.0, "HangDetected", "compute").accuses
    assert ACCUSATIONS == {"MemberSuspected", "AlertRaised", "MemberDead", "MemberLeft"}
    assert all(isinstance(getattr(ev, kind), type) for kind in ACCUSATIONS)
    with pytest.raises(KeyError):
        AgentEvent.from_status({"at": 1.0, "type": "MemberDead"})


def test_recent_events_are_those_of_the_status_document_in_order() -> None:
    agent = unstarted_agent()
    listed = [{"at": 1.5, "type": "MemberSuspected", "detail": "a"},
              {"at": 2.5, "type": "QuorumLost", "detail": "b"}]
    asked: list[float] = []

    def status(timeout_s: float = 5.0) -> dict[str, object]:
        asked.append(timeout_s)
        return {"recent_events": listed, "role": "rank"}

    agent.status = status  # type: ignore[method-assign]
    assert agent.recent_events(timeout_s=2.0) == (AgentEvent(1.5, "MemberSuspected", "a"),
                                                  AgentEvent(2.5, "QuorumLost", "b"))
    assert asked == [2.0]


def test_a_running_agent_reports_the_accusation_before_a_change_as_typed_events() -> None:
    cluster = LocalCluster(3, 1, seed=7)
    agents = {m: Agent(a.settings) for m, a in cluster.agents.items()}
    for agent in agents.values():
        agent.start()
    try:
        for m in (1, 2, 3):
            agents[m].report_progress(3, Phase.COMMITTED)
        agents[2].stop(leave=False)
        change = agents[1].next_change(timeout_s=20)
        assert change is not None and change.plan.removed == (2,)
        typed = agents[1].recent_events()
        first = [(e.at, e.type, e.detail) for e in typed]
        later = [(e["at"], e["type"], e["detail"]) for e in agents[1].status()["recent_events"]]
        # The same records in the same order (the later list may have lost some of the
        # oldest to its bound, and gained new ones).
        overlap = [e for e in first if e in later]
        assert overlap and later[:len(overlap)] == overlap
        accused = [e for e in typed if e.accuses]
        assert accused and accused[0].at <= change.decided_at
    finally:
        for agent in agents.values():
            agent.stop()


def test_every_public_name_of_the_agent_package_resolves() -> None:
    assert set(agent_package.__all__) == set(agent_package._HOMES)
    for name in agent_package.__all__:
        assert getattr(agent_package, name) is not None
    with pytest.raises(AttributeError):
        agent_package.nothing_of_that_name  # noqa: B018


def test_importing_the_agent_package_loads_no_runtime() -> None:
    # The simulator and the launcher import modules of the package (pulse, settings).
    code = ("import sys, torchpass_p2p.agent.settings, torchpass_p2p.agent.pulse; "
            "loaded = [m for m in ('torchpass_p2p.agent.runtime', 'torchpass_p2p.agent.api', "
            "'torch') if m in sys.modules]; print(loaded); sys.exit(bool(loaded))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
