"""Half the members lost at once, in the simulator, through ``sims/scenarios/half_lost.toml``
(issue 32, item 3).

48 ranks and 16 spares at 5 % loss; at 10 s 32 members crash and come back as new processes
within 2 s. The 32 survivors are one short of a majority (33 of 64): no change can be decided,
not even the admission of a new process. What each survivor's host shows its user comes from
the core: :class:`~torchpass_p2p.core.events.QuorumLost` and ``Member.reachable``.

Must hold, in each of 20 seeds: nothing is decided, nobody is admitted, nobody live is counted
out; every survivor that is fenced reports the configuration's 64 members, the majority of 33
and how many it believes reachable, which is never below the 32 alive (but 1 while it suspects
itself: most of its subjects are dead); 30 s after the crash every survivor counts exactly the
32 alive, except a crashed member with fewer than L = 3 live observers (its one or two alerts
are noise, never a conviction, and gossip may miss a member), and every survivor that counts 32
is fenced.
"""

from __future__ import annotations

import pytest

from sims.cluster import SimMember
from sims.scenario import load_scenario
from tests.sims.fleet import scenario_fleet
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.messages import MemberState

SCENARIO = load_scenario("half_lost")
SEEDS = range(1, 21)
MEMBERS, ALIVE, MAJORITY = 64, 32, 33


@pytest.mark.parametrize("seed", SEEDS)
def test_survivors_without_a_majority_report_how_many_are_left(seed: int) -> None:
    cluster, recorder, safety = scenario_fleet(SCENARIO, seed)
    # Each QuorumLost with whether its member suspected itself then (reachable is 1 then).
    reported: dict[int, list[tuple[ev.QuorumLost, bool]]] = {}

    def on_event(sm: SimMember, event: ev.Event) -> None:
        if isinstance(event, ev.QuorumLost):
            reported.setdefault(sm.index, []).append((event, sm.core.self_suspected))

    cluster.listeners.append(on_event)
    cluster.run(SCENARIO.virtual_s)

    crashed = [cluster.by_id[m] for m in recorder.faults]
    survivors = [cluster.by_id[m] for m in recorder.live_ids()]
    assert len(crashed) == len(survivors) == ALIVE
    assert safety.decisions == 0 and safety.count == 0 and recorder.joined == {}
    assert recorder.false_removals == {}
    # What a survivor reports when it is fenced: the configuration, its size, the majority
    # and its count, never below the members really alive unless it suspects itself.
    for sm in survivors:
        for event, isolated in reported.get(sm.index, []):
            assert (event.config_id, event.members, event.majority) == (0, MEMBERS, MAJORITY)
            # A member that heard no ack nor nack for self_suspect_after_s counts only itself
            # (Member.reachable); most of a survivor's subjects are dead here, so a few do.
            assert event.reachable == 1 if isolated else ALIVE <= event.reachable
    # 30 s after the crash: each survivor counts the 32 alive, plus any crashed member its
    # view still holds alive, and only one whose alerts could never convict it.
    config = cluster.configuration
    for sm in survivors:
        held = [x for x in crashed if sm.core.state_of(x.id)[0] == MemberState.ALIVE]
        assert sm.core.reachable == ALIVE + len(held)
        for x in held:
            live_observers = [o for o in config.observers_of(x.id) if not cluster.by_id[o].crashed]
            assert len(live_observers) < cluster.params.min_alerts_to_confirm
        if sm.core.reachable == ALIVE:
            assert sm.core.fenced and sm.index in reported
