"""A fake ``pynvml`` for tests on machines without an NVIDIA GPU.

It speaks the documented nvidia-ml-py API the inventory uses, with the same names and the same
error classes: ``NVMLError(value)`` maps to a subclass by error code (``NVMLError_LibraryNotFound``,
``NVMLError_InvalidArgument``, ...), calls before ``nvmlInit`` raise ``NVMLError_Uninitialized``,
``nvmlDeviceGetName``/``nvmlDeviceGetUUID`` return ``str``, memory info has ``total``/``free``/``used``
and processes have ``pid``/``usedGpuMemory``.

Install it with ``monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(devices))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
}


class NVMLError(Exception):
    """As in pynvml: ``NVMLError(code)`` builds the subclass for that code; ``.value`` is the code."""

    _valClassMapping: dict[int, type] = {}

    def __new__(cls, value: int):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


def _error_class(name: str, code: int) -> type:
    cls = type(name, (NVMLError,), {})
    NVMLError._valClassMapping[code] = cls
    return cls


NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_DriverNotLoaded = _error_class("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_LibraryNotFound = _error_class("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)


@dataclass
class FakeDevice:
    name: str
    uuid: str
    minor: int
    total: int
    used: int = 0
    compute: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, usedGpuMemory)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)


class FakeNvml:
    """A stand-in for the ``pynvml`` module: the functions are methods, the error classes attributes."""

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound

    def __init__(self, devices: list[FakeDevice], *, init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error  # e.g. NVML_ERROR_DRIVER_NOT_LOADED: nvmlInit fails like that
        self.init_count = 0  # nvmlInit/nvmlShutdown are reference counted, as in NVML

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._ready()
        self.init_count -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._ready()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        self._ready()
        if not 0 <= index < len(self.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.devices[index]

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str:
        self._ready()
        return handle.name

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        self._ready()
        return handle.uuid

    def nvmlDeviceGetMinorNumber(self, handle: FakeDevice) -> int:
        self._ready()
        return handle.minor

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> SimpleNamespace:
        self._ready()
        return SimpleNamespace(total=handle.total, free=handle.total - handle.used, used=handle.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[SimpleNamespace]:
        self._ready()
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.compute]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeDevice) -> list[SimpleNamespace]:
        self._ready()
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.graphics]

    def _ready(self) -> None:
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)


# -- engines starting on a fake card ----------------------------------------------------------------

class EngineStartFailed(RuntimeError):
    """What a real engine raises (and dies of) when the card lacks the memory it asked for."""


# The CUDA context NVML counts to a process beyond its own allocations: 595 MiB, measured on an
# NVIDIA H200 (driver 580.159.04, CUDA 13) with cuBLAS and the kernels loaded (docs/gpu-check.md,
# "Last run": "NVML showed each process 595 MiB beyond llama-server's own account: the CUDA context").
CUDA_CONTEXT = 595 << 20


def start_like_vllm(device: FakeDevice, pid: int, fraction: float, *, context: int = CUDA_CONTEXT) -> int:
    """Start a vLLM worker with ``--gpu-memory-utilization fraction`` on ``device`` as vLLM 0.32.0
    does: its CUDA context exists first, then ``request_memory`` (vllm/v1/worker/utils.py) asks for
    ``ceil(total * fraction)`` and raises ValueError("Free memory on device ... is less than desired
    GPU memory utilization") when the free memory is smaller; otherwise the worker ends up holding
    that budget in all (weights, activations and KV cache fill it, its context included:
    determine_available_memory, vllm/v1/worker/gpu_worker.py). Returns the bytes it holds."""
    if not 0 < fraction <= 1:
        raise EngineStartFailed(f"gpu_memory_utilization must be in (0, 1], got {fraction}")  # CacheConfig: gt=0, le=1
    free_after_context = device.total - device.used - context
    if free_after_context < 0:
        raise EngineStartFailed("CUDA out of memory while creating the context")
    requested = math.ceil(device.total * fraction)
    if free_after_context < requested:
        raise EngineStartFailed(
            f"Free memory on device ({free_after_context / 2**30:.2f}/{device.total / 2**30:.2f} GiB) on startup "
            f"is less than desired GPU memory utilization ({fraction}, {requested / 2**30:.2f} GiB).")
    device.used += requested
    device.compute.append((pid, requested))
    return requested
