"""benchmarks.vs_ddp: the run order, the ratios, the model sizes, and one short run of the small
model under the three launches (figures only: no timing target is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.ddp_worker import parameters, thread_cpu_s
from benchmarks.vs_ddp import METHODS, Run, order, summarize

REPO = Path(__file__).resolve().parents[2]


def _run(method: str, size: str, step_s: float,
         threads: dict[str, float] | None = None) -> Run:
    return Run(method, size, step_s, step_s / 2, 10.0, (step_s,), threads or {})


def test_each_method_takes_each_place_once_in_three_rounds() -> None:
    assert order(0) == METHODS
    rounds = [order(i) for i in range(3)]
    for place in range(len(METHODS)):
        assert sorted(r[place] for r in rounds) == sorted(METHODS)
    assert order(3) == order(0)
    four = ("torch", "exact", "native", "torch_hook")
    assert [order(i, four) for i in range(4)] == [
        four, ("exact", "native", "torch_hook", "torch"),
        ("native", "torch_hook", "torch", "exact"), ("torch_hook", "torch", "exact", "native")]


def test_ratios_are_medians_of_the_per_round_ratios() -> None:
    # torch's step halves over the rounds while exact's stays: the per-round ratios are 1, 2, 4
    runs = [[_run("native", "small", 1.0), _run("torch", "small", t), _run("exact", "small", 1.0)]
            for t in (1.0, 0.5, 0.25)]
    out = summarize(runs, ["small"])
    assert [r["small"]["ratio_exact"] for r in out["per_round"]] == [1.0, 2.0, 4.0]
    assert out["step_ratio_exact_small"] == 2.0
    assert out["step_ratio_native_small"] == 2.0
    assert out["cpu_ratio_exact_small"] == 2.0
    assert out["step_ratio_exact_large"] is None and out["step_ratio_native_large"] is None
    assert out["median_step_s"] == {"small": {"torch": 0.5, "exact": 1.0, "native": 1.0}}
    assert out["median_cpu_step_s"]["small"]["torch"] == 0.25
    assert out["wall_s"]["small"]["exact"] == 10.0
    assert [r["order"] for r in out["per_round"]] == [list(order(i)) for i in range(3)]


def test_an_optional_method_is_ratioed_against_torch_and_threads_are_medians() -> None:
    methods = ("torch", "native", "torch_hook")
    runs = [[_run("torch", "large", 1.0, {"MainThread": 0.3}),
             _run("native", "large", 1.1, {"MainThread": 0.3, "torchpass-agent": a}),
             _run("torch_hook", "large", h)] for a, h in ((0.01, 0.9), (0.03, 1.0), (0.02, 1.2))]
    out = summarize(runs, ["large"], methods)
    assert out["step_ratio_torch_hook_large"] == 1.0
    assert out["step_ratio_native_large"] == 1.1
    assert "step_ratio_exact_large" not in out
    assert out["thread_cpu_step_s"]["large"] == {
        "torch": {"MainThread": 0.3}, "native": {"MainThread": 0.3, "torchpass-agent": 0.02},
        "torch_hook": {}}
    assert [r["order"] for r in out["per_round"]] == [list(order(i, methods)) for i in range(3)]


def test_thread_cpu_counts_a_busy_thread_under_its_name() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    before = thread_cpu_s()
    worker = threading.Thread(target=spin, name="busy-bench-thread")
    worker.start()
    seen: dict[str, float] = {}
    try:  # read while it runs: an ended thread leaves /proc/self/task
        deadline = time.monotonic() + 30.0
        while seen.get("busy-bench-thread", 0.0) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.02)
            seen = thread_cpu_s()
    finally:
        stop.set()
        worker.join()
    assert "busy-bench-thread" not in before
    assert seen["busy-bench-thread"] >= 0.05
    assert seen["MainThread"] >= before["MainThread"]


def test_model_sizes() -> None:
    assert 80_000 <= parameters("small") <= 120_000
    assert 24_000_000 <= parameters("large") <= 26_000_000


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_short_round_of_the_small_model() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_ddp", "--json", "--rounds", "1", "--steps", "4",
         "--warmup", "1", "--sizes", "small", "--methods", "torch,exact,native,torch_hook"],
        cwd=REPO, capture_output=True, timeout=550, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out = json.loads(proc.stdout)
    methods = [*METHODS, "torch_hook"]
    for method in methods[1:]:
        for kind in ("step", "cpu"):
            assert out[f"{kind}_ratio_{method}_small"] > 0
            assert out[f"{kind}_ratio_{method}_large"] is None
    for key in ("median_step_s", "median_cpu_step_s", "wall_s"):
        assert list(out[key]) == ["small"]
        assert all(out[key]["small"][m] > 0 for m in methods)
    assert all("MainThread" in out["thread_cpu_step_s"]["small"][m] for m in methods)
    assert out["job"]["sizes"]["small"]["steps"] == 4
    assert out["job"]["sizes"]["small"]["parameters"] == parameters("small")
    (only,) = out["per_round"]
    assert only["order"] == methods
    assert out["job"]["methods"] == methods
    assert set(out["targets"]) == {"step_ratio_exact", "step_ratio_native"}
