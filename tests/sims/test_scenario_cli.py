"""Scenario files, ``python -m sims run`` and ``python -m sims report`` (issue 3, item 5).

Runs are small (tens of members, tens of virtual seconds) so every test stays within seconds.
The golden event count pins the whole simulation: if a change to the core, the network or the
engine moves it, the change altered behaviour (or the order of random draws) and the value must
be updated on purpose.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from sims.report import main as report_main
from sims.run_cli import main as run_main
from sims.scenario import (
    SCENARIO_DIR,
    ScenarioError,
    load_scenario,
    run_scenario,
    scenario_from_mapping,
)
from sims.scenario_faults import FAULT_KINDS

SMALL = {
    "name": "small",
    "members": 32,
    "spares": 2,
    "virtual_s": 20.0,
    "seed": 3,
    "warmup_s": 2.0,
    "link": {"loss": 0.01},
    "faults": [{"kind": "crash", "member": "random", "at": 5.0}],
}
SMALL_EVENTS_SEED_3 = 19_631
"""Golden: engine events of SMALL with seed 3 (with agreement: votes, decision, progress;
vote pushes every 25 ms; cut detection rechecked when a window ends)."""

REQUIRED_KEYS = {
    "members", "virtual_s", "wall_s", "events", "events_per_s", "detect_first_p50_s",
    "detect_all_p50_s", "detect_all_p99_s", "false_removals", "bytes_per_member_per_s",
    "packets_per_member_per_s", "invariant_violations", "decided_all_p50_s", "decided_all_p99_s",
    "fast_path_fraction", "empty_changes", "safety_violations",
}
UNTIMED = ("wall_s", "events_per_s")


def _without_timing(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in UNTIMED}


def test_same_seed_gives_the_same_result_and_the_pinned_event_count() -> None:
    scenario = scenario_from_mapping(SMALL)
    first = run_scenario(scenario, series=True)
    second = run_scenario(scenario, series=True)
    assert _without_timing(first) == _without_timing(second)
    assert first["events"] == SMALL_EVENTS_SEED_3
    assert first["faults"] == first["detected_by_all"] == 1
    assert first["live_members"] == 31 and first["false_removals"] == 0
    assert 0 < first["detect_first_p50_s"] <= first["detect_all_p50_s"] < 8.5
    assert len(first["series"]["t_s"]) == 20
    other = run_scenario(scenario, seed=4)
    assert other["events"] != first["events"]
    assert other["seed"] == 4


def test_repeated_crashes_hit_distinct_members_and_all_are_detected() -> None:
    data = dict(SMALL, virtual_s=30.0,
                faults=[{"kind": "crash", "member": "random", "at": 4.0,
                         "repeat_every_s": 8.0, "count": 3}])
    result = run_scenario(scenario_from_mapping(data), series=True)
    assert result["faults"] == result["detected_by_all"] == 3
    victims = [index for _, _, index in result["series"]["faults"]]
    assert len(set(victims)) == 3
    # 3 faults x 29 live members, every pair knew.
    assert len(result["series"]["detect_member_s"]) == 87
    assert result["detect_member_p99_s"] is not None


def test_every_fault_kind_runs() -> None:
    faults = [
        {"kind": "crash", "member": 0, "at": 2.0},
        {"kind": "hang", "member": "rank:1", "at": 2.0},
        {"kind": "one_way", "member": "spare:0", "at": 2.0, "direction": "deaf"},
        {"kind": "pause", "member": [3, 4], "at": 2.0, "duration_s": 0.5,
         "repeat_every_s": 2.0, "count": 2},
        {"kind": "clog", "member": "random", "at": 3.0, "duration_s": 0.3},
        {"kind": "gray", "member": "random:2", "at": 2.0, "loss": 0.2},
        {"kind": "busy", "member": "random", "start": 1.0, "until": 6.0,
         "chunk_s": [0.2, 0.4], "duty": 0.3},
        {"kind": "host_failure", "host": "random", "at": 4.0, "gpus_per_host": 4},
        {"kind": "partition", "side_a": "fraction:0.25", "at": 5.0, "heal_at": 6.0},
        {"kind": "arrivals", "rate_per_gpu_hour": 60.0, "start": 1.0, "until": 7.0},
        {"kind": "delay", "member": "random", "at": 2.0, "duration_s": 1.0, "delay_s": 0.3,
         "messages": "acks"},
        {"kind": "restart", "member": "random", "at": 2.0, "after_s": 1.0, "lost_joins": 1},
    ]
    scenario = scenario_from_mapping(dict(SMALL, virtual_s=8.0, faults=faults))
    result = run_scenario(scenario, series=True)
    kinds = {kind for _, kind, _ in result["series"]["faults"]}
    assert {"crash", "hang", "one_way_deaf", "pause", "clog", "gray", "partition", "delay_acks",
            "restart"} <= kinds
    # crash + hang + one-way + the host's 4 + the arrivals (a Poisson draw, seeded).
    assert result["faults"] >= 7


def test_member_override_scales_spares() -> None:
    result = run_scenario(scenario_from_mapping(dict(SMALL, virtual_s=3.0, faults=[])),
                          members=16)
    assert (result["members"], result["spares"]) == (16, 1)
    assert result["faults"] == 0 and result["detect_all_p50_s"] is None


@pytest.mark.parametrize(("patch", "message"), [
    ({"memebers": 3}, "unknown key 'memebers'"),
    ({"link": {"los": 0.1}}, "unknown key 'link.los'"),
    ({"params": {"probe": {"probe_intervall_s": 1.0}}}, "probe.probe_intervall_s"),
    ({"params": {"probes": {}}}, "unknown table 'probes'"),
    ({"faults": [{"kind": "crash", "member": 1, "at": 5.0, "when": 2}]},
     "unknown key 'faults[0].when'"),
    ({"faults": [{"kind": "crsh", "member": 1, "at": 5.0}]}, "did you mean 'crash'"),
    ({"faults": [{"kind": "crash", "at": 5.0}]}, "missing key 'faults[0].member'"),
    ({"faults": [{"kind": "crash", "member": "somebody", "at": 5.0}]},
     "is not a member selector"),
    ({"faults": [{"kind": "crash", "member": 1, "at": 50.0}]}, "outside"),
    ({"faults": [{"kind": "crash", "member": 1, "at": 5.0, "repeat_every_s": 1.0,
                  "count": 3}]}, "needs member = \"random\""),
    ({"members": 32.0}, "expected an int"),
    ({"warmup_s": 20.0}, "leaves nothing to measure"),
])
def test_bad_scenarios_name_the_key(patch: dict, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        scenario_from_mapping(dict(SMALL, **patch), source="t.toml")
    assert message in str(info.value)
    assert "t.toml" in str(info.value)


def test_selector_out_of_range_fails_when_read_and_at_run_time() -> None:
    with pytest.raises(ScenarioError, match="'faults\\[0\\].member' in t.toml: member index 40 "
                                            "does not exist \\(32 members: 0-31\\)"):
        scenario_from_mapping(dict(SMALL, faults=[{"kind": "crash", "member": 40, "at": 5.0}]),
                              source="t.toml")
    # Within the file's 32 members, beyond the 16 of a --members override.
    scenario = scenario_from_mapping(
        dict(SMALL, faults=[{"kind": "crash", "member": 20, "at": 5.0}]))
    with pytest.raises(ScenarioError, match="member index 20 is out of range"):
        run_scenario(scenario, members=16)


def test_every_shipped_scenario_loads() -> None:
    names = sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))
    assert {"crash", "crash_16k", "crashes", "quiet_lossy", "host_failure", "partition",
            "gray"} <= set(names)
    kinds = set()
    for name in names:
        scenario = load_scenario(name)
        assert scenario.name == name and scenario.description
        kinds.update(f.kind for f in scenario.faults)
    assert kinds <= set(FAULT_KINDS)


def _tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text('name = "tiny"\nmembers = 16\nvirtual_s = 8.0\nwarmup_s = 1.0\n'
                    '[link]\nloss = 0.01\n'
                    '[[faults]]\nkind = "crash"\nmember = "random"\nat = 2.0\n')
    return path


def test_cli_run_json_prints_one_object_with_every_required_key(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "sims", "run", str(_tiny(tmp_path)), "--json",
                          "--seed", "5", "--series", str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    assert REQUIRED_KEYS <= set(result)
    assert result["members"] == 16 and result["seed"] == 5 and "series" not in result
    saved = json.loads((tmp_path / "s.json").read_text())
    assert _without_timing({k: v for k, v in saved.items() if k != "series"}) == \
        _without_timing(result)
    assert len(saved["series"]["views"]) == 8


def test_cli_run_prints_a_table_without_json(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main([str(_tiny(tmp_path)), "--members", "12"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("scenario tiny\n")
    assert "  members " in out and " 12" in out
    assert "detect_all_p50_s" in out and "false_removals" in out


def test_cli_run_rejects_a_bad_scenario(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("members = 16\nvirtual_s = 8.0\ncolour = 1\n")
    out = subprocess.run([sys.executable, "-m", "sims", "run", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "unknown key 'colour'" in out.stderr


def test_report_writes_the_three_plots(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert report_main([str(_tiny(tmp_path)), "--seeds", "2", "--out",
                        str(tmp_path / "out")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert pngs == ["tiny_bytes.png", "tiny_detection_cdf.png", "tiny_views.png"]
    for name in pngs:
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "seed 0" in capsys.readouterr().out


def test_steady_bytes_are_the_median_second_and_flat_in_members() -> None:
    # A change costs O(N) bytes per member for a few seconds (N-bit vote and progress
    # bitmaps), which lifts the whole-run mean with N; a typical second's cost (probes,
    # acks, gossip: K = 10 observers and log N retransmits) does not grow with N.
    data = dict(SMALL, virtual_s=16.0, count_bytes=True)
    small = run_scenario(scenario_from_mapping(dict(data, members=64)), series=True)
    large = run_scenario(scenario_from_mapping(dict(data, members=512)), series=True)
    for run in (small, large):
        series = run["series"]
        seconds = [b for t, b in zip(series["t_s"], series["bytes_per_member_per_s"], strict=True)
                   if t > data["warmup_s"]]
        assert run["steady_bytes_per_member_per_s"] == round(statistics.median(seconds), 3)
        assert run["steady_bytes_per_member_per_s"] < run["bytes_per_member_per_s"]
    ratio = large["steady_bytes_per_member_per_s"] / small["steady_bytes_per_member_per_s"]
    assert 0.9 < ratio < 1.15
    assert (large["bytes_per_member_per_s"] - large["steady_bytes_per_member_per_s"]
            > small["bytes_per_member_per_s"] - small["steady_bytes_per_member_per_s"])
