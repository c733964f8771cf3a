"""Loading protocol parameters from TOML profiles (torchpass_p2p.config)."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpass_p2p.config import (
    GROUPS,
    ConfigError,
    dump_params,
    load_params,
    params_from_mapping,
)
from torchpass_p2p.core.params import Params

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LAN = CONFIGS / "lan.toml"
FIELDS = [f.name for f in dataclasses.fields(Params)]
PROFILES = sorted(CONFIGS.glob("*.toml"))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x.toml"
    path.write_text(text)
    return path


def test_lan_profile_equals_defaults() -> None:
    # Keeps configs/lan.toml and the defaults in core/params.py from drifting apart.
    assert load_params(LAN) == Params()


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_profile_lists_every_field_in_its_table(profile: Path) -> None:
    data = tomllib.loads(profile.read_text())
    listed = {key: table for table, body in data.items() for key in body}
    missing = [name for name in FIELDS if name not in listed]
    assert missing == [], f"{profile.name} lacks {missing}"
    load_params(profile)  # and every profile is valid


def test_groups_cover_every_field_exactly_once() -> None:
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(FIELDS)
    assert len(grouped) == len(set(grouped))


def test_missing_keys_take_defaults() -> None:
    assert params_from_mapping({}) == Params()
    assert params_from_mapping({"gossip": {"gossip_fanout": 5}}) == Params(gossip_fanout=5)


def test_int_accepted_where_float_expected() -> None:
    params = params_from_mapping({"probe": {"probe_interval_s": 2}})
    assert params.probe_interval_s == 2.0
    assert type(params.probe_interval_s) is float


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[probe]\nprobe_intervall_s = 1.0\n", "'probe.probe_intervall_s'"),
        ("[probe]\nfrobnicate = 1\n", "'probe.frobnicate'"),
        ("[probx]\nprobe_interval_s = 1.0\n", "'probx'"),
        ("cluster = 'lab'\n", "'cluster'"),
        ("[protocol.probe]\nprobe_interval_s = 1.0\n", "'protocol'"),
    ],
    ids=["misspelt-key", "unknown-key", "unknown-table", "unknown-top-level", "nested-table"],
)
def test_unknown_names_are_rejected_by_name(tmp_path: Path, text: str, named: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match="unknown") as info:
        load_params(path)
    assert named in str(info.value)
    assert str(path) in str(info.value)


def test_misspelt_key_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'probe\.probe_interval_s'"):
        params_from_mapping({"probe": {"probe_intervall_s": 1.0}})


def test_key_in_wrong_table_names_the_right_one() -> None:
    with pytest.raises(ConfigError, match=r"'gossip\.observers' belongs in table \[observers\]"):
        params_from_mapping({"gossip": {"observers": 10}})


@pytest.mark.parametrize(("key", "table"), [("observers", "observers"), ("max_events", "bounds")])
def test_flat_key_at_top_level_names_its_table(key: str, table: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{key}' must be in table \[{table}\]"):
        params_from_mapping({key: 10})


def test_table_that_is_not_a_table() -> None:
    with pytest.raises(ConfigError, match="'probe' must be a table"):
        params_from_mapping({"probe": 3})


@pytest.mark.parametrize(
    ("table", "key", "value", "expected"),
    [
        ("probe", "probe_interval_s", "1.0", "expected float, got str"),
        ("probe", "probe_interval_s", True, "expected float, got bool"),
        ("probe", "indirect_probes", 3.0, "expected int, got float"),
        ("probe", "indirect_probes", False, "expected int, got bool"),
        ("bounds", "max_events", [1], "expected int, got list"),
    ],
)
def test_wrong_types_are_rejected_by_name(
    table: str, key: str, value: object, expected: str
) -> None:
    with pytest.raises(ConfigError, match=f"'{table}.{key}'") as info:
        params_from_mapping({table: {key: value}}, source="t.toml")
    assert expected in str(info.value)


def test_string_number_in_file_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, '[suspicion]\nsuspicion_max_s = "6.0"\n')
    with pytest.raises(ConfigError, match=r"'suspicion\.suspicion_max_s'.*expected float"):
        load_params(path)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[gossip]\ngossip_fanout = -1\n", "gossip_fanout must be a positive number"),
        ("[sync]\nsync_interval_s = 0.0\n", "sync_interval_s must be a positive number"),
        ("[probe]\nprobe_timeout_s = 0.5\n", "probe_timeout_s must be shorter"),
        ("[suspicion]\nsuspicion_min_s = 7.0\n", "suspicion_min_s must not exceed"),
        ("[health]\nstall_tolerance_s = inf\n", "stall_tolerance_s must be finite"),
    ],
)
def test_invalid_values_raise_config_error_with_file(tmp_path: Path, text: str, match: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as info:
        load_params(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


def test_invalid_toml_raises_config_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "[probe\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_params(path)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_dump_round_trips_defaults() -> None:
    text = dump_params(Params())
    assert params_from_mapping(tomllib.loads(text)) == Params()
    assert load_params(LAN) == params_from_mapping(tomllib.loads(text))


_seconds = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(
    interval=_seconds,
    probe_frac=st.floats(min_value=0.01, max_value=0.99),
    suspicion_min=_seconds,
    suspicion_mult=st.floats(min_value=1.0, max_value=100.0),
    fanout=st.integers(min_value=1, max_value=2**62),
)
def test_dump_round_trips(
    interval: float,
    probe_frac: float,
    suspicion_min: float,
    suspicion_mult: float,
    fanout: int,
) -> None:
    params = Params(
        probe_interval_s=interval,
        round_timeout_s=interval,
        probe_timeout_s=interval * probe_frac,
        suspicion_min_s=suspicion_min,
        suspicion_max_s=suspicion_min * suspicion_mult,
        gossip_fanout=fanout,
    )
    assert params_from_mapping(tomllib.loads(dump_params(params))) == params
