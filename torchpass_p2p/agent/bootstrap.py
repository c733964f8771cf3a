"""A :class:`~torchpass_p2p.core.Configuration` as plain data, for files and the wire.

The launcher writes configuration 0 as JSON (``TORCHPASS_CONFIGURATION``); a process that joins
later receives the current configuration from a seed as msgpack over the authenticated TCP port
(:mod:`.transport`). Both go through :func:`configuration_to_data` and
:func:`configuration_from_data`, which checks every field against hard limits: the data may come
from a peer, and a peer's mistake is an error here, never an exception from deep inside.

Layout (member ids as 16 hex digits, as everywhere a person reads them)::

    {"config_id": 0, "observers": 10,
     "ranks": ["00a1...", null, ...],          # null: a vacant rank
     "spares": ["..."],
     "addresses": {"00a1...": ["127.0.0.1", 29500], ...},
     "topology": {"00a1...": ["host-a", "nvl0"], ...}}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from os import PathLike
from typing import Any

from torchpass_p2p.core.configuration import Address, Configuration
from torchpass_p2p.core.messages import MemberId, Topology, format_member_id

__all__ = [
    "MAX_MEMBERS",
    "BootstrapError",
    "configuration_from_data",
    "configuration_to_data",
    "read_configuration",
    "write_configuration",
]

MAX_MEMBERS = 131_072
"""Largest configuration accepted from data: above docs/design.md section 1's 100k GPUs plus
spares."""
_MAX_LABEL = 64  # bytes of a host name or topology label, as the wire codec allows


class BootstrapError(ValueError):
    """Data that does not describe a valid configuration; the message names the field."""


def configuration_to_data(config: Configuration) -> dict[str, Any]:
    """``config`` as plain JSON- and msgpack-encodable data (module layout)."""
    topology = {}
    for m in config.members:
        t = config.topology_of(m)
        if t != Topology():
            topology[format_member_id(m)] = [t.host, t.domain]
    return {
        "config_id": config.config_id,
        "observers": config.observers,
        "ranks": [None if m is None else format_member_id(m) for m in config.ranks],
        "spares": [format_member_id(m) for m in config.spares],
        "addresses": {format_member_id(m): [h, p] for m, (h, p) in config.addresses.items()},
        "topology": topology,
    }


def configuration_from_data(data: object) -> Configuration:
    """The configuration ``data`` describes.

    Raises:
        BootstrapError: a missing or mistyped field, a member id that is not 16 hex digits, an
            address that is not ``[host, port]`` with a port in 1..65535, more than
            :data:`MAX_MEMBERS` members, or a configuration the constructor rejects.
    """
    if not isinstance(data, Mapping):
        raise BootstrapError("configuration must be a mapping")
    config_id = _int(data, "config_id", 0, (1 << 63) - 1)
    observers = _int(data, "observers", 1, 64)
    ranks_raw = _list(data, "ranks")
    spares_raw = _list(data, "spares")
    if len(ranks_raw) + len(spares_raw) > MAX_MEMBERS:
        raise BootstrapError(f"more than {MAX_MEMBERS} members")
    ranks = [None if r is None else _member(r, "ranks") for r in ranks_raw]
    spares = [_member(s, "spares") for s in spares_raw]
    addresses: dict[MemberId, Address] = {}
    for key, value in _mapping(data, "addresses").items():
        addresses[_member(key, "addresses")] = _address(value)
    topology: dict[MemberId, Topology] = {}
    for key, value in _mapping(data, "topology").items():
        if (not isinstance(value, list) or len(value) != 2
                or not all(isinstance(v, str) and len(v) <= _MAX_LABEL for v in value)):
            raise BootstrapError("topology entries must be [host, domain] strings")
        topology[_member(key, "topology")] = Topology(value[0], value[1])
    try:
        return Configuration(config_id, ranks, spares, addresses, observers=observers,
                             topology=topology)
    except ValueError as exc:
        raise BootstrapError(str(exc)) from exc


def write_configuration(path: str | PathLike[str], config: Configuration) -> None:
    """Write ``config`` as JSON to ``path`` (the launcher's configuration 0)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(configuration_to_data(config), f, indent=1)
        f.write("\n")


def read_configuration(path: str | PathLike[str]) -> Configuration:
    """Read a configuration written by :func:`write_configuration`.

    Raises:
        BootstrapError: the file is not JSON or does not describe a configuration.
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise BootstrapError(f"{path}: not JSON: {exc}") from exc
    try:
        return configuration_from_data(data)
    except BootstrapError as exc:
        raise BootstrapError(f"{path}: {exc}") from exc


def _int(data: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = data.get(key)
    if type(value) is not int or not low <= value <= high:
        raise BootstrapError(f"{key} must be an integer in {low}..{high}")
    return value


def _list(data: Mapping[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise BootstrapError(f"{key} must be a list")
    return value


def _mapping(data: Mapping[str, Any], key: str) -> Mapping[Any, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping) or len(value) > MAX_MEMBERS:
        raise BootstrapError(f"{key} must be a mapping of at most {MAX_MEMBERS} entries")
    return value


def _member(value: object, where: str) -> MemberId:
    if not isinstance(value, str) or len(value) != 16:
        raise BootstrapError(f"{where}: a member id is 16 hex digits, got {value!r:.40}")
    try:
        return int(value, 16)
    except ValueError:
        raise BootstrapError(f"{where}: a member id is 16 hex digits, got {value!r}") from None


def _address(value: object) -> Address:
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str)
            or not 0 < len(value[0]) <= _MAX_LABEL or type(value[1]) is not int
            or not 0 < value[1] < 65536):
        raise BootstrapError(f"an address is [host, port 1..65535], got {value!r:.60}")
    return value[0], value[1]
