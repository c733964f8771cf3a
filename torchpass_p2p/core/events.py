"""Events the membership core hands to its host, pulled with ``Member.next_event()``.

Each event carries ``at``, the ``now`` (seconds) of the call that produced it, so a host or the
simulator can build timelines without reading a clock. A peer's failure is an event, never an
exception (docs/design.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

from .configuration import Configuration
from .messages import MemberId
from .plan import Plan


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
    """No ack or nack from anyone for ``Params.self_suspect_after_s``: this member is likely the
    one cut off, so it accuses nobody until an ack or nack arrives again."""

    at: float


@dataclass(frozen=True, slots=True)
class SelfRefuted:
    """This member raised its incarnation to refute an alert about itself."""

    at: float
    incarnation: int


@dataclass(frozen=True, slots=True)
class SelfRemoved:
    """A decided configuration no longer holds this member (it was declared dead, it left, or
    it lost a partition): it must stop training and may come back only as a new member id
    (docs/design.md section 5)."""

    at: float
    incarnation: int


@dataclass(frozen=True, slots=True)
class ConfigurationDecided:
    """``configuration`` succeeded ``plan.previous_config_id`` and this member now holds it.

    ``round`` is the deciding round (0: the fast round); ``votes`` the bits in the certificate
    this member decided on. ``plan.resume_step`` is still None here; see :class:`PlanReady`.
    """

    at: float
    configuration: Configuration
    round: int
    votes: int
    plan: Plan


@dataclass(frozen=True, slots=True)
class PlanReady:
    """Every surviving rank holder reported its last committed step: ``plan.resume_step`` is
    fixed, and ``plan.hash`` is the same on every member (docs/design.md section 6)."""

    at: float
    plan: Plan


@dataclass(frozen=True, slots=True)
class RankAssigned:
    """This member, a spare, holds ``rank`` from ``config_id`` on."""

    at: float
    config_id: int
    rank: int


@dataclass(frozen=True, slots=True)
class WaitingForSpare:
    """``config_id`` leaves ``vacant`` ranks empty: no spare was left (policy ``wait``)."""

    at: float
    config_id: int
    vacant: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class JobStopped:
    """``config_id``'s plan stops the job (action ``stop``, :mod:`.plan` rules 3 and 5): nobody
    can fill the ``vacant`` ranks (every holder of their state is gone, or no spare is left
    under policy ``stop``), so no member trains again."""

    at: float
    config_id: int
    vacant: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Joined:
    """This process, which asked to join, is a spare of ``config_id``."""

    at: float
    config_id: int


@dataclass(frozen=True, slots=True)
class QuorumLost:
    """This member has believed fewer than a majority of its configuration reachable for
    ``Params.lease_s``: it must stop training until :class:`QuorumRegained` (fencing).

    ``members`` is the configuration's size, ``reachable`` how many of them this member
    believes reachable now, itself included (``Member.reachable``), ``majority`` how many a
    decision needs (``floor(members / 2) + 1``). ``reachable < majority``: too many members
    are suspected or convicted, or this member reaches nobody (it suspects itself, and cannot
    tell whether it is cut off or all the others are gone); unless enough come back (a paused
    process, a healed partition) no change of this configuration can be decided on this side,
    not even the admission of a new process. ``reachable >= majority``: this member heard too
    few of its own neighbours lately (it is the one cut off)."""

    at: float
    config_id: int
    members: int
    reachable: int
    majority: int


@dataclass(frozen=True, slots=True)
class QuorumRegained:
    """A majority of the configuration is reachable again."""

    at: float
    config_id: int


Event = (MemberAlive | MemberSuspected | AlertRaised | MemberDead | MemberLeft | SelfSuspected
         | SelfRefuted | SelfRemoved | ConfigurationDecided | PlanReady | RankAssigned
         | WaitingForSpare | JobStopped | Joined | QuorumLost | QuorumRegained)
