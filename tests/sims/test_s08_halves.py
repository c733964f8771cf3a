"""S08 halves (docs/scenarios.md), in the simulator.

8 ranks + 2 spares at 1 % loss, training 1 s steps. At t = 20 s the network splits in two,
4 | 4+2 or 5+1 | 3+1, for 60 s, then heals. A removed process comes back, as its launcher would
restart it, 1 s after it learns it was removed: a new process with a new member id that joins as a
spare. Must hold: only the side holding a majority of the previous configuration decides and
trains; the other side pauses; after healing there is one configuration and one training history.

Why it holds: the majority side convicts the other side, cannot reach the fast quorum (8 of 10)
with its 6 members, and decides in a classic round (a majority, 6 of 10). The minority side
convicts the majority too but can gather neither quorum; its members lose their lease (they see
fewer than a majority reachable) and stop training. On healing, the minority's messages carry an
old ``config_id``; the majority answers with its certificates, the minority learns it was removed,
and its restarted processes join as spares of the majority's configuration.
"""

from __future__ import annotations

import pytest

from sims.cluster import Cluster, SimMember
from sims.invariants import InvariantChecker
from sims.jobmodel import TrainingJob
from sims.network import LinkModel
from sims.recorder import DetectionRecorder
from sims.safety import SafetyChecker
from torchpass_p2p.core import Configuration
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.plan import Policy

SPLIT_AT_S, HEAL_AT_S, HORIZON_S, RESTART_S = 20.0, 80.0, 120.0, 1.0

SPLITS = {
    "4|4+2": ((0, 1, 2, 3), (), (4, 5, 6, 7), (0, 1)),  # (minority ranks, spares; majority ...)
    "5+1|3+1": ((5, 6, 7), (1,), (0, 1, 2, 3, 4), (0,)),
}


def run_s08(seed: int, split: str, policy: Policy):
    cluster = Cluster(10, spares=2, seed=seed, link=LinkModel(loss=0.01), keep_events=False,
                      policy=policy)
    recorder = DetectionRecorder(cluster)
    checker = InvariantChecker(cluster, recorder)
    safety = SafetyChecker(cluster)
    job = TrainingJob(cluster, step_time_s=1.0, replace_s=2.0)
    config = cluster.configuration
    min_ranks, min_spares, maj_ranks, maj_spares = SPLITS[split]
    minority = [cluster.by_id[config.ranks[r]] for r in min_ranks]
    minority += [cluster.by_id[config.spares[s]] for s in min_spares]
    majority = [sm for sm in cluster.members if sm not in minority]
    assert len(majority) == 6 and len(minority) == 4

    decided: list[tuple[float, SimMember, int]] = []
    fenced: dict[int, float] = {}
    regained: dict[int, float] = {}
    rejoined: list[SimMember] = []

    def on_event(sm: SimMember, event: ev.Event) -> None:
        if isinstance(event, ev.ConfigurationDecided):
            decided.append((event.at, sm, event.configuration.config_id))
        elif isinstance(event, ev.QuorumLost):
            fenced.setdefault(sm.index, event.at)
        elif isinstance(event, ev.QuorumRegained):
            regained[sm.index] = event.at
        elif isinstance(event, ev.SelfRemoved):
            via = majority[0]
            cluster.at(event.at + RESTART_S,
                       lambda: rejoined.append(cluster.spawn_joiner(via)))

    cluster.listeners.append(on_event)
    cluster.at(SPLIT_AT_S, lambda: cluster.network.partition([sm.id for sm in minority],
                                                             [sm.id for sm in majority]))
    steps_at_split: list[int] = []
    cluster.at(SPLIT_AT_S, lambda: steps_at_split.append(job.step))
    steps_at_heal: list[int] = []
    cluster.at(HEAL_AT_S, lambda: steps_at_heal.append(job.step))
    held_at_heal: list[Configuration] = []
    cluster.at(HEAL_AT_S, lambda: held_at_heal.append(majority[0].core.configuration))
    cluster.at(HEAL_AT_S, cluster.network.heal)
    cluster.run(HORIZON_S)
    return (cluster, checker, safety, job, minority, majority, decided, (fenced, regained),
            rejoined, steps_at_split[0], steps_at_heal[0], held_at_heal[0])


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_s08_only_the_majority_side_decides_and_trains(seed: int, split: str) -> None:
    (cluster, checker, safety, job, minority, majority, decided, (fenced, regained), rejoined,
     steps_at_split, steps_at_heal, at_heal) = run_s08(seed, split, Policy.SHRINK)
    during = [(t, sm, cid) for t, sm, cid in decided if SPLIT_AT_S < t < HEAL_AT_S]
    # Only the majority side decided while split, until the other side was out entirely.
    assert during and {sm.index for _, sm, _ in during} == {sm.index for sm in majority}
    assert not any(sm.id in at_heal for sm in minority)
    split_changes = range(1, at_heal.config_id + 1)
    # 6 of the 10 is a majority but not a fast quorum: the first change took a classic round.
    assert safety.first_round[1] > 0
    assert all(safety.decided_at[c] < HEAL_AT_S for c in split_changes)
    # The minority paused: it lost its lease and trained in no configuration after the split.
    lease_s = cluster.params.lease_s
    assert all(SPLIT_AT_S < fenced.get(sm.index, -1.0) < SPLIT_AT_S + 10.0 + lease_s
               for sm in minority), fenced
    # A majority member may pause too, if most of its neighbours are on the other side, but
    # only until its side decides: it regained its lease before the network healed.
    assert all(fenced[sm.index] < regained.get(sm.index, HEAL_AT_S) < HEAL_AT_S
               for sm in majority if sm.index in fenced), (fenced, regained)
    # The majority side trained during the split (shrunk to its own ranks).
    trained_while_split = steps_at_heal - steps_at_split
    assert trained_while_split > 30, trained_while_split
    assert set(at_heal.ranks) <= {sm.id for sm in majority}  # shrunk, no vacancy
    # After healing: the other side learned it was removed, came back as new spares, and
    # everyone holds one configuration; one history (no safety or invariant violation).
    assert all(sm.core.removed for sm in minority)
    assert len(rejoined) == 4 and all(sm.core.joining is None for sm in rejoined)
    live = [sm for sm in cluster.members if not sm.core.removed and not sm.crashed]
    assert {sm.core.configuration.config_id for sm in live} == {max(safety.configurations)}
    final = live[0].core.configuration
    assert {sm.id for sm in live} == set(final.members)
    assert all(sm.id in final.spares for sm in rejoined)
    assert safety.violations == [] and checker.violations == []


@pytest.mark.parametrize("split", list(SPLITS))
def test_s08_with_policy_wait_the_rejoined_processes_fill_the_vacant_ranks(split: str) -> None:
    (cluster, checker, safety, job, minority, majority, decided, _, rejoined,
     steps_at_split, steps_at_heal, at_heal) = run_s08(3, split, Policy.WAIT)
    assert at_heal.vacant_ranks  # fewer spares than lost ranks: the job waits...
    assert steps_at_heal - steps_at_split <= 1  # ...through the split (no full world)
    final = safety.configurations[max(safety.configurations)]
    assert final.world_size == 8 and not final.vacant_ranks
    assert sum(1 for sm in rejoined if sm.id in final.ranks) == len(at_heal.vacant_ranks)
    ends = job.completions()
    assert any(t > HEAL_AT_S for t in ends)  # training resumed after the rejoin
    assert safety.violations == [] and checker.violations == []
