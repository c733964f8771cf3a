"""The plan (docs/design.md sections 5 and 6): exact replacements on a hand-built job, and
properties.

The job: 8 ranks (members 0x10..0x17) and 3 spares (0x20..0x22).

    ranks 0-3  node-a, NVLink domain nvl-a
    ranks 4-7  node-b, nvl-b
    spare 0x20 node-c, nvl-c   (near nobody)
    spare 0x21 node-b, nvl-b   (same host as ranks 4-7)
    spare 0x22 node-d, nvl-a   (another host in ranks 0-3's NVLink domain)

The configuration is number 7, so the plan's tie-break is ``mix_pair(8, member)``; the first test
pins the order it gives, which the exact values below follow.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpass_p2p.core.configuration import VACANT, Configuration
from torchpass_p2p.core.hashing import mix_pair
from torchpass_p2p.core.messages import Cut, Joiner, Topology, format_member_id
from torchpass_p2p.core.plan import Plan, Policy, next_configuration, with_resume_step

from .strategies import member_ids

A = Topology("node-a", "nvl-a")
B = Topology("node-b", "nvl-b")
FAR = Topology("node-c", "nvl-c")
NEAR_A = Topology("node-d", "nvl-a")

RANKS = tuple(range(0x10, 0x18))
SPARES = (0x20, 0x21, 0x22)
TOPOLOGY = {**{m: (A if r < 4 else B) for r, m in enumerate(RANKS)},
            0x20: FAR, 0x21: B, 0x22: NEAR_A}
JOB = Configuration(7, RANKS, SPARES, {m: ("10.0.0.1", 9000 + m) for m in RANKS + SPARES},
                    observers=4, topology=TOPOLOGY)


def fmt(*members: int) -> str:
    return " ".join(format_member_id(m) for m in members)


def test_hash_order_assumed_by_this_module() -> None:
    def by_hash(ms: tuple[int, ...]) -> list[int]:
        return sorted(ms, key=lambda m: mix_pair(8, m))

    assert by_hash(RANKS) == [0x16, 0x14, 0x15, 0x12, 0x17, 0x10, 0x13, 0x11]
    assert by_hash(SPARES) == [0x20, 0x22, 0x21]


def test_one_removal_takes_the_same_host_spare() -> None:
    new, plan, reason = next_configuration(JOB, Cut(removed=(0x15,)), policy=Policy.WAIT)
    assert reason == (f"config 7 -> 8; removed {fmt(0x15)}; rank 5 <- {fmt(0x21)} (same host); "
                      "continue")
    assert plan == Plan(
        previous_config_id=7, config_id=8, removed=(0x15,), joined=(),
        assignments=((5, 0x21),), vacant=(), action="continue", renumbered=(), world_size=8,
        # Same host as the spare first (ranks 6, 4, 7 in hash order), then node-a in hash order.
        sources=((5, (0x16, 0x14, 0x17, 0x12, 0x10, 0x13, 0x11)),),
        resume_step=None,
    )
    assert new == Configuration(
        8, (0x10, 0x11, 0x12, 0x13, 0x14, 0x21, 0x16, 0x17), (0x20, 0x22),
        {m: a for m, a in JOB.addresses.items() if m != 0x15}, observers=4,
        topology={m: t for m, t in TOPOLOGY.items() if m != 0x15},
    )
    assert new.role_of(0x21) == "rank" and new.rank_of(0x21) == 5
    assert new.role_of(0x15) is None


def test_same_domain_spare_when_no_spare_shares_the_host() -> None:
    new, plan, reason = next_configuration(JOB, Cut(removed=(0x11,)), policy=Policy.WAIT)
    assert plan.assignments == ((1, 0x22),)
    assert reason.endswith(f"rank 1 <- {fmt(0x22)} (same domain); continue")
    # Sources: the spare's NVLink domain (node-a's ranks) first, then node-b's.
    assert plan.sources == ((1, (0x12, 0x10, 0x13, 0x16, 0x14, 0x15, 0x17)),)
    assert new.spares == (0x20, 0x21)


def test_two_removals_pair_greedily_in_rank_order() -> None:
    _, plan, reason = next_configuration(JOB, Cut(removed=(0x15, 0x14)), policy=Policy.WAIT)
    # Rank 4 takes node-b's spare; rank 5 then has only far spares: 0x20 wins the hash.
    assert plan.assignments == ((4, 0x21), (5, 0x20))
    assert reason == (f"config 7 -> 8; removed {fmt(0x14, 0x15)}; rank 4 <- {fmt(0x21)} "
                      f"(same host); rank 5 <- {fmt(0x20)} (other); continue")
    assert plan.sources == ((4, (0x16, 0x17, 0x12, 0x10, 0x13, 0x11)),
                            (5, (0x16, 0x12, 0x17, 0x10, 0x13, 0x11)))


FOUR_GONE = Cut(removed=(0x11, 0x12, 0x15, 0x16))
FOUR_GONE_PAIRS = (f"rank 1 <- {fmt(0x22)} (same domain); rank 2 <- {fmt(0x20)} (other); "
                   f"rank 5 <- {fmt(0x21)} (same host)")


def test_no_spare_left_wait_keeps_the_rank_vacant() -> None:
    new, plan, reason = next_configuration(JOB, FOUR_GONE, policy=Policy.WAIT)
    assert reason == (f"config 7 -> 8; removed {fmt(0x11, 0x12, 0x15, 0x16)}; {FOUR_GONE_PAIRS}; "
                      "wait: ranks [6] vacant, no spare left")
    assert (plan.action, plan.vacant, plan.world_size) == ("wait", (6,), 8)
    assert plan.assignments == ((1, 0x22), (2, 0x20), (5, 0x21))
    assert new.ranks == (0x10, 0x22, 0x20, 0x13, 0x14, 0x21, VACANT, 0x17)
    assert new.spares == ()
    assert new.vacant_ranks == (6,)


def test_no_spare_left_shrink_renumbers_survivors() -> None:
    new, plan, reason = next_configuration(JOB, FOUR_GONE, policy=Policy.SHRINK)
    assert reason.endswith(f"{FOUR_GONE_PAIRS}; shrink: dropped ranks [6], world size 8 -> 7")
    assert plan.action == "continue"
    assert plan.renumbered == ((0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (7, 6))
    assert (plan.world_size, plan.vacant) == (7, ())
    assert new.ranks == (0x10, 0x22, 0x20, 0x13, 0x14, 0x21, 0x17)
    assert new.rank_of(0x17) == 6


def test_shrink_renumbers_assignments_and_sources() -> None:
    # Ranks 1 and 2 vacate with one spare left: rank 1 is filled, rank 2 dropped, 3.. move down.
    job = Configuration(0, RANKS, (0x22,), topology={m: TOPOLOGY[m] for m in RANKS + (0x22,)})
    new, plan, _ = next_configuration(job, Cut(removed=(0x11, 0x12)), policy="shrink")
    assert plan.assignments == ((1, 0x22),)
    assert plan.renumbered == ((0, 0), (1, 1), (3, 2), (4, 3), (5, 4), (6, 5), (7, 6))
    assert new.ranks == (0x10, 0x22, 0x13, 0x14, 0x15, 0x16, 0x17)
    assert [rank for rank, _ in plan.sources] == [1]


def test_no_spare_left_stop_promotes_nobody() -> None:
    new, plan, reason = next_configuration(JOB, FOUR_GONE, policy=Policy.STOP)
    assert reason == (f"config 7 -> 8; removed {fmt(0x11, 0x12, 0x15, 0x16)}; "
                      "stop: no spare left for ranks [6]")
    assert (plan.action, plan.assignments, plan.sources) == ("stop", (), ())
    assert plan.vacant == (1, 2, 5, 6)
    assert new.ranks == (0x10, VACANT, VACANT, 0x13, 0x14, VACANT, VACANT, 0x17)
    assert new.spares == SPARES


@pytest.mark.parametrize("policy", list(Policy))
def test_removing_every_rank_holder_stops(policy: Policy) -> None:
    new, plan, reason = next_configuration(JOB, Cut(removed=RANKS), policy=policy)
    assert reason.endswith("stop: state of ranks [0, 1, 2, 3, 4, 5, 6, 7] lost, "
                           "no surviving replica")
    assert (plan.action, plan.assignments, plan.vacant) == ("stop", (), tuple(range(8)))
    assert new.members == SPARES


def test_joiners_are_used_after_existing_spares() -> None:
    joiners = (Joiner(0x31, "node-b", 7001, B), Joiner(0x30, "node-a", 7000, A))
    new, plan, reason = next_configuration(JOB, Cut(FOUR_GONE.removed, joiners),
                                           policy=Policy.WAIT)
    # Rank 1 (node-a) takes the existing same-domain spare, not the same-host joiner 0x30; the
    # existing spares go first, then rank 6 (node-b) takes the node-b joiner.
    assert plan.assignments == ((1, 0x22), (2, 0x20), (5, 0x21), (6, 0x31))
    assert plan.joined == (0x30, 0x31)
    assert reason.endswith(f"joined {fmt(0x30, 0x31)}; {FOUR_GONE_PAIRS}; "
                           f"rank 6 <- {fmt(0x31)} (same host, joiner); continue")
    assert new.spares == (0x30,)
    assert new.addresses[0x30] == ("node-a", 7000)
    assert new.topology_of(0x30) == A


def test_joiners_go_to_the_end_of_the_pool_in_id_order() -> None:
    joiners = (Joiner(0x41, "h", 1), Joiner(0x40, "h", 2))
    new, plan, reason = next_configuration(JOB, Cut(joined=joiners), policy=Policy.WAIT)
    assert new.spares == (0x20, 0x21, 0x22, 0x40, 0x41)
    assert (plan.joined, plan.assignments, plan.action) == ((0x40, 0x41), (), "continue")
    assert reason == f"config 7 -> 8; joined {fmt(0x40, 0x41)}; continue"


def test_strangers_and_present_joiners_are_ignored_and_counted() -> None:
    cut = Cut(removed=(0x11, 0x99), joined=(Joiner(0x20, "x", 1), Joiner(0x30, "node-a", 1, A),
                                            Joiner(0x30, "node-a", 2, A), Joiner(0x99, "y", 1)))
    new, plan, reason = next_configuration(JOB, cut, policy=Policy.WAIT)
    assert (plan.removed, plan.joined) == ((0x11,), (0x30,))
    assert reason == (f"config 7 -> 8; removed {fmt(0x11)}; ignored 1 removal(s) of non-members; "
                      f"joined {fmt(0x30)}; ignored 3 joiner(s) already present; "
                      f"rank 1 <- {fmt(0x22)} (same domain); continue")
    assert new.addresses[0x30] == ("node-a", 1)  # the duplicate with the lower port wins
    assert 0x99 not in new


def test_empty_cut_only_advances_the_config_id() -> None:
    new, plan, reason = next_configuration(JOB, Cut(), policy=Policy.STOP)
    assert reason == "config 7 -> 8; continue"
    assert plan.action == "continue"
    assert (new.config_id, new.ranks, new.spares, new.topology) == (8, RANKS, SPARES, TOPOLOGY)


def test_a_joiner_fills_a_rank_left_vacant_under_wait() -> None:
    waiting = Configuration(3, (0x10, VACANT, 0x12), (), topology={0x10: A})
    new, plan, reason = next_configuration(waiting, Cut(joined=(Joiner(0x50, "node-a", 1, A),)),
                                           policy=Policy.WAIT)
    # The vacant rank's previous holder is gone from the configuration, so no affinity.
    assert reason.endswith(f"rank 1 <- {fmt(0x50)} (other, joiner); continue")
    assert new.ranks == (0x10, 0x50, 0x12)
    assert plan.sources == ((1, (0x10, 0x12)),)  # 0x10 shares the joiner's host


def test_a_vacancy_with_nobody_to_fill_it_keeps_waiting() -> None:
    waiting = Configuration(3, (0x10, VACANT), ())
    _, plan, reason = next_configuration(waiting, Cut(), policy=Policy.WAIT)
    assert (plan.action, plan.vacant) == ("wait", (1,))
    assert reason == "config 3 -> 4; wait: ranks [1] vacant, no spare left"


def test_sharded_sources_are_the_same_shard_only() -> None:
    def shard_of(rank: int) -> int:
        return rank % 2  # two shards; ranks 1, 3, 5, 7 hold replicas of shard 1

    _, plan, _ = next_configuration(JOB, Cut(removed=(0x15,)), policy=Policy.WAIT,
                                    shard_of=shard_of)
    assert plan.sources == ((5, (0x17, 0x13, 0x11)),)  # node-b's 0x17 first, then by hash


def test_sharded_job_stops_when_a_shard_has_no_replica_left() -> None:
    _, plan, reason = next_configuration(JOB, Cut(removed=(0x11, 0x13, 0x15, 0x17)),
                                         policy=Policy.WAIT, shard_of=lambda r: r % 2)
    assert plan.action == "stop"
    assert reason.endswith("stop: state of ranks [1, 3, 5, 7] lost, no surviving replica")


def test_unknown_policy_is_local_misuse() -> None:
    with pytest.raises(ValueError, match="unknown policy 'retry'"):
        next_configuration(JOB, Cut(), policy="retry")


def test_plan_rejects_an_unknown_action() -> None:
    with pytest.raises(ValueError, match="unknown plan action 'pause'"):
        Plan(0, 1, (), (), (), (), "pause", (), 0, ())  # type: ignore[arg-type]


# --- the plan's hash -------------------------------------------------------------------------


def test_plan_hash_is_stable_and_identical_for_identical_inputs() -> None:
    first = next_configuration(JOB, Cut(removed=(0x15,)), policy=Policy.WAIT)[1]
    again = next_configuration(JOB, Cut(removed=(0x15,)), policy=Policy.WAIT)[1]
    assert first is not again and first.hash == again.hash
    # Golden: the encoding is a contract between machines. If this changes on purpose, change
    # plan._HASH_PERSON too.
    assert first.hash == 0x24AC0A861BA682B3


def test_plan_hash_covers_every_field() -> None:
    base = next_configuration(JOB, Cut(removed=(0x15,)), policy=Policy.WAIT)[1]
    changes: dict[str, Any] = {
        "previous_config_id": 6, "config_id": 9, "removed": (0x15, 0x16), "joined": (0x30,),
        "assignments": ((5, 0x20),), "vacant": (5,), "action": "wait", "renumbered": ((7, 6),),
        "world_size": 7, "sources": ((5, (0x16,)),), "resume_step": 0,
    }
    assert set(changes) == {f.name for f in fields(Plan)}
    hashes = {base.hash} | {replace(base, **{name: v}).hash for name, v in changes.items()}
    assert len(hashes) == len(changes) + 1
    assert all(0 <= h < 1 << 64 for h in hashes)


def test_plan_hash_is_unambiguous_across_neighbouring_fields() -> None:
    base = next_configuration(JOB, Cut(), policy=Policy.WAIT)[1]
    assert replace(base, removed=(1,), joined=(2,)).hash != replace(base, removed=(1, 2)).hash
    assert replace(base, resume_step=None).hash != replace(base, resume_step=0).hash
    nested, flat = ((1, (2,)),), ((1, ()), (2, ()))
    assert replace(base, sources=nested).hash != replace(base, sources=flat).hash


# --- resume step -----------------------------------------------------------------------------


@pytest.mark.parametrize(("max_committed", "resume"), [(-1, 0), (0, 1), (41, 42)])
def test_with_resume_step(max_committed: int, resume: int) -> None:
    plan = next_configuration(JOB, Cut(removed=(0x15,)), policy=Policy.WAIT)[1]
    fixed = with_resume_step(plan, max_committed)
    assert fixed.resume_step == resume
    assert replace(fixed, resume_step=None) == plan
    assert fixed.hash != plan.hash
    assert with_resume_step(fixed, max_committed) == fixed  # idempotent


def test_with_resume_step_misuse() -> None:
    plan = next_configuration(JOB, Cut(), policy=Policy.WAIT)[1]
    with pytest.raises(ValueError, match=">= -1"):
        with_resume_step(plan, -2)
    with pytest.raises(ValueError, match="already resumes at step 5, not 8"):
        with_resume_step(with_resume_step(plan, 4), 7)


# --- properties ------------------------------------------------------------------------------

topologies = st.builds(Topology, st.sampled_from(["", "h0", "h1", "h2"]),
                       st.sampled_from(["", "d0", "d1"]))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Configuration, Cut, Cut, Policy, int | None]:
    """A configuration, a cut, the same cut with its tuples permuted, a policy, a shard count."""
    ids = draw(st.lists(member_ids, min_size=2, max_size=16, unique=True))
    n_ranks = draw(st.integers(1, len(ids)))
    ranks: list[int | None] = list(ids[:n_ranks])
    for r in range(n_ranks):
        if draw(st.booleans()) and draw(st.booleans()):
            ranks[r] = VACANT
    members = [m for m in ranks if m is not None] + ids[n_ranks:]
    config = Configuration(draw(st.integers(0, 1 << 40)), ranks, ids[n_ranks:],
                           topology={m: draw(topologies) for m in members})
    strangers = draw(st.lists(member_ids.filter(lambda m: m not in ids), max_size=3))
    removed = strangers + (draw(st.lists(st.sampled_from(members), max_size=len(members)))
                           if members else [])
    joined_ids = draw(st.lists(member_ids, max_size=4)) + draw(st.lists(st.sampled_from(ids),
                                                                       max_size=2))
    joined = [Joiner(m, "h", draw(st.integers(0, 3)), draw(topologies)) for m in joined_ids]
    cut = Cut(tuple(sorted(removed)), tuple(sorted(joined, key=lambda j: (j.member, j.port))))
    shuffled = Cut(tuple(draw(st.permutations(removed))), tuple(draw(st.permutations(joined))))
    shards = draw(st.one_of(st.none(), st.integers(1, 3)))
    return config, cut, shuffled, draw(st.sampled_from(list(Policy))), shards


@given(scenarios())
def test_plan_is_deterministic_and_safe(
    scenario: tuple[Configuration, Cut, Cut, Policy, int | None],
) -> None:
    config, cut, shuffled, policy, shards = scenario
    shard_of = None if shards is None else (lambda r: r % shards)
    new, plan, reason = next_configuration(config, cut, policy=policy, shard_of=shard_of)

    # Independent of the order of cut.removed and cut.joined.
    assert next_configuration(config, shuffled, policy=policy, shard_of=shard_of) == (
        new, plan, reason)

    holders = [m for m in new.ranks if m is not None]
    assert len(set(holders)) == len(holders), "a member holds two ranks"
    assert not set(holders) & set(new.spares), "a spare also holds a rank"
    assert len({r for r, _ in plan.assignments}) == len(plan.assignments)
    assert len({m for _, m in plan.assignments}) == len(plan.assignments)
    for rank, member in plan.assignments:
        assert new.ranks[rank] == member
        assert member in config.spares or member in plan.joined

    gone = {m for m in cut.removed if m in config}
    assert plan.removed == tuple(sorted(gone))
    assert set(new.members) == (set(config.members) - gone) | set(plan.joined)
    assert new.config_id == plan.config_id == config.config_id + 1
    assert plan.world_size == new.world_size
    assert plan.vacant == new.vacant_ranks

    renumber = dict(plan.renumbered) or {r: r for r in range(config.world_size)}
    for r, m in enumerate(config.ranks):
        if m is not None and m not in gone:
            assert new.rank_of(m) == renumber[r], "a survivor lost or changed its place"
    survivors = {m for m in config.ranks if m is not None and m not in gone}
    assert [r for r, _ in plan.sources] == [r for r, _ in plan.assignments]
    for _, sources in plan.sources:
        assert sources and set(sources) <= survivors and len(set(sources)) == len(sources)

    if plan.action == "stop":
        assert plan.assignments == ()
    elif plan.action == "wait":
        assert policy is Policy.WAIT and plan.vacant
    else:
        assert plan.vacant == ()
    if policy is not Policy.SHRINK:
        assert plan.renumbered == () and new.world_size == config.world_size
