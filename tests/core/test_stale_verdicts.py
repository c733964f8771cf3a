"""Verdicts a member holds about members that are alive (issue 32, item 8: seeds 2595 and 2775
of the safety fuzz). A member on the minority side of a partition convicts the majority it
cannot reach; its view can count a majority reachable all the same (members of the other side
that none of its side observes stay unsuspected), so the verdicts are not marked as taken
without one, and their gossip runs out before the heal. Three rules keep such a view from
removing healthy members or muting its member:

* a decided configuration that keeps a member the view holds dead sends the verdict to its
  subject, which refutes it if it is alive (``Member._send_kept_verdicts``);
* a member whose view counts fewer than a majority reachable sends its anti-entropy digest to
  any member of its configuration, not only to those it holds alive (``Member._start_sync``);
* a coordinator whose view counts fewer than a majority reachable proposes none of it
  (``Reconfiguration._view_holds_majority``).
"""

from __future__ import annotations

from tests.core.helpers import drain, make_member
from torchpass_p2p.core.agreement import fast_quorum
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.messages import Ack, Cut, Dead, Digest, Gossip, Ping, Prepare, Vote
from torchpass_p2p.core.params import Params

IDS = [1, 2, 3, 4, 5, 6, 7]
CONFIG = Configuration(0, IDS, [], observers=4)


def _convict(member, now: float, subjects: list[int], confirmer: int) -> None:
    """``member`` learns verdicts about ``subjects`` from ``confirmer`` (a member of its side)."""
    member.receive(now, confirmer, Gossip(tuple(Dead(s, 0, confirmer) for s in subjects)))


def test_a_change_that_keeps_a_member_held_dead_sends_the_verdict_to_it() -> None:
    m = make_member(1, CONFIG)
    _convict(m, 1.0, [5, 6], confirmer=2)
    drain(m)
    # A fast quorum decides removing 7 only: 5 and 6 are kept.
    cut = Cut((7,), ())
    bits = (1 << fast_quorum(len(IDS))) - 1
    m.receive(2.0, 2, Vote(0, 0, cut, 0, bits.to_bytes(1, "little"), -1))
    assert m.configuration.config_id == 1 and 5 in m.configuration
    sent = [(dst, msg.updates) for dst, msg in drain(m) if isinstance(msg, Gossip)]
    told = {dst for dst, updates in sent
            if any(isinstance(u, Dead) and u.member == dst for u in updates)}
    assert told == {5, 6}


def test_a_member_that_holds_most_dead_syncs_with_one_it_holds_dead() -> None:
    m = make_member(1, CONFIG, params=Params(sync_interval_s=1.0))
    _convict(m, 0.1, [3, 4, 5, 6, 7], confirmer=2)
    _convict(m, 0.2, [2], confirmer=3)
    assert m.reachable == 1
    drain(m)
    digests = []
    now = 0.2
    while now < 6.0:
        now = m.next_deadline()
        m.handle_timer(now)
        digests += [dst for dst, msg in drain(m) if isinstance(msg, Digest)]
    assert digests and set(digests) <= set(IDS[1:])


def test_a_coordinator_whose_view_counts_no_majority_proposes_nothing() -> None:
    m = make_member(1, CONFIG)
    _convict(m, 0.1, [5, 6, 7], confirmer=2)  # each taken while 4 of 7 were still reachable
    assert m.reachable == 4 and not m.isolated_verdicts()
    _convict(m, 0.2, [4], confirmer=2)  # now 3 of 7: below a majority
    assert m.reachable == 3
    drain(m)
    sent = []
    now, chat_at = 0.2, 0.2
    while now < 20.0:
        now = min(m.next_deadline(), chat_at)
        if now == chat_at:  # 2 and 3 are alive and talk to it: it is not cut off
            chat_at += 0.25
            for peer in (2, 3):
                m.receive(now, peer, Gossip(()))
        else:
            m.handle_timer(now)
        for dst, msg in drain(m):
            sent.append(msg)
            if isinstance(msg, Ping) and dst in (2, 3):
                m.receive(now, dst, Ack(msg.seq, ()))
    assert m.reachable == 3
    assert any(isinstance(msg, Vote) for msg in sent)  # its fast vote, harmless alone
    assert not any(isinstance(msg, Prepare) for msg in sent)
