"""Events the membership core hands to its host, pulled with ``Member.next_event()``.

Each event carries ``at``, the ``now`` (seconds) of the call that produced it, so a host or the
simulator can build timelines without reading a clock. A peer's failure is an event, never an
exception (DESIGN section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

from .messages import MemberId


@dataclass(frozen=True, slots=True)
class MemberAlive:
    """``member`` refuted a suspicion (or was seen at a higher incarnation)."""

    at: float
    member: MemberId
    incarnation: int


@dataclass(frozen=True, slots=True)
class MemberSuspected:
    """The first alert about ``member`` at ``incarnation`` arrived; its suspicion timer runs."""

    at: float
    member: MemberId
    incarnation: int
    observer: MemberId


@dataclass(frozen=True, slots=True)
class AlertRaised:
    """``observer`` (possibly this member) reported ``subject`` unreachable. The agreement
    layer tallies these per subject (Rapid's cut detection)."""

    at: float
    observer: MemberId
    subject: MemberId
    incarnation: int


@dataclass(frozen=True, slots=True)
class MemberDead:
    """``member`` is confirmed dead at ``incarnation`` (by ``confirmer``)."""

    at: float
    member: MemberId
    incarnation: int
    confirmer: MemberId


@dataclass(frozen=True, slots=True)
class MemberLeft:
    """``member`` left on its own."""

    at: float
    member: MemberId
    incarnation: int


@dataclass(frozen=True, slots=True)
class SelfSuspected:
    """No ack from anyone for ``Params.self_suspect_after_s``: this member is likely the one cut
    off, so it accuses nobody until an ack arrives again."""

    at: float


@dataclass(frozen=True, slots=True)
class SelfRefuted:
    """This member raised its incarnation to refute an alert about itself."""

    at: float
    incarnation: int


@dataclass(frozen=True, slots=True)
class SelfRemoved:
    """Another member confirmed this member dead: it must stop training and may come back only
    as a new member id (DESIGN section 5)."""

    at: float
    incarnation: int


Event = (MemberAlive | MemberSuspected | AlertRaised | MemberDead | MemberLeft | SelfSuspected
         | SelfRefuted | SelfRemoved)
