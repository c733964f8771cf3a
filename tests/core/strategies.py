"""Hypothesis strategies for the membership core's values: ids, updates and messages.

Shared by the codec, wire and membership tests. Every value they draw is valid on the wire
(:mod:`torchpass_p2p.core.codec` limits), so ``decode(encode(m)) == m`` must hold for all.
"""

from __future__ import annotations

from hypothesis import strategies as st

from torchpass_p2p.core.codec import MAX_PAGE, MAX_SYNC_ENTRIES, MAX_UPDATES
from torchpass_p2p.core.messages import (
    MAX_INCARNATION,
    MAX_MEMBER_ID,
    MAX_SEQ,
    Ack,
    Alert,
    Alive,
    Dead,
    Digest,
    Gossip,
    Left,
    Nack,
    Ping,
    PingReq,
    SyncState,
)

# Edge values first: hypothesis shrinks toward them and draws them often.
member_ids = st.one_of(
    st.sampled_from([0, 1, MAX_MEMBER_ID, 1 << 63]), st.integers(0, MAX_MEMBER_ID)
)
incarnations = st.one_of(st.sampled_from([0, MAX_INCARNATION]), st.integers(0, MAX_INCARNATION))
seqs = st.integers(0, MAX_SEQ)
u64s = st.integers(0, (1 << 64) - 1)
pages = st.integers(0, MAX_PAGE)

alives = st.builds(Alive, member_ids, incarnations)
alerts = st.builds(Alert, member_ids, member_ids, incarnations)
deads = st.builds(Dead, member_ids, incarnations, member_ids)
lefts = st.builds(Left, member_ids, incarnations)
updates = st.one_of(alives, alerts, deads, lefts)


def update_lists(max_size: int = MAX_UPDATES) -> st.SearchStrategy[tuple]:
    """Tuples of up to ``max_size`` updates (hypothesis keeps most short: about 5 on average)."""
    return st.lists(updates, max_size=max_size).map(tuple)


pings = st.builds(Ping, seqs, update_lists())
ping_reqs = st.builds(PingReq, seqs, member_ids, update_lists())
acks = st.builds(Ack, seqs, update_lists())
nacks = st.builds(Nack, seqs, member_ids)
gossips = st.builds(Gossip, update_lists())
digests = st.builds(Digest, u64s, u64s, st.integers(0, (1 << 32) - 1))
sync_states = st.builds(
    SyncState, u64s, pages, pages, update_lists(MAX_SYNC_ENTRIES), st.booleans()
)
messages = st.one_of(pings, ping_reqs, acks, nacks, gossips, digests, sync_states)

MESSAGE_STRATEGIES = {
    Ping: pings,
    PingReq: ping_reqs,
    Ack: acks,
    Nack: nacks,
    Gossip: gossips,
    Digest: digests,
    SyncState: sync_states,
}
"""One strategy per message class, for tests parametrised over every message type."""
