"""Whether an operator's drain (``POST /drain``) may hand this member's rank to a spare.

A drain the agent asks for itself (a hang, a failing GPU) is never refused: that rank cannot
train on. An operator's is refused when it would stop the job: when no other rank holder is
alive and known to hold the state (the agreement counts a removed member's state as gone,
plan rule 3, so the job would stop although this member still holds it), or under policy
``wait`` with no spare (every rank would wait for a spare to join, up to its give-up time).

What must stay true: only holders known to hold the state count: those in the group of the
host's last commit, or before any, the ranks of the configuration this member was started in.
A spare promoted since may still be receiving the state (from this member, which would stop
serving it); it counts once a step commits in its group. Two holders drained within one gossip
round can still both be accepted; the job then stops cleanly (exit 5).
"""

from __future__ import annotations

from typing import Any

from torchpass_p2p.core.membership import Member
from torchpass_p2p.core.messages import MemberId, MemberState
from torchpass_p2p.core.plan import Policy

__all__ = ["drain_refusal"]


def drain_refusal(member: Member, member_id: MemberId,
                  known: tuple[MemberId | None, ...], policy: Policy) -> dict[str, Any] | None:
    """Why rank holder ``member_id`` (whose core is ``member``) may not be drained now, as the
    reply to ``POST /drain`` (``{"draining": False, "reason": "last_holder" | "no_spare",
    "detail"}``), or None when it may. ``known``: the rank map of the last group known to hold
    the state; ``policy``: the job's."""
    config = member.configuration
    others = [h for h in config.ranks if h is not None and h != member_id and h in known]
    if not any(member.state_of(h)[0] == MemberState.ALIVE for h in others):
        return {"draining": False, "reason": "last_holder",
                "detail": "no other rank holder is alive and known to hold the state "
                          "(a spare promoted since the last committed step may still be "
                          "receiving it): the configuration would lose it and stop the "
                          "job; retry after the next step"}
    if policy is Policy.WAIT and not config.spares:
        return {"draining": False, "reason": "no_spare",
                "detail": "no spare to take the rank: under policy wait training would "
                          "stop until one joins (start a spare first, or use policy "
                          "shrink)"}
    return None
