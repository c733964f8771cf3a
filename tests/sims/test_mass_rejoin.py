"""A mass rejoin, in the simulator, through ``sims/scenarios/mass_rejoin.toml`` (issue 32, item 2).

48 ranks and 16 spares at 5 % loss; at 10 s 31 members crash at once and come back as new
processes within 2 s (``restart``). 33 survive: a majority of 64 but no fast quorum (49), so
every change until the dead are removed is decided in a classic round.

Must hold, in each of 20 seeds: every new process is admitted within 10 s of the crash it
replaces (``rejoin_p99_s``, virtual seconds), no decided change is empty (nothing removed,
nothing admitted), every crashed member is removed, nobody else is, and the live members end in
one configuration.

Why it holds: a cut admits as many joiners as one datagram holds (``sizes.cut_budget``: all 31
here) instead of four; joiners are admitted while the crashes are still being convicted (a
cut of joiners alone does not wait for unstable subjects) and as soon as a member has voted,
for the members it still holds alive cannot make a fast quorum; a member learns joiners from
any vote or ``Accept`` that names them, not only from the ``Join`` flood, half of whose
targets are dead; and a classic round whose coordinator has nothing to propose holds instead
of deciding the empty cut.
"""

from __future__ import annotations

import pytest

from sims.scenario import load_scenario, run_scenario

SCENARIO = load_scenario("mass_rejoin")
SEEDS = range(1, 21)
REJOIN_S = 10.0
"""Issue 32: every restarted process back within 10 s of the crash it replaces."""


@pytest.mark.parametrize("seed", SEEDS)
def test_a_mass_rejoin_is_admitted_within_10_s_and_decides_no_empty_change(seed: int) -> None:
    result = run_scenario(SCENARIO, seed=seed)
    assert result["restarts"] == result["rejoined"] == 31
    assert result["rejoin_p99_s"] <= REJOIN_S, result
    assert result["empty_changes"] == 0
    # The 31 crashes: each detected by all and removed, nobody else; 33 + 31 members live.
    assert result["faults"] == result["detected_by_all"] == 31
    assert result["decided_all_p99_s"] is not None
    assert result["false_removals"] == 0
    assert result["live_members"] == 64 and result["views_final"] == 1
    assert result["safety_violations"] == result["invariant_violations"] == 0
    # Fewer changes than the 8 of at most 4 joiners each: the joiners in one or two, the
    # removal, and a straggler.
    assert 2 <= result["decisions"] <= 5
