"""``PgTransport.abandon`` while a receive is still awaited (a gloo pair in one process): the
receive raises ``TransferFailed("abandoned")``, its own error, not an internal one, and nothing
lands in the target. On both wire layouts: the staged path receives with a thread per source."""

from __future__ import annotations

import asyncio
import datetime
import threading

import pytest
import torch

from torchpass_p2p.collective.group import close_connections
from torchpass_p2p.transfer import Snapshot, TransferFailed
from torchpass_p2p.transfer.pg_transport import PgTransport
from torchpass_p2p.transfer.state_transport import TransferPlan

from ..collective.gloo_pair import gloo_pair

HOUR_S = 3600.0
PROGRESS_TIMEOUT_S = 20.0
"""The receive looks at its stop every T / 2 = 10 s at the latest; the abandon comes well
before its wait on the stalled source would end it with ``no_progress`` (T)."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", [None, "cpu"], ids=["direct", "staged"])
def test_a_receive_awaited_when_its_transport_is_abandoned_fails_abandoned(device):
    receiver_pg, source_pg = gloo_pair(timeout_s=HOUR_S)
    plan = TransferPlan(sources=(1,), config_id=5, receiver=0,
                        progress_timeout_s=PROGRESS_TIMEOUT_S)
    snap = Snapshot.capture({"model": {"w": torch.arange(1 << 18, dtype=torch.float32)}},
                            step=3)
    into = Snapshot.capture({"model": {"w": torch.zeros(1 << 18)}}, step=0)
    manifest_sent = threading.Event()
    outcome: dict[str, BaseException] = {}

    class Stalled(PgTransport):
        """Sends its manifest, then hangs in a wait on the group until it is closed."""

        def manifest_sent(self) -> None:
            manifest_sent.set()
            try:
                self._pg().recv([torch.empty(1)], 0, 9).wait(datetime.timedelta(seconds=HOUR_S))
            except RuntimeError:
                pass

    def run(name: str, coro) -> threading.Thread:
        def body() -> None:
            try:
                asyncio.run(coro)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                outcome[name] = exc
        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t

    transport = PgTransport(receiver_pg, device=device)
    source = run("source", Stalled(source_pg, device=device).provide(snap, plan))
    receiving = run("receiver", transport.receive(plan, into=into))
    assert manifest_sent.wait(60)
    transport.abandon()  # as the trainer's run_watched does, then it closes the group
    close_connections(receiver_pg, [1])
    receiving.join(60)
    source.join(60)
    assert not receiving.is_alive() and not source.is_alive()
    error = outcome["receiver"]
    assert isinstance(error, TransferFailed) and error.reason == "abandoned", repr(error)
    assert not any(bool(t.any()) for t in into.tensors)  # no chunk landed
