"""Everything an agent needs to start: from arguments, a TOML file, or ``TORCHPASS_*`` variables.

Precedence, highest first: keyword arguments to :func:`load_settings`, the environment (what the
launcher sets), the TOML file, defaults. The cluster key never comes from a command line (it would
show in ``ps``): a key file or an environment variable (docs/design.md section 9).

Environment (the launcher's contract with the processes it starts):

==========================  ==================================================================
``TORCHPASS_CLUSTER``       cluster name, part of every datagram's authenticated header
``TORCHPASS_KEY_FILE``      file with the cluster key(s): 64 hex digits per line, primary first
``TORCHPASS_KEY``           the primary key as 64 hex digits (when there is no key file)
``TORCHPASS_MEMBER_ID``     this process's member id, 16 hex digits (default: a fresh random id)
``TORCHPASS_BIND``          ``host:port`` of the UDP gossip socket and the TCP port (same number)
``TORCHPASS_BIND_FDS``      ``udp,tcp``: inherited descriptors of sockets already bound to it
``TORCHPASS_STATUS_FD``     inherited descriptor of a TCP socket already bound to the status port
``TORCHPASS_CONFIGURATION`` JSON file of configuration 0 (:mod:`.bootstrap`); absent: join
``TORCHPASS_SEEDS``         ``host:port,...`` of members to join through
``TORCHPASS_STATUS``        ``host:port`` of the HTTP status page; ``off`` disables it
``TORCHPASS_PROFILE``       TOML file of protocol parameters (``configs/lan.toml``)
``TORCHPASS_TOPOLOGY``      ``host`` or ``host/domain`` labels for spare affinity
``TORCHPASS_HANG_TIMEOUT``  seconds without reported progress before the hang watchdog fires
``TORCHPASS_POLICY``        ``wait``, ``shrink`` or ``stop`` when no spare is left
``TORCHPASS_HEALTH``        ``auto`` (NVML when present) or ``off``
``TORCHPASS_PULSE``         ``on`` (default) or ``off``: the native pulse responder and prober
``TORCHPASS_JOIN_TIMEOUT``  seconds a joining process asks its seeds before giving up (30)
``TORCHPASS_STARTED``       ``member@seconds,...``: when the launcher started each process it had
                            started so far (``CLOCK_MONOTONIC``, this host's), for the start-up
                            grace of members not heard from yet (``Params.start_grace_s``)
==========================  ==================================================================
"""

from __future__ import annotations

import math
import os
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from os import PathLike
from typing import Any

from torchpass_p2p.config import ConfigError, params_from_mapping
from torchpass_p2p.core.configuration import Address, Configuration
from torchpass_p2p.core.messages import MAX_MEMBER_ID, MemberId, Topology, format_member_id
from torchpass_p2p.core.params import Params
from torchpass_p2p.core.plan import Policy
from torchpass_p2p.core.seal import KEY_BYTES, Keyring

from .bootstrap import MAX_MEMBERS, read_configuration

__all__ = ["AgentSettings", "SettingsError", "load_settings", "parse_address", "parse_key",
           "read_keyring", "read_keys"]

ENV_PREFIX = "TORCHPASS_"


class SettingsError(ValueError):
    """Settings that cannot start an agent; the message names the setting and its source."""


@dataclass(frozen=True)
class AgentSettings:
    """What one agent runs with. Build it with :func:`load_settings`.

    ``configuration`` is configuration 0 for a member the launcher started; ``None`` means this
    process joins as a new spare through ``seeds`` (it learns the current configuration from
    them). ``bind`` port 0 picks a free port (tests).
    """

    keyring: Keyring = field(repr=False)
    member_id: MemberId
    bind: Address = ("127.0.0.1", 0)
    cluster: str = "torchpass"
    configuration: Configuration | None = None
    seeds: tuple[Address, ...] = ()
    status: Address | None = ("127.0.0.1", 0)
    topology: Topology = Topology()
    params: Params = field(default_factory=Params)
    policy: Policy = Policy.WAIT
    hang_timeout_s: float | None = None
    health: bool = True
    pulse: bool = True
    """Run the pulse responder (when built: ``agent/pulse_wire.py``) and watch the pulses of
    this member's subjects, so that a stopped or vanished process is removed in under a second
    instead of after the 3.1 s a stalled loop is owed (``Params.refutation_window_s``)."""
    join_timeout_s: float = 30.0
    """How long a joining process keeps asking its seeds for the configuration (seconds)."""
    bind_fds: tuple[int, int] | None = None
    """Descriptors of a UDP and a TCP socket already bound to ``bind``, used instead of binding
    (the launcher binds a child's ports before it starts it: :mod:`torchpass_p2p.launch.ports`)."""
    status_fd: int | None = None
    """Descriptor of a TCP socket already bound to ``status``, likewise."""
    key_file: str | None = None
    """The key file ``keyring`` was read from, read again by
    :meth:`~.runtime.AgentRuntime.reload_keys` (``docs/running.md``, "Keys"); None when the
    key came from ``TORCHPASS_KEY`` or an argument (it cannot be reloaded)."""
    started: Mapping[MemberId, float] | None = None
    """When the launcher started each member's process (``time.monotonic()`` seconds: the
    runtime's clock must be that one, as it is by default): members of configuration 0 not
    heard from yet are accused by nobody until ``params.start_grace_s`` after it (after this
    process's own start for one missing here). None (no launcher): no grace."""

    def __post_init__(self) -> None:
        if not 0 <= self.member_id <= MAX_MEMBER_ID:
            raise SettingsError("member_id must be an unsigned 64-bit integer")
        if self.configuration is None and not self.seeds:
            raise SettingsError("a joining member needs seeds (TORCHPASS_SEEDS)")
        if self.configuration is not None and self.member_id not in self.configuration:
            raise SettingsError(f"member {format_member_id(self.member_id)} is not in "
                                "configuration 0")
        if self.hang_timeout_s is not None and not self.hang_timeout_s > 0:
            raise SettingsError("hang_timeout_s must be positive")

    @property
    def joining(self) -> bool:
        return self.configuration is None


def load_settings(
    file: str | PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> AgentSettings:
    """Merge ``overrides`` (fields of :class:`AgentSettings`, plus ``key`` as bytes), the
    environment and the TOML ``file``.

    The TOML file may hold an ``[agent]`` table (``cluster``, ``bind``, ``status``, ``seeds``,
    ``topology``, ``policy``, ``hang_timeout_s``, ``health``, ``pulse``, ``key_file``) and the
    protocol parameter tables of ``configs/lan.toml``.

    Raises:
        SettingsError: a missing key, a malformed value, or an inconsistent combination.
        ConfigError: invalid protocol parameters in the file or profile.
        OSError: a named file cannot be read.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if file is not None:
        values.update(_from_toml(file))
    values.update(_from_env(env))
    for address, fds in (("bind", "bind_fds"), ("status", "status_fd")):
        if address in overrides and fds not in overrides:
            values.pop(fds, None)  # the inherited sockets are bound to the launcher's address
    values.update(overrides)
    key = values.pop("key", None)
    key_file = values.pop("key_file", None)
    if "keyring" not in values:
        if key is not None:
            values["keyring"] = Keyring(bytes(key))
        elif key_file is not None:
            values["keyring"] = read_keyring(key_file)
            values["key_file"] = os.path.abspath(key_file)
        else:
            raise SettingsError("no cluster key: set TORCHPASS_KEY_FILE or TORCHPASS_KEY")
    values.setdefault("member_id", secrets.randbits(64))
    try:
        return AgentSettings(**values)
    except TypeError as exc:
        raise SettingsError(str(exc)) from exc


def read_keys(path: str | PathLike[str]) -> list[bytes]:
    """The keys of a key file: 64 hex digits per line, the primary first; blank lines and
    ``#`` comments skipped. The one reader of the format (the launcher uses it too).

    Raises:
        SettingsError: no key, or a line that is not 64 hex digits.
        OSError: the file cannot be read.
    """
    with open(path, encoding="ascii", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    keys = [parse_key(line, str(path)) for line in lines]
    if not keys:
        raise SettingsError(f"{path}: no key")
    return keys


def read_keyring(path: str | PathLike[str]) -> Keyring:
    """A keyring from a key file (:func:`read_keys`), the primary first.

    Raises:
        SettingsError: no key, or a line that is not 64 hex digits.
    """
    keys = read_keys(path)
    return Keyring(keys[0], keys[1:])


def parse_address(text: str, *, where: str = "address") -> Address:
    """``host:port`` (IPv6 as ``[::1]:port``) -> (host, port).

    Raises:
        SettingsError: no port, or a port outside 0..65535.
    """
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SettingsError(f"{where}: expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


def with_member_id(settings: AgentSettings, member_id: MemberId) -> AgentSettings:
    """A copy of ``settings`` for another member (tests run many agents from one template)."""
    return replace(settings, member_id=member_id)


def parse_key(text: str, where: str) -> bytes:
    """A 32-byte key from 64 hex digits.

    Raises:
        SettingsError: anything else (the message names ``where``).
    """
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise SettingsError(f"{where}: a key is {2 * KEY_BYTES} hex digits")
    return key


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    def get(name: str) -> str | None:
        value = env.get(ENV_PREFIX + name)
        return value if value else None

    out: dict[str, Any] = {}
    if (v := get("CLUSTER")) is not None:
        out["cluster"] = v
    if (v := get("KEY_FILE")) is not None:
        out["key_file"] = v
    elif (v := get("KEY")) is not None:
        out["key"] = parse_key(v, ENV_PREFIX + "KEY")
    if (v := get("MEMBER_ID")) is not None:
        try:
            out["member_id"] = int(v, 16)
        except ValueError:
            raise SettingsError(f"{ENV_PREFIX}MEMBER_ID: 16 hex digits, got {v!r}") from None
    if (v := get("BIND")) is not None:
        out["bind"] = parse_address(v, where=ENV_PREFIX + "BIND")
    if (v := get("BIND_FDS")) is not None:
        udp, tcp = _descriptors(v, ENV_PREFIX + "BIND_FDS", count=2)
        out["bind_fds"] = (udp, tcp)
    if (v := get("STATUS_FD")) is not None:
        (out["status_fd"],) = _descriptors(v, ENV_PREFIX + "STATUS_FD", count=1)
    if (v := get("CONFIGURATION")) is not None:
        out["configuration"] = read_configuration(v)
    if (v := get("SEEDS")) is not None:
        out["seeds"] = _seeds(v, ENV_PREFIX + "SEEDS")
    if (v := get("STATUS")) is not None:
        out["status"] = None if v == "off" else parse_address(v, where=ENV_PREFIX + "STATUS")
    if (v := get("PROFILE")) is not None:
        out["params"] = _load_params(v)
    if (v := get("TOPOLOGY")) is not None:
        host, _, domain = v.partition("/")
        out["topology"] = Topology(host, domain)
    if (v := get("HANG_TIMEOUT")) is not None:
        out["hang_timeout_s"] = _float(v, ENV_PREFIX + "HANG_TIMEOUT")
    if (v := get("JOIN_TIMEOUT")) is not None:
        out["join_timeout_s"] = _float(v, ENV_PREFIX + "JOIN_TIMEOUT")
    if (v := get("POLICY")) is not None:
        out["policy"] = _policy(v, ENV_PREFIX + "POLICY")
    if (v := get("HEALTH")) is not None:
        if v not in ("auto", "off"):
            raise SettingsError(f"{ENV_PREFIX}HEALTH: auto or off, got {v!r}")
        out["health"] = v == "auto"
    if (v := get("PULSE")) is not None:
        if v not in ("on", "off"):
            raise SettingsError(f"{ENV_PREFIX}PULSE: on or off, got {v!r}")
        out["pulse"] = v == "on"
    if (v := get("STARTED")) is not None:
        out["started"] = _started(v, ENV_PREFIX + "STARTED")
    return out


def _from_toml(path: str | PathLike[str]) -> dict[str, Any]:
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{path}: invalid TOML: {exc}") from exc
    agent = data.pop("agent", {})
    out: dict[str, Any] = {}
    if data:
        out["params"] = params_from_mapping(data, source=str(path))
    where = f"{path} [agent]"
    for key, value in agent.items():
        if key in ("cluster", "key_file"):
            out[key] = str(value)
        elif key in ("bind", "status"):
            out[key] = None if value == "off" else parse_address(str(value), where=where)
        elif key == "seeds":
            out["seeds"] = tuple(parse_address(str(s), where=where) for s in value)
        elif key == "topology":
            host, _, domain = str(value).partition("/")
            out["topology"] = Topology(host, domain)
        elif key == "policy":
            out["policy"] = _policy(str(value), where)
        elif key == "hang_timeout_s":
            out["hang_timeout_s"] = _float(str(value), where)
        elif key in ("health", "pulse"):
            out[key] = bool(value)
        else:
            raise SettingsError(f"{where}: unknown key {key!r}")
    return out


def _load_params(path: str) -> Params:
    with open(path, "rb") as f:
        try:
            return params_from_mapping(tomllib.load(f), source=path)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from exc


def _seeds(text: str, where: str) -> tuple[Address, ...]:
    return tuple(parse_address(s, where=where) for s in text.split(",") if s.strip())


def _float(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise SettingsError(f"{where}: a number of seconds, got {text!r}") from None


def _started(text: str, where: str) -> dict[MemberId, float]:
    """``member@seconds,...`` (member ids as 16 hex digits) -> {member: seconds}."""
    out: dict[MemberId, float] = {}
    parts = text.split(",")
    if len(parts) > MAX_MEMBERS:
        raise SettingsError(f"{where}: more than {MAX_MEMBERS} entries")
    for part in parts:
        member, sep, seconds = part.strip().partition("@")
        try:
            key, at = int(member, 16), float(seconds)
        except ValueError:
            key, at = -1, math.nan
        if not sep or len(member) != 16 or key < 0 or not math.isfinite(at):
            raise SettingsError(f"{where}: member@seconds entries, got {part!r:.60}")
        out[key] = at
    return out


def _descriptors(text: str, where: str, *, count: int) -> tuple[int, ...]:
    try:
        fds = tuple(int(part) for part in text.split(","))
    except ValueError:
        fds = ()
    if len(fds) != count or min(fds) < 0:
        raise SettingsError(f"{where}: {count} comma-separated file descriptor(s), got {text!r}")
    return fds


def _policy(text: str, where: str) -> Policy:
    try:
        return Policy(text)
    except ValueError:
        raise SettingsError(f"{where}: wait, shrink or stop, got {text!r}") from None
