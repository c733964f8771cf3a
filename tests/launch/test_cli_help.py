"""Command-line help reads as plain text: docstrings' reStructuredText markup is stripped."""

from __future__ import annotations

import pytest

from torchpass_p2p.cli import plain
from torchpass_p2p.cli.main import main


def test_roles_and_literals_become_their_text():
    doc = "``torchpass-p2p launch``: see :mod:`torchpass_p2p.launch` and :class:`~a.B`."
    assert plain(doc) == "torchpass-p2p launch: see torchpass_p2p.launch and a.B."
    assert plain(None) == ""


@pytest.mark.parametrize("command", ["launch", "drain"])
def test_help_has_no_markup(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert f"torchpass-p2p {command}" in out
    assert "``" not in out and ":mod:" not in out
