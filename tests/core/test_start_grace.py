"""The start-up grace (``Params.start_grace_s``, ``Member``'s ``started``): a member of the first
configuration that nobody has heard from yet is accused by nobody until its grace ends; a member
that never starts is still convicted, exactly that much later."""

from __future__ import annotations

import dataclasses
import math

import pytest

from torchpass_p2p.core import events as ev
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.membership import Member
from torchpass_p2p.core.messages import Ack, Alert, Gossip, MemberState, Ping

from .helpers import QUIET, Fleet, drain, events, member_rng, step_alone

GRACE = dataclasses.replace(QUIET, start_grace_s=10.0)
PAIR = Configuration(0, [1, 2])
P = GRACE


def member(started: dict[int, float] | None, *, params=GRACE, config=PAIR, me: int = 1,
           now: float = 0.0) -> Member:
    return Member(me, config, params=params, rng=member_rng(0, me), now=now, started=started)


def alerts_sent(steps) -> list[tuple[float, Alert]]:
    """Each alert in the gossip of ``steps`` (``step_alone``'s), with when it was first sent."""
    first: list[tuple[float, Alert]] = []
    for t, sent in steps:
        for _, msg in sent:
            if type(msg) is Gossip:
                first += [(t, u) for u in msg.updates
                          if type(u) is Alert and all(u != a for _, a in first)]
    return first


def expected_alert_at(t0: float, grace_end: float, params=GRACE) -> float:
    """When member 1 of ``PAIR`` (one subject, no relays), probing a silent member 2 since
    ``t0`` (health 0: no counted failure yet), raises its alert: at the second failed round that
    ends at or after ``grace_end``. The first such round ends ``round_timeout_s`` after its
    ping and raises the health to 1; the next ping follows ``probe_interval_s`` after (its slot
    was drawn at health 0), and its round lasts twice ``round_timeout_s``."""
    pi, rt = params.probe_interval_s, params.round_timeout_s
    k = max(0, math.ceil((grace_end - rt - t0) / pi))  # the first round that counts
    return t0 + (k + 1) * pi + 2 * rt


def test_a_member_nobody_heard_from_is_not_accused_until_its_grace_ends_then_convicted():
    m = member({2: 0.0})
    t0 = m.next_deadline()
    steps = step_alone(m, 9.99)
    pings = [t for t, sent in steps for _, msg in sent if type(msg) is Ping]
    assert pings == pytest.approx([t0 + k * P.probe_interval_s for k in range(len(pings))])
    assert alerts_sent(steps) == []
    ended = sum(1 for t in pings if t + P.round_timeout_s <= 9.99)
    c = m.counters
    assert c["rounds_in_start_grace"] == ended >= 8
    assert "probe_rounds_failed" not in c and "alerts_raised" not in c
    assert m.health == 0 and m.state_of(2) == (MemberState.ALIVE, 0)
    assert [e for e in events(m) if isinstance(
        e, ev.MemberSuspected | ev.AlertRaised | ev.MemberDead)] == []

    # Its grace is over: rounds count again, and the member that never started is convicted.
    at = expected_alert_at(t0, 10.0)
    steps = step_alone(m, at + P.suspicion_min_s)
    [(t, alert)] = alerts_sent(steps)
    assert t == pytest.approx(at) and alert == Alert(1, 2, 0)
    assert m.counters["probe_rounds_failed"] == 2
    dead = [e for e in events(m) if type(e) is ev.MemberDead]
    # field by field: the compiled event class takes only a float for ``at``
    assert [(d.at, d.member, d.incarnation, d.confirmer) for d in dead] == [
        (pytest.approx(at + P.suspicion_min_s), 2, 0, 1)]


def test_a_member_heard_from_once_is_owed_no_grace():
    m = member({2: 0.0})
    t0 = m.next_deadline()
    m.handle_timer(t0)
    [(dest, ping)] = drain(m)
    assert dest == 2 and type(ping) is Ping
    m.receive(t0 + 0.01, 2, Ack(ping.seq, ()))  # it has started: then falls silent
    steps = step_alone(m, 9.0)
    # Two failed rounds, as without any grace: the next ping's round (health 0), then the
    # one after (health 1, twice as long).
    [(t, alert)] = alerts_sent(steps)
    assert t == pytest.approx(t0 + 2 * P.probe_interval_s + 2 * P.round_timeout_s)
    assert alert == Alert(1, 2, 0)
    assert "rounds_in_start_grace" not in m.counters


@pytest.mark.parametrize(("started", "grace_end"), [
    ({2: -25.0}, 5.0),   # started by its launcher 25 s before this member: 5 s left
    ({2: 50.0}, 30.0),   # a start after now is taken as now: the grace never exceeds 30 s
    ({}, 30.0),          # not in the record: counted from this member's own start
    (None, 0.0),         # no record at all (a joiner, the simulator): no grace
])
def test_the_grace_runs_from_the_recorded_start_and_never_past_start_grace_s(started,
                                                                            grace_end):
    params = dataclasses.replace(QUIET, start_grace_s=30.0)
    m = member(started, params=params)
    t0 = m.next_deadline()
    at = expected_alert_at(t0, grace_end, params)
    [(t, alert)] = alerts_sent(step_alone(m, at + 0.01))
    assert t == pytest.approx(at) and alert == Alert(1, 2, 0)


def test_reports_of_silence_or_unreachability_count_for_nothing_in_the_grace_an_exit_does():
    m = member({2: 0.0})
    assert m.report_unreachable(1.0, 2) is False
    assert m.report_silent(1.0, 2) is False
    assert m.counters["evidence_in_start_grace"] == 2
    assert "alerts_raised" not in m.counters and m.state_of(2) == (MemberState.ALIVE, 0)
    # An exit its launcher reaped is certain: no grace.
    assert m.report_exited(1.5, 2) is True
    assert m.state_of(2) == (MemberState.LEFT, 0)

    m = member({2: 0.0})
    m.receive(2.0, 2, Ping(1, ()))  # heard from: its silence now counts at once
    assert m.report_silent(2.5, 2) is True
    assert m.counters["alerts_raised"] == 1


def test_a_member_reported_started_by_a_commit_is_owed_no_grace():
    # A rank that voted in a commit runs: a stop right after it is evidence at once, even
    # before any datagram of its agent arrived (a short job's first second).
    m = member({2: 0.0})
    m.report_started(0.5, (1, 2, None))
    assert m.report_silent(1.0, 2) is True
    assert m.counters["alerts_raised"] == 1
    assert "evidence_in_start_grace" not in m.counters


def test_a_member_whose_process_starts_3_s_late_is_never_accused():
    # Three members of configuration 0; member 3's process starts 3 s after the others' (a
    # loaded host), its agent only then: members 1 and 2 probe it from their start.
    def late_start(started: dict[int, float] | None) -> Fleet:
        fleet = Fleet(3, params=dataclasses.replace(QUIET, start_grace_s=30.0))
        for i in (1, 2):
            fleet.members[i] = member(started, params=fleet.params, config=fleet.config, me=i)
        fleet.down = {3}
        fleet.run_until(3.0)
        fleet.members[3] = member(started, params=fleet.params, config=fleet.config, me=3,
                                  now=3.0)
        fleet.down = set()
        fleet.run_until(60.0)
        return fleet

    fleet = late_start({1: 0.0, 2: 0.0, 3: 0.0})
    for i in (1, 2, 3):
        assert fleet[i].counters["alerts_raised"] == 0, i
        assert [e for e in fleet.events(i) if isinstance(
            e, ev.MemberSuspected | ev.AlertRaised | ev.MemberDead)] == [], i
        assert all(fleet[i].state_of(j) == (MemberState.ALIVE, 0) for j in (1, 2, 3))
        assert fleet[i].configuration.config_id == 0
    assert fleet.config.observers_of(3) == (1,)
    assert fleet[1].counters["rounds_in_start_grace"] == 2  # the rounds before 3 s

    # The same start without the launcher's record (no grace): member 3 is accused by its
    # observer before it runs, and convicted.
    fleet = late_start(None)
    raised = [e for i in (1, 2) for e in fleet.events(i)
              if type(e) is ev.AlertRaised and e.subject == 3]
    assert {e.observer for e in raised} == {1} and all(e.at < 3.0 for e in raised)
