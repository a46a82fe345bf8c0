"""Host inventory: the real call on this machine, a fake NVML for GPU hosts, and the real NVML where there is one."""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from capyctl.errors import CapyError
from capyctl.hosts import NvmlUnavailable, device_nodes, gpu_inventory, host_inventory
from capyctl.scheduler import Footprint, Ledger, Request, plan
from tests.fakes.fake_nvml import NVML_ERROR_DRIVER_NOT_LOADED, FakeDevice, FakeNvml

GiB = 1 << 30


def _real_nvml_works() -> bool:
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:
        return False
    nvml.nvmlShutdown()
    return True


# -- the real call on this machine -----------------------------------------------------------------

def test_real_inventory_of_a_host_without_nvml_is_a_cpu_host() -> None:
    if _real_nvml_works():
        pytest.skip("this host has a working NVML; the GPU test below covers it")
    inventory = host_inventory()
    assert inventory.gpus == [] and inventory.is_cpu_host
    assert inventory.nvml_error and "NVML" in inventory.nvml_error
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert inventory.ram_total == int(meminfo["MemTotal"].split()[0]) * 1024
    assert 0 < inventory.ram_available <= inventory.ram_total
    assert inventory.cpu_count == len(os.sched_getaffinity(0))
    assert inventory.hostname == socket.gethostname()
    assert json.loads(inventory.to_json())["nvml_error"] == inventory.nvml_error
    with pytest.raises(NvmlUnavailable) as info:
        gpu_inventory()
    assert info.value.code == "nvml_unavailable"


def test_missing_nvidia_ml_py_is_a_cpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # what `import pynvml` sees when it is not installed
    inventory = host_inventory()
    assert inventory.gpus == [] and "nvidia-ml-py is not installed" in inventory.nvml_error


# -- a GPU host through the fake NVML --------------------------------------------------------------

@pytest.fixture
def fake_proc(tmp_path: Path) -> Path:
    """A /proc with meminfo and the cgroups of four GPU processes."""
    (tmp_path / "meminfo").write_text("MemTotal:       263921452 kB\nMemFree:         1000 kB\n"
                                      "MemAvailable:   200000000 kB\n")
    cgroups = {
        # cgroup v2 (unified) line
        4101: "0::/capyctl.slice/capyctl-qwen3-8b.service\n",
        # cgroup v1 hybrid, as on this machine: the name=systemd hierarchy names the unit
        4102: ("12:memory:/capyctl.slice/capyctl-llama-70b.service\n"
               "1:name=systemd:/capyctl.slice/capyctl-llama-70b.service/engine\n0::/\n"),
        # someone's notebook in a user session
        4200: "0::/user.slice/user-1000.slice/session-3.scope\n",
    }
    for pid, text in cgroups.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    return tmp_path  # pid 4300 has no entry: it lives in another pid namespace


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    nvml = FakeNvml([
        FakeDevice("NVIDIA H100 80GB HBM3", "GPU-aaaa", minor=0, total=80 * GiB, used=42 * GiB,
                   compute=[(4101, 20 * GiB), (4102, 22 * GiB)]),
        FakeDevice("NVIDIA H100 80GB HBM3", "GPU-bbbb", minor=1, total=80 * GiB, used=23 * GiB,
                   compute=[(4102, 22 * GiB), (4300, None)], graphics=[(4102, 22 * GiB)]),
        FakeDevice("NVIDIA L4", "GPU-cccc", minor=3, total=24 * GiB, used=2 * GiB, graphics=[(4200, 2 * GiB)]),
    ])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def test_fake_nvml_gives_the_gpu_list_and_maps_processes_to_deployments(fake_nvml: FakeNvml, fake_proc: Path) -> None:
    gpus = gpu_inventory(fake_proc)
    assert [(g.index, g.uuid, g.name, g.minor_number) for g in gpus] == [
        (0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 0), (1, "GPU-bbbb", "NVIDIA H100 80GB HBM3", 1),
        (2, "GPU-cccc", "NVIDIA L4", 3)]
    assert (gpus[0].memory_total, gpus[0].memory_used, gpus[0].memory_free) == (80 * GiB, 42 * GiB, 38 * GiB)
    assert [(p.pid, p.deployment, p.unit) for p in gpus[0].processes] == [
        (4101, "qwen3-8b", "capyctl-qwen3-8b.service"), (4102, "llama-70b", "capyctl-llama-70b.service")]
    # A process listed as compute and graphics counts once; one in another namespace maps to nothing.
    assert [(p.pid, p.deployment, p.used_memory) for p in gpus[1].processes] == [
        (4102, "llama-70b", 22 * GiB), (4300, None, None)]
    assert [(p.pid, p.deployment) for p in gpus[2].processes] == [(4200, None)]
    assert fake_nvml.init_count == 0  # every nvmlInit was paired with nvmlShutdown


async def test_processes_proc_does_not_show_are_named_by_systemd(fake_nvml: FakeNvml, fake_proc: Path) -> None:
    """The daemon's fallback where /proc hides a process (hidepid, another pid namespace): systemd's
    unit of each pid (GetUnitByPID); one outside CapyCTL's units, or unknown, stays unnamed."""
    from dataclasses import asdict

    from capyctl.controller._hosts import attribute_gpu_processes
    from capyctl.errors import SystemdError

    class Systemd:  # SystemdClient.unit_of_pid as tests/integration/test_systemd_client.py checks it
        asked: list[int] = []

        async def unit_of_pid(self, pid: int) -> str | None:
            self.asked.append(pid)
            if pid == 4200:
                raise SystemdError("the bus went away", code="dbus_unavailable")
            return {4300: "capyctl-late.service"}.get(pid, "user@0.service")

    gpus = [asdict(g) for g in gpu_inventory(fake_proc)]
    systemd = Systemd()
    await attribute_gpu_processes(systemd, gpus)
    assert sorted(set(systemd.asked)) == [4200, 4300]  # only those /proc did not name
    assert [(p["pid"], p["deployment"], p["unit"]) for p in gpus[1]["processes"]] == [
        (4102, "llama-70b", "capyctl-llama-70b.service"), (4300, "late", "capyctl-late.service")]
    assert [(p["pid"], p["deployment"]) for p in gpus[2]["processes"]] == [(4200, None)]
    await attribute_gpu_processes(None, gpus)  # no systemd connection: nothing to add, no error


def test_fake_gpu_host_inventory_feeds_the_scheduler(fake_nvml: FakeNvml, fake_proc: Path) -> None:
    inventory = host_inventory(fake_proc)
    assert inventory.nvml_error is None and not inventory.is_cpu_host
    assert (inventory.ram_total, inventory.ram_available) == (263921452 * 1024, 200000000 * 1024)
    as_json = json.loads(inventory.to_json())
    assert as_json["gpus"][0]["processes"][0] == {"pid": 4101, "used_memory": 20 * GiB,
                                                   "unit": "capyctl-qwen3-8b.service", "deployment": "qwen3-8b"}
    # The two H100s are identical cards for the scheduler; the L4 is not.
    ledger = Ledger([inventory.resources(ram_reserve=8 * GiB)])
    result = plan(Request("tp2", Footprint(2, 30 * GiB, 16 * GiB)), ledger, [], 0.0)
    assert result.gpus == (0, 1)


def test_device_nodes_use_nvml_minor_numbers(fake_nvml: FakeNvml) -> None:
    assert device_nodes([0, 2]) == ["/dev/nvidia0", "/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    with pytest.raises(CapyError) as info:
        device_nodes([5])
    assert info.value.code == "unknown_gpu"


def test_driver_not_loaded_is_a_cpu_host_with_the_reason(monkeypatch: pytest.MonkeyPatch, fake_proc: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([], init_error=NVML_ERROR_DRIVER_NOT_LOADED))
    inventory = host_inventory(fake_proc)
    assert inventory.gpus == [] and inventory.nvml_error == "NVML: Driver Not Loaded (nvmlInit)"
    with pytest.raises(NvmlUnavailable):
        device_nodes([0])


# -- the real NVML ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_real_nvml_lists_this_hosts_gpus() -> None:
    if not _real_nvml_works():
        if os.environ.get("CAPYCTL_REQUIRE_GPU") == "1":  # scripts/gpu-check: a GPU machine must have NVML
            pytest.fail("NVML is not available (CAPYCTL_REQUIRE_GPU=1)")
        pytest.skip("needs an NVIDIA GPU (NVML not available)")
    inventory = host_inventory()
    assert inventory.nvml_error is None and inventory.gpus
    for gpu in inventory.gpus:
        assert gpu.uuid.startswith("GPU-") and gpu.name
        assert 0 < gpu.memory_total and 0 <= gpu.memory_free <= gpu.memory_total
    nodes = device_nodes([0])
    assert nodes[0].startswith("/dev/nvidia") and nodes[-2:] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert os.path.exists(nodes[0])
