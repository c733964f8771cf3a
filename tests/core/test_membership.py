"""The sans-IO membership core, stepped by hand: exact datagrams, deadlines, events and counters.

Every test drives :class:`Member` objects with an explicit clock (tests/core/helpers.py): either
one member alone whose outbox the test reads after each ``handle_timer`` at exactly
``next_deadline()``, or a :class:`Fleet` of members 1..N on a zero-latency network. Expected times
are computed from :class:`Params` and the seeded rngs, never copied from a run.

Why one file of this size: the rules of one class, :class:`Member`, section by section, all on
the same hand-stepped members and helpers.
"""

from __future__ import annotations

import math

import pytest

from tests.core.helpers import (
    QUIET,
    Fleet,
    deliver,
    drain,
    events,
    make_member,
    member_rng,
    of_type,
    step_alone,
)
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.membership import LocalProtocolError, Member
from torchpass_p2p.core.messages import (
    Ack,
    Alert,
    Alive,
    Dead,
    Digest,
    Gossip,
    Left,
    MemberState,
    Nack,
    Ping,
    PingReq,
    Prepare,
    SyncState,
    Vote,
)
from torchpass_p2p.core.params import Params

ALIVE, SUSPECT, DEAD, LEFT = MemberState
P = QUIET
CONFIG = Configuration(0, range(1, 9))
SUBJECT = 4
"""The subject most tests accuse; member 1 is one of its observers, member 6 is not."""
OBSERVERS = CONFIG.observers_of(SUBJECT)
LONE = Params(sync_interval_s=1_000.0, self_suspect_after_s=100.0)
"""For a member stepped alone, which never hears an ack: it does not suspect itself within a
test, so the alerts its failed rounds raise stay visible."""
NO_ALERTS = Params(sync_interval_s=1_000.0, failed_rounds_to_alert=1_000)
"""Nobody raises an alert on its own: the test injects exactly the alerts it wants."""


def first_probe_at(seed: int, member: int, now: float, params: Params = P) -> float:
    """The constructor draws the sync jitter first, then the first probe's offset."""
    rng = member_rng(seed, member)
    rng.random()
    return now + params.probe_interval_s * rng.random()


def schedule(first: float, slot: float, count: int) -> list[float]:
    """``count`` probe times ``slot`` apart, accumulated the way the member accumulates them."""
    times = [first]
    for _ in range(count - 1):
        times.append(times[-1] + slot)
    return times


def alert_from(observer: int, subject: int = SUBJECT, incarnation: int = 0) -> Gossip:
    return Gossip((Alert(observer, subject, incarnation),))


def sent_by(fleet: Fleet, src: int, kind: type, dst: int | None = None) -> list:
    """(time, dst, message) of every datagram ``src`` sent, delivered or lost, in send order."""
    entries = sorted(fleet.trace + fleet.dropped, key=lambda e: e[0])
    return [(t, d, m) for t, s, d, m in entries
            if s == src and type(m) is kind and (dst is None or d == dst)]


def distinct_messages(out):
    """The distinct messages of an outbox, first-seen order (messages are unhashable values)."""
    seen = []
    for _, msg in out:
        if msg not in seen:
            seen.append(msg)
    return seen


# ---------------------------------------------------------------------------- probe schedule


def test_the_rings_these_tests_rely_on():
    assert 1 in OBSERVERS and SUBJECT in CONFIG.subjects_of(1)
    assert 6 not in OBSERVERS and SUBJECT not in CONFIG.subjects_of(6)
    assert len(OBSERVERS) > NO_ALERTS.min_alerts_to_confirm
    assert len(CONFIG.subjects_of(1)) >= 3


def test_first_probe_time_and_target_follow_the_seed():
    m = make_member(1, CONFIG, seed=7, now=100.0)
    first = first_probe_at(7, 1, 100.0)
    assert m.next_deadline() == first
    assert drain(m) == []
    m.handle_timer(first)
    assert drain(m) == [(CONFIG.subjects_of(1)[0], Ping(1, ()))]
    assert m.counters["probes"] == 1
    assert events(m) == []


def test_next_deadline_walks_indirect_probe_next_slot_and_round_end():
    # Timeouts chosen so that no two timers of the first two rounds coincide.
    params = Params(sync_interval_s=1_000.0, probe_timeout_s=0.1, round_timeout_s=0.3)
    m = make_member(1, CONFIG, params=params)
    s0, s1, s2 = CONFIG.subjects_of(1)[:3]
    pt, rt = params.probe_timeout_s, params.round_timeout_s
    slot = params.probe_interval_s / len(CONFIG.subjects_of(1))
    t0 = first_probe_at(0, 1, 0.0, params)
    assert pt < slot < rt < slot + pt < 2 * slot < slot + rt

    assert m.next_deadline() == t0
    m.handle_timer(t0)
    assert drain(m) == [(s0, Ping(1, ()))]

    assert m.next_deadline() == t0 + pt
    m.handle_timer(t0 + pt)
    assert distinct_messages(drain(m)) == [PingReq(1, s0, ())]

    assert m.next_deadline() == t0 + slot
    m.handle_timer(t0 + slot)
    assert drain(m) == [(s1, Ping(2, ()))]

    assert m.next_deadline() == t0 + rt
    m.handle_timer(t0 + rt)
    assert drain(m) == []
    assert m.counters["probe_rounds_failed"] == 1

    assert m.next_deadline() == t0 + slot + pt
    m.handle_timer(t0 + slot + pt)
    assert distinct_messages(drain(m)) == [PingReq(2, s1, ())]

    assert m.next_deadline() == t0 + slot + slot
    m.handle_timer(t0 + slot + slot)
    assert drain(m) == [(s2, Ping(3, ()))]
    # Round 2 was timed at health 0, before round 1's failure raised the health.
    assert m.next_deadline() == t0 + slot + rt


def test_each_subject_is_probed_once_per_interval_round_robin():
    fleet = Fleet(8)
    intervals = 3
    fleet.run_until(intervals * P.probe_interval_s + 1.0)
    for i in fleet.members:
        subjects = CONFIG.subjects_of(i)
        n = len(subjects)
        slot = P.probe_interval_s * 1 / n  # health stays 0: every probe is acked
        times = schedule(first_probe_at(0, i, 0.0), slot, intervals * n)
        expected = [(t, subjects[k % n]) for k, t in enumerate(times)]
        pings = [(t, d) for t, d, _ in sent_by(fleet, i, Ping)]
        assert pings[: intervals * n] == expected, i
        assert fleet[i].health == 0
        assert fleet[i].counters["probe_acks"] == fleet[i].counters["probes"]
    assert fleet.dropped == []
    assert not any(type(m) is PingReq for _, _, _, m in fleet.trace)


# ---------------------------------------------------------------------------- ping, ack, relays


def test_ping_gets_ack_with_the_same_seq():
    m = make_member(3, CONFIG)
    m.receive(0.5, 2, Ping(77, ()))
    m.receive(0.5, 5, Ping(0xFFFF_FFFF, ()))
    assert drain(m) == [(2, Ack(77, ())), (5, Ack(0xFFFF_FFFF, ()))]
    assert m.counters["received"] == 2


def test_ack_closes_the_round_and_no_ping_req_follows():
    m = make_member(1, CONFIG)
    s0 = CONFIG.subjects_of(1)[0]
    slot = P.probe_interval_s / len(CONFIG.subjects_of(1))
    t0 = m.next_deadline()
    m.handle_timer(t0)
    assert drain(m) == [(s0, Ping(1, ()))]
    m.receive(t0 + 0.01, s0, Ack(1, ()))
    assert m.counters["probe_acks"] == 1
    assert m.next_deadline() == t0 + slot  # no indirect probe pending
    sent = [msg for _, out in step_alone(m, t0 + 0.9 * P.probe_interval_s) for _, msg in out]
    assert not any(type(msg) is PingReq and msg.target == s0 for msg in sent)
    assert any(type(msg) is PingReq for msg in sent)  # the other subjects' rounds do time out


def test_ack_with_an_unknown_seq_leaves_the_round_open():
    m = make_member(1, CONFIG)
    s0 = CONFIG.subjects_of(1)[0]
    t0 = m.next_deadline()
    m.handle_timer(t0)
    drain(m)
    m.receive(t0 + 0.01, s0, Ack(2, ()))
    assert m.counters["probe_acks"] == 0
    assert m.next_deadline() == t0 + P.probe_timeout_s


def test_silence_sends_ping_req_to_distinct_relays_at_exactly_probe_timeout():
    m = make_member(1, CONFIG)
    s0 = CONFIG.subjects_of(1)[0]
    t0 = m.next_deadline()
    m.handle_timer(t0)
    drain(m)
    assert m.next_deadline() == t0 + P.probe_timeout_s
    m.handle_timer(t0 + P.probe_timeout_s)
    out = drain(m)
    relays = [dest for dest, _ in out]
    assert [msg for _, msg in out] == [PingReq(1, s0, ())] * P.indirect_probes
    assert len(set(relays)) == P.indirect_probes
    assert 1 not in relays and s0 not in relays


def test_relay_pings_the_target_and_relays_its_ack_with_the_origin_seq():
    origin = make_member(1, CONFIG)
    target_id = CONFIG.subjects_of(1)[0]
    target = make_member(target_id, CONFIG)
    t0 = origin.next_deadline()
    origin.handle_timer(t0)
    drain(origin)  # the direct ping is lost
    t1 = t0 + P.probe_timeout_s
    origin.handle_timer(t1)
    relay_id, req = drain(origin)[0]
    assert req == PingReq(1, target_id, ())
    relay = make_member(relay_id, CONFIG)

    relay.receive(t1, 1, req)
    to_target = drain(relay)
    assert to_target == [(target_id, Ping(1, ()))]  # the relay's own seq counter
    deliver(t1, relay, target, to_target)
    back = drain(target)
    assert back == [(relay_id, Ack(1, ()))]
    deliver(t1, target, relay, back)
    relayed = drain(relay)
    assert relayed == [(1, Ack(1, ()))]  # the origin's seq
    deliver(t1, relay, origin, relayed)
    assert origin.counters["probe_acks"] == 1
    slot = P.probe_interval_s / len(CONFIG.subjects_of(1))
    assert origin.next_deadline() == t0 + slot  # the round is closed: only the next probe
    origin.handle_timer(t0 + slot)
    drain(origin)
    assert origin.next_deadline() == t0 + slot + P.probe_timeout_s  # the new round's timer
    assert origin.counters["probe_rounds_failed"] == 0


def test_relay_sends_nack_at_its_deadline_when_the_target_stays_silent():
    relay = make_member(5, CONFIG)
    t = 0.05
    relay.receive(t, 1, PingReq(41, 2, ()))
    assert drain(relay) == [(2, Ping(1, ()))]
    nack_at = t + 0.8 * (P.round_timeout_s - P.probe_timeout_s)
    while (due := relay.next_deadline()) < nack_at:
        relay.handle_timer(due)  # the relay's own probing; all of it is lost
        assert not of_type(drain(relay), Nack)
    assert due == nack_at
    relay.handle_timer(nack_at)
    assert of_type(drain(relay), Nack) == [(1, Nack(41, 2))]


def test_relay_refuses_ping_req_about_itself_or_a_stranger():
    relay = make_member(5, CONFIG)
    relay.receive(0.05, 1, PingReq(41, 5, ()))
    relay.receive(0.05, 1, PingReq(42, 999, ()))
    assert drain(relay) == []
    assert relay.counters["dropped_ping_req"] == 2


# ---------------------------------------------------------------------------- alerts


def _blocked_fleet(windows):
    """Fleet in which every datagram to SUBJECT is lost while ``windows(now)`` is true."""
    fleet = Fleet(8)
    fleet.drop = lambda src, dst, msg: dst == SUBJECT and windows(fleet.now)
    return fleet


def _pings_to_subject(observer: int = 1, count: int = 6) -> list[float]:
    """When ``observer`` pings SUBJECT while its health stays 0 (rounds fail only with every
    relay's nack, which costs no health)."""
    subjects = CONFIG.subjects_of(observer)
    slot = P.probe_interval_s * 1 / len(subjects)
    times = schedule(first_probe_at(0, observer, 0.0), slot, count * len(subjects))
    k = subjects.index(SUBJECT)
    return times[k::len(subjects)][:count]


def test_one_failed_round_raises_no_alert():
    p = _pings_to_subject()
    fleet = _blocked_fleet(lambda now: p[0] - 0.05 <= now < p[0] + 0.6)
    fleet.run_until(p[1] + 0.6)
    o = fleet[1]
    assert o.counters["probe_rounds_failed"] == 1
    assert o.counters["alerts_raised"] == 0
    assert o.health == 0
    assert all(type(e) is not ev.AlertRaised for e in fleet.events(1))
    assert o.state_of(SUBJECT) == (ALIVE, 0)


def test_m_consecutive_failed_rounds_raise_exactly_one_alert():
    assert P.failed_rounds_to_alert == 2
    p = _pings_to_subject()
    fleet = _blocked_fleet(lambda now: now >= p[0] - 0.05)
    fleet.run_until(p[1] + P.round_timeout_s - 0.001)
    assert fleet[1].counters["alerts_raised"] == 0
    fleet.run_until(p[5])
    o = fleet[1]
    alert = Alert(1, SUBJECT, 0)
    at = p[1] + P.round_timeout_s
    mine = [e for e in fleet.events(1) if type(e) is ev.AlertRaised and e.observer == 1]
    assert mine == [ev.AlertRaised(at, 1, SUBJECT, 0)]
    assert o.counters["alerts_raised"] == 1
    assert o.counters["stalls"] == 0
    # Sent straight to the subject (lost here, the subject is cut off) in the same call.
    assert (1, SUBJECT, Gossip((alert,))) in [
        (s, d, m) for t, s, d, m in fleet.dropped if t == at
    ]


def test_an_ack_between_failed_rounds_resets_the_count():
    p = _pings_to_subject()
    # Rounds 0 fails, 1 succeeds, 2 and 3 fail: the alert comes at the end of round 3.
    fleet = _blocked_fleet(lambda now: p[0] - 0.05 <= now < p[0] + 0.6 or now >= p[2] - 0.05)
    fleet.run_until(p[3] - 0.01)
    o = fleet[1]
    assert o.counters["probe_rounds_failed"] == 2
    assert o.counters["alerts_raised"] == 0
    fleet.run_until(p[3] + P.round_timeout_s)
    assert o.counters["alerts_raised"] == 1
    mine = [e for e in fleet.events(1) if type(e) is ev.AlertRaised and e.observer == 1]
    assert mine == [ev.AlertRaised(p[3] + P.round_timeout_s, 1, SUBJECT, 0)]


def test_alert_from_a_non_observer_is_dropped_counted_and_changes_nothing():
    x = make_member(6, CONFIG)
    outsider = next(m for m in CONFIG.members if m not in OBSERVERS and m != SUBJECT)
    digest = x.view_digest()
    x.receive(0.1, outsider, alert_from(outsider))
    x.receive(0.1, 1, Gossip((Alert(1, 999, 0),)))  # a stranger as subject
    assert x.counters["dropped_invalid_alert"] == 2
    assert x.state_of(SUBJECT) == (ALIVE, 0)
    assert x.alerts_about(SUBJECT) == ()
    assert x.view_digest() == digest
    assert events(x) == [] and drain(x) == []
    assert x.next_deadline() == first_probe_at(0, 6, 0.0)  # no gossip scheduled


def test_alert_about_self_from_a_non_observer_is_not_refuted():
    outsider = next(m for m in CONFIG.members if m not in OBSERVERS and m != SUBJECT)
    s = make_member(SUBJECT, CONFIG)
    s.receive(0.1, outsider, alert_from(outsider))
    assert s.incarnation == 0
    assert s.counters["dropped_invalid_alert"] == 1
    assert events(s) == [] and drain(s) == []


# ---------------------------------------------------------------------------- suspicion


def test_suspicion_timeout_is_lifeguards_formula():
    p = Params()
    k = 9
    assert p.suspicion_timeout_s(0, k) == p.suspicion_max_s
    assert p.suspicion_timeout_s(k, k) == p.suspicion_min_s
    for c in range(k + 1):
        span = p.suspicion_max_s - p.suspicion_min_s
        want = max(p.suspicion_min_s, p.suspicion_max_s - span * math.log(c + 1) / math.log(k + 1))
        assert p.suspicion_timeout_s(c, k) == want
    values = [p.suspicion_timeout_s(c, k) for c in range(k + 1)]
    assert values == sorted(values, reverse=True) and len(set(values)) == len(values)
    assert p.suspicion_timeout_s(3, 0) == p.suspicion_min_s


@pytest.mark.parametrize("alerts", [3, 4])
def test_observer_confirms_dead_exactly_at_the_deadline_that_shrinks_with_alerts(alerts):
    assert 1 in OBSERVERS and alerts <= len(OBSERVERS)
    fleet = Fleet(8, params=NO_ALERTS)
    fleet.down.add(SUBJECT)
    fleet.run_until(0.1)
    x = fleet[1]
    accusers = [o for o in OBSERVERS if o != 1][:alerts]
    # Independent alerts arrive 0.3 s apart; the deadline counts from the first.
    for i, o in enumerate(accusers):
        fleet.run_until(0.1 + 0.3 * i)
        x.receive(fleet.now, o, alert_from(o))
        x.receive(fleet.now, o, alert_from(o))  # a repeat is not independent
    assert x.alerts_about(SUBJECT) == tuple(accusers)
    k = len(OBSERVERS)
    deadline = 0.1 + NO_ALERTS.suspicion_timeout_s(alerts - 1, k - 1)
    fleet.run_until(deadline - 1e-9)
    assert x.state_of(SUBJECT) == (SUSPECT, 0)
    fleet.run_until(deadline)
    assert x.state_of(SUBJECT) == (DEAD, 0)
    got = fleet.events(1)
    assert [e for e in got if type(e) is ev.MemberDead] == [ev.MemberDead(deadline, SUBJECT, 0, 1)]
    assert got[0] == ev.MemberSuspected(0.1, SUBJECT, 0, accusers[0])
    assert [e for e in got if type(e) is ev.AlertRaised] == [
        ev.AlertRaised(0.1 + 0.3 * i, o, SUBJECT, 0) for i, o in enumerate(accusers)
    ]
    assert min(t for t, _, m in sent_by(fleet, 1, Gossip) if Dead(SUBJECT, 0, 1) in m.updates) == (
        deadline
    )
    assert x.counters["stalls"] == 0


def test_more_alerts_convict_sooner():
    k = len(OBSERVERS)
    times = [NO_ALERTS.suspicion_timeout_s(n - 1, k - 1) for n in range(1, k + 1)]
    assert times == sorted(times, reverse=True)
    assert times[0] == NO_ALERTS.suspicion_max_s and times[-1] == NO_ALERTS.suspicion_min_s


def test_fewer_than_min_alerts_never_convict():
    fleet = Fleet(8, params=NO_ALERTS)
    fleet.down.add(SUBJECT)
    fleet.run_until(0.1)
    accusers = [o for o in OBSERVERS if o != 1][: NO_ALERTS.min_alerts_to_confirm - 1]
    for o in accusers:
        fleet[1].receive(0.1, o, alert_from(o))
    fleet.run_until(0.1 + 10 * NO_ALERTS.suspicion_max_s)
    for i, m in fleet.members.items():
        if i == SUBJECT:
            continue
        assert m.state_of(SUBJECT) == (SUSPECT, 0), i
        assert m.alerts_about(SUBJECT) == tuple(accusers), i
        assert not any(type(e) is ev.MemberDead for e in fleet.events(i)), i
        assert m.counters["stalls"] == 0


def test_non_observer_confirms_only_at_suspicion_max():
    y = make_member(6, CONFIG, params=NO_ALERTS)
    assert SUBJECT not in CONFIG.subjects_of(6)
    t0 = 0.1
    for o in OBSERVERS:
        y.receive(t0, o, alert_from(o))
    assert y.alerts_about(SUBJECT) == OBSERVERS
    # An observer holding the same alerts would convict at suspicion_min_s.
    assert NO_ALERTS.suspicion_timeout_s(len(OBSERVERS) - 1, len(OBSERVERS) - 1) == 1.0
    fired = [t for t, _ in step_alone(y, t0 + 2 * NO_ALERTS.suspicion_max_s)]
    assert t0 + NO_ALERTS.suspicion_max_s in fired
    dead = [e for e in events(y) if type(e) is ev.MemberDead]
    assert dead == [ev.MemberDead(t0 + NO_ALERTS.suspicion_max_s, SUBJECT, 0, 6)]


HEARD = Params(sync_interval_s=1_000.0, failed_rounds_to_alert=1_000, self_suspect_after_s=100.0)


def _suspect_while_answering(x: Member, until: float) -> None:
    """Step ``x`` alone to ``until``; SUBJECT acks every ping ``x`` sends it (without the
    piggybacked alerts ever reaching it), every other datagram is lost."""
    while (due := x.next_deadline()) <= until:
        x.handle_timer(due)
        for dest, msg in drain(x):
            if dest == SUBJECT and type(msg) is Ping:
                x.receive(due, SUBJECT, Ack(msg.seq, ()))


def _observer_with_all_alerts() -> tuple[Member, float]:
    x = make_member(1, CONFIG, params=HEARD)
    accusers = [o for o in OBSERVERS if o != 1]
    for o in accusers:
        x.receive(0.1, o, alert_from(o))
    return x, 0.1 + HEARD.suspicion_timeout_s(len(accusers) - 1, len(OBSERVERS) - 1)


def test_observer_that_hears_the_subject_postpones_conviction_by_an_interval():
    x, deadline = _observer_with_all_alerts()
    _suspect_while_answering(x, deadline)
    assert x.counters["probe_acks"] >= 1  # SUBJECT answered after the suspicion began
    assert x.counters["convictions_postponed"] == 1
    assert x.state_of(SUBJECT) == (SUSPECT, 0)
    again = deadline + HEARD.probe_interval_s * (x.health + 1)
    _suspect_while_answering(x, again - 1e-9)
    assert x.counters["convictions_postponed"] == 1
    _suspect_while_answering(x, again)
    assert x.counters["convictions_postponed"] == 2
    _suspect_while_answering(x, 60.0)  # it keeps answering: never convicted
    assert x.state_of(SUBJECT) == (SUSPECT, 0)
    assert not any(type(e) is ev.MemberDead for e in events(x))


def test_postponed_conviction_happens_once_the_subject_falls_silent():
    x, deadline = _observer_with_all_alerts()
    _suspect_while_answering(x, deadline)
    assert x.counters["convictions_postponed"] == 1
    again = deadline + HEARD.probe_interval_s * (x.health + 1)
    step_alone(x, again)  # SUBJECT crashed right after the first expiry
    dead = [e for e in events(x) if type(e) is ev.MemberDead]
    assert len(dead) == 1 and deadline < dead[0].at <= again
    assert dead[0] == ev.MemberDead(dead[0].at, SUBJECT, 0, 1)


# ---------------------------------------------------------------------------- refutation


def test_alert_about_self_raises_incarnation_and_tells_every_observer():
    s = make_member(SUBJECT, CONFIG)
    t = first_probe_at(0, SUBJECT, 0.0) / 4  # before any timer of the subject is due
    s.receive(t, 1, alert_from(1))
    assert s.incarnation == 1
    assert s.health == 1
    assert s.counters["refutations"] == 1
    assert events(s) == [ev.SelfRefuted(t, 1)]
    assert s.state_of(SUBJECT) == (ALIVE, 1)
    assert drain(s) == [(o, Gossip((Alive(SUBJECT, 1),))) for o in OBSERVERS]
    # The refutation is also queued for gossip, pushed at once.
    assert s.next_deadline() == t
    # A stale alert (the incarnation already refuted) changes nothing.
    s.receive(2 * t, 2, alert_from(2, incarnation=0))
    assert s.incarnation == 1 and events(s) == [] and drain(s) == []
    # An alert at a later incarnation is refuted again, above that incarnation.
    s.receive(3 * t, 2, alert_from(2, incarnation=4))
    assert s.incarnation == 5
    assert events(s) == [ev.SelfRefuted(3 * t, 5)]
    assert s.health == 2


def test_alert_about_self_piggybacked_on_a_ping_is_refuted_in_the_ack():
    s = make_member(SUBJECT, CONFIG)
    s.receive(0.3, 1, Ping(9, (Alert(1, SUBJECT, 0),)))
    out = drain(s)
    assert out[: len(OBSERVERS)] == [(o, Gossip((Alive(SUBJECT, 1),))) for o in OBSERVERS]
    assert out[len(OBSERVERS):] == [(1, Ack(9, (Alive(SUBJECT, 1),)))]


def test_higher_alive_drops_the_suspicion_then_an_old_dead_is_ignored():
    x = make_member(6, CONFIG)
    x.receive(0.1, 1, alert_from(1))
    step_alone(x, 0.1)  # the host runs the timer the news armed
    assert x.state_of(SUBJECT) == (SUSPECT, 0)
    events(x)
    x.receive(0.2, SUBJECT, Gossip((Alive(SUBJECT, 1),)))
    step_alone(x, 0.2)
    assert events(x) == [ev.MemberAlive(0.2, SUBJECT, 1)]
    assert x.state_of(SUBJECT) == (ALIVE, 1)
    assert x.alerts_about(SUBJECT) == ()
    x.receive(0.3, 2, Gossip((Dead(SUBJECT, 0, 2), Alert(2, SUBJECT, 0))))
    assert x.state_of(SUBJECT) == (ALIVE, 1)
    assert events(x) == []
    # Nothing convicts later either.
    step_alone(x, 0.1 + 2 * P.suspicion_max_s)
    assert x.state_of(SUBJECT) == (ALIVE, 1)


def test_higher_alive_overrides_a_stale_dead_and_probing_resumes():
    x = make_member(1, CONFIG)
    x.receive(0.05, 2, Gossip((Dead(SUBJECT, 0, 2),)))
    assert events(x) == [ev.MemberDead(0.05, SUBJECT, 0, 2)]
    x.receive(0.06, SUBJECT, Gossip((Alive(SUBJECT, 1),)))
    assert events(x) == [ev.MemberAlive(0.06, SUBJECT, 1)]
    assert x.state_of(SUBJECT) == (ALIVE, 1)
    pinged = {d for _, out in step_alone(x, 1.5) for d, m in out if type(m) is Ping}
    assert SUBJECT in pinged


def test_dead_subject_is_not_probed():
    x = make_member(1, CONFIG)
    x.receive(0.0, 2, Gossip((Dead(SUBJECT, 0, 2),)))
    pinged = [d for _, out in step_alone(x, 3.0) for d, m in out if type(m) is Ping]
    assert SUBJECT not in pinged
    assert set(pinged) == set(CONFIG.subjects_of(1)) - {SUBJECT}


def test_left_is_final():
    x = make_member(6, CONFIG)
    x.receive(0.1, SUBJECT, Gossip((Left(SUBJECT, 0),)))
    assert events(x) == [ev.MemberLeft(0.1, SUBJECT, 0)]
    x.receive(0.2, 1, Gossip((Alive(SUBJECT, 5), Dead(SUBJECT, 0, 1), Alert(1, SUBJECT, 0))))
    x.receive(0.2, 1, Gossip((Left(SUBJECT, 3),)))
    assert x.state_of(SUBJECT) == (LEFT, 0)
    assert events(x) == []


def test_conviction_of_a_refuted_incarnation_repeats_the_refutation():
    s = make_member(SUBJECT, CONFIG)
    t = first_probe_at(0, SUBJECT, 0.0) / 4
    s.receive(t, 1, alert_from(1))
    s.handle_timer(t)  # pushes the refutation until it is sent transmit_limit times
    drain(s), events(s)
    s.receive(2 * t, 2, Gossip((Dead(SUBJECT, 0, 2),)))
    assert not s.removed
    assert events(s) == []
    assert s.next_deadline() == 2 * t
    s.handle_timer(2 * t)  # the repeated Alive is pushed at once
    assert [m for _, m in drain(s)] == [Gossip((Alive(SUBJECT, 1),))] * P.gossip_fanout


# ---------------------------------------------------------------------------- stalls


def test_late_timer_voids_open_rounds_raises_health_and_alerts_nobody():
    params = Params(sync_interval_s=1_000.0, self_suspect_after_s=100.0, failed_rounds_to_alert=1)
    m = make_member(1, CONFIG, params=params)
    s0, s1 = CONFIG.subjects_of(1)[:2]
    t0 = m.next_deadline()
    m.handle_timer(t0)
    drain(m)
    due = m.next_deadline()
    late = due + 2 * params.stall_tolerance_s
    m.handle_timer(late)
    assert m.counters["stalls"] == 1
    assert m.counters["rounds_voided"] == 1
    assert m.health == 1
    # The voided round sends no PingReq; the overdue probe goes out at once.
    assert drain(m) == [(s1, Ping(2, ()))]
    # The round to s0 would have failed at t0 + round_timeout < late; M = 1 would alert at
    # once. Only rounds started after the stall may alert (s0's next one starts much later).
    step_alone(m, late + 1.5 * params.probe_interval_s)
    accused = [e.subject for e in events(m) if type(e) is ev.AlertRaised]
    assert accused[0] == s1 and s0 not in accused
    assert not m.self_suspected


def test_a_loop_that_keeps_stalling_counts_itself_alone_once_it_hears_nobody():
    """Every timer fires late (a loaded host): each stall voids the open rounds and resets the
    silence the member would suspect itself for, so its view accuses nobody and keeps all 8.
    Once no neighbour was heard for half a lease it counts 1 reachable (what its fenced host
    reports), not 8; a word from one neighbour ends that at once."""
    params = Params(sync_interval_s=1_000.0)
    m = make_member(1, CONFIG, params=params)
    late = 2 * params.stall_tolerance_s
    now = 0.0
    while now < params.lease_s:
        now = m.next_deadline() + late
        m.handle_timer(now)
        drain(m)
    assert m.counters["stalls"] > 0 and m.counters["alerts_raised"] == 0
    assert not m.self_suspected and not m.in_contact
    assert [m.state_of(x)[0] for x in CONFIG.members if x != 1] == [ALIVE] * 7
    assert m.reachable == 1
    m.receive(now, CONFIG.subjects_of(1)[0], Ack(1, ()))
    assert m.reachable == 8


def test_timer_late_by_less_than_the_tolerance_is_no_stall():
    m = make_member(1, CONFIG)
    t0 = m.next_deadline()
    m.handle_timer(t0)
    due = m.next_deadline()
    m.handle_timer(due + 0.5 * P.stall_tolerance_s)
    assert m.counters["stalls"] == 0
    assert distinct_messages(of_type(drain(m), PingReq)) == [
        PingReq(1, CONFIG.subjects_of(1)[0], ())
    ]


def test_failed_round_without_stall_alerts_with_m_equal_1():
    """Control for the stall test: the same round, on time, does raise the alert."""
    params = Params(sync_interval_s=1_000.0, self_suspect_after_s=100.0, failed_rounds_to_alert=1)
    m = make_member(1, CONFIG, params=params)
    s0 = CONFIG.subjects_of(1)[0]
    t0 = m.next_deadline()
    step_alone(m, t0 + params.round_timeout_s)
    assert ev.AlertRaised(t0 + params.round_timeout_s, 1, s0, 0) in events(m)


def test_late_alert_that_moves_the_deadline_into_the_past_is_not_a_stall():
    fleet = Fleet(8, params=NO_ALERTS)
    fleet.down.add(SUBJECT)
    x = fleet[1]
    a, b, c = [o for o in OBSERVERS if o != 1][:3]
    fleet.run_until(0.1)
    x.receive(0.1, a, alert_from(a))
    fleet.run_until(2.0)
    x.receive(2.0, b, alert_from(b))
    # Two alerts < L: at 0.1 + timeout(1, K-1) the suspicion parks.
    fleet.run_until(5.0)
    x.receive(5.0, c, alert_from(c))
    # Precondition on the parameters (virtual time): with three alerts the deadline lies more
    # than the stall tolerance before this call, so a naive lateness check would see a stall.
    parked_deadline = 0.1 + NO_ALERTS.suspicion_timeout_s(2, len(OBSERVERS) - 1)
    tolerance = P.stall_tolerance_s
    assert 5.0 - parked_deadline > tolerance
    fleet.run_until(5.0)  # the host fires the (overdue) timer at once
    assert ev.MemberDead(5.0, SUBJECT, 0, 1) in fleet.events(1)
    assert x.counters["stalls"] == 0
    assert x.health == 0


# ---------------------------------------------------------------------------- local health


def _one_round_with_nacks(nacks: int) -> tuple[Member, float]:
    """Member 1 alone; its first round fails at ``t0 + round_timeout`` after ``nacks`` relays
    nacked. Returns the member and that time; round 2 (seq 2) is still open then."""
    m = make_member(1, CONFIG)
    s0 = CONFIG.subjects_of(1)[0]
    t0 = m.next_deadline()
    m.handle_timer(t0)
    drain(m)
    m.handle_timer(t0 + P.probe_timeout_s)
    relays = [d for d, msg in drain(m) if type(msg) is PingReq]
    for r in relays[:nacks]:
        m.receive(t0 + P.probe_timeout_s + 0.01, r, Nack(1, s0))
    m.receive(t0 + P.probe_timeout_s + 0.01, relays[0], Nack(1, 999))  # wrong target: ignored
    m.receive(t0 + P.probe_timeout_s + 0.01, relays[0], Nack(7, s0))  # unknown seq: ignored
    while (due := m.next_deadline()) <= t0 + P.round_timeout_s:
        m.handle_timer(due)
    assert m.counters["probe_rounds_failed"] == 1
    return m, t0 + P.round_timeout_s


@pytest.mark.parametrize("nacks", [0, 1, 2, 3])
def test_failed_round_raises_health_by_the_missing_nacks(nacks):
    m, _ = _one_round_with_nacks(nacks)
    assert m.health == P.indirect_probes - nacks


def test_successful_probe_lowers_health():
    m, t = _one_round_with_nacks(1)
    assert m.health == 2
    s1 = CONFIG.subjects_of(1)[1]
    m.receive(t, s1, Ack(2, ()))  # round 2 succeeds (indirectly: its PingReqs are out)
    assert m.health == 1
    assert m.counters["probe_acks"] == 1
    m.receive(t, s1, Ack(2, ()))  # a duplicate ack is not a second success
    assert m.health == 1


def test_health_is_capped_at_max_health_multiplier():
    m = make_member(1, CONFIG)
    seen = []
    for _ in step_alone(m, 30.0):
        seen.append(m.health)
    assert max(seen) == P.max_health_multiplier
    assert m.health == P.max_health_multiplier


def test_probe_spacing_and_timeouts_scale_with_health():
    m = make_member(1, CONFIG)
    s0, s1 = CONFIG.subjects_of(1)[:2]
    m.health = 3
    scale = m.health + 1
    slot = P.probe_interval_s * scale / len(CONFIG.subjects_of(1))
    t0 = m.next_deadline()
    m.handle_timer(t0)
    assert drain(m) == [(s0, Ping(1, ()))]
    assert m.next_deadline() == t0 + P.probe_timeout_s * scale
    m.handle_timer(t0 + P.probe_timeout_s * scale)
    relays = [d for d, msg in drain(m) if type(msg) is PingReq]
    assert m.next_deadline() == t0 + slot
    m.handle_timer(t0 + slot)
    assert of_type(drain(m), Ping) == [(s1, Ping(2, ()))]
    for r in relays:  # every relay nacks: the failure costs no health
        m.receive(t0 + slot, r, Nack(1, s0))
    while (due := m.next_deadline()) < t0 + P.round_timeout_s * scale:
        m.handle_timer(due)
        assert m.counters["probe_rounds_failed"] == 0
    assert due == t0 + P.round_timeout_s * scale
    m.handle_timer(due)
    assert m.counters["probe_rounds_failed"] == 1
    assert m.health == 3


@pytest.mark.parametrize("nacks", [0, 3])
def test_a_stretched_round_whose_relays_nacked_accuses_though_the_nacks_are_old(nacks):
    """Health 4 stretches a round to 2.5 s; the relays' nacks arrive 1 s in, so when the round
    fails they are 1.5 s old, past ``self_suspect_after_s``. They still prove we reach peers
    that cannot reach the subject: the failure is the subject's, not a sign of isolation. (A
    6-member job whose subjects died together otherwise silenced its survivors.) Without a
    nack the same round means we may be the one cut off."""
    params = Params(sync_interval_s=1_000.0, failed_rounds_to_alert=1)
    m = make_member(1, CONFIG, params=params)
    s0 = CONFIG.subjects_of(1)[0]
    m.health = 4
    scale = m.health + 1
    t0 = m.next_deadline()
    m.handle_timer(t0)
    assert drain(m) == [(s0, Ping(1, ()))]
    nacked_at = t0 + params.probe_timeout_s * scale
    m.handle_timer(nacked_at)
    relays = [d for d, msg in drain(m) if type(msg) is PingReq]
    for r in relays[:nacks]:
        m.receive(nacked_at + 0.01, r, Nack(1, s0))
    fails_at = t0 + params.round_timeout_s * scale
    assert fails_at - (nacked_at + 0.01) > params.self_suspect_after_s
    while (due := m.next_deadline()) <= fails_at:
        m.handle_timer(due)
    alerts = [e for e in events(m) if type(e) is ev.AlertRaised]
    if nacks:
        assert alerts == [ev.AlertRaised(fails_at, 1, s0, 0)] and not m.self_suspected
    else:
        assert alerts == [] and m.self_suspected


def test_health_rises_on_a_send_error():
    m = make_member(1, CONFIG)
    m.report_send_error(0.1, 5)  # no open round to 5
    assert m.health == 1
    assert m.counters["send_errors"] == 1
    assert m.counters["probe_rounds_failed"] == 0


# ---------------------------------------------------------------------------- self-suspicion


def _isolated_after(params: Params, cut_at: float, until: float) -> Fleet:
    fleet = Fleet(8, params=params)
    fleet.run_until(cut_at)
    fleet.isolate(1)
    fleet.run_until(until)
    return fleet


def test_member_that_hears_no_ack_suspects_itself_and_accuses_nobody():
    params = P
    fleet = _isolated_after(params, 3.0, 40.0)
    m = fleet[1]
    assert len(CONFIG.subjects_of(1)) >= 2
    last_ack = max(t for t, s, d, msg in fleet.trace if d == 1 and type(msg) is Ack)
    got = fleet.events(1)
    suspected = [e for e in got if type(e) is ev.SelfSuspected]
    assert len(suspected) == 1
    assert suspected[0].at - last_ack >= params.self_suspect_after_s
    assert m.self_suspected
    assert m.counters["self_suspected"] == 1
    assert m.counters["alerts_raised"] == 0
    assert not any(type(e) is ev.AlertRaised and e.observer == 1 for e in got)
    # The cut heals: the first ack ends the self-suspicion.
    fleet.drop = lambda src, dst, msg: False
    fleet.run_until(50.0)
    assert not m.self_suspected
    assert m.counters["alerts_raised"] == 0


def test_member_with_a_single_subject_never_suspects_itself():
    fleet = Fleet(2)
    assert len(fleet.config.subjects_of(1)) == 1
    fleet.run_until(2.0)
    fleet.isolate(1)
    fleet.run_until(30.0)
    got = fleet.events(1)
    assert not any(type(e) is ev.SelfSuspected for e in got)
    assert [e.subject for e in got if type(e) is ev.AlertRaised and e.observer == 1] == [2]


# ---------------------------------------------------------------------------- send errors


def test_send_error_fails_the_open_round_to_that_member_at_once():
    m = make_member(1, CONFIG)
    s0 = CONFIG.subjects_of(1)[0]
    slot = P.probe_interval_s / len(CONFIG.subjects_of(1))
    t0 = m.next_deadline()
    m.handle_timer(t0)
    drain(m)
    m.report_send_error(t0 + 0.001, s0)
    assert m.counters["probe_rounds_failed"] == 1
    assert m.counters["send_errors"] == 1
    assert m.health == 1  # one failed probe, counted once (through the failed round)
    assert m.next_deadline() == t0 + slot  # no indirect probe, no round end pending
    m.handle_timer(t0 + slot)
    assert not of_type(drain(m), PingReq)


def test_send_errors_in_m_rounds_raise_an_alert():
    m = make_member(1, CONFIG, params=LONE)
    s0 = CONFIG.subjects_of(1)[0]
    times = []
    while len(times) < P.failed_rounds_to_alert:
        due = m.next_deadline()
        m.handle_timer(due)
        for dest, msg in drain(m):
            if type(msg) is Ping and dest == s0:
                m.report_send_error(due, s0)
                times.append(due)
    assert m.counters["alerts_raised"] == 1
    assert ev.AlertRaised(times[-1], 1, s0, 0) in events(m)


# ---------------------------------------------------------------------------- leave and removal


def test_leave_spreads_left_and_stops_probing():
    m = make_member(1, CONFIG)
    m.leave(0.01)
    assert m.left
    assert m.next_deadline() == 0.01
    m.handle_timer(0.01)
    out = drain(m)
    assert [msg for _, msg in out] == [Gossip((Left(1, 0),))] * P.gossip_fanout
    assert len({d for d, _ in out}) == P.gossip_fanout and 1 not in {d for d, _ in out}
    assert m.state_of(1) == (LEFT, 0)
    m.leave(0.02)  # idempotent
    steps = step_alone(m, 5.0)
    sent = [msg for _, out in steps for _, msg in out]
    assert not any(type(msg) in (Ping, PingReq) for msg in sent)
    assert m.counters["probes"] == 0
    # Pings get no ack, ping requests are refused.
    m.receive(5.0, 2, Ping(3, ()))
    m.receive(5.0, 2, PingReq(4, 3, ()))
    assert drain(m) == []
    assert m.counters["dropped_ping_req"] == 1
    # Alerts about a member that left are not refuted.
    m.receive(5.0, 8, alert_from(8, subject=1))
    assert m.incarnation == 0


def test_a_graceful_leave_is_decided_as_a_configuration_without_the_leaver():
    fleet = Fleet(8)
    fleet.run_until(1.5)
    fleet[SUBJECT].leave(1.5)
    fleet.run_until(4.0)
    for i, m in fleet.members.items():
        if i == SUBJECT:
            continue
        got = fleet.events(i)  # drains
        assert ev.MemberLeft(1.5, SUBJECT, 0) in got, i
        assert m.configuration.config_id == 1 and SUBJECT not in m.configuration, i
        decided = [e for e in got if isinstance(e, ev.ConfigurationDecided)]
        assert [(e.round, e.plan.removed) for e in decided] == [(0, (SUBJECT,))], i
    leaver = fleet[SUBJECT]
    assert leaver.removed
    assert isinstance(fleet.events(SUBJECT)[-1], ev.SelfRemoved)
    later = [e for e in fleet.trace if e[0] > 1.5 and e[2] == SUBJECT and type(e[3]) is Ping]
    assert later == []


def test_dead_about_self_is_evidence_and_gets_refuted():
    # Only a decided configuration removes a member (docs/design.md section 5); a verdict is
    # refuted.
    m = make_member(SUBJECT, CONFIG)
    m.receive(0.1, 1, Gossip((Dead(SUBJECT, 0, 1),)))
    assert not m.removed and m.incarnation == 1
    assert events(m) == [ev.SelfRefuted(0.1, 1)]
    refutations = of_type(drain(m), Gossip)
    assert {dest for dest, _ in refutations} == set(CONFIG.observers_of(SUBJECT))
    assert all(msg == Gossip((Alive(SUBJECT, 1),)) for _, msg in refutations)


def test_dead_about_an_older_incarnation_repeats_the_refutation():
    m = make_member(SUBJECT, CONFIG)
    m.receive(0.1, 1, alert_from(1))
    assert m.incarnation == 1
    drain(m), events(m)
    m.receive(0.2, 1, Gossip((Dead(SUBJECT, 0, 1),)))
    assert m.incarnation == 1 and not m.removed and events(m) == []
    m.receive(0.3, 2, Ping(9, ()))
    (_, ack), = drain(m)
    assert isinstance(ack, Ack) and Alive(SUBJECT, 1) in ack.updates


def test_a_member_keeps_answering_pings_that_carry_a_verdict_about_it():
    m = make_member(SUBJECT, CONFIG)
    m.receive(0.1, 1, Ping(9, (Dead(SUBJECT, 0, 1),)))
    assert not m.removed
    acks = of_type(drain(m), Ack)
    assert [(dest, msg.seq) for dest, msg in acks] == [(1, 9)]
    assert Alive(SUBJECT, 1) in acks[0][1].updates


# ---------------------------------------------------------------------------- anti-entropy


def test_first_digest_goes_to_one_peer_at_the_jittered_sync_time():
    params = Params()
    m = make_member(1, CONFIG, params=params, seed=5)
    rng = member_rng(5, 1)
    sync_at = params.sync_interval_s * (0.5 + rng.random())
    digests = []
    for t, out in step_alone(m, sync_at):
        for dest, msg in of_type(out, Digest):
            digests.append((t, dest, msg))
    assert len(digests) == 1
    t, dest, msg = digests[0]
    assert t == sync_at
    assert dest in CONFIG and dest != 1
    assert msg == Digest(0, *m.view_digest())


def test_digest_of_an_equal_view_gets_no_reply():
    a, b = make_member(1, CONFIG), make_member(2, CONFIG)
    for m in (a, b):
        m.receive(0.1, 3, Gossip((Dead(5, 0, 3), Alive(6, 2))))
        drain(m), events(m)
    assert a.view_digest() == b.view_digest()
    assert a.view_digest()[1] == 2
    a.receive(0.2, 2, Digest(0, *b.view_digest()))
    assert drain(a) == []
    assert a.counters["sync_mismatches"] == 0


def test_digest_mismatch_exchanges_views_in_pages_both_ways():
    params = Params(sync_interval_s=1_000.0, sync_page_entries=1)
    a = make_member(1, CONFIG, params=params)
    b = make_member(2, CONFIG, params=params)
    a.receive(0.1, 3, Gossip((Dead(5, 0, 3), Alive(6, 2))))
    b.receive(0.1, 3, Gossip((Left(7, 1),)))
    for m in (a, b):
        drain(m), events(m)
    assert a.view_digest() != b.view_digest()

    a.receive(0.2, 2, Digest(0, *b.view_digest()))
    pages = drain(a)
    assert pages == [
        (2, SyncState(0, 0, 2, (Dead(5, 0, 3),), True)),  # the original confirmer travels
        (2, SyncState(0, 1, 2, (Alive(6, 2),), True)),
    ]
    assert a.counters["sync_mismatches"] == 1

    deliver(0.2, a, b, pages[:1])
    assert drain(b) == []  # replies after the last page only
    deliver(0.2, a, b, pages[1:])
    replies = of_type(drain(b), SyncState)
    assert replies == [
        (1, SyncState(0, 0, 3, (Dead(5, 0, 3),), False)),
        (1, SyncState(0, 1, 3, (Alive(6, 2),), False)),
        (1, SyncState(0, 2, 3, (Left(7, 1),), False)),
    ]
    assert events(b) == [ev.MemberDead(0.2, 5, 0, 3), ev.MemberAlive(0.2, 6, 2)]

    deliver(0.3, b, a, replies)
    assert of_type(drain(a), SyncState) == []  # reply=False asks for nothing back
    assert events(a) == [ev.MemberLeft(0.3, 7, 1)]
    assert a.view_digest() == b.view_digest()
    assert a.view_digest()[1] == 3


def test_empty_view_mismatch_sends_one_empty_page():
    a = make_member(1, CONFIG)
    a.receive(0.1, 2, Digest(0, 12345, 1))
    assert drain(a) == [(2, SyncState(0, 0, 1, (), True))]


def test_anti_entropy_from_a_newer_configuration_asks_to_be_caught_up():
    a = make_member(1, CONFIG)
    a.receive(0.1, 2, Digest(1, 12345, 3))  # the sender holds configuration 1, we hold 0
    assert drain(a) == [(2, Digest(0, *a.view_digest()))]  # it answers with certificates
    a.receive(0.1, 2, SyncState(1, 0, 1, (Dead(5, 0, 2),), True))
    assert a.counters["dropped_other_config"] == 1
    assert drain(a) == [] and events(a) == []
    assert a.state_of(5) == (ALIVE, 0)


def test_suspicion_at_incarnation_zero_does_not_change_the_digest():
    a, b = make_member(6, CONFIG), make_member(7, CONFIG)
    a.receive(0.1, 1, alert_from(1))
    assert a.state_of(SUBJECT) == (SUSPECT, 0)
    drain(a)
    a.receive(0.2, 7, Digest(0, *b.view_digest()))
    assert a.view_digest() == b.view_digest()
    assert drain(a) == []


def test_suspicion_at_a_higher_incarnation_does_not_change_the_digest():
    a, b = make_member(6, CONFIG), make_member(7, CONFIG)
    for m in (a, b):
        m.receive(0.1, SUBJECT, Gossip((Alive(SUBJECT, 1),)))
    a.receive(0.2, 1, alert_from(1, incarnation=1))
    assert a.state_of(SUBJECT) == (SUSPECT, 1)
    assert a.view_digest() == b.view_digest()


# ---------------------------------------------------------------------------- dissemination


def test_news_is_pushed_at_once_and_sent_transmit_limit_times_in_all():
    x = make_member(1, CONFIG)
    dead = Dead(5, 0, 3)
    x.receive(0.01, 3, Gossip((dead,)))
    assert x.next_deadline() == 0.01
    x.handle_timer(0.01)
    first = drain(x)
    assert [m for _, m in first] == [Gossip((dead,))] * P.gossip_fanout
    dests = [d for d, _ in first]
    assert len(set(dests)) == P.gossip_fanout and not {1, 5} & set(dests)
    later = [m for _, out in step_alone(x, 5.0) for _, m in out]  # pings, ping requests, gossip
    carried = [m for m in [m for _, m in first] + later if dead in getattr(m, "updates", ())]
    assert len(carried) == P.transmit_limit(len(CONFIG))


# ---------------------------------------------------------------------------- determinism


def _scripted_trace(seed: int) -> tuple[list, list, list]:
    fleet = Fleet(8, seed=seed, params=Params())
    fleet.run_until(2.0)
    fleet.down.add(SUBJECT)
    fleet.run_until(9.0)
    fleet[3].leave(9.0)
    fleet.run_until(14.0)
    evs = [fleet.events(i) for i in fleet.members]
    return fleet.trace, fleet.dropped, evs


def test_same_seed_same_trace_other_seed_other_trace():
    trace, dropped, evs = _scripted_trace(3)
    again = _scripted_trace(3)
    assert trace == again[0]
    assert dropped == again[1]
    assert evs == again[2]
    assert len(trace) > 100 and any(type(e) is ev.MemberDead for es in evs for e in es)
    other = _scripted_trace(4)
    assert other[0] != trace


# ---------------------------------------------------------------------------- local misuse


def test_time_going_backwards_raises():
    m = make_member(1, CONFIG, now=5.0)
    with pytest.raises(LocalProtocolError):
        m.handle_timer(4.0)
    m.receive(6.0, 2, Ping(1, ()))
    for call in (
        lambda: m.receive(5.5, 2, Ping(2, ())),
        lambda: m.handle_timer(5.5),
        lambda: m.leave(5.5),
        lambda: m.report_send_error(5.5, 2),
    ):
        with pytest.raises(LocalProtocolError):
            call()
    assert drain(m) == [(2, Ack(1, ()))]
    assert not m.left and m.counters["send_errors"] == 0
    m.receive(6.0, 2, Ping(3, ()))  # the same instant is fine
    assert drain(m) == [(2, Ack(3, ()))]


def test_member_must_belong_to_its_configuration():
    with pytest.raises(ValueError):
        make_member(99, CONFIG)
    m = make_member(1, CONFIG)
    with pytest.raises(KeyError):
        m.state_of(99)


# ---------------------------------------------------------------------------- bounds


def test_outbox_beyond_max_outbox_drops_the_oldest_and_counts():
    m = make_member(1, CONFIG, params=Params(max_outbox=2))
    for seq in range(1, 6):
        m.receive(0.1, 2, Ping(seq, ()))
    assert drain(m) == [(2, Ack(4, ())), (2, Ack(5, ()))]
    assert m.counters["outbox_dropped"] == 3
    assert m.counters["sent"] == 5


def test_events_beyond_max_events_drop_the_oldest_and_count():
    x = make_member(6, CONFIG, params=Params(max_events=2))
    a, b, c = OBSERVERS[:3]
    for o in (a, b, c):
        x.receive(0.1, o, alert_from(o))
    # MemberSuspected, then AlertRaised for each of the three observers: four events.
    assert events(x) == [ev.AlertRaised(0.1, b, SUBJECT, 0), ev.AlertRaised(0.1, c, SUBJECT, 0)]
    assert x.counters["events_dropped"] == 2


def test_stalled_observer_reads_its_backlog_before_convicting():
    fleet = Fleet(8, params=NO_ALERTS)
    fleet.down.add(SUBJECT)
    fleet.run_until(0.1)
    x = fleet[1]
    accusers = [o for o in OBSERVERS if o != 1]
    for o in accusers:
        x.receive(0.1, o, alert_from(o))
    deadline = x.next_deadline()
    assert deadline <= 0.1 + NO_ALERTS.suspicion_min_s
    # Our loop stalls past the conviction deadline; the subject's refutation sits in our socket.
    wake = 0.1 + NO_ALERTS.suspicion_max_s
    x.handle_timer(wake)
    assert x.counters["stalls"] == 1
    assert x.state_of(SUBJECT) == (SUSPECT, 0)
    x.receive(wake, SUBJECT, Gossip((Alive(SUBJECT, 1),)))
    x.handle_timer(wake + NO_ALERTS.round_timeout_s)
    assert x.state_of(SUBJECT) == (ALIVE, 1)
    assert not [e for e in fleet.events(1) if type(e) is ev.MemberDead]


def test_stalled_observer_still_convicts_a_silent_subject_after_the_grace():
    fleet = Fleet(8, params=NO_ALERTS)
    fleet.down.add(SUBJECT)
    fleet.run_until(0.1)
    x = fleet[1]
    for o in [o for o in OBSERVERS if o != 1]:
        x.receive(0.1, o, alert_from(o))
    wake = 0.1 + NO_ALERTS.suspicion_max_s
    x.handle_timer(wake)
    assert x.state_of(SUBJECT) == (SUSPECT, 0)
    # Back on time, with nothing from the subject in the backlog: it is convicted at the grace.
    step_alone(x, wake + NO_ALERTS.round_timeout_s)
    assert x.state_of(SUBJECT) == (DEAD, 0)
    dead = [e for e in events(x) if type(e) is ev.MemberDead]
    assert [(e.at, e.confirmer) for e in dead] == [(wake + NO_ALERTS.round_timeout_s, 1)]


# ------------------------------------------------------------------ fast evidence


def test_evidence_makes_an_observer_alert_at_once_and_tell_the_subject():
    o = make_member(1, CONFIG)
    assert 1 in OBSERVERS
    assert o.report_unreachable(0.2, SUBJECT) is True
    alert = Alert(1, SUBJECT, 0)
    assert events(o) == [ev.MemberSuspected(0.2, SUBJECT, 0, 1), ev.AlertRaised(0.2, 1, SUBJECT, 0)]
    assert (SUBJECT, Gossip((alert,))) in drain(o)
    assert o.alerts_about(SUBJECT) == (1,)
    assert o.counters["evidence_reported"] == 1
    assert o.counters["alerts_raised"] == 1
    # The same evidence again raises nothing new: one alert per incarnation.
    assert o.report_unreachable(0.3, SUBJECT) is False
    assert o.counters["alerts_raised"] == 1


def test_evidence_at_a_non_observer_probes_the_subject_now_and_alerts_nobody():
    x = make_member(6, CONFIG)
    assert 6 not in OBSERVERS
    assert x.report_unreachable(0.2, SUBJECT) is False
    out = drain(x)
    assert [(d, type(m)) for d, m in out] == [(SUBJECT, Ping)]
    assert events(x) == []
    # A second report while that round is open sends no second ping.
    assert x.report_unreachable(0.25, SUBJECT) is False
    assert drain(x) == []


def test_evidence_about_self_a_stranger_or_after_leaving_is_ignored():
    o = make_member(1, CONFIG)
    assert o.report_unreachable(0.1, 1) is False
    assert o.report_unreachable(0.1, 999) is False
    o.leave(0.2)
    drain(o)
    assert o.report_unreachable(0.3, SUBJECT) is False
    assert drain(o) == [] and o.counters["alerts_raised"] == 0


def test_an_exit_reaped_by_the_launcher_is_announced_as_a_departure():
    x = make_member(6, CONFIG)  # any member: no observer role needed for certain evidence
    assert x.report_exited(0.2, SUBJECT) is True
    assert events(x) == [ev.MemberLeft(0.2, SUBJECT, 0)]
    assert x.state_of(SUBJECT) == (MemberState.LEFT, 0)
    assert x.counters["exits_reported"] == 1
    # Disseminated at once, like the subject's own Left, and only once.
    assert x.next_deadline() == 0.2
    x.handle_timer(0.2)
    assert any(isinstance(m, Gossip) and Left(SUBJECT, 0) in m.updates for _, m in drain(x))
    assert x.report_exited(0.3, SUBJECT) is False and events(x) == []
    assert x.report_exited(0.3, 6) is False and x.report_exited(0.3, 999) is False


def test_a_silent_pulse_makes_an_observer_raise_a_silent_alert_at_once():
    o = make_member(1, CONFIG)
    assert 1 in OBSERVERS and SUBJECT in o.subjects
    assert o.report_silent(0.2, SUBJECT) is True
    alert = Alert(1, SUBJECT, 0, True)
    assert events(o) == [ev.MemberSuspected(0.2, SUBJECT, 0, 1), ev.AlertRaised(0.2, 1, SUBJECT, 0)]
    assert (SUBJECT, Gossip((alert,))) in drain(o)
    assert o.counters["silences_reported"] == 1 and o.counters["alerts_raised"] == 1
    # One alert per incarnation, whatever the evidence.
    assert o.report_silent(0.3, SUBJECT) is False
    assert o.report_unreachable(0.3, SUBJECT) is False
    assert o.counters["alerts_raised"] == 1


def test_a_silence_is_only_heard_from_an_observer_that_is_not_cut_off_itself():
    x = make_member(6, CONFIG)
    assert SUBJECT not in x.subjects
    assert x.report_silent(0.2, SUBJECT) is False  # not one it watches: no probe either
    assert drain(x) == [] and events(x) == []
    lone = make_member(1, CONFIG, params=P)
    step_alone(lone, P.self_suspect_after_s + P.round_timeout_s)
    assert lone.self_suspected
    drain(lone)
    alerts = lone.counters["alerts_raised"]
    assert lone.report_silent(lone.next_deadline(), SUBJECT) is False
    assert lone.counters["silences_ignored_isolated"] == 1
    assert lone.counters["alerts_raised"] == alerts
    o = make_member(1, CONFIG)
    assert o.report_silent(0.1, 1) is False and o.report_silent(0.1, 999) is False


def test_a_silent_alert_from_the_wire_counts_as_silent_and_a_refutation_forgets_it():
    x = make_member(6, CONFIG, params=NO_ALERTS)
    observers = sorted(OBSERVERS)
    x.receive(0.1, observers[0], alert_from(observers[0]))  # a plain one among them
    for i, observer in enumerate(observers[1:]):
        x.receive(0.1 * (i + 2), observer, Gossip((Alert(observer, SUBJECT, 0, True),)))
    assert x.alerts_about(SUBJECT) == tuple(observers)
    assert x.silent_alerts_about(SUBJECT) == tuple(observers[1:])
    x.receive(1.0, SUBJECT, Gossip((Alive(SUBJECT, 1),)))
    assert x.alerts_about(SUBJECT) == () and x.silent_alerts_about(SUBJECT) == ()


def test_silence_about_an_incarnation_is_forgotten_when_a_newer_one_is_accused():
    # A plain alert about the refuted incarnation can arrive before the refutation itself: the
    # silence of the old incarnation must not carry over to it (it would waive the refutation
    # window of a member whose loop is merely stalled).
    x = make_member(6, CONFIG, params=NO_ALERTS)
    observers = sorted(OBSERVERS)
    for observer in observers:
        x.receive(0.1, observer, Gossip((Alert(observer, SUBJECT, 0, True),)))
    x.receive(0.5, observers[0], Gossip((Alert(observers[0], SUBJECT, 1),)))
    x.receive(0.6, SUBJECT, Gossip((Alive(SUBJECT, 1),)))  # late: changes nothing now
    assert x.alerts_about(SUBJECT) == (observers[0],)
    assert x.silent_alerts_about(SUBJECT) == ()


def _first_sent(fleet: Fleet, kind: type) -> list[tuple[float, int]]:
    """(time, sender) of every ``kind`` message in the fleet's trace, in order."""
    return [(at, src) for at, src, _, msg in fleet.trace if isinstance(msg, kind)]


def _decisions(fleet: Fleet, member: int) -> list[ev.ConfigurationDecided]:
    return [e for e in fleet.events(member) if isinstance(e, ev.ConfigurationDecided)]


def test_the_cut_for_an_exit_waits_only_exit_settle_s_not_the_refutation_window():
    fleet = Fleet(8, params=P)
    fleet.run_until(3.0)
    fleet.down.add(8)
    for i in range(1, 8):
        fleet[i].report_exited(fleet.now, 8)
    fleet.run_until(3.0 + P.cut_settle_s)
    # Every survivor votes exactly exit_settle_s after it learned of the exit (not the 0.6 s
    # an accusation's cut waits, nor the refutation window a stalled member is owed), and the
    # fast round decides at once on the zero-latency network.
    votes = _first_sent(fleet, Vote)
    assert votes and votes[0][0] == 3.0 + P.exit_settle_s
    assert {src for _, src in votes} == set(range(1, 8))
    for i in range(1, 8):
        (decided,) = _decisions(fleet, i)
        assert decided.round == 0 and decided.at < 3.0 + P.exit_settle_s + 0.05
        assert 8 not in fleet[i].configuration and fleet[i].configuration.config_id == 1


def _silenced_at(fleet: Fleet, subject: int, observers, at: float, *, plain: int = 0) -> None:
    """``observers`` report ``subject`` silent at ``at``; the first ``plain`` of them raise a
    plain alert instead (evidence without the pulse: a collective error, say)."""
    for i, observer in enumerate(observers):
        if i < plain:
            fleet[observer].report_unreachable(at, subject)
        else:
            fleet[observer].report_silent(at, subject)
    fleet.flush()


def test_a_member_every_needed_observer_finds_silent_is_voted_out_after_exit_settle_s():
    fleet = Fleet(8, params=NO_ALERTS)
    fleet.run_until(3.0)
    fleet.down.add(8)  # stopped: no refutation will come
    _silenced_at(fleet, 8, fleet[1].configuration.observers_of(8), 3.0)
    fleet.run_until(3.0 + NO_ALERTS.refutation_window_s)
    # No refutation window, no suspicion_min_s and no cut_settle_s: the silence of its whole
    # process is as certain as an exit.
    votes = _first_sent(fleet, Vote)
    assert votes and votes[0][0] == 3.0 + NO_ALERTS.exit_settle_s
    assert {src for _, src in votes} == set(range(1, 8))
    for i in range(1, 8):
        (decided,) = _decisions(fleet, i)
        assert decided.round == 0 and 8 not in fleet[i].configuration


def test_two_stopped_members_that_observe_each_other_are_both_voted_out_after_exit_settle_s():
    # Each is an observer of the other and cannot alert: its alert counts implicitly (Rapid
    # section 4.2), and every observer that can speak found it silent.
    fleet = Fleet(8, params=NO_ALERTS)
    config = fleet[1].configuration
    a, b = next((a, b) for a in range(1, 9) for b in range(a + 1, 9)
                if a in config.observers_of(b) and b in config.observers_of(a))
    fleet.run_until(3.0)
    fleet.down |= {a, b}
    for stopped, other in ((a, b), (b, a)):
        _silenced_at(fleet, stopped, [o for o in config.observers_of(stopped) if o != other],
                     3.0)
    p = NO_ALERTS
    fleet.run_until(3.0 + p.exit_settle_s + p.classic_timeout_s + p.classic_spread_s + 0.1)
    votes = _first_sent(fleet, Vote)
    assert votes and votes[0][0] == 3.0 + p.exit_settle_s
    # Six voters of eight cannot make the fast quorum (7): a classic round decides.
    for i in [i for i in range(1, 9) if i not in (a, b)]:
        (decided,) = _decisions(fleet, i)
        assert decided.round >= 1 and a not in fleet[i].configuration
        assert b not in fleet[i].configuration


def test_a_member_only_some_observers_find_silent_keeps_its_refutation_window():
    fleet = Fleet(8, params=NO_ALERTS)
    fleet.run_until(3.0)
    fleet.down.add(8)
    _silenced_at(fleet, 8, fleet[1].configuration.observers_of(8), 3.0, plain=1)
    fleet.run_until(3.0 + NO_ALERTS.refutation_window_s + NO_ALERTS.cut_settle_s)
    votes = _first_sent(fleet, Vote)
    assert votes and votes[0][0] == 3.0 + NO_ALERTS.refutation_window_s
    assert all(8 not in fleet[i].configuration for i in range(1, 8))


def test_a_cut_leaving_no_fast_quorum_is_led_into_a_classic_round_by_its_first_kept_member():
    # Two of six exit: four voters can never make the fast quorum of six (5), so member 1,
    # the first member the cut keeps, starts classic round 1 as soon as it has voted, instead
    # of after classic_timeout_s; the other voters only vote and promise.
    fleet = Fleet(6, params=P)
    fleet.run_until(3.0)
    fleet.down |= {5, 6}
    for i in range(1, 5):
        fleet[i].report_exited(fleet.now, 5)
        fleet[i].report_exited(fleet.now, 6)
    fleet.run_until(3.0 + P.classic_timeout_s)
    assert _first_sent(fleet, Prepare) == [(3.0 + P.exit_settle_s, 1)] * 3  # to 2, 3 and 4
    for i in range(1, 5):
        (decided,) = _decisions(fleet, i)
        assert decided.round == 1 and decided.at < 3.0 + P.exit_settle_s + 0.05
        assert fleet[i].configuration.config_id == 1
        assert not {5, 6} & set(fleet[i].configuration.members)
    assert sum(fleet[i].counters["classic_rounds_started"] for i in range(1, 5)) == 1


def test_a_cut_with_an_accusation_waits_classic_timeout_s_though_no_fast_quorum_is_left():
    # 5 and 6 go silent: the cut {5, 6} leaves four voters of six, but both are only accused
    # (they may yet refute), so the first classic round comes classic_timeout_s after the
    # first vote, not at once.
    fleet = Fleet(6, params=P)
    fleet.run_until(3.0)
    fleet.down |= {5, 6}
    fleet.run_until(20.0)
    votes, prepares = _first_sent(fleet, Vote), _first_sent(fleet, Prepare)
    assert votes and prepares
    assert prepares[0][0] >= votes[0][0] + P.classic_timeout_s
    for i in range(1, 5):
        (decided,) = _decisions(fleet, i)
        assert decided.round >= 1 and not {5, 6} & set(fleet[i].configuration.members)


def test_a_cut_that_still_allows_a_fast_quorum_starts_no_classic_round_early():
    fleet = Fleet(6, params=P)
    fleet.run_until(3.0)
    fleet.down.add(6)
    for i in range(1, 6):
        fleet[i].report_exited(fleet.now, 6)
    fleet.run_until(3.0 + P.classic_timeout_s + P.classic_spread_s)
    assert _first_sent(fleet, Prepare) == []
    assert [[d.round for d in _decisions(fleet, i)] for i in range(1, 6)] == [[0]] * 5


def test_last_ack_at_moves_only_with_answers_to_open_probes_not_with_a_stall():
    fleet = Fleet(8, params=P)
    fleet.run_until(3.0)
    o = fleet[1]
    answered = o.last_ack_at
    assert 2.0 < answered <= 3.0
    # Ten silent seconds of our own (a SIGSTOP): the stall voids the open rounds and must not
    # look like an answer, so a lease resting on last_ack_at has expired on waking.
    o.handle_timer(13.0)
    assert o.counters["stalls"] == 1
    assert o.last_ack_at == answered
