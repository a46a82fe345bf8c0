"""On a machine with an NVIDIA GPU (scripts/gpu-check runs these with CAPYCTL_REQUIRE_GPU=1):
CapyCTL's own NVML code sees a process that holds a known amount of GPU memory, maps it to its
deployment, corrects an estimated charge to what it uses, and confirms the release once the
process is gone. Elsewhere these tests skip (no NVML)."""

from __future__ import annotations

import asyncio
import functools
import importlib
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from capyctl.config import DaemonConfig
from capyctl.controller._memory import GPU_MEASURE_MARGIN, MemoryPlanner, measure, refresh_gpus
from capyctl.engines import adapter_for
from capyctl.hosts.inventory import gpu_inventory
from capyctl.scheduler import Footprint
from capyctl.spec import parse_manifest

pytestmark = pytest.mark.gpu

GiB = 1 << 30
HOLD = 2 * GiB
# A child that holds HOLD bytes on the GPU through PyTorch until its stdin closes.
HOLDER = f"""
import sys, torch
x = torch.empty({HOLD}, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("holding", flush=True)
sys.stdin.read()
"""


def _need(what: str, ok: bool) -> None:
    if ok:
        return
    if os.environ.get("CAPYCTL_REQUIRE_GPU") == "1":
        pytest.fail(f"needs {what} (CAPYCTL_REQUIRE_GPU=1)")
    pytest.skip(f"needs {what}")


def _nvml_works() -> bool:
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:
        return False
    nvml.nvmlShutdown()
    return True


def _torch_cuda() -> bool:
    done = subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                          capture_output=True, timeout=120)
    return done.returncode == 0


@pytest.fixture
def holder(tmp_path: Path):
    _need("an NVIDIA GPU with NVML", _nvml_works())
    _need("PyTorch with CUDA", _torch_cuda())
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "holding"
        # A /proc where the child lives in a CapyCTL unit's cgroup: NVML's pid maps to "gpucheck".
        proc = tmp_path / "proc"
        (proc / str(child.pid)).mkdir(parents=True)
        (proc / str(child.pid) / "cgroup").write_text("0::/capyctl.slice/capyctl-gpucheck.service\n")
        yield child, proc
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


def _where(gpus, pid: int):
    for gpu in gpus:
        for p in gpu.processes:
            if p.pid == pid:
                return gpu, p
    return None, None


def test_nvml_reports_the_process_and_what_it_holds(holder) -> None:
    child, proc = holder
    gpus = gpu_inventory(proc)
    gpu, found = _where(gpus, child.pid)
    listed = {g.index: [(p.pid, p.used_memory) for p in g.processes] for g in gpus}
    assert found is not None, (f"NVML does not list pid {child.pid} (it lists {listed}): NVML pids are "
                               "from another pid namespace here, and per-process measurement cannot work")
    assert found.deployment == "gpucheck" and found.unit == "capyctl-gpucheck.service"
    assert found.used_memory is not None and HOLD <= found.used_memory <= HOLD + GiB, listed
    assert gpu.memory_total - gpu.memory_free >= found.used_memory


class _Systemd:
    async def memory_current(self, unit: str) -> int:
        return 300 << 20


async def test_the_estimate_is_corrected_to_the_measured_use_and_released_when_nvml_shows_it_free(
        holder, monkeypatch) -> None:
    import capyctl.hosts
    child, proc = holder
    monkeypatch.setattr(capyctl.hosts, "gpu_inventory", functools.partial(gpu_inventory, proc))
    gpus = gpu_inventory(proc)
    gpu, found = _where(gpus, child.pid)
    assert found is not None, "NVML does not list the holder's pid (see the test above)"
    planner = MemoryPlanner(DaemonConfig(), local_gpus=capyctl.hosts.host_inventory().resources().gpus)
    spec = parse_manifest("name: gpucheck\nengine: custom\nmodel: {path: /m}\nresources: {gpus: 1}\n")
    actor = SimpleNamespace(name="gpucheck", spec=spec, state="ready", host="local", unit="capyctl-gpucheck.service",
                            parked_in_place=False, model_path=None,
                            controller=SimpleNamespace(adapter=lambda s: adapter_for("custom")))
    # Charged a whole card (nothing to estimate from), on the card the holder runs on.
    planner.ledger.place("gpucheck", Footprint(1, None, GiB), "local", (gpu.index,), "ready")
    ctl = SimpleNamespace(memory=planner, hosts=SimpleNamespace(systemd=lambda host: _Systemd()))
    changed = await measure(ctl, actor)
    domain = f"gpu:local:{gpu.index}"
    assert changed["gpu_memory"] == math.ceil(found.used_memory * GPU_MEASURE_MARGIN)
    assert planner.ledger.holders(domain) == {"gpucheck": changed["gpu_memory"]}
    print(f"measured {found.used_memory / GiB:.2f} GiB on GPU {gpu.index}; charge corrected from the whole "
          f"card ({gpu.memory_total / GiB:.0f} GiB) to {changed['gpu_memory'] / GiB:.2f} GiB")

    # Stopped: the charge stays pending while NVML still lists the process, trimmed to what the
    # process still holds (Ledger.observe_card), and is confirmed free after it exits. The charge
    # carries GPU_MEASURE_MARGIN, so the trim is what shows here (seen on an H200: the pending
    # amount was the 2.51 GiB measured, not the 2.56 GiB charged).
    planner.ledger.set_state("gpucheck", "stopped")
    await refresh_gpus(ctl, ["local"])
    _, still = _where(gpu_inventory(proc), child.pid)
    assert still is not None and still.used_memory
    assert planner.ledger.pending(domain) == {"gpucheck": min(changed["gpu_memory"], still.used_memory)}
    child.stdin.close()
    child.wait(timeout=60)
    deadline = time.monotonic() + 30
    while planner.ledger.pending(domain) and time.monotonic() < deadline:
        await refresh_gpus(ctl, ["local"])
        await asyncio.sleep(0.2)
    assert planner.ledger.pending(domain) == {}, "NVML still shows the exited process's memory after 30 s"
