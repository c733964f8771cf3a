"""Rapid cut detection (core/cut.py): stable, unstable and noise, implicit alerts, limits."""

from __future__ import annotations

from torchpass_p2p.core.codec import MAX_CUT_JOINED, MAX_LABEL_BYTES, MAX_STEP
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.cut import Suspected, propose_cut
from torchpass_p2p.core.messages import MAX_MEMBER_ID, Cut, Joiner, Topology, Vote
from torchpass_p2p.core.seal import OVERHEAD_BYTES
from torchpass_p2p.core.sizes import cut_budget, cut_size, encoded_size
from torchpass_p2p.core.wire import DEFAULT_MAX_DATAGRAM_BYTES

CONFIG = Configuration(3, range(1, 31), range(31, 35))  # 34 members, K = 10 observers each
H, L, WINDOW = 9, 3, 1.0


def propose(gone=(), suspected=None, joiners=(), now=10.0, max_removed=32,
            max_joined=MAX_CUT_JOINED):
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


def test_joiners_do_not_wait_for_unstable_subjects() -> None:
    # 9 is unstable (L alerts): the removal of 5 waits for it, the joiner does not.
    j40 = Joiner(40, "h", 2)
    p = propose(gone=(5,), suspected={9: alerts(9, L)}, joiners=(j40,))
    assert (p.cut, p.unstable) == (Cut(joined=(j40,)), (9,))
    assert p.reason == "join 1; waiting: 1 unstable"
    # Once 9 is stable, one cut removes both and admits the joiner.
    stable = propose(gone=(5, 9), joiners=(j40,))
    assert stable.cut == Cut(removed=(5, 9), joined=(j40,)) and stable.unstable == ()


# 31 restarted processes as a launcher starts them: 41 bytes each in a cut (array 1, member 9,
# host "10.0.1.1xx" 11, port 3, labels "node-1xx" 9 and "rack-07" 8).
RESTARTED = [Joiner((1 << 60) + i, f"10.0.1.{i}", 29500, Topology(f"node-{i:03d}", "rack-07"))
             for i in range(100, 131)]
LONGEST = "x" * MAX_LABEL_BYTES


def widest_vote(cut: Cut) -> Vote:
    """A vote of CONFIG (34 members: a 5-byte segment) with ``cut``, every field at its
    widest."""
    return Vote(MAX_MEMBER_ID, (1 << 32) - 1, cut, 0, b"\xff" * 5, MAX_STEP)


def test_a_cut_admits_as_many_joiners_as_one_datagram_holds() -> None:
    budget = cut_budget(len(CONFIG))
    assert budget == 1400 - 34 - 27 - (2 + 5) == 1332  # seal, vote fields, bin8 segment
    # Joiners alone: all 31 fit (array 1, two array headers 1 + 3, 31 * 41 = 1,271).
    alone = propose(joiners=RESTARTED)
    assert alone.cut == Cut(joined=tuple(RESTARTED)) and cut_size(alone.cut) == 1276
    # Beside 30 removals of small ids (array16 header 3 + 30 one-byte ids), all still fit:
    # 1 + 33 + 3 + 1,271 = 1,308.
    both = propose(gone=range(1, 31), joiners=RESTARTED)
    assert both.cut == Cut(tuple(range(1, 31)), tuple(RESTARTED))
    assert cut_size(both.cut) == 1308
    # Member ids at their widest (9 bytes each): 30 removals take 273 bytes, and 25 joiners
    # fit: 1 + 273 + 3 + 25 * 41 = 1,302; a 26th would make 1,343.
    wide = Configuration(3, [MAX_MEMBER_ID - i for i in range(34)][::-1])
    gone = wide.members[:30]
    p = propose_cut(wide, gone=gone, suspected={}, joiners=RESTARTED, now=10.0, high=H, low=L,
                    min_window_s=WINDOW)
    assert p.cut is not None and p.cut.joined == tuple(RESTARTED[:25])
    assert cut_size(p.cut) == 1302 <= budget < cut_size(Cut(p.cut.removed, tuple(RESTARTED[:26])))
    assert encoded_size(widest_vote(p.cut)) + OVERHEAD_BYTES <= DEFAULT_MAX_DATAGRAM_BYTES
    # Joiners with the longest labels (211 bytes): 4 beside 32 removals (1 + 291 + 1 + 844).
    big = [Joiner(MAX_MEMBER_ID - 100 + i, LONGEST, 65535, Topology(LONGEST, LONGEST))
           for i in range(6)]
    p = propose_cut(wide, gone=wide.members[:32], suspected={}, joiners=big, now=10.0, high=H,
                    low=L, min_window_s=WINDOW)
    assert p.cut is not None and len(p.cut.removed) == 32 and p.cut.joined == tuple(big[:4])
    assert cut_size(p.cut) == 1137
    assert encoded_size(widest_vote(p.cut)) + OVERHEAD_BYTES <= DEFAULT_MAX_DATAGRAM_BYTES


def test_the_byte_budget_of_a_cut_fills_exactly_one_datagram() -> None:
    # Whatever the configuration's size, a widest vote whose cut takes its budget, with a full
    # segment of that configuration, seals to exactly the default datagram.
    cut = Cut((1, 2, 3), tuple(RESTARTED[:4]))
    for members in (1, 8, 9, 64, 2047, 2048, 16384):
        segment = min(256, (members + 7) // 8)
        vote = Vote(MAX_MEMBER_ID, (1 << 32) - 1, cut, 255, b"\xff" * segment, MAX_STEP)
        spare = cut_budget(members) - cut_size(cut)
        assert encoded_size(vote) + spare + OVERHEAD_BYTES == DEFAULT_MAX_DATAGRAM_BYTES
    assert cut_budget(2048) == 1080 and cut_budget(64) == 1329


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
