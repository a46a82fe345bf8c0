"""What a host has: its GPUs through NVML (``import pynvml``, from nvidia-ml-py), its RAM and CPUs.

Its CPUs are the ones this process may run on (its affinity, which a cpuset or CPUAffinity= of
the daemon's own unit narrows), grouped into cores by the kernel's topology (each CPU's
``thread_siblings_list``): a core is one CPU id without SMT, its hardware threads with it.

A host where NVML cannot start (no driver, no library, nvidia-ml-py missing) is a CPU host: its
inventory has no GPUs and says why in ``nvml_error``. Each GPU process is mapped to the CapyCTL
deployment whose unit holds it, through ``/proc/<pid>/cgroup``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable

from ..config import deployment_from_unit
from ..errors import CapyError, InvalidRequest
from ..scheduler import Core, GpuCard, HostResources

DEFAULT_PROC = Path("/proc")
DEFAULT_SYS_CPU = Path("/sys/devices/system/cpu")
# Device nodes every CUDA process needs besides its cards' own /dev/nvidia<minor>.
SHARED_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm")
_UNIT_IN_CGROUP = re.compile(r"(?:^|/)(capyctl-[^/]+\.service)(?:/|$)")


class NvmlUnavailable(CapyError):
    """NVML could not be used on this host (no NVIDIA driver or library): it has no usable GPU."""

    code = "nvml_unavailable"
    status = 503


@dataclass(frozen=True)
class GpuProcess:
    """A process using a GPU, and the deployment whose unit it runs in (None: not CapyCTL's)."""

    pid: int
    used_memory: int | None  # bytes; None where the driver does not say
    unit: str | None = None
    deployment: str | None = None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it. Memory in bytes."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_free: int
    memory_used: int
    minor_number: int | None = None
    processes: tuple[GpuProcess, ...] = ()


# GPUs whose memory is, for certain, the host's own RAM (one LPDDR pool the CPU and GPU share):
# NVIDIA GB10 (DGX Spark) and the Jetson modules (Orin, Thor). By NVML's device name. Grace
# Hopper (GH200) and Grace Blackwell (GB200) are not listed: each GPU there has its own HBM beside
# the Grace CPU's LPDDR, coherent over NVLink-C2C but two pools, so a host copy of the weights does
# free HBM; such a host is declared at `capyctl host add --unified-memory` when its operator treats
# it otherwise.
UNIFIED_MEMORY_GPU_NAMES = ("GB10", "Orin", "Thor")
# Superchips whose GPU memory is coherent with the CPU's: the operator says how to treat them.
COHERENT_GPU_NAMES = ("GH200", "GB200", "GB300")


def unified_memory_default(gpu_names: "list[str]") -> bool | None:
    """Whether a host's GPU and host memory are one pool, where its GPUs' names make that certain:
    True for known unified-memory parts, False for a host without GPUs or with discrete cards (their
    own memory), None (the operator must say: host add --unified-memory) for the superchips."""
    if any(any(part in name for part in COHERENT_GPU_NAMES) for name in gpu_names):
        return None
    unified = [any(part in name for part in UNIFIED_MEMORY_GPU_NAMES) for name in gpu_names]
    if unified and all(unified):
        return True
    return False if not any(unified) else None


@dataclass(frozen=True)
class HostInventory:
    """A host's GPUs, RAM (bytes, from /proc/meminfo) and CPUs (those this service may run on,
    ``cpu_count`` of them, grouped in ``cores``: each the CPU ids of one core's hardware threads).
    ``nvml_error`` says why a host has no GPU list (None when NVML answered)."""

    hostname: str
    gpus: list[GpuInfo] = field(default_factory=list)
    ram_total: int = 0
    ram_available: int = 0
    cpu_count: int = 0
    nvml_error: str | None = None
    cores: list[list[int]] = field(default_factory=list)

    @property
    def is_cpu_host(self) -> bool:
        return not self.gpus

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """The JSON ``capyctl host-info --json`` prints."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def resources(self, ram_reserve: int = 0, core_reserve: int = 0) -> HostResources:
        """The scheduler's view of this host: its cards by model and memory, its RAM less
        ``ram_reserve``, its cores less the first ``core_reserve``."""
        return HostResources(self.hostname, self.ram_total, ram_reserve,
                             tuple(GpuCard(g.index, g.name, g.memory_total) for g in self.gpus),
                             tuple(tuple(core) for core in self.cores), core_reserve)


def gpu_inventory(proc_root: str | Path = DEFAULT_PROC) -> list[GpuInfo]:
    """Every GPU NVML sees, with its processes mapped to deployments. Raises ``NvmlUnavailable``."""
    nvml = _nvml()
    _call(nvml, nvml.nvmlInit)
    try:
        gpus = []
        for index in range(_call(nvml, nvml.nvmlDeviceGetCount)):
            handle = _call(nvml, nvml.nvmlDeviceGetHandleByIndex, index)
            memory = _call(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
            gpus.append(GpuInfo(
                index=index,
                uuid=_text(_call(nvml, nvml.nvmlDeviceGetUUID, handle)),
                name=_text(_call(nvml, nvml.nvmlDeviceGetName, handle)),
                memory_total=int(memory.total), memory_free=int(memory.free), memory_used=int(memory.used),
                minor_number=_optional(nvml, nvml.nvmlDeviceGetMinorNumber, handle),
                processes=tuple(_processes(nvml, handle, Path(proc_root))),
            ))
        return gpus
    finally:
        _shutdown(nvml)


def host_inventory(proc_root: str | Path = DEFAULT_PROC) -> HostInventory:
    """This host's inventory; a host without NVML is a CPU host with ``nvml_error`` set."""
    try:
        gpus, error = gpu_inventory(proc_root), None
    except NvmlUnavailable as exc:
        gpus, error = [], exc.message
    total, available = _meminfo(Path(proc_root) / "meminfo")
    allowed = os.sched_getaffinity(0)
    return HostInventory(hostname=socket.gethostname(), gpus=gpus, ram_total=total, ram_available=available,
                         cpu_count=len(allowed), nvml_error=error, cores=[list(c) for c in cores_of(allowed)])


def cores_of(cpus: Iterable[int], sys_cpu: str | Path = DEFAULT_SYS_CPU) -> list[Core]:
    """``cpus`` grouped into cores, in the order of each core's first CPU id: the CPUs a core's
    ``topology/thread_siblings_list`` names, as far as they are among ``cpus``. A CPU whose
    topology cannot be read is a core of its own."""
    wanted = set(cpus)
    cores: dict[Core, None] = {}
    for cpu in sorted(wanted):
        try:
            text = (Path(sys_cpu) / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
            siblings = set(parse_cpu_list(text)) & wanted
        except (OSError, ValueError):
            siblings = set()
        cores[tuple(sorted(siblings | {cpu}))] = None
    return list(cores)


def parse_cpu_list(text: str) -> list[int]:
    """The kernel's CPU list format ("0-3,8,10-11") as sorted ids; ValueError when it is not one."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"{text!r} is not a CPU list")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """Sorted CPU ids in the kernel's list format, runs folded: (0, 1, 2, 5) -> "0-2,5"."""
    ids = sorted(set(cpus))
    runs: list[list[int]] = []
    for cpu in ids:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def device_nodes(indices: Iterable[int]) -> list[str]:
    """The device nodes a unit needs to use the GPUs ``indices`` (for its DeviceAllow=):
    ``/dev/nvidia<minor>`` of each, then /dev/nvidiactl and /dev/nvidia-uvm."""
    wanted = list(indices)
    nvml = _nvml()
    _call(nvml, nvml.nvmlInit)
    try:
        count = _call(nvml, nvml.nvmlDeviceGetCount)
        nodes = []
        for index in wanted:
            if not 0 <= index < count:
                raise InvalidRequest(f"this host has no GPU {index} (it has {count})", code="unknown_gpu")
            handle = _call(nvml, nvml.nvmlDeviceGetHandleByIndex, index)
            nodes.append(f"/dev/nvidia{_call(nvml, nvml.nvmlDeviceGetMinorNumber, handle)}")
        return nodes + list(SHARED_DEVICE_NODES)
    finally:
        _shutdown(nvml)


def deployment_of_pid(pid: int, proc_root: str | Path = DEFAULT_PROC) -> tuple[str | None, str | None]:
    """The CapyCTL unit and deployment a process runs in, from its cgroup path; (None, None) if
    it is not in one, or it is gone, or it lives in another pid namespace."""
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text()
    except OSError:
        return None, None
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        match = _UNIT_IN_CGROUP.search(path)
        if match:
            unit = match.group(1)
            return unit, deployment_from_unit(unit)
    return None, None


# -- internals -------------------------------------------------------------------------------------

def _nvml() -> ModuleType:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc}); this host is treated as a CPU host") from None


def _is_nvml_error(nvml: ModuleType, exc: BaseException) -> bool:
    base = getattr(nvml, "NVMLError", None)
    return isinstance(base, type) and isinstance(exc, base)


def _call(nvml: ModuleType, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        if _is_nvml_error(nvml, exc):
            raise NvmlUnavailable(f"NVML: {exc} ({fn.__name__})") from None
        raise


def _optional(nvml: ModuleType, fn, *args):
    """A value some GPUs do not report (NVML answers "Not Supported"): None then."""
    try:
        return fn(*args)
    except Exception as exc:
        if _is_nvml_error(nvml, exc):
            return None
        raise


def _shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception as exc:
        if not _is_nvml_error(nvml, exc):
            raise


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _processes(nvml: ModuleType, handle, proc_root: Path) -> list[GpuProcess]:
    seen: dict[int, GpuProcess] = {}
    for query in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
        for proc in _optional(nvml, query, handle) or []:
            pid = int(proc.pid)
            if pid in seen:
                continue
            used = getattr(proc, "usedGpuMemory", None)
            unit, deployment = deployment_of_pid(pid, proc_root)
            seen[pid] = GpuProcess(pid, int(used) if used is not None else None, unit, deployment)
    return list(seen.values())


def _meminfo(path: Path) -> tuple[int, int]:
    """MemTotal and MemAvailable in bytes."""
    values: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and key in ("MemTotal", "MemAvailable"):
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError as exc:
        raise CapyError(f"cannot read {path}: {exc}", code="meminfo_unreadable") from None
    return values.get("MemTotal", 0), values.get("MemAvailable", 0)
