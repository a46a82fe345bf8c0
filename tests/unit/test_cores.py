"""Cores on CPU hosts, from the inventory to the unit: which CPUs a host offers, by core; each
engine's default and thread flags; what the unit is given; the manifest error for too many cores."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from capyctl.config import ENGINE_CPU_WEIGHT, DaemonConfig
from capyctl.controller import UsageView
from capyctl.engines import LaunchContext, adapter_for
from capyctl.engines.vllm import CPU_BIND_ENV, cpu_thread_bind
from capyctl.errors import CapyError
from capyctl.hosts import cores_of, format_cpu_list, parse_cpu_list
from capyctl.spec import DeploymentSpec, EngineSpec, ManifestError, parse_manifest, problems_in_file
from capyctl.systemd import TransientUnit
from tests.controllers import RecordingSystemd

GiB = 1 << 30


# -- the inventory ---------------------------------------------------------------------------------

def sysfs(tmp_path: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(text + "\n")
    return tmp_path


def test_cpus_are_grouped_into_cores_by_their_thread_siblings(tmp_path):
    root = sysfs(tmp_path, {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"})
    assert cores_of(range(8), root) == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_only_the_cpus_the_daemon_may_run_on_count(tmp_path):
    root = sysfs(tmp_path, {1: "1,5", 2: "2,6", 5: "1,5"})
    assert cores_of({1, 2, 5}, root) == [(1, 5), (2,)]  # CPU 6 is not ours: core 2 is CPU 2 alone


def test_a_cpu_without_readable_topology_is_a_core_of_its_own(tmp_path):
    assert cores_of({0, 3}, tmp_path) == [(0,), (3,)]


def test_the_real_inventory_lists_every_cpu_of_our_affinity_once():
    from capyctl.hosts import host_inventory
    import os
    inv = host_inventory()
    listed = [cpu for core in inv.cores for cpu in core]
    assert sorted(listed) == sorted(os.sched_getaffinity(0)) and inv.cpu_count == len(listed)
    assert inv.resources(core_reserve=1).placeable_cores == tuple(tuple(c) for c in inv.cores[1:])


def test_cpu_lists_read_and_written_in_the_kernels_format():
    assert parse_cpu_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    assert format_cpu_list([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")


def test_the_default_reserve_keeps_a_core_only_on_larger_hosts_and_never_all():
    assert [DaemonConfig().cpu_reserve_for(n) for n in (1, 2, 3, 4, 64)] == [0, 0, 0, 1, 1]
    config = DaemonConfig(host_cpu_reserve=4)
    assert config.cpu_reserve_for(8) == 4 and config.cpu_reserve_for(2) == 1


# -- engines: defaults and thread flags ------------------------------------------------------------

def spec(engine: str, **resources) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "m", "engine": engine, "model": {"path": "/models/m"},
                                          "resources": resources})


def launch(kind: str, dep: DeploymentSpec, cores=(), threads=None) -> LaunchContext:
    eng = EngineSpec.model_validate({"kind": "engine", "name": "e", "type": kind, "path": "/opt/engine"})
    return LaunchContext(deployment=dep, engine=eng, model_path="/models/m", port=41000, cpu_threads=threads,
                         cores=tuple(cores), secret_dir="/run/credentials/capyctl-m.service")


def test_default_cores_grow_with_the_weights_within_bounds():
    llama, vllm = adapter_for("llama.cpp"), adapter_for("vllm")
    assert [llama.default_cores(spec("llama"), size) for size in (100 << 20, 2 * GiB, 5 * GiB, 400 * GiB)] \
        == [1, 1, 3, 8]
    assert vllm.default_cores(spec("vllm"), 100 << 20) == 2  # one more: vLLM's scheduler core
    assert adapter_for("sglang").default_cores(spec("sglang"), GiB) is None  # not planned


def test_llama_gets_one_thread_per_core_for_generation_and_batches():
    argv = adapter_for("llama.cpp").build_launch(launch("llama.cpp", spec("llama"), ((2,), (3,)), 2)).argv
    assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("-tb") + 1] == "2"


def test_llama_thread_flags_in_engine_args_win():
    dep = DeploymentSpec.model_validate({"name": "m", "engine": "llama", "model": {"path": "/models/m"},
                                         "engine_args": ["--threads", "1"]})
    argv = adapter_for("llama.cpp").build_launch(launch("llama.cpp", dep, ((2,), (3,)), 2)).argv
    assert "-t" not in argv and argv.count("--threads") == 1 and argv[argv.index("-tb") + 1] == "2"


def test_vllm_cpu_binds_its_openmp_threads_to_its_cores_as_its_auto_binding_would():
    assert cpu_thread_bind(((0,),), 1) == "0"  # one core: nothing to spare for the scheduler
    assert cpu_thread_bind(((2,), (3,), (4,)), 1) == "2,3"  # the last core kept for the scheduler
    assert cpu_thread_bind(((0, 8), (1, 9)), 1) == "8"  # one logical CPU per core, its last
    assert cpu_thread_bind(tuple((i,) for i in range(6)), 2) == "0,1|2,3"
    plan = adapter_for("vllm").build_launch(launch("vllm", spec("vllm"), ((4,), (5,)), 2))
    assert plan.environment[CPU_BIND_ENV] == "4"
    assert CPU_BIND_ENV not in adapter_for("vllm").build_launch(launch("vllm", spec("vllm"))).environment


def test_resources_cpus_are_whole_cores():
    with pytest.raises(ValidationError) as err:
        spec("llama", cpus=1.5)
    assert [(e["loc"], e["type"]) for e in err.value.errors()] == [(("resources", "cpus"), "int_from_float")]
    assert spec("llama", cpus=2).resources.cpus == 2


# -- the unit --------------------------------------------------------------------------------------

def test_a_pinned_unit_gets_its_cpus_for_both_hierarchies_and_a_lower_cpu_weight():
    unit = TransientUnit(name="capyctl-m.service", description="m", argv=["/bin/true"], allowed_cpus="2-3",
                         cpu_weight=ENGINE_CPU_WEIGHT)
    unit.validate()
    props = dict(unit.properties())
    assert props["AllowedCPUs"].value == props["CPUAffinity"].value == bytes([0b1100])
    assert props["CPUWeight"].value == ENGINE_CPU_WEIGHT < 100  # below the daemon's default weight
    assert "CPUQuotaPerSecUSec" not in props


def test_a_cpu_weight_out_of_range_is_refused():
    with pytest.raises(CapyError):
        TransientUnit(name="capyctl-m.service", description="m", argv=["/bin/true"], cpu_weight=0).validate()


# -- the controller: two CPU deployments, and too many cores ---------------------------------------

class _SystemdOf100MiBUnits(RecordingSystemd):
    """Every unit's cgroup holds 100 MiB."""

    async def memory_current(self, name):
        return 100 << 20


@pytest.fixture
async def cpu_controller(tmp_path, monkeypatch):
    """A Controller on a CPU host (no NVML) of four cores, vLLM registered: (controller, systemd, model)."""
    from capyctl.controller import _memory
    from tests.controllers import vllm_controller
    from tests.fakes.fake_nvml import FakeNvml

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([]))
    monkeypatch.setattr(_memory, "_local_cores", lambda: ((0,), (1,), (2,), (3,)))
    systemd = _SystemdOf100MiBUnits()
    async with vllm_controller(tmp_path, systemd) as (ctl, model):
        yield ctl, systemd, model


def cpu_manifest(name: str, model: Path, cpus: int) -> DeploymentSpec:
    return parse_manifest(f"name: {name}\nengine: vllm\nmodel: {{path: {model}}}\n"
                          f"resources: {{ram: 1GiB, cpus: {cpus}}}\npark: stop\n")


async def test_two_cpu_deployments_run_on_disjoint_cores_with_threads_to_match(cpu_controller):
    ctl, systemd, model = cpu_controller
    units = {}
    for name, cpus in (("a", 1), ("b", 2)):
        actor = await ctl.deploy(cpu_manifest(name, model, cpus))
        await ctl.make_room(actor, lambda _: None)
        await actor._launch(lambda _: None)
        actor._set("ready")
        units[name] = systemd.started[-1]
    a, b = units["a"], units["b"]
    # Four cores, the first kept for the daemon (cpu_reserve's default from four cores up).
    assert (a.allowed_cpus, b.allowed_cpus) == ("1", "2-3")
    assert a.environment[CPU_BIND_ENV] == "1"  # one core: its OpenMP thread's
    assert b.environment[CPU_BIND_ENV] == "2"  # its other core is vLLM's scheduler's
    for unit in (a, b):
        assert unit.cpu_weight == ENGINE_CPU_WEIGHT and unit.cpu_quota is None
        assert unit.markers["cpus"] == unit.allowed_cpus
    rows = {row["name"]: row for row in (await UsageView(ctl).view())["deployments"]}
    assert rows["b"]["cores"] == [{"host": "local", "count": 2, "cpus": "2-3"}]
    cores = next(d for d in rows["b"]["domains"] if d["id"] == "cpu:local")
    assert cores["held"] == cores["reserved"] == 2

    # A third that needs two cores: only by evicting the idle ones that hold them.
    c = await ctl.deploy(cpu_manifest("c", model, 2))
    await ctl.make_room(c, lambda _: None)
    assert ctl.memory.ledger.get("c").cpus in ((1, 2), (1, 3), (2, 3))
    assert ctl.memory.ledger.overcommitted() == []


async def test_more_cores_than_the_host_has_is_a_manifest_error_naming_the_field(cpu_controller):
    ctl, _, model = cpu_controller
    with pytest.raises(ManifestError) as err:
        await ctl.deploy(cpu_manifest("big", model, 64))
    problem = err.value.problems[0]
    assert problem.field == "resources.cpus"
    assert "asks for 64 cores" in problem.message
    assert "host 'local' has 3 (1 more kept by cpu_reserve)" in problem.message
    assert ctl.store.get_deployment("big") is None  # refused before anything is recorded


def test_the_cli_shows_the_daemons_manifest_problem_on_its_line_in_the_file(tmp_path, monkeypatch, capsys):
    from capyctl import cli
    manifest = tmp_path / "big.yaml"
    manifest.write_text("name: big\nengine: llama\nmodel:\n  path: /models/m.gguf\nresources:\n  cpus: 64\n")
    problem = {"field": "resources.cpus", "line": None,
               "message": "asks for 64 cores, more than CapyCTL may give one engine: host 'local' has 2"}

    def refuse(self, method, path, body=None):
        raise CapyError("request body: spec: resources.cpus: ...", code="invalid_manifest", status=422,
                        detail={"file": "request body: spec", "problems": [problem]})
        yield  # pragma: no cover

    monkeypatch.setattr(cli.ApiClient, "stream", refuse)
    assert cli.main(["deploy", "model", "--file", str(manifest)]) == 2
    assert f"{manifest}:6: resources.cpus: asks for 64 cores" in capsys.readouterr().err
    assert problems_in_file(manifest, [problem]).problems[0].line == 6


def test_an_adopted_unit_keeps_the_cores_it_runs_on_and_a_default_fits_the_host():
    from capyctl.controller._memory import MemoryPlanner
    from tests.fakes.deployments import PlacedDeploymentFake

    planner = MemoryPlanner(DaemonConfig(host_cpu_reserve=0), local_gpus=(), local_cores=((0,), (1,), (2,), (3,)))
    adopted = PlacedDeploymentFake(parse_manifest("name: a\nengine: llama.cpp\nmodel: {path: /models/a.gguf}\n"
                                                  "resources: {ram: 1GiB, cpus: 2}\n"))
    planner.adopting("a", "2-3")  # the unit's "cpus" marker
    adopted.state = "ready"
    planner.observe(adopted)
    assert planner.cores_for(adopted) == ((2,), (3,))
    # A model of unknown size (not on disk) gets its engine's default, at most what a host has.
    default = PlacedDeploymentFake(parse_manifest("name: b\nengine: llama.cpp\nmodel: {path: /models/b.gguf}\n"))
    assert planner.footprint(default).cores == 1
    gpu = PlacedDeploymentFake(parse_manifest("name: g\nengine: llama.cpp\nmodel: {path: /models/g.gguf}\n"
                                              "resources: {gpus: 1, gpu_memory: 1GiB}\n"))
    assert planner.footprint(gpu).cores == 0  # a GPU deployment is not pinned unless it asks
