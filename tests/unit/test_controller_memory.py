"""The controller's bridge to the scheduler: GPU deployments get identical cards, and the cards
they hold are what their unit is given."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from capyctl.config import DaemonConfig
from capyctl.controller._memory import MemoryPlanner
from capyctl.engines import adapter_for
from capyctl.scheduler import GpuCard, NoRoom
from capyctl.spec import parse_manifest


class _Controller:
    def adapter(self, spec):
        return adapter_for(spec.engine)


@dataclass
class _Actor:
    """The fields of DeploymentActor the planner reads."""

    spec: object
    state: str = "stopped"
    last_used: float = 0.0
    busy: bool = False
    parked_in_place: bool = False
    host: str = "local"
    model_path: str | None = None
    controller: _Controller = field(default_factory=_Controller)
    _commands: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def name(self) -> str:
        return self.spec.name


def vllm(name: str, gpus: int, memory: str = "60GiB") -> _Actor:
    return _Actor(parse_manifest(f"name: {name}\nengine: vllm\nmodel: {{hf: org/{name}}}\ntensor_parallel: {gpus}\n"
                                 f"resources: {{gpus: {gpus}, gpu_memory: {memory}, ram: 4GiB}}\npark: stop\n"))


CARDS = (GpuCard(0, "NVIDIA H100 80GB HBM3", 80 << 30), GpuCard(1, "NVIDIA L4", 24 << 30),
         GpuCard(2, "NVIDIA H100 80GB HBM3", 80 << 30))


def start(planner: MemoryPlanner, actor: _Actor, others: list[_Actor], now: float = 100.0):
    victims = planner.plan(actor, [actor, *others], now)
    for victim, _ in victims:
        victim.state = "parked"
        planner.observe(victim)
    if victims:
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
