"""A fleet of real membership cores on the virtual clock and network.

Each :class:`SimMember` wraps one unmodified :class:`torchpass_p2p.core.Member`. The cluster plays
the host's part for all of them: it delivers datagrams, fires timers at ``next_deadline()`` (with
lazy invalidation: a stale heap entry is skipped), drains outboxes into the network and events into
the recorders. Faults act on the host side only (a crashed member gets nothing, a blocked member
gets everything late), exactly as a real process would see them.

With ``pulse=True`` every member also runs the agent's pulse prober (the same
:class:`~torchpass_p2p.agent.pulse.PulseTracker`) against its subjects' pulse responders: a ping
and its pong cross the virtual network; a responder answers unless its process crashed or is
frozen (:meth:`Cluster.block` with ``frozen``: SIGSTOP), however long its loop is blocked (a GIL
holder, scenario S01). The prober runs on the member's loop, so a blocked member pings late.

Datagrams travel as message objects by default. With ``sealed=True`` every datagram is encoded,
sealed with the real AEAD, opened and decoded on arrival, so small runs exercise the wire path;
with ``count_bytes=True`` the objects are encoded only to measure their size.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from torchpass_p2p.agent.pulse import PulseTracker
from torchpass_p2p.core import Configuration, Member, MemberId, Params
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.membership import Transitions
from torchpass_p2p.core.messages import Ack, Join, Joiner, Message, Topology
from torchpass_p2p.core.plan import Policy
from torchpass_p2p.core.seal import Keyring
from torchpass_p2p.core.sizes import encoded_size
from torchpass_p2p.core.wire import Wire

from .engine import CALL, DELIVER, TIMER, Engine
from .network import LinkModel, Network

SEAL_OVERHEAD_BYTES: Final = 18 + 16
"""Header (version, key id, sender, incarnation, counter) plus the Poly1305 tag."""


@dataclass(slots=True)
class SimMember:
    """Host-side state of one simulated process."""

    index: int
    core: Member
    timer_at: float = math.inf
    crashed: bool = False
    blocked_until: float = 0.0
    sent_bytes: int = 0
    recv_bytes: int = 0
    sent_packets: int = 0
    recv_packets: int = 0
    wire: Wire | None = None
    events: list[ev.Event] = field(default_factory=list)
    frozen_until: float = 0.0
    """Until then the whole process is stopped (SIGSTOP): its pulse responder answers nothing."""
    pulse: PulseTracker | None = None
    pulse_at: float = math.inf
    pulse_config: int = -1  # the configuration whose subjects ``pulse`` watches

    @property
    def id(self) -> MemberId:
        return self.core.id


class Cluster:
    """``n`` members in configuration 0 (``ranks`` of them hold ranks, the rest are spares).

    Args:
        members: total number of members.
        spares: how many of them are spares (the last ones).
        seed: fixes member ids, every member's randomness and the network's.
        params: protocol parameters shared by every member.
        link: the default link model.
        sealed: send real sealed datagrams (slow; small runs and tests).
        count_bytes: measure datagram sizes with the real codec (objects mode).
        keep_events: keep each member's events in ``SimMember.events``.
        policy: what a decided change does when no spare is left (every member's).
        pulse: every member watches its subjects' pulse responders (module docstring).
    """

    def __init__(
        self,
        members: int,
        *,
        spares: int = 0,
        seed: int = 0,
        params: Params | None = None,
        link: LinkModel | None = None,
        sealed: bool = False,
        count_bytes: bool = False,
        keep_events: bool = True,
        policy: Policy = Policy.WAIT,
        pulse: bool = False,
    ) -> None:
        self.seed = seed
        self.pulse = pulse
        self.policy = policy
        self.started_in: dict[MemberId, int] = {}
        """Joiners: the config_id of the configuration each was handed when it started."""
        self.exits_reported: set[MemberId] = set()
        """Crashed members whose exit a launcher reported (:meth:`report_exited`)."""
        self.send_delays: dict[MemberId, tuple[float, bool]] = {}
        """member -> (seconds, acks only): every datagram it sends now (with acks only, every
        ``Ack`` and pulse answer) leaves that much later (:meth:`delay_sends`)."""
        self.lost_joins: dict[MemberId, int] = {}
        """joiner -> how many of its next ``Join`` datagrams the network loses."""
        self.params = params or Params()
        self.rng = random.Random(seed)
        ids = sorted({self.rng.getrandbits(64) for _ in range(members)})
        while len(ids) < members:  # pragma: no cover - 64-bit collisions
            ids = sorted(set(ids) | {self.rng.getrandbits(64)})
        order = ids[:]
        self.rng.shuffle(order)
        ranks, spare_ids = order[: members - spares], order[members - spares:]
        self.configuration = Configuration(0, ranks, spare_ids, observers=self.params.observers)
        self.engine = Engine()
        self.network = Network(random.Random(self.rng.getrandbits(64)), link or LinkModel())
        self.members: list[SimMember] = []
        self.by_id: dict[MemberId, SimMember] = {}
        self.keep_events = keep_events
        self.count_bytes = count_bytes
        self.sealed = sealed
        self.listeners: list[Callable[[SimMember, ev.Event], None]] = []
        self.counters: Counter[str] = Counter()
        self._key = self.rng.randbytes(32)
        self._transitions: Transitions = {}  # one next configuration per change, shared
        for mid in self.configuration.members:
            self._add(Member(mid, self.configuration, params=self.params, policy=policy,
                             transitions=self._transitions,
                             rng=random.Random(self.rng.getrandbits(64)), now=0.0))
        self._count_sizes = count_bytes and not sealed
        for sm in self.members:
            self._arm(sm)

    # ------------------------------------------------------------------ running

    @property
    def now(self) -> float:
        return self.engine.now

    def run(self, until: float) -> None:
        """Advance the virtual clock to ``until`` seconds, handling everything due."""
        engine = self.engine
        entry = engine.pop_due(until)
        while entry is not None:
            kind = entry.kind
            if kind == DELIVER:
                self._deliver(entry.a, entry.b, entry.c)
            elif kind == TIMER:
                self._timer(entry.a, entry.b)
            elif kind == CALL:
                entry.a()
            entry = engine.pop_due(until)
        engine.settle(until)

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Schedule ``fn()`` at virtual time ``when``."""
        self.engine.call_at(when, fn)

    def live(self) -> list[SimMember]:
        return [sm for sm in self.members if not sm.crashed and not sm.core.removed]

    # ------------------------------------------------------------------ faults

    def crash(self, sm: SimMember) -> None:
        """The process is gone: it sends and receives nothing, its timers never fire."""
        sm.crashed = True
        sm.timer_at = math.inf

    def block(self, sm: SimMember, duration_s: float, *, frozen: bool = False) -> None:
        """The member's loop is blocked for ``duration_s``: datagrams queue in its socket
        buffer and its timers fire late, all at the end of the block (a GIL holder). With
        ``frozen`` the whole process is stopped (SIGSTOP): its pulse responder is silent too."""
        sm.blocked_until = max(sm.blocked_until, self.now + duration_s)
        if frozen:
            sm.frozen_until = max(sm.frozen_until, self.now + duration_s)

    def delay_sends(self, sm: SimMember, delay_s: float, *, acks_only: bool = False) -> None:
        """From now on every datagram ``sm`` sends arrives ``delay_s`` seconds later than the
        link alone would deliver it (an egress queue or a slow send path); with ``acks_only``
        only its acks (``Ack``, direct or relayed, and pulse answers). ``delay_s = 0`` ends
        the delay. Datagrams already in flight keep their arrival time."""
        if delay_s > 0:
            self.send_delays[sm.id] = (delay_s, acks_only)
        else:
            self.send_delays.pop(sm.id, None)

    def spawn_joiner(self, via: SimMember, *, host: str = "", lost_joins: int = 0) -> SimMember:
        """Start a new process now that asks to join as a spare. Like a real one, it fetched
        the configuration ``via`` holds (the runtime serves it over HTTP) and sends its Join to
        that member's peers. Its member id is fresh, never one used before. The network loses
        its first ``lost_joins`` Join datagrams (a join attempt that fails); it re-sends one
        every ``join_retry_s``."""
        mid = self.rng.getrandbits(64)
        while mid in self.by_id:  # pragma: no cover - 64-bit collisions
            mid = self.rng.getrandbits(64)
        config = via.core.configuration
        joiner = Joiner(mid, "sim", 1 + len(self.members) % 65535, Topology(host))
        seeds = tuple(m for m in config.members if not self.by_id[m].crashed)[:8] or (via.id,)
        core = Member(mid, config, params=self.params, policy=self.policy, joining=joiner,
                      seeds=seeds, transitions=self._transitions,
                      rng=random.Random(self.rng.getrandbits(64)), now=self.now)
        self.started_in[mid] = config.config_id
        if lost_joins > 0:
            self.lost_joins[mid] = lost_joins
        sm = self._add(core)
        self._arm(sm)
        return sm

    def leave(self, sm: SimMember) -> None:
        """The member leaves gracefully now (drain, shutdown): its Left goes out at once."""
        sm.core.leave(self.now)
        self._after(sm)

    def report_exited(self, sm: SimMember, subject: MemberId) -> None:
        """``sm``'s launcher reaped ``subject``, its sibling on the same host, and reports the
        exit to ``sm`` now (``Member.report_exited``; a crashed ``sm`` hears nothing).

        Raises:
            ValueError: ``subject`` has not crashed (a launcher reports only a reaped process).
        """
        if not self.by_id[subject].crashed:
            raise ValueError("only a crashed member's exit can be reported")
        self.exits_reported.add(subject)
        if sm.crashed:
            return
        sm.core.report_exited(self.now, subject)
        self._after(sm)

    # ------------------------------------------------------------------ host side

    def _add(self, core: Member) -> SimMember:
        sm = SimMember(len(self.members), core)
        if self.pulse:
            sm.pulse = PulseTracker(_counter_nonces())
        if self.sealed:
            sm.wire = Wire(f"sim-{self.seed}", Keyring(self._key), core.id)
        self.members.append(sm)
        self.by_id[core.id] = sm
        return sm

    def _deliver(self, sm: SimMember, sender: MemberId, data: Message | bytes) -> None:
        if sm.crashed:
            return
        now = self.engine.now
        if sm.blocked_until > now:
            self.engine.push(sm.blocked_until, DELIVER, sm, sender, data)
            return
        message: Message
        if isinstance(data, bytes):
            assert sm.wire is not None
            opened = sm.wire.open(data)
            if opened is None:
                self.counters["rejected"] += 1
                return
            sender, message = opened.sender, opened.message
        else:
            message = data
        sm.core.receive(now, sender, message)
        self._after(sm)

    def _timer(self, sm: SimMember, at: float) -> None:
        if sm.crashed or sm.timer_at != at:
            return  # stale entry: the deadline moved since this was pushed
        now = self.engine.now
        if sm.blocked_until > now:
            self.engine.push(sm.blocked_until, TIMER, sm, at)
            return
        sm.core.handle_timer(now)
        self._after(sm)

    def _after(self, sm: SimMember) -> None:
        core = sm.core
        out = core.messages_to_send()
        if out:
            self._transmit(sm, out)
        event = core.next_event()
        while event is not None:
            if self.keep_events:
                sm.events.append(event)
            for listener in self.listeners:
                listener(sm, event)
            event = core.next_event()
        self._arm(sm)
        if sm.pulse is not None:
            self._watch_pulses(sm)

    def _arm(self, sm: SimMember) -> None:
        deadline = sm.core.next_deadline()
        if deadline != sm.timer_at:
            sm.timer_at = deadline
            if deadline != math.inf:
                self.engine.push(max(deadline, self.engine.now), TIMER, sm, deadline)

    # ------------------------------------------------------------------ pulses

    def _watch_pulses(self, sm: SimMember) -> None:
        tracker = sm.pulse
        assert tracker is not None
        core = sm.core
        config_id = -2 if core.removed or core.left else core.configuration.config_id
        if config_id != sm.pulse_config:
            sm.pulse_config = config_id
            subjects = core.subjects if config_id >= 0 else ()
            tracker.watch(self.engine.now, {m: ("sim", 0) for m in subjects})
        self._arm_pulse(sm)

    def _arm_pulse(self, sm: SimMember) -> None:
        assert sm.pulse is not None
        due = sm.pulse.next_deadline()
        if due != sm.pulse_at:
            sm.pulse_at = due
            if due != math.inf:
                at = max(due, self.engine.now)
                self.engine.call_at(at, lambda: self._poll_pulses(sm, due))

    def _poll_pulses(self, sm: SimMember, due: float) -> None:
        tracker = sm.pulse
        if sm.crashed or sm.pulse_at != due or tracker is None:
            return  # stale: the deadline moved since this was scheduled
        now = self.engine.now
        if sm.blocked_until > now:  # the prober runs on the member's loop
            self.engine.call_at(sm.blocked_until, lambda: self._poll_pulses(sm, due))
            return
        sm.pulse_at = math.inf
        pings, silent = tracker.poll(now)
        src = sm.core.id
        late = self._send_delay(src, False)
        for member, _address, nonce in pings:
            ping_delay, _ = self.network.arrivals(src, member)
            target = self.by_id.get(member)
            if ping_delay >= 0 and target is not None:
                self._ping_arrives(target, sm, nonce, now + ping_delay + late)
        for member in silent:
            sm.core.report_silent(now, member)
        if silent:
            self._after(sm)
        else:
            self._arm_pulse(sm)

    def _ping_arrives(self, responder: SimMember, prober: SimMember, nonce: bytes,
                      at: float) -> None:
        def answer() -> None:
            if responder.crashed:
                return
            now = self.engine.now
            if responder.frozen_until > now:  # queued in the socket: answered on SIGCONT
                self.engine.call_at(responder.frozen_until, answer)
                return
            src = responder.core.id
            pong_delay, _ = self.network.arrivals(src, prober.core.id)
            if pong_delay >= 0:
                late = self._send_delay(src, True)
                self._pong_arrives(prober, src, nonce, now + pong_delay + late)
        self.engine.call_at(at, answer)

    def _pong_arrives(self, prober: SimMember, member: MemberId, nonce: bytes,
                      at: float) -> None:
        def read() -> None:
            tracker = prober.pulse
            if prober.crashed or tracker is None:
                return
            now = self.engine.now
            if prober.blocked_until > now:
                self.engine.call_at(prober.blocked_until, read)
                return
            tracker.answered(now, nonce, member)
        self.engine.call_at(at, read)

    def _send_delay(self, src: MemberId, is_ack: bool) -> float:
        """Seconds added to a datagram ``src`` sends now (:meth:`delay_sends`)."""
        rule = self.send_delays.get(src) if self.send_delays else None
        if rule is None or (rule[1] and not is_ack):
            return 0.0
        return rule[0]

    def _transmit(self, sm: SimMember, out: list[tuple[MemberId, Message]]) -> None:
        engine = self.engine
        now = engine.now
        net = self.network
        by_id = self.by_id
        count_sizes = self._count_sizes
        src = sm.core.id
        # Fault rules, looked up once per batch: on a fault-free run both dicts are empty.
        delay_rule = self.send_delays.get(src) if self.send_delays else None
        joins_lost = self.lost_joins.get(src, 0) if self.lost_joins else 0
        for dst, message in out:
            target = by_id.get(dst)
            if target is None:
                continue
            data: Message | bytes
            if sm.wire is not None:
                data = sm.wire.seal(message, sm.core.incarnation)
                size = len(data)
            else:
                data = message
                size = encoded_size(message) + SEAL_OVERHEAD_BYTES if count_sizes else 0
            sm.sent_packets += 1
            sm.sent_bytes += size
            if joins_lost and type(message) is Join:
                joins_lost -= 1
                self._lose_join(src, joins_lost)
                continue
            first, second = net.arrivals(src, dst)
            if first >= 0:
                sent = now
                if delay_rule is not None and (not delay_rule[1] or type(message) is Ack):
                    sent += delay_rule[0]
                target.recv_packets += 1
                target.recv_bytes += size
                engine.push(sent + first, DELIVER, target, src, data)
                if second >= 0:
                    target.recv_packets += 1
                    target.recv_bytes += size
                    engine.push(sent + second, DELIVER, target, src, data)
                    if net.link.duplicate_copies > 1:
                        for extra in net.extra_copies():
                            target.recv_packets += 1
                            target.recv_bytes += size
                            engine.push(sent + extra, DELIVER, target, src, data)

    def _lose_join(self, joiner: MemberId, left: int) -> None:
        """One ``Join`` of ``joiner`` lost on purpose (:meth:`spawn_joiner`'s ``lost_joins``):
        it was sent (and counted as sent), and the network dropped it."""
        self.network.dropped += 1
        self.counters["joins_lost"] += 1
        if left:
            self.lost_joins[joiner] = left
        else:
            del self.lost_joins[joiner]


def _counter_nonces() -> Callable[[], bytes]:
    """Nonces for a simulated prober: distinct and repeatable (same seed, same trace)."""
    count = 0

    def nonce() -> bytes:
        nonlocal count
        count += 1
        return count.to_bytes(16, "big")
    return nonce
