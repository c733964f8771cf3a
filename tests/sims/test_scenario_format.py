"""Scenario-file keys for partly broken networks, mass events and joins (issue 32, item 7).

Each key is shown to have its effect in a simulated run, against the same run without it:
duplicate deliveries with several copies, a member's outgoing messages (all, or only acks)
delayed for a window, a restart under a new member id with lost Join datagrams, and a partition
that names the members it is expected to remove. Bad values fail when the file is read, naming
the key. Runs are 16 members and 40 virtual s: a tenth of a second each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sims.scenario import ScenarioError, load_scenario, run_scenario, scenario_from_mapping
from torchpass_p2p.core import Params

BASE: dict[str, Any] = {
    "name": "format",
    "members": 16,
    "spares": 2,
    "virtual_s": 40.0,
    "seed": 1,
    "warmup_s": 2.0,
    "count_bytes": False,
    "check_convergence": True,
}
SEEDS = range(1, 21)
UNTIMED = ("wall_s", "events_per_s")


def run(seed: int, **patch: Any) -> dict[str, Any]:
    return run_scenario(scenario_from_mapping(dict(BASE, seed=seed, **patch)), series=True)


def _untimed(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in UNTIMED}


# ---------------------------------------------------------------- duplicate copies


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_duplicated_datagrams_arrive_one_plus_copies_times(seed: int) -> None:
    # No loss and every datagram duplicated: each arrives exactly 1 + copies times.
    for copies in (1, 3):
        result = run(seed, link={"duplicate": 1.0, "duplicate_copies": copies})
        sent = result["packets_per_member_per_s"]
        assert result["recv_packets_per_member_per_s"] == pytest.approx((1 + copies) * sent,
                                                                        rel=1e-4)
        assert result["false_removals"] == result["invariant_violations"] == 0
    plain = run(seed)
    assert plain["recv_packets_per_member_per_s"] == plain["packets_per_member_per_s"]


def test_default_copies_draw_as_before() -> None:
    # duplicate_copies = 1 draws nothing more: the same trace as a file without the key.
    link = {"loss": 0.01, "duplicate": 0.05}
    assert _untimed(run(4, link=link)) == _untimed(run(4, link=dict(link, duplicate_copies=1)))


# ---------------------------------------------------------------- delayed sends


def _delay(messages: str, **extra: Any) -> list[dict[str, Any]]:
    return [dict({"kind": "delay", "member": 3, "at": 5.0, "duration_s": 20.0, "delay_s": 3.0,
                  "messages": messages}, **extra)]


@pytest.mark.parametrize("seed", SEEDS)
def test_delayed_acks_get_a_member_suspected_and_delayed_sends_get_it_removed(
        seed: int) -> None:
    # Acks 3 s late fail every probe of member 3 (round timeout 0.5 s): its observers suspect
    # it, it refutes in time (its refutations are not acks) and stays. Everything it sends
    # 3 s late, refutations included: it is removed, a false removal unless expected.
    assert run(seed)["suspicions"] == 0
    acks = run(seed, faults=_delay("acks"))
    assert acks["suspicions"] > 0 and acks["refutations"] > 0
    assert (acks["false_removals"], acks["decisions"], acks["live_members"]) == (0, 0, 16)
    every = run(seed, faults=_delay("all"))
    assert (every["false_removals"], every["decisions"], every["live_members"]) == (1, 1, 15)
    expected = run(seed, faults=_delay("all", expected_removal=True))
    assert (expected["faults"], expected["detected_by_all"], expected["false_removals"]) == \
        (1, 1, 0)
    assert ["delay_acks", "delay", "delay"] == [
        r["series"]["faults"][0][1] for r in (acks, every, expected)]


def test_a_delay_below_the_round_timeout_is_absorbed_and_the_window_ends() -> None:
    # 0.3 s late acks still beat the 0.5 s round (indirect probes answer in time); a 3 s delay
    # over a 0.1 s window delays at most the few datagrams sent in it.
    assert run(1, faults=_delay("acks", delay_s=0.3))["suspicions"] == 0
    short = run(1, faults=_delay("all", duration_s=0.1))
    assert short["false_removals"] == short["decisions"] == 0


# ---------------------------------------------------------------- restarts and lost joins


def _restart(**extra: Any) -> list[dict[str, Any]]:
    return [dict({"kind": "restart", "member": 3, "at": 5.0, "after_s": 1.0}, **extra)]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_restart_is_a_detected_crash_and_a_new_member_that_joins(seed: int) -> None:
    join_retry_s = Params().join_retry_s
    plain = run(seed, faults=_restart())
    lost = run(seed, faults=_restart(lost_joins=3))
    for result in (plain, lost):
        assert (result["faults"], result["detected_by_all"], result["false_removals"]) == \
            (1, 1, 0)
        assert (result["restarts"], result["rejoined"]) == (1, 1)
        assert result["live_members"] == 16  # 15 left of the first 16, and the new process
        assert result["invariant_violations"] == 0, result["invariant_examples"]
        kinds = [kind for _, kind, _ in result["series"]["faults"]]
        assert kinds == ["crash", "restart"]
        # The new process is the 17th member, started after_s after the crash.
        assert result["series"]["faults"][1] == [pytest.approx(6.0), "restart", 16]
    assert plain["rejoin_p50_s"] >= 1.0
    # Its first three Joins are lost; the fourth goes out 3 join_retry_s after the first.
    assert lost["rejoin_p50_s"] >= 1.0 + 3 * join_retry_s
    assert lost["rejoin_p50_s"] > plain["rejoin_p50_s"]


def test_a_mass_restart_within_a_window_is_seeded() -> None:
    faults = [{"kind": "restart", "member": "random:5", "at": 5.0, "after_s": [0.5, 2.0]}]
    first = run(2, faults=faults)
    assert _untimed(first) == _untimed(run(2, faults=faults))
    assert (first["faults"], first["restarts"], first["rejoined"]) == (5, 5, 5)
    starts = [t for t, kind, _ in first["series"]["faults"] if kind == "restart"]
    assert len(set(starts)) == 5 and all(5.5 <= t <= 7.0 for t in starts)
    rejoin = first["series"]["rejoin_s"]  # one per restart, from its crash to its admission
    assert len(rejoin) == 5 and all(x is not None and x >= 0.5 for x in rejoin)


# ---------------------------------------------------------------- partitions with expected removals


@pytest.mark.parametrize("seed", SEEDS)
def test_a_partition_that_names_its_expected_removals_counts_them_as_detections(
        seed: int) -> None:
    # 6 | 10: the 10 remove the 6, and the 6, cut off, convict most of the 10 among
    # themselves (each majority member has about 4 of its 10 observers on the small side).
    side = [f"rank:{i}" for i in range(6)]
    cut = {"kind": "partition", "side_a": side, "at": 5.0}
    unnamed = run(seed, faults=[cut])
    assert unnamed["faults"] == 0 and unnamed["false_removals"] > 6
    named = run(seed, faults=[dict(cut, expected_removed=side)])
    assert (named["faults"], named["detected_by_all"], named["false_removals"]) == (6, 6, 0)
    assert named["decided_all_p99_s"] is not None and named["live_members"] == 10
    assert named["invariant_violations"] == 0, named["invariant_examples"]
    kinds = [kind for _, kind, _ in named["series"]["faults"]]
    assert kinds == ["partition"] + ["partition_removal"] * 6


def test_a_partition_cannot_expect_a_member_on_neither_side() -> None:
    faults = [{"kind": "partition", "side_a": ["rank:0"], "side_b": ["rank:1"], "at": 5.0,
               "expected_removed": "rank:2"}]
    with pytest.raises(ScenarioError, match=r"faults\[0\] in .*expected_removed names "
                                            r"members \[\d+\], on neither side"):
        run(1, faults=faults)


# ---------------------------------------------------------------- the file format


def test_the_new_keys_read_from_a_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "partly_broken.toml"
    path.write_text(
        'members = 16\nspares = 2\nvirtual_s = 30.0\n'
        '[link]\nduplicate = 0.5\nduplicate_copies = 2\n'
        '[[faults]]\nkind = "delay"\nmember = "rank:2"\nat = 4.0\nduration_s = 5.0\n'
        'delay_s = 0.5\nmessages = "acks"\n'
        '[[faults]]\nkind = "restart"\nmember = "random"\nat = 6.0\nafter_s = [1.0, 2.0]\n'
        'lost_joins = 2\n'
        '[[faults]]\nkind = "partition"\nside_a = "rank:9"\nside_b = [1, 2, 3]\nat = 5.0\n'
        'heal_at = 9.0\nexpected_removed = "rank:9"\n')
    scenario = load_scenario(path)
    assert scenario.link.duplicate_copies == 2
    delay, restart, cut = scenario.faults
    assert dict(delay.args) == {"member": "rank:2", "at": 4.0, "duration_s": 5.0,
                                "delay_s": 0.5, "messages": "acks"}
    assert dict(restart.args) == {"member": "random", "at": 6.0, "after_s": (1.0, 2.0),
                                  "lost_joins": 2}
    assert cut.args["expected_removed"] == "rank:9"
    first = run_scenario(scenario)
    assert _untimed(first) == _untimed(run_scenario(scenario))
    assert (first["restarts"], first["faults"]) == (1, 2)


@pytest.mark.parametrize(("patch", "message"), [
    ({"link": {"duplicate": 0.1, "duplicate_copies": 0}}, "'link.duplicate_copies'"),
    ({"link": {"duplicate": 0.1, "duplicate_copies": 2.0}},
     "'link.duplicate_copies' in t.toml: expected an int"),
    ({"link": {"duplicate_copies": 3}}, "need link.duplicate > 0"),
    ({"faults": _delay("acks", delay="3")}, "unknown key 'faults[0].delay' in t.toml "
                                            "(did you mean 'faults[0].delay_s'?)"),
    ({"faults": _delay("acks", delay_s="3")}, "'faults[0].delay_s' in t.toml: expected a number"),
    ({"faults": _delay("nacks")}, "'faults[0].messages' in t.toml: 'nacks' is not one of"),
    ({"faults": [{"kind": "delay", "member": 3, "at": 5.0, "delay_s": 1.0}]},
     "missing key 'faults[0].duration_s'"),
    ({"faults": _restart(lost_joins=-1)}, "'faults[0].lost_joins' in t.toml: -1 is below 0"),
    ({"faults": _restart(lost_joins=True)}, "'faults[0].lost_joins' in t.toml: expected an int"),
    ({"faults": _restart(after_s=[2.0, 1.0])}, "'faults[0].after_s' in t.toml: expected seconds "
                                               "or [min_s, max_s]"),
    ({"faults": _restart(after_s=39.0)}, "starts after the end of the run"),
    ({"faults": _restart(member=16)}, "'faults[0].member' in t.toml: member index 16 does not "
                                      "exist (16 members: 0-15)"),
    ({"faults": _restart(member="rank:14")}, "rank 14 does not exist (14 ranks)"),
    ({"faults": _restart(member="spare:2")}, "spare 2 does not exist (2 spares)"),
    ({"faults": _restart(member="random:17")}, "asks for more than the 16 members"),
    ({"faults": [{"kind": "partition", "side_a": "rank:0", "at": 5.0,
                  "expected_removed": "rest"}]}, "'faults[0].expected_removed' in t.toml: "
                                                 "'rest' is not a member selector"),
    ({"faults": [{"kind": "partition", "side_a": "rank:0", "at": 5.0,
                  "expected_removed": [3, 30]}]}, "'faults[0].expected_removed' in t.toml: "
                                                  "member index 30 does not exist"),
    ({"faults": [{"kind": "host_failure", "host": 2, "at": 5.0}]},
     "'faults[0].host' in t.toml: host 2 does not exist"),
])
def test_bad_values_fail_when_read_naming_the_key(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        scenario_from_mapping(dict(BASE, **patch), source="t.toml")
    assert message in str(info.value)
