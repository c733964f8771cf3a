"""The sans-IO protocol core: membership, wire codec and sealing, parameters.

Nothing here reads a clock, touches a socket, starts a thread or draws global randomness
(docs/design.md section 3): every entry point takes ``now`` and randomness is injected.
"""

from .configuration import Address, Configuration
from .errors import LocalProtocolError
from .membership import Member
from .messages import MemberId, MemberState, format_member_id
from .params import Params

__all__ = [
    "Address",
    "Configuration",
    "LocalProtocolError",
    "Member",
    "MemberId",
    "MemberState",
    "Params",
    "format_member_id",
]
