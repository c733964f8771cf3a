"""A scenario's fleet with its faults scheduled, for tests that watch its events themselves."""

from __future__ import annotations

import dataclasses

from sims.cluster import Cluster
from sims.faults import FaultInjector
from sims.recorder import DetectionRecorder
from sims.safety import SafetyChecker
from sims.scenario import Scenario
from sims.scenario_faults import schedule_faults


def scenario_fleet(scenario: Scenario, seed: int) -> tuple[Cluster, DetectionRecorder,
                                                            SafetyChecker]:
    """The scenario's members and spares under ``seed``, its link (a copy: faults change it),
    a detection recorder and a safety checker attached, and its faults scheduled."""
    cluster = Cluster(scenario.members, spares=scenario.spares, seed=seed,
                      params=scenario.params, link=dataclasses.replace(scenario.link),
                      keep_events=False)
    recorder = DetectionRecorder(cluster)
    safety = SafetyChecker(cluster)
    schedule_faults(scenario, FaultInjector(cluster, recorder))
    return cluster, recorder, safety
