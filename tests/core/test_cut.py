"""Rapid cut detection (core/cut.py): stable, unstable and noise, implicit alerts, limits."""

from __future__ import annotations

from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.cut import Suspected, propose_cut
from torchpass_p2p.core.messages import Cut, Joiner

CONFIG = Configuration(3, range(1, 31), range(31, 35))  # 34 members, K = 10 observers each
H, L, WINDOW = 9, 3, 1.0


def propose(gone=(), suspected=None, joiners=(), now=10.0, max_removed=32, max_joined=4):
    return propose_cut(CONFIG, gone=gone, suspected=suspected or {}, joiners=joiners, now=now,
                       high=H, low=L, min_window_s=WINDOW, max_removed=max_removed,
                       max_joined=max_joined)


def alerts(subject: int, count: int, started_at: float = 8.0) -> Suspected:
    return Suspected(CONFIG.observers_of(subject)[:count], started_at)


def test_nothing_to_change() -> None:
    p = propose()
    assert (p.cut, p.unstable, p.reason) == (None, (), "nothing to change")


def test_convicted_and_left_members_are_stable() -> None:
    p = propose(gone=(7, 5, 99))  # 99 is not in the configuration
    assert p.cut == Cut(removed=(5, 7)) and p.reason == "remove 2, join 0"


def test_fewer_than_l_alerts_are_noise_and_do_not_block() -> None:
    assert 4 not in CONFIG.observers_of(9)
    p = propose(gone=(4,), suspected={9: alerts(9, L - 1)})
    assert p.cut == Cut(removed=(4,)) and p.unstable == ()


def test_a_dead_observer_does_not_lift_a_subject_out_of_the_noise_band() -> None:
    assert 5 in CONFIG.observers_of(9)  # Rapid counts implicit alerts only above L
    p = propose(gone=(5,), suspected={9: alerts(9, L - 1)})
    assert p.cut == Cut(removed=(5,)) and p.unstable == ()


def test_between_l_and_h_alerts_block_the_whole_proposal() -> None:
    p = propose(gone=(5,), suspected={9: alerts(9, L)})
    assert (p.cut, p.unstable, p.reason) == (None, (9,), "waiting: 1 unstable")


def test_h_alerts_are_stable_only_after_the_shortest_refutation_window() -> None:
    early = propose(suspected={9: alerts(9, H, started_at=9.5)})
    assert early.cut is None and early.unstable == (9,)
    late = propose(suspected={9: alerts(9, H, started_at=9.0)})
    assert late.cut == Cut(removed=(9,))


def test_implicit_alerts_from_failed_observers_complete_h() -> None:
    observers = CONFIG.observers_of(9)
    assert len(observers) == 9  # ten rings, two of which give 9 the same predecessor
    explicit = Suspected(observers[2:], 8.0)  # 7 explicit alerts: unstable on their own
    assert propose(suspected={9: explicit}).unstable == (9,)
    p = propose(gone=observers[:2], suspected={9: explicit})  # +2 implicit from dead observers
    assert p.cut == Cut(removed=tuple(sorted((*observers[:2], 9))))


def test_joiners_are_admitted_sorted_and_members_are_not_rejoined() -> None:
    j50, j40 = Joiner(50, "h", 1), Joiner(40, "h", 2)
    p = propose(joiners=(j50, Joiner(3, "h", 3), j40))  # member 3 is already in
    assert p.cut == Cut(joined=(j40, j50))


def test_a_cut_is_capped_and_the_rest_waits_for_the_next_change() -> None:
    p = propose(gone=range(1, 11), max_removed=4,
                joiners=[Joiner(m, "h", 1) for m in range(60, 63)], max_joined=2)
    assert p.cut == Cut(removed=(1, 2, 3, 4), joined=(Joiner(60, "h", 1), Joiner(61, "h", 1)))


def test_members_that_observe_each_other_and_fail_together_are_one_cut() -> None:
    # Scenario S12 at its real size: 4 ranks and 2 spares give each subject 3 observers. 2 and
    # 3 observe each other, so each dead one can collect only 2 of its 3 alerts: with L = 3
    # both would stay noise for ever. L scales with the observers (3 * 3 / 10 -> 1), so both
    # are unstable, and each one's implicit alert completes the other's H = 3.
    small = Configuration(0, range(1, 5), range(5, 7))
    assert small.observers_of(2) == (3, 5, 1) and small.observers_of(3) == (6, 2, 4)
    suspected = {2: Suspected((5, 1), 8.0), 3: Suspected((6, 4), 8.0)}
    p = propose_cut(small, gone=(), suspected=suspected, joiners=(), now=10.0, high=H, low=L,
                    min_window_s=WINDOW, max_removed=32, max_joined=4)
    assert p.cut == Cut(removed=(2, 3)) and p.reason == "remove 2, join 0"
    # One alive member with a stray alert is unstable (it blocks a cut until refuted or
    # convicted), not a removal.
    lone = propose_cut(small, gone=(), suspected={2: Suspected((5,), 8.0)}, joiners=(),
                       now=10.0, high=H, low=L, min_window_s=WINDOW, max_removed=32,
                       max_joined=4)
    assert (lone.cut, lone.unstable) == (None, (2,))


def test_h_silent_alerts_are_stable_at_once_and_silenced() -> None:
    observers = CONFIG.observers_of(9)
    silent = propose(suspected={9: Suspected(observers[:H], 9.9, silent=H)})
    assert silent.cut == Cut(removed=(9,)) and silent.silenced == (9,)
    one_plain = propose(suspected={9: Suspected(observers[:H], 9.9, silent=H - 1)})
    assert one_plain.cut is None and one_plain.unstable == (9,)  # the window again
    late = propose(suspected={9: Suspected(observers[:H], 9.0, silent=H - 1)})
    assert late.cut == Cut(removed=(9,)) and late.silenced == ()  # stable, still owed it


def test_two_silent_members_observing_each_other_count_each_other_implicitly() -> None:
    a, b = next((a, b) for a in range(1, 31) for b in range(a + 1, 31)
                if a in CONFIG.observers_of(b) and b in CONFIG.observers_of(a))
    suspected = {}
    for subject, other in ((a, b), (b, a)):
        speaking = tuple(o for o in CONFIG.observers_of(subject) if o != other)[:H - 1]
        suspected[subject] = Suspected(speaking, 9.9, silent=len(speaking))
    p = propose(suspected=suspected)
    assert p.cut == Cut(removed=tuple(sorted((a, b)))) and p.silenced == tuple(sorted((a, b)))
