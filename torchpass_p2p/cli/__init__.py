"""The ``torchpass-p2p`` command line: ``launch``, ``drain`` and ``status`` (:mod:`.main`)."""

from __future__ import annotations

import re

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(doc: str | None) -> str:
    """A docstring as ``--help`` text: reStructuredText roles and literals as their bare text
    (``:mod:`x``` and ````x```` become ``x``)."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", doc or ""))
