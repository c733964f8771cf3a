"""How a member's training ends other than by finishing, as the exceptions the trainer raises,
and the exit code each end has.

The training API and scripts map them to exit codes with :func:`exit_code_for`, whose codes are
the launcher's (:mod:`torchpass_p2p.launch.outcome`): :class:`Removed` 3, :class:`Drained` 4 (a
clean end), :class:`Stopped` 5. :class:`Incomplete` never leaves the trainer: recovery waits for
the change that fills the vacant ranks. Once one of the first three is raised the member must not
touch a process group again.
"""

from __future__ import annotations

from torchpass_p2p.launch.outcome import EXIT_DRAINED, EXIT_REMOVED, EXIT_STOPPED

__all__ = ["EXIT_FAILED", "Diverged", "Drained", "Incomplete", "Removed", "Stopped",
           "exit_code_for"]

EXIT_FAILED = 1
"""What :func:`exit_code_for` gives any other exception: a failure, the code an uncaught
exception ends Python with; the launcher reports it and may respawn the member."""


class Removed(RuntimeError):
    """This member is no longer part of the training world (removed, or the agent stopped):
    stop at once and never touch a process group again. Scripts exit with code 3."""


class Incomplete(RuntimeError):
    """The configuration has vacant ranks (more ranks died than spares were left, under the
    ``wait`` policy): nobody trains in it; the members wait for the change that fills them
    (a spare joins, e.g. a process the launcher respawned with ``--respawn``)."""


class Stopped(RuntimeError):
    """The job cannot go on. Either the agreed plan stops it (action ``stop``,
    :mod:`torchpass_p2p.core.plan` rules 3 and 5): a vacant rank nobody can fill, because every
    holder of its state is gone (data parallel: every rank at once) or no spare is left under
    policy ``stop``; or no majority of the configuration is left (fenced for the trainer's
    ``give_up_s`` while it believes fewer than a majority of its configuration reachable: no
    change can be decided, not even the admission of a new process; the message says how
    many are left and how many a majority is); or a spare was not admitted, or cut off, for
    ``give_up_s``. No member trains again; resume from a checkpoint. Scripts exit with code
    5."""


class Diverged(Stopped):
    """The ranks' states are not the same where they must be (the final state; the optimizer
    steps and their hyperparameters between two commits; the sources of a spare's state): the
    script steered a replica by state that does not move to a spare. The result would be
    wrong: every rank that sees it stops (exit code 5) rather than finish."""


STEERED = ("a replica was steered by state that does not move to a spare, such as a counter of "
           "the script's own (docs/training.md, \"What moves to a spare\")")
"""The likely cause of :class:`Diverged`, as its one-line errors end."""


class Drained(Removed):
    """This member was removed because it asked to leave (a drain): its rank went to a spare as
    planned. A clean end, not a failure: scripts exit with code 4
    (:data:`~torchpass_p2p.launch.outcome.EXIT_DRAINED`), which the launcher never counts as
    a failure."""


def exit_code_for(exc: BaseException) -> int:
    """The exit code a member's process ends with after ``exc``: the launcher's table
    (:mod:`torchpass_p2p.launch.outcome`), which decides whether the launcher reports the
    member as failed and respawns it.

    - :class:`Drained`: ``EXIT_DRAINED`` (4), a clean end, never respawned;
    - any other :class:`Removed`: ``EXIT_REMOVED`` (3);
    - :class:`Stopped` (``JobMismatch`` too): ``EXIT_STOPPED`` (5), the job stops;
    - anything else: :data:`EXIT_FAILED` (1), a failure.

    :class:`Drained` is a :class:`Removed`: it is tested first, and must stay so.

    Args:
        exc: the exception that ended training.

    Returns:
        The exit code, an int in 0..255.
    """
    if isinstance(exc, Drained):
        return EXIT_DRAINED
    if isinstance(exc, Removed):
        return EXIT_REMOVED
    if isinstance(exc, Stopped):
        return EXIT_STOPPED
    return EXIT_FAILED
