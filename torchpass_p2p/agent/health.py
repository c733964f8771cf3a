"""GPU health of this member from NVML, read off the event loop, every call under a deadline.

Why one module of this size: the NVML facts, the call runner that puts every call under a
deadline, and the monitor's checks are read together when a fault is classified; the test
stand-in lives apart (:mod:`torchpass_p2p.testing.fake_nvml`).

Theory of operation
-------------------
A :class:`HealthMonitor` watches one GPU. Every NVML call goes through :class:`_CallRunner`: a
single daemon thread executes the call while the asking thread waits at most the call's
deadline. A call that misses it is the fault ``nvml_hang`` at once, although the runner thread
stays inside the call (NVML calls can block indefinitely, even unkillably, on a failing GPU:
docs/gpu.md, "NVML health"). While that call is stuck nothing new is sent to NVML, so stuck
threads never pile up; once it returns, polling resumes by itself.

Latency of a hang (S05): reported ``call_deadline_s`` after the stuck call began. With XID
events the worker issues calls back to back, at most ``event_wait_s`` (1 s) apart, so from the
moment NVML starts hanging it is at most ``call_deadline_s + event_wait_s``; S05's 10 s bound
therefore wants ``call_deadline_s`` <= 9 s. Without XID events (unsupported) calls come once
per ``interval_s``, and the bound is ``interval_s + call_deadline_s``.

:meth:`HealthMonitor.poll_once` is one synchronous, bounded round of checks; tests call it
directly. :meth:`HealthMonitor.start` runs a daemon worker thread that polls every
``interval_s`` and, between polls, waits for XID events ~1 s at a time. Neither thread touches
an asyncio loop: ``on_fault`` runs on the worker (or on whichever thread called ``poll_once``),
and the agent marshals it with ``loop.call_soon_threadsafe``.

What is read, and why (docs/gpu.md, "NVML health", which follows NVIDIA's NVML API reference
and XID catalog):

- XID events: ``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents(h,
  nvmlEventTypeXidCriticalError, set)``, ``nvmlEventSetWait_v2`` (``eventData`` is the XID).
  :data:`FATAL_XIDS` and the contained 94 migrate; the trends 63 and 92 and any other XID warn.
- Uncorrectable ECC: ``nvmlDeviceGetTotalEccErrors(h, UNCORRECTED, VOLATILE)`` > 0: migrate.
- Row remapping (Ampere and later): ``nvmlDeviceGetRemappedRows`` pending (reset at the next
  window) or failure (replace the GPU): migrate. Older GPUs:
  ``nvmlDeviceGetRetiredPagesPendingStatus``: migrate.
- Recovery action: field 230 through ``nvmlDeviceGetFieldValues`` (pynvml has no getter),
  each entry's ``nvmlReturn`` and ``valueType`` checked; any value but 0: migrate.
- GPU lost: any call raising ``NVMLError_GpuIsLost`` (fell off the bus): migrate.
  ``NVMLError_ResetRequired`` counts as a recovery action.
- Hung NVML: a call that misses its deadline: migrate.
- Throttling: ``nvmlDeviceGetCurrentClocksEventReasons`` bits HwSlowdown 0x8, SwThermalSlowdown
  0x20, HwThermalSlowdown 0x40, HwPowerBrakeSlowdown 0x80: the GPU will straggle: warn.
- Temperature: ``nvmlDeviceGetTemperatureV`` and ``nvmlDeviceGetMarginTemperature`` (distance
  to slowdown): status only (thermal slowdown itself shows up as a throttle bit).

A ``migrate`` fault means the member should ask to be replaced proactively: it is still alive,
so it serves its own state (docs/design.md section 4). ``warn`` is information for the straggler
policy. Each distinct fault (kind plus XID number, recovery value or throttle reason) is reported
once for the monitor's life. A check that the GPU or driver does not support (``NotSupported``,
``FunctionNotFound``) is dropped and listed under ``unsupported`` in :meth:`status`.

No ``pynvml``, no driver, no GPU, or a GPU hidden by ``CUDA_VISIBLE_DEVICES``: the monitor is
disabled, :meth:`status` says why in ``reason``, and nothing is raised.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "CONTAINED_XIDS",
    "FATAL_XIDS",
    "RECOVERY_ACTIONS",
    "STRAGGLE_REASONS",
    "TREND_XIDS",
    "FaultKind",
    "HealthFault",
    "HealthMonitor",
    "Severity",
    "resolve_device",
]

log = logging.getLogger(__name__)

# --- facts from docs/gpu.md (NVIDIA XID catalog, NVML API reference) -------------------------

FATAL_XIDS: frozenset[int] = frozenset(
    {46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, *range(143, 151), 155, 156, 158,
     160})
"""XIDs NVIDIA's own mapping treats as fatal: 48 double-bit ECC, 74 NVLink, 79 fell off the bus."""

CONTAINED_XIDS: frozenset[int] = frozenset({94})
"""Contained ECC error: the application must restart (reset later), so this process migrates."""

TREND_XIDS: frozenset[int] = frozenset({63, 92})
"""Row-remapping / high single-bit ECC events: trends to watch, a warning."""

RECOVERY_ACTIONS: dict[int, str] = {
    0: "none", 1: "GPU reset", 2: "node reboot", 3: "drain P2P", 4: "drain and reset"}
"""Field 230 ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``; values >= 5 changed between driver
releases, so any unknown value >= 5 is read as "needs reset/reboot"."""

RECOVERY_ACTION_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; pynvml has no getter for it

STRAGGLE_REASONS: dict[int, str] = {
    0x8: "HwSlowdown", 0x20: "SwThermalSlowdown", 0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown"}
"""Clock-event reason bits that mark a GPU that will straggle (a warning, not a migration)."""

_OTHER_REASONS: dict[int, str] = {
    0x1: "GpuIdle", 0x2: "ApplicationsClocksSetting", 0x4: "SwPowerCap", 0x10: "SyncBoost",
    0x100: "DisplayClockSetting"}

_VALUE_ATTR: dict[int, str] = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal",
                               5: "siVal", 6: "usVal"}  # nvmlValueType_t -> c_nvmlValue_t member

# --- limits, each with its reason ----------------------------------------------------------

DEFAULT_INIT_DEADLINE_S = 30.0
"""``nvmlInit`` touches every GPU and is slow without persistence mode; NVIDIA's own health
monitor allows 45 s per probe, cheap queries 5-10 s (docs/gpu.md)."""

DEFAULT_EVENT_WAIT_S = 1.0
"""One ``nvmlEventSetWait_v2`` wait (docs/gpu.md: ~1 s); it is clamped to half the call deadline so
that a hang inside the wait is still reported within ``call_deadline_s``."""

MAX_EVENTS_PER_DRAIN = 64
"""XID events read in one go; the rest wait for the next drain (an XID storm cannot pin us)."""

MAX_FAULTS_KEPT = 64
"""Faults listed by :meth:`HealthMonitor.status`; later ones are still reported and counted."""


class FaultKind(enum.StrEnum):
    XID = "xid"
    ECC_UNCORRECTABLE = "ecc_uncorrectable"
    REMAP_PENDING = "remap_pending"
    REMAP_FAILED = "remap_failed"
    RETIRED_PAGES_PENDING = "retired_pages_pending"
    GPU_LOST = "gpu_lost"
    RECOVERY_ACTION = "recovery_action"
    NVML_HANG = "nvml_hang"
    THROTTLE = "throttle"  # always Severity.WARN


class Severity(enum.StrEnum):
    MIGRATE = "migrate"  # ask to be replaced proactively, serving our own state
    WARN = "warn"  # keep training; input for the straggler policy


@dataclasses.dataclass(frozen=True)
class HealthFault:
    """One GPU health fault. ``at`` is in the monitor's clock (monotonic seconds)."""

    kind: FaultKind
    detail: str
    severity: Severity
    at: float

    def to_dict(self) -> dict[str, Any]:
        return {"kind": str(self.kind), "detail": self.detail, "severity": str(self.severity),
                "at": self.at}


def resolve_device(env: Mapping[str, str]) -> tuple[int | str | None, str]:
    """The NVML device of this process: an index, a UUID, or ``None`` when none is visible.

    ``LOCAL_RANK`` (default 0) picks an entry of ``CUDA_VISIBLE_DEVICES`` when that is set;
    entries are NVML indices or ``GPU-``/``MIG-`` UUIDs. NVML itself ignores
    ``CUDA_VISIBLE_DEVICES`` and numbers GPUs in PCI bus order, which is the CUDA order under
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (and on a node of identical GPUs). Returns the device and
    a reason that says how it was chosen.
    """
    raw_rank = env.get("LOCAL_RANK", "0").strip() or "0"
    try:
        local_rank = int(raw_rank)
    except ValueError:
        return None, f"LOCAL_RANK={raw_rank!r} is not an integer"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return local_rank, f"LOCAL_RANK={local_rank}"
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    # CUDA stops at the first invalid entry; "-1" or "" hides every GPU.
    usable: list[str] = []
    for entry in entries:
        if entry.startswith(("GPU-", "MIG-")) or entry.isdigit():
            usable.append(entry)
        else:
            break
    if not 0 <= local_rank < len(usable):
        return None, (f"CUDA_VISIBLE_DEVICES={visible!r} shows no GPU for "
                      f"LOCAL_RANK={local_rank}")
    chosen = usable[local_rank]
    how = f"CUDA_VISIBLE_DEVICES={visible!r}[LOCAL_RANK={local_rank}]"
    return (int(chosen) if chosen.isdigit() else chosen), how


# --- the deadline-bound call runner ----------------------------------------------------------


class _Hung(Exception):
    def __init__(self, call: str, deadline_s: float) -> None:
        super().__init__(f"{call} did not return within {deadline_s:g} s")
        self.call = call
        self.deadline_s = deadline_s


class _Busy(Exception):
    """An earlier call is still stuck in NVML; nothing new was started."""


class _Closed(Exception):
    """The runner was closed (the monitor stopped)."""


class _Job:
    __slots__ = ("args", "done", "error", "fn", "name", "result")

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.name = name
        self.fn = fn
        self.args = args
        self.done = False
        self.result: Any = None
        self.error: Exception | None = None


class _CallRunner:
    """One daemon thread that makes NVML calls one at a time; askers wait with a deadline.

    A call past its deadline is abandoned, not cancelled (a thread cannot be): the thread stays
    in it and :meth:`call` raises :class:`_Busy` until it comes back, so at most one thread is
    ever stuck in NVML per monitor.
    """

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._cond = threading.Condition()
        self._pending: _Job | None = None
        self._running: _Job | None = None
        self._closed = False
        self._finalizer: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None

    def call(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
             deadline_s: float) -> Any:
        job = _Job(name, fn, args)
        with self._cond:
            if self._closed:
                raise _Closed
            if self._running is not None or self._pending is not None:
                raise _Busy
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._thread_name,
                                                daemon=True)
                self._thread.start()
            self._pending = job
            self._cond.notify_all()
            self._cond.wait_for(lambda: job.done or self._closed, timeout=deadline_s)
            if not job.done:
                if self._closed:
                    raise _Closed
                raise _Hung(name, deadline_s)
        if job.error is not None:
            raise job.error
        return job.result

    @property
    def stuck(self) -> bool:
        with self._cond:
            return self._running is not None or self._pending is not None

    def close(self, finalizer: Callable[[], None] | None = None) -> None:
        """Refuse new calls and wake every waiter (it raises :class:`_Closed`) at once.

        The thread finishes the call it is in, if any (a stuck one: whenever NVML lets go),
        then runs ``finalizer`` on itself and exits; nobody waits for either.
        """
        with self._cond:
            self._closed = True
            self._pending = None
            self._finalizer = finalizer  # no thread yet: NVML was never called, nothing to undo
            self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    break  # closed and idle
                job, self._pending = self._pending, None
                self._running = job
            try:
                job.result = job.fn(*job.args)
            except Exception as exc:  # handed to the asker, who may be gone
                job.error = exc
            with self._cond:
                job.done = True
                self._running = None
                self._cond.notify_all()
        if self._finalizer is not None:
            try:
                self._finalizer()
            except Exception:
                log.debug("NVML finalizer failed", exc_info=True)


# --- the monitor ------------------------------------------------------------------------------

_Found = list[tuple[tuple[Any, ...], HealthFault]]  # (dedup key, fault) found by one round


class HealthMonitor:
    """Watches one GPU through NVML; see the module docstring.

    ``nvml`` is the ``pynvml`` module or a :class:`~torchpass_p2p.testing.fake_nvml.FakeNvml`;
    ``None`` imports ``pynvml`` lazily (first poll). ``device_index`` ``None`` picks the device
    from ``LOCAL_RANK`` and ``CUDA_VISIBLE_DEVICES`` in ``env`` (default ``os.environ``), see
    :func:`resolve_device`. ``clock`` only stamps faults and polls; waits use real time.
    """

    def __init__(self, *, nvml: Any = None, device_index: int | None = None,
                 interval_s: float = 5.0, call_deadline_s: float = 8.0,
                 clock: Callable[[], float] = time.monotonic,
                 init_deadline_s: float = DEFAULT_INIT_DEADLINE_S,
                 event_wait_s: float = DEFAULT_EVENT_WAIT_S,
                 env: Mapping[str, str] | None = None) -> None:
        if interval_s <= 0 or call_deadline_s <= 0 or init_deadline_s <= 0 or event_wait_s < 0:
            raise ValueError("interval_s, call_deadline_s and init_deadline_s must be > 0, "
                             "event_wait_s >= 0")
        if device_index is not None and device_index < 0:
            raise ValueError(f"device_index must be >= 0, not {device_index}")
        self._nvml = nvml
        self._device_index = device_index
        self._interval_s = interval_s
        self._call_deadline_s = call_deadline_s
        self._init_deadline_s = init_deadline_s
        self._event_wait_s = min(event_wait_s, call_deadline_s / 2)
        self._clock = clock
        self._env = env
        self._runner = _CallRunner("torchpass-nvml-call")
        self._poll_lock = threading.Lock()  # one round at a time; never held by status()
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._on_fault: Callable[[HealthFault], None] | None = None
        # Owned by the polling thread (under _poll_lock):
        self._nvml_initialized = False
        self._handle: Any = None
        self._event_set: Any = None
        # Read by status() (under _state_lock):
        self._state_lock = threading.Lock()
        self._state = "idle"  # idle | running | disabled | stopped
        self._reason: str | None = None
        self._device: dict[str, Any] = {"index": device_index, "name": None, "uuid": None}
        self._last_poll_at: float | None = None
        self._temperature_c: int | None = None
        self._margin_c: int | None = None
        self._throttle: list[str] = []
        self._ecc_uncorrected: int | None = None
        self._remapped_rows: dict[str, int] | None = None
        self._recovery_action: int | None = None
        self._xid_counts: collections.Counter[int] = collections.Counter()
        self._unsupported: set[str] = set()
        self._stuck: dict[str, Any] | None = None
        self._last_error: str | None = None
        self._lost = False
        self._seen: set[tuple[Any, ...]] = set()
        self._faults: list[HealthFault] = []
        self._fault_count = 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, on_fault: Callable[[HealthFault], None]) -> None:
        """Start the worker thread and return at once; ``on_fault`` runs on monitor threads."""
        with self._state_lock:
            if self._worker is not None or self._state == "stopped":
                raise RuntimeError("HealthMonitor.start() may be called once")
            self._on_fault = on_fault
            self._worker = threading.Thread(target=self._run, name="torchpass-gpu-health",
                                            daemon=True)
            self._worker.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop polling and return at once (within ``timeout_s``); True when the worker exited.

        A waiting worker is woken, so this is prompt even from an event loop. A call in
        flight cannot be interrupted: its thread finishes it (a stuck one is abandoned as a
        daemon thread and ends whenever NVML lets go), then frees the event set and calls
        ``nvmlShutdown`` on its own; nobody waits for that.
        """
        self._stop.set()
        with self._state_lock:
            worker = self._worker
            if self._state != "disabled":
                self._state = "stopped"
        self._runner.close(self._finalize)
        if worker is None:
            return True
        worker.join(timeout_s)
        return not worker.is_alive()

    # -- polling ---------------------------------------------------------------------------

    def poll_once(self) -> list[HealthFault]:
        """Run every check once and return the faults not reported before (also to on_fault).

        Bounded in time: each NVML call waits at most its deadline. Never raises for a GPU or
        NVML problem; those become faults or a disabled status.
        """
        with self._poll_lock:
            new = self._guarded(self._poll_body)
            with self._state_lock:
                self._last_poll_at = self._clock()
        self._emit(new)
        return new

    def _wait_events(self, wait_s: float) -> None:
        with self._poll_lock:
            new = self._guarded(lambda found: self._drain_xids(found, wait_s))
        self._emit(new)

    def _guarded(self, body: Callable[[_Found], None]) -> list[HealthFault]:
        """Run one round, turning hangs, a lost GPU and a required reset into faults."""
        found: _Found = []
        with self._state_lock:
            if self._state in ("disabled", "stopped"):
                return []
        try:
            body(found)
        except _Hung as hung:
            with self._state_lock:
                self._stuck = {"call": hung.call, "since": self._clock()}
            found.append(((FaultKind.NVML_HANG,), self._fault(
                FaultKind.NVML_HANG, Severity.MIGRATE,
                f"{hung} and is still blocked (a missed NVML deadline is a health failure in "
                f"itself)")))
        except (_Busy, _Closed):
            pass  # the stuck call was reported when it missed its deadline
        except Exception as exc:
            nvml = self._nvml  # imported by the body when it was None
            if nvml is None or not isinstance(exc, nvml.NVMLError):
                raise
            if isinstance(exc, nvml.NVMLError_GpuIsLost):
                self._lost = True
                found.append(((FaultKind.GPU_LOST,), self._fault(
                    FaultKind.GPU_LOST, Severity.MIGRATE,
                    "NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus")))
            elif isinstance(exc, nvml.NVMLError_ResetRequired):
                found.append(((FaultKind.RECOVERY_ACTION, "reset_required"), self._fault(
                    FaultKind.RECOVERY_ACTION, Severity.MIGRATE,
                    "NVML_ERROR_RESET_REQUIRED: the GPU requires a reset")))
            else:
                self._note_error("poll", exc)
        return self._record(found)

    def _poll_body(self, found: _Found) -> None:
        if self._handle is None and not self._setup():
            return
        h = self._handle
        self._drain_xids(found, 0.0)
        self._check_ecc(h, found)
        self._check_remap(h, found)
        self._check_recovery_action(h, found)
        self._check_clocks(h, found)
        self._check_temperature(h)

    def _setup(self) -> bool:
        """Init NVML and find our GPU; False (and disabled, with a reason) when there is none."""
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                return self._disable(f"pynvml (nvidia-ml-py) is not importable: {exc}")
        nvml = self._nvml
        if not self._nvml_initialized:
            try:
                self._call("nvmlInit", fn=self._init_nvml, deadline_s=self._init_deadline_s)
            except (nvml.NVMLError_GpuIsLost, nvml.NVMLError_ResetRequired):
                raise
            except nvml.NVMLError as exc:
                return self._disable(f"NVML unavailable: {type(exc).__name__}: {exc}")
        if self._device_index is not None:
            target: int | str | None = self._device_index
            how = "device_index argument"
        else:
            target, how = resolve_device(os.environ if self._env is None else self._env)
        if target is None:
            return self._disable(f"no GPU for this process: {how}")
        try:
            count = self._call("nvmlDeviceGetCount")
            if count == 0:
                return self._disable("NVML sees no GPU")
            if isinstance(target, int):
                if target >= count:
                    return self._disable(f"GPU {target} ({how}) is absent: NVML sees {count}")
                handle = self._call("nvmlDeviceGetHandleByIndex", target)
            else:
                handle = self._call("nvmlDeviceGetHandleByUUID", target)
        except (nvml.NVMLError_NotFound, nvml.NVMLError_InvalidArgument) as exc:
            return self._disable(f"GPU {target!r} ({how}) not found: {exc}")
        index = self._query("index", "nvmlDeviceGetIndex", handle)
        name = self._query("name", "nvmlDeviceGetName", handle)
        uuid = self._query("uuid", "nvmlDeviceGetUUID", handle)
        with self._state_lock:
            self._device = {"index": index if index is not None else target,
                            "name": _text(name), "uuid": _text(uuid)}
            if self._state == "idle":
                self._state = "running"
        self._handle = handle
        self._register_xid_events(handle)
        return True

    def _register_xid_events(self, handle: Any) -> None:
        nvml = self._nvml
        event_set = self._query("xid", "nvmlEventSetCreate")
        if event_set is None:
            return
        registered = self._query("xid", "nvmlDeviceRegisterEvents", handle,
                                 nvml.nvmlEventTypeXidCriticalError, event_set, none_ok=True)
        if registered is _FAILED:
            try:
                self._call("nvmlEventSetFree", event_set)
            except (nvml.NVMLError_GpuIsLost, nvml.NVMLError_ResetRequired):
                raise
            except nvml.NVMLError as exc:
                self._note_error("xid", exc)
            return
        self._event_set = event_set

    # -- the checks ----------------------------------------------------------------------------

    def _drain_xids(self, found: _Found, wait_s: float) -> None:
        """Read queued XID events; the first read waits up to ``wait_s``."""
        if self._event_set is None or self._lost:
            return
        nvml = self._nvml
        wait_ms = int(wait_s * 1000)
        for _ in range(MAX_EVENTS_PER_DRAIN):
            try:
                data = self._call("nvmlEventSetWait_v2", self._event_set, wait_ms)
            except nvml.NVMLError_Timeout:
                return
            except (nvml.NVMLError_GpuIsLost, nvml.NVMLError_ResetRequired):
                raise
            except nvml.NVMLError as exc:
                self._note_error("xid", exc)
                return
            wait_ms = 0
            if not int(data.eventType) & nvml.nvmlEventTypeXidCriticalError:
                continue
            xid = int(data.eventData)
            with self._state_lock:
                self._xid_counts[xid] += 1
            found.append(((FaultKind.XID, xid), self._xid_fault(xid)))

    def _xid_fault(self, xid: int) -> HealthFault:
        if xid in FATAL_XIDS:
            return self._fault(FaultKind.XID, Severity.MIGRATE,
                               f"XID {xid}: fatal in NVIDIA's XID catalog")
        if xid in CONTAINED_XIDS:
            return self._fault(FaultKind.XID, Severity.MIGRATE,
                               f"XID {xid}: contained error, the application must restart "
                               f"(GPU reset later)")
        if xid in TREND_XIDS:
            return self._fault(FaultKind.XID, Severity.WARN,
                               f"XID {xid}: a trend to watch (memory remapping/ECC)")
        return self._fault(FaultKind.XID, Severity.WARN,
                           f"XID {xid}: not in the fatal list")

    def _check_ecc(self, h: Any, found: _Found) -> None:
        nvml = self._nvml
        count = self._query("ecc", "nvmlDeviceGetTotalEccErrors", h,
                            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        if count is None:
            return
        with self._state_lock:
            self._ecc_uncorrected = int(count)
        if count > 0:
            found.append(((FaultKind.ECC_UNCORRECTABLE,), self._fault(
                FaultKind.ECC_UNCORRECTABLE, Severity.MIGRATE,
                f"{count} uncorrectable ECC error(s) (volatile counter, since the last driver "
                f"load or reset)")))

    def _check_remap(self, h: Any, found: _Found) -> None:
        if "remapped_rows" not in self._unsupported:
            rows = self._query("remapped_rows", "nvmlDeviceGetRemappedRows", h)
            if rows is not None:
                correctable, uncorrectable, pending, failure = (int(v) for v in rows)
                with self._state_lock:
                    self._remapped_rows = {"correctable": correctable,
                                           "uncorrectable": uncorrectable,
                                           "pending": pending, "failure": failure}
                if failure:
                    found.append(((FaultKind.REMAP_FAILED,), self._fault(
                        FaultKind.REMAP_FAILED, Severity.MIGRATE,
                        "row remapping failed: replace the GPU")))
                if pending:
                    found.append(((FaultKind.REMAP_PENDING,), self._fault(
                        FaultKind.REMAP_PENDING, Severity.MIGRATE,
                        "row remap pending: reset the GPU at the next window")))
                return
            if "remapped_rows" not in self._unsupported:
                return  # an error other than NotSupported; try again next poll
        pending_pages = self._query("retired_pages", "nvmlDeviceGetRetiredPagesPendingStatus", h)
        if pending_pages:
            found.append(((FaultKind.RETIRED_PAGES_PENDING,), self._fault(
                FaultKind.RETIRED_PAGES_PENDING, Severity.MIGRATE,
                "page retirement pending: reset the GPU")))

    def _check_recovery_action(self, h: Any, found: _Found) -> None:
        nvml = self._nvml
        values = self._query("recovery_action", "nvmlDeviceGetFieldValues", h,
                             [RECOVERY_ACTION_FIELD])
        if values is None:
            return
        entry = values[0]
        if entry.nvmlReturn != nvml.NVML_SUCCESS:
            if entry.nvmlReturn == nvml.NVML_ERROR_NOT_SUPPORTED:
                with self._state_lock:
                    self._unsupported.add("recovery_action")
            return
        attr = _VALUE_ATTR.get(int(entry.valueType))
        if attr is None:
            self._note_error("recovery_action", f"unknown valueType {entry.valueType}")
            return
        action = int(getattr(entry.value, attr))
        with self._state_lock:
            self._recovery_action = action
        if action == 0:
            return
        meaning = RECOVERY_ACTIONS.get(action, "unknown value >= 5: needs reset/reboot")
        found.append(((FaultKind.RECOVERY_ACTION, action), self._fault(
            FaultKind.RECOVERY_ACTION, Severity.MIGRATE,
            f"NVML recovery action {action} ({meaning})")))

    def _check_clocks(self, h: Any, found: _Found) -> None:
        reasons = self._query("clocks_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", h)
        if reasons is None:
            return
        reasons = int(reasons)
        names = [name for bit, name in sorted({**STRAGGLE_REASONS, **_OTHER_REASONS}.items())
                 if reasons & bit]
        with self._state_lock:
            self._throttle = names
        for bit, name in sorted(STRAGGLE_REASONS.items()):
            if reasons & bit:
                found.append(((FaultKind.THROTTLE, name), self._fault(
                    FaultKind.THROTTLE, Severity.WARN,
                    f"clocks reduced by {name} (0x{bit:x}): this GPU will straggle")))

    def _check_temperature(self, h: Any) -> None:
        nvml = self._nvml
        temp = self._query("temperature", "nvmlDeviceGetTemperatureV", h,
                           nvml.NVML_TEMPERATURE_GPU)
        margin = self._query("margin_temperature", "nvmlDeviceGetMarginTemperature", h)
        with self._state_lock:
            self._temperature_c = None if temp is None else int(temp)
            self._margin_c = None if margin is None else int(margin)

    # -- NVML plumbing -----------------------------------------------------------------------

    def _call(self, name: str, *args: Any, deadline_s: float | None = None,
              fn: Callable[..., Any] | None = None) -> Any:
        if fn is None:
            fn = getattr(self._nvml, name)
        result = self._runner.call(name, fn, args,
                                   self._call_deadline_s if deadline_s is None else deadline_s)
        if self._stuck is not None:
            with self._state_lock:
                self._stuck = None  # the runner was free again
        return result

    def _query(self, check: str, name: str, *args: Any, none_ok: bool = False) -> Any:
        """Call, answering None when ``check`` is unsupported or failed for another reason.

        A lost GPU, a required reset and a hang propagate to :meth:`_guarded`. With
        ``none_ok`` (a call that returns None on success) failure answers :data:`_FAILED`.
        """
        nvml = self._nvml
        failed = _FAILED if none_ok else None
        if check in self._unsupported:
            return failed
        try:
            return self._call(name, *args)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
            with self._state_lock:
                self._unsupported.add(check)
            return failed
        except (nvml.NVMLError_GpuIsLost, nvml.NVMLError_ResetRequired):
            raise
        except nvml.NVMLError as exc:
            self._note_error(check, exc)
            return failed

    def _init_nvml(self) -> None:
        """``nvmlInit`` on the call thread, which also records it (for :meth:`_finalize`)."""
        self._nvml.nvmlInit()
        self._nvml_initialized = True

    def _finalize(self) -> None:
        """Runs on the call thread after :meth:`stop`, once it is idle: undo what setup did."""
        if not self._nvml_initialized:
            return
        nvml = self._nvml
        event_set, self._event_set = self._event_set, None
        if event_set is not None:
            try:
                nvml.nvmlEventSetFree(event_set)
            except nvml.NVMLError as exc:
                log.debug("nvmlEventSetFree failed: %s", exc)
        self._nvml_initialized = False
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    # -- worker --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll_once()
                if self._disabled():
                    return
                next_at = time.monotonic() + self._interval_s
                while not self._stop.is_set():
                    remaining = next_at - time.monotonic()
                    if remaining <= 0:
                        break
                    if self._event_set is None or self._lost or self._runner.stuck:
                        self._stop.wait(remaining)
                    else:
                        self._wait_events(min(self._event_wait_s, remaining))
        except Exception:  # a bug here must not end health silently
            log.exception("GPU health worker failed")
            with self._state_lock:
                self._last_error = "worker failed; see the log"

    # -- bookkeeping -------------------------------------------------------------------------

    def _fault(self, kind: FaultKind, severity: Severity, detail: str) -> HealthFault:
        return HealthFault(kind=kind, detail=detail, severity=severity, at=self._clock())

    def _record(self, found: _Found) -> list[HealthFault]:
        new: list[HealthFault] = []
        with self._state_lock:
            for key, fault in found:
                if key in self._seen:
                    continue
                self._seen.add(key)
                self._fault_count += 1
                if len(self._faults) < MAX_FAULTS_KEPT:
                    self._faults.append(fault)
                new.append(fault)
        for fault in new:
            log.warning("GPU health fault %s (%s): %s", fault.kind, fault.severity, fault.detail)
        return new

    def _emit(self, faults: list[HealthFault]) -> None:
        callback = self._on_fault
        if callback is None:
            return
        for fault in faults:
            try:
                callback(fault)
            except Exception:
                log.exception("on_fault callback failed for %s", fault.kind)

    def _disable(self, reason: str) -> bool:
        log.info("GPU health monitoring disabled: %s", reason)
        with self._state_lock:
            self._state = "disabled"
            self._reason = reason
        return False

    def _disabled(self) -> bool:
        with self._state_lock:
            return self._state == "disabled"

    def _note_error(self, check: str, exc: object) -> None:
        with self._state_lock:
            self._last_error = f"{check}: {type(exc).__name__}: {exc}"

    def status(self) -> dict[str, Any]:
        """A JSON-able snapshot for ``/status``; thread-safe, never touches NVML."""
        with self._state_lock:
            return {
                "enabled": self._state != "disabled",
                "state": self._state,
                "reason": self._reason,
                "device": dict(self._device),
                "last_poll_at": self._last_poll_at,
                "temperature_c": self._temperature_c,
                "margin_temperature_c": self._margin_c,
                "throttle_reasons": list(self._throttle),
                "ecc_uncorrected_volatile": self._ecc_uncorrected,
                "remapped_rows": None if self._remapped_rows is None else dict(
                    self._remapped_rows),
                "recovery_action": self._recovery_action,
                "xid_counts": {str(x): n for x, n in sorted(self._xid_counts.items())},
                "unsupported": sorted(self._unsupported),
                "stuck_call": None if self._stuck is None else dict(self._stuck),
                "last_error": self._last_error,
                "fault_count": self._fault_count,
                "faults": [f.to_dict() for f in self._faults],
            }


_FAILED = object()  # _query(none_ok=True) failed


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
