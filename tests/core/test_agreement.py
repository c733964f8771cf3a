"""Fast Paxos over bitmaps (core/agreement.py): exact decisions, quorums and the value rule."""

from __future__ import annotations

import pytest

from torchpass_p2p.core.agreement import (
    Certificate,
    Consensus,
    bitmap_segments,
    classic_quorum,
    coordinator_index,
    fast_quorum,
)
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.errors import LocalProtocolError
from torchpass_p2p.core.messages import Accept, Cut, Prepare, Promise, Vote

MEMBERS = tuple(range(101, 111))  # ten members, sorted: index i holds id 101 + i
CONFIG = Configuration(7, MEMBERS[:8], MEMBERS[8:])
A = Cut(removed=(103,))
B = Cut(removed=(103, 104))


def fleet() -> dict[int, Consensus]:
    return {m: Consensus(CONFIG, m) for m in MEMBERS}


def spread(fleet_: dict[int, Consensus]) -> None:
    """Deliver every member's dirty votes to every other member until nothing changes."""
    changed = True
    while changed:
        changed = False
        for consensus in fleet_.values():
            for vote in consensus.dirty_votes():
                for other in fleet_.values():
                    if other is not consensus and other.merge_vote(vote):
                        changed = True


def deliver(fleet_: dict[int, Consensus]) -> None:
    """Deliver direct messages (Prepare/Promise/Accept) until every outbox is empty."""
    while any(c.outbox for c in fleet_.values()):
        for sender, consensus in fleet_.items():
            out, consensus.outbox = consensus.outbox, []
            for dest, msg in out:
                target = fleet_.get(dest)
                if target is None:
                    continue
                if isinstance(msg, Prepare):
                    target.on_prepare(sender, msg)
                elif isinstance(msg, Promise):
                    target.on_promise(sender, msg)
                elif isinstance(msg, Accept):
                    target.on_accept(sender, msg)


def test_quorum_sizes_follow_rapid_and_paxos() -> None:
    assert [fast_quorum(n) for n in (1, 2, 4, 5, 10, 1000)] == [1, 2, 4, 4, 8, 751]
    assert [classic_quorum(n) for n in (1, 2, 4, 5, 10, 1000)] == [1, 2, 3, 3, 6, 501]
    assert coordinator_index(1, 10) == 0 and coordinator_index(24, 10) == 3


def test_fast_round_decides_at_exactly_the_fast_quorum() -> None:
    f = fleet()
    for m in MEMBERS[:7]:
        assert f[m].vote_fast(A, step=41)
    spread(f)
    assert all(c.decision is None for c in f.values())  # 7 < 8
    f[MEMBERS[7]].vote_fast(A, step=42)
    spread(f)
    decisions = {c.decision for c in f.values()}
    assert len(decisions) == 1
    cert = decisions.pop()
    assert cert is not None
    assert (cert.config_id, cert.round, cert.cut, cert.max_step) == (7, 0, A, 42)
    assert cert.bits == 0b0011111111 and cert.valid_for(CONFIG)


def test_a_member_votes_once_in_the_fast_round() -> None:
    c = Consensus(CONFIG, 101)
    assert c.vote_fast(A, step=0)
    assert not c.vote_fast(B, step=0)
    assert c.voted_cut == A


def test_certificate_travels_as_votes_and_convinces_a_fresh_member() -> None:
    cert = Certificate(7, 0, A, 0b1111111100, 3)
    late = Consensus(CONFIG, 101)
    for vote in cert.votes(len(CONFIG)):
        late.merge_vote(vote)
    assert late.decision == cert
    assert not Certificate(7, 0, A, 0b0111111100, 3).valid_for(CONFIG)  # 7 votes


def test_split_fast_votes_decide_nothing_then_a_classic_round_decides_one() -> None:
    f = fleet()
    for m in MEMBERS[:5]:
        f[m].vote_fast(A, step=0)
    for m in MEMBERS[5:]:
        f[m].vote_fast(B, step=0)
    spread(f)
    assert all(c.decision is None for c in f.values())
    round_ = f[104].prepare(attempt=0, fallback=B)
    assert round_ == 4 and coordinator_index(round_, 10) == 3
    deliver(f)
    spread(f)
    certs = [c.decision for c in f.values()]
    assert all(cert is not None and cert.valid_for(CONFIG) for cert in certs)
    # Each member may hold a different bitmap (proof), all for the same round and cut. The
    # coordinator accepted on the first six promises (104, 105 for A; 106..109 for B):
    # B has |Q| - F = 4 of them, so it is the cut that might have been decided fast.
    assert {(cert.round, cert.cut) for cert in certs if cert} == {(4, B)}


def test_value_rule_keeps_a_cut_that_may_have_been_decided_fast() -> None:
    # 8 of 10 voted A in round 0 (a fast quorum somewhere may have formed); the coordinator
    # hears only 6 promises, 4 for A and 2 for B: |Q| - F = 6 - 2 = 4, so A must be chosen.
    c = Consensus(CONFIG, 110)
    c.vote_fast(B, step=0)
    c.prepare(attempt=0, fallback=B)
    for sender, cut in ((101, A), (102, A), (103, A), (104, A), (109, B)):
        c.on_promise(sender, Promise(7, c.coordinating, 0, cut))
    accepts = {msg.cut for _, msg in c.outbox if isinstance(msg, Accept)}
    assert accepts == {A}


def test_a_minority_never_decides() -> None:
    f = {m: Consensus(CONFIG, m) for m in MEMBERS[:4]}  # four of ten reachable
    for c in f.values():
        c.vote_fast(A, step=0)
    spread(f)
    f[101].prepare(attempt=0, fallback=A)
    deliver(f)
    spread(f)
    assert all(c.decision is None for c in f.values())
    assert not any(isinstance(m, Accept) for c in f.values() for _, m in c.outbox)


def test_a_promise_blocks_late_fast_votes_and_lower_accepts() -> None:
    c = Consensus(CONFIG, 105)
    c.on_prepare(101 + 2, Prepare(7, 13))  # round 13: coordinator index 2 -> member 103
    assert c.promised == 13
    assert not c.vote_fast(A, step=0)
    c.on_accept(102, Accept(7, 2, A))  # round 2 < 13
    assert c.voted_round == -1 and c.dropped["accept_stale"] == 1


def test_messages_from_the_wrong_coordinator_are_dropped() -> None:
    c = Consensus(CONFIG, 105)
    c.on_prepare(109, Prepare(7, 4))  # round 4 belongs to member 104
    c.on_accept(109, Accept(7, 4, A))
    assert c.promised == 0 and c.voted_round == -1
    assert c.dropped["prepare_invalid"] == 1 and c.dropped["accept_invalid"] == 1


def test_out_of_range_vote_bits_are_dropped() -> None:
    c = Consensus(CONFIG, 101)
    assert not c.merge_vote(Vote(7, 0, A, 0, (1 << 10).to_bytes(2, "little")))
    assert not c.merge_vote(Vote(7, 0, A, 1, b"\x01"))
    assert not c.merge_vote(Vote(7, 0, Cut(), 0, b"\x01"))
    assert c.dropped == {"vote_bits_out_of_range": 1, "vote_segment_out_of_range": 1,
                         "vote_invalid": 1}


def test_bitmap_segments_split_at_2048_members_and_trim_zeros() -> None:
    bits = 1 | 1 << 2048 | 1 << 5000
    assert bitmap_segments(bits, 6000) == [(0, b"\x01"), (1, b"\x01"), (2, (1 << 904).to_bytes(
        114, "little"))]
    assert bitmap_segments(bits, 6000, only=0b010) == [(1, b"\x01")]


def test_a_non_member_gathers_certificates_but_never_votes_or_coordinates() -> None:
    c = Consensus(CONFIG, None)
    assert not c.vote_fast(A, step=0)
    with pytest.raises(LocalProtocolError):
        c.prepare(0, A)
    with pytest.raises(ValueError):
        Consensus(CONFIG, 999)


def test_when_no_cut_can_have_been_decided_the_coordinator_proposes_its_own_view() -> None:
    # Three stale fast votes for A (a member that has since refuted); |Q| - F = 6 - 2 = 4 > 3,
    # so A cannot have been decided and the coordinator's current view, B, wins.
    c = Consensus(CONFIG, 110)
    c.prepare(attempt=0, fallback=B)
    for sender in (101, 102, 103):
        c.on_promise(sender, Promise(7, c.coordinating, 0, A))
    for sender in (104, 105):
        c.on_promise(sender, Promise(7, c.coordinating, -1, None))
    accepts = [msg.cut for _, msg in c.outbox if isinstance(msg, Accept)]
    assert len(accepts) == 9 and set(accepts) == {B}


@pytest.mark.parametrize("nothing", [None, Cut()])
def test_a_coordinator_with_no_change_holds_its_round_until_it_has_one(nothing: Cut | None
                                                                       ) -> None:
    # The same stale votes, but the coordinator's view holds no change (the suspicion behind A
    # was refuted): it proposes nothing rather than the empty cut, and holds its round, a
    # quorum of promises in hand, until its view has a change.
    f = fleet()
    for m in MEMBERS[:3]:
        f[m].vote_fast(A, step=0)
    spread(f)
    coordinator = f[110]
    coordinator.prepare(attempt=0, fallback=nothing)
    deliver(f)
    spread(f)
    assert coordinator.holding and coordinator.choose() is None
    assert all(c.decision is None for c in f.values())
    assert not any(isinstance(msg, Accept) for c in f.values() for _, msg in c.outbox)
    coordinator.update_fallback(nothing)  # still nothing: still holding
    assert coordinator.holding and coordinator.outbox == []
    coordinator.update_fallback(B)  # a change (a member failed since): the Accept goes out
    assert not coordinator.holding
    assert [msg for _, msg in coordinator.outbox] == [Accept(7, 10, B)] * 9
    deliver(f)
    spread(f)
    assert {(c.decision.round, c.decision.cut) for c in f.values() if c.decision} == {(10, B)}
    assert all(c.decision is not None for c in f.values())


def test_no_round_votes_accepts_or_promises_the_empty_cut() -> None:
    with pytest.raises(LocalProtocolError):
        Consensus(CONFIG, 101).vote_fast(Cut(), step=0)
    c = Consensus(CONFIG, 101)
    c.on_prepare(110, Prepare(7, 10))
    c.on_accept(110, Accept(7, 10, Cut()))  # round 10 is 110's, but the cut is empty
    assert c.voted_round == -1 and c.dropped["accept_invalid"] == 1
    # A classic round's vote for the empty cut, carrying its coordinator's bit: no accept, no
    # tally, however many bits it holds.
    assert not c.merge_vote(Vote(7, 10, Cut(), 0, (0b1111111111).to_bytes(2, "little")))
    assert c.decision is None and c.voted_round == -1 and c.tallies == {}
    assert c.dropped["vote_invalid"] == 1
    coordinator = Consensus(CONFIG, 110)
    coordinator.prepare(attempt=0, fallback=A)
    coordinator.on_promise(101, Promise(7, 10, 5, Cut()))
    assert coordinator.dropped["promise_invalid"] == 1


def test_a_member_whose_accept_was_lost_accepts_from_the_coordinators_vote() -> None:
    # Eight members, exactly a majority (5) alive: 101..105. Coordinator 104 (round 4); the
    # Accept to 102 is lost, so without more only 4 of the 5 needed bits could ever be set.
    config = Configuration(7, MEMBERS[:8])
    alive = {m: Consensus(config, m) for m in MEMBERS[:5]}
    coordinator = alive[104]
    assert coordinator.prepare(attempt=0, fallback=A) == 4
    deliver(alive)  # Prepare and Promise; the coordinator then sends its Accept
    assert coordinator.voted_round == 4
    for m in (101, 103, 105):
        alive[m].on_accept(104, Accept(7, 4, A))
    # 102 never got it; gossip of the round-4 tally brings the coordinator's bit:
    spread(alive)
    assert alive[102].voted_round == 4 and alive[102].voted_cut == A
    spread(alive)
    assert all(c.decision is not None and (c.decision.round, c.decision.cut) == (4, A)
               for c in alive.values())


def test_a_vote_without_the_coordinators_bit_is_no_accept() -> None:
    c = Consensus(CONFIG, 102)
    # Round 4 belongs to 104 (index 3); these bits are 101's and 103's only.
    assert c.merge_vote(Vote(7, 4, A, 0, bytes([0b101])))
    assert c.voted_round == -1 and c.promised == 0
    # With the coordinator's bit it accepts, but never below a promise:
    c.on_prepare(105, Prepare(7, 5))  # round 5: coordinator index 4 -> member 105
    assert c.merge_vote(Vote(7, 4, A, 0, bytes([0b1101])))
    assert c.voted_round == -1


def test_the_coordinator_sends_prepare_again_only_to_the_silent_and_at_most_twice() -> None:
    c = Consensus(CONFIG, 104)
    c.prepare(attempt=0, fallback=A)
    c.outbox.clear()
    c.on_promise(101, Promise(7, 4, -1, None))
    c.on_promise(102, Promise(7, 4, -1, None))
    for _ in range(3):
        c.resend_prepare()
    resent = [(dest, msg) for dest, msg in c.outbox]
    silent = [m for m in MEMBERS if m not in (101, 102, 104)]
    assert resent == [(m, Prepare(7, 4)) for m in silent] * 2
    # A promise received again for the same round is harmless, and the Accept goes out once
    # a majority (6 of 10) promised:
    c.outbox.clear()
    for m in (102, 103, 105, 106):
        c.on_promise(m, Promise(7, 4, -1, None))
    assert [d for d, msg in c.outbox if isinstance(msg, Accept)] == [m for m in MEMBERS
                                                                     if m != 104]
    c.outbox.clear()
    c.resend_prepare()
    assert c.outbox == []


def test_the_coordinator_proposes_its_view_as_of_its_accept_not_of_its_prepare() -> None:
    # Prepared while it saw A; by the time a majority promised (no fast votes among them), a
    # second member had failed and its view is B: that is what it proposes. Later updates do
    # not change an Accept already sent.
    c = Consensus(CONFIG, 104)
    c.prepare(attempt=0, fallback=A)
    c.update_fallback(B)
    for m in (101, 102, 103, 105, 106):
        c.on_promise(m, Promise(7, 4, -1, None))
    assert {msg.cut for _, msg in c.outbox if isinstance(msg, Accept)} == {B}
    c.update_fallback(A)
    c.update_fallback(None)
    assert c.voted_cut == B and not c.holding
