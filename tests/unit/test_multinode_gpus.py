"""Multi-node groups on GPUs: tensor_parallel is the total across the nodes (vLLM and SGLang read
it so), each member is budgeted on its host and given exactly its tensor_parallel / nodes cards there
(CUDA_VISIBLE_DEVICES and DeviceAllow), and the engine is told the node count."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from capyctl.config import DaemonConfig, Paths
from capyctl.controller._confine import Probe, confinement
from capyctl.controller._controller import Controller
from capyctl.controller._group import GroupMember, ModelGroup
from capyctl.controller._members import UnitMembers
from capyctl.controller._memory import MemoryPlanner
from capyctl.engines import LaunchContext, adapter_for
from capyctl.engines._base import require_gpus_for_tp
from capyctl.errors import CapyError
from capyctl.scheduler import GpuCard, HostResources
from capyctl.spec import EngineSpec, ManifestError, parse_manifest
from tests.fakes.deployments import PlacedDeploymentFake

GiB = 1 << 30
H100 = "NVIDIA H100 80GB HBM3"

GROUP = ("name: big\nengine: vllm\nmodel: {path: /models/big}\nhosts: [ga, gb]\nnodes: 2\ntensor_parallel: 4\n"
         "resources: {gpus: 2, gpu_memory: 70GiB, ram: 8GiB}\npark: stop\n")


# -- the manifest --------------------------------------------------------------------------------

def test_tensor_parallel_must_be_divisible_by_nodes() -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest("name: g\nengine: vllm\nmodel: {path: /m}\nhosts: [a, b]\nnodes: 2\ntensor_parallel: 3\n")
    assert "tensor_parallel is 3 but nodes is 2" in str(info.value) and "divisible by nodes" in str(info.value)


def test_gpus_per_node_are_tensor_parallel_over_nodes() -> None:
    spec = parse_manifest(GROUP)
    assert spec.gpus_needed == 2
    # resources.gpus is per node: 4 ranks over 2 nodes fit 2 GPUs on each.
    with pytest.raises(ManifestError) as info:
        parse_manifest(GROUP.replace("gpus: 2,", "gpus: 1,"))
    assert "on each of 2 nodes" in str(info.value)
    assert parse_manifest("name: s\nengine: vllm\nmodel: {path: /m}\ntensor_parallel: 2\n").gpus_needed == 2


# -- the adapters' check -------------------------------------------------------------------------

def _ctx(kind: str, gpus: list[int], nnodes: int, tp: int = 4) -> LaunchContext:
    spec = parse_manifest(f"name: g\nengine: {kind}\nmodel: {{path: /m}}\nhosts: [a, b]\nnodes: 2\n"
                          f"tensor_parallel: {tp}\n")
    engine = EngineSpec.model_validate({"kind": "engine", "name": kind, "type": kind, "path": "/opt/venv"})
    return LaunchContext(deployment=spec, engine=engine, model_path="/m", port=1, gpu_indices=gpus, nnodes=nnodes,
                         secret_dir="/var/lib/capyctl/secrets")


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_each_node_needs_only_its_share_of_the_ranks(kind: str) -> None:
    assert require_gpus_for_tp(_ctx(kind, [0, 1], nnodes=2)) == 4  # the engine is given the total
    argv = adapter_for(kind).build_launch(_ctx(kind, [0, 1], nnodes=2)).argv
    tp_flag = next(a for a in argv if a in ("--tensor-parallel-size", "--tp-size", "--tp"))
    assert argv[argv.index(tp_flag) + 1] == "4"
    with pytest.raises(CapyError) as info:
        adapter_for(kind).build_launch(_ctx(kind, [0], nnodes=2))
    assert info.value.code == "gpu_count_mismatch" and "2 GPU(s) on each of its 2 nodes" in info.value.message


# -- planning the members ------------------------------------------------------------------------

_Actor = PlacedDeploymentFake


def _planner() -> MemoryPlanner:
    planner = MemoryPlanner(DaemonConfig(), local_gpus=())
    for host in ("ga", "gb"):
        cards = (GpuCard(0, "NVIDIA L4", 24 * GiB), GpuCard(1, H100, 80 * GiB), GpuCard(2, H100, 80 * GiB))
        planner.set_host(host, HostResources(host, 512 * GiB, 0, cards))
    return planner


def test_each_member_is_placed_on_two_identical_cards_of_its_host_and_idle_ones_make_room() -> None:
    planner = _planner()
    idle = _Actor(parse_manifest("name: idle\nengine: vllm\nmodel: {path: /m}\nhosts: [gb]\n"
                                 "resources: {gpus: 1, gpu_memory: 30GiB, ram: 1GiB}\npark: stop\n"), host="gb")
    assert planner.plan(idle, [idle], 0.0, ("gb",)) == []
    planner.charge(idle)
    idle.state = "ready"
    planner.observe(idle)
    assert planner.gpus_for(idle) == (1,)

    group = _Actor(parse_manifest(GROUP))
    victims = planner.plan(group, [group, idle], 10.0)
    assert [(v.name, action) for v, action in victims] == [("idle", "stop")]  # gb has no two free H100s
    idle.state = "stopped"
    planner.observe(idle)
    planner.observe_gpus("gb", [{"index": i, "memory_free": cap, "processes": []}
                                for i, cap in ((0, 24 * GiB), (1, 80 * GiB), (2, 80 * GiB))])
    assert planner.plan(group, [group, idle], 10.0) == []
    assert planner.planned_host(group) == "ga"
    planner.charge(group)
    group.state = "starting"
    planner.observe(group)
    assert planner.gpus_for(group, 0) == planner.gpus_for(group, 1) == (1, 2)
    assert planner.ledger.holders("gpu:gb:2") == {"big#rank1": 70 * GiB}
    fraction, budget = planner.launch_memory(group, 1)
    assert budget == 70 * GiB and fraction <= 70 / 80
    group.state = "stopped"
    planner.observe(group)
    assert planner.ledger.holders("gpu:ga:1") == {} and planner.ledger.pending("ram:ga") == {}


# -- launching the members -----------------------------------------------------------------------

class _Systemd:
    def __init__(self, started: list) -> None:
        self.started = started

    async def unit_state(self, name):
        return None

    async def start_transient(self, unit) -> None:
        self.started.append(unit)

    async def set_description(self, name, description) -> None:
        pass  # group members keep the description they started with


class _Hosts:
    def __init__(self, started: list) -> None:
        # host-info of each remote host: its cards' NVML minor numbers differ from their indices.
        self.entries = {h: SimpleNamespace(info={"gpus": [{"index": 0, "minor_number": 4},
                                                          {"index": 1, "minor_number": 5},
                                                          {"index": 2, "minor_number": 6}]})
                        for h in ("ga", "gb")}
        self._systemd = _Systemd(started)

    def get(self, name):
        return self.entries[name]

    def systemd(self, name):
        return self._systemd


class _Ctl:
    gpu_device_nodes = Controller.gpu_device_nodes  # the real code: remote minors from host-info

    def __init__(self, planner: MemoryPlanner, started: list) -> None:
        self.memory, self.hosts = planner, _Hosts(started)
        self.engine = EngineSpec.model_validate({"kind": "engine", "name": "vllm", "type": "vllm",
                                                 "path": "/opt/vllm"})

    def engine_for(self, spec):
        return self.engine

    def adapter(self, spec):
        return adapter_for("vllm")

    def systemd_on(self, host):
        return self.hosts.systemd(host)

    def gpus_for(self, actor, rank=None):
        return self.memory.gpus_for(actor, rank)

    def launch_memory(self, actor, rank=None):
        return self.memory.launch_memory(actor, rank)

    def cores_for(self, actor, rank=None):
        return self.memory.cores_for(actor, rank)

    async def lease_port(self, name, host):
        return 31000

    async def resolve_model(self, spec, engine, progress):
        return SimpleNamespace(path="/models/big", revision=None)

    def dev_controls(self, host):
        return True

    def cpu_threads(self, spec, host, cores=()):
        return len(cores) or 8

    async def launch_credentials_on(self, host, key_file, key, files):
        # As on a host without systemd-creds: 0600 files, nothing encrypted.
        return ({"engine-key": f"/var/lib/capyctl/secrets/{key_file}.key",
                 **{name: f"/var/lib/capyctl/secrets/{name}" for name in files}}, frozenset())

    async def engine_confinement(self, host, deployment, engine_path, model_path, devices):
        return confinement(Paths(Path("/var/lib/capyctl"), Path("/run/capyctl")), deployment, engine_path,
                           model_path, devices, Probe())


async def test_each_member_unit_gets_exactly_its_cards_and_the_node_count() -> None:
    planner = _planner()
    group = _Actor(parse_manifest(GROUP))
    assert planner.plan(group, [group], 0.0) == []
    planner.charge(group)
    group.state = "starting"
    planner.observe(group)
    started: list = []
    ctl = _Ctl(planner, started)
    actor = SimpleNamespace(name="big", spec=group.spec, unit="capyctl-big.service", controller=ctl,
                            revision=SimpleNamespace(revision=1), launch_id="l1", key=None)
    members = UnitMembers(actor)  # type: ignore[arg-type]
    model_group = ModelGroup("big", "vllm", [GroupMember("ga", "10.0.0.1"), GroupMember("gb", "10.0.0.2")],
                             members, dist_port=29500)
    for launch in model_group.launches:
        await members.start(launch)
    assert len(started) == 2
    for rank, unit in enumerate(started):
        assert unit.environment["CUDA_VISIBLE_DEVICES"] == "1,2"
        assert unit.environment["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # CUDA counts cards as NVML does
        assert unit.devices == ["/dev/nvidia5", "/dev/nvidia6", "/dev/nvidiactl", "/dev/nvidia-uvm"]
        # Each member runs as a user of its own with its key as a credential, on its host too.
        assert unit.dynamic_user and unit.credentials == {"engine-key": f"/var/lib/capyctl/secrets/big.rank{rank}.key"}
        assert unit.credential_environment == {"VLLM_API_KEY": "engine-key"} and unit.environment_file is None
        argv = unit.argv
        assert argv[argv.index("--tensor-parallel-size") + 1] == "4"  # the total: vLLM splits it per node
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == str(rank)
        # The planned share of each of its cards (70 GiB of 80), as the vLLM adapter emits it.
        assert float(argv[argv.index("--gpu-memory-utilization") + 1]) == planner.launch_memory(group, rank)[0]
