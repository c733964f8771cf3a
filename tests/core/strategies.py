"""Hypothesis strategies for the membership core's values: ids, updates and messages.

Shared by the codec, wire and membership tests. Every value they draw is valid on the wire
(:mod:`torchpass_p2p.core.codec` limits), so ``decode(encode(m)) == m`` must hold for all.
"""

from __future__ import annotations

from hypothesis import strategies as st

from torchpass_p2p.core.codec import (
    MAX_CUT_BYTES,
    MAX_CUT_JOINED,
    MAX_CUT_REMOVED,
    MAX_LABEL_BYTES,
    MAX_PAGE,
    MAX_PORT,
    MAX_SEGMENT,
    MAX_STEP,
    MAX_SYNC_ENTRIES,
    MAX_UPDATES,
    SEGMENT_BYTES,
)
from torchpass_p2p.core.messages import (
    MAX_INCARNATION,
    MAX_MEMBER_ID,
    MAX_SEQ,
    Accept,
    Ack,
    Alert,
    Alive,
    Cut,
    Dead,
    Digest,
    Gossip,
    Join,
    Joiner,
    Left,
    Nack,
    Ping,
    PingReq,
    Prepare,
    Progress,
    Promise,
    SyncState,
    Topology,
    Vote,
)
from torchpass_p2p.core.sizes import cut_size

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

# --- agreement values ---------------------------------------------------------------------------

u32s = st.integers(0, (1 << 32) - 1)
rounds = st.one_of(st.sampled_from([0, 1, (1 << 32) - 1]), u32s)
steps = st.one_of(st.sampled_from([-1, 0, MAX_STEP]), st.integers(-1, MAX_STEP))

# Any Unicode text (no lone surrogates: they have no UTF-8 spelling) of at most MAX_LABEL_BYTES
# UTF-8 bytes. Up to 16 characters always fit (4 bytes each at most); edge strings sit exactly
# on the limit with 1-, 2-, 3- and 4-byte characters.
_edge_labels = ["x" * MAX_LABEL_BYTES, "\u00e9" * (MAX_LABEL_BYTES // 2),
                "\u20ac" * (MAX_LABEL_BYTES // 3) + "x", "\U0001f600" * (MAX_LABEL_BYTES // 4)]
labels = st.one_of(
    st.just(""),
    st.sampled_from(_edge_labels),
    st.text(max_size=16),
    st.text(st.characters(max_codepoint=127), max_size=MAX_LABEL_BYTES),
)
hosts = labels.filter(bool)
ports = st.one_of(st.sampled_from([1, MAX_PORT]), st.integers(1, MAX_PORT))
topologies = st.builds(Topology, labels, labels)
joiners = st.builds(Joiner, member_ids, hosts, ports, topologies)


def _sorted_joiners(items: list[Joiner]) -> tuple[Joiner, ...]:
    return tuple(sorted(items, key=lambda j: j.member))


def _within_budget(cut: Cut) -> Cut:
    """``cut`` with as many of its joiners as :data:`MAX_CUT_BYTES` holds (what a member
    proposes), so that every message carrying it stays under the body limit."""
    joined = cut.joined
    while cut_size(Cut(cut.removed, joined)) > MAX_CUT_BYTES:
        joined = joined[:-1]
    return Cut(cut.removed, joined)


cuts = st.builds(
    Cut,
    st.lists(member_ids, max_size=MAX_CUT_REMOVED, unique=True).map(sorted).map(tuple),
    st.lists(joiners, max_size=MAX_CUT_JOINED, unique_by=lambda j: j.member).map(_sorted_joiners),
).map(_within_budget)
"""Canonical cuts: both tuples strictly increasing by member id, within the codec's limits
and a member's byte budget."""
segment_bits = st.one_of(st.sampled_from([b"", b"\xff" * SEGMENT_BYTES]),
                         st.binary(max_size=SEGMENT_BYTES))
segments = st.integers(0, MAX_SEGMENT)


def _promise(config_id: int, round_: int, voted: tuple[int, Cut] | None) -> Promise:
    return Promise(config_id, round_, -1, None) if voted is None else Promise(
        config_id, round_, voted[0], voted[1]
    )


votes = st.builds(Vote, u64s, rounds, cuts, segments, segment_bits, steps)
prepares = st.builds(Prepare, u64s, rounds)
promises = st.builds(_promise, u64s, rounds, st.none() | st.tuples(rounds, cuts))
accepts = st.builds(Accept, u64s, rounds, cuts)
joins = st.builds(Join, joiners, u64s)
progresses = st.builds(Progress, u64s, segments, segment_bits, steps)

messages = st.one_of(
    pings, ping_reqs, acks, nacks, gossips, digests, sync_states,
    votes, prepares, promises, accepts, joins, progresses,
)  # fmt: skip

MESSAGE_STRATEGIES = {
    Ping: pings,
    PingReq: ping_reqs,
    Ack: acks,
    Nack: nacks,
    Gossip: gossips,
    Digest: digests,
    SyncState: sync_states,
    Vote: votes,
    Prepare: prepares,
    Promise: promises,
    Accept: accepts,
    Join: joins,
    Progress: progresses,
}
"""One strategy per message class, for tests parametrised over every message type."""
