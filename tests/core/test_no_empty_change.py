"""Issue 32, item 2, in the membership core: no empty change, and joiners known everywhere.

A fleet of real :class:`~torchpass_p2p.core.membership.Member` objects on a hand-advanced clock
(:class:`tests.core.helpers.Fleet`): votes left over from a suspicion that was refuted start no
classic round and decide nothing, not even the empty cut, until a real change comes, which a
classic round then decides; and a member that missed a joiner's ``Join`` learns it from the
vote of a member that did not.
"""

from __future__ import annotations

import pytest

from tests.core.helpers import QUIET, Fleet
from torchpass_p2p.core import events as ev
from torchpass_p2p.core.messages import Cut, Join, Joiner, Prepare, Vote

P = QUIET


def _decisions(fleet: Fleet, member: int) -> list[ev.ConfigurationDecided]:
    return [e for e in fleet.events(member) if isinstance(e, ev.ConfigurationDecided)]


def test_stale_votes_start_no_classic_round_and_decide_nothing_until_a_change_comes() -> None:
    fleet = Fleet(6, params=P)
    fleet.run_until(3.0)
    # Members 1-3 voted to remove 6, which then refuted: three fast votes of six, no quorum,
    # and nobody's view holds a change any more.
    stale = Vote(0, 0, Cut((6,)), 0, bytes([0b000111]), -1)
    for i in range(1, 7):
        fleet[i].receive(fleet.now, 2 if i != 2 else 3, stale)
    fleet.run_until(20.0)
    # The members that fall due defer their classic round: no Prepare, no decision. A round
    # run 1.5-2.5 s later would decide the empty cut (configuration 1, no change).
    assert [msg for _, _, _, msg in fleet.trace if isinstance(msg, Prepare)] == []
    assert all(_decisions(fleet, i) == [] for i in range(1, 7))
    assert sum(fleet[i].counters["classic_rounds_started"] for i in range(1, 7)) == 0
    assert all(fleet[i].configuration.config_id == 0 for i in range(1, 7))
    # Two members exit: the instance that holds the stale votes decides their removal, in a
    # classic round (four of six cannot make the fast quorum of five), and never 6's.
    fleet.down |= {4, 5}
    for i in (1, 2, 3, 6):
        fleet[i].report_exited(fleet.now, 4)
        fleet[i].report_exited(fleet.now, 5)
    fleet.run_until(30.0)
    for i in (1, 2, 3, 6):
        (decided,) = _decisions(fleet, i)
        assert decided.round >= 1 and decided.plan.removed == (4, 5)
        assert decided.plan.previous_config_id == 0
        assert fleet[i].configuration.members == (1, 2, 3, 6)


def test_a_member_that_missed_a_join_learns_the_joiner_from_a_vote() -> None:
    fleet = Fleet(6, params=P)
    fleet.run_until(3.0)
    # Every Join is lost but the one that reaches member 2: the flood reaches nobody. (No
    # process runs as 99: what the members send it is lost too.)
    fleet.drop = lambda src, dst, msg: isinstance(msg, Join) or dst == 99
    joiner = Joiner(99, "10.0.0.99", 29500)
    fleet[2].receive(fleet.now, 99, Join(joiner, 0))
    fleet.run_until(5.0)
    assert not [msg for _, _, _, msg in fleet.trace if isinstance(msg, Join)]
    # Member 2 voted to admit it; its vote carried the joiner to the other five, who voted
    # the same cut: a fast quorum admitted it everywhere.
    for i in range(1, 7):
        (decided,) = _decisions(fleet, i)
        assert (decided.round, decided.plan.joined, decided.plan.removed) == (0, (99,), ())
        # Member 2's cut settled cut_settle_s after the Join; the others', cut_settle_s after
        # its vote reached them (zero latency here).
        assert decided.at == pytest.approx(3.0 + 2 * P.cut_settle_s)
        assert fleet[i].configuration.spares == (99,)
