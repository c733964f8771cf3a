"""False removals at 5 % uniform loss: the CI-sized version of benchmarks/false_removals.py.

Issue 3 asks for 0 false removals over at least 1,000 simulated member-hours at 5 % loss; that
long run is ``python -m benchmarks.false_removals --member-hours 1000 --loss 0.05`` (outside CI).
Here: one 64-member cluster for 10 virtual minutes (~10.7 member-hours), same code path.
"""

from __future__ import annotations

from benchmarks.false_removals import run


def test_no_false_removal_at_5_percent_loss() -> None:
    # Seed 2: at this size about one seed in three sees a suspicion in 10 minutes at 5 % loss;
    # this one does (the last assertion), so the run shows suspicions raised and cleared.
    out = run(member_hours=10.0, loss=0.05, members=64, horizon_s=600.0, jobs=1, first_seed=2)
    assert out["member_hours"] >= 10.0
    assert out["false_removals"] == 0, out["false_removal_list"]
    assert out["invariant_violations"] == 0, out["first_violations"]
    assert out["suspicions"] > 0  # the loss was real: members were suspected, and cleared
