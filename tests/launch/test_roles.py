"""What the launcher reads from its children's status pages: the parsing of one page, and when
a job has lost its majority for good (:func:`torchpass_p2p.launch.roles.majority_lost`), and
when a vacant rank has no spare left to take it (``vacant_without_spare``)."""

from __future__ import annotations

import pytest

from torchpass_p2p.launch.roles import StatusView, _view, majority_lost, vacant_without_spare

A, B, C, D, E = (f"{i:016x}" for i in range(0xA, 0xF))
FIVE = frozenset({A, B, C, D, E})


def fenced(config_id: int = 3, members: frozenset[str] = FIVE, *, role: str = "spare",
           is_fenced: bool = True) -> StatusView:
    return StatusView(role, frozenset(), config_id, members, is_fenced)


def test_a_status_page_is_read_into_a_view() -> None:
    page = {"role": "spare", "config_id": 3, "fenced": True, "world_size": 2, "members": [
        {"member_id": A, "role": "rank"}, {"member_id": B, "role": "spare"},
        {"member_id": 7, "role": "rank"}, "junk"]}
    assert _view(page) == StatusView("spare", frozenset({A}), 3, frozenset({A, B}), True, 2)
    # Fields of another shape read as "unknown", never as fenced.
    assert _view({"role": "rank", "members": [], "config_id": "3", "fenced": 1}) == StatusView(
        "rank", frozenset(), -1, frozenset(), False)
    assert _view({"role": "rank"}) is None and _view([]) is None


def test_a_fenced_agent_without_a_majority_says_how_many_are_left() -> None:
    # What the launcher says when that member stops the job (issue 32, item 3): its counts,
    # in the wording of majority_lost.
    page = {"role": "rank", "config_id": 3, "fenced": True, "reachable": 2, "majority": 3,
            "members": [{"member_id": m} for m in (A, B, C, D, E)]}
    view = _view(page)
    assert view == StatusView("rank", frozenset(), 3, FIVE, True, 0, 2, 3)
    assert view.no_majority() == (
        "no majority of configuration 3 is left: 2 of its 5 members are reachable and a "
        "majority is 3")
    # Not fenced, still counting a majority (cut off), or counts it did not give: nothing.
    for patch in ({"fenced": False}, {"reachable": 3}, {"reachable": True}, {"majority": None}):
        other = _view(dict(page, **patch))
        assert other is not None and other.no_majority() is None, patch


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


def _in(config_id: int, holders: set[str], members: set[str], world_size: int,
        role: str = "rank") -> StatusView:
    return StatusView(role, frozenset(holders), config_id, frozenset(members), False, world_size)


def test_a_vacant_rank_without_a_spare_is_named() -> None:
    # Configuration 2: four ranks, C's vacant, every member holds a rank.
    views = [_in(2, {A, B, D}, {A, B, D}, 4), _in(2, {A, B, D}, {A, B, D}, 4), None]
    assert vacant_without_spare(views) == (
        "configuration 2 has 1 vacant rank(s) and no spare left to fill them")
    # The newest configuration counts: an agent still in configuration 1 says nothing.
    assert vacant_without_spare([_in(1, {A, B, C, D}, {A, B, C, D}, 4), *views]) == (
        vacant_without_spare(views))


def test_no_hint_while_a_spare_is_left_or_no_rank_is_vacant() -> None:
    assert vacant_without_spare([_in(2, {A, B, D}, {A, B, D, E}, 4)]) is None  # E: a spare
    assert vacant_without_spare([_in(2, {A, B, C, D}, {A, B, C, D}, 4)]) is None
    assert vacant_without_spare([_in(2, {A}, {A}, 0)]) is None  # world size unknown
    # A joining spare belongs to no configuration yet; no answer says nothing.
    assert vacant_without_spare([_in(0, set(), {E}, 4, role="joining"), None]) is None
