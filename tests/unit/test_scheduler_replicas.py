"""Replicas of one deployment (issue 46): each is charged under its own name, and placement spreads
them over cards and hosts where room allows and never evicts one to start another."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

import pytest

from capyctl.config import DaemonConfig, replica_name, unit_name
from capyctl.controller._memory import MemoryPlanner
from capyctl.scheduler import (Candidate, Footprint, GpuCard, HostResources, Ledger, NoRoom, Request, Victim,
                               plan)
from capyctl.spec import parse_manifest
from tests.fakes.deployments import PlacedDeploymentFake

GiB = 1 << 30
NOW = 1000.0
H100 = "NVIDIA H100 80GB HBM3"


def host(name: str = "gpu1", cards: int = 8, cores: int = 0) -> HostResources:
    return HostResources(name, 512 * GiB, 0, tuple(GpuCard(i, H100, 80 * GiB) for i in range(cards)),
                         tuple((i,) for i in range(cores)))


def candidates(ledger: Ledger, **busy: bool) -> list[Candidate]:
    """Every deployment the ledger holds, idle unless named busy, used in the order placed."""
    return [Candidate(p.deployment, p.state, float(i), busy=busy.get(p.deployment, False))
            for i, p in enumerate(ledger.placements())]


def place_replicas(ledger: Ledger, fp: Footprint, count: int, deployment: str = "chat") -> list[tuple[str, tuple]]:
    """Place ``count`` replicas one after the other, as the controller starts them: each request's
    siblings are the replicas placed before it. Returns (host, cards) of each."""
    names = [replica_name(deployment, k) for k in range(1, count + 1)]
    for k, name in enumerate(names):
        request = Request(name, fp, siblings=frozenset(names[:k]))
        result = plan(request, ledger, candidates(ledger), NOW)
        assert result.victims == ()
        ledger.apply(result, request)
    return [(ledger.get(n).host, ledger.get(n).gpus) for n in names]


# -- one 8-GPU host ---------------------------------------------------------------------------------

def test_four_one_gpu_replicas_land_on_four_cards() -> None:
    # 20 GiB each: all four fit on one card, and the tightest fit alone would pack them there.
    placed = place_replicas(Ledger([host()]), Footprint(1, 20 * GiB, GiB), 4)
    assert sorted(gpus for _, gpus in placed) == [(0,), (1,), (2,), (3,)]


def test_four_two_gpu_replicas_use_all_eight_cards_without_sharing() -> None:
    placed = place_replicas(Ledger([host()]), Footprint(2, 20 * GiB, GiB), 4)
    cards = [i for _, gpus in placed for i in gpus]
    assert sorted(cards) == list(range(8))


def test_without_siblings_the_same_requests_pack_onto_one_card() -> None:
    """The contrast: deployments that are not replicas keep the tightest fit."""
    ledger = Ledger([host()])
    for name in ("a", "b", "c"):
        request = Request(name, Footprint(1, 20 * GiB, GiB))
        ledger.apply(plan(request, ledger, candidates(ledger), NOW), request)
    assert {ledger.get(n).gpus for n in "abc"} == {(0,)}


def test_a_ninth_replica_shares_a_card_with_a_single_sibling() -> None:
    placed = place_replicas(Ledger([host()]), Footprint(1, 20 * GiB, GiB), 9)
    cards = [gpus[0] for _, gpus in placed]
    assert sorted(cards[:8]) == list(range(8)) and cards.count(cards[8]) == 2


# -- several hosts ------------------------------------------------------------------------------------

def test_two_replicas_on_two_one_card_hosts_go_one_per_host() -> None:
    ledger = Ledger([host("ga", 1), host("gb", 1)])
    placed = place_replicas(ledger, Footprint(1, 20 * GiB, GiB), 2)
    assert placed == [("ga", (0,)), ("gb", (0,))]


def test_free_cards_on_a_sibling_s_host_come_after_a_host_without_siblings() -> None:
    ledger = Ledger([host("ga", 4), host("gb", 4)])
    placed = place_replicas(ledger, Footprint(1, 20 * GiB, GiB), 4)
    assert [h for h, _ in placed] == ["ga", "gb", "ga", "gb"]


def test_cpu_replicas_spread_over_hosts_and_get_cores_of_their_own() -> None:
    ledger = Ledger([host("ca", 0, cores=4), host("cb", 0, cores=4)])
    placed = place_replicas(ledger, Footprint(ram=GiB, cores=2), 4)
    assert [h for h, _ in placed] == ["ca", "cb", "ca", "cb"]
    on_ca = [ledger.cores_of(n) for n in ("chat", "chat@3")]
    assert len(on_ca[0]) == len(on_ca[1]) == 2 and not set(on_ca[0]) & set(on_ca[1])


# -- no room to spread ----------------------------------------------------------------------------------

def two_cards_one_taken() -> Ledger:
    """Card 1 held by an idle other deployment; replica 1 of chat on card 0 with room left."""
    ledger = Ledger([host(cards=2)])
    ledger.place("other", Footprint(1, 70 * GiB, GiB), "gpu1", (1,), "ready")
    ledger.place("chat", Footprint(1, 30 * GiB, GiB), "gpu1", (0,), "ready")
    return ledger


def test_when_only_a_sibling_s_card_has_room_the_replica_shares_it_rather_than_evict() -> None:
    ledger = two_cards_one_taken()
    result = plan(Request("chat@2", Footprint(1, 30 * GiB, GiB), siblings=frozenset({"chat"})),
                  ledger, candidates(ledger), NOW)
    assert (result.gpus, result.victims) == ((0,), ())


def test_a_sibling_is_never_a_victim() -> None:
    ledger = two_cards_one_taken()
    ledger.set_state("other", "starting")  # card 1 is not to be had; card 0 only by evicting chat
    fp = Footprint(1, 60 * GiB, GiB)
    # Not a replica, it would evict the idle chat ...
    unrelated = plan(Request("new", fp), ledger, candidates(ledger), NOW)
    assert unrelated.victims == (Victim("chat", "stop"),)
    # ... but chat's own replica never does, and no room names the sibling that holds it.
    with pytest.raises(NoRoom) as info:
        plan(Request("chat@2", fp, siblings=frozenset({"chat"})), ledger, candidates(ledger), NOW)
    assert info.value.detail["hosts"]["gpu1"]["replicas"] == ["chat (30.0 GiB on gpu:gpu1:0, 1.0 GiB on ram:gpu1)"]
    assert "held by its other replicas: chat" in info.value.message


def test_spreading_never_costs_a_victim() -> None:
    """Fewest victims first: sharing a sibling's card beats evicting another deployment."""
    ledger = Ledger([host(cards=2)])
    ledger.place("other", Footprint(1, 70 * GiB, GiB), "gpu1", (1,), "ready")
    placed = place_replicas(ledger, Footprint(1, 20 * GiB, GiB), 2)
    assert placed == [("gpu1", (0,)), ("gpu1", (0,))]


def test_a_sibling_parked_in_place_keeps_its_card_and_a_stopped_one_does_not() -> None:
    ledger = Ledger([host(cards=2)])
    fp = Footprint(1, 20 * GiB, GiB, parked_ram=4 * GiB)
    ledger.place("chat", fp, "gpu1", (0,), "parked", in_place=True)  # it wakes on card 0
    request = Request("chat@2", fp, siblings=frozenset({"chat"}))
    assert plan(request, ledger, candidates(ledger), NOW).gpus == (1,)
    ledger.set_state("chat", "stopped")
    assert plan(request, ledger, candidates(ledger), NOW).gpus == (0,)


# -- through the controller's memory planner, with cards from a fake NVML ------------------------------

@dataclass
class _Replica(PlacedDeploymentFake):
    """One replica actor: its own ledger name, and its siblings' (DeploymentActor.sibling_names)."""

    replica: str = ""
    sibling_names: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.replica

    @property
    def unit(self) -> str:
        return unit_name(self.replica)


def replicas(count: int, gpus: int = 1, hosts: str = "") -> list[_Replica]:
    spec = parse_manifest(f"name: chat\nengine: vllm\nmodel: {{hf: org/chat}}\ntensor_parallel: {gpus}\n"
                          f"resources: {{gpus: {gpus}, gpu_memory: 20GiB, ram: 4GiB}}\npark: stop\n{hosts}")
    names = [replica_name("chat", k) for k in range(1, count + 1)]
    return [_Replica(spec, replica=n, sibling_names=tuple(m for m in names if m != n)) for n in names]


def fake_nvml(monkeypatch, cards: int):
    from tests.fakes.fake_nvml import FakeDevice, FakeNvml
    nvml = FakeNvml([FakeDevice(H100, f"GPU-{i}", i, 80 * GiB) for i in range(cards)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def start_all(monkeypatch, planner: MemoryPlanner, actors: list[_Replica], nvml_by_host: dict, proc) -> None:
    """Start the replicas one after the other as the controller does, each engine then showing up in
    its host's fake NVML (pid -> its unit's cgroup) and that view fed back to the planner."""
    from capyctl.hosts.inventory import gpu_inventory
    for pid, actor in enumerate(actors, start=5000):
        assert planner.plan(actor, actors, NOW, hosts=tuple(nvml_by_host)) == []
        planner.charge(actor)
        actor.state, actor.host = "starting", planner.ledger.get(actor.name).host
        planner.observe(actor)
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::/capyctl.slice/{actor.unit}\n")
        nvml = nvml_by_host[actor.host]
        for index in planner.gpus_for(actor):
            nvml.devices[index].used += 20 * GiB
            nvml.devices[index].compute.append((pid, 20 * GiB))
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        planner.observe_gpus(actor.host, [asdict(g) for g in gpu_inventory(proc)])


def test_four_replicas_spread_over_an_eight_gpu_host_from_a_fake_nvml(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CAPYCTL_RAM_BUDGET", "512GiB")
    nvml = fake_nvml(monkeypatch, 8)
    planner = MemoryPlanner(DaemonConfig(), local_cores=())  # its cards read through the inventory
    assert len(planner.ledger.host_domains("local")) == 9
    actors = replicas(4)
    start_all(monkeypatch, planner, actors, {"local": nvml}, tmp_path / "proc")
    assert sorted(planner.gpus_for(a) for a in actors) == [(0,), (1,), (2,), (3,)]
    seen = {d.minor: [pid for pid, _ in d.compute] for d in nvml.devices}
    assert all(len(pids) <= 1 for pids in seen.values())  # NVML shows one engine per card
    assert planner.ledger.free("gpu:local:0") == 60 * GiB and planner.ledger.pending("gpu:local:0") == {}


def test_two_gpu_replicas_fill_the_eight_gpu_host_from_a_fake_nvml(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CAPYCTL_RAM_BUDGET", "512GiB")
    nvml = fake_nvml(monkeypatch, 8)
    planner = MemoryPlanner(DaemonConfig(), local_cores=())
    actors = replicas(4, gpus=2)
    start_all(monkeypatch, planner, actors, {"local": nvml}, tmp_path / "proc")
    assert sorted(i for a in actors for i in planner.gpus_for(a)) == list(range(8))


def test_two_replicas_go_one_to_each_host_from_their_fake_nvml(monkeypatch, tmp_path) -> None:
    from capyctl.hosts import host_inventory
    monkeypatch.setenv("CAPYCTL_RAM_BUDGET", "512GiB")
    planner = MemoryPlanner(DaemonConfig(), local_gpus=(), local_cores=())
    nvml_by_host = {}
    for name in ("ga", "gb"):  # each host's inventory as its host-info would read it
        nvml_by_host[name] = fake_nvml(monkeypatch, 1)
        planner.set_host(name, host_inventory().resources())
    actors = replicas(2, hosts="hosts: [ga, gb]\n")
    start_all(monkeypatch, planner, actors, nvml_by_host, tmp_path / "proc")
    assert [(planner.ledger.get(a.name).host, planner.gpus_for(a)) for a in actors] == [("ga", (0,)), ("gb", (0,))]
