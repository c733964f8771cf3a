"""The agreed configuration and the observer rings derived from it.

A :class:`Configuration` is the numbered, agreed view of the job (docs/design.md section 2): which
member holds each rank, the ordered spare pool, every member's address and topology (host, NVLink
domain). Configuration 0 is the launcher's initial member list; later ones are decided by the
agreement layer and computed by :func:`torchpass_p2p.core.plan.next_configuration`.
Configurations are immutable values, equal when their contents are equal, so one object can be
shared by every member that holds it (the simulator relies on this to run 16k members without 16k
copies of the member table).

A rank whose holder was removed and that no spare could take (policy ``wait``, docs/design.md
section 5)
is :data:`VACANT`: it keeps its place in ``ranks`` (the world size does not change) but has no
member, so it is in no ring and observes nothing.

Monitoring follows Rapid (Suresh et al., ATC 2018, section 4.1): K pseudo-random rings over the
members, each ordered by a hash of (ring, member id). On every ring a member observes its successor,
so each subject has up to K distinct observers and each observer up to K subjects. Every member
computes the same rings from the same configuration, so an alert from a member that is not one of
the subject's observers is recognised and dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, Literal, TypeAlias, cast

from .hashing import mix_pair
from .messages import MemberId, Topology

Address = tuple[str, int]
"""(host, port) of a member's datagram socket."""

VACANT: Final = None
"""The holder of a rank that nobody holds (its member was removed and no spare was left)."""

Role: TypeAlias = Literal["rank", "spare"]
"""A member's role (docs/design.md section 2): it holds a rank of the training world, or is a
spare."""

_UNKNOWN_TOPOLOGY: Final = Topology()


class Configuration:
    """An immutable, agreed view of the job.

    Args:
        config_id: the configuration number, the fencing token (docs/design.md section 5).
        ranks: member id holding rank ``r`` at index ``r``, or :data:`VACANT`; ``len(ranks)`` is
            the world size.
        spares: the ordered spare pool.
        addresses: every member's (host, port); may be empty in the simulator.
        observers: K, the number of observer rings.
        topology: where members run; a member missing here has ``Topology()`` (unknown, matches
            nothing). Entries equal to ``Topology()`` are dropped, so equal views compare equal.

    Raises:
        ValueError: a member appears twice, an id is outside uint64, or ``topology`` names
            someone who is not a member.
    """

    def __init__(
        self,
        config_id: int,
        ranks: Iterable[MemberId | None],
        spares: Iterable[MemberId] = (),
        addresses: Mapping[MemberId, Address] | None = None,
        *,
        observers: int = 10,
        topology: Mapping[MemberId, Topology] | None = None,
    ) -> None:
        self.config_id = config_id
        self.ranks: tuple[MemberId | None, ...] = tuple(ranks)
        self.spares: tuple[MemberId, ...] = tuple(spares)
        everyone = _distinct_members(self.ranks, self.spares)
        if any(not 0 <= m < 1 << 64 for m in everyone):
            raise ValueError("member ids must be unsigned 64-bit integers")
        # Sorted so that every member iterates the membership in the same order.
        self.members: tuple[MemberId, ...] = tuple(sorted(everyone))
        self._index = {m: i for i, m in enumerate(self.members)}
        self.addresses: Mapping[MemberId, Address] = dict(addresses or {})
        self.observers = observers
        where = {m: t for m, t in (topology or {}).items() if t != _UNKNOWN_TOPOLOGY}
        if any(m not in self._index for m in where):
            raise ValueError("topology names a member that is not in the configuration")
        self.topology: Mapping[MemberId, Topology] = where
        self._roles: dict[MemberId, int] | None = None
        self._vacant: tuple[int, ...] | None = None
        self._hash: int | None = None  # hashed on first use: O(members), and the value is fixed
        # Rings and neighbour tables are built on first use and then shared by every member
        # holding this configuration (plain attributes, not functools.cached_property, so the
        # mypyc build caches them too).
        self._rings: tuple[tuple[MemberId, ...], ...] | None = None
        self._ring_positions: tuple[dict[MemberId, int], ...] = ()
        self._observer_table: dict[MemberId, tuple[MemberId, ...]] = {}
        self._subject_table: dict[MemberId, tuple[MemberId, ...]] = {}

    def __contains__(self, member: object) -> bool:
        return member in self._index

    def __len__(self) -> int:
        return len(self.members)

    def __repr__(self) -> str:
        vacant = f", vacant={len(self.vacant_ranks)}" if self.vacant_ranks else ""
        return (f"Configuration(config_id={self.config_id}, world_size={len(self.ranks)}, "
                f"spares={len(self.spares)}{vacant})")

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Configuration):
            return NotImplemented
        return (self.config_id == other.config_id and self.ranks == other.ranks
                and self.spares == other.spares and self.observers == other.observers
                and dict(self.addresses) == dict(other.addresses)
                and dict(self.topology) == dict(other.topology))

    def __hash__(self) -> int:
        # Cached: every member of a 16k fleet looks up its decided transition by configuration
        # (reconfiguration.Transitions), and hashing 16k ranks each time was 2 % of that phase.
        found = self._hash
        if found is None:
            found = self._hash = hash((self.config_id, self.ranks, self.spares))
        return found

    @property
    def world_size(self) -> int:
        """The number of ranks of the training world, vacant ones included."""
        return len(self.ranks)

    @property
    def vacant_ranks(self) -> tuple[int, ...]:
        """The ranks nobody holds (:data:`VACANT` in ``ranks``), ascending."""
        found = self._vacant
        if found is None:
            found = self._vacant = tuple(r for r, m in enumerate(self.ranks) if m is None)
        return found

    def topology_of(self, member: MemberId) -> Topology:
        """Where ``member`` runs; ``Topology()`` (unknown) when not recorded."""
        return self.topology.get(member, _UNKNOWN_TOPOLOGY)

    def _role_table(self) -> dict[MemberId, int]:
        # member -> rank, or -1 for a spare; built on first use (plain attribute, see below).
        table = self._roles
        if table is None:
            table = {m: -1 for m in self.spares}
            for r, m in enumerate(self.ranks):
                if m is not None:
                    table[m] = r
            self._roles = table
        return table

    def rank_of(self, member: MemberId) -> int | None:
        """The rank ``member`` holds, or None for a spare or a stranger."""
        rank = self._role_table().get(member, -1)
        return None if rank < 0 else rank

    def role_of(self, member: MemberId) -> Role | None:
        """``"rank"`` or ``"spare"`` (docs/design.md section 2), or None for a stranger."""
        rank = self._role_table().get(member)
        if rank is None:
            return None
        return "spare" if rank < 0 else "rank"

    def _build_rings(self) -> tuple[tuple[MemberId, ...], ...]:
        rings = []
        for ring in range(min(self.observers, max(0, len(self.members) - 1))):
            keyed = sorted((mix_pair(ring, m), m) for m in self.members)
            rings.append(tuple(m for _, m in keyed))
        self._ring_positions = tuple({m: i for i, m in enumerate(r)} for r in rings)
        self._rings = tuple(rings)
        return self._rings

    def _neighbours(self, member: MemberId, step: int) -> tuple[MemberId, ...]:
        rings = self._rings if self._rings is not None else self._build_rings()
        seen: dict[MemberId, None] = {}
        for ring, pos in zip(rings, self._ring_positions, strict=True):
            other = ring[(pos[member] + step) % len(ring)]
            if other != member:
                seen.setdefault(other)
        return tuple(seen)

    def observers_of(self, subject: MemberId) -> tuple[MemberId, ...]:
        """The distinct observers of ``subject`` (its predecessor on each ring), ring order.

        Raises:
            KeyError: ``subject`` is not in this configuration.
        """
        table = self._observer_table
        found = table.get(subject)
        if found is None:
            found = table[subject] = self._neighbours(subject, -1)
        return found

    def subjects_of(self, observer: MemberId) -> tuple[MemberId, ...]:
        """The distinct subjects ``observer`` probes (its successor on each ring), ring order.

        Raises:
            KeyError: ``observer`` is not in this configuration.
        """
        table = self._subject_table
        found = table.get(observer)
        if found is None:
            found = table[observer] = self._neighbours(observer, +1)
        return found


def _distinct_members(ranks: tuple[MemberId | None, ...], spares: tuple[MemberId, ...],
                      ) -> tuple[MemberId, ...]:
    """Rank holders then spares, vacancies left out.

    One set serves the duplicate check and, in O(1), the question whether any rank is vacant, so
    a configuration without vacancies costs what it did before vacancies existed (measured with
    the mypyc build: 1.9 ms for 16k ranks and 1k spares, before and after).

    Raises:
        ValueError: a member appears twice.
    """
    everyone = cast(tuple[MemberId, ...], ranks) + spares  # may still hold VACANT here
    # Typed with None: mypyc compiles `None in` a set[int] into something as slow as a scan
    # (measured: +0.7 ms for 17k members); as a set of optional ids it is one hash lookup.
    distinct: set[MemberId | None] = set(everyone)
    if None in distinct:
        everyone = tuple(m for m in ranks if m is not None) + spares
        distinct = set(everyone)
    if len(distinct) != len(everyone):
        raise ValueError("a member appears twice in the configuration")
    return everyone
