"""Pure decisions of the supervisor: keep running, finish, stop; and the launcher's exit code.

Theory of operation. The launcher cannot see which member holds which rank once the agents have
replaced one (that is agreed among the agents, docs/design.md section 5), so it reasons from exits
only:

- *Roles are known* while this launcher wrote configuration 0 and every exit so far was a clean
  exit (code 0) of a process started as a rank: no rank was vacated, so no spare was promoted,
  and the processes started as ranks still hold exactly the ranks. (A rank paused past its
  lease is replaced without an exit; the spare that took its rank then exits 0 at the end,
  which ends this assumption.) Once all of them have exited (each with 0) the job is
  complete and every process still running started as a spare: **stop** them now (the
  supervisor first asks their agents, :mod:`.roles`: one that took a rank on another host
  gets the grace period).
- After a failure (any non-zero exit or death by signal), or when the children joined through
  seeds, any running process may hold a rank. The job is complete when some process exits 0 (a
  training script returns only when training is done); the others, which may be finishing the
  same last step, then get a grace period to exit on their own: **finish**, then stop. The
  supervisor ends that grace early once every process left is idle, as its agent's status page
  says (:mod:`.roles`).
- With no child left, the launcher is **done**.

Exit code (:func:`exit_code`): 0 when some process exited 0 and no process failed after the
first such exit (exits reaped together after the launcher itself was stopped have no known
order: a failure among them is not "after"), except processes the launcher itself signalled
while shutting down and members that exit with :data:`EXIT_REMOVED` (the agreement removed
them: a member paused past its lease may wake and learn it only after the others finished),
:data:`EXIT_DRAINED` or :data:`EXIT_STOPPED` (finished ranks go silent without leaving, so
spares that outnumber them may agree the job stopped); 128 + the signal number when a signal
stopped the launcher; :data:`EXIT_STOPPED` when, with no process exited 0, the job stopped
because it cannot go on (a member stopped it: a rank nobody can fill, or no majority of its
configuration left; or a majority of a configuration of the launcher's own children exited):
resume it from its last checkpoint, as the reason says; :data:`EXIT_KEY_REFUSED` when, with no
process exited 0, the cluster refused a child's key; 1 otherwise (every exit failed, or a
failure after completion). With no process exited 0, 1 also wins over :data:`EXIT_STOPPED`
when every process started as a rank failed with an ordinary error (:func:`script_failed`):
the script failed, and resuming it would fail the same way. Which of the two a timing gives
must not matter (a spare left alive may have been stopped for a lost majority, or not).
Known limitation: a rank drained on purpose that exits 0 while roles are known makes the
launcher believe its rank is finished; if every starting rank leaves that way, the spares that
took over get only the grace period (their agents say they hold ranks, but nothing says the job
is not complete).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from torchpass_p2p.core.agreement import classic_quorum
from torchpass_p2p.core.messages import MemberId, format_member_id

__all__ = ["EXIT_DRAINED", "EXIT_KEY_REFUSED", "EXIT_REMOVED", "EXIT_STOPPED", "JOB_STOPS",
           "ChildExit", "Verdict", "decide", "describe_exit", "exit_code", "is_error",
           "is_failure", "no_majority_left", "script_failed"]

EXIT_REMOVED = 3
"""What a member's script exits with once a decided configuration removed it
(:class:`torchpass_p2p.trainer.Removed`): it may come back only as a new spare."""
EXIT_DRAINED = 4
"""What a member's script exits with once the rank it asked to hand over was taken by a spare
(:class:`torchpass_p2p.trainer.Drained`: ``torchpass-p2p drain``, a GPU fault): a clean end,
which the launcher neither reports as evidence nor respawns (the host is being emptied)."""
EXIT_STOPPED = 5
"""What a member's script exits with once the job cannot go on
(:class:`torchpass_p2p.trainer.Stopped`): a decided configuration stops it (a vacant rank
nobody can fill, e.g. every holder of the state died at once; every member learns it from the
agreement itself), or a spare reached no majority for its give-up time. The launcher neither
reports nor respawns it; with no process exiting 0 the launch fails."""
EXIT_KEY_REFUSED = 6
"""What a process exits with once the cluster refused its key (:mod:`torchpass_p2p.agent.api`:
its key file is older or newer than the members'; ``docs/running.md``, "Keys"). A failure, so
the launcher reports it to the siblings, but never respawned: the same key file would be
refused again."""
JOB_STOPS = "the job stops: resume it from its last checkpoint"
"""What follows a reason the job cannot go on, in a member's last line and the launcher's."""


def no_majority_left(config_id: int, count: int, members: int, how: str) -> str:
    """``no majority of configuration C is left: X of its N members HOW and a majority is M``,
    the one wording of a lost majority: the launcher counts the members that exited (``how``
    ``"exited"``), a fenced member those it believes reachable (``"reachable"``: "1 of its 3
    members is reachable"). ``M`` is ``floor(N / 2) + 1``."""
    if how == "reachable":
        how = f"{'is' if count == 1 else 'are'} reachable"
    return (f"no majority of configuration {config_id} is left: {count} of its {members} "
            f"members {how} and a majority is {classic_quorum(members)}")


class Verdict(StrEnum):
    RUN = "run"
    """Keep supervising."""
    FINISH = "finish"
    """The job completed: give the running processes a grace period to exit, then stop them."""
    STOP = "stop"
    """The job completed and the running processes started as spares: stop them now, unless
    an agent says one holds a rank (it replaced a rank on another host): that one gets the
    grace period."""
    DONE = "done"
    """No process is left."""


@dataclass(frozen=True)
class ChildExit:
    """One process's end. ``returncode`` follows :mod:`subprocess`: ``-N`` is death by signal
    ``N``. ``by_launcher``: the launcher had signalled it (shutdown), so it is no failure.
    ``unordered``: reaped just after the launcher itself did not run for a while (SIGSTOP, a
    frozen host): when it happened relative to the other exits reaped then is unknown.
    ``name``: how the launcher's log names the process (``rank 0 (8d2c...)``); empty: its
    member id names it."""

    member_id: MemberId
    started_as_rank: bool
    returncode: int
    by_launcher: bool = False
    unordered: bool = False
    name: str = ""

    def label(self) -> str:
        return self.name or format_member_id(self.member_id)


def is_failure(returncode: int) -> bool:
    """A death the launcher reports to the siblings (and respawns for): anything but 0,
    :data:`EXIT_DRAINED` (a planned hand-over) and :data:`EXIT_STOPPED` (every member knows)."""
    return returncode not in (0, EXIT_DRAINED, EXIT_STOPPED)


def is_error(returncode: int) -> bool:
    """An ordinary error of the script: a positive exit code the trainer does not give a
    meaning (an uncaught exception exits 1). Death by a signal is no script error (a fault of
    the host, or a kill), nor are :data:`EXIT_REMOVED`, :data:`EXIT_DRAINED`,
    :data:`EXIT_STOPPED` and :data:`EXIT_KEY_REFUSED`."""
    return returncode > 0 and returncode not in (EXIT_REMOVED, EXIT_DRAINED, EXIT_STOPPED,
                                                 EXIT_KEY_REFUSED)


def script_failed(exits: Sequence[ChildExit]) -> str | None:
    """Why the script, not the job's processes, failed, or None: no process exited 0 and
    every process started as a rank among ``exits`` failed with an ordinary error
    (:func:`is_error`) before the launcher signalled it. Such a failure repeats at every
    resume or respawn (a bug in the script or its input): the reason names the first rank that
    failed, whose stderr shows the traceback, and never advises a resume."""
    ranks = [e for e in exits if e.started_as_rank]
    if (not ranks or any(e.returncode == 0 for e in exits)
            or not all(is_error(e.returncode) and not e.by_launcher for e in ranks)):
        return None
    first = ranks[0]
    return (f"the script failed: every rank exited with an error, {first.label()} first "
            f"({describe_exit(first.returncode)}): its stderr above shows why; fix the script "
            "(a resume would fail the same way)")


def describe_exit(returncode: int) -> str:
    """``exited with 3`` or ``exited with signal SIGKILL``: the evidence reason and log text."""
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"exited with signal {name}"


def decide(
    exits: Sequence[ChildExit], *, running: int, running_ranks: int, joining: bool
) -> tuple[Verdict, str]:
    """What to do after the exits so far (in the order they happened).

    ``running``: processes still running; ``running_ranks``: those of them started as ranks;
    ``joining``: the children joined through seeds (no configuration 0 from this launcher).
    """
    if running == 0:
        return Verdict.DONE, "no process is left"
    # A spare that exits 0 finished training in a rank: some rank changed hands without an
    # exit (a member paused past its lease and replaced, say).
    roles_known = not joining and all(e.returncode == 0 and e.started_as_rank for e in exits)
    if roles_known:
        if running_ranks == 0 and any(e.started_as_rank for e in exits):
            return Verdict.STOP, (f"every rank exited 0; {running} process(es) left, started "
                                  "as spare(s)")
        return Verdict.RUN, f"{running_ranks} rank(s) running"
    if any(e.returncode == 0 for e in exits):
        first = next(e for e in exits if e.returncode == 0)
        return Verdict.FINISH, (f"{format_member_id(first.member_id)} exited 0: job complete; "
                                f"{running} process(es) may still be finishing")
    return Verdict.RUN, f"{running} process(es) running, roles unknown after a failure"


def exit_code(exits: Sequence[ChildExit], *, stopped_by: int | None = None,
              gave_up: str | None = None, mismatch: str | None = None) -> tuple[int, str]:
    """The launcher's exit code and the reason (module docstring). ``stopped_by``: the signal
    number that stopped the launcher, if one did; ``gave_up``: why no majority of the
    configuration is left, if the launcher found it so (:func:`.roles.majority_lost`) or a
    member stopped the job saying so (:meth:`.roles.StatusView.no_majority`); ``mismatch``:
    why every replacement of a rank would be refused at its join (its script describes another
    job), if the launcher stopped the job for it: :data:`EXIT_STOPPED` with that reason alone,
    since resuming the same script would be refused the same way."""
    if stopped_by is not None:
        return 128 + stopped_by, f"stopped by {signal.Signals(stopped_by).name}"
    first = next((i for i, e in enumerate(exits) if e.returncode == 0), None)
    if first is None:
        failed = script_failed(exits)
        if failed is not None:
            return 1, failed
        if mismatch is not None:
            return EXIT_STOPPED, mismatch
        if gave_up is not None:
            return EXIT_STOPPED, f"{gave_up}; {JOB_STOPS}"
        if any(e.returncode == EXIT_STOPPED for e in exits):
            return EXIT_STOPPED, (
                "a member stopped the job: the agreement left a rank nobody can fill (every "
                "holder of its state is gone, or no spare is left under policy 'stop'), no "
                "majority of its configuration was left for its give-up time, or the ranks' "
                "states diverged (the members' lines say which); " + JOB_STOPS)
        if any(e.returncode == EXIT_KEY_REFUSED for e in exits):
            return EXIT_KEY_REFUSED, ("the cluster refused the key of this launcher's key file "
                                      "(docs/running.md, \"Keys\")")
        return 1, "no process exited 0"
    for e in exits[first + 1:]:
        if (e.returncode not in (0, EXIT_REMOVED, EXIT_DRAINED, EXIT_STOPPED)
                and not e.by_launcher and not (e.unordered and exits[first].unordered)):
            return 1, (f"{e.label()} {describe_exit(e.returncode)} after "
                       "the job completed")
    return 0, "job complete"
