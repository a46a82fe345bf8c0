"""What machine a recipe ran on: CPU, cores, RAM, and GPUs with their driver and CUDA from NVML."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def _cpu_model(cpuinfo: str) -> str | None:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware", "cpu model"):
            return value.strip() or None
    return None


def _mem_total(meminfo: str) -> int | None:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def _gpus() -> dict[str, Any]:
    """GPUs, driver and CUDA version as NVML reports them; why not, when it cannot."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return {"gpus": [], "gpu_unknown": "nvidia-ml-py is not installed (no NVML to ask)"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded ...: no NVIDIA driver here
        return {"gpus": [], "gpu_unknown": f"NVML is not available: {exc}"}
    try:
        def text(value: Any) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append({"index": index, "name": text(pynvml.nvmlDeviceGetName(handle)),
                         "memory_total": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                         "uuid": text(pynvml.nvmlDeviceGetUUID(handle))})
        return {"gpus": gpus, "driver": text(pynvml.nvmlSystemGetDriverVersion()),
                "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}"}
    finally:
        pynvml.nvmlShutdown()


def machine_facts(proc: Path = Path("/proc")) -> dict[str, Any]:
    """The machine as a report records it."""
    def read(name: str) -> str:
        try:
            return (proc / name).read_text()
        except OSError:
            return ""
    facts: dict[str, Any] = {
        "hostname": platform.node(), "cpu_model": _cpu_model(read("cpuinfo")) or platform.processor() or None,
        "cpu_cores": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
        "ram_bytes": _mem_total(read("meminfo")), "kernel": platform.release(), "platform": platform.platform(),
        "python": platform.python_version(),
    }
    facts.update(_gpus())
    return facts


def hardware_shortfall(needs: Any, facts: dict[str, Any]) -> str | None:
    """Why this machine cannot run a recipe whose hardware is ``needs`` (a recipe's Hardware); None if it can."""
    if needs.gpus:
        gpus = [g for g in facts.get("gpus", [])
                if (not needs.gpu_model or needs.gpu_model.lower() in g["name"].lower())
                and (not needs.gpu_memory or g["memory_total"] >= needs.gpu_memory)]
        if len(gpus) < needs.gpus:
            want = f"{needs.gpus} GPU(s)" + (f" {needs.gpu_model}" if needs.gpu_model else "") + (
                f" with {needs.gpu_memory >> 30} GiB each" if needs.gpu_memory else "")
            have = ", ".join(g["name"] for g in facts.get("gpus", [])) or facts.get("gpu_unknown") or "no GPU"
            return f"it needs {want}; this machine has: {have}"
    # RAM after GPUs: a GPU recipe on a machine without one should say so, not that RAM is short.
    if needs.ram and facts.get("ram_bytes") and facts["ram_bytes"] < needs.ram:
        return f"it needs {needs.ram >> 20} MiB of RAM and this machine has {facts['ram_bytes'] >> 20} MiB"
    return None
