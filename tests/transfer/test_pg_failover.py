"""The process-group transport when a source fails halfway (real gloo processes, real signals):
its chunks move to the other source, or, with none left, the receiver raises the typed
``TransferFailed("no_sources_left")`` after "no progress for T" instead of waiting for the
group's timeout (set far above T in the workers). Each test runs three times: sending snapshot
memory; staging every message through buffers (``device="cpu"``: NCCL's path, over gloo); and
staged with the receiver taking every source's chunks from one thread, as it does over NCCL
(``cpu-serial``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .pg_fault_worker import PROGRESS_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 240.0
"""Backstop for a broken deadline (the workers' group timeout is 600 s), not a speed check."""


@pytest.fixture(params=[None, "cpu", "cpu-serial"], ids=["direct", "staged", "staged_serial"])
def device(request):
    return request.param


def run(fault: str, world: int, device: str | None,
        details: list[str] | None = None) -> tuple[dict, list[int]]:
    """The receiver's report and every rank's exit code; a ``TransferFailed``'s text goes to
    ``details`` (if given), not into the report."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        # Each in its own session: the stopped victim is alone in its process group, so a
        # signal meant for the test run's group never reaches it (one local run saw the victim
        # continued by a SIGCONT whose sender was not found; the worker also re-stops itself).
        procs = [subprocess.Popen([sys.executable, "-m", "tests.transfer.pg_fault_worker",
                                   str(r), str(world), store, out, fault,
                                   *([device] if device else [])], cwd=REPO,
                                  start_new_session=True)
                 for r in range(world)]
        try:
            codes = [p.wait(WAIT_S) for p in procs[1:]]  # every rank but the victim
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        report = json.loads(Path(out).read_text())
        victim = Path(f"{out}.victim")
        if victim.exists():
            report["victim"] = victim.read_text()
        detail = report.pop("detail", None)
        if details is not None and detail is not None:
            details.append(detail)
        return report, [procs[0].returncode, *codes]


STALLED = {"error": "TransferFailed", "reason": "no_progress", "failures": {"no_progress": 1}}
"""The receiver's report when a receive did not complete within T. gloo does not always report
a SIGKILLed peer's closed connection to receives already posted: about one run in three here it
surfaces only as the timeout (and then the whole group is closed), so a killed source may end
the transfer this way instead of being repaired around."""


@pytest.mark.slow  # three interpreters importing torch: 10-30 s on a shared 2-core host
def test_stripe_of_a_killed_source_moves_to_the_other(device):
    report, codes = run("kill", 3, device)
    if report.get("error"):
        assert report == STALLED and codes == [-signal.SIGKILL, 3, 0]
        pytest.xfail("gloo reported the dead source only as a timeout (see STALLED)")
    assert codes == [-signal.SIGKILL, 0, 0]
    assert report["failures"] == {"source_failed": 1}
    assert report["tensors_equal"] and report["fingerprint_equal"] and report["in_place"]
    total, victim, other = (report["total_bytes"], report["bytes_by_source"]["0"],
                            report["bytes_by_source"]["1"])
    assert victim + other == total
    # The victim dies once its second chunk has left, with up to 4 more in flight (its
    # window), so at most 6 of its 8 chunks arrive; the other source sends the rest. Fewer
    # than 2 can arrive too: gloo counts a send done once it is handed to the kernel, and a
    # socket closed by death with unread bytes resets, dropping what it had not sent (one CI
    # run: 1 chunk). Only whole, verified chunks count.
    chunk = total // report["num_chunks"]
    assert victim % chunk == 0 and victim <= 6 * chunk
    assert report["refetched"] == report["num_chunks"] // 2 - victim // chunk


@pytest.mark.slow
def test_a_stalled_source_is_a_typed_error_not_a_hang(device):
    # gloo closes the whole group on a timed-out wait: the receiver says so (no_progress) and
    # the healthy source's provide() fails too (exit 3: TransferFailed) instead of waiting.
    details: list[str] = []
    report, codes = run("stop", 3, device, details)
    assert report == STALLED
    assert codes == [-signal.SIGKILL, 3, 0]
    # It says what the caller does: abandon the group (no TCP fallback exists there).
    [detail] = details
    assert detail.startswith(
        f"source 0 moved nothing for {PROGRESS_TIMEOUT_S} s; gloo closed every connection of "
        "the group on the timed-out wait, so no repair round can run over it: the group must "
        "be abandoned (the trainer restarts recovery in the next configuration, with a new "
        "group) (")


@pytest.mark.slow
def test_a_source_dead_before_the_receives_are_posted_is_repaired_around(device):
    # gloo can fail the post of a receive from a peer whose connection already reset (seen in
    # CI: the receiver crashed with the RuntimeError); the source is dropped like any other.
    report, codes = run("kill_at_manifest", 3, device)
    assert codes == [-signal.SIGKILL, 0, 0], report
    assert report["failures"] == {"source_failed": 1}
    assert report["tensors_equal"] and report["fingerprint_equal"] and report["in_place"]
    assert report["bytes_by_source"] == {"0": 0, "1": report["total_bytes"]}
    assert report["refetched"] == report["num_chunks"] // 2


@pytest.mark.slow
def test_no_source_left_is_a_typed_error(device):
    report, codes = run("kill", 2, device)
    assert report in (STALLED, {"error": "TransferFailed", "reason": "no_sources_left",
                                "failures": {"source_failed": 1}})
    assert codes == [-signal.SIGKILL, 0]


@pytest.mark.slow
def test_over_nccl_the_first_lost_source_ends_the_transfer():
    # NCCL aborts the communicator on a failed operation and cannot withdraw posted ones: the
    # receiver names the lost source instead of running a repair round over a dead group, and
    # releases nobody (a status would not match), so the healthy source gives up on its own.
    details: list[str] = []
    report, codes = run("kill_one_shot", 3, "cpu", details)
    assert report in (STALLED, {"error": "TransferFailed", "reason": "source_failed",
                                "failures": {"source_failed": 1}})
    assert codes == [-signal.SIGKILL, 3, 0]
    if report != STALLED:
        assert details == ["source 0: source_failed; over NCCL a failed operation cannot be "
                           "routed around: the group must be abandoned (the trainer restarts "
                           "recovery in the next configuration, with a new group)"]


@pytest.mark.slow
def test_a_state_the_receiver_cannot_allocate_is_a_typed_error():
    report, codes = run("alloc", 3, None)
    assert report["error"] == "TransferFailed" and report["reason"] == "too_large"
    # The sources already stream their stripes, which nobody receives: each ends on its own
    # deadline ("no progress for T"), with a typed error, as with a dead receiver.
    assert codes == [3, 3, 0]


@pytest.mark.slow
def test_a_healthy_source_waits_out_a_slow_co_source(device):
    # The victim moves a chunk per SLOW_CHUNK_S (within T): its stripe takes longer than the
    # healthy source may wait for a status without a word. The receiver tells the healthy
    # source, whose stripe has arrived, that it still works: nobody concludes receiver_lost.
    report, codes = run("slow", 3, device)
    assert codes == [0, 0, 0], report
    assert report["failures"] == {} and report["refetched"] == 0
    assert report["tensors_equal"] and report["fingerprint_equal"] and report["in_place"]
    assert report["bytes_by_source"] == {"0": report["total_bytes"] // 2,
                                         "1": report["total_bytes"] // 2}


@pytest.mark.slow
def test_a_cancelled_receive_leaves_the_target_alone(device):
    # Cancelled while the slow victim still streams: receive() closes the group and ends its
    # threads before the cancellation propagates, so no byte lands afterwards (checked once
    # every source has ended), and both sources fail at once instead of streaming on.
    report, codes = run("cancel", 3, device)
    assert report == {"outcome": "cancelled", "complete_at_cancel": False,
                      "partial_at_cancel": True, "changed_after_cancel": False}
    assert codes == [3, 3, 0]


@pytest.mark.slow
def test_a_source_at_another_step_is_dropped_and_its_stripe_moves(device):
    # The plan asks for step 5; the victim serves step 6 (TCP sources refuse: step_mismatch).
    # It is dropped at its manifest, told so without waiting (it listens only once its stripe,
    # which nobody receives, is sent: a wait would time out and gloo close the whole group,
    # the healthy source's connection too), and its stripe comes from the other.
    report, codes = run("wrong_step", 3, device)
    assert report["failures"] == {"step_mismatch": 1}, report
    assert report["tensors_equal"] and report["fingerprint_equal"] and report["in_place"]
    assert report["bytes_by_source"] == {"0": 0, "1": report["total_bytes"]}
    assert report["refetched"] == report["num_chunks"] // 2
    assert codes[1:] == [0, 0]


@pytest.mark.slow
def test_a_healthy_source_waits_out_a_co_source_near_t_per_chunk(device, request):
    # As above at SLOWER_CHUNK_S = 0.8 T per chunk: the healthy source must not conclude
    # receiver_lost (see pg_fault_worker.SLOWER_CHUNK_S). The victim, still in its last
    # chunk's pause when the others end, may be killed by ``run``.
    if device == "cpu-serial":
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="one receiving thread over gloo takes the receives in posting "
            "order (gloo reports one complete only once waited on), so the healthy source's "
            "last chunks wait behind the slow one's window; NCCL's report completion"))
    report, codes = run("slower", 3, device)
    assert codes[1:] == [0, 0], report
    assert report["failures"] == {} and report["tensors_equal"] and report["fingerprint_equal"]


@pytest.mark.slow
def test_a_source_that_sent_a_bad_chunk_is_told_at_once(device):
    # Its chunk is fetched again from the other source, and it is told it was given up on,
    # so it ends now (receiver_aborted) instead of waiting 3T for a word from the receiver
    # (receiver_lost). The receiver waits for it to end.
    report, codes = run("corrupt", 3, device)
    assert report.pop("victim") == "receiver_aborted"
    assert report["failures"] == {"bad_chunk": 1}, report
    assert report["refetched"] == 1  # chunk 0 (its other chunks passed their digests)
    assert report["tensors_equal"] and report["fingerprint_equal"]
    assert codes == [3, 0, 0]


@pytest.mark.slow
def test_a_source_with_the_other_wire_layout_is_dropped_at_its_manifest(device):
    # The victim stages where the receiver does not (or the reverse): a staged chunk is one
    # message, an unstaged one a message per segment, and gloo aborted the receiving process on
    # a message larger than the receive posted for it. Its manifest header says which; it is
    # dropped there (bad_manifest), told so, and its stripe comes from the other source.
    report, codes = run("layout", 3, device)
    victim = report.pop("victim")
    assert victim in ("receiver_aborted", "no_progress"), victim
    assert report["failures"] == {"bad_manifest": 1}, report
    assert report["tensors_equal"] and report["fingerprint_equal"] and report["in_place"]
    assert report["bytes_by_source"] == {"0": 0, "1": report["total_bytes"]}
    assert codes == [3, 0, 0]
