"""Watching the pulses of this member's subjects: fast evidence that a process stopped.

Every member runs a pulse responder, a native thread that answers authenticated UDP pings while
its process runs at all (:mod:`.pulse_wire`). An observer pings each of its subjects' responders
every :data:`PULSE_INTERVAL_S`; :data:`PULSE_MISSES` unanswered pings in a row make the subject
*silent*, and the observer tells the core (``Member.report_silent``), which raises a silent alert
at once. A subject whose event loop is blocked (scenario S01: a thread holding the GIL, a
synchronous CUDA call) still answers, so only a process that is stopped, frozen, gone or cut off
goes silent, and its removal is owed no refutation window: about 0.5 s from the stop to the
decision instead of 3.1 s.

:class:`PulseTracker` is the bookkeeping, sans-IO like the core (time passed in, nonces from an
injected source); :class:`PulseProber` puts it on a UDP socket of the agent's loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from torchpass_p2p.core.configuration import Address
from torchpass_p2p.core.messages import MemberId
from torchpass_p2p.kernel_drops import socket_drops
from torchpass_p2p.tasks import OwnedTasks

from .pulse_wire import decode_pong, encode_ping, ping_nonce
from .wakeup import Wakeup

__all__ = ["PULSE_INTERVAL_S", "PULSE_MISSES", "PULSE_TIMEOUT_S", "PulseProber", "PulseTracker"]

log = logging.getLogger("torchpass_p2p.agent")

PULSE_INTERVAL_S = 0.1
"""Seconds between two pings to one subject. An observer watches at most K = 10 subjects (Rapid
section 4.1), so at most 100 pings and their pongs (45 bytes each) a second."""
PULSE_TIMEOUT_S = 0.1
"""A ping unanswered this long is a miss. The responder is a native thread: it answers within a
scheduling delay plus the round trip (well under 1 ms on loopback and LAN), however busy the
subject's Python is."""
PULSE_MISSES = 4
"""Consecutive misses that make a subject silent: 0.4-0.5 s after its process stopped. A ping
and its pong cross the network, so at 1 % datagram loss a ping is missed 2 % of the time and
four in a row once in 6 million windows: about once an hour among 36 members watching 10
subjects each (the simulator's S01 runs saw 4 false silences in 2 minutes with three misses).
A false silence costs one refuted alert; a removal still needs the silent alerts of every
observer it counts (``Params.alerts_to_remove``, capped by the configuration's rings) plus a
decision."""
STALL_TOLERANCE_S = 0.25
"""A poll this much later than due means our own loop stalled: the answers may be waiting unread,
so the pings then outstanding count as nothing (``Params.stall_tolerance_s``, same value)."""
ANSWER_KEEP_S = 1.0
"""A pong this late (after its ping was counted a miss) is still a sign of life."""


class PulseTracker:
    """Which pings to send, which went unanswered, and which subjects are silent.

    Args:
        nonce: returns a fresh nonce of :data:`~.pulse_wire.NONCE_BYTES` bytes (in use the
            prober's id and a sequence, :func:`~.pulse_wire.ping_nonce`; the simulator's and
            the tests' are counters, so that runs repeat exactly).
        interval_s, timeout_s, misses, stall_tolerance_s: see the module's constants.
    """

    def __init__(self, nonce: Callable[[], bytes], *, interval_s: float = PULSE_INTERVAL_S,
                 timeout_s: float = PULSE_TIMEOUT_S, misses: int = PULSE_MISSES,
                 stall_tolerance_s: float = STALL_TOLERANCE_S) -> None:
        if not 0 < timeout_s <= ANSWER_KEEP_S or interval_s <= 0 or misses < 1:
            raise ValueError("need 0 < timeout_s <= ANSWER_KEEP_S, interval_s > 0, misses >= 1")
        self._nonce = nonce
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.misses = misses
        self.stall_tolerance_s = stall_tolerance_s
        self._targets: dict[MemberId, Address] = {}
        self._next_at: dict[MemberId, float] = {}
        self._missed: dict[MemberId, int] = {}
        self._sent: dict[bytes, tuple[MemberId, float]] = {}  # nonce -> (target, sent at)
        self._due: dict[bytes, float] = {}  # nonces not yet counted: nonce -> when it is a miss
        self._polled_at: float | None = None
        self._answered_at: dict[MemberId, float] = {}
        self._streak_at: dict[MemberId, float] = {}  # when the first ping of a miss streak went
        self.silent: set[MemberId] = set()
        """Targets silent now (since their last answer)."""
        self._reported: set[MemberId] = set()  # silent ones handed out by poll()
        self._withheld: set[MemberId] = set()  # silent ones poll() could not vouch for yet
        self.counters: Counter[str] = Counter()

    @property
    def targets(self) -> Mapping[MemberId, Address]:
        return self._targets

    def watch(self, now: float, targets: Mapping[MemberId, Address]) -> None:
        """Watch exactly ``targets`` (member -> its responder's address) from now on: a new one
        is pinged at once, a dropped one forgotten, one whose address moved starts afresh."""
        for member in [m for m, a in self._targets.items() if targets.get(m) != a]:
            del self._targets[member]
            self._next_at.pop(member, None)
            self._missed.pop(member, None)
            self._answered_at.pop(member, None)
            self._streak_at.pop(member, None)
            self.silent.discard(member)
            self._reported.discard(member)
            self._withheld.discard(member)
        for nonce in [n for n, (m, _) in self._sent.items() if m not in self._targets]:
            del self._sent[nonce]
            self._due.pop(nonce, None)
        for member, address in targets.items():
            if member not in self._targets:
                self._targets[member] = address
                self._next_at[member] = now
                self._missed[member] = 0

    def answered(self, now: float, nonce: bytes, member: MemberId) -> bool:
        """A verified pong from ``member`` echoing ``nonce``. Returns True when it answered a
        ping of ours to that member (sent at most ``ANSWER_KEEP_S`` ago)."""
        sent = self._sent.get(nonce)
        if sent is None or sent[0] != member:
            self.counters["pongs_unexpected"] += 1
            return False
        del self._sent[nonce]
        if self._due.pop(nonce, None) is None:
            self.counters["pongs_late"] += 1
        self.counters["pongs"] += 1
        self._missed[member] = 0
        self._answered_at[member] = now
        if member in self.silent:
            self.silent.discard(member)
            self._reported.discard(member)
            self._withheld.discard(member)
            self.counters["answered_again"] += 1
        return True

    def poll(self, now: float) -> tuple[list[tuple[MemberId, Address, bytes]], list[MemberId]]:
        """Advance to ``now``: returns the pings to send now, as (member, address, nonce), and
        the members that went silent (each once per silence).

        A silence is handed out only once another watched target answered during it (after
        the first missed ping of the silent one was due), or when only one is watched: when
        every target falls silent at once, the likelier cause is our own network (a receive
        path lost, scenario S06), and the core's probes, which suspect ourselves first, are
        left to judge."""
        stalled = (self._polled_at is not None
                   and now - self._polled_at > self.interval_s + self.stall_tolerance_s)
        self._polled_at = now
        if stalled:
            # Our loop did not run: the pings then outstanding were not the subjects' fault.
            self.counters["stalls"] += 1
            self.counters["pings_voided"] += len(self._due)
            self._due.clear()
            for member in self._missed:
                self._missed[member] = 0
        silent: list[MemberId] = []
        for nonce, miss_at in list(self._due.items()):
            if now < miss_at:
                continue
            del self._due[nonce]
            member = self._sent[nonce][0]
            self.counters["misses"] += 1
            if not self._missed[member]:
                self._streak_at[member] = miss_at
            self._missed[member] += 1
            if self._missed[member] >= self.misses:
                self.silent.add(member)
        if len(self._reported) < len(self.silent):
            for member in sorted(self.silent - self._reported):
                since = self._streak_at[member]
                if len(self._targets) == 1 or any(
                        at >= since for m, at in self._answered_at.items() if m != member):
                    self._reported.add(member)
                    self._withheld.discard(member)
                    silent.append(member)
                elif member not in self._withheld:
                    self._withheld.add(member)
                    self.counters["silences_withheld"] += 1
        for nonce, (_, sent_at) in list(self._sent.items()):
            if now - sent_at >= ANSWER_KEEP_S:
                del self._sent[nonce]
        pings: list[tuple[MemberId, Address, bytes]] = []
        for member, address in self._targets.items():
            if now < self._next_at[member]:
                continue
            nonce = self._nonce()
            self._sent[nonce] = (member, now)
            self._due[nonce] = now + self.timeout_s
            # From now, not from when it was due: a late poll sends one ping, not a burst.
            self._next_at[member] = now + self.interval_s
            pings.append((member, address, nonce))
        self.counters["pings"] += len(pings)
        return pings, silent

    def next_deadline(self) -> float:
        """When :meth:`poll` has work next (seconds; ``inf`` with nothing watched)."""
        return min([*self._next_at.values(), *self._due.values()], default=float("inf"))


class PulseProber(asyncio.DatagramProtocol):
    """A :class:`PulseTracker` on a UDP socket of the running loop.

    Args:
        prober: this member's id: with a sequence from 1, each ping's nonce
            (:func:`~.pulse_wire.ping_nonce`; responders drop a sequence they saw).
        kid, secrets: the key id pings are sent under and every key id's pulse secret (pongs
            under any of them are accepted: a key rotation moves the primary first).
        on_silent: called on the loop with each member that went silent.
        clock: monotonic seconds.
        key_for: the key id to ping a member under, if not ``kid`` (a member still on an older
            key that ``secrets`` holds: its responder knows only that one); an id without a
            secret here means ``kid``.
    """

    def __init__(self, prober: MemberId, kid: int, secrets: Mapping[int, bytes],
                 on_silent: Callable[[MemberId], None], *,
                 clock: Callable[[], float], tracker: PulseTracker | None = None,
                 key_for: Callable[[MemberId], int] | None = None) -> None:
        self._kid = kid
        self._secrets = dict(secrets)
        self._key_for = key_for
        self._on_silent = on_silent
        self._clock = clock
        sequence = itertools.count(1)
        self.tracker = tracker or PulseTracker(lambda: ping_nonce(prober, next(sequence)))
        self._transport: asyncio.DatagramTransport | None = None
        self._socket: socket.socket | None = None
        self._tasks = OwnedTasks("pulse-prober", 1)  # the ping loop
        self._wake = Wakeup()

    async def start(self, host: str) -> None:
        """Bind a UDP socket on ``host`` (any port) and start pinging. Raises OSError."""
        loop = asyncio.get_running_loop()
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, 0, type=socket.SOCK_DGRAM)[0]
        sock = socket.socket(family, kind, proto)
        try:  # bound here, not by create_datagram_endpoint: its socket is ours to ask
            sock.bind(address)
            sock.setblocking(False)
            transport, _ = await loop.create_datagram_endpoint(lambda: self, sock=sock)
        except BaseException:
            sock.close()
            raise
        self._socket = sock
        self._transport = transport  # type: ignore[assignment]
        self._tasks.spawn(self._run(), name="ping")

    def rekey(self, kid: int, secrets: Mapping[int, bytes]) -> None:
        """Ping under ``kid`` and accept pongs under ``secrets`` from now on (a reloaded key
        file). Raises KeyError if ``secrets`` lacks ``kid``."""
        self._secrets = {**secrets, kid: secrets[kid]}
        self._kid = kid

    def watch(self, targets: Mapping[MemberId, Address]) -> None:
        """Watch exactly ``targets`` (member -> responder address) from now on."""
        self.tracker.watch(self._clock(), targets)
        self._wake.set()

    def counters(self) -> dict[str, int]:
        """The tracker's counters, with ``kernel_dropped``: datagrams (pongs, or anything
        else) lost in this socket's full receive buffer (:mod:`torchpass_p2p.kernel_drops`)."""
        self._read_kernel_drops()
        return dict(self.tracker.counters)

    def _read_kernel_drops(self) -> None:
        if self._transport is not None and self._socket is not None:
            dropped = socket_drops(self._socket)
            if dropped:  # the kernel's total since the socket was made
                self.tracker.counters["kernel_dropped"] = dropped

    async def close(self) -> None:
        """Stop pinging and close the socket. Idempotent."""
        await self._tasks.close(1.0)  # it ends at its next await
        if self._transport is not None:
            self._read_kernel_drops()  # the last figure: the socket goes with the transport
            self._transport.close()
            self._transport = None

    async def _run(self) -> None:
        tracker = self.tracker
        while True:
            pings, silent = tracker.poll(self._clock())
            transport = self._transport
            for member, address, nonce in pings:
                if transport is not None:
                    kid = self._kid if self._key_for is None else self._key_for(member)
                    if kid not in self._secrets:
                        kid = self._kid
                    try:
                        # Addressed to ``member``: no other responder answers it (pulse_wire).
                        transport.sendto(encode_ping(kid, self._secrets[kid], nonce, member),
                                         address)
                    except OSError:  # a missing route shows as misses, which is the point
                        tracker.counters["send_errors"] += 1
            for member in silent:
                try:
                    self._on_silent(member)
                except Exception:  # the agent's code: it must not end the pulse
                    log.exception("pulse: the silence handler failed for %016x", member)
            delay = min(tracker.next_deadline() - self._clock(), 1.0)
            if delay > 0:
                self._wake.clear()
                await self._wake.sleep(delay)

    # asyncio.DatagramProtocol

    def datagram_received(self, data: bytes, addr: Any) -> None:
        pong = decode_pong(data, self._secrets)
        if pong is None:
            self.tracker.counters["pongs_invalid"] += 1
            return
        self.tracker.answered(self._clock(), *pong)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable from a gone responder, reported on a later call: a miss anyway.
        self.tracker.counters["receive_errors"] += 1
