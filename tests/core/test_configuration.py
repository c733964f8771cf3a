"""Configuration: vacant ranks, roles, topology, value equality; the rings ignore vacancies."""

from __future__ import annotations

from typing import Any

import pytest

from torchpass_p2p.core.configuration import VACANT, Configuration
from torchpass_p2p.core.messages import Topology

GPU0 = Topology("node-a", "nvl-0")


def test_positional_constructor_is_unchanged() -> None:
    config = Configuration(3, [10, 11, 12], [20], {10: ("h", 1)}, observers=2)
    assert config.config_id == 3
    assert config.ranks == (10, 11, 12)
    assert config.spares == (20,)
    assert config.members == (10, 11, 12, 20)
    assert config.addresses == {10: ("h", 1)}
    assert config.observers == 2
    assert config.world_size == 3
    assert config.vacant_ranks == ()
    assert config.topology == {}
    assert repr(config) == "Configuration(config_id=3, world_size=3, spares=1)"


def test_vacant_ranks_keep_their_place_and_are_not_members() -> None:
    config = Configuration(5, [10, VACANT, 12, VACANT], [20])
    assert VACANT is None
    assert config.world_size == 4
    assert config.vacant_ranks == (1, 3)
    assert config.members == (10, 12, 20)
    assert len(config) == 3
    assert None not in config
    assert config.rank_of(12) == 2
    assert repr(config) == "Configuration(config_id=5, world_size=4, spares=1, vacant=2)"


def test_roles() -> None:
    config = Configuration(0, [10, VACANT, 12], [20, 21])
    assert [config.role_of(m) for m in (10, 12, 20, 21, 99)] == [
        "rank", "rank", "spare", "spare", None
    ]
    assert [config.rank_of(m) for m in (10, 12, 20, 99)] == [0, 2, None, None]


def test_topology_defaults_to_unknown_and_drops_unknown_entries() -> None:
    config = Configuration(0, [10, 11], [20], topology={10: GPU0, 20: Topology()})
    assert config.topology_of(10) == GPU0
    assert config.topology_of(11) == Topology()
    assert config.topology == {10: GPU0}  # the explicit Topology() for 20 is not kept


@pytest.mark.parametrize(
    ("ranks", "spares", "topology", "message"),
    [
        ([1, 2, 1], [], {}, "appears twice"),
        ([1, VACANT, 2], [2], {}, "appears twice"),
        ([1, -1], [], {}, "unsigned 64-bit"),
        ([1], [1 << 64], {}, "unsigned 64-bit"),
        ([1, VACANT], [], {7: GPU0}, "topology names a member"),
    ],
)
def test_rejects_malformed(ranks: list, spares: list, topology: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Configuration(0, ranks, spares, topology=topology)


def test_two_vacancies_are_not_a_duplicate() -> None:
    assert Configuration(0, [VACANT, VACANT]).members == ()


def test_value_equality() -> None:
    def make(**kw: Any) -> Configuration:
        args: dict = {"config_id": 1, "ranks": [1, VACANT], "spares": [3],
                      "addresses": {1: ("h", 1)}, "observers": 4, "topology": {1: GPU0}}
        args.update(kw)
        return Configuration(**args)

    base = make()
    assert base == make()
    assert hash(base) == hash(make())
    assert base == make(topology={1: GPU0, 3: Topology()})  # unknown is the default
    changes: list[dict[str, Any]] = [{"config_id": 2}, {"ranks": [1, 2]}, {"spares": []},
                                     {"addresses": {}}, {"observers": 5}, {"topology": {}}]
    for change in changes:
        assert base != make(**change), change
    assert base != "not a configuration"


def test_rings_skip_vacant_ranks() -> None:
    full = Configuration(0, [1, 2, 3, 4, 5], [6], observers=3)
    holed = Configuration(0, [1, 2, VACANT, 4, 5], [3, 6], observers=3)
    # Same member set, so the same rings: a vacancy neither observes nor is observed.
    for m in full.members:
        assert holed.observers_of(m) == full.observers_of(m)
        assert holed.subjects_of(m) == full.subjects_of(m)
