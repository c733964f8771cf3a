"""The roll-forward-or-redo rule (docs/design.md section 6), as a pure function.

A member of the new configuration holds the state after ``applied`` steps (it runs step
``applied`` next) and maybe the averaged gradient of step ``reduced`` (its gradient all-reduce
of that step completed, its optimizer step not applied yet). The plan says every member resumes
at ``resume_step`` (the highest step any voter committed, plus one). Then:

====================================  =================  =======================================
condition                             action             why
====================================  =================  =======================================
``resume == applied``                 ``redo``           nobody committed step ``applied``: drop
                                                         any averaged gradient, redo the step
                                                         with the same batch
``resume == applied + 1`` and         ``roll_forward``   someone committed step ``applied``: so
``reduced == applied``                                   every rank finished its all-reduce;
                                                         apply the held gradient
otherwise                             ``fetch``          this member cannot reach the resume
                                                         state by itself (a spare always
                                                         fetches; a DDP survivor inside step
                                                         ``applied`` is handed its gradient,
                                                         :mod:`torchpass_p2p.ddp.handoff`)
====================================  =================  =======================================
"""

from __future__ import annotations

from typing import Literal

__all__ = ["Action", "resolve"]

Action = Literal["redo", "roll_forward", "fetch"]


def resolve(applied: int, reduced: int | None, resume: int) -> tuple[Action, str]:
    """``(action, reason)`` for a member at ``applied`` holding the averaged gradient of step
    ``reduced`` (None: none) told to resume at ``resume`` (module docstring). Pure; the reason
    is one deterministic line."""
    if resume == applied:
        held = "" if reduced is None else f", dropping the averaged gradient of step {reduced}"
        return "redo", f"nobody committed step {applied}: redo it{held}"
    if resume == applied + 1 and reduced == applied:
        return "roll_forward", f"step {applied} was committed: apply its averaged gradient"
    return "fetch", (f"state after {applied} steps (gradient of step {reduced}) cannot reach "
                     f"resume step {resume}")
