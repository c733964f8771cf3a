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
