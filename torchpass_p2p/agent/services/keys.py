"""The keys an agent seals and opens with: reloading the key file, and finding out that the
members no longer accept this member's key.

A reload (``POST /keys/reload``, SIGHUP through the launcher) reads the key file again and
installs its keyring everywhere the agent uses keys. Something that arrives under a key this
member does not hold starts a key check: a key file rewritten since it was read is reloaded
first (the operator rotated it and this member missed the reload); otherwise a few members are
asked whether they accept this member's key, and refused by enough of them, this member stops
(``docs/running.md``, "Keys").

What must stay true: at most one key check starts per :data:`KEY_CHECK_INTERVAL_S`, each over
within :data:`KEY_CHECK_TIMEOUT_S` (they are bounded tasks of the runtime's owner), and no
single refusal stops a member (:data:`KEY_CHECK_REFUSALS`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torchpass_p2p.core.configuration import Address
from torchpass_p2p.core.messages import MemberId
from torchpass_p2p.tasks import OwnedTasks

from ..settings import SettingsError, read_keyring
from ..transport import KeyRefused, Kind, TransportError

if TYPE_CHECKING:
    from ..transport import Transport

__all__ = ["KEY_CHECK_INTERVAL_S", "KEY_CHECK_PEERS", "KEY_CHECK_REFUSALS",
           "KEY_CHECK_TIMEOUT_S", "KeyKeeper", "KeyNotAccepted", "not_accepted"]

log = logging.getLogger("torchpass_p2p.agent")

KEY_CHECK_INTERVAL_S = 1.0
"""At most one key check (:meth:`KeyKeeper.on_unknown_key`) per this many seconds: one is due
when something arrives under a key this member does not hold."""
KEY_CHECK_PEERS = 5
"""Members of the configuration a key check asks (a random sample of the others)."""
KEY_CHECK_REFUSALS = 2
"""Refusals a key check needs, with no member accepting, to conclude that this member's key is
not accepted. Two, not one: a single peer that refuses may be the odd one itself (a spare on
an old key refuses every member that moved on), and in a configuration of two a stale member
is removed by failure detection instead."""
KEY_CHECK_TIMEOUT_S = 2.0
"""Seconds each member asked by a key check has to answer (a request on loopback or a LAN
takes milliseconds); a process refused everywhere exits well within 5 s."""


class KeyNotAccepted(TransportError):
    """The members (or, joining, the seeds) hold none of this process's keys: its key file is
    older or newer than the cluster's. The message names key ids, never keys. A process under
    :func:`torchpass_p2p.start` exits with ``EXIT_KEY_REFUSED`` and this one line."""


def not_accepted(own: tuple[int, ...], refusals: list[KeyRefused], who: str,
                 asked: int) -> KeyNotAccepted:
    """The error for ``refusals`` from ``asked`` peers (``who`` names them, e.g. "seed(s)") of
    a process whose key ids are ``own``, the primary first."""
    accepted = sorted({kid for r in refusals for kid in r.accepted})
    return KeyNotAccepted(
        f"key not accepted: this process seals with key id {own[0]} (its keys: "
        f"{', '.join(map(str, own))}) and {len(refusals)} of {asked} {who} accept only key "
        f"ids {', '.join(map(str, accepted))}")


class KeyKeeper:
    """The keyring in use, its reloads and the key checks of one agent.

    Args:
        keyring: the keys read at start (:class:`~torchpass_p2p.core.seal.Keyring`).
        key_file: where they were read, or None (``TORCHPASS_KEY``: nothing to reload); asked
            at each use (the host may replace the settings until the agent starts).
        transport: the agent's transport: rekeyed on each install; key checks ask through it.
        clock: monotonic seconds.
        tasks: the runtime's task owner; key checks run in it.
        running: whether the agent is up (a core, not stopped): no key check otherwise.
        peers: the addresses of the other members of the current configuration, in its
            order; None before the core runs.
        on_installed: called with each keyring installed, right after the transport's rekey and
            before the host's listeners (the runtime's own users of keys); it must not raise.
        on_refused: called once, with the error, when a key check concludes that this
            member's key is not accepted (the runtime then stops).
    """

    def __init__(self, keyring: Any, key_file: Callable[[], str | None], transport: Transport, *,
                 clock: Callable[[], float], tasks: OwnedTasks, running: Callable[[], bool],
                 peers: Callable[[], Mapping[MemberId, Address] | None],
                 on_installed: Callable[[Any], None],
                 on_refused: Callable[[KeyNotAccepted], None]) -> None:
        self.keyring = keyring
        """The keys in use: ``keyring`` until :meth:`reload` replaces it."""
        self.refused: KeyNotAccepted | None = None
        """Set when the members refused this member's key (:meth:`check`)."""
        self.reloaded_at: float | None = None
        """Clock seconds of the last successful reload; None before one."""
        self.counts: Counter[str] = Counter()
        """``reloads``, ``reload_failed``, ``key_checks``."""
        self._key_file = key_file
        self._transport = transport
        self._clock = clock
        self._tasks = tasks
        self._running = running
        self._peers = peers
        self._on_installed = on_installed
        self._on_refused = on_refused
        self._listeners: list[Callable[[Any], None]] = []
        self._check_at = -float("inf")
        self._sample = random.Random()  # not the core's: its draws stay reproducible

    def add_listener(self, listener: Callable[[Any], None]) -> None:
        """Call ``listener(keyring)`` with each keyring :meth:`reload` installs."""
        self._listeners.append(listener)

    def counters(self) -> dict[str, int]:
        """:attr:`counts` and the transport's key events: the ``torchpass_keys_total``
        metric."""
        return {**self.counts, **self._transport.key_events}

    def not_accepted(self, refusals: list[KeyRefused], who: str, asked: int) -> KeyNotAccepted:
        """:func:`not_accepted` for this member's current keys."""
        return not_accepted(self.keyring.key_ids, refusals, who, asked)

    def reload(self) -> dict[str, Any]:
        """Read the key file again and install its keyring (see
        :meth:`~torchpass_p2p.agent.runtime.AgentRuntime.reload_keys`). Returns
        ``{"reloaded": True, "primary_id", "key_ids"}`` or ``{"reloaded": False, "reason"}``
        (never raises for a bad file)."""
        path = self._key_file()
        try:
            if path is None:
                raise SettingsError("this agent's key came from TORCHPASS_KEY, not a key file")
            keyring = read_keyring(path)
        except (SettingsError, OSError, ValueError) as exc:
            self.counts["reload_failed"] += 1
            log.error("key file not reloaded, keeping key ids %s: %s",
                      ", ".join(map(str, self.keyring.key_ids)), exc)
            return {"reloaded": False, "reason": str(exc)}
        before = self.keyring.key_ids
        self.install(keyring)
        self.counts["reloads"] += 1
        self.reloaded_at = self._clock()
        log.info("key file reloaded: primary key id %d, accepted key ids %s (were %s)",
                 keyring.primary_id, ", ".join(map(str, keyring.key_ids)),
                 ", ".join(map(str, before)))
        return {"reloaded": True, "primary_id": keyring.primary_id,
                "key_ids": list(keyring.key_ids)}

    def install(self, keyring: Any) -> None:
        """Seal and open under ``keyring`` from now on, everywhere; a host listener that
        raises is logged and the others still run."""
        self.keyring = keyring
        self._transport.rekey(keyring)
        self._on_installed(keyring)
        for listener in list(self._listeners):
            try:
                listener(keyring)
            except Exception:  # the host's code: it must not stop the reload here
                log.exception("a key listener failed")

    def on_unknown_key(self, address: Address) -> None:
        """Something arrived under a key this member does not hold: check, at most once per
        :data:`KEY_CHECK_INTERVAL_S`, whether it is this member whose key is refused."""
        now = self._clock()
        if (not self._running() or self.refused is not None
                or now - self._check_at < KEY_CHECK_INTERVAL_S):
            return
        self._check_at = now
        self._tasks.spawn(self.check(), name="key-check")

    async def check(self) -> None:
        """Is this member's key refused by the others? First, a key file rewritten since it
        was read is reloaded. Then up to :data:`KEY_CHECK_PEERS` other members of the
        configuration are asked (``Kind.KEY_CHECK``); with none accepting and at least
        :data:`KEY_CHECK_REFUSALS` refusing, :attr:`refused` is set and ``on_refused`` called."""
        self.counts["key_checks"] += 1
        path = self._key_file()
        if path is not None:
            try:
                on_file = read_keyring(path)
            except (SettingsError, OSError, ValueError):
                on_file = None
            if on_file is not None and on_file.key_ids != self.keyring.key_ids:
                log.warning("key file %s changed since it was read: reloading it", path)
                self.reload()
                return
        addresses = self._peers()
        if addresses is None:
            return
        others = list(addresses)
        asked = self._sample.sample(others, min(KEY_CHECK_PEERS, len(others)))
        answers = await asyncio.gather(*(self._ask(addresses[m]) for m in asked))
        refusals = [a for a in answers if isinstance(a, KeyRefused)]
        if (self.refused is None and self._running() and True not in answers
                and len(refusals) >= KEY_CHECK_REFUSALS):
            self.refused = self.not_accepted(refusals, "member(s) asked", len(asked))
            self._on_refused(self.refused)

    async def _ask(self, address: Address) -> KeyRefused | bool | None:
        """True: ``address`` accepts our key; its refusal; None: no answer."""
        try:
            kind, _ = await self._transport.request(address, Kind.KEY_CHECK, b"",
                                                    timeout_s=KEY_CHECK_TIMEOUT_S)
        except KeyRefused as exc:
            return exc
        except TransportError:
            return None
        return kind == Kind.KEY_CHECK_REPLY

