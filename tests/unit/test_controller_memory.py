"""The controller's bridge to the scheduler: GPU deployments get identical cards, and the cards
they hold are what their unit is given."""

from __future__ import annotations

import math

import pytest

from capyctl.config import DaemonConfig
from capyctl.controller._memory import MemoryPlanner
from capyctl.controller._lifecycle import Command
from capyctl.controller._park_modes import RESTART
from capyctl.engines import adapter_for
from capyctl.scheduler import GpuCard, NoRoom
from capyctl.controller import DeploymentState
from capyctl.spec import parse_manifest
from tests.controllers import RecordingSystemd
from tests.fakes.deployments import PlacedDeploymentFake


class _Controller:
    def adapter(self, spec):
        return adapter_for(spec.engine)


_Actor = PlacedDeploymentFake


def vllm(name: str, gpus: int, memory: str = "60GiB") -> _Actor:
    return _Actor(parse_manifest(f"name: {name}\nengine: vllm\nmodel: {{hf: org/{name}}}\ntensor_parallel: {gpus}\n"
                                 f"resources: {{gpus: {gpus}, gpu_memory: {memory}, ram: 4GiB}}\npark: stop\n"))


CARDS = (GpuCard(0, "NVIDIA H100 80GB HBM3", 80 << 30), GpuCard(1, "NVIDIA L4", 24 << 30),
         GpuCard(2, "NVIDIA H100 80GB HBM3", 80 << 30))


def nvml_view(planner: MemoryPlanner, host: str = "local", **processes: dict[int, int]) -> list[dict]:
    """What NVML would show on ``host``: each card's free memory (capacity less the ledger's active
    charges and the given processes) and the processes by deployment ({deployment: {card: bytes}})."""
    ledger, view = planner.ledger, []
    for dom in ledger.domains.values():
        if dom.kind != "gpu" or dom.host != host:
            continue
        procs = [{"pid": 1000 + i, "used_memory": cards[dom.index], "unit": f"capyctl-{name}.service",
                  "deployment": name} for i, (name, cards) in enumerate(processes.items()) if dom.index in cards]
        used = sum(ledger.holders(dom.id).values()) + sum(p["used_memory"] for p in procs)
        view.append({"index": dom.index, "memory_total": dom.capacity, "memory_free": dom.capacity - used,
                     "processes": procs})
    return view


def start(planner: MemoryPlanner, actor: _Actor, others: list[_Actor], now: float = 100.0):
    victims = planner.plan(actor, [actor, *others], now)
    for victim, _ in victims:
        victim.state = "parked"
        planner.observe(victim)
    if victims:
        planner.observe_gpus("local", nvml_view(planner))  # the victims' processes are gone from the cards
        assert planner.plan(actor, [actor, *others], now) == []
    planner.charge(actor)
    actor.state = "starting"
    planner.observe(actor)
    return victims


def test_two_gpu_deployment_gets_the_two_identical_cards():
    planner = MemoryPlanner(DaemonConfig(), local_gpus=CARDS)
    big = vllm("big", 2)
    start(planner, big, [])
    assert planner.gpus_for(big) == (0, 2)


def test_a_second_big_model_evicts_the_idle_first_one():
    planner = MemoryPlanner(DaemonConfig(), local_gpus=CARDS)
    first, second = vllm("first", 2), vllm("second", 2)
    start(planner, first, [])
    first.state, first.last_used = "ready", 10.0
    planner.observe(first)
    victims = start(planner, second, [first])
    assert [(v.name, action) for v, action in victims] == [("first", "stop")]
    assert planner.gpus_for(second) == (0, 2)


def test_a_busy_model_is_never_evicted():
    planner = MemoryPlanner(DaemonConfig(), local_gpus=CARDS)
    first, second = vllm("first", 2), vllm("second", 2)
    start(planner, first, [])
    first.state, first.busy = "ready", True
    planner.observe(first)
    with pytest.raises(NoRoom):
        planner.plan(second, [first, second], 100.0)


def test_a_cpu_host_has_no_cards():
    planner = MemoryPlanner(DaemonConfig(), local_gpus=())
    with pytest.raises(NoRoom):
        planner.plan(vllm("big", 1), [], 100.0)


# -- GPU memory released only once NVML shows it free -------------------------------------------

GiB = 1 << 30


def test_gpu_memory_of_a_stopped_deployment_stays_charged_until_nvml_shows_it_free():
    planner = MemoryPlanner(DaemonConfig(), local_gpus=CARDS)
    first, second = vllm("first", 2), vllm("second", 2)
    start(planner, first, [])
    first.state = "ready"
    planner.observe(first)
    first.state = "stopped"  # its unit is gone ...
    planner.observe(first)
    assert planner.ledger.pending("ram:local") == {}  # ... and with its cgroup its RAM
    # ... but the driver still lists its processes on both cards.
    planner.observe_gpus("local", nvml_view(planner, first={0: 60 * GiB, 2: 60 * GiB}))
    with pytest.raises(NoRoom) as info:
        planner.plan(second, [first, second], 100.0)
    assert "not yet confirmed released: first (60.0 GiB on gpu:local:0)" in info.value.message
    # A process still exiting that holds only part of it: only that part stays charged.
    planner.observe_gpus("local", nvml_view(planner, first={0: 10 * GiB, 2: 10 * GiB}))
    assert planner.ledger.pending("gpu:local:0") == {"first": 10 * GiB}
    assert planner.plan(second, [first, second], 100.0) == []
    planner.observe_gpus("local", nvml_view(planner))
    assert planner.ledger.pending("gpu:local:0") == {} and planner.ledger.free("gpu:local:0") == 80 * GiB


def test_memory_that_nvml_cannot_map_to_a_deployment_stays_charged_as_external():
    planner = MemoryPlanner(DaemonConfig(), local_gpus=CARDS)
    first = vllm("first", 2)
    start(planner, first, [])
    first.state = "stopped"
    planner.observe(first)
    view = nvml_view(planner)
    view[0]["memory_free"] -= 5 * GiB  # a process in another pid namespace, say
    planner.observe_gpus("local", view)
    assert planner.ledger.pending("gpu:local:0") == {} and planner.ledger.external("gpu:local:0") == 5 * GiB
    assert planner.ledger.free("gpu:local:0") == 75 * GiB


# -- two deployments on one card: launch shares from the plan ------------------------------------

def test_two_deployments_on_one_card_get_shares_that_fit_the_card():
    card = GpuCard(0, "NVIDIA H100 80GB HBM3", 80 * GiB)
    planner = MemoryPlanner(DaemonConfig(), local_gpus=(card,))
    a, b = vllm("a", 1, "30GiB"), vllm("b", 1, "50GiB")  # 80 GiB on paper: exactly the card
    start(planner, a, [])
    a.state = "ready"
    planner.observe(a)
    assert start(planner, b, [a]) == []
    assert planner.gpus_for(a) == planner.gpus_for(b) == (0,)
    (fa, ba), (fb, bb) = planner.launch_memory(a), planner.launch_memory(b)
    assert (ba, bb) == (30 * GiB, 50 * GiB)
    assert fa <= 30 / 80 and fb <= 50 / 80 and fa + fb <= 1
    assert fa == 0.368 and fb == 0.618  # the budget less its startup headroom, rounded down


def test_the_shares_start_one_after_the_other_on_a_fake_card_where_the_default_fails():
    from tests.fakes.fake_nvml import EngineStartFailed, FakeDevice, start_like_vllm

    card = GpuCard(0, "NVIDIA H100 80GB HBM3", 80 * GiB)
    planner = MemoryPlanner(DaemonConfig(), local_gpus=(card,))
    a, b = vllm("a", 1, "30GiB"), vllm("b", 1, "50GiB")
    start(planner, a, [])
    a.state = "ready"
    planner.observe(a)
    start(planner, b, [a])
    device = FakeDevice("NVIDIA H100 80GB HBM3", "GPU-0", 0, total=80 * GiB)
    held_a = start_like_vllm(device, 101, planner.launch_memory(a)[0])
    held_b = start_like_vllm(device, 102, planner.launch_memory(b)[0])
    assert held_a <= 30 * GiB and held_b <= 50 * GiB and device.used <= device.total
    # Without the shares, vLLM's default (0.92, vllm/config/cache.py) takes the card: b cannot start.
    crowded = FakeDevice("NVIDIA H100 80GB HBM3", "GPU-1", 1, total=80 * GiB)
    start_like_vllm(crowded, 201, 0.92)
    with pytest.raises(EngineStartFailed, match="less than desired GPU memory utilization"):
        start_like_vllm(crowded, 202, 0.92)


def test_a_whole_card_deployment_keeps_the_engine_default_and_a_cpu_one_has_no_share():
    planner = MemoryPlanner(DaemonConfig(), local_gpus=CARDS)
    whole = _Actor(parse_manifest("name: whole\nengine: vllm\nmodel: {hf: org/m}\nresources: {gpus: 1, ram: 1GiB}\n"))
    start(planner, whole, [])
    # The model is not on disk yet, so nothing to estimate from: a whole card, the engine's default share.
    assert planner.gpus_for(whole) == (0,) and planner.launch_memory(whole) == (None, 80 * GiB)
    cpu = _Actor(parse_manifest("name: cpu\nengine: vllm\nmodel: {hf: org/c}\nresources: {ram: 1GiB}\n"))
    start(planner, cpu, [whole])
    assert planner.launch_memory(cpu) == (None, None)


# -- estimates where the manifest gives no gpu_memory -------------------------------------------

def _hf_model(tmp_path, weights: int, **config) -> str:
    import json
    folder = tmp_path / "model"
    folder.mkdir()
    base = {"num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 2048,
            "max_position_embeddings": 4096}
    (folder / "config.json").write_text(json.dumps({**base, **config}))
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(weights)  # sparse: only its size matters
    return str(folder)


def test_vllm_without_gpu_memory_is_charged_weights_kv_cache_and_overhead(tmp_path):
    from capyctl.controller._memory import ENGINE_OVERHEAD
    path = _hf_model(tmp_path, 3 * GiB)
    actor = _Actor(parse_manifest(f"name: est\nengine: vllm\nmodel: {{path: {path}}}\nresources: {{gpus: 1}}\n"))
    planner = MemoryPlanner(DaemonConfig(), local_gpus=CARDS)
    kv_per_token = 2 * 24 * 8 * (2048 // 16) * 2  # K and V, layers, kv heads, head size, 16-bit
    size = 3 * GiB + len((tmp_path / "model" / "config.json").read_bytes())
    assert planner.footprint(actor).gpu_memory == size + 2 * kv_per_token * 4096 + ENGINE_OVERHEAD
    shorter = _Actor(parse_manifest(f"name: est\nengine: vllm\nmodel: {{path: {path}}}\nresources: {{gpus: 1}}\n"
                                    "engine_args: [--max-model-len, 1K]\n"))
    assert planner.footprint(shorter).gpu_memory == size + 2 * kv_per_token * 1024 + ENGINE_OVERHEAD
    start(planner, actor, [])
    fraction, budget = planner.launch_memory(actor)
    assert budget == planner.footprint(actor).gpu_memory and fraction < budget / (24 * GiB)
    assert planner.gpus_for(actor) == (1,)  # the tightest card that holds it: the L4


def test_an_estimate_larger_than_any_card_asks_for_a_whole_card(tmp_path):
    path = _hf_model(tmp_path, 90 * GiB)
    actor = _Actor(parse_manifest(f"name: big\nengine: vllm\nmodel: {{path: {path}}}\nresources: {{gpus: 1}}\n"))
    assert MemoryPlanner(DaemonConfig(), local_gpus=CARDS).footprint(actor).gpu_memory is None


# -- measured after ready ---------------------------------------------------------------------------

class _Systemd:
    def __init__(self, current: int) -> None:
        self.current = current

    async def memory_current(self, unit: str) -> int:
        assert unit == "capyctl-est.service"
        return self.current


class _Hosts:
    def __init__(self, systemd: _Systemd) -> None:
        self._systemd = systemd

    def systemd(self, host: str) -> _Systemd:
        return self._systemd


class _MeasuringController:
    def __init__(self, planner: MemoryPlanner, ram: int) -> None:
        self.memory = planner
        self.hosts = _Hosts(_Systemd(ram))


@pytest.fixture
def nvml_with_est(monkeypatch, tmp_path):
    """A fake NVML whose card 1 shows pid 4242 of capyctl-est.service using 5 GiB, read through
    CapyCTL's own inventory code (capyctl.hosts.gpu_inventory) with a /proc where that pid lives."""
    import functools
    import sys

    import capyctl.hosts
    from capyctl.hosts.inventory import gpu_inventory
    from tests.fakes.fake_nvml import FakeDevice, FakeNvml

    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text("0::/capyctl.slice/capyctl-est.service\n")
    nvml = FakeNvml([FakeDevice("NVIDIA H100 80GB HBM3", "GPU-a", 0, 80 * GiB),
                     FakeDevice("NVIDIA L4", "GPU-b", 1, 24 * GiB, used=5 * GiB, compute=[(4242, 5 * GiB)]),
                     FakeDevice("NVIDIA H100 80GB HBM3", "GPU-c", 2, 80 * GiB)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(capyctl.hosts, "gpu_inventory", functools.partial(gpu_inventory, proc))
    return nvml


async def test_estimates_are_corrected_by_what_nvml_and_the_cgroup_measure(tmp_path, nvml_with_est):
    from capyctl.controller._memory import GPU_MEASURE_MARGIN, RAM_MEASURE_MARGIN, RAM_MEASURE_SLACK, measure
    path = _hf_model(tmp_path, 3 * GiB)
    actor = _Actor(parse_manifest(f"name: est\nengine: vllm\nmodel: {{path: {path}}}\nresources: {{gpus: 1}}\n"))
    planner = MemoryPlanner(DaemonConfig(), local_gpus=CARDS)
    start(planner, actor, [])
    estimated = planner.ledger.holders("gpu:local:1")["est"]
    assert estimated > 5.5 * GiB
    actor.state = "ready"
    planner.observe(actor)
    changed = await measure(_MeasuringController(planner, 900 << 20), actor)
    assert planner.ledger.holders("gpu:local:1") == {"est": changed["gpu_memory"]}
    assert changed["gpu_memory"] == math.ceil(5 * GiB * GPU_MEASURE_MARGIN) < estimated
    assert planner.ledger.holders("ram:local")["est"] == math.ceil((900 << 20) * RAM_MEASURE_MARGIN) + RAM_MEASURE_SLACK
    assert planner.ledger.pending("gpu:local:1") == {}  # a correction is no release
    assert planner.ledger.free("gpu:local:1") == 24 * GiB - changed["gpu_memory"]


async def test_a_budget_the_manifest_gives_is_not_replaced_by_a_measurement(tmp_path, nvml_with_est):
    from capyctl.controller._memory import measure
    actor = _Actor(parse_manifest("name: est\nengine: vllm\nmodel: {hf: org/est}\n"
                                  "resources: {gpus: 1, gpu_memory: 20GiB, ram: 2GiB}\n"))
    planner = MemoryPlanner(DaemonConfig(), local_gpus=CARDS)
    start(planner, actor, [])
    actor.state = "ready"
    planner.observe(actor)
    assert await measure(_MeasuringController(planner, 900 << 20), actor) == {}
    assert planner.ledger.holders("gpu:local:1") == {"est": 20 * GiB}


# -- the launch the controller builds ---------------------------------------------------------------

class _GateRecordingSystemd(RecordingSystemd):
    """Where the D-Bus client goes: records, besides the transient units the controller starts,
    the units stopped, the gates opened and each unit's last description."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped: list = []
        self.gates_opened: list = []
        self.descriptions: dict = {}

    async def open_gate(self, name):
        self.gates_opened.append(name)
        return await super().open_gate(name)

    async def set_description(self, name, description):
        self.descriptions[name] = description
        await super().set_description(name, description)

    async def stop_unit(self, name, timeout=30.0):
        self.stopped.append(name)
        await super().stop_unit(name, timeout)


@pytest.fixture
async def vllm_on_two_cards(tmp_path, monkeypatch):
    """A Controller over a recording systemd and two fake cards (an L4, an H100), with vLLM
    registered and a model directory: (controller, systemd, launch contexts, model path)."""
    import sys

    from capyctl.engines.vllm import VllmAdapter
    from tests.controllers import vllm_controller
    from tests.fakes.fake_nvml import FakeDevice, FakeNvml

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([
        FakeDevice("NVIDIA L4", "GPU-l4", minor=3, total=24 * GiB),
        FakeDevice("NVIDIA H100 80GB HBM3", "GPU-h100", minor=7, total=80 * GiB)]))
    contexts = []
    build = VllmAdapter.build_launch
    monkeypatch.setattr(VllmAdapter, "build_launch", lambda self, ctx: contexts.append(ctx) or build(self, ctx))
    systemd = _GateRecordingSystemd()
    async with vllm_controller(tmp_path, systemd) as (ctl, model):
        yield ctl, systemd, contexts, model


async def test_the_controllers_launch_carries_the_planned_share_and_only_the_planned_card(vllm_on_two_cards):
    ctl, systemd, contexts, model = vllm_on_two_cards
    actor = await ctl.deploy(parse_manifest(f"name: chat\nengine: vllm\nmodel: {{path: {model}}}\n"
                                            "resources: {gpus: 1, gpu_memory: 30GiB, ram: 2GiB}\npark: stop\n"))
    await ctl.make_room(actor, lambda _: None)
    await actor._launch(lambda _: None)
    ctx, unit = contexts[-1], systemd.started[-1]
    # The H100 (NVML index 1, /dev/nvidia7): the L4 cannot hold 30 GiB.
    assert ctx.gpu_indices == [1] and unit.devices == ["/dev/nvidia7", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert ctx.gpu_memory_budget == 30 * GiB and ctx.gpu_memory_fraction == 0.368
    assert unit.environment["CUDA_VISIBLE_DEVICES"] == "1"
    assert unit.environment["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


async def _ready_on_the_h100(ctl, model):
    actor = await ctl.deploy(parse_manifest(f"name: chat\nengine: vllm\nmodel: {{path: {model}}}\n"
                                            "resources: {gpus: 1, gpu_memory: 30GiB, ram: 2GiB}\npark: stop\n"))
    await ctl.make_room(actor, lambda _: None)
    await actor._launch(lambda _: None)
    actor._set("ready")
    return actor


async def test_a_park_arms_the_next_launch_on_the_planned_card_and_a_changed_plan_is_not_used(vllm_on_two_cards):
    """A park by stopping starts the next launch's unit held at its gate (controller/_actor.py
    _arm) with the card and share the plan gives; the wake opens that gate only while the plan
    is unchanged, else stops the armed unit and launches afresh."""
    ctl, systemd, contexts, model = vllm_on_two_cards
    actor = await _ready_on_the_h100(ctl, model)
    running = systemd.started[-1]
    assert not running.gated

    assert await actor._do_park() == "parked"
    armed = systemd.started[-1]
    assert armed is not running and armed.gated and systemd.stopped == ["capyctl-chat.service"]
    assert armed.exec_argv()[:4] == ["/bin/sh", "-c", 'kill -STOP $$ && exec "$@"', "capyctl-gate"]
    assert armed.devices == running.devices == ["/dev/nvidia7", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert armed.markers["gate"] == "armed" and actor.describe()["armed"] is True
    launched = []

    async def launch():
        launched.append(actor.name)

    await RESTART.wake(actor, lambda _: None, launch)  # as _do_wake does
    assert systemd.gates_opened == ["capyctl-chat.service"] and actor.describe()["armed"] is False
    assert launched == [] and actor.parked == "no"

    # Parked again and armed; then placement moves it to the other card before the wake.
    actor._set(DeploymentState.WAKING)  # as _do_wake does around the gate it opened
    actor._set(DeploymentState.READY)
    await actor._do_park()
    assert systemd.started[-1].gated
    ctl.memory.gpus_for = lambda actor, rank=None: (0,)
    await RESTART.wake(actor, lambda _: None, launch)
    assert systemd.gates_opened == ["capyctl-chat.service"]  # that gate was not opened
    assert systemd.stopped[-1] == "capyctl-chat.service" and actor.describe()["armed"] is False
    assert launched == ["chat"]  # launched afresh


async def test_an_eviction_arms_after_it_returns_and_the_next_wake_opens_the_gate(vllm_on_two_cards):
    """The wake an eviction makes room for waits for the park to return, so the park arms the next
    launch only after it (the deployment's next command waits for that); an idle park arms within."""
    ctl, systemd, contexts, model = vllm_on_two_cards
    actor = await _ready_on_the_h100(ctl, model)
    assert await actor.submit(Command.PARK, evicting=True) == "parked"
    assert len(systemd.started) == 1 and actor.parked == "stopped"  # returned before arming
    await actor._arming
    assert systemd.started[-1].gated and actor.parked == "armed" and actor.describe()["armed"] is True

    async def launch():
        raise AssertionError("an armed wake starts no unit")

    await RESTART.wake(actor, lambda _: None, launch)  # as _do_wake does once its room is made
    assert systemd.gates_opened == ["capyctl-chat.service"] and actor.parked == "no"
    await actor._do_stop()
    await actor._launch(lambda _: None)
    actor._set("ready")
    await actor._do_park(evicting=True, idle=True)
    assert systemd.started[-1].gated and actor.describe()["armed"] is True


async def test_a_failure_to_arm_leaves_the_park_standing(vllm_on_two_cards, monkeypatch):
    """Arming is an optimisation: a launch that cannot be built at the park (here a bug's
    ValueError) leaves the deployment parked, unarmed, and nothing of the armed unit behind."""
    from capyctl.engines.vllm import VllmAdapter
    ctl, systemd, contexts, model = vllm_on_two_cards
    actor = await _ready_on_the_h100(ctl, model)
    monkeypatch.setattr(VllmAdapter, "build_launch", lambda self, ctx: (_ for _ in ()).throw(ValueError("a bug")))
    assert await actor._do_park() == "parked"
    assert actor.describe()["armed"] is False and len(systemd.started) == 1
    assert systemd.stopped[-1] == "capyctl-chat.service"
