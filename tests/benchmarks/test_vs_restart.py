"""benchmarks.vs_restart: Young's interval, the baseline's checkpoints, and one short run of the
whole comparison (20 steps of a model whose gradient is averaged in shards, one SIGKILL at
step 7)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.restart_worker import latest_checkpoint, save_checkpoint
from benchmarks.vs_restart import _timeline_ratios, young_interval_s, young_k_steps
from examples.char_lm import CharLM
from torchpass_p2p.collective.group import SHARDED_MIN_BYTES

REPO = Path(__file__).resolve().parents[2]


def test_young_interval() -> None:
    assert young_interval_s(0.5, 100.0) == 10.0  # sqrt(2 * 0.5 * 100)
    assert young_k_steps(0.5, 100.0, 0.25) == 40
    assert young_k_steps(0.001, 1.0, 10.0) == 1  # never below one step


def test_checkpoints_atomic_and_two_kept(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, {"step": step, "w": torch.full((3,), float(step))})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010.pt",
                                                          "step-00000015.pt"]
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and torch.load(latest)["step"] == 15


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_comparison() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_restart", "--json", "--steps", "20",
         "--faults", "kill@7:grad:rank=1", "--dim", "192", "--layers", "1", "--batch", "8"],
        cwd=REPO, capture_output=True, timeout=850, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out = json.loads(proc.stdout)
    tp, tr, ft = out["torchpass_p2p"], out["torchrun"], out["torchft"]
    assert tp["steps_lost"] == 0 and tp["restarts"] == 0
    assert tp["final_weights_equal_fault_free"] is True
    assert tr["completed"] and tr["restarts"] == 1
    assert tr["faults"][0]["resume_step"] <= 7
    # the model size reached every method: the same bits without faults need the same model;
    # its gradient is large enough for the sharded mean in both launchers
    model = CharLM(context=64, dim=192, heads=4, layers=1)
    assert out["job"]["model"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert 4 * out["job"]["model"]["parameters"] > SHARDED_MIN_BYTES
    # the same loop, arithmetic and data under both launchers: the same bits without faults
    assert out["fault_free_weights_equal_across_methods"] is True
    young = out["young"]
    mean_time_between_faults = young["mtbf_s"]
    assert young["k_steps"] >= 1 and mean_time_between_faults > 0
    assert out["speedup_vs_torchrun"] > 0
    for method in (tp, tr):  # one repeat: its own pair of runs
        (lost,) = method["time_lost_per_fault_s_per_repeat"]
        assert method["time_lost_per_fault_s"] == lost
        assert lost == pytest.approx(method["wall_s"] - method["fault_free_wall_s"], abs=1e-3)
    (kill,) = out["recovery_by_fault"]
    assert kill["kind"] == "kill" and kill["step"] == 7
    assert kill["torchpass_p2p_s"] == tp["faults"][0]["resumed_s"]
    assert kill["torchrun_s"] == tr["faults"][0]["back_at_fault_step_s"]
    assert kill["torchft_next_commit_s"] == (ft["faults"][0]["next_step_committed_s"]
                                             if "faults" in ft else None)
    assert ft["ran"] is False and ft["reason"] or ft["completed"]


def test_timeline_ratios_are_means_over_the_faults() -> None:
    rows = [{"torchpass_p2p_s": 0.5, "torchrun_s": 5.0, "torchft_next_commit_s": 10.0},
            {"torchpass_p2p_s": 1.5, "torchrun_s": 17.0, "torchft_next_commit_s": 6.0}]
    out = _timeline_ratios(rows)
    assert out["lost_per_fault_by_timeline_s"] == {"torchpass_p2p": 1.0, "torchrun": 11.0,
                                                   "torchft": 8.0}
    assert out["lost_per_fault_ratio_torchrun_by_timeline"] == 11.0
    assert out["lost_per_fault_ratio_torchft_by_timeline"] == 8.0
    rows[1]["torchft_next_commit_s"] = None  # torchft did not run or missed a fault
    assert _timeline_ratios(rows)["lost_per_fault_ratio_torchft_by_timeline"] is None
