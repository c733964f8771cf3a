"""Data-parallel training through faults (issue #7 part 2): the step loop with the commit rule
(``loop``), built on layers that follow the agent (``changes``), move the state (``exchange``)
and recover (``recovery``) over shared state (``member``), with its ends (``ends``); the rule
itself (``commit``), regrouping after a transient collective failure (``regroup``), per-step
seeding (``seeding``), the transfer service (``service``), fault injection (``faults``) and
the timeline (``events``)."""

from .commit import resolve
from .faults import Fault, FaultInjector, parse_faults
from .loop import Drained, Removed, Stopped, Trainer, TrainResult
from .seeding import seed_step, step_generator, step_seed

__all__ = [
    "Drained", "Fault", "FaultInjector", "Removed", "Stopped", "TrainResult", "Trainer",
    "parse_faults", "resolve", "seed_step", "step_generator", "step_seed",
]
