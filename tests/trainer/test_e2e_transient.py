"""A transient collective failure end to end (issue #7): no process dies, so no configuration
change comes; the ranks regroup in the same configuration and train on.

Four ranks and two spares train the example language model (the settings and fault-free run of
:mod:`.test_e2e`) for 57 steps. Rank 1's collective fails at step 20 before its last bucket and
vote leave, and rank 0's (the host of every rendezvous store) at step 40 once the votes are in
but before it took the averaged gradient (``reset`` faults,
:mod:`torchpass_p2p.trainer.faults`): each abandons its group as after a failed collective,
which makes its peers' operations fail too (at step 40 in step 41: they committed 40). Must
hold: every rank logs the failure (the peers from gloo itself); no configuration change, no
spare promoted, no process exits before the end; every rank regroups (attempt 1, then 2) and
resumes at the same step, the one after the last step anyone committed (no step lost, none run
twice): 20 (all redo it), then 41 (rank 0 rolls forward with the gradient handed to it); the
end state is bitwise equal to the fault-free run's.

Timings are not asserted (2 shared cores). The launch limit is what catches a rank whose
collective failed with nobody dead waiting 600 s for a configuration change and then exiting,
far past :data:`RUN_LIMIT_S`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from examples.main_job import Run, run_job
from tests.trainer.settings import ARGS
from tests.trainer.test_e2e_s04_s13 import assert_same_end_state, members_of
from torchpass_p2p.trainer.regroup import GIVE_UP_S
from torchpass_p2p.trainer.timeline import recoveries

STEPS = 57
FAULTS = "reset@20:grad:rank=1,reset@40:commit:rank=0"
RUN_LIMIT_S = GIVE_UP_S / 3
"""200 s per launch (a fault-free launch takes well under half of it here): the old wait of
:data:`GIVE_UP_S` for a configuration change after the first fault overruns it
(``subprocess.TimeoutExpired``)."""


@pytest.fixture(scope="module")
def clean(clean_run: Callable[[int], Run]) -> Run:
    return clean_run(STEPS)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_transient_failures_regroup_in_the_same_configuration(tmp_path: Path,
                                                              clean: Run) -> None:
    faulty = run_job(tmp_path / "faults", nproc=4, spares=2, steps=STEPS, faults=FAULTS,
                     script_args=ARGS, timeout_s=RUN_LIMIT_S)
    assert faulty.code == 0, faulty.diagnosis()
    events = faulty.events

    # The two faults fired, and no configuration change followed either.
    faults = [r for r in events if r["event"] == "fault"]
    assert [(r["kind"], r["step"], r["point"], r["rank"]) for r in faults] == [
        ("reset", 20, "grad", 1), ("reset", 40, "commit", 0)]
    assert [f.config_id for f in recoveries(events)] == [None, None]
    assert not [r for r in events if r["event"] == "change"]
    assert not [r for r in events if r["event"] in ("state_fetched", "fetch_started",
                                                    "removed", "recovery_restarted",
                                                    "regroup_failed", "superseded")]
    ranks = members_of(events, 0)
    assert sorted(ranks) == [0, 1, 2, 3]
    assert all(r["config_id"] == 0 for r in events if "config_id" in r)
    # No spare ever held a rank; every rank trained to the end in its rank.
    started = {r["member"]: r["role"] for r in events if r["event"] == "start"}
    assert sorted(started.values()) == ["rank"] * 4 + ["spare"] * 2
    assert {m for m, role in started.items() if role == "rank"} == set(ranks.values())
    assert {(r["rank"], r["member"]) for r in faulty.finals} == set(ranks.items())
    finished = [r for r in events if r["event"] == "finished"]
    assert sorted(r["member"] for r in finished) == sorted(ranks.values())

    for fault, attempt in zip(faults, (1, 2), strict=True):
        k = fault["step"]
        # At "grad" the faulty rank's last bucket and vote never left: nobody committed step
        # k. At "commit" the votes were in: its peers committed k and failed in step k + 1.
        resume = k if fault["point"] == "grad" else k + 1
        # Every rank's collective failed: the faulty one's by the injection, its peers'
        # because it dropped its group (gloo's own errors).
        failed = [r for r in events if r["event"] == "collective_failed"
                  and r["step"] == (k if r["member"] == fault["member"] else resume)]
        assert sorted(r["member"] for r in failed) == sorted(ranks.values())
        assert all(("injected" in r["error"]) == (r["member"] == fault["member"])
                   for r in failed)
        # Every rank regrouped once, with the same attempt, and resumed at the same step:
        # the one after the last step anyone committed (no step lost). The faulty rank,
        # behind at "commit", was handed step k's averaged gradient and rolled forward.
        started_rg = [r for r in events if r["event"] == "regroup_started"
                      and r["attempt"] == attempt]
        done = [r for r in events if r["event"] == "regroup_done" and r["attempt"] == attempt]
        assert sorted(r["member"] for r in started_rg) == sorted(ranks.values())
        assert {(r["rank"], r["member"]) for r in done} == set(ranks.items())
        assert {r["resume_step"] for r in done} == {resume}
        assert {r["action"] for r in done if r["member"] != fault["member"]} == {"redo"}
        rolled = "redo" if resume == k else "roll_forward"
        assert [r["action"] for r in done if r["member"] == fault["member"]] == [rolled]
        assert len({r["fingerprint"] for r in done}) == 1
        first = min(r["t"] for r in started_rg)
        committed = [r["step"] for r in events if r["event"] == "step" and r["t"] < first]
        assert max(committed) + 1 == resume
    assert len([r for r in events if r["event"] == "regroup_done"]) == 8

    # Each rank committed every step exactly once, all in configuration 0 ...
    for member in ranks.values():
        steps = [r["step"] for r in events if r["event"] == "step" and r["member"] == member]
        assert steps == list(range(STEPS))
    # ... and ended bitwise equal to the fault-free run.
    assert_same_end_state(clean, faulty)
    assert all(sorted(map(int, r["losses"])) == list(range(STEPS)) for r in faulty.finals)
