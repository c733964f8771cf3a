"""The pulse tracker stepped by hand (exact pings, misses and silences), then the prober and real
responders on loopback."""

from __future__ import annotations

import asyncio
import itertools
import socket
import sys
import time
from dataclasses import replace

import pytest

from tests.agent.cluster import LocalCluster
from torchpass_p2p.agent import pulse_wire
from torchpass_p2p.agent.pulse import PulseProber, PulseTracker
from torchpass_p2p.agent.pulse_wire import decode_ping, decode_pong, encode_ping, ping_nonce
from torchpass_p2p.agent.settings import SettingsError, load_settings
from torchpass_p2p.core.params import Params

A = ("127.0.0.1", 9001)
B = ("127.0.0.1", 9002)


def tracker(**kw) -> PulseTracker:
    counter = itertools.count(1)
    return PulseTracker(lambda: next(counter).to_bytes(16, "big"), **kw)


def nonce(i: int) -> bytes:
    return i.to_bytes(16, "big")


U = 0.125
"""Interval and timeout of the hand-stepped tracker: a binary fraction, so that sums of it are
exact and every deadline falls on the poll times the tests name."""


def test_a_new_target_is_pinged_at_once_then_every_interval():
    t = tracker(interval_s=U, timeout_s=U, misses=3)
    t.watch(0.0, {1: A, 2: B})
    assert t.poll(0.0) == ([(1, A, nonce(1)), (2, B, nonce(2))], [])
    assert t.next_deadline() == U
    assert t.answered(0.01, nonce(1), 1) and t.answered(0.02, nonce(2), 2)
    assert t.poll(0.05) == ([], [])
    assert t.poll(U) == ([(1, A, nonce(3)), (2, B, nonce(4))], [])
    assert t.counters["pings"] == 4 and t.counters["pongs"] == 2 and t.counters["misses"] == 0


def test_three_misses_in_a_row_make_a_target_silent_once_and_an_answer_ends_it():
    t = tracker(interval_s=U, timeout_s=U, misses=3)
    t.watch(0.0, {1: A})
    silent_at = []
    for i in range(8):
        pings, silent = t.poll(i * U)
        assert [p[0] for p in pings] == [1]
        if silent:
            silent_at.append((i, silent))
    # Pings at 0, U, 2U are misses at U, 2U, 3U: silent at the third, reported once.
    assert silent_at == [(3, [1])]
    assert t.silent == {1} and t.counters["misses"] == 7
    # A late pong to a ping already counted as a miss is still a sign of life.
    assert t.answered(7.5 * U, nonce(7), 1)
    assert t.silent == set() and t.counters["answered_again"] == 1
    assert t.counters["pongs_late"] == 1


def test_an_answer_between_misses_resets_the_count():
    t = tracker(interval_s=U, timeout_s=U, misses=3)
    t.watch(0.0, {1: A})
    t.poll(0.0)
    t.poll(U)  # miss 1 (ping 1), ping 2
    t.poll(2 * U)  # miss 2 (ping 2), ping 3
    assert t.answered(2.5 * U, nonce(3), 1)
    t.poll(3 * U)  # ping 4
    assert t.poll(4 * U)[1] == [] and t.poll(5 * U)[1] == []  # misses 1 and 2 again
    assert t.poll(6 * U)[1] == [1]


def test_a_stalled_poll_voids_the_outstanding_pings():
    t = tracker(interval_s=U, timeout_s=U, misses=3, stall_tolerance_s=0.25)
    t.watch(0.0, {1: A})
    t.poll(0.0)
    t.poll(U)
    t.poll(2 * U)  # two misses so far
    # Our loop stalled for a second: nothing outstanding counts, the count starts again.
    pings, silent = t.poll(10 * U)
    assert silent == [] and t.counters["stalls"] == 1 and t.counters["pings_voided"] == 1
    assert [p[0] for p in pings] == [1]  # one ping, not a burst of the missed ones
    assert t.poll(11 * U)[1] == [] and t.poll(12 * U)[1] == [] and t.poll(13 * U)[1] == [1]


def test_a_silence_is_handed_out_only_while_another_target_still_answers():
    t = tracker(interval_s=U, timeout_s=U, misses=2)
    t.watch(0.0, {1: A, 2: B})
    for i in range(3):  # member 2 answers every ping, member 1 none
        pings, silent = t.poll(i * U)
        assert t.answered(i * U, next(n for m, _, n in pings if m == 2), 2)
    assert silent == [1]  # two misses (pings at 0 and U), and member 2 vouches for our network
    # Now member 2 falls silent too, and nobody is left to vouch: held back, as is a silence
    # of every target at once (our receive path lost: scenario S06), for the probes to judge.
    reported = [m for i in range(3, 8) for m in t.poll(i * U)[1]]
    assert reported == [] and t.silent == {1, 2}
    assert t.counters["silences_withheld"] == 1
    # Member 1 answers again: it vouches for our network, and member 2's silence goes out.
    assert t.answered(8 * U - 0.01, next(n for n, (m, _) in t._sent.items() if m == 1), 1)
    assert t.poll(8 * U)[1] == [2]


def test_pongs_for_another_member_or_unknown_nonces_count_for_nothing():
    t = tracker()
    t.watch(0.0, {1: A, 2: B})
    t.poll(0.0)
    assert not t.answered(0.01, nonce(1), 2)  # member 2 echoing member 1's nonce
    assert not t.answered(0.01, nonce(99), 1)
    assert t.counters["pongs_unexpected"] == 2 and t.counters["pongs"] == 0


def test_watching_a_new_set_forgets_the_dropped_and_restarts_a_moved_target():
    t = tracker(interval_s=U, timeout_s=U, misses=1)
    t.watch(0.0, {1: A, 2: B})
    t.poll(0.0)
    assert t.poll(U)[1] == [] and t.silent == {1, 2}
    t.watch(1.5 * U, {1: ("127.0.0.1", 9003)})
    assert t.silent == set() and dict(t.targets) == {1: ("127.0.0.1", 9003)}
    assert t.poll(1.5 * U)[0] == [(1, ("127.0.0.1", 9003), nonce(5))]
    assert not t.answered(1.6 * U, nonce(4), 2)  # forgotten


def test_bad_settings_raise():
    with pytest.raises(ValueError):
        tracker(timeout_s=0.0)
    with pytest.raises(ValueError):
        tracker(misses=0)


# ------------------------------------------------------------------ on loopback

needs_native = pytest.mark.skipif(not pulse_wire.available(),
                                  reason="pulse responder not built (./scripts/build-native)")
SECRETS = {7: bytes(range(32))}


@needs_native
async def test_the_prober_hears_a_live_responder_and_finds_a_closed_one_silent():
    silent: list[int] = []
    prober = PulseProber(99, 7, SECRETS, silent.append, clock=time.monotonic)
    alive = pulse_wire.PulseResponder.start("127.0.0.1", 11, SECRETS)
    gone = pulse_wire.PulseResponder.start("127.0.0.1", 12, SECRETS)
    try:
        await prober.start("127.0.0.1")
        prober.watch({11: ("127.0.0.1", alive.port), 12: ("127.0.0.1", gone.port)})
        await asyncio.sleep(0.3)
        assert silent == [] and prober.counters()["pongs"] >= 4
        gone.close()
        async with asyncio.timeout(5.0):
            while not silent:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        assert silent == [12] and prober.tracker.silent == {12}
        assert alive.counts()["answered"] >= 4
    finally:
        await prober.close()
        alive.close()
        gone.close()


@needs_native
async def test_pongs_under_another_key_are_not_a_sign_of_life():
    silent: list[int] = []
    prober = PulseProber(99, 7, SECRETS, silent.append, clock=time.monotonic)
    other = pulse_wire.PulseResponder.start("127.0.0.1", 11, {7: bytes(32)})
    try:
        await prober.start("127.0.0.1")
        prober.watch({11: ("127.0.0.1", other.port)})
        async with asyncio.timeout(5.0):
            while not silent:
                await asyncio.sleep(0.02)
        assert silent == [11] and other.counts()["bad_tag"] >= 3
        assert prober.counters().get("pongs", 0) == 0
    finally:
        await prober.close()
        other.close()


async def test_datagrams_lost_in_the_probers_full_buffer_are_counted():
    if not sys.platform.startswith("linux"):
        pytest.skip("SO_MEMINFO is Linux's")
    prober = PulseProber(99, 7, SECRETS, print, clock=time.monotonic)
    sent = 200
    await prober.start("127.0.0.1")
    try:
        assert prober._socket is not None
        prober._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the minimum
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(sent):  # this loop cannot read meanwhile: most are dropped
                s.sendto(b"\x00", prober._socket.getsockname())
        async with asyncio.timeout(10.0):
            while (c := prober.counters()).get("pongs_invalid", 0) \
                    + c.get("kernel_dropped", 0) < sent:
                await asyncio.sleep(0.005)
        assert c["kernel_dropped"] > 0
        assert c["pongs_invalid"] + c["kernel_dropped"] == sent  # each once
    finally:
        await prober.close()
    assert prober.counters()["kernel_dropped"] == c["kernel_dropped"]  # kept past the close


class Tap(asyncio.DatagramProtocol):
    """A wiretap on the path to one responder: forwards the prober's pings to it and its pongs
    back, and keeps a copy of every ping."""

    def __init__(self, responder: tuple[str, int]) -> None:
        self.responder = responder
        self.prober: tuple[str, int] | None = None
        self.captured: list[bytes] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        assert self.transport is not None
        if addr == self.responder:
            if self.prober is not None:
                self.transport.sendto(data, self.prober)
            return
        self.prober = addr
        self.captured.append(data)
        self.transport.sendto(data, self.responder)


@needs_native
async def test_a_captured_ping_relayed_to_other_responders_gets_no_answer():
    loop = asyncio.get_running_loop()
    silent: list[int] = []
    prober = PulseProber(99, 7, SECRETS, silent.append, clock=time.monotonic)
    target, *others = (pulse_wire.PulseResponder.start("127.0.0.1", m, SECRETS)
                       for m in (11, 12, 13))
    tap = Tap(("127.0.0.1", target.port))
    tap_transport, _ = await loop.create_datagram_endpoint(lambda: tap,
                                                           local_addr=("127.0.0.1", 0))
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        await prober.start("127.0.0.1")
        prober.watch({11: tap_transport.get_extra_info("sockname")})
        async with asyncio.timeout(10.0):  # member 11 answered 20 pings through the tap
            while prober.counters().get("pongs", 0) < 20:
                await asyncio.sleep(0.02)
        captured = list(tap.captured)
        # Live pings, valid under the key, each for member 11.
        assert len(captured) >= 20
        assert [decode_ping(p, SECRETS)[0] for p in captured] == [11] * len(captured)
        for ping in captured:  # relayed, by whoever saw them, to the other responders
            for other in others:
                attacker.sendto(ping, ("127.0.0.1", other.port))
        for other, member in zip(others, (12, 13), strict=True):
            # A ping of the attacker's own for each (it holds the key here): its pong is the
            # first datagram back, so none of the relayed ones was answered.
            attacker.sendto(encode_ping(7, SECRETS[7], ping_nonce(500, 1), member),
                            ("127.0.0.1", other.port))
            attacker.settimeout(10.0)
            reply = attacker.recv(1024)
            assert decode_pong(reply, SECRETS) == (ping_nonce(500, 1), member)
            async with asyncio.timeout(10.0):  # the count follows the send by a moment
                while other.counts()["answered"] < 1:
                    await asyncio.sleep(0.001)
            assert other.counts() == {
                "answered": 1, "malformed": 0, "unknown_key": 0, "misdirected": len(captured),
                "bad_tag": 0, "replayed": 0, "send_errors": 0, "receive_errors": 0}
        assert silent == [] and target.counts()["misdirected"] == 0
    finally:
        attacker.close()
        tap_transport.close()
        await prober.close()
        for r in (target, *others):
            r.close()


# ------------------------------------------------------------------ in the agent

SLOW_TO_CONVICT = Params(refutation_window_s=60.0, suspicion_min_s=30.0, suspicion_max_s=60.0)
"""A minute of refutation window: only a removal owed none can be decided within a test."""


@needs_native
async def test_a_crashed_agents_observers_find_it_silent_and_remove_it_without_a_window():
    cluster = LocalCluster(4, 1, params=SLOW_TO_CONVICT, seed=5)
    await cluster.start()
    try:
        # Every agent found its subjects' responders and hears them.
        await cluster.until(lambda: all(
            len(a.pulse_watch.prober.tracker.targets) == len(a.member.subjects)
            and a.counters().get("pulse_pongs", 0) >= 2 * len(a.member.subjects)
            for a in cluster.live()), timeout_s=10)
        observers = cluster.configuration.observers_of(2)
        await cluster[2].stop(leave=False)  # a crash: its responder goes with it
        survivors = cluster.live()
        await cluster.until(lambda: all(a.configuration.config_id == 1 for a in survivors),
                            timeout_s=20)
        # ...and watch the subjects the new configuration gives them (looked up anew).
        await cluster.until(lambda: all(
            a.status()["pulse"]["watching"] == len(a.member.subjects) for a in survivors),
            timeout_s=10)
        config = survivors[0].configuration
        assert 2 not in config and config.ranks[1] == 5  # the spare took rank 1
        assert {a.configuration for a in survivors} == {config}
        for a in survivors:
            reported = a.counters().get("silences_reported", 0)
            assert reported == (1 if a.member_id in observers else 0), a.member_id
            assert a.counters()["pulse_responder_answered"] > 0
            pulse = a.status()["pulse"]
            assert pulse["responder_port"] == a.pulse.port
            assert pulse["silent"] == []
    finally:
        await cluster.stop()


async def test_without_the_pulse_setting_nothing_pulses():
    cluster = LocalCluster(2, 1, seed=6, pulse=False)
    await cluster.start()
    try:
        assert all(a.pulse is None and a.pulse_watch.prober is None for a in cluster.live())
        assert all(a.status()["pulse"] == {"responder_port": None, "watching": 0, "silent": []}
                   for a in cluster.live())
        assert all(not any(k.startswith("pulse") for k in a.counters()) for a in cluster.live())
    finally:
        await cluster.stop()


def test_the_environment_turns_the_pulse_off():
    key = {"TORCHPASS_KEY": "ab" * 32, "TORCHPASS_SEEDS": "127.0.0.1:9"}
    assert load_settings(environ=key).pulse is True
    assert load_settings(environ={**key, "TORCHPASS_PULSE": "off"}).pulse is False
    with pytest.raises(SettingsError, match="TORCHPASS_PULSE: on or off"):
        load_settings(environ={**key, "TORCHPASS_PULSE": "0"})


@needs_native
async def test_a_subject_whose_responder_is_not_found_is_asked_again(monkeypatch):
    from torchpass_p2p.agent.services import pulse_watch

    monkeypatch.setattr(pulse_watch, "PULSE_LOOKUP_S", 1.2)  # one held request, then a pause
    monkeypatch.setattr(pulse_watch, "PULSE_RELOOKUP_S", 0.2)
    cluster = LocalCluster(3, 0, seed=7)
    late = cluster[3]
    late.settings = replace(late.settings, pulse=False)  # starts without a responder
    await cluster.start()
    try:
        observers = [cluster[m] for m in cluster.configuration.observers_of(3)]
        await asyncio.sleep(2.0)  # at least one lookup failed and is waiting to ask again
        assert all(3 not in a.pulse_watch.prober.tracker.targets for a in observers)
        assert all(not a.pulse_watch.lookups[3].done() for a in observers)
        secrets = late.settings.keyring.derive_secrets(pulse_watch.PULSE_LABEL)
        late.pulse_watch.responder = pulse_wire.PulseResponder.start("127.0.0.1", 3, secrets)
        late.register_service(pulse_watch.PULSE_SERVICE, 0, late.pulse.port)
        await cluster.until(
            lambda: all(3 in a.pulse_watch.prober.tracker.targets for a in observers),
            timeout_s=10)
        assert all(3 not in a.pulse_watch.lookups for a in observers)
    finally:
        await cluster.stop()
