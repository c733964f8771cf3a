"""Errors of the state-transfer layer.

Local misuse (a non-plain object in metadata, a bad argument) raises ``TypeError`` /
``ValueError``. A peer's fault never raises out of the server: it is counted by reason and the
connection is dropped. On the receiving side a source's fault is counted and its chunks move to
another source; only when no source is left does :class:`TransferFailed` reach the caller.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class TransferError(Exception):
    """Base class. ``reason`` is a short snake_case string that tests and metrics use."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class PeerError(TransferError):
    """One peer misbehaved or refused (bad frame, failed authentication, stale config_id,
    corrupted chunk, ...). The connection is dropped; the caller counts ``reason``."""


class Refused(PeerError):
    """The server answered with an explicit refusal (``reason`` is the server's, one of
    ``REFUSALS``; any other is counted ``refused``)."""

    @classmethod
    def of(cls, msg: dict[str, Any]) -> Refused:
        """The refusal an ``error`` frame ``msg`` carries. Its reason comes from the peer, before
        or without proof of the key: a reason no server sends becomes ``refused``, so counters
        keep a bounded set of labels."""
        reason = msg.get("reason")  # any msgpack value: a list is unhashable
        return cls(reason if type(reason) is str and reason in REFUSALS else "refused")


class SnapshotChanged(TransferError):
    """A snapshot's bytes differ from the digests first computed from them: something wrote
    into tensors it references (a snapshot captured without ``copy`` while training went on, or
    a memory fault). Its digests, and so its fingerprint, no longer describe it; the server
    refuses it (``snapshot_changed``) and the receiver takes the other sources."""


REFUSALS = frozenset({"bad_version", "unknown_key", "auth_failed", "stale_config",
                      "too_many_connections", "no_snapshot", "step_mismatch", "withdrawn",
                      "snapshot_changed"})
"""Every reason a transfer server puts in an ``error`` frame."""


class TransferFailed(TransferError):
    """The receiver could not complete the transfer from any source. ``failures`` counts the
    per-source reasons that led there. The receiver's tensors may hold partial data: the spare
    must not join (its state was never valid before a complete, verified transfer)."""

    def __init__(self, reason: str, detail: str = "", failures: Counter[str] | None = None):
        super().__init__(reason, detail)
        self.failures: Counter[str] = failures if failures is not None else Counter()
