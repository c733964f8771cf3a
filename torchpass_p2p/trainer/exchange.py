"""The state exchange: serving this member's training state to the members that lack it, fetching
it from those that hold it, and checking that every member of a group holds the same one.

A member that holds the resume state of a configuration publishes it (host memory is not
copied: the member waits while it is served) and announces its transfer server for that
configuration; a member that lacks it (a promoted spare) fetches it from the plan's sources
over TCP before the group forms (:mod:`.service`), or, with ``state_transport="pg"`` (the
default over NCCL), over the new group itself once it has formed (:mod:`.group_transfer`:
NVLink or RDMA on GPUs). Every member then all-gathers the 32-byte state fingerprints, and the
state is withdrawn from the server (docs/design.md section 7, docs/transfer.md).

The transferred state is rank-independent: model, optimizer, scheduler, ``extra`` objects, the
step and the data position (``step * world_size`` batches). Generators are not part of it: they
are a function of ``(seed, rank, step)``.

Invariants: the state is served only while this member waits at a configuration's entry (from
:meth:`StateExchange._publish` to :meth:`StateExchange._withdraw`), so nothing is trained on
while it is served; a member without the state (``_holds_state`` False) announces that it
serves none, so its peers' lookups fail at once; a restored state is trained on only once its
own fingerprint equals the sources'.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from torchpass_p2p.agent import NotServed, TrainingAgent
from torchpass_p2p.collective import ManagedGroup, Superseded
from torchpass_p2p.core.messages import format_member_id
from torchpass_p2p.transfer import FetchResult, Snapshot, TransferError, TransferKeys

from .changes import ChangeFollower
from .ends import STEERED, Diverged, Stopped
from .service import StateService

__all__ = ["FETCH_ATTEMPTS", "LOOKUP_GRACE_S", "LOOKUP_SLICE_S", "LOOKUP_TIMEOUT_S",
           "TRANSFER_SERVICE", "StateExchange"]

TRANSFER_SERVICE = "transfer"
LOOKUP_TIMEOUT_S = 30.0
"""How long a spare waits for a source to announce its transfer server for the new
configuration (a survivor announces it once it holds the resume state: milliseconds after the
decision, plus any roll-forward)."""
LOOKUP_GRACE_S = 0.5
"""Once one source has announced, how much longer the others are waited for before the fetch
starts from those found. Survivors announce within milliseconds of each other; a source that
died after the decision, or a spare promoted earlier that is still fetching the state itself
(the plan names every rank holder), never does: waiting for every named source would stall
such a recovery for the full ``LOOKUP_TIMEOUT_S``. Ours."""
LOOKUP_SLICE_S = 0.25
"""Lookups run in rounds of this many seconds, with a look at the agent for a newer
configuration between rounds (each request is held by the source until it registers, so a
round costs no latency)."""
FETCH_ATTEMPTS = 5


class StateExchange(ChangeFollower):
    """The layer that moves and checks the training state (module docstring).

    Args:
        agent: this process's started agent.
        state_transport: ``"tcp"``, ``"pg"`` or ``"auto"`` (:class:`~.loop.Trainer`).
        backend: ``"gloo"`` or ``"nccl"``.
        **base: the lower layers' arguments (:class:`~.changes.ChangeFollower`).

    Raises:
        ValueError: ``state_transport`` is none of those.
    """

    def __init__(self, agent: TrainingAgent, *, state_transport: str, backend: str,
                 **base: Any) -> None:
        if state_transport not in ("auto", "tcp", "pg"):
            raise ValueError(f"state_transport {state_transport!r}: 'auto', 'tcp' or 'pg'")
        super().__init__(agent, backend=backend, **base)
        self.state_over_group = (state_transport == "pg"
                                 or (state_transport == "auto" and backend == "nccl"))
        transfer_keys = TransferKeys.from_keyring(agent.settings.keyring)
        # A reloaded key file reaches the state transfer too (docs/running.md, "Keys").
        agent.add_key_listener(transfer_keys.rekey)
        self.service = StateService(
            transfer_keys, self._known_config_id,
            host=agent.address[0],
            on_served=self._served if self.faults.serving or self.history is not None
            else None)
        # Its refusals (bad input, floods) are drops of this member's: counted where its
        # others are, in the agent's /metrics and /status.
        agent.add_counter_source("transfer_refused", self.service.refusals)

    def _capture(self) -> Snapshot:
        """The state at ``self.step`` (no copy of host memory)."""
        return Snapshot.capture(self.objects, self.step, self._metadata())

    def _fingerprint(self) -> bytes:
        """The fingerprint of the state at ``self.step`` (32 bytes)."""
        return self._capture().fingerprint()

    def _metadata(self) -> dict[str, Any]:
        world = len(self._ranks)
        return {"seed": self.seed, "world_size": world, "data_position": self.step * world}

    def _publish(self, snap: Snapshot | None = None) -> Snapshot:
        """Serve the state at ``self.step``: host tensors as they are in memory, GPU tensors
        copied to the host (a copy after every step cost 30 ms per 300 MB here, and on a GPU
        the whole state). Only at a configuration's entry, where this member waits for the
        group: every member that needs the state fetches before it joins, so nothing is
        trained on while it is served; :meth:`_withdraw` once everyone has joined. ``snap``:
        that state, already captured (a fetch's check captured it)."""
        snap = snap if snap is not None else self._capture()
        self.service.publish(snap)
        return snap

    def _withdraw(self) -> None:
        """Stop serving: every member of the group holds the state, and training is about
        to change the memory the snapshot refers to."""
        self.service.publish(None)

    def _announce(self, config_id: int, *, serving: bool = True) -> None:
        """Tell peers where this member serves its state for ``config_id``, or (``serving``
        False: it holds none yet) that it serves none there: their lookups fail at once."""
        self.agent.register_service(TRANSFER_SERVICE, config_id,
                                    self.service.port if serving else 0)

    def _known_config_id(self) -> int:
        latest = self._latest
        return max(self.config_id, latest.configuration.config_id if latest else -1, 0)

    def _served(self, step: int, served_bytes: int, total_bytes: int) -> None:
        """The transfer server sent a chunk (its thread): the status page's progress, and a
        ``serve`` fault may fire."""
        if self.history is not None:
            self.history.transfer_progress("sending", step, served_bytes, total_bytes)
        if not self.faults.serving:
            return
        ranks = self._ranks
        self.faults.served(step, served_bytes, total_bytes,
                           ranks.index(self.me) if self.me in ranks else None)

    def _check_fingerprints(self, group: ManagedGroup, mine: bytes, what: str,
                            resume: int) -> None:
        """All-gather the 32-byte state fingerprints over ``group``; unless every member's
        equals ``mine``, abandon it and raise :class:`Diverged` (naming ``what`` and the ranks
        that hold each state): a replica was steered by state that does not move to a spare,
        and no recovery makes the states one again."""
        prints = [bytes(p.tolist()) for p in group.allgather(
            torch.frombuffer(bytearray(mine), dtype=torch.uint8), watch=self._watch)]
        if set(prints) != {mine}:
            group.abandon()
            by: dict[bytes, list[int]] = {}
            for r, p in enumerate(prints):
                by.setdefault(p, []).append(r)
            held = "; ".join(f"ranks {ranks} {p.hex()[:16]}" for p, ranks in by.items())
            self.log("diverged", step=resume, config_id=group.config_id, what=what, states=held)
            raise Diverged(f"{what}: the ranks' states differ at step {resume} ({held}): "
                           f"{STEERED}")

    def _sources_disagree(self, exc: TransferError, config_id: int, step: int) -> None:
        """Raise :class:`Diverged` if ``exc`` says the state's sources hold different states
        at ``step`` (no fingerprint held by most of them): sources holding another step refuse
        to serve, so the replicas drifted apart, and every retry would meet the same sources
        while the job waits for this member up to its give-up time. Else return."""
        if exc.reason != "sources_disagree":
            return
        self.log("diverged", step=step, config_id=config_id, what="fetch", reason=str(exc))
        raise Diverged(f"configuration {config_id}: the sources of the state at step {step} "
                       f"hold different states ({exc}): {STEERED}") from None

    def _fetch(self, members: tuple[int, ...], config_id: int, step: int) -> Snapshot:
        if not members:
            raise RuntimeError(f"no state source for configuration {config_id}")
        t0 = time.monotonic()
        self.log("fetch_started", config_id=config_id, step=step, sources=len(members))
        last: Exception | None = None
        for _ in range(FETCH_ATTEMPTS):
            found, withheld = self._find_sources(members, config_id)
            addresses = list(found)
            if not addresses and withheld == set(members):
                # Every source is a spare promoted before it received the state (their
                # sources died meanwhile): nobody can ever hand it on. Waiting for the next
                # change would wait, up to give_up_s, for one that no failure brings.
                self.log("job_stopped", config_id=config_id, step=self.step,
                         resume_step=step, reason="no member holds the state")
                raise Stopped(f"configuration {config_id}: no member holds the state (its "
                              "holders are spares promoted before they received it)")
            if not addresses:
                raise TransferError("no_sources", f"no source announced state for {config_id}")
            try:
                result = self.service.fetch(addresses, config_id, step=step, into=self.objects,
                                            on_progress=self._fetch_progress(config_id, step))
                break
            except TransferError as exc:
                self._sources_disagree(exc, config_id, step)
                # Kept without its traceback, whose frames would hold this attempt's locals
                # through the next attempt (the client clears its own; this covers the rest).
                last = exc.with_traceback(None)
                self.log("fetch_retry", config_id=config_id, error=str(exc)[:160])
                if self._poll():
                    raise Superseded from None
                time.sleep(0.2)
        else:
            assert last is not None
            raise last
        return self._restored(result, config_id, time.monotonic() - t0, len(addresses),
                              {format_member_id(found[a]): n
                               for a, n in result.bytes_by_source.items()})

    def _fetch_progress(self, config_id: int, step: int
                        ) -> Callable[[int, int], None] | None:
        """The status page's view of a fetch as chunks arrive (the service's thread)."""
        history = self.history
        if history is None:
            return None
        return lambda received, total: history.transfer_progress(
            "receiving", step, received, total, config_id)

    def _find_sources(self, members: tuple[int, ...], config_id: int
                      ) -> tuple[dict[Any, int], set[int]]:
        """Where ``members`` serve the state of ``config_id``: ``{(host, port): member}``, and
        the members that announced they serve none there (they hold no state). Waits for
        every other member to announce, but at most :data:`LOOKUP_GRACE_S` after the first
        did, and at most :data:`LOOKUP_TIMEOUT_S` in all. Raises :class:`Superseded` when a
        newer configuration changes the ranks meanwhile."""

        def lookup(member: int, timeout_s: float) -> tuple[str, int] | None:
            try:
                return self.agent.lookup_service(member, TRANSFER_SERVICE, config_id,
                                                 timeout_s=timeout_s)
            except NotServed:
                withheld.add(member)
                return None
            except Exception:  # noqa: BLE001 - not (yet) announced: asked again, or skipped
                return None

        found: dict[Any, int] = {}
        withheld: set[int] = set()
        pending = list(members)
        give_up_at = time.monotonic() + LOOKUP_TIMEOUT_S
        with ThreadPoolExecutor(len(members)) as pool:
            while pending:
                round_s = min(LOOKUP_SLICE_S, give_up_at - time.monotonic())
                if round_s <= 0:
                    break
                answers = list(pool.map(lookup, pending, [round_s] * len(pending)))
                for member, address in zip(pending, answers, strict=True):
                    if address is not None:
                        found[address] = member
                pending = [m for m, a in zip(pending, answers, strict=True)
                           if a is None and m not in withheld]
                if found and pending:
                    give_up_at = min(give_up_at, time.monotonic() + LOOKUP_GRACE_S)
                self._drain_changes()  # not _poll: nothing here may act on a same-rank change
                if self._changes_ranks():
                    raise Superseded
        return found, withheld

    def _restored_over_group(self, result: FetchResult, config_id: int, total_s: float,
                             sources: tuple[int, ...]) -> Snapshot:
        """:meth:`_restored` for a state received over the group from ranks ``sources``."""
        return self._restored(result, config_id, total_s, len(sources),
                              {f"rank {s}": n for s, n in result.bytes_by_source.items()},
                              over_group=True)

    def _restored(self, result: FetchResult, config_id: int, total_s: float, sources: int,
                  served_by: dict[str, int], **details: Any) -> Snapshot:
        """Load a fetched state into the live objects and check its fingerprint; returns the
        restored state as captured for that check. Raises ``RuntimeError`` if the state does
        not load into the live objects or the restored state's fingerprint differs from the
        sources'."""
        try:
            got_step, _metadata = result.snapshot.restore(self.objects)
        except (KeyError, ValueError) as e:
            raise RuntimeError(f"the received state does not load into this process's objects "
                               f"({e}): do all members build the same model, optimizer and "
                               "scheduler?") from e
        self.step = got_step
        self._reduced = None
        mine = self._capture()
        own = mine.fingerprint()
        self.log("state_fetched", config_id=config_id, step=got_step, seconds=result.seconds,
                 bytes=result.snapshot.total_bytes, sources=sources,
                 fingerprint=result.fingerprint.hex(), restored_fingerprint=own.hex(),
                 failures=dict(result.failures), total_s=total_s, served_by=served_by,
                 refetched_chunks=result.refetched_chunks, **details)
        if own != result.fingerprint:
            raise RuntimeError("the restored state's fingerprint differs from the sources'")
        self._holds_state = True
        if got_step > 0:
            # It holds every step up to got_step - 1 as committed: its vote must say so, or a
            # plan made after the last other holder died would resume at step 0 (a replaced
            # spare has committed nothing itself), below the only state left.
            self.agent.report_progress(got_step - 1)
        return mine
