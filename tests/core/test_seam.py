"""The seam between a member and its agreement side (``core/reconfiguration.py``, "The seam").

:class:`Reconfiguration` gets everything it needs from its :class:`Member` at construction and
reads nothing else: a static check walks the module with ``ast`` and names every attribute it
reads or writes with a leading underscore on anything but ``self``; a dynamic one runs a fleet
through a decision and checks that the configuration the two sides hold stays one object.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from torchpass_p2p.core import events as ev

from .helpers import Fleet

RECONFIGURATION = Path(__file__).resolve().parents[2] / "torchpass_p2p/core/reconfiguration.py"


def private_reaches(source: str) -> list[tuple[int, str]]:
    """(line, ``base._name``) for each access to a private attribute of anything but ``self``;
    dunders (``__class__``) are not private."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            continue
        found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
    return found


def test_reconfiguration_reaches_into_no_private_attribute() -> None:
    bad = private_reaches(RECONFIGURATION.read_text())
    assert bad == [], "Reconfiguration must use only what its constructor is given"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("m = self._member\nm._config.config_id", [(2, "m._config")]),
        ("self._member._counts['x'] += 1", [(1, "self._member._counts")]),
        ("x = member._send", [(1, "member._send")]),
        ("self._send(dest, vote)\nself.configuration.config_id", []),
        ("m.view_digest()\nx.__class__", []),
    ],
)
def test_checker_finds_private_reaches(source: str, expected: list[tuple[int, str]]) -> None:
    assert private_reaches(source) == expected


def test_both_sides_hold_the_decided_configuration() -> None:
    fleet = Fleet(8)
    start = {i: m.configuration for i, m in fleet.members.items()}
    for i, m in fleet.members.items():
        assert m._reconf.configuration is start[i]
    fleet.run_until(1.5)
    fleet[8].leave(1.5)
    fleet.run_until(4.0)
    for i, m in fleet.members.items():
        if i == 8:
            assert m.removed
            continue
        decided = [e for e in fleet.events(i) if isinstance(e, ev.ConfigurationDecided)]
        assert [e.configuration.config_id for e in decided] == [1], i
        assert m.configuration is decided[0].configuration, i
        assert m._reconf.configuration is m.configuration, i
        assert not m._reconf.cut_dirty, i
