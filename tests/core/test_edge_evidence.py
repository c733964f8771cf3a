"""Detection is about edges (issue 32, item 1): a member that only one peer reaches is accused.

A round that only a relay's ack saved leaves the observer's count of failed rounds as it was; a
refutation relayed by a third party clears suspicions but not an observer's count; a subject
refutes an accusation only once the accusing observer reaches it (an observer's word within
``probe_interval_s``, at once or later), so a subject cut off from its observers lets their
evidence stand; an ack that came through a relay does not postpone a conviction. Exact times
come from :class:`Params` and the seeded rngs (tests/core/test_membership.py's conventions).
"""

from __future__ import annotations

import pytest

from tests.core.helpers import QUIET, Fleet, drain, events, make_member, step_alone
from tests.core.test_membership import (
    CONFIG,
    HEARD,
    LONE,
    OBSERVERS,
    SUBJECT,
    _observer_with_all_alerts,
    _pings_to_subject,
    alert_from,
)
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.messages import Ack, Alive, Dead, Gossip, MemberState, Ping, PingReq

ALIVE, SUSPECT, DEAD, LEFT = MemberState
P = QUIET
OBSERVER = 1
"""Observes SUBJECT (4), which observes it back. Of SUBJECT's other members, 3 observes it and
6 and 7 do not (tests/core/test_membership.py checks the rings)."""


def test_rounds_saved_by_relays_keep_the_count_and_the_cut_off_subject_does_not_refute():
    assert P.failed_rounds_to_alert == 2 and OBSERVER in OBSERVERS
    p = _pings_to_subject(OBSERVER, count=8)
    fleet = Fleet(8)
    cut = {(OBSERVER, SUBJECT), (SUBJECT, OBSERVER)}
    relays_lost = [True]  # round 0: every datagram to SUBJECT lost (a failed round)

    def drop(src: int, dst: int, msg: object) -> bool:
        return (src, dst) in cut or (relays_lost[0] and dst == SUBJECT)

    fleet.drop = drop
    fleet.run_until(p[0] + P.round_timeout_s)
    o = fleet[OBSERVER]
    assert o.counters["probe_rounds_failed"] == 1
    # Rounds 1-2: a relay's ping gets through and its ack comes back; the count stays at 1.
    relays_lost[0] = False
    fleet.run_until(p[3] - 1e-6)
    assert o.counters["probe_rounds_relayed"] == 2 and o.counters["alerts_raised"] == 0
    # Round 3 fails again: the second failed round in a row of this edge alerts.
    relays_lost[0] = True
    fleet.run_until(p[3] + P.round_timeout_s)
    mine = [e for e in fleet.events(OBSERVER) if type(e) is ev.AlertRaised
            and e.observer == OBSERVER and e.subject == SUBJECT]
    assert mine == [ev.AlertRaised(p[3] + P.round_timeout_s, OBSERVER, SUBJECT, 0)]
    relays_lost[0] = False
    # The alert reached SUBJECT through third parties. OBSERVER cannot reach it, but most of
    # its neighbours do: it is not cut off, and refutes at once (one bad link removes nobody).
    fleet.run_until(p[4] - 1e-6)
    s = fleet[SUBJECT]
    assert s.incarnation == 1 and s.counters["refutations_deferred"] == 0
    assert fleet[6].state_of(SUBJECT) == (ALIVE, 1)


@pytest.mark.parametrize(("sender", "alerts_again"), [(6, True), (SUBJECT, False)])
def test_only_a_refutation_straight_from_the_subject_clears_the_failed_rounds(
        sender: int, alerts_again: bool) -> None:
    # SUBJECT is down from before round 0; OBSERVER alerts at the end of round 1. Its
    # refutation arrives relayed by member 6 (the edge still fails: the next failed round
    # alerts about the new incarnation) or straight from SUBJECT (M more rounds needed).
    p = _pings_to_subject(OBSERVER, count=3)
    fleet = Fleet(8)
    fleet.down.add(SUBJECT)
    fleet.run_until(p[1] + P.round_timeout_s)
    o = fleet[OBSERVER]
    assert o.counters["alerts_raised"] == 1 and o.health == 0
    refuted_at = p[1] + P.round_timeout_s + 0.01
    fleet.now = refuted_at
    o.receive(refuted_at, sender, Gossip((Alive(SUBJECT, 1),)))
    assert o.state_of(SUBJECT) == (ALIVE, 1)
    fleet.run_until(p[2] + P.round_timeout_s)
    mine = [e for e in fleet.events(OBSERVER) if type(e) is ev.AlertRaised
            and e.observer == OBSERVER and e.subject == SUBJECT]
    first = ev.AlertRaised(p[1] + P.round_timeout_s, OBSERVER, SUBJECT, 0)
    again = ev.AlertRaised(p[2] + P.round_timeout_s, OBSERVER, SUBJECT, 1)
    assert mine == ([first, again] if alerts_again else [first])
    assert o.counters["probe_rounds_failed"] == 3


def _quiet_subject(until: float) -> object:
    s = make_member(SUBJECT, CONFIG, params=LONE)
    step_alone(s, until)  # it hears nobody; everything it sends is lost
    drain(s), events(s)
    return s


def test_a_subject_refutes_at_once_an_accuser_it_heard_within_a_probe_interval():
    s = _quiet_subject(2.0)
    s.receive(2.0, OBSERVER, Ping(7, ()))
    drain(s)
    s.receive(2.0 + LONE.probe_interval_s, 6, alert_from(OBSERVER))  # relayed by member 6
    assert s.incarnation == 1
    assert events(s) == [ev.SelfRefuted(2.0 + LONE.probe_interval_s, 1)]
    assert s.counters["refutations_deferred"] == 0


def test_a_verdict_by_unreachable_accusers_stands_until_one_reaches_the_subject():
    assert 3 in OBSERVERS and 6 not in OBSERVERS
    s = _quiet_subject(3.0)  # nobody reached it for over two probe intervals
    s.receive(3.0, 6, alert_from(OBSERVER))  # relayed by member 6
    s.receive(3.1, 6, Gossip((Dead(SUBJECT, 0, 3),)))  # confirmed by observer 3
    assert s.incarnation == 0 and events(s) == [] and not s.removed
    assert s.counters["refutations_deferred"] == 2
    s.receive(3.2, 6, Ping(8, ()))  # a member that accused nobody: still no refutation
    assert s.incarnation == 0
    drain(s)
    s.receive(3.3, 3, Ping(9, ()))  # the confirmer reaches it: refuted in the ack
    assert s.incarnation == 1 and events(s) == [ev.SelfRefuted(3.3, 1)]
    out = drain(s)
    assert out[-1] == (3, Ack(9, (Alive(SUBJECT, 1),)))


def test_a_verdict_naming_no_observer_of_the_subject_is_refuted_at_once():
    # Nothing names an edge to check: the verdict is refuted as a plain accusation.
    assert 7 not in OBSERVERS
    s = _quiet_subject(2.0)
    s.receive(2.0, 3, Gossip((Dead(SUBJECT, 0, 7),)))
    assert s.incarnation == 1 and events(s) == [ev.SelfRefuted(2.0, 1)]


def test_an_ack_through_a_relay_does_not_postpone_a_conviction():
    x, deadline = _observer_with_all_alerts()
    # SUBJECT answers every relay's ping, never x's own: x's rounds are saved, not answered.
    while (due := x.next_deadline()) <= deadline:
        x.handle_timer(due)
        for dest, msg in drain(x):
            if type(msg) is PingReq and msg.target == SUBJECT:
                x.receive(due, dest, Ack(msg.seq, ()))
    assert x.counters["probe_rounds_relayed"] >= 1
    assert x.counters["convictions_postponed"] == 0
    dead = [e for e in events(x) if type(e) is ev.MemberDead]
    assert dead == [ev.MemberDead(deadline, SUBJECT, 0, 1)]
    assert HEARD.failed_rounds_to_alert == 1_000  # x's own rounds raised nothing
