"""Cut detection: which changes one member proposes, and when (Rapid, ATC 2018, section 4.2).

Alerts about a subject are tallied per subject over its K observers. A subject is *stable* (in
the proposal) when it was convicted (the Lifeguard suspicion timer ran out with at least L
alerts, :mod:`.membership`), left on its own, or when at least H observers alerted and the
shortest suspicion window has passed; it is *unstable* with L..H-1 alerts and no conviction yet;
fewer than L alerts are noise. Rapid's implicit alerts count an observer that is itself stable or
unstable as having alerted, so a subject whose observers failed with it (a whole host) still
reaches H. A subject with fewer than K distinct observers (a small configuration) has H capped
at their number and L scaled in proportion (L/K). Joiners are stable at once. A member
proposes removals only while nothing is unstable, so failures that start together are decided
as one cut; the caller also waits until the proposal has not changed for
``Params.cut_settle_s``. Joiners do not wait for the unstable: while something is, the proposal
admits the joiners alone (a mass crash takes seconds to convict, and processes restarted
meanwhile would wait that long). A change that only admits spares leaves the rank map as it
is, which costs the trainers nothing (``trainer/changes.py``).

A cut holds at most ``max_removed`` removals and as many joiners as its byte budget takes
(:func:`~.sizes.cut_budget`: every agreement message carrying it fits one datagram), smallest
member ids first; the rest wait for the next change. Each change costs a classic round's
timeout or more, so a mass restart must be admitted in as few changes as the bytes allow.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .codec import MAX_CUT_JOINED, MAX_CUT_REMOVED
from .configuration import Configuration
from .messages import Cut, Joiner, MemberId
from .sizes import array_header_size, cut_budget, cut_size, joiner_size

# Both classes below are values nothing mutates, built on every view change. Not frozen and with
# a written-out __init__ (init=False): mypyc builds a frozen or generated-__init__ dataclass
# through the Python-level __init__ that ``dataclasses`` generates (~15x slower than a native
# constructor); equality and repr still come from ``dataclass``.


@dataclass(slots=True, init=False)
class Suspected:
    """One subject's alerts as this member holds them."""

    observers: tuple[MemberId, ...]
    """Observers whose alerts about the subject's current incarnation arrived."""
    started_at: float
    """When the first of them arrived (seconds)."""
    silent: int
    """How many of them were raised on a silent pulse (:attr:`Alert.silent`): each observer
    that says so found the subject's whole process stopped, not its loop stalled."""

    def __init__(self, observers: tuple[MemberId, ...], started_at: float,
                 silent: int = 0) -> None:
        self.observers = observers
        self.started_at = started_at
        self.silent = silent


@dataclass(slots=True, init=False)
class Proposal:
    """The outcome of :func:`propose_cut`: the cut (None when nothing can change yet), the
    subjects that still hold up its removals, a reason the tests assert on, and when to look
    again (seconds; ``inf`` when only new alerts can change the answer)."""

    cut: Cut | None
    unstable: tuple[MemberId, ...]
    reason: str
    recheck_at: float
    silenced: tuple[MemberId, ...]
    """Members the cut removes that every observer able to speak found silent: owed no
    refutation window (``Params.refutation_window_s``), for their process does not run."""

    def __init__(self, cut: Cut | None, unstable: tuple[MemberId, ...], reason: str,
                 recheck_at: float = math.inf, silenced: tuple[MemberId, ...] = ()) -> None:
        self.cut = cut
        self.unstable = unstable
        self.reason = reason
        self.recheck_at = recheck_at
        self.silenced = silenced


def propose_cut(
    config: Configuration,
    *,
    gone: Iterable[MemberId],
    suspected: Mapping[MemberId, Suspected],
    joiners: Iterable[Joiner],
    now: float,
    high: int,
    low: int,
    min_window_s: float,
    max_removed: int = MAX_CUT_REMOVED,
    max_joined: int = MAX_CUT_JOINED,
    max_cut_bytes: int | None = None,
) -> Proposal:
    """This member's proposal for ``config``'s next change.

    Args:
        gone: members convicted dead or left, per the local view.
        suspected: alerts held per subject (current incarnation only).
        joiners: processes asking to join that are not in ``config``.
        now: the current time, seconds.
        high: H, alerts that make a subject stable on their own (Rapid: K - 1 = 9); capped
            at the subject's number of distinct observers.
        low: L, alerts below which a subject is noise (Rapid: about 0.3 K = 3); scaled by
            the subject's distinct observers over K = H + 1 when it has fewer than K.
        min_window_s: a subject with H alerts still waits this long after its first alert, so
            it keeps Lifeguard's shortest refutation window (``Params.suspicion_min_s``),
            unless it is *silenced*: H of its alerts are silent, implicit ones included (an
            observer that is itself failing cannot alert, Rapid section 4.2), so every
            observer that can speak found its process stopped and nothing will refute.
        max_removed, max_joined: the most of each one cut carries (default: the codec's
            limits); the rest waits for the next configuration, smallest member ids first.
        max_cut_bytes: the most bytes the encoded cut may take (default:
            :func:`~.sizes.cut_budget` of ``config``); joiners that would take it over wait
            for the next configuration. Removals always fit (``max_removed`` ids take at most
            291 bytes).

    Returns:
        A :class:`Proposal`; ``cut`` is None when there is nothing to change, or something is
        unstable and nobody asks to join (then the cut admits the joiners alone);
        ``recheck_at`` is when a subject that has its alerts finishes its window.
    """
    stable = {m for m in gone if m in config}
    silenced: set[MemberId] = set()
    partial: dict[MemberId, int] = {}
    for subject, s in suspected.items():
        if subject in stable or subject not in config:
            continue
        alerts = len(s.observers)
        needed = alerts_needed(config, subject, high)
        if alerts >= needed and s.silent >= needed:
            stable.add(subject)
            silenced.add(subject)
        elif alerts >= needed and now - s.started_at >= min_window_s:
            stable.add(subject)
        elif alerts >= _low(config, subject, low, high):
            partial[subject] = alerts
    # Implicit alerts (Rapid section 4.2): an observer that is itself stable or unstable cannot
    # alert, so it counts as having alerted.
    failing = stable | partial.keys()
    recheck_at = math.inf
    for subject in list(partial):
        s = suspected[subject]
        explicit = set(s.observers)
        implicit = sum(1 for o in config.observers_of(subject)
                       if o in failing and o not in explicit)
        needed = alerts_needed(config, subject, high)
        if s.silent + implicit >= needed:  # two stopped members that observe each other
            stable.add(subject)
            silenced.add(subject)
            del partial[subject]
        elif partial[subject] + implicit >= needed:
            ripe_at = s.started_at + min_window_s
            if now >= ripe_at:
                stable.add(subject)
                del partial[subject]
            else:  # stable then, with no new alert to wake us
                recheck_at = min(recheck_at, ripe_at)
    joined = sorted((j for j in joiners if j.member not in config), key=lambda j: j.member)
    budget = cut_budget(len(config)) if max_cut_bytes is None else max_cut_bytes
    if partial:
        waiting = f"waiting: {len(partial)} unstable"
        if not joined:
            return Proposal(None, tuple(sorted(partial)), waiting, recheck_at)
        admitted = _fitting((), joined[:max_joined], budget)
        return Proposal(Cut((), admitted), tuple(sorted(partial)),
                        f"join {len(admitted)}; {waiting}", recheck_at)
    if not stable and not joined:
        return Proposal(None, (), "nothing to change")
    removed = tuple(sorted(stable))[:max_removed]
    cut = Cut(removed, _fitting(removed, joined[:max_joined], budget))
    return Proposal(cut, (), f"remove {len(removed)}, join {len(cut.joined)}", math.inf,
                    tuple(m for m in removed if m in silenced))


def _fitting(removed: tuple[MemberId, ...], joined: list[Joiner],
             budget: int) -> tuple[Joiner, ...]:
    """The longest prefix of ``joined`` (sorted by id) that a cut removing ``removed`` holds
    within ``budget`` bytes. A prefix, not a best fit: every member that sees the same joiners
    computes the same cut, and a joiner is never passed over for a later one."""
    base = cut_size(Cut(removed)) - array_header_size(0)  # the joined array's header varies
    used = 0
    for k, joiner in enumerate(joined):
        used += joiner_size(joiner)
        if base + array_header_size(k + 1) + used > budget:
            return tuple(joined[:k])
    return tuple(joined)


def alerts_needed(config: Configuration, subject: MemberId, high: int) -> int:
    """H as it applies to ``subject``: ``high``, or fewer when a small configuration gives the
    subject fewer than K distinct observers."""
    return min(high, len(config.observers_of(subject)))


def _low(config: Configuration, subject: MemberId, low: int, high: int) -> int:
    # L in proportion to the distinct observers, as L/K in Rapid (K = H + 1): in a 6-member
    # job a subject has 2-4 observers, and with L = 3 two members that observe each other and
    # die together would each stay one alert short of unstable for ever (scenario S12).
    observers = len(config.observers_of(subject))
    if observers > high:
        return low
    return max(1, -(-low * observers // (high + 1)))
