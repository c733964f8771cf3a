"""Regrouping within one configuration after a transient collective failure (issue #7): the
pure decisions. The trainer (:mod:`.recovery`) does the waiting and the I/O.

A collective can fail although every member lives (a gloo connection reset by a network blip,
an operation that errored on one rank). Then no configuration change ever comes: nobody is
suspected, so the agreement has nothing to decide. Theory of operation:

1. A rank whose collective failed abandons its group (its peers' operations fail in turn: the
   dropped references close the connections, docs/design.md section 13) and waits
   :func:`regroup_wait_s` for a configuration with another rank map. If one comes, a member
   really failed: the normal recovery (the plan's ``resume_step``) runs.
2. Otherwise the ranks form the group of the *same* configuration again, attempt
   :func:`next_attempt`, under a store and key namespace of their own
   (:func:`torchpass_p2p.collective.rendezvous.store_prefix`). Every rank of a group knows the
   attempt of the last group it tried to form (formed or not), and all ranks of one group tried
   the same ones: a rank whose collective failed later than another's (the failure reaches it
   through the closing connections, or at its next operation) still picks the same number, and
   the first to arrive waits in the rendezvous (bounded by the store's timeout).
3. In the new group the ranks all-gather ``(applied, reduced)`` (state after ``applied``
   steps; the averaged gradient of step ``reduced`` held, or -1) and :func:`regroup_resume`
   fixes the resume step: the highest ``applied``. Those one step behind roll forward with the
   gradient they hold (:func:`~.commit.resolve`, exactly as for a plan's ``resume_step``). The
   step loop's vote follows the whole all-reduce, so a rank applied step ``k`` only once
   every rank held its averaged gradient; a DDP session's vote leaves with the last bucket,
   so a rank one step behind may lack it, and it is handed over first (the trainer's
   ``_fill_gap``, :mod:`torchpass_p2p.ddp.handoff`). Then the fingerprints are all-gathered
   as on the normal path.
4. A configuration change during any of this wins (the waits are watched); a regroup that
   fails (a member did not come: it may really be dead) is retried after another wait, at most
   :data:`MAX_REGROUPS` times per failure; then only a configuration change helps
   (:data:`GIVE_UP_S`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torchpass_p2p.core.params import Params

__all__ = ["GIVE_UP_S", "MAX_REGROUPS", "next_attempt", "regroup_resume", "regroup_wait_s"]

MAX_REGROUPS = 3
"""Regroups tried after one collective failure before waiting only for a configuration change:
one for the transient fault itself, two more for a second blip during the regroup. A member
that is really dead makes each of them fail within the store timeout, or a configuration
change supersedes them first."""
GIVE_UP_S = 600.0
"""Last resort (the default of the trainer's ``give_up_s``): after a collective failure that
neither a regroup nor a configuration change repaired for this long, counted from the failure,
the member stops (:class:`~.loop.Removed`); a spare that heard no majority, or was not admitted,
for this long stops too (:class:`~.loop.Stopped`), and so does a member fenced this long that
counts fewer than a majority of its configuration reachable (the job stops). Long enough for a
partition to heal, a paused member to wake or an operator to add a spare; short enough that a
dead job frees its machines."""


def regroup_wait_s(params: Params) -> float:
    """How long a rank whose collective failed waits for a configuration change before it
    regroups in the same configuration: the longest a member's death normally takes to be
    decided, so that a real death is handled by the normal path and a regroup runs only when
    nobody failed. The sum of

    * detection: ``failed_rounds_to_alert`` probe rounds (the first may end after
      ``round_timeout_s``, the others a ``probe_interval_s`` apart);
    * conviction: ``max(refutation_window_s, suspicion_max_s)``, the suspicion timeout with a
      single accuser (with every observer accusing it is ``suspicion_min_s``);
    * the decision: ``cut_settle_s``, then a fast round, or a classic round after
      ``classic_timeout_s`` plus up to ``classic_spread_s``.

    With the default parameters: 1.5 + 6.0 + 3.1 = 10.6 s (a crash is decided in about 3.5 s,
    ``Params.vote_push_interval_s``). A transient fault costs this much idle time; a shorter
    wait would only start regroups that a pending change then supersedes.
    """
    detect = params.round_timeout_s + (params.failed_rounds_to_alert - 1) * params.probe_interval_s
    convict = max(params.refutation_window_s, params.suspicion_max_s)
    decide = params.cut_settle_s + params.classic_timeout_s + params.classic_spread_s
    return detect + convict + decide


def next_attempt(last_tried: int) -> int:
    """The attempt of the next regroup of a configuration's group, given the attempt of the
    last group of it this rank tried to form (0: the configuration's first group), whether it
    formed or not. Every rank of the group tried the same attempts, so all pick the same."""
    if last_tried < 0:
        raise ValueError(f"attempt must be >= 0, got {last_tried}")
    return last_tried + 1


def regroup_resume(progress: Sequence[tuple[int, int]]) -> tuple[int | None, str]:
    """``(resume_step, reason)`` from every rank's ``(applied, reduced)`` in rank order
    (``reduced`` -1: no averaged gradient held). The resume step is the highest ``applied``;
    a rank below it must be exactly one step behind and hold that step's gradient (it rolls
    forward). Otherwise ``(None, reason)``: some rank cannot reach the resume step by itself
    (cannot happen once the gap is filled, module docstring). Pure; deterministic reason."""
    if not progress:
        return None, "no ranks"
    resume = max(applied for applied, _ in progress)
    behind = [r for r, (applied, _) in enumerate(progress) if applied != resume]
    stuck = [r for r in behind if progress[r] != (resume - 1, resume - 1)]
    if stuck:
        return None, (f"ranks {stuck} cannot reach step {resume}: "
                      + ", ".join(f"rank {r} applied {progress[r][0]} holds gradient "
                                  f"{progress[r][1]}" for r in stuck))
    if behind:
        return resume, (f"step {resume - 1} was committed: ranks {behind} roll forward, "
                        f"resume at {resume}")
    return resume, f"nobody committed step {resume}: every rank redoes it"
