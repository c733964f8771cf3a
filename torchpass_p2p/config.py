"""Read :class:`~torchpass_p2p.core.params.Params` from TOML profiles such as ``configs/lan.toml``.

A profile groups the fields of ``Params`` in tables that mirror the comment groups of
``core/params.py`` (see :data:`GROUPS`); keys keep their full field names, so one spelling is
used in code, docs and files. Missing keys take the ``Params`` default. Everything else is strict:
an unknown table or key, a wrong type, or a value ``Params`` rejects raises :class:`ConfigError`
naming the key, because a silently ignored typo in a timeout is a production outage later.

This module reads files, so it lives outside the sans-IO ``core``.
"""

from __future__ import annotations

import difflib
import tomllib
import typing
from collections.abc import Mapping
from os import PathLike
from typing import Any

from torchpass_p2p.core.params import Params

__all__ = ["GROUPS", "ConfigError", "dump_params", "load_params", "params_from_mapping"]

GROUPS: dict[str, tuple[str, ...]] = {
    "probe": (
        "probe_interval_s",
        "probe_timeout_s",
        "round_timeout_s",
        "indirect_probes",
        "failed_rounds_to_alert",
    ),
    "observers": ("observers", "min_alerts_to_confirm"),
    "suspicion": ("suspicion_min_s", "suspicion_max_s", "start_grace_s"),
    "health": ("max_health_multiplier", "stall_tolerance_s", "self_suspect_after_s"),
    "gossip": ("retransmit_mult", "gossip_interval_s", "gossip_fanout", "max_piggyback"),
    "sync": ("sync_interval_s", "sync_page_entries"),
    "agreement": (
        "alerts_to_remove",
        "cut_settle_s",
        "exit_settle_s",
        "refutation_window_s",
        "vote_push_interval_s",
        "vote_resend_s",
        "classic_timeout_s",
        "classic_spread_s",
        "lease_s",
        "join_retry_s",
        "certificate_log",
        "max_pending_joins",
    ),
    "bounds": ("max_events", "max_outbox"),
}
"""TOML table -> the ``Params`` fields it holds, in file order. Each field is in exactly one."""

_TABLE_OF: dict[str, str] = {name: table for table, names in GROUPS.items() for name in names}
_FIELD_TYPE: dict[str, type] = typing.get_type_hints(Params)  # resolves postponed annotations


class ConfigError(ValueError):
    """A configuration file or mapping that does not describe a valid :class:`Params`."""


def load_params(path: str | PathLike[str]) -> Params:
    """Read a TOML profile and return the :class:`Params` it describes.

    Raises:
        ConfigError: the file is not valid TOML, has an unknown table or key, a value of the
            wrong type, or values that ``Params`` rejects; the message names the file and key.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    return params_from_mapping(data, source=str(path))


def params_from_mapping(mapping: Mapping[str, Any], *, source: str = "<mapping>") -> Params:
    """Build :class:`Params` from a parsed profile: ``{table: {field: value}}`` per :data:`GROUPS`.

    Integers are accepted (and converted) where a float is expected; a bool is never a number.
    ``source`` names the origin (a file path) in error messages.

    Raises:
        ConfigError: an unknown table or key, a key in the wrong table, a table that is not a
            table, a value of the wrong type, or values that ``Params.__post_init__`` rejects.
    """
    values: dict[str, Any] = {}  # each checked against its field's type by _typed
    for table, body in mapping.items():
        # A field written at top level ("observers" is both a field and a table name).
        if table in _TABLE_OF and not isinstance(body, Mapping):
            raise ConfigError(f"key {table!r} must be in table [{_TABLE_OF[table]}] in {source}")
        if table not in GROUPS:
            raise ConfigError(f"unknown table {table!r} in {source}{_hint(table, GROUPS)}")
        if not isinstance(body, Mapping):
            raise ConfigError(f"{table!r} must be a table, got {type(body).__name__} in {source}")
        for key, value in body.items():
            where = f"{table}.{key}"
            if key not in _TABLE_OF:
                raise ConfigError(f"unknown key {where!r} in {source}{_hint(key, _TABLE_OF)}")
            if _TABLE_OF[key] != table:
                raise ConfigError(f"key {where!r} belongs in table [{_TABLE_OF[key]}] in {source}")
            values[key] = _typed(where, _FIELD_TYPE[key], value, source)
    try:
        return Params(**values)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def dump_params(params: Params) -> str:
    """TOML text for ``params`` that :func:`params_from_mapping` reads back to an equal value.

    Every field is written, grouped per :data:`GROUPS`. ``repr`` of a finite float and of an int
    is valid TOML (``Params`` forbids inf and nan), so no TOML writer is needed.
    """
    lines: list[str] = []
    for table, names in GROUPS.items():
        if lines:
            lines.append("")
        lines.append(f"[{table}]")
        lines.extend(f"{name} = {getattr(params, name)!r}" for name in names)
    return "\n".join(lines) + "\n"


def _typed(where: str, expected: type, value: object, source: str) -> int | float:
    """Check ``value`` against the field type ``expected`` (``int`` or ``float``).

    Raises:
        ConfigError: ``value`` is a bool, not a number, or a float where an int is expected.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        got = type(value).__name__
        want = expected.__name__
        raise ConfigError(f"key {where!r} in {source}: expected {want}, got {got} {value!r}")
    if expected is int:
        if not isinstance(value, int):
            raise ConfigError(f"key {where!r} in {source}: expected int, got float {value!r}")
        return value
    return float(value)


def _hint(name: str, known: Mapping[str, object]) -> str:
    """A " (did you mean ...?)" suffix for a misspelt name, or an empty string."""
    close = difflib.get_close_matches(name, list(known), n=1)
    if not close:
        return ""
    match = close[0]
    if known is _TABLE_OF:
        match = f"{_TABLE_OF[match]}.{match}"
    return f" (did you mean {match!r}?)"
