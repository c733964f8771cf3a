"""The plan: what a decided configuration change implies (docs/design.md sections 5 and 6).

Theory of operation. Agreement (Rapid, Suresh et al., ATC 2018, section 4.2) decides one
:class:`~torchpass_p2p.core.messages.Cut` per ``config_id``: members removed, spares admitted.
Every member then calls :func:`next_configuration` on the same (configuration, cut, policy) and
gets the same next configuration and :class:`Plan` without talking to anyone (docs/design.md section
5: "the replacement is a pure function of the decided configuration and cut, computed identically by
everyone"). Nothing here reads a clock, draws randomness or iterates a set or dict in an order
that could differ between machines: every input is sorted first, and ties are broken by
:func:`~torchpass_p2p.core.hashing.mix_pair`, which every machine computes identically.

The rules, in the order they are applied:

1. Removed members leave their rank (now vacant) or the spare pool. A removal naming someone who
   is not in the configuration is ignored (counted in the reason); so is a joiner who is already
   a member, is named twice, or is also named as removed.
2. Joiners are admitted as spares at the end of the pool, in member-id order (docs/design.md section
5:
   "a recovered or new process joins as a spare").
3. If a vacant rank's state has no surviving replica (data parallel: every rank holder was
   removed; sharded: every holder of that shard), nobody can hand it to a spare: ``stop``.
4. Vacant ranks, ascending, are paired greedily with eligible spares (not removed), each used at
   most once. For each rank the spares are ordered by: existing spares before joiners, then
   topology affinity to the rank's previous holder (same host, then same NVLink domain, then
   others), then ``mix_pair(config_id, member)`` with the new ``config_id``, then member id.
5. Ranks left without a spare follow the :class:`Policy`: ``wait`` keeps them :data:`VACANT`
   (action ``"wait"``), ``shrink`` drops them and renumbers the survivors densely in their old
   order (action ``"continue"``), ``stop`` promotes nobody (action ``"stop"``).
6. Each promoted spare's state sources are the surviving rank holders that hold a replica of
   that rank's state, ordered by affinity to the spare, then ``mix_pair(config_id, member)``.
7. ``resume_step`` stays None until the votes' committed steps are known; then
   :func:`with_resume_step` fixes it by the roll-forward-or-redo rule (docs/design.md section 6).

The model is torchft's lighthouse ``quorum_compute``: sorted inputs, a pure function, and a
reason string that tests assert on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Final, Literal, TypeAlias

from .configuration import VACANT, Address, Configuration
from .hashing import mix_pair
from .messages import Cut, Joiner, MemberId, Topology, format_member_id

Action: TypeAlias = Literal["continue", "wait", "stop"]
"""What the job does in the new configuration: train, wait for a spare, or stop cleanly."""

ACTIONS: Final = ("continue", "wait", "stop")

_UNKNOWN: Final = Topology()
_AFFINITY_NAMES: Final = ("same host", "same domain", "other")

_HASH_PERSON: Final = b"torchpass-plan-1"
"""blake2b personalisation (16 bytes): names the encoding below; change it if the encoding
changes, so hashes of the old and new encodings never collide by construction."""


class Policy(StrEnum):
    """What to do with a vacant rank when no spare is left (docs/design.md section 5)."""

    WAIT = "wait"
    """Keep the rank vacant and pause training until a joiner takes it."""
    SHRINK = "shrink"
    """Drop the rank; survivors are renumbered densely (only where the job allows it)."""
    STOP = "stop"
    """Stop the job cleanly."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What a decided configuration change implies (docs/design.md section 2, "plan").

    Every tuple is sorted as stated, so equal decisions are equal values with equal :attr:`hash`.
    Ranks in ``assignments``, ``vacant`` and ``sources`` are ranks of the new configuration
    (they differ from the old ones only after a shrink, see ``renumbered``).

    Attributes:
        previous_config_id: the configuration the cut was decided in.
        config_id: the new configuration's number (``previous_config_id + 1``).
        removed: members actually removed, ascending id.
        joined: members actually admitted as spares, ascending id.
        assignments: ``(rank, spare)`` for every promoted spare, ascending rank.
        vacant: ranks nobody holds in the new configuration (action ``"wait"`` or ``"stop"``),
            ascending.
        action: ``"continue"``, ``"wait"`` or ``"stop"``.
        renumbered: after a shrink, ``(old rank, new rank)`` for every rank kept, ascending;
            empty when no rank was dropped.
        world_size: the new configuration's number of ranks, vacant ones included.
        sources: ``(rank, members)`` for every assigned rank, ascending rank: the survivors that
            hold a replica of that rank's state, best source first.
        resume_step: the step every member of the new configuration resumes at; None until
            :func:`with_resume_step` fixed it.

    Raises:
        ValueError: ``action`` is not one of :data:`ACTIONS`.
    """

    previous_config_id: int
    config_id: int
    removed: tuple[MemberId, ...]
    joined: tuple[MemberId, ...]
    assignments: tuple[tuple[int, MemberId], ...]
    vacant: tuple[int, ...]
    action: Action
    renumbered: tuple[tuple[int, int], ...]
    world_size: int
    sources: tuple[tuple[int, tuple[MemberId, ...]], ...]
    resume_step: int | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown plan action {self.action!r}; expected one of {ACTIONS}")

    @property
    def hash(self) -> int:
        """A 64-bit hash of every field, equal on every machine and Python version.

        blake2b (8-byte digest) over a hand-built, unambiguous encoding of ``(field name, value)``
        pairs in declaration order; not ``pickle`` or ``repr``, whose bytes are not a contract.
        """
        out = bytearray()
        _encode(tuple((f.name, getattr(self, f.name)) for f in fields(self)), out)
        digest = hashlib.blake2b(bytes(out), digest_size=8, person=_HASH_PERSON).digest()
        return int.from_bytes(digest, "big")


def _encode(value: object, out: bytearray) -> None:
    """Append a canonical, prefix-free encoding of ``value`` (None, int, str or nested tuples).

    Each value is a one-byte tag, then for ints a 4-byte length and the minimal big-endian two's
    complement bytes, for strings a 4-byte length and UTF-8, for tuples a 4-byte count and the
    elements.
    """
    if value is None:
        out += b"N"
    elif isinstance(value, bool):  # a bool is an int; no plan field is one
        raise TypeError("booleans have no canonical plan encoding")
    elif isinstance(value, int):
        body = value.to_bytes(value.bit_length() // 8 + 1, "big", signed=True)
        out += b"I" + len(body).to_bytes(4, "big") + body
    elif isinstance(value, str):
        body = str(value).encode()
        out += b"S" + len(body).to_bytes(4, "big") + body
    elif isinstance(value, tuple):
        out += b"T" + len(value).to_bytes(4, "big")
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"no canonical plan encoding for {type(value).__name__}")


def _affinity(candidate: Topology, anchor: Topology) -> int:
    """0 same host, 1 same NVLink domain, 2 otherwise; unknown (empty) names match nothing."""
    if candidate.host and candidate.host == anchor.host:
        return 0
    if candidate.domain and candidate.domain == anchor.domain:
        return 1
    return 2


def _joiner_key(j: Joiner) -> tuple[int, str, int, str, str]:
    return (j.member, j.host, j.port, j.topology.host, j.topology.domain)


def next_configuration(
    config: Configuration,
    cut: Cut,
    *,
    policy: Policy | str,
    shard_of: Callable[[int], int] | None = None,
) -> tuple[Configuration, Plan, str]:
    """The configuration and plan that follow ``config`` once ``cut`` is decided.

    A pure function (docs/design.md section 5; rules 1-6 of this module's docstring): every member
    computes the same result from the same arguments, whatever the order of ``cut.removed`` and
    ``cut.joined``.

    Args:
        config: the configuration the cut was decided in.
        cut: the decided change; its tuples may come in any order.
        policy: what to do with a vacant rank when no spare is left (a :class:`Policy` or its
            value).
        shard_of: maps a rank of ``config`` to the shard of the training state it holds; ranks
            with equal values hold replicas of the same state. None means pure data parallel:
            every rank holds the whole state.

    Returns:
        ``(next configuration, plan, reason)``: the configuration numbered
        ``config.config_id + 1``, the :class:`Plan` (``resume_step`` None), and a one-line,
        deterministic explanation.

    Raises:
        ValueError: ``policy`` is not a :class:`Policy` value (local misuse), or a joiner's id
            is outside uint64.
    """
    try:
        policy = Policy(policy)
    except ValueError:
        raise ValueError(
            f"unknown policy {policy!r}; expected one of {[p.value for p in Policy]}"
        ) from None
    new_id = config.config_id + 1

    # Rule 1: removals, sorted; strangers ignored.
    asked = sorted(set(cut.removed))
    removed = tuple(m for m in asked if m in config)
    gone = set(removed)
    ignored_removals = len(asked) - len(removed)

    # Rule 2: joiners, in id order; members, duplicates and the removed ignored.
    asked_set = set(asked)
    joiners: dict[MemberId, Joiner] = {}
    for j in sorted(cut.joined, key=_joiner_key):
        if j.member not in config and j.member not in joiners and j.member not in asked_set:
            joiners[j.member] = j
    ignored_joiners = len(cut.joined) - len(joiners)
    joined = tuple(joiners)

    # Who holds what after the removals (ranks of ``config``).
    holders = config.ranks
    vacant = [r for r, m in enumerate(holders) if m is None or m in gone]
    survivors = [(r, m) for r, m in enumerate(holders) if m is not None and m not in gone]
    groups: dict[int, list[MemberId]] = {}
    for r, m in survivors:
        groups.setdefault(0 if shard_of is None else shard_of(r), []).append(m)

    def replicas(rank: int) -> list[MemberId]:
        return groups.get(0 if shard_of is None else shard_of(rank), [])

    # Rule 3: state with no surviving replica cannot be handed on.
    lost = [r for r in vacant if not replicas(r)]

    # Rule 4: greedy pairing.
    pool = [s for s in config.spares if s not in gone] + list(joined)
    where: dict[MemberId, Topology] = {s: config.topology_of(s) for s in config.spares}
    where.update((m, j.topology) for m, j in joiners.items())
    paired: list[tuple[int, MemberId]] = []
    notes: list[str] = []
    unfilled: list[int] = []
    if not lost:
        taken: set[MemberId] = set()
        for r in vacant:
            previous = holders[r]
            anchor = _UNKNOWN if previous is None else config.topology_of(previous)
            best: tuple[int, int, int, MemberId] | None = None
            for s in pool:
                if s in taken:
                    continue
                key = (int(s in joiners), _affinity(where[s], anchor), mix_pair(new_id, s), s)
                if best is None or key < best:
                    best = key
            if best is None:
                unfilled.append(r)
                continue
            taken.add(best[3])
            paired.append((r, best[3]))
            joiner = ", joiner" if best[0] else ""
            notes.append(f"rank {r} <- {format_member_id(best[3])} "
                         f"({_AFFINITY_NAMES[best[1]]}{joiner})")

    # Rule 5: the policy for ranks no spare took.
    action: Action = "continue"
    keep = list(range(len(holders)))
    if lost:
        action = "stop"
        outcome = f"stop: state of ranks {lost} lost, no surviving replica"
    elif not unfilled:
        outcome = "continue"
    elif policy is Policy.WAIT:
        action = "wait"
        outcome = f"wait: ranks {unfilled} vacant, no spare left"
    elif policy is Policy.SHRINK:
        dropped = set(unfilled)
        keep = [r for r in keep if r not in dropped]
        outcome = f"shrink: dropped ranks {unfilled}, world size {len(holders)} -> {len(keep)}"
    else:
        action = "stop"
        outcome = f"stop: no spare left for ranks {unfilled}"
    if action == "stop":  # nobody is promoted into a job that stops
        paired, notes = [], []

    # The next configuration.
    slots: list[MemberId | None] = [VACANT if m in gone else m for m in holders]
    for r, s in paired:
        slots[r] = s
    promoted = {s for _, s in paired}
    new_rank = {old: new for new, old in enumerate(keep)}
    addresses: dict[MemberId, Address] = {
        m: a for m, a in config.addresses.items() if m not in gone
    }
    topology = {m: t for m, t in config.topology.items() if m not in gone}
    for m, j in joiners.items():
        addresses[m] = (j.host, j.port)
        topology[m] = j.topology
    following = Configuration(
        new_id,
        [slots[r] for r in keep],
        [s for s in pool if s not in promoted],
        addresses,
        observers=config.observers,
        topology=topology,
    )

    # Rule 6: state sources for every promoted spare.
    sources = []
    for r, s in paired:
        anchor = where[s]
        ranked = sorted(
            (_affinity(config.topology_of(m), anchor), mix_pair(new_id, m), m)
            for m in replicas(r)
        )
        sources.append((new_rank[r], tuple(m for _, _, m in ranked)))

    plan = Plan(
        previous_config_id=config.config_id,
        config_id=new_id,
        removed=removed,
        joined=joined,
        assignments=tuple((new_rank[r], s) for r, s in paired),
        vacant=following.vacant_ranks,
        action=action,
        renumbered=tuple(new_rank.items()) if len(keep) < len(holders) else (),
        world_size=following.world_size,
        sources=tuple(sources),
    )

    parts = [f"config {config.config_id} -> {new_id}"]
    if removed:
        parts.append("removed " + " ".join(format_member_id(m) for m in removed))
    if ignored_removals:
        parts.append(f"ignored {ignored_removals} removal(s) of non-members")
    if joined:
        parts.append("joined " + " ".join(format_member_id(m) for m in joined))
    if ignored_joiners:
        parts.append(f"ignored {ignored_joiners} joiner(s) already present")
    parts += notes
    parts.append(outcome)
    return following, plan, "; ".join(parts)


def with_resume_step(plan: Plan, max_committed_step: int) -> Plan:
    """``plan`` with ``resume_step = max_committed_step + 1`` (docs/design.md section 6).

    ``max_committed_step`` is the highest step any member of the new configuration reported as
    committed in its vote (``Vote.max_step``; -1 when none has committed any step). Why the
    next step, and why that is safe, for the step ``k`` in flight when the failure struck:

    * Each step runs (1) forward/backward with the gradient all-reduce, (2) a tiny commit
      all-reduce, (3) the optimizer step.
    * If any survivor completed (2) for step ``k``, every rank had finished (1), so every
      survivor holds the full averaged gradient of step ``k``: those that had not applied it yet
      apply (3) now, and everyone resumes at ``k + 1`` (roll forward). ``max_committed_step`` is
      then ``k``.
    * If no survivor completed (2), nobody applied step ``k`` and ``max_committed_step`` is
      ``k - 1``: step ``k`` is redone with the same batch (redo).
    * Never roll back: no step that any member committed is lost, and every member of the new
      configuration holds bitwise-identical state at ``resume_step``.

    Args:
        plan: the plan from :func:`next_configuration`.
        max_committed_step: the highest committed step among the voters, ``>= -1``.

    Returns:
        A copy of ``plan`` with ``resume_step`` set (steps are numbered from 0).

    Raises:
        ValueError: ``max_committed_step < -1``, or ``plan`` already has a different
            ``resume_step`` (it is fixed once per configuration).
    """
    if max_committed_step < -1:
        raise ValueError(f"max_committed_step must be >= -1, got {max_committed_step}")
    step = max_committed_step + 1
    if plan.resume_step is not None and plan.resume_step != step:
        raise ValueError(
            f"plan {plan.config_id} already resumes at step {plan.resume_step}, not {step}"
        )
    return replace(plan, resume_step=step)
