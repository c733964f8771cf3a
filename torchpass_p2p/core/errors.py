"""Errors the core raises. Only local misuse raises; a peer's fault is an event or a counted drop
(docs/design.md section 3; h11's ``LocalProtocolError`` / ``RemoteProtocolError`` split)."""

from __future__ import annotations


class LocalProtocolError(RuntimeError):
    """The host used the core wrongly (e.g. time went backwards). Never raised for peer input."""
