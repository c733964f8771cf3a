"""GPU health monitor against the scripted fake NVML (S05, S18) and the real pynvml (no GPU here).

Faults are asserted exactly (kind, severity, detail, time stamp from a hand clock). Waits on
threads use generous bounds and assert on what arrived, never on how fast.

Why one file of this size: every section drives the same monitor through the same scripted
fake NVML and hand clock, and the last section checks that fake against the binding itself.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from torchpass_p2p.agent import health
from torchpass_p2p.agent.health import (
    FATAL_XIDS,
    FaultKind,
    HealthFault,
    HealthMonitor,
    Severity,
    resolve_device,
)
from torchpass_p2p.testing.fake_nvml import FakeNvml

NOW = 100.0
WAIT_S = 10.0  # upper bound for anything a thread should deliver; never a speed assertion
HANG_DETAIL = ("did not return within 0.2 s and is still blocked (a missed NVML deadline is "
               "a health failure in itself)")


def clock() -> float:
    return NOW


def migrate(kind: FaultKind, detail: str) -> HealthFault:
    return HealthFault(kind, detail, Severity.MIGRATE, NOW)


def warn(kind: FaultKind, detail: str) -> HealthFault:
    return HealthFault(kind, detail, Severity.WARN, NOW)


@pytest.fixture
def nvml() -> Iterator[FakeNvml]:
    fake = FakeNvml(gpus=2)
    yield fake
    fake.release()  # let any call stuck in a scripted hang return


@pytest.fixture
def make_monitor(nvml: FakeNvml) -> Iterator[Callable[..., HealthMonitor]]:
    monitors: list[HealthMonitor] = []

    def make(**kwargs: Any) -> HealthMonitor:
        kwargs.setdefault("nvml", nvml)
        kwargs.setdefault("device_index", 0)
        kwargs.setdefault("clock", clock)
        kwargs.setdefault("call_deadline_s", 5.0)
        monitor = HealthMonitor(**kwargs)
        monitors.append(monitor)
        return monitor

    yield make
    for monitor in monitors:
        monitor.stop(timeout_s=2.0)


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# --- a healthy GPU ---------------------------------------------------------------------------


def test_healthy_gpu_no_fault_and_full_status(make_monitor: Callable[..., HealthMonitor],
                                              nvml: FakeNvml) -> None:
    monitor = make_monitor()
    assert monitor.status()["state"] == "idle"
    assert monitor.poll_once() == []
    status = monitor.status()
    assert status == {
        "enabled": True,
        "state": "running",
        "reason": None,
        "device": {"index": 0, "name": "NVIDIA H200 (fake)", "uuid": nvml.gpu.uuid},
        "last_poll_at": NOW,
        "temperature_c": 45,
        "margin_temperature_c": 40,
        "throttle_reasons": [],
        "ecc_uncorrected_volatile": 0,
        "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": 0, "failure": 0},
        "recovery_action": 0,
        "xid_counts": {},
        "unsupported": [],
        "stuck_call": None,
        "last_error": None,
        "fault_count": 0,
        "faults": [],
    }
    json.dumps(status)


# --- S18: each scripted condition gives exactly its fault ------------------------------------


def _remap(rows: tuple[int, int, int, int]) -> Callable[[FakeNvml], None]:
    return lambda f: setattr(f.gpu, "remapped_rows", rows)


def _recovery(action: int) -> Callable[[FakeNvml], None]:
    return lambda f: setattr(f.gpu, "recovery_action", action)


def _retired_pending(f: FakeNvml) -> None:
    f.gpu.remapped_rows = None  # pre-Ampere: no row remapper
    f.gpu.retired_pages_pending = True


def _xids(*xids: int) -> Callable[[FakeNvml], None]:
    def push(f: FakeNvml) -> None:
        for xid in xids:
            f.push_xid(xid)
    return push


RA = FaultKind.RECOVERY_ACTION
CASES: dict[str, tuple[Callable[[FakeNvml], None], list[HealthFault]]] = {
    "ecc": (lambda f: setattr(f.gpu, "ecc_uncorrected", 2), [migrate(
        FaultKind.ECC_UNCORRECTABLE,
        "2 uncorrectable ECC error(s) (volatile counter, since the last driver load or reset)")]),
    "remap_pending": (_remap((3, 1, 1, 0)), [migrate(
        FaultKind.REMAP_PENDING, "row remap pending: reset the GPU at the next window")]),
    "remap_failed": (_remap((3, 1, 0, 1)), [migrate(
        FaultKind.REMAP_FAILED, "row remapping failed: replace the GPU")]),
    "remap_pending_and_failed": (_remap((0, 2, 1, 1)), [
        migrate(FaultKind.REMAP_FAILED, "row remapping failed: replace the GPU"),
        migrate(FaultKind.REMAP_PENDING, "row remap pending: reset the GPU at the next window")]),
    "remapped_rows_in_the_past_are_fine": (_remap((5, 2, 0, 0)), []),
    "retired_pages_pending": (_retired_pending, [migrate(
        FaultKind.RETIRED_PAGES_PENDING, "page retirement pending: reset the GPU")]),
    "recovery_gpu_reset": (_recovery(1), [migrate(RA, "NVML recovery action 1 (GPU reset)")]),
    "recovery_node_reboot": (_recovery(2), [migrate(RA, "NVML recovery action 2 (node reboot)")]),
    "recovery_drain_p2p": (_recovery(3), [migrate(RA, "NVML recovery action 3 (drain P2P)")]),
    "recovery_drain_reset": (_recovery(4), [
        migrate(RA, "NVML recovery action 4 (drain and reset)")]),
    "recovery_unknown": (_recovery(7), [
        migrate(RA, "NVML recovery action 7 (unknown value >= 5: needs reset/reboot)")]),
    "gpu_lost": (lambda f: setattr(f.gpu, "lost", True), [migrate(
        FaultKind.GPU_LOST, "NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus")]),
    "reset_required": (lambda f: f.fail("nvmlDeviceGetTotalEccErrors",
                                        pynvml.NVML_ERROR_RESET_REQUIRED), [migrate(
        RA, "NVML_ERROR_RESET_REQUIRED: the GPU requires a reset")]),
    "xids": (_xids(79, 48, 94, 63, 92, 13), [
        migrate(FaultKind.XID, "XID 79: fatal in NVIDIA's XID catalog"),
        migrate(FaultKind.XID, "XID 48: fatal in NVIDIA's XID catalog"),
        migrate(FaultKind.XID, "XID 94: contained error, the application must restart "
                               "(GPU reset later)"),
        warn(FaultKind.XID, "XID 63: a trend to watch (memory remapping/ECC)"),
        warn(FaultKind.XID, "XID 92: a trend to watch (memory remapping/ECC)"),
        warn(FaultKind.XID, "XID 13: not in the fatal list")]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scripted_condition_gives_exactly_its_faults(
        name: str, make_monitor: Callable[..., HealthMonitor], nvml: FakeNvml) -> None:
    script, expected = CASES[name]
    monitor = make_monitor()
    assert monitor.poll_once() == []  # healthy first, then the GPU turns bad
    script(nvml)
    assert monitor.poll_once() == expected
    assert monitor.status()["faults"] == [f.to_dict() for f in expected]
    assert monitor.poll_once() == []  # reported once


def test_fatal_xid_list_is_gpu_md() -> None:
    assert sorted(FATAL_XIDS) == [46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143,
                                  144, 145, 146, 147, 148, 149, 150, 155, 156, 158, 160]


def test_lost_gpu_ends_the_round(make_monitor: Callable[..., HealthMonitor],
                                 nvml: FakeNvml) -> None:
    monitor = make_monitor()
    monitor.poll_once()
    nvml.gpu.lost = True
    nvml.gpu.ecc_uncorrected = 1
    [fault] = monitor.poll_once()
    assert fault.kind == FaultKind.GPU_LOST
    assert nvml.calls["nvmlDeviceGetRemappedRows"] == 1  # nothing after the lost call


def test_recovery_action_any_value_type(make_monitor: Callable[..., HealthMonitor],
                                        nvml: FakeNvml) -> None:
    nvml.gpu.recovery_action = 2
    nvml.gpu.recovery_action_value_type = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    assert make_monitor().poll_once() == [migrate(RA, "NVML recovery action 2 (node reboot)")]


def test_field_entry_error_is_no_fault(make_monitor: Callable[..., HealthMonitor],
                                       nvml: FakeNvml) -> None:
    nvml.gpu.recovery_action = None  # the entry's nvmlReturn is NOT_SUPPORTED
    monitor = make_monitor()
    assert monitor.poll_once() == []
    assert monitor.status()["unsupported"] == ["recovery_action"]
    assert monitor.status()["recovery_action"] is None


def test_each_distinct_fault_reported_once(make_monitor: Callable[..., HealthMonitor],
                                           nvml: FakeNvml) -> None:
    monitor = make_monitor()
    monitor.poll_once()
    nvml.gpu.ecc_uncorrected = 1
    nvml.push_xid(79)
    assert [f.kind for f in monitor.poll_once()] == [FaultKind.XID, FaultKind.ECC_UNCORRECTABLE]
    nvml.gpu.ecc_uncorrected = 5
    nvml.push_xid(79)
    assert monitor.poll_once() == []
    nvml.push_xid(74)  # another XID is another fault
    assert monitor.poll_once() == [migrate(FaultKind.XID, "XID 74: fatal in NVIDIA's XID catalog")]
    status = monitor.status()
    assert status["fault_count"] == 3
    assert status["xid_counts"] == {"74": 1, "79": 2}
    assert status["ecc_uncorrected_volatile"] == 5


def test_throttling_is_a_warning(make_monitor: Callable[..., HealthMonitor],
                                 nvml: FakeNvml) -> None:
    monitor = make_monitor()
    nvml.gpu.clocks_event_reasons = 0x4 | 0x1  # power cap and idle: no straggler
    assert monitor.poll_once() == []
    assert monitor.status()["throttle_reasons"] == ["GpuIdle", "SwPowerCap"]
    nvml.gpu.clocks_event_reasons = 0x8 | 0x40 | 0x80 | 0x20
    assert monitor.poll_once() == [
        warn(FaultKind.THROTTLE, "clocks reduced by HwSlowdown (0x8): this GPU will straggle"),
        warn(FaultKind.THROTTLE,
             "clocks reduced by SwThermalSlowdown (0x20): this GPU will straggle"),
        warn(FaultKind.THROTTLE,
             "clocks reduced by HwThermalSlowdown (0x40): this GPU will straggle"),
        warn(FaultKind.THROTTLE,
             "clocks reduced by HwPowerBrakeSlowdown (0x80): this GPU will straggle"),
    ]
    assert monitor.status()["throttle_reasons"] == [
        "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"]


def test_unsupported_checks_are_dropped(make_monitor: Callable[..., HealthMonitor],
                                        nvml: FakeNvml) -> None:
    gpu = nvml.gpu
    gpu.ecc_uncorrected = gpu.remapped_rows = gpu.retired_pages_pending = None
    gpu.temperature_c = gpu.margin_c = None
    gpu.xid_events_supported = False
    monitor = make_monitor()
    assert monitor.poll_once() == []
    assert monitor.poll_once() == []
    assert monitor.status()["unsupported"] == [
        "ecc", "margin_temperature", "remapped_rows", "retired_pages", "temperature", "xid"]
    assert nvml.calls["nvmlDeviceGetTotalEccErrors"] == 1  # not asked again
    assert nvml.calls["nvmlEventSetWait_v2"] == 0
    assert nvml.calls["nvmlEventSetFree"] == 1  # the unregistered set was freed


def test_other_nvml_error_is_noted_not_a_fault(make_monitor: Callable[..., HealthMonitor],
                                               nvml: FakeNvml) -> None:
    nvml.fail("nvmlDeviceGetTotalEccErrors", pynvml.NVML_ERROR_UNKNOWN)
    monitor = make_monitor()
    assert monitor.poll_once() == []
    assert monitor.status()["last_error"] == "ecc: NVMLError_Unknown: Unknown Error"
    assert monitor.status()["temperature_c"] == 45  # the other checks still ran


# --- disabled, never an error ---------------------------------------------------------------


@pytest.mark.parametrize(("code", "reason"), [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
     "NVML unavailable: NVMLError_LibraryNotFound: NVML Shared Library Not Found"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
     "NVML unavailable: NVMLError_DriverNotLoaded: Driver Not Loaded"),
])
def test_no_driver_disables(code: int, reason: str, make_monitor: Callable[..., HealthMonitor],
                            nvml: FakeNvml) -> None:
    nvml.fail("nvmlInit", code)
    monitor = make_monitor()
    assert monitor.poll_once() == []
    status = monitor.status()
    assert (status["enabled"], status["state"], status["reason"]) == (False, "disabled", reason)
    assert monitor.poll_once() == []
    assert nvml.calls["nvmlInit"] == 1  # disabled is final


@pytest.mark.parametrize("inject", [True, False])
def test_real_pynvml_without_gpu_disables(inject: bool) -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present; see test_real_pynvml_with_gpu")
    monitor = HealthMonitor(nvml=pynvml if inject else None, device_index=0)
    try:
        assert monitor.poll_once() == []
        status = monitor.status()
        assert status["enabled"] is False
        assert "library" in status["reason"].lower()
    finally:
        assert monitor.stop(timeout_s=2.0)


def test_real_pynvml_with_gpu() -> None:
    """GPU smoke test for S18 where a GPU is lent: a healthy GPU polls clean and reports."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pytest.skip("no NVIDIA driver")
    pynvml.nvmlShutdown()
    monitor = HealthMonitor(nvml=pynvml, device_index=0)
    try:
        faults = monitor.poll_once()
        status = monitor.status()
        assert status["enabled"] is True, status
        assert status["device"]["uuid"], status
        assert status["temperature_c"] is not None, status
        assert [f for f in faults if f.severity == Severity.MIGRATE] == [], status
        json.dumps(status)
    finally:
        assert monitor.stop(timeout_s=5.0)


def test_disabled_worker_ends_and_never_calls_back(make_monitor: Callable[..., HealthMonitor],
                                                   nvml: FakeNvml) -> None:
    nvml.fail("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    faults: list[HealthFault] = []
    monitor = make_monitor(interval_s=0.01)
    monitor.start(faults.append)
    wait_until(lambda: monitor.status()["state"] == "disabled", "disabled")
    assert monitor.stop(timeout_s=2.0)
    assert faults == []
    assert monitor.status()["enabled"] is False


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"device_index": None, "env": {"CUDA_VISIBLE_DEVICES": ""}},
     "no GPU for this process: CUDA_VISIBLE_DEVICES='' shows no GPU for LOCAL_RANK=0"),
    ({"device_index": 5}, "GPU 5 (device_index argument) is absent: NVML sees 2"),
    ({"device_index": None, "env": {"CUDA_VISIBLE_DEVICES": "GPU-nope"}},
     "GPU 'GPU-nope' (CUDA_VISIBLE_DEVICES='GPU-nope'[LOCAL_RANK=0]) not found: Not Found"),
])
def test_no_gpu_for_this_process_disables(kwargs: dict[str, Any], reason: str,
                                          make_monitor: Callable[..., HealthMonitor]) -> None:
    monitor = make_monitor(**kwargs)
    assert monitor.poll_once() == []
    assert (monitor.status()["enabled"], monitor.status()["reason"]) == (False, reason)


def test_no_gpu_at_all_disables(make_monitor: Callable[..., HealthMonitor]) -> None:
    monitor = make_monitor(nvml=FakeNvml(gpus=0))
    assert monitor.poll_once() == []
    assert monitor.status()["reason"] == "NVML sees no GPU"


@pytest.mark.parametrize(("env", "device"), [
    ({}, 0),
    ({"LOCAL_RANK": "3"}, 3),
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}, 6),
    ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}, "GPU-abc"),
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,-1,3"}, None),  # CUDA stops at "-1"
    ({"CUDA_VISIBLE_DEVICES": "-1"}, None),
    ({"LOCAL_RANK": "x"}, None),
])
def test_resolve_device(env: dict[str, str], device: int | str | None) -> None:
    assert resolve_device(env)[0] == device


def test_uuid_from_cuda_visible_devices(make_monitor: Callable[..., HealthMonitor],
                                        nvml: FakeNvml) -> None:
    second = nvml.gpus[1]
    monitor = make_monitor(device_index=None,
                           env={"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": second.uuid})
    nvml.gpus[0].ecc_uncorrected = 9  # not ours
    assert monitor.poll_once() == []
    assert monitor.status()["device"] == {"index": 1, "name": second.name, "uuid": second.uuid}
    nvml.push_xid(79, device=0)  # not ours either
    nvml.push_xid(48, device=1)
    assert [f.detail for f in monitor.poll_once()] == ["XID 48: fatal in NVIDIA's XID catalog"]


# --- S05: a hung NVML call -----------------------------------------------------------------


def test_hang_reported_within_deadline_while_call_still_blocked(
        make_monitor: Callable[..., HealthMonitor], nvml: FakeNvml) -> None:
    monitor = make_monitor(call_deadline_s=0.2)
    assert monitor.poll_once() == []
    nvml.hang(60.0)  # S05: every NVML call blocks 60 s
    assert monitor.poll_once() == [
        migrate(FaultKind.NVML_HANG, f"nvmlEventSetWait_v2 {HANG_DETAIL}")]
    assert nvml.blocked == 1  # reported while the call is still inside NVML
    assert monitor.status()["stuck_call"] == {"call": "nvmlEventSetWait_v2", "since": NOW}
    calls = sum(nvml.calls.values())
    assert monitor.poll_once() == []  # reported once; no new call piles up behind it
    assert (sum(nvml.calls.values()), nvml.blocked) == (calls, 1)

    nvml.release()  # the stuck call returns; polling resumes by itself
    nvml.gpu.ecc_uncorrected = 1
    found: list[HealthFault] = []

    def poll() -> bool:
        found.extend(monitor.poll_once())
        return bool(found)

    wait_until(poll, "polling to resume")
    assert found == [migrate(
        FaultKind.ECC_UNCORRECTABLE,
        "1 uncorrectable ECC error(s) (volatile counter, since the last driver load or reset)")]
    assert monitor.status()["stuck_call"] is None
    assert [f["kind"] for f in monitor.status()["faults"]] == ["nvml_hang", "ecc_uncorrectable"]


def test_hang_in_nvml_init_is_a_fault(make_monitor: Callable[..., HealthMonitor],
                                      nvml: FakeNvml) -> None:
    nvml.hang(60.0)
    monitor = make_monitor(call_deadline_s=0.2, init_deadline_s=0.2)
    assert monitor.poll_once() == [migrate(FaultKind.NVML_HANG, f"nvmlInit {HANG_DETAIL}")]
    assert monitor.status()["enabled"] is True  # a hang is a fault, not "no GPU"


def test_s05_worker_reports_hang_and_stop_returns_with_stuck_thread(
        make_monitor: Callable[..., HealthMonitor], nvml: FakeNvml) -> None:
    faults: queue.Queue[HealthFault] = queue.Queue()
    monitor = make_monitor(call_deadline_s=0.2, interval_s=0.05)
    monitor.start(faults.put)
    wait_until(lambda: nvml.calls["nvmlEventSetWait_v2"] >= 2, "event waits between polls")
    nvml.hang(60.0)
    fault = faults.get(timeout=WAIT_S)
    assert (fault.kind, fault.severity, fault.at) == (FaultKind.NVML_HANG, Severity.MIGRATE, NOW)
    assert fault.detail.endswith(HANG_DETAIL)
    assert nvml.blocked == 1
    assert monitor.stop(timeout_s=2.0) is True  # the worker ends; the stuck thread is abandoned
    assert nvml.blocked == 1
    assert monitor.status()["state"] == "stopped"
    assert faults.empty()
    assert nvml.initialized  # no nvmlShutdown while a call is stuck: it would block too


async def test_s05_asyncio_loop_keeps_running_during_hang(
        make_monitor: Callable[..., HealthMonitor], nvml: FakeNvml) -> None:
    loop = asyncio.get_running_loop()
    faults: asyncio.Queue[HealthFault] = asyncio.Queue()
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    nvml.hang(60.0, calls=["nvmlDeviceGetTotalEccErrors"])
    monitor = make_monitor(call_deadline_s=0.2, interval_s=0.05)
    async with asyncio.TaskGroup() as tg:
        beat = tg.create_task(heartbeat())
        monitor.start(lambda f: loop.call_soon_threadsafe(faults.put_nowait, f))
        async with asyncio.timeout(WAIT_S):
            fault = await faults.get()
        assert fault == migrate(FaultKind.NVML_HANG, f"nvmlDeviceGetTotalEccErrors {HANG_DETAIL}")
        assert nvml.blocked == 1
        assert ticks > 0  # the loop ran while NVML was stuck
        assert await asyncio.to_thread(monitor.stop, 2.0)
        beat.cancel()


# --- the worker thread ------------------------------------------------------------------------


def test_worker_reports_s18_faults_once_each(make_monitor: Callable[..., HealthMonitor],
                                             nvml: FakeNvml) -> None:
    faults: queue.Queue[HealthFault] = queue.Queue()
    nvml.gpu.recovery_action = 4
    monitor = make_monitor(interval_s=0.01)
    monitor.start(faults.put)
    assert faults.get(timeout=WAIT_S) == migrate(RA, "NVML recovery action 4 (drain and reset)")
    nvml.gpu.remapped_rows = (0, 1, 1, 0)
    assert faults.get(timeout=WAIT_S).kind == FaultKind.REMAP_PENDING
    polls = nvml.calls["nvmlDeviceGetRemappedRows"]
    wait_until(lambda: nvml.calls["nvmlDeviceGetRemappedRows"] >= polls + 5, "more polls")
    assert monitor.stop(timeout_s=2.0)
    assert faults.empty()
    assert monitor.status()["fault_count"] == 2
    wait_until(lambda: not nvml.initialized, "nvmlShutdown after a clean stop")


def test_worker_reads_xids_between_polls(make_monitor: Callable[..., HealthMonitor],
                                         nvml: FakeNvml) -> None:
    faults: queue.Queue[HealthFault] = queue.Queue()
    monitor = make_monitor(interval_s=3600.0)  # only the event wait can see it
    monitor.start(faults.put)
    wait_until(lambda: nvml.calls["nvmlEventSetWait_v2"] >= 2, "the event wait")
    nvml.push_xid(79)
    assert faults.get(timeout=WAIT_S) == migrate(FaultKind.XID,
                                                 "XID 79: fatal in NVIDIA's XID catalog")
    assert nvml.calls["nvmlDeviceGetTotalEccErrors"] == 1
    assert monitor.stop(timeout_s=5.0)


def test_a_failing_callback_does_not_stop_monitoring(make_monitor: Callable[..., HealthMonitor],
                                                     nvml: FakeNvml,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    got: list[HealthFault] = []
    done = threading.Event()

    def on_fault(fault: HealthFault) -> None:
        got.append(fault)
        if len(got) == 1:
            raise RuntimeError("agent bug")
        done.set()

    nvml.gpu.ecc_uncorrected = 1
    monitor = make_monitor(interval_s=0.01)
    monitor.start(on_fault)
    wait_until(lambda: len(got) == 1, "the first fault")
    nvml.gpu.lost = True
    assert done.wait(WAIT_S)
    assert [f.kind for f in got] == [FaultKind.ECC_UNCORRECTABLE, FaultKind.GPU_LOST]
    assert "on_fault callback failed" in caplog.text


def test_stop_wakes_a_worker_waiting_for_events(make_monitor: Callable[..., HealthMonitor],
                                                nvml: FakeNvml) -> None:
    monitor = make_monitor(call_deadline_s=120.0, event_wait_s=60.0)
    monitor.start(lambda f: None)
    wait_until(lambda: nvml.calls["nvmlEventSetWait_v2"] >= 2, "a 60 s event wait")
    assert monitor.stop(timeout_s=5.0)  # the worker did not sit out the wait
    nvml.push_xid(79)  # ends the wait; the call thread then shuts NVML down
    wait_until(lambda: not nvml.initialized, "nvmlShutdown after the wait")


def test_lifecycle_misuse_raises(make_monitor: Callable[..., HealthMonitor]) -> None:
    monitor = make_monitor(interval_s=0.01)
    monitor.start(lambda f: None)
    with pytest.raises(RuntimeError):
        monitor.start(lambda f: None)
    assert monitor.stop(timeout_s=2.0)
    with pytest.raises(ValueError):
        HealthMonitor(nvml=FakeNvml(), call_deadline_s=0)


def test_stop_without_start_shuts_nvml_down(make_monitor: Callable[..., HealthMonitor],
                                            nvml: FakeNvml) -> None:
    monitor = make_monitor()
    monitor.poll_once()
    assert nvml.initialized
    assert monitor.stop(timeout_s=2.0)
    wait_until(lambda: not nvml.initialized, "nvmlShutdown on the call thread")
    assert nvml.calls["nvmlEventSetFree"] == 1
    assert monitor.poll_once() == []  # stopped: no more NVML
    assert nvml.calls["nvmlInit"] == 1


# --- the fake stays faithful to the binding --------------------------------------------------


def test_fake_and_pynvml_have_every_name_the_monitor_uses() -> None:
    source = Path(health.__file__).read_text()
    names = set(re.findall(r'"(nvml[A-Z]\w*)"', source))  # _call("nvml...") and _query
    names |= set(re.findall(r"(?:\bself\._nvml|(?<![\w.])nvml)\.([A-Za-z]\w*)", source))
    assert {"nvmlInit", "nvmlEventSetWait_v2", "NVMLError_GpuIsLost",
            "nvmlDeviceGetFieldValues"} <= names
    fake = FakeNvml()
    assert sorted(n for n in names if not hasattr(pynvml, n)) == []
    assert sorted(n for n in names if not hasattr(fake, n)) == []
    assert fake.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    assert health.RECOVERY_ACTION_FIELD == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    assert health.STRAGGLE_REASONS == {
        pynvml.nvmlClocksEventReasonHwSlowdown: "HwSlowdown",
        pynvml.nvmlClocksEventReasonSwThermalSlowdown: "SwThermalSlowdown",
        pynvml.nvmlClocksEventReasonHwThermalSlowdown: "HwThermalSlowdown",
        pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown: "HwPowerBrakeSlowdown"}
