"""The agreed configuration and the observer rings derived from it.

A :class:`Configuration` is the numbered, agreed view of the job (DESIGN section 2): which member
holds each rank, the ordered spare pool, and every member's address. Configuration 0 is the
launcher's initial member list; later ones are decided by the agreement layer. Configurations are
immutable values, so one object can be shared by every member that holds it (the simulator relies on
this to run 16k members without 16k copies of the member table).

Monitoring follows Rapid (Suresh et al., ATC 2018, section 4.1): K pseudo-random rings over the
members, each ordered by a hash of (ring, member id). On every ring a member observes its successor,
so each subject has up to K distinct observers and each observer up to K subjects. Every member
computes the same rings from the same configuration, so an alert from a member that is not one of
the subject's observers is recognised and dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .hashing import mix_pair
from .messages import MemberId

Address = tuple[str, int]
"""(host, port) of a member's datagram socket."""


class Configuration:
    """An immutable, agreed view of the job.

    Args:
        config_id: the configuration number, the fencing token (DESIGN section 5).
        ranks: member id holding rank ``r`` at index ``r``; ``len(ranks)`` is the world size.
        spares: the ordered spare pool.
        addresses: every member's (host, port); may be empty in the simulator.
        observers: K, the number of observer rings.

    Raises:
        ValueError: a member appears twice, or an id is outside uint64.
    """

    def __init__(
        self,
        config_id: int,
        ranks: Iterable[MemberId],
        spares: Iterable[MemberId] = (),
        addresses: Mapping[MemberId, Address] | None = None,
        *,
        observers: int = 10,
    ) -> None:
        self.config_id = config_id
        self.ranks: tuple[MemberId, ...] = tuple(ranks)
        self.spares: tuple[MemberId, ...] = tuple(spares)
        everyone = self.ranks + self.spares
        if len(set(everyone)) != len(everyone):
            raise ValueError("a member appears twice in the configuration")
        if any(not 0 <= m < 1 << 64 for m in everyone):
            raise ValueError("member ids must be unsigned 64-bit integers")
        # Sorted so that every member iterates the membership in the same order.
        self.members: tuple[MemberId, ...] = tuple(sorted(everyone))
        self._index = {m: i for i, m in enumerate(self.members)}
        self.addresses: Mapping[MemberId, Address] = dict(addresses or {})
        self.observers = observers
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
        return (f"Configuration(config_id={self.config_id}, world_size={len(self.ranks)}, "
                f"spares={len(self.spares)})")

    def rank_of(self, member: MemberId) -> int | None:
        """The rank ``member`` holds, or None for a spare or a stranger."""
        try:
            return self.ranks.index(member)
        except ValueError:
            return None

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
