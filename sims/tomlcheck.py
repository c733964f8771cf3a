"""Strict reading of parsed TOML tables for scenario files: every error names file and key.

Same rules as :mod:`torchpass_p2p.config`: an unknown key is an error with a "did you mean"
hint, a bool is never a number, an int is accepted where a float is expected.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from typing import Any

from torchpass_p2p.config import ConfigError

_REQUIRED: Any = object()


class ScenarioError(ConfigError):
    """A scenario file or mapping that does not describe a runnable scenario."""


def check_keys(table: Mapping[str, Any], known: Collection[str], prefix: str,
               source: str) -> None:
    """Raise :class:`ScenarioError` for the first key of ``table`` not in ``known``."""
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
            raise ScenarioError(f"unknown key {prefix + key!r} in {source}{hint}")


def _get(table: Mapping[str, Any], key: str, prefix: str, source: str, default: Any) -> Any:
    if key in table:
        return table[key]
    if default is _REQUIRED:
        raise ScenarioError(f"missing key {prefix + key!r} in {source}")
    return default


def number(table: Mapping[str, Any], key: str, source: str, *, prefix: str = "",
           default: Any = _REQUIRED, minimum: float | None = None,
           maximum: float | None = None) -> float:
    """A float (ints accepted) within [minimum, maximum]."""
    value = _get(table, key, prefix, source, default)
    where = prefix + key
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScenarioError(f"key {where!r} in {source}: expected a number, got "
                            f"{type(value).__name__} {value!r}")
    if value != value or (minimum is not None and value < minimum) or (
            maximum is not None and value > maximum):
        raise ScenarioError(f"key {where!r} in {source}: {value!r} is outside "
                            f"[{minimum}, {maximum}]")
    return float(value)


def integer(table: Mapping[str, Any], key: str, source: str, *, prefix: str = "",
            default: Any = _REQUIRED, minimum: int | None = None) -> int:
    """An int (a float is an error: 1000.0 members is a typo) of at least ``minimum``."""
    value = _get(table, key, prefix, source, default)
    where = prefix + key
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"key {where!r} in {source}: expected an int, got "
                            f"{type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ScenarioError(f"key {where!r} in {source}: {value} is below {minimum}")
    return value


def boolean(table: Mapping[str, Any], key: str, source: str, *, prefix: str = "",
            default: Any = _REQUIRED) -> bool:
    value = _get(table, key, prefix, source, default)
    if not isinstance(value, bool):
        raise ScenarioError(f"key {prefix + key!r} in {source}: expected true or false, got "
                            f"{type(value).__name__} {value!r}")
    return value


def string(table: Mapping[str, Any], key: str, source: str, *, prefix: str = "",
           default: Any = _REQUIRED, choices: Collection[str] | None = None) -> str:
    value = _get(table, key, prefix, source, default)
    where = prefix + key
    if not isinstance(value, str):
        raise ScenarioError(f"key {where!r} in {source}: expected a string, got "
                            f"{type(value).__name__} {value!r}")
    if choices is not None and value not in choices:
        close = difflib.get_close_matches(value, list(choices), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ScenarioError(f"key {where!r} in {source}: {value!r} is not one of "
                            f"{', '.join(sorted(choices))}{hint}")
    return value
