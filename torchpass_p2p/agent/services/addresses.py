"""Where this member sends to: the current configuration's members, members a decided change
removed, and processes asking to join.

What must stay true: a joiner's address comes from its authenticated Join message, never from
a datagram's source address (a replayed datagram would move a member); and a removed member's
address is kept for a while, since a removed member that wakes up (a long pause) must still
hear the certificates that tell it so. Both maps are bounded (:data:`MAX_JOINER_ADDRESSES`,
oldest dropped first).
"""

from __future__ import annotations

from torchpass_p2p.core.configuration import Address, Configuration
from torchpass_p2p.core.messages import Joiner, MemberId

__all__ = ["MAX_JOINER_ADDRESSES", "AddressBook"]

MAX_JOINER_ADDRESSES = 1024
"""Joiners' (and former members') addresses kept (oldest dropped first): far above the joins
one change admits."""


class AddressBook:
    """Addresses beyond the current configuration's: former members and joiners."""

    def __init__(self) -> None:
        self.former: dict[MemberId, Address] = {}
        """Where members that a decided change removed were."""
        self.joiners: dict[MemberId, Address] = {}
        """Where processes asking to join are, from their Join messages."""

    def heard_join(self, joiner: Joiner) -> None:
        """``joiner`` (of an authenticated Join, from a process in no configuration yet) says
        where it listens."""
        joiners = self.joiners
        if len(joiners) >= MAX_JOINER_ADDRESSES:
            joiners.pop(next(iter(joiners)))
        joiners[joiner.member] = (joiner.host, joiner.port)

    def decided(self, old: Configuration, new: Configuration) -> None:
        """A change from ``old`` to ``new`` was decided: remember where the members it removed
        were."""
        former = self.former
        for member, address in old.addresses.items():
            if member not in new:
                former[member] = address
        while len(former) > MAX_JOINER_ADDRESSES:
            former.pop(next(iter(former)))

    def send_to(self, configuration: Configuration, member: MemberId) -> Address | None:
        """Where a datagram for ``member`` goes: its address in ``configuration``, else where
        it was as a former member, else as a joiner; None if unknown."""
        return (configuration.addresses.get(member) or self.former.get(member)
                or self.joiners.get(member))

    def ask_at(self, configuration: Configuration, member: MemberId) -> Address | None:
        """Where a request for ``member`` goes (a member or a joiner, never a former member);
        None if unknown."""
        return configuration.addresses.get(member) or self.joiners.get(member)

    def member_at(self, configuration: Configuration | None, address: Address
                  ) -> MemberId | None:
        """The member of ``configuration`` (None: none yet), else the joiner, at ``address``."""
        if configuration is not None:
            for member, addr in configuration.addresses.items():
                if addr == address:
                    return member
        for member, addr in self.joiners.items():
            if addr == address:
                return member
        return None
