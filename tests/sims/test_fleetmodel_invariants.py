"""Invariants of the job-level model over seeds, and its command line.

The accounting must stay exact (wall = work + every lost second, by cause); a job without
failures pays only its step ratio and its checkpoint writes; a recovery never costs more than
its phases; an empty spare pool makes rank replacement wait; the same seed gives the same run.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from sims.__main__ import main as sims_main
from sims.fleetmodel import scenarios as sc
from sims.fleetmodel.costs import Method, default_methods, transfer_s
from sims.fleetmodel.decided import DecidedLatency
from sims.fleetmodel.failures import FailureModel, category_mix, default_model
from sims.fleetmodel.simulate import simulate
from sims.fleetmodel.sources import Sourced

SEEDS = range(1, 11)


def _methods() -> list[Method]:
    return default_methods()


@pytest.mark.parametrize("arrivals", ["exponential", "weibull"])
@pytest.mark.parametrize("software_scope", ["job", "gpu"])
def test_wall_time_is_work_plus_every_lost_second(arrivals: str, software_scope: str) -> None:
    job = sc.reference_job(4096, days=10.0, spare_fraction=0.005, repair_h=48.0)
    failures = default_model("high", arrivals=arrivals, software_scope=software_scope)
    for method in _methods():
        for seed in SEEDS:
            r = simulate(job, method, failures, seed)
            assert r.wall_s == pytest.approx(r.work_s + sum(r.lost_s.values()), rel=1e-9)
            assert all(v >= 0 for v in r.lost_s.values())
            assert 0 < r.ettr < 1 and r.spares_min >= 0
            if software_scope == "gpu":
                assert r.failures["job"] == 0


def test_without_failures_a_job_pays_its_step_ratio_and_its_checkpoints() -> None:
    job = sc.reference_job(1024, days=2.0)
    never = FailureModel(Sourced(1e-30, "failures per GPU-hour", "none"))
    cr, rg, tp = _methods()
    r = simulate(job, tp, never, 1)
    assert r.wall_s == pytest.approx(job.work_s * tp.ratio, rel=1e-9)
    assert r.lost_s["step_overhead"] == pytest.approx(job.work_s * (tp.ratio - 1), rel=1e-9)
    fixed = replace(cr.restart, interval_s=3600.0)
    r = simulate(job, replace(cr, restart=fixed), never, 1)
    writes = math.ceil(job.work_s / 3600.0) - 1  # none at the very end
    assert r.lost_s["checkpoint_write"] == pytest.approx(writes * fixed.write.value)
    assert r.wall_s == pytest.approx(job.work_s + writes * fixed.write.value)


def test_a_rank_replacement_costs_no_more_than_its_phases_and_one_step() -> None:
    job = sc.reference_job(16384, days=5.0)
    failures = default_model(software_scope="gpu")
    tp = _methods()[2]
    assert tp.torchpass is not None
    costs = tp.torchpass
    per_failure = (costs.decided.at(job.gpus, "host") + transfer_s(job, costs.receiver)
                   + costs.rejoin.value + job.step_s)
    for seed in SEEDS:
        r = simulate(job, tp, failures, seed)
        n = r.failures["gpu"] + r.failures["host"]
        recovery = sum(r.lost_s[c] for c in ("redo", "decision", "transfer", "rejoin"))
        assert n > 0 and 0 < recovery <= n * per_failure
        assert r.lost_s["spare_wait"] == 0 and r.lost_s["lost_work"] == 0
        assert r.checkpoint_interval_s is None  # nothing sends it back to a checkpoint


def test_an_empty_spare_pool_makes_replacement_wait_for_repairs() -> None:
    failures = default_model(software_scope="gpu")
    tp = _methods()[2]
    with_spares = sc.reference_job(16384, days=5.0, spare_fraction=0.02)
    without = sc.reference_job(16384, days=5.0, spare_fraction=0.0)
    for seed in range(1, 6):
        a = simulate(with_spares, tp, failures, seed)
        b = simulate(without, tp, failures, seed)
        assert a.lost_s["spare_wait"] == 0 and a.spares_min > 0
        # Every replacement waits for the failed hardware's own repair (2.2 h).
        n = b.failures["gpu"] + b.failures["host"]
        assert b.spares_min == 0 and b.lost_s["spare_wait"] > 0.5 * n * without.repair_s
        assert b.ettr < a.ettr


def test_no_other_holder_of_the_state_sends_every_failure_to_the_checkpoint() -> None:
    job = replace(sc.reference_job(4096, days=5.0), state_holders=1)
    tp = _methods()[2]
    for seed in range(1, 6):
        r = simulate(job, tp, default_model(), seed)
        assert r.lost_s["transfer"] == r.lost_s["decision"] == 0
        assert r.lost_s["restart"] > 0 and r.lost_s["lost_work"] > 0


def test_the_same_seed_gives_the_same_run_and_methods_share_failures() -> None:
    job = sc.reference_job(8192, days=5.0)
    failures = default_model(arrivals="weibull")
    tp = _methods()[2]
    assert simulate(job, tp, failures, 3) == simulate(job, tp, failures, 3)
    assert simulate(job, tp, failures, 3) != simulate(job, tp, failures, 4)
    # Common random numbers: a seed's failure stream does not depend on the method.
    s1 = failures.stream(job.gpus, random.Random("fleetmodel-3"))
    s2 = failures.stream(job.gpus, random.Random("fleetmodel-3"))
    assert [next(s1) for _ in range(20)] == [next(s2) for _ in range(20)]


def test_failure_mix_is_llama3_by_count() -> None:
    mix = category_mix()
    assert sum(mix.values()) == pytest.approx(1.0)
    assert mix["gpu"] == pytest.approx((268 + 7) / 419)
    assert mix["host"] == pytest.approx((35 + 21 + 32) / 419)
    assert mix["job"] == pytest.approx(56 / 419)
    assert category_mix("gpu")["job"] == 0


def test_weibull_arrivals_keep_the_mean_rate() -> None:
    model = default_model(arrivals="weibull", weibull_shape=0.6)
    stream = model.stream(16384, random.Random(7))
    times = [next(stream).at_s for _ in range(20000)]
    assert times[-1] / len(times) == pytest.approx(model.mean_gap_s(16384), rel=0.05)


def test_decided_latency_interpolates_and_never_falls_beyond_the_table() -> None:
    d = DecidedLatency.load()
    for scope, rows in d.points.items():
        for n, s in rows:
            assert d.at(n, scope) == pytest.approx(s)
        assert d.at(rows[0][0] // 2, scope) == rows[0][1]
        assert d.at(100_000, scope) >= rows[-1][1]
        assert d.at(100_000, scope) < 10 * rows[-1][1]
    assert d.at(16384, "job") == 0.0
    assert d.largest >= 256


def test_cli_prints_each_method_with_ettr_time_and_lost_time(capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    assert sims_main(["jobmodel", "--gpus", "1024", "--days", "3", "--seeds", "2", "--json",
                      "--sources"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["method"] for m in out["methods"]] == ["checkpoint_restart", "replica_group",
                                                     "torchpass_p2p"]
    for m in out["methods"]:
        assert 0 < m["ettr"] < 1 and m["time_to_train_h"] > 72
        assert set(m["lost_h"]) >= {"step_overhead", "lost_work", "decision", "transfer"}
    assert any("docs/benchmarks.md" in s["source"] for s in out["sources"])
    assert sims_main(["jobmodel", "--gpus", "1024", "--days", "1", "--seeds", "1"]) == 0
    assert "torchpass_p2p" in capsys.readouterr().out
    assert sims_main(["jobmodel", "--overhead", "nope"]) == 2


def test_report_writes_the_three_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sims.fleetmodel import plots

    monkeypatch.setattr(plots, "GPUS", (1024, 4096))
    monkeypatch.setattr(plots, "SPARE_FRACTIONS", (0.0, 0.02))
    monkeypatch.setattr(plots, "REFERENCE_GPU_DAYS", 4096 * 2.0)
    assert sims_main(["report", "jobmodel", "--out", str(tmp_path), "--seeds", "1"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["jobmodel_ettr_vs_gpus.png", "jobmodel_ettr_vs_spares.png",
                     "jobmodel_time_vs_gpus.png"]
    assert all((tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
