"""Membership invariants checked as events happen, and convergence checked at the end of a run.

An :class:`InvariantChecker` joins ``cluster.listeners`` and sees every event of every core the
moment the host drains it, so a violation is caught at the event that breaks it, with its time and
members, not reconstructed after the run. Each check below follows from the code of
:mod:`torchpass_p2p.core.membership`; the name in brackets starts every violation message.

Host side (sims/cluster.py):

* [silent-when-crashed] a crashed process, or one whose loop is blocked, produces no event.
* [silent-after-removal] after ``SelfRemoved`` a member produces no event (``receive`` and
  ``handle_timer`` return early once ``removed`` is set).

Incarnations (SWIM section 4.2; only a member raises its own):

* [refute-by-one] each ``SelfRefuted`` raises the member's incarnation by exactly one: it answers
  an alert at the incarnation it holds, since nobody can know a higher one.
* [refute-real-alert] a refutation answers an alert its observer really raised.
* [minted-by-owner] no event names a member at an incarnation above the member's own.

One holder's view of one subject (``_merge`` only moves forward):

* [view-monotone] the incarnations a holder reports about a subject never decrease, and
  ``MemberAlive`` only ever reports a strictly higher one.
* [dead-until-newer] after ``MemberDead`` at incarnation i the holder reports nothing about that
  subject but ``MemberAlive`` above i; after ``MemberLeft`` nothing at all (Left is final).
* [alert-in-suspicion] ``AlertRaised`` comes within a suspicion of that incarnation, once per
  observer.

Accusation and conviction (Rapid section 4.1, Lifeguard section IV-B):

* [alert-by-observer] every alert names one of the subject's K observers.
* [alert-has-origin] an alert reaches others only after its observer raised it itself.
* [quorum] the member that convicts (the confirmer, whose own ``MemberDead`` names itself) holds
  alerts from at least ``min(L, observers)`` distinct observers: no single accuser convicts.
* [suspicion-timeout] it convicts no sooner than ``suspicion_min_s`` after its suspicion began
  (``suspicion_max_s`` when it does not observe the subject itself: the fallback).
* [dead-has-origin] every other ``MemberDead`` follows the named confirmer's own conviction at
  that incarnation.
* [removed-by-decision] ``SelfRemoved`` comes right after the member's own
  ``ConfigurationDecided`` for a configuration that does not hold it: a verdict alone removes
  nobody (docs/design.md section 5); the agreement rules live in :mod:`sims.safety`.
* [left-by-self] ``MemberLeft`` names a member that did leave, or whose process exited and
  whose launcher reported it (``Cluster.report_exited`` of a crashed member).

The brief for this module also proposed "the confirmer is one of the subject's observers"; that
does not hold: a member that is not an observer convicts on its own after ``suspicion_max_s`` as a
fallback, so [suspicion-timeout] checks the timeout that applies to each case instead.

:meth:`InvariantChecker.check_end` checks convergence after a quiet, healed period (SWIM's
completeness and memberlist's anti-entropy): every live, reachable member holds the same view, and
every crashed or cut-off member is dead or gone in it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from torchpass_p2p.core import Configuration, MemberId, MemberState, format_member_id
from torchpass_p2p.core import events as ev

from .cluster import Cluster, SimMember
from .recorder import DetectionRecorder

_EPS_S = 1e-9
"""Float slack on timer comparisons (seconds): deadlines are sums of float seconds."""

_DEAD = int(MemberState.DEAD)
_LEFT = int(MemberState.LEFT)
_ALIVE = int(MemberState.ALIVE)
_SUSPECT = int(MemberState.SUSPECT)

_MEMBER_EVENTS = (ev.MemberAlive, ev.MemberSuspected, ev.MemberDead, ev.MemberLeft)
"""Events about one member, named ``member`` (``AlertRaised`` names it ``subject``)."""

_SubjectEvent = (ev.MemberAlive | ev.MemberSuspected | ev.AlertRaised | ev.MemberDead
                 | ev.MemberLeft)


class InvariantChecker:
    """Checks membership invariants on every event of ``cluster``; attach before running.

    Args:
        cluster: the fleet to watch; the checker appends itself to ``cluster.listeners``.
        recorder: optional; members it holds as faulty are left out of :meth:`check_end`'s
            agreement (a member with a gray-failing link may lag behind without breaking
            anything).
        max_kept: violations kept as text; ``count`` keeps counting beyond it.
    """

    def __init__(self, cluster: Cluster, recorder: DetectionRecorder | None = None, *,
                 max_kept: int = 100) -> None:
        self.cluster = cluster
        self.recorder = recorder
        self.max_kept = max_kept
        self.violations: list[str] = []
        self.count = 0
        self.events = 0
        p = cluster.params
        self._min_alerts = p.min_alerts_to_confirm
        self._suspicion_min_s = p.suspicion_min_s
        self._suspicion_max_s = p.suspicion_max_s
        self._incarnation: dict[MemberId, int] = {}
        self._removed: set[MemberId] = set()
        # (holder, subject) -> (state, incarnation) as the holder's events reported it.
        self._view: dict[tuple[MemberId, MemberId], tuple[int, int]] = {}
        # (holder, subject, incarnation) -> when its suspicion began / observers it holds.
        self._suspected_at: dict[tuple[MemberId, MemberId, int], float] = {}
        self._held_alerts: dict[tuple[MemberId, MemberId, int], set[MemberId]] = {}
        self._raised: set[tuple[MemberId, MemberId, int]] = set()  # (observer, subject, inc)
        self._raised_about: set[tuple[MemberId, int]] = set()  # (subject, inc)
        self._convicted: set[tuple[MemberId, MemberId, int]] = set()  # (confirmer, subject, inc)
        self._last_decided: dict[MemberId, ev.ConfigurationDecided] = {}
        self._observer_cache: dict[tuple[int, MemberId], frozenset[MemberId]] = {}
        cluster.listeners.append(self)

    # ------------------------------------------------------------------ reporting

    @property
    def ok(self) -> bool:
        return self.count == 0

    def _fail(self, rule: str, text: str) -> None:
        self.count += 1
        if len(self.violations) < self.max_kept:
            self.violations.append(f"[{rule}] {text}")

    def _name(self, member: MemberId) -> str:
        sm = self.cluster.by_id.get(member)
        return f"#{sm.index}" if sm is not None else format_member_id(member)

    # Violation texts are built only when a rule fails: formatting them for every event cost
    # more than checking the rules (16k members emit millions of events).

    def _who(self, sm: SimMember, at: float) -> str:
        return f"t={at:.3f} {self._name(sm.id)}"

    def _what(self, sm: SimMember, event: ev.Event, subject: MemberId, inc: int) -> str:
        return f"{self._who(sm, event.at)} {type(event).__name__} {self._name(subject)}@{inc}"

    def _observers(self, config: Configuration, subject: MemberId) -> frozenset[MemberId]:
        # Configurations are immutable, so (config_id, subject) names one answer for good;
        # keeping it here costs one dict entry per member and spares a ring walk per event.
        key = (config.config_id, subject)
        found = self._observer_cache.get(key)
        if found is None:
            found = self._observer_cache[key] = frozenset(config.observers_of(subject))
        return found

    # ------------------------------------------------------------------ per event

    def __call__(self, sm: SimMember, event: ev.Event) -> None:
        self.events += 1
        me = sm.id
        at = event.at
        if sm.crashed:
            self._fail("silent-when-crashed", f"{self._who(sm, at)} crashed, yet emitted {event!r}")
        elif sm.blocked_until > at + _EPS_S:
            self._fail("silent-when-crashed", f"{self._who(sm, at)} blocked until "
                                              f"{sm.blocked_until:.3f}, yet emitted {event!r}")
        if me in self._removed:
            self._fail("silent-after-removal",
                       f"{self._who(sm, at)} was removed, yet emitted {event!r}")
        if isinstance(event, ev.AlertRaised):
            self._about_subject(sm, event, event.subject)
        elif isinstance(event, _MEMBER_EVENTS):
            self._about_subject(sm, event, event.member)
        elif isinstance(event, ev.SelfRefuted):
            self._self_refuted(sm, event)
        elif isinstance(event, ev.SelfRemoved):
            self._removed.add(me)
            last = self._last_decided.get(me)
            if last is None or me in last.configuration:
                self._fail("removed-by-decision", f"{self._who(sm, at)} SelfRemoved without a "
                                                  f"decided configuration that drops it")
        elif isinstance(event, ev.ConfigurationDecided):
            self._last_decided[me] = event

    def _self_refuted(self, sm: SimMember, event: ev.SelfRefuted) -> None:
        me = sm.id
        before = self._incarnation.get(me, 0)
        self._incarnation[me] = event.incarnation
        if event.incarnation != before + 1:
            self._fail("refute-by-one",
                       f"{self._who(sm, event.at)} refuted from incarnation {before} to "
                       f"{event.incarnation}")
        accused = event.incarnation - 1
        if (me, accused) not in self._raised_about:
            self._fail("refute-real-alert",
                       f"{self._who(sm, event.at)} refuted incarnation {accused}, which no "
                       f"observer accused")

    def _about_subject(self, sm: SimMember, event: _SubjectEvent, subject: MemberId) -> None:
        me = sm.id
        kind = type(event)
        inc = event.incarnation
        subject_sm = self.cluster.by_id.get(subject)
        if subject_sm is None:
            self._fail("minted-by-owner",
                       f"{self._who(sm, event.at)} reported unknown member "
                       f"{format_member_id(subject)}")
            return
        if inc > subject_sm.core.incarnation:
            self._fail("minted-by-owner",
                       f"{self._who(sm, event.at)} reported {self._name(subject)} at incarnation "
                       f"{inc}, above its own {subject_sm.core.incarnation}: {event!r}")
        key = (me, subject)
        state, known = self._view.get(key, (_ALIVE, 0))

        def what() -> str:
            return self._what(sm, event, subject, inc)

        if state == _LEFT:
            self._fail("dead-until-newer", f"{what()} after it had left")
            return
        if state == _DEAD and not (kind is ev.MemberAlive and inc > known):
            self._fail("dead-until-newer", f"{what()} while it was dead at incarnation {known}")
        if inc < known or (kind is ev.MemberAlive and inc == known):
            self._fail("view-monotone", f"{what()} after it had reported incarnation {known}")
        elif inc > known:  # the older suspicion is over for this holder: keep memory bounded
            self._suspected_at.pop((me, subject, known), None)
            self._held_alerts.pop((me, subject, known), None)
        if isinstance(event, ev.MemberAlive):
            self._view[key] = (_ALIVE, inc)
        elif isinstance(event, ev.MemberSuspected):
            self._view[key] = (_SUSPECT, inc)
            self._suspected_at.setdefault((me, subject, inc), event.at)
        elif isinstance(event, ev.AlertRaised):
            self._alert(sm, event, state, known)
        elif isinstance(event, ev.MemberDead):
            self._view[key] = (_DEAD, inc)
            self._dead(sm, event)
        else:  # MemberLeft
            self._view[key] = (_LEFT, inc)
            if not (subject_sm.core.left or subject in self.cluster.exits_reported):
                self._fail("left-by-self", f"{what()}, but it never left")

    def _alert(self, sm: SimMember, event: ev.AlertRaised, state: int, known: int) -> None:
        me, subject, observer, inc = sm.id, event.subject, event.observer, event.incarnation

        def what() -> str:
            return f"{self._what(sm, event, subject, inc)} from {self._name(observer)}"

        if observer not in self._observers(sm.core.configuration, subject):
            self._fail("alert-by-observer", f"{what()}, which is not one of its observers")
        if observer == me:
            self._raised.add((observer, subject, inc))
            self._raised_about.add((subject, inc))
        elif (observer, subject, inc) not in self._raised:
            self._fail("alert-has-origin", f"{what()}, which that observer never raised")
        if state != _SUSPECT or known != inc:
            self._fail("alert-in-suspicion", f"{what()} outside a suspicion at that incarnation")
        held = self._held_alerts.setdefault((me, subject, inc), set())
        if observer in held:
            self._fail("alert-in-suspicion", f"{what()} twice")
        held.add(observer)

    def _dead(self, sm: SimMember, event: ev.MemberDead) -> None:
        me, subject, confirmer, inc = sm.id, event.member, event.confirmer, event.incarnation

        def what() -> str:
            return f"{self._what(sm, event, subject, inc)} by {self._name(confirmer)}"

        if confirmer != me:
            if (confirmer, subject, inc) not in self._convicted:
                self._fail("dead-has-origin", f"{what()}, who never convicted it")
            return
        self._convicted.add((me, subject, inc))
        config = sm.core.configuration
        observers = self._observers(config, subject)
        needed = min(self._min_alerts, len(observers))
        held = self._held_alerts.get((me, subject, inc), set())
        if len(held) < needed:
            names = ", ".join(sorted(self._name(o) for o in held)) or "none"
            self._fail("quorum", f"{what()} holding alerts from {len(held)} observers ({names}); "
                                 f"needs {needed}")
        began = self._suspected_at.get((me, subject, inc))
        observes = me in observers
        wait_s = self._suspicion_min_s if observes else self._suspicion_max_s
        if began is None:
            self._fail("suspicion-timeout", f"{what()} without a suspicion at that incarnation")
        elif event.at + _EPS_S < began + wait_s:
            self._fail("suspicion-timeout",
                       f"{what()} {event.at - began:.3f} s after suspecting it; needs {wait_s} s "
                       f"({'observer' if observes else 'not an observer'})")

    # ------------------------------------------------------------------ at the end

    def check_end(self, exclude: Iterable[MemberId] = ()) -> list[str]:
        """Convergence after a quiet period: call once the network healed and a few sync
        intervals passed. Returns (and records) the violations it found.

        The members compared are the live ones (not crashed, removed or left) that the network
        reaches (not deaf, mute, clogged or on a cut link), minus ``exclude`` and the recorder's
        faulty members. Each must hold the same view digest as the others, and every crashed,
        deaf, mute or clogged member must be dead or gone in its view. Members that hold
        different configurations (one decided a change, another not yet) are reported as an
        [agree] finding naming both configuration ids; a member outside one holder's
        configuration reads "not in its configuration" there. Never raises on what the members
        hold: every disagreement is a finding.
        """
        start = self.count
        net = self.cluster.network
        cut_off = set(net.deaf) | set(net.mute) | set(net.clogged)
        skip = set(exclude) | cut_off
        for a, b in net.cut:  # a cut link may leave its ends behind; it does not isolate them
            skip.update((a, b))
        if self.recorder is not None:
            skip.update(self.recorder.faults)
        compared = [sm for sm in self.cluster.members
                    if not (sm.crashed or sm.core.removed or sm.core.left or sm.id in skip)]
        gone = [sm for sm in self.cluster.members if sm.crashed or sm.id in cut_off]
        if compared:
            self._check_agreement(compared)
        for holder in compared:
            for sm in gone:
                if sm.id not in holder.core.configuration:
                    continue  # removed by a decided configuration: gone for good
                state, inc = holder.core.state_of(sm.id)
                if state < MemberState.DEAD:
                    self._fail("complete",
                               f"t={self.cluster.now:.3f} {self._name(holder.id)} still holds "
                               f"{'crashed' if sm.crashed else 'cut-off'} {self._name(sm.id)} "
                               f"as {state.name}@{inc}")
        return self.violations[start:] if start < len(self.violations) else []

    def _check_agreement(self, compared: list[SimMember]) -> None:
        # Compare against the view most members hold, so the odd ones out are the ones named.
        tally = Counter(sm.core.view_digest() for sm in compared)
        digest = max(tally, key=lambda d: tally[d])
        reference = next(sm for sm in compared if sm.core.view_digest() == digest)
        differ = [sm for sm in compared if sm.core.view_digest() != digest]
        if not differ:
            return
        members = self.cluster.members
        ref_config = reference.core.configuration.config_id
        for sm in differ[:5]:
            diffs = []
            config = sm.core.configuration.config_id
            if config != ref_config:
                diffs.append(f"configuration {config} vs {ref_config}")
            for other in members:
                mine, theirs = _entry(sm, other.id), _entry(reference, other.id)
                if _norm(mine) != _norm(theirs):
                    diffs.append(f"{self._name(other.id)}: {_text(mine)} vs {_text(theirs)}")
            self._fail("agree", f"t={self.cluster.now:.3f} {self._name(sm.id)} and "
                                f"{self._name(reference.id)} hold different views: "
                                + ("; ".join(diffs[:5]) or "digest only"))
        if len(differ) > 5:
            self._fail("agree", f"... and {len(differ) - 5} more members disagree")


def _entry(holder: SimMember, member: MemberId) -> tuple[MemberState, int] | None:
    """(state, incarnation) of ``member`` in ``holder``'s view, or None when ``member`` is not
    in the holder's configuration. Live members may hold different configurations when the
    check runs (one decided, another not yet), and ``Member.state_of`` raises ``KeyError`` for
    a member outside its own: asking it would crash the check instead of reporting."""
    core = holder.core
    if member not in core.configuration:
        return None
    return core.state_of(member)


def _norm(entry: tuple[MemberState, int] | None) -> tuple[int, int] | None:
    """SUSPECT is transient and local: it agrees with ALIVE (as the view digest has it)."""
    if entry is None:
        return None
    state, inc = entry
    return (_ALIVE if state == MemberState.SUSPECT else int(state), inc)


def _text(entry: tuple[MemberState, int] | None) -> str:
    return "not in its configuration" if entry is None else f"{entry[0].name}@{entry[1]}"
