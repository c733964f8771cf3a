"""A scriptable stand-in for the ``pynvml`` module, for tests and the simulator (S05, S18).

:class:`FakeNvml` is module-like: it has the functions :mod:`torchpass_p2p.agent.health` calls,
under the same names and signatures, and it carries ``pynvml``'s own constants and error
classes (copied from the installed ``nvidia-ml-py``, which imports without a driver), so an
error the fake raises is the very class the real binding raises (``NVMLError(code)`` maps the
code to its subclass). Struct results are the binding's ctypes structs too
(``c_nvmlFieldValue_t``, ``c_nvmlEventData_t``).

Scripting, all thread-safe::

    nvml = FakeNvml()                      # one healthy GPU
    nvml.gpu.ecc_uncorrected = 2           # volatile uncorrectable ECC count
    nvml.gpu.remapped_rows = (0, 1, 1, 0)  # (correctable, uncorrectable, pending, failure)
    nvml.gpu.remapped_rows = None          # pre-Ampere: NotSupported, use retired pages
    nvml.gpu.recovery_action = 4           # field 230 (4: NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET)
    nvml.gpu.clocks_event_reasons = 0x40   # HwThermalSlowdown
    nvml.gpu.lost = True                   # every call on this GPU raises NVMLError_GpuIsLost
    nvml.push_xid(79)                      # an XID event for every registered event set
    nvml.hang(60.0)                        # every later call blocks 60 s (S05) ...
    nvml.release()                         # ... until released (do this in test teardown)
    nvml.fail("nvmlInit", nvml.NVML_ERROR_LIBRARY_NOT_FOUND)   # no driver

``calls`` counts calls by name and ``blocked`` says how many calls are inside a hang right now,
so a test can prove a call is still stuck while the monitor has already reported it.
The fake has no randomness and no clock of its own; hangs are real ``Event.wait`` timeouts.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterable
from typing import Any

import pynvml

__all__ = ["FakeGpu", "FakeNvml"]


@dataclasses.dataclass(eq=False)  # handles compare by identity, as real handles do
class FakeGpu:
    """The scripted state of one fake GPU; it is also the device handle the fake hands out.

    ``None`` in a queryable field means the query raises ``NVMLError_NotSupported``, as it does
    on a GPU without that feature (ECC off, no row remapper before Ampere, old driver).
    """

    index: int
    name: str = "NVIDIA H200 (fake)"
    uuid: str = ""
    ecc_uncorrected: int | None = 0
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    retired_pages_pending: bool | None = False
    recovery_action: int | None = 0
    recovery_action_value_type: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    clocks_event_reasons: int = 0
    temperature_c: int | None = 45
    margin_c: int | None = 40
    xid_events_supported: bool = True
    lost: bool = False

    def __post_init__(self) -> None:
        if not self.uuid:
            self.uuid = f"GPU-00000000-fake-0000-0000-{self.index:012d}"


class _EventSet:
    def __init__(self) -> None:
        self.devices: dict[int, int] = {}  # id(FakeGpu) -> registered event mask
        self.queue: collections.deque[tuple[FakeGpu, int, int]] = collections.deque(maxlen=1024)
        self.freed = False


class FakeNvml:
    """Module-like fake of ``pynvml``; see the module docstring for the scripting API."""

    def __init__(self, gpus: int = 1) -> None:
        self._cond = threading.Condition()
        self.gpus: list[FakeGpu] = [FakeGpu(index=i) for i in range(gpus)]
        self.calls: collections.Counter[str] = collections.Counter()
        self._init_count = 0
        self._event_sets: list[_EventSet] = []
        self._failures: dict[str, int] = {}
        self._hang_s = 0.0
        self._hang_calls: frozenset[str] | None = None
        self._released = threading.Event()
        self._blocked = 0

    # -- scripting --------------------------------------------------------------------------

    @property
    def gpu(self) -> FakeGpu:
        """GPU 0, the usual subject of a test."""
        return self.gpus[0]

    def hang(self, seconds: float, calls: Iterable[str] | None = None) -> None:
        """Make every later call (or only those named in ``calls``) block ``seconds`` first."""
        with self._cond:
            self._hang_s = seconds
            self._hang_calls = frozenset(calls) if calls is not None else None
            self._released = threading.Event()

    def release(self) -> None:
        """End the hang: blocked calls return now, later calls do not block."""
        with self._cond:
            self._hang_s = 0.0
            self._released.set()

    def fail(self, call: str, error_code: int) -> None:
        """Make every later call of ``call`` raise ``NVMLError(error_code)`` (its subclass)."""
        with self._cond:
            self._failures[call] = error_code

    def clear_failure(self, call: str) -> None:
        with self._cond:
            self._failures.pop(call, None)

    def push_xid(self, xid: int, device: int = 0) -> None:
        """Deliver XID ``xid`` of GPU ``device`` to every event set registered for XIDs."""
        gpu = self.gpus[device]
        with self._cond:
            for es in self._event_sets:
                mask = es.devices.get(id(gpu), 0)
                if not es.freed and mask & pynvml.nvmlEventTypeXidCriticalError:
                    es.queue.append((gpu, pynvml.nvmlEventTypeXidCriticalError, xid))
            self._cond.notify_all()

    @property
    def blocked(self) -> int:
        """How many calls are inside a scripted hang at this moment."""
        with self._cond:
            return self._blocked

    @property
    def initialized(self) -> bool:
        with self._cond:
            return self._init_count > 0

    # -- the shared entry of every fake call --------------------------------------------------

    def _enter(self, name: str, gpu: FakeGpu | None = None, *, needs_init: bool = True) -> None:
        with self._cond:
            self.calls[name] += 1
            hang_s = self._hang_s
            if self._hang_calls is not None and name not in self._hang_calls:
                hang_s = 0.0
            released = self._released
            if hang_s > 0:
                self._blocked += 1
        if hang_s > 0:
            try:
                released.wait(hang_s)
            finally:
                with self._cond:
                    self._blocked -= 1
        with self._cond:
            code = self._failures.get(name)
            initialized = self._init_count > 0
        if code is not None:
            raise pynvml.NVMLError(code)
        if needs_init and not initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if gpu is not None and gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    @staticmethod
    def _supported(value: Any) -> Any:
        if value is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    # -- the pynvml functions the health monitor uses -----------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", needs_init=False)
        with self._cond:
            self._init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        with self._cond:
            self._init_count -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeGpu:
        self._enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self.gpus:
            if gpu.uuid == text:
                return gpu
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        self._enter("nvmlDeviceGetName", handle)
        return handle.name

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlEventSetCreate(self) -> _EventSet:
        self._enter("nvmlEventSetCreate")
        es = _EventSet()
        with self._cond:
            self._event_sets.append(es)
        return es

    def nvmlDeviceRegisterEvents(self, handle: FakeGpu, event_types: int, event_set: _EventSet
                                 ) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)
        if not handle.xid_events_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._cond:
            event_set.devices[id(handle)] = event_set.devices.get(id(handle), 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeoutms: int) -> Any:
        """Wait up to ``timeoutms`` for an event; none: ``NVMLError_Timeout``, as NVML does."""
        self._enter("nvmlEventSetWait_v2")
        with self._cond:
            self._cond.wait_for(lambda: bool(event_set.queue), timeout=timeoutms / 1000)
            if not event_set.queue:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            _gpu, event_type, xid = event_set.queue.popleft()
        data = pynvml.c_nvmlEventData_t()
        data.eventType = event_type
        data.eventData = xid
        return data

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._enter("nvmlEventSetFree")
        with self._cond:
            event_set.freed = True
            self._event_sets.remove(event_set)

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeGpu, error_type: int, counter_type: int
                                    ) -> int:
        self._enter("nvmlDeviceGetTotalEccErrors", handle)
        if (error_type, counter_type) != (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                          pynvml.NVML_VOLATILE_ECC):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # only this one is scripted
        return int(self._supported(handle.ecc_uncorrected))

    def nvmlDeviceGetRemappedRows(self, handle: FakeGpu) -> tuple[int, int, int, int]:
        self._enter("nvmlDeviceGetRemappedRows", handle)
        return tuple(self._supported(handle.remapped_rows))  # type: ignore[return-value]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        pending = self._supported(handle.retired_pages_pending)
        return pynvml.NVML_FEATURE_ENABLED if pending else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetFieldValues(self, handle: FakeGpu, field_ids: list[int]) -> Any:
        """Only field 230 (recovery action) is scripted; others answer NOT_SUPPORTED per entry."""
        self._enter("nvmlDeviceGetFieldValues", handle)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for entry, field_id in zip(values, field_ids, strict=True):
            entry.fieldId = field_id
            if field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and (
                    handle.recovery_action is not None):
                entry.nvmlReturn = pynvml.NVML_SUCCESS
                entry.valueType = handle.recovery_action_value_type
                attr = {pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
                        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
                        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
                        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
                        pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal"}[entry.valueType]
                setattr(entry.value, attr, handle.recovery_action)
            else:
                entry.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return handle.clocks_event_reasons

    def nvmlDeviceGetTemperatureV(self, handle: FakeGpu, sensor: int,
                                  version: int = pynvml.nvmlTemperature_v1) -> int:
        self._enter("nvmlDeviceGetTemperatureV", handle)
        return int(self._supported(handle.temperature_c))

    def nvmlDeviceGetMarginTemperature(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetMarginTemperature", handle)
        return int(self._supported(handle.margin_c))


def _copy_binding_names() -> None:
    """Give the fake every constant and error class of the installed ``pynvml``."""
    for name in dir(pynvml):
        value = getattr(pynvml, name)
        if name.startswith("NVMLError") and isinstance(value, type):
            setattr(FakeNvml, name, value)
        elif (name.startswith(("NVML_", "nvml")) and isinstance(value, int)
              and not isinstance(value, bool) and not hasattr(FakeNvml, name)):
            setattr(FakeNvml, name, value)


_copy_binding_names()
