"""Following the agent: its configuration changes as the trainer takes them in, the waits for
a rank, a change or a lease, and the last resort of a member nothing else moves.

Every wait here has a deadline of the form "no progress for T": a member fenced for
``give_up_s`` without a break (also inside a group operation its peers never finish), a spare
not admitted or fenced that long, or a rank whose failed collective no change repaired within
``give_up_s`` of the failure, stops. What each kind of change means (docs/design.md sections 5
and 8):

* Changes that leave the rank map as it is (a spare joined or left) cost nothing: the group
  stays; only the services are announced under the new ``config_id``. A group is named after
  the first configuration of its rank map (``Change.group_id``), so that members that entered
  different configurations of one rank map (one was handed a change the other never was) meet
  in the same rendezvous.
* A member removed from the configuration (or fenced and then removed) stops at once with
  :class:`~.ends.Removed`; it never writes to the new group.
* *No majority left.* A member fenced for ``give_up_s`` (the last resort, also counted during
  a group operation its peers never finish) that believes fewer than a majority of its
  configuration reachable stops with :class:`~.ends.Stopped` and one line: how many of the
  configuration are reachable, how many a majority is, and that the job stops (resume it from
  the last checkpoint): no change can be decided without a majority, not even the admission
  of the processes restarted in the dead ones' place. One that still counts a majority
  reachable is the one cut off: :class:`~.ends.Removed`, as before.
* A drained member (``torchpass-p2p drain``, a GPU fault, the hang watchdog: its agent has
  announced that it leaves) still holds its rank until the agreement decides the configuration
  without it, so it keeps training: leaving at once would fail its peers' collectives like a
  crash. The decision removes it and it stops with :class:`~.ends.Drained`, a clean end; the
  spare taking its rank fetches the state from the survivors, who hold every step it
  committed.

Invariants: ``_latest`` is set only here, by ``_take`` (to a newer configuration only) and by
a spare's first rank; the only change acted on here is one that keeps the rank map (``_poll``
keeps the group and re-announces the services); one that alters the rank map is reported
(``_poll`` or ``_watch`` returns True, or :class:`Superseded` is raised) and acted on by the
recovery (:mod:`.recovery`), never here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torchpass_p2p.agent import Change, TrainingAgent
from torchpass_p2p.collective import Superseded
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.messages import format_member_id
from torchpass_p2p.launch.outcome import JOB_STOPS, no_majority_left

from .ends import Drained, Removed, Stopped
from .member import MemberBase

__all__ = ["SLICE_S", "WAIT_SLICE_S", "ChangeFollower"]

log = logging.getLogger(__name__)

SLICE_S = 0.05
"""Seconds between checks of the agent while waiting for a configuration."""
WAIT_SLICE_S = 1.0
"""How often a waiting spare looks whether it is fenced (it wakes at once for a rank)."""


class ChangeFollower(MemberBase):
    """The layer that follows the agent (module docstring).

    Args:
        agent: this process's started agent.
        give_up_s: the last resort, in seconds (:class:`~.loop.Trainer`).
        **base: :class:`~.member.MemberBase`'s arguments.
    """

    def __init__(self, agent: TrainingAgent, *, give_up_s: float, **base: Any) -> None:
        super().__init__(agent, **base)
        self.give_up_s = give_up_s
        self._draining = False  # the "draining" event is logged once
        self._fenced_since: float | None = None  # fenced without a break since (_watch)
        agent.on_change(self._wake_group)

    def _announce(self, config_id: int, *, serving: bool = True) -> None:
        """Where this member serves its state for ``config_id``: the state exchange's
        (:meth:`~.exchange.StateExchange._announce`); :meth:`_poll` calls it for a change
        that keeps the rank map."""
        raise NotImplementedError

    def _started_as_spare(self) -> bool:
        """Started as a spare (or joining: a late spare), judged by the configuration it was
        started in, not by its role now: a slow start may find it already holding a dead
        rank's place in a later configuration; it takes the spare's way in all the same."""
        started_in = self.agent.settings.configuration
        return started_in is None or self.agent.member_id not in started_in.ranks

    def _started_rank(self) -> tuple[Configuration, int]:
        """The configuration a member started as a rank was started in, and its rank there.

        Raises:
            RuntimeError: this member was started as a spare (:meth:`_started_as_spare`).
        """
        started_in = self.agent.settings.configuration
        rank = None if started_in is None else started_in.rank_of(self.me)
        if started_in is None or rank is None:
            raise RuntimeError("this member was started as a spare, not in a rank")
        return started_in, rank

    def _await_first_rank(self) -> Change:
        """A spare's wait for its first rank (:meth:`_wait_for_rank`); returns that change."""
        self.log("spare_waiting", config_id=self.agent.config_id)
        self._holds_state = False
        change = self._wait_for_rank()
        self._latest = change
        return change

    def _wait_for_rank(self) -> Change:
        """A spare's wait for a rank, as long as it takes while the job lives. A spare that
        for ``give_up_s`` has reached no majority of its configuration (fenced: the job lost
        its majority, or this host its network) or has not been admitted (still joining:
        nobody decides its join) stops with :class:`Stopped`, and its launcher respawns
        nobody for it."""
        agent, stuck_since, was_fenced = self.agent, None, False
        while True:
            try:
                return agent.wait_for_rank(timeout_s=WAIT_SLICE_S)
            except TimeoutError:
                pass
            except Exception as exc:  # removed: a drained spare ends as Drained, not respawned
                raise self._out(f"no rank for this spare: {exc}") from None
            now, fenced = time.monotonic(), agent.fenced
            if fenced and not was_fenced:
                self.log("fenced", step=self.step, config_id=agent.config_id)
            was_fenced = fenced
            if not fenced and agent.role != "joining":
                stuck_since = None
            elif stuck_since is None:
                stuck_since = now
            elif now - stuck_since > self.give_up_s:
                lost = self._no_majority_left() if fenced else None
                why = str(lost) if lost is not None else (
                    f"no majority of configuration {agent.config_id} reachable" if fenced
                    else "not admitted") + f" for {self.give_up_s:g} s"
                self.log("gave_up", config_id=agent.config_id, reason=why)
                raise lost if lost is not None else Stopped(why)

    def _drain_changes(self) -> None:
        while (change := self.agent.next_change(0)) is not None:
            self._take(change)

    def _take(self, change: Change) -> None:
        if self._latest is None or change.configuration.config_id > \
                self._latest.configuration.config_id:
            self._latest = change

    def _changes_ranks(self) -> bool:
        latest = self._latest
        return (latest is not None and latest.configuration.config_id > self.config_id
                and tuple(latest.configuration.ranks) != self._ranks)

    def _poll(self) -> bool:
        """Take in the agent's changes; True when the newest one changes the rank map (the
        group must be rebuilt). Raises :class:`Removed` if this member was removed,
        ``RuntimeError`` if its agent failed.

        A draining member (role ``leaving``) trains on: it holds its rank until the decision
        that removes it (module docstring)."""
        self._drain_changes()
        role = self.agent.role
        if role == "failed":  # it stopped as if crashed; its log says why
            raise RuntimeError("this member's agent failed: the member is being replaced")
        draining = self.agent.draining
        if role == "removed" or (role == "leaving" and not draining):
            raise self._out(f"this member is {role}")
        if draining and not self._draining:
            self._draining = True
            self.log("draining", step=self.step, config_id=self.config_id, role=role)
        if self._changes_ranks():
            return True
        latest = self._latest
        if latest is not None and latest.configuration.config_id > self.config_id:
            self._log_change(latest, same_ranks=True)
            # Same ranks: keep the group (a spare still without the state serves none).
            self._announce(latest.configuration.config_id, serving=self._holds_state)
            self.config_id = latest.configuration.config_id
        return False

    def _out(self, why: str) -> Removed:
        """The end of a member out of the configuration: :class:`Drained` when it asked for it."""
        return Drained(f"{why} (drained)") if self.agent.draining else Removed(why)

    def _watch(self) -> bool:
        """Between the wait slices of a group operation: True when a newer configuration is
        due. Raises what :meth:`_gave_up` gives once this member has been fenced for
        ``give_up_s`` without a break (peers paused or dead with no majority left: nothing
        else would end the operation before the backend's 30-minute timeout)."""
        if self._poll():
            return True
        now = time.monotonic()
        if not self.agent.fenced:
            self._fenced_since = None
        elif self._fenced_since is None:
            self._fenced_since = now
        elif now - self._fenced_since > self.give_up_s:
            raise self._gave_up(f"fenced for {self.give_up_s:g} s in a collective operation")
        return False

    def _no_majority_left(self) -> Stopped | None:
        """The end of a fenced member that believes fewer than a majority of its configuration
        reachable: no change can be decided unless enough of the others come back, so the job
        stops; its one line says how many are left and how many a majority is
        (:func:`~torchpass_p2p.launch.outcome.no_majority_left`, the launcher's wording).
        None when it reaches a majority by count (it is the one cut off)."""
        agent = self.agent
        members, reachable = len(agent.configuration), agent.reachable
        if reachable >= agent.majority:
            return None
        return Stopped(f"{no_majority_left(agent.config_id, reachable, members, 'reachable')}; "
                       f"fenced for {self.give_up_s:g} s, {JOB_STOPS}")

    def _gave_up(self, why: str) -> Removed | Stopped:
        """The last resort after ``give_up_s``: :class:`Stopped` with the counts when no
        majority is left (:meth:`_no_majority_left`), else :class:`Removed` with ``why`` (cut
        off, or a collective failure nothing repaired: the others go on without it)."""
        lost = self._no_majority_left() if self.agent.fenced else None
        if lost is not None:
            self.log("gave_up", config_id=self.agent.config_id, reason=str(lost))
            return lost
        return Removed(why)

    def _wake_group(self, _change: Change) -> None:
        """On the agent's thread, for every ready change: the group's operation in flight
        runs :meth:`_watch` at once (a survivor stuck with a paused peer learns of the
        change that replaces it then, not up to a wait slice later)."""
        group = self.group
        if group is not None:
            group.wake()

    def _await_change(self, within_s: float | None = None, *,
                      since: float | None = None) -> Change | None:
        """Block until the agent delivers a configuration with another rank map and return
        it; None when ``within_s`` seconds passed first. Raise :class:`Removed` once
        ``give_up_s`` passed since ``since`` (``time.monotonic()`` of the failure that started
        the wait; default: now), the last resort."""
        waited = time.monotonic()
        give_up_at = (waited if since is None else since) + self.give_up_s
        fenced = False
        while not self._poll():
            if self.agent.fenced and not fenced:  # say why nothing moves (once per wait)
                fenced = True
                self.log("fenced", step=self.step, config_id=self.config_id)
                log.warning("member %s: fenced at step %d (no majority of configuration %d "
                            "reachable); waiting for a decided configuration", self.log.member,
                            self.step, self.config_id)
            # Block on the agent's next change, not a sleep: the decision that ends this wait
            # is in the recovery's critical path (a 50 ms sleep cost 25 ms per fault).
            if (change := self.agent.next_change(SLICE_S)) is not None:
                self._take(change)
            if within_s is not None and time.monotonic() - waited > within_s:
                return None
            if time.monotonic() > give_up_at:
                raise self._gave_up(f"no new configuration for {self.give_up_s:g} s after a "
                                    "collective failure")
        return self._latest

    def _await_lease(self) -> None:
        """After a vetoed commit or final barrier: wait while this member is fenced. A member on
        the minority side of a partition stays fenced until the change that removes it
        (:class:`Superseded`); one that was merely paused (woken from SIGSTOP into a change
        decided at that moment, before its first probe was answered) regains its lease within
        a probe round, and the step (or barrier) is redone. Waiting for a change there would
        wait for one that never comes. The group stays: no operation failed. Raises
        :class:`Removed` after ``give_up_s``."""
        since = time.monotonic()
        while self.agent.fenced:
            if self._poll():
                raise Superseded
            if time.monotonic() - since > self.give_up_s:
                raise self._gave_up(f"fenced for {self.give_up_s:g} s after a vetoed commit")
            time.sleep(SLICE_S)

    def _log_change(self, change: Change, *, same_ranks: bool = False) -> None:
        """The ``change`` event: the plan this member follows, with its hash (every member of
        the configuration must log the same one). ``same_ranks``: the group is kept."""
        alerts: list[float] = []
        try:
            alerts = [e.at for e in self.agent.recent_events() if e.accuses]
        except Exception:  # noqa: BLE001 - the events are only for the timeline
            pass
        plan = change.plan
        self.log("change", config_id=change.configuration.config_id,
                 plan_hash=f"{plan.hash:016x}", decided_at=change.decided_at,
                 ready_at=change.ready_at,
                 resume_step=plan.resume_step, removed=[format_member_id(m) for m in plan.removed],
                 joined=[format_member_id(m) for m in plan.joined],
                 assignments=[[r, format_member_id(m)] for r, m in plan.assignments],
                 same_ranks=same_ranks, alerts_at=alerts)
