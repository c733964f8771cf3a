"""``run_watched``: a state transfer over a configuration's group, given up when a newer
configuration comes. gloo cannot abort the transfer's waits, and it reports a dead peer often
only as a timeout; the interrupt closes the group's connections, so the transfer ends at once
here and at its peers instead of after its progress timeout (set to an hour here: a transfer
that was not interrupted fails the test by its pytest timeout)."""

from __future__ import annotations

import asyncio
import datetime
import threading

import pytest
import torch

from torchpass_p2p.collective import GroupSpec, ManagedGroup, Superseded
from torchpass_p2p.trainer.group_transfer import run_watched
from torchpass_p2p.transfer import Snapshot, TransferFailed
from torchpass_p2p.transfer.pg_transport import PgTransport
from torchpass_p2p.transfer.state_transport import TransferPlan

from ..collective.gloo_pair import gloo_pair

HOUR_S = 3600.0


def _groups() -> list[ManagedGroup]:
    pgs = gloo_pair(timeout_s=HOUR_S)
    return [ManagedGroup(pg, GroupSpec(5, r, 2, 1), "gloo") for r, pg in enumerate(pgs)]


class Removed(Exception):
    """What the trainer's watch raises once this member is out of the configuration."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["superseded", "watch_raises"])
def test_a_newer_configuration_ends_a_gloo_transfer_here_and_at_the_source(ending: str) -> None:
    receiver, source = _groups()
    plan = TransferPlan(sources=(1,), config_id=5, receiver=0, progress_timeout_s=HOUR_S)
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    into = Snapshot.capture({"model": {"w": torch.zeros(1 << 18)}}, step=0)
    snap = Snapshot.capture({"model": state}, step=3)
    outcome: dict[str, BaseException] = {}
    manifest_sent = threading.Event()

    class Stalled(PgTransport):
        """A source that sends its manifest, then hangs in a wait on the group before its
        first chunk (as on a peer gloo has not reported dead); once that wait ends, it goes
        on sending its chunks."""

        def manifest_sent(self) -> None:
            manifest_sent.set()
            try:
                self._pg().recv([torch.empty(1)], 0, 9).wait(datetime.timedelta(seconds=HOUR_S))
            except RuntimeError as e:
                outcome["hook"] = e

    def serve() -> None:
        try:
            asyncio.run(Stalled(source.process_group).provide(snap, plan))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome["source"] = exc

    served = threading.Thread(target=serve, daemon=True)
    served.start()
    # The newer configuration comes once the receiver waits for the stalled source's chunks:
    # its watch says so, or raises (the trainer's, once this member is removed).
    def removed() -> bool:
        if manifest_sent.is_set():
            raise Removed
        return False

    watch = manifest_sent.is_set if ending == "superseded" else removed
    transport = PgTransport(receiver.process_group)
    with pytest.raises(Superseded if ending == "superseded" else Removed):
        run_watched(receiver, transport.receive(plan, into=into), watch, transport.abandon)
    assert receiver.state == "stuck" and receiver.process_group is None

    served.join(HOUR_S)  # its wait ended when the receiver closed the connections
    hook = str(outcome["hook"])
    assert "closed by peer" in hook or "reset by peer" in hook, outcome
    assert isinstance(outcome["source"], TransferFailed), outcome
    assert outcome["source"].reason == "send_failed"
    assert not any(bool(t.any()) for t in into.tensors)  # its chunks never landed
