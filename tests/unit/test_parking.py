"""Declared park tiers, what a park really released, and the proof after a wake (issue 16).

The proof against engines is in tests/integration/test_park_proof.py (the fake vLLM whose
weights come back wrong, the real llama-server that passes it)."""

from __future__ import annotations

import sys

import pytest

from capyctl.config import DaemonConfig, Paths
from capyctl.controller._memory import MemoryPlanner
from capyctl.engines import adapter_for
from capyctl.engines._tiers import check_park_tier, resolve_park_tier
from capyctl.errors import CapyError
from capyctl.hosts import unified_memory_default
from capyctl.scheduler import Candidate, Footprint, GpuCard, HostResources, Ledger, Request, plan
from capyctl.spec import EngineSpec, ManifestError, parse_manifest
from capyctl.store import Store

GiB = 1 << 30


def vllm_spec(extra: str = "") -> "object":
    return parse_manifest(f"name: q\nengine: vllm\nmodel: {{path: /models/q}}\nresources: {{gpus: 1}}\n{extra}")


def test_old_manifests_load_and_park_level_is_an_alias():
    assert vllm_spec("park_level: 2\n").park_level == 2
    assert resolve_park_tier(adapter_for("vllm"), vllm_spec("park_level: 2\n")) == "deep"
    assert resolve_park_tier(adapter_for("vllm"), vllm_spec()) == "host_backed"
    assert resolve_park_tier(adapter_for("vllm"), vllm_spec("park: stop\n")) == "restart"
    # Unset on a unified-memory host: deep, never a host copy that frees nothing.
    assert resolve_park_tier(adapter_for("vllm"), vllm_spec(), unified_memory=True) == "deep"
    # A CPU vLLM (no sleep mode) with the old default park_level: 1 still loads and parks by stopping.
    cpu = parse_manifest("name: c\nengine: vllm\nmodel: {path: /m}\npark_level: 1\n")
    assert resolve_park_tier(adapter_for("vllm"), cpu) == "restart"
    with pytest.raises(ManifestError, match="park_tier is deep but park_level is 1"):
        vllm_spec("park_tier: deep\npark_level: 1\n")
    with pytest.raises(ManifestError, match="park is stop but park_tier is host_backed"):
        vllm_spec("park: stop\npark_tier: host_backed\n")


def test_tiers_the_engine_cannot_deliver_are_refused_naming_the_field():
    with pytest.raises(CapyError) as err:
        check_park_tier(adapter_for("llama.cpp"), parse_manifest(
            "name: l\nengine: llama.cpp\nmodel: {path: /m.gguf}\npark_tier: deep\n"), host="local", unified_memory=False)
    assert err.value.code == "park_tier_unsupported" and err.value.detail["field"] == "park_tier"
    with pytest.raises(CapyError, match="sleep mode exists only on CUDA"):
        check_park_tier(adapter_for("vllm"), parse_manifest("name: c\nengine: vllm\nmodel: {path: /m}\n"
                                                            "park_tier: host_backed\n"), host="local",
                        unified_memory=False)
    with pytest.raises(CapyError, match="level 2 only"):
        check_park_tier(adapter_for("tensorfold"), parse_manifest(
            "name: t\nengine: tensorfold\nmodel: {path: /m}\nresources: {gpus: 1}\npark_tier: host_backed\n"),
            host="local", unified_memory=False)
    check_park_tier(adapter_for("sglang"), parse_manifest(
        "name: s\nengine: sglang\nmodel: {path: /m}\npark_tier: deep\n"), host="local", unified_memory=True)


def test_unified_memory_is_known_from_the_gpu_where_certain():
    assert unified_memory_default(["NVIDIA GB10"]) is True
    assert unified_memory_default(["NVIDIA H100 80GB HBM3"]) is False
    assert unified_memory_default([]) is False
    assert unified_memory_default(["NVIDIA GH200 480GB"]) is None  # asked at host add


class _Systemd:
    async def unit_state(self, name):
        return None


async def test_host_backed_is_refused_at_deploy_on_a_unified_memory_host(tmp_path, monkeypatch):
    """A GB10 (NVML's name): GPU and host memory are one pool, so host_backed frees nothing."""
    from capyctl.controller import Controller
    from tests.fakes.fake_nvml import FakeDevice, FakeNvml

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([FakeDevice("NVIDIA GB10", "GPU-gb10", 0, 119 * GiB)]))
    monkeypatch.delenv("CAPYCTL_UNIFIED_MEMORY", raising=False)
    state = tmp_path / "state"
    state.mkdir()
    store = Store(state / "state.db")
    ctl = Controller(DaemonConfig(paths=Paths(state_dir=state, runtime_dir=tmp_path / "run")), store, _Systemd())
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    store.put_engine(EngineSpec.model_validate({"kind": "engine", "name": "vllm", "type": "vllm", "path": str(venv)}))
    try:
        assert ctl.unified_memory("local")
        with pytest.raises(CapyError) as err:
            await ctl.deploy(vllm_spec("park_tier: host_backed\n"))
        assert err.value.code == "park_tier_unsupported" and err.value.status == 400
        assert "park_tier: host_backed" in err.value.message and "one pool" in err.value.message
        assert store.get_deployment("q") is None  # refused before anything is recorded
        # deep is deliverable there, and a manifest that declares nothing parks deep.
        actor = await ctl.deploy(parse_manifest("name: d\nengine: vllm\nmodel: {path: /m}\nresources: {gpus: 1}\n"))
        assert actor.park_tier == "deep" and actor.describe()["park_tier"] == "deep"
        assert (await ctl.deploy(vllm_spec("park_tier: deep\n"))).park_tier == "deep"
    finally:
        await ctl.close()
        store.close()


def test_memory_a_park_did_not_release_stays_charged():
    ledger = Ledger([HostResources("local", 64 * GiB, 0, (GpuCard(0, "NVIDIA L4", 24 * GiB),))])
    fp = Footprint(gpus=1, gpu_memory=20 * GiB, ram=4 * GiB, parked_ram=0)  # deep: nothing kept
    ledger.place("a", fp, "local", (0,), "ready")
    ledger.set_state("a", "parked", in_place=True)
    assert ledger.holders("gpu:local:0") == {} and ledger.pending("gpu:local:0") == {"a": 20 * GiB}
    # NVML (per process) shows 6 GiB still held after the park: it stays charged, not pending.
    ledger.retain("a", {"gpu:local:0": 6 * GiB})
    assert ledger.holders("gpu:local:0") == {"a": 6 * GiB}
    assert ledger.pending("gpu:local:0") == {"a": 14 * GiB}
    assert ledger.retained("a") == {"gpu:local:0": 6 * GiB}
    ledger.set_state("a", "waking")  # the wake takes its whole footprint back
    assert ledger.holders("gpu:local:0") == {"a": 20 * GiB} and ledger.retained("a") == {}


def test_the_planner_evicts_the_deployment_that_wakes_cheaply_first():
    ledger = Ledger([HostResources("local", 64 * GiB, 0, (GpuCard(0, "NVIDIA L4", 24 * GiB),))])
    fp = Footprint(gpus=1, gpu_memory=12 * GiB, ram=GiB)
    for name in ("slow", "fast"):
        ledger.place(name, fp, "local", (0,), "ready")
    candidates = [Candidate("slow", "ready", last_used=10.0, wake_seconds=45.0),
                  Candidate("fast", "ready", last_used=20.0, wake_seconds=0.4)]
    result = plan(Request("new", fp), ledger, candidates, now=100.0)
    # "slow" is the least recently used, but "fast" comes back in under a second.
    assert [v.deployment for v in result.victims] == ["fast"]


async def test_after_a_park_nvml_and_the_cgroup_decide_what_stays_charged(tmp_path, monkeypatch):
    """measure_retained reads the fake NVML per process and the unit's cgroup memory."""
    import functools

    import capyctl.hosts
    from capyctl.controller._parking import measure_retained
    from capyctl.hosts.inventory import gpu_inventory
    from tests.fakes.fake_nvml import FakeDevice, FakeNvml

    proc = tmp_path / "proc"
    (proc / "77").mkdir(parents=True)
    (proc / "77" / "cgroup").write_text("0::/capyctl.slice/capyctl-q.service\n")
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([
        FakeDevice("NVIDIA L4", "GPU-l4", 0, 24 * GiB, used=3 * GiB, compute=[(77, 3 * GiB)])]))
    monkeypatch.setattr(capyctl.hosts, "gpu_inventory", functools.partial(gpu_inventory, proc))
    planner = MemoryPlanner(DaemonConfig(), local_gpus=(GpuCard(0, "NVIDIA L4", 24 * GiB),))
    planner.ledger.place("q", Footprint(gpus=1, gpu_memory=20 * GiB, ram=2 * GiB, parked_ram=0), "local", (0,), "ready")
    planner.ledger.set_state("q", "parked", in_place=True)

    class Systemd:
        async def memory_current(self, unit):
            return 900 << 20  # the process kept 900 MiB of RAM

    class Hosts:
        entries: dict = {}

        def systemd(self, host):
            return Systemd()

    class Ctl:
        memory = planner
        hosts = Hosts()

    class Actor:
        name, host, unit = "q", "local", "capyctl-q.service"

    held = await measure_retained(Ctl(), Actor())
    assert held == {"gpu:local:0": 3 * GiB, "ram:local": 900 << 20}
    planner.ledger.retain("q", held)
    assert planner.ledger.holders("gpu:local:0") == {"q": 3 * GiB}


def test_park_record_is_kept_in_the_store(tmp_path):
    store = Store(tmp_path / "state.db")
    try:
        store.put_park_record("q", {"tier": "deep", "wake_seconds": 1.25, "proof": {"result": "passed"}})
        assert store.park_record("q")["proof"] == {"result": "passed"}
        store.put_host("gb10", "ssh", address="root@gb10", unified_memory=True)
        assert store.list_hosts()[0].unified_memory is True
    finally:
        store.close()


def test_status_shows_the_park_record_and_parsers():
    from capyctl.cli import park_lines
    lines = park_lines({"park_tier": "deep", "park_record": {
        "tier": "deep", "parked_at": 1.0, "retained": {"gpu:local:0": 512 << 20}, "wake_seconds": 1.5,
        "proof": {"result": "failed", "reason": "after the wake the model generated 'x'"}},
        "parsers": {"tool_call_parser": "hermes", "tool_call_parser_source": "model_family",
                    "reasoning_parser": None, "reasoning_parser_source": "unsupported", "model_type": "qwen2"}})
    text = "\n".join(lines)
    assert "tier deep" in text and "kept charged" in text and "proof failed" in text
    assert "tool calls: hermes (model_family, model_type qwen2)" in text


def test_status_says_when_a_park_armed_the_next_launch():
    from capyctl.cli import park_lines
    record = {"tier": "restart", "parked_at": 1.0, "retained": {}}
    armed = "\n".join(park_lines({"park_tier": "restart", "park_record": record, "armed": True}))
    assert "memory released" in armed and "armed: the next launch's unit is started and waits at its gate" in armed
    assert "armed" not in "\n".join(park_lines({"park_tier": "restart", "park_record": record, "armed": False}))


def test_status_shows_the_last_wake_and_park_phases():
    from capyctl.cli import park_lines
    wake = {"kind": "wake", "phases": [{"phase": "evict", "at": 10.0, "seconds": 0.05},
                                       {"phase": "open gate", "at": 10.05, "seconds": 0.004},
                                       {"phase": "health", "at": 10.054, "seconds": 0.4},
                                       {"phase": "first answer", "at": 10.454, "seconds": 0.1}],
            "evicted": [{"deployment": "qwen", "marks": {"last answer": 9.9}}], "swap_seconds": 0.654}
    park = {"kind": "park", "phases": [{"phase": "drain", "at": 1.0, "seconds": 0.0},
                                       {"phase": "unit stop", "at": 1.0, "seconds": 0.03}]}
    text = "\n".join(park_lines({"park_tier": "restart", "park_record": {"last_wake": wake, "last_park": park}}))
    assert ("last wake's phases: evict 50 ms, open gate 4 ms, health 400 ms, first answer 100 ms; evicted qwen; "
            "0.65s from their last answer to its first") in text
    assert "last park's phases: drain 0 ms, unit stop 30 ms" in text


def test_a_proof_left_for_the_park_runs_there_unless_room_is_wanted(monkeypatch):
    """A wake that restored a prompt cache leaves its proof for the next park (WakeProof.
    before_next_park): there it runs once, and is skipped (and recorded so) while another
    deployment waits for room."""
    import asyncio
    from types import SimpleNamespace

    from capyctl.controller._proof import WakeProof

    saved: dict = {}
    controller = SimpleNamespace(room_wanted=lambda: False)
    deployment = SimpleNamespace(name="chat", controller=controller, park_record={},
                                 save_park_record=lambda **changes: saved.update(changes))
    proof = WakeProof(deployment)
    checked: list = []

    async def check(self, woken_from_park, wake_seconds, current=None, woken_at=None):
        checked.append(wake_seconds)
        assert woken_at == saved["woken_at"]  # the proof's record keeps when the wake was
        return "after the wake the model generated 'x'"

    monkeypatch.setattr(WakeProof, "check", check)
    assert not proof.left_for_park and asyncio.run(proof.at_park()) is None and checked == []
    proof.before_next_park(0.25)
    assert proof.left_for_park and saved["wake_seconds"] == 0.25  # the wake is recorded at once
    assert asyncio.run(proof.at_park()) == "after the wake the model generated 'x'" and checked == [0.25]
    assert not proof.left_for_park  # once
    proof.before_next_park(0.5)
    controller.room_wanted = lambda: True
    assert asyncio.run(proof.at_park()) is None and checked == [0.25]
    assert saved["proof"]["result"] == "skipped" and saved["wake_seconds"] == 0.5


def test_a_saved_prompt_cache_is_discarded_when_its_engine_failed_its_proof(monkeypatch):
    from types import SimpleNamespace

    from capyctl.controller import _prompt_cache as prompt_cache

    removed: list = []
    monkeypatch.setattr(prompt_cache, "remove_files", lambda directory, files: removed.extend(files))
    keeper = prompt_cache.PromptCacheKeeper(SimpleNamespace(name="chat"))
    saved = {"state": "saved", "files": ["capyctl-slot-0.bin"], "tokens": 1200}
    dropped = keeper.discard(saved, "the proof after its last wake failed: x")
    assert dropped == {"state": "dropped", "why": "the proof after its last wake failed: x", "files": [], "tokens": 0}
    assert removed == ["capyctl-slot-0.bin"]
    assert keeper.discard(None, "why") is None
