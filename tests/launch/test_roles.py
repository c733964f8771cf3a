"""What the launcher reads from its children's status pages: the parsing of one page, and when
a job has lost its majority for good (:func:`torchpass_p2p.launch.roles.majority_lost`)."""

from __future__ import annotations

import pytest

from torchpass_p2p.launch.roles import StatusView, _view, majority_lost

A, B, C, D, E = (f"{i:016x}" for i in range(0xA, 0xF))
FIVE = frozenset({A, B, C, D, E})


def fenced(config_id: int = 3, members: frozenset[str] = FIVE, *, role: str = "spare",
           is_fenced: bool = True) -> StatusView:
    return StatusView(role, frozenset(), config_id, members, is_fenced)


def test_a_status_page_is_read_into_a_view() -> None:
    page = {"role": "spare", "config_id": 3, "fenced": True, "members": [
        {"member_id": A, "role": "rank"}, {"member_id": B, "role": "spare"},
        {"member_id": 7, "role": "rank"}, "junk"]}
    assert _view(page) == StatusView("spare", frozenset({A}), 3, frozenset({A, B}), True)
    # Fields of another shape read as "unknown", never as fenced.
    assert _view({"role": "rank", "members": [], "config_id": "3", "fenced": 1}) == StatusView(
        "rank", frozenset(), -1, frozenset(), False)
    assert _view({"role": "rank"}) is None and _view([]) is None


def test_three_of_five_gone_is_a_lost_majority() -> None:
    assert majority_lost([fenced(), fenced()], frozenset({C, D, E}), FIVE) == (
        "no majority of configuration 3 is left: 3 of its 5 members exited and a majority is 3")


@pytest.mark.parametrize("views, gone", [
    pytest.param([fenced(), fenced()], frozenset({D, E}), id="two-gone-three-left"),
    pytest.param([fenced(), fenced(is_fenced=False)], frozenset({C, D, E}),
                 id="one-agent-still-reaches-a-majority"),
    pytest.param([fenced(), None], frozenset({C, D, E}), id="one-agent-did-not-answer"),
    pytest.param([fenced(3), fenced(4, FIVE - {E})], frozenset({C, D, E}),
                 id="agents-in-different-configurations"),
    pytest.param([fenced(-1)], frozenset({C, D, E}), id="no-configuration-yet"),
    pytest.param([], frozenset({C, D, E}), id="nobody-to-ask"),
    pytest.param([fenced()], frozenset({"1" * 16, "2" * 16, "3" * 16}),
                 id="the-dead-are-not-members"),
])
def test_no_verdict_without_certainty(views: list[StatusView | None],
                                      gone: frozenset[str]) -> None:
    assert majority_lost(views, gone, FIVE) is None


def test_members_still_joining_are_left_out() -> None:
    # Respawned spares are joining: never fenced, and their view is their seed's. They decide
    # nothing, so the fenced members' verdict stands; alone they give none.
    joining = StatusView("joining", frozenset(), 0, FIVE, False)
    assert majority_lost([fenced(), joining, joining], frozenset({C, D, E}), FIVE) == (
        "no majority of configuration 3 is left: 3 of its 5 members exited and a majority is 3")
    assert majority_lost([joining], frozenset({C, D, E}), FIVE) is None


def test_no_verdict_about_a_configuration_with_members_on_other_hosts() -> None:
    # Seven members, two started elsewhere: even with four of ours gone, a newer configuration
    # may have been decided over there that a partition kept from our agents.
    seven = FIVE | {"1" * 16, "2" * 16}
    assert majority_lost([fenced(members=seven)], frozenset({B, C, D, E}), FIVE) is None
    assert majority_lost([fenced(members=seven)], frozenset({B, C, D, E}), seven) == (
        "no majority of configuration 3 is left: 4 of its 7 members exited and a majority is 4")
