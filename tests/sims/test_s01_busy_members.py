"""S01 busy members (shared/scenarios/SCENARIOS.md), in the simulator.

32 ranks + 4 spares at 1 % loss. Three ranks spend half their time with the event loop blocked in
chunks of 0.8-3 s (FaultInjector.busy, duty 0.5). Must hold: no spare promoted, no process group
rebuilt (no member convicted at all: a conviction is the evidence the agreement layer acts on);
every suspicion of the busy members refuted; the busy members raise their local-health multiplier
and accuse less than the healthy ones. The invariants of sims/invariants.py hold throughout.

The full scenario is 10 virtual minutes (one seed, marked slow); CI runs 2 minutes per seed.

Status: the protocol does not survive 3 s blocks today, so the tests with the scenario's numbers
are xfail(strict=True) until it is tuned. Measured at 600 s, seeds 0/1/2 (report of issue 3):

* chunks 0.8-3 s: 57/44/83 convicted (member, incarnation) pairs; the job model hands all three
  busy ranks to spares within the first 100 s. Causes, in order of weight:
  (a) a block longer than ~2.5 s is convicted before the member wakes: first alert ~1.5 s in,
  Lifeguard's timeout shrinks to ``suspicion_min_s`` = 1 s once the observers agree (46 of 68,
  32 of 54 and 56 of 62 blocks of 2.7-3 s were convicted; none under 2.4 s by this path);
  (b) an observer's failed-round count survives the subject's short wake between two blocks, so
  it alerts 0.5 s into the next block and anchors the suspicion clock early: convictions from
  1.98 s into a block (seed 0: #12 blocked at 167.696 s for 2.82 s, #7 alerted at 168.200 s,
  #1 convicted #12@26 at 169.675 s);
  (c) a busy observer waking from its own block runs the suspicion timer that expired meanwhile
  before it reads the refutation queued in its socket (seed 0: #35 refuted at 226.054 s, #20
  blocked 225.913-227.519 s convicted #35@35 at 227.519 s).
* chunks 0.8-2.5 s: 4/4/5 pairs convicted (through (a) near 2.4-2.5 s, (b) and (c)).
* chunks 0.8-2 s: nothing convicted, every must-hold line holds (the test without xfail below).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sims.cluster import Cluster, SimMember
from sims.faults import FaultInjector
from sims.invariants import InvariantChecker
from sims.jobmodel import TrainingJob
from sims.network import LinkModel
from sims.recorder import DetectionRecorder
from torchpass_p2p.core import MemberId
from torchpass_p2p.core import events as ev

RANKS, SPARES, BUSY = 32, 4, 3
SCENARIO_CHUNK_S = (0.8, 3.0)
TOLERATED_CHUNK_S = (0.8, 2.0)
CI_HORIZON_S = 120.0
FULL_HORIZON_S = 600.0

XFAIL_3S = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="S01 with 3 s blocks: blocks over ~2.5 s are convicted before the member wakes "
           "(suspicion_min_s = 1 s is tuned for 2 s stalls and the 3 s detection target), and "
           "alerts carried over from a previous block convict earlier still (measurements in "
           "the module docstring; waking observers' stale timers were fixed since)")


class ChunkLog(FaultInjector):
    """A FaultInjector that also keeps every pause as (start, seconds), per member."""

    def __init__(self, cluster: Cluster, recorder: DetectionRecorder) -> None:
        super().__init__(cluster, recorder)
        self.chunks: dict[MemberId, list[tuple[float, float]]] = {}

    def pause(self, sm: SimMember, at: float, duration_s: float) -> None:
        self.chunks.setdefault(sm.id, []).append((at, duration_s))
        super().pause(sm, at, duration_s)


@dataclass
class S01Result:
    busy: list[SimMember]
    healthy: list[SimMember]
    convictions: list[str]
    """Every conviction: time, confirmer, subject, and where the subject's block stood."""
    unrefuted: list[tuple[int, int]]
    """(member index, incarnation) of suspicions of a busy member that it never refuted."""
    max_health: dict[int, int]
    checker: InvariantChecker
    job: TrainingJob
    blocks: dict[MemberId, list[tuple[float, float]]] = field(default_factory=dict)


def run_s01(seed: int, horizon_s: float, chunk_s: tuple[float, float]) -> S01Result:
    cluster = Cluster(RANKS + SPARES, spares=SPARES, seed=seed, link=LinkModel(loss=0.01),
                      keep_events=False)
    recorder = DetectionRecorder(cluster)
    checker = InvariantChecker(cluster, recorder)
    job = TrainingJob(cluster, step_time_s=1.0, replace_s=5.0)
    faults = ChunkLog(cluster, recorder)
    busy = [cluster.by_id[m] for m in cluster.rng.sample(cluster.configuration.ranks, BUSY)]
    busy_ids = {sm.id for sm in busy}
    blocks = faults.chunks
    for sm in busy:  # quiet for the last 10 s, so the last suspicions can be refuted
        faults.busy(sm, 5.0, horizon_s - 10.0, chunk_s, 0.5)

    suspected: dict[MemberId, int] = {}
    convictions: list[str] = []

    def where(member: MemberId, at: float) -> str:
        for start, length in blocks.get(member, ()):
            if start <= at <= start + length:
                return f"{at - start:.2f} s into a {length:.2f} s block"
        return "not blocked"

    def on_event(sm: SimMember, event: ev.Event) -> None:
        kind = type(event)
        if kind is ev.MemberSuspected and event.member in busy_ids:
            suspected[event.member] = max(suspected.get(event.member, 0), event.incarnation)
        elif kind is ev.MemberDead and event.confirmer == sm.id:
            subject = cluster.by_id[event.member]
            convictions.append(
                f"t={event.at:.3f} #{sm.index} ({where(sm.id, event.at)}) convicted "
                f"#{subject.index}@{event.incarnation} ({where(subject.id, event.at)})")

    cluster.listeners.append(on_event)
    max_health = {sm.index: 0 for sm in busy}

    def sample_health() -> None:
        for sm in busy:
            max_health[sm.index] = max(max_health[sm.index], sm.core.health)
        cluster.at(cluster.now + 0.25, sample_health)

    cluster.at(0.0, sample_health)
    cluster.run(horizon_s)
    unrefuted = [(cluster.by_id[m].index, inc) for m, inc in suspected.items()
                 if inc >= cluster.by_id[m].core.incarnation]
    healthy = [sm for sm in cluster.members if sm.id not in busy_ids]
    return S01Result(busy, healthy, convictions, unrefuted, max_health, checker, job, blocks)


def assert_s01_holds(result: S01Result) -> None:
    # No member convicted, so no spare promoted and no process group rebuilt.
    assert result.convictions == [], "\n".join(result.convictions[:20])
    assert result.job.replacements == []
    # Every suspicion of a busy member refuted (each suspected incarnation was superseded).
    assert result.unrefuted == []
    assert all(sm.core.counters["refutations"] > 0 for sm in result.busy)
    # They noticed their own stalls and raised their local-health multiplier...
    assert all(sm.core.counters["stalls"] > 0 for sm in result.busy)
    assert all(h > 0 for h in result.max_health.values()), result.max_health
    # ...and accused less than the healthy members do.
    healthy_mean = (sum(sm.core.counters["alerts_raised"] for sm in result.healthy)
                    / len(result.healthy))
    busy_alerts = [sm.core.counters["alerts_raised"] for sm in result.busy]
    assert max(busy_alerts) < healthy_mean, (busy_alerts, healthy_mean)
    assert result.checker.violations == []


@XFAIL_3S
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_s01_busy_members_ci(seed: int) -> None:
    assert_s01_holds(run_s01(seed, CI_HORIZON_S, SCENARIO_CHUNK_S))


@XFAIL_3S
@pytest.mark.slow
def test_s01_busy_members_full_10_minutes() -> None:
    assert_s01_holds(run_s01(0, FULL_HORIZON_S, SCENARIO_CHUNK_S))


@pytest.mark.parametrize("seed", [0, 1])
def test_s01_with_blocks_the_protocol_tolerates_today(seed: int) -> None:
    """The same scenario with chunks of 0.8-2 s: everything must hold already."""
    assert_s01_holds(run_s01(seed, CI_HORIZON_S, TOLERATED_CHUNK_S))
