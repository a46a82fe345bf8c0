"""The controller's host registry without SSH: inventory to scheduler resources, placement rules,
offline errors, remote port choice, and the host commands' parsing."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from capyctl.cli import build_parser
from capyctl.config import DaemonConfig, Paths
from capyctl.controller import Controller
from capyctl.controller._hosts import LOCAL, OFFLINE, ONLINE, HostEntry, parse_target
from capyctl.errors import CapyError
from capyctl.hosts import HostInventory
from capyctl.spec import DeploymentSpec
from capyctl.store import Store
from tests.controllers import custom_engine


class NoSystemd:
    """Where the D-Bus client goes; these tests never reach systemd."""

    def __getattr__(self, name: str):
        raise AssertionError(f"systemd.{name} was used")


@pytest.fixture
async def controller(tmp_path: Path):
    store = Store(tmp_path / "state.db")
    store.put_engine(custom_engine())
    config = DaemonConfig(paths=Paths(state_dir=tmp_path / "state", runtime_dir=tmp_path / "run"))
    ctl = Controller(config, store, NoSystemd())
    yield ctl
    await ctl.close()
    store.close()


def _host_info(ram: int, gpus: list[dict] | None = None) -> dict:
    return {"hostname": "node7", "gpus": gpus or [], "ram_total": ram, "ram_available": ram // 2, "cpu_count": 8,
            "nvml_error": None}


def test_host_info_becomes_the_scheduler_view_under_the_registry_name() -> None:
    gpu = {"index": 1, "name": "NVIDIA H100", "memory_total": 80 << 30, "memory_free": 70 << 30}
    entry = HostEntry("b", "ssh", info=_host_info(64 << 30, [gpu]))
    res = entry.resources(ram_reserve=1 << 30)
    assert res.name == "b"  # not the machine's hostname: manifests name hosts by registry name
    assert res.ram_total == 64 << 30 and res.ram_reserve == 1 << 30
    assert [(c.index, c.model, c.memory_total) for c in res.gpus] == [(1, "NVIDIA H100", 80 << 30)]


def test_the_local_inventory_json_round_trips_into_resources() -> None:
    out = subprocess.run([sys.executable, "-m", "capyctl", "host-info", "--json"], capture_output=True, text=True,
                         check=True).stdout
    info = json.loads(out)
    assert set(info) >= set(HostInventory("x").to_dict())
    assert HostEntry("local", "local", info=info).resources(0).ram_total == info["ram_total"] > 0


def test_parse_target() -> None:
    assert parse_target("root@10.0.0.2") == ("root", "10.0.0.2")
    assert parse_target("gpu-box") == (None, "gpu-box")


async def test_offline_host_errors_name_the_host(controller: Controller) -> None:
    controller.hosts.entries["b"] = HostEntry("b", "ssh", state=OFFLINE, reason="the SSH connection was lost")
    with pytest.raises(CapyError) as err:
        controller.hosts.systemd("b")
    assert err.value.code == "host_offline" and err.value.status == 503
    assert "'b'" in err.value.message and "connection was lost" in err.value.message
    with pytest.raises(CapyError) as err:
        controller.hosts.get("nowhere")
    assert err.value.code == "host_not_found"


async def test_try_acquire_admits_at_once_only_what_acquire_would_admit_without_waiting(
        controller: Controller) -> None:
    # The proxy's common case (Router.try_acquire): a ready deployment with nothing queued and its
    # hosts usable is admitted at once; anything else answers None, marks nothing, and is left to
    # acquire(), which waits, wakes or refuses.
    from capyctl.controller import DeploymentState
    READY = DeploymentState.READY
    controller.hosts.entries["b"] = HostEntry("b", "ssh", state=ONLINE)
    spec = DeploymentSpec(name="m", engine="custom-x", model={"path": "/models/m.gguf"}, hosts=["b"],
                          aliases=["m-alias"])
    actor = await controller.deploy(spec)
    assert controller.try_acquire("m") is None and actor.in_flight == 0  # stopped: acquire() wakes it
    assert controller.try_acquire("nowhere") is None  # acquire() answers model_not_found
    actor.state, actor.port, actor.key = READY, 40123, "launch-key"
    lease = controller.try_acquire("m-alias")
    assert lease is not None and actor.in_flight == 1 and actor.busy
    upstream, release = lease
    assert (upstream.deployment, upstream.base_url, upstream.api_key) == ("m", "http://127.0.0.1:40123", "launch-key")
    release()
    assert actor.in_flight == 0 and not actor.busy
    actor._commands.put_nowait(object())  # a park queued: the deployment is about to change
    assert controller.try_acquire("m") is None and actor.in_flight == 0
    actor._commands.get_nowait()
    # Placement only refuses a deployment not running yet (a cordon, a pinned host offline): one
    # that serves is admitted by both ways alike.
    controller.hosts.entries["b"].state = OFFLINE
    assert controller.placement_error(actor) is None
    await actor.requests.admit()
    lease = controller.try_acquire("m")
    assert lease is not None and actor.in_flight == 2
    lease[1]()
    actor.requests.release()
    actor.state = "stopped"
    assert controller.try_acquire("m") is None and actor.in_flight == 0
    with pytest.raises(CapyError) as err:
        await actor.requests.admit()
    assert err.value.code == "host_offline"


async def test_a_request_reads_nothing_from_the_store_once_its_launch_is_known(
        controller: Controller, monkeypatch) -> None:
    # The proxy asks for the Upstream on every request; the engine's kind is a store read (a
    # SELECT and a validated EngineSpec). It is read once a launch and address, not per request.
    from capyctl.controller import DeploymentState
    READY = DeploymentState.READY
    from capyctl.spec import EngineSpec
    controller.store.put_engine(EngineSpec.model_validate(
        {"kind": "engine", "name": "llama", "type": "llama.cpp", "path": "/opt/llama-server"}))
    spec = DeploymentSpec(name="m", engine="llama", model={"path": "/models/m.gguf"})
    actor = await controller.deploy(spec)
    actor.state, actor.port, actor.key, actor.launch_id = READY, 40123, "launch-key", "l1"
    reads: list[str] = []
    get_engine = controller.store.get_engine
    monkeypatch.setattr(controller.store, "get_engine", lambda name: reads.append(name) or get_engine(name))
    for _ in range(3):
        upstream, release = controller.try_acquire("m")
        release()
        assert upstream.engine == "llama.cpp" and upstream.base_url == "http://127.0.0.1:40123"
    assert reads == ["llama"]
    # A new launch, on a new port with a new key: a new Upstream, read once more.
    actor.port, actor.key, actor.launch_id = 40999, "next-key", "l2"
    upstream, release = controller.try_acquire("m")
    release()
    assert (upstream.base_url, upstream.api_key) == ("http://127.0.0.1:40999", "next-key") and reads == ["llama"] * 2
    # The same launch learning what its engine serves: the Upstream says so at once.
    actor.capabilities = frozenset({"chat"})
    upstream, release = controller.try_acquire("m")
    release()
    assert upstream.capabilities == {"chat"}


async def test_pinned_deployment_on_an_offline_host_is_refused_at_admission(controller: Controller) -> None:
    controller.hosts.entries["b"] = HostEntry("b", "ssh", state=OFFLINE, reason="unreachable")
    spec = DeploymentSpec(name="m", engine="custom-x", model={"path": "/models/m.gguf"}, hosts=["b"])
    actor = await controller.deploy(spec)
    with pytest.raises(CapyError) as err:
        await actor.requests.admit()
    assert err.value.code == "host_offline" and "'m'" in err.value.message and "'b'" in err.value.message
    with pytest.raises(CapyError) as err:
        controller.cordons.allowed_hosts(actor)
    assert err.value.code == "host_offline"

    controller.hosts.entries["b"].state = ONLINE
    assert controller.placement_error(actor) is None
    assert controller.cordons.allowed_hosts(actor) == ("b",)

    # No hosts in the manifest: any online host; an unknown host in it is an error of its own.
    free = DeploymentSpec(name="f", engine="custom-x", model={"path": "/models/m.gguf"})
    actor_f = await controller.deploy(free)
    assert set(controller.cordons.allowed_hosts(actor_f)) == {LOCAL, "b"}
    controller.hosts.entries["b"].state = OFFLINE
    assert controller.cordons.allowed_hosts(actor_f) == (LOCAL,)
    typo = DeploymentSpec(name="t", engine="custom-x", model={"path": "/models/m.gguf"}, hosts=["bb"])
    actor_t = await controller.deploy(typo)
    with pytest.raises(CapyError) as err:
        controller.cordons.allowed_hosts(actor_t)
    assert err.value.code == "host_not_found"


async def test_remove_refused_while_a_manifest_names_the_host(controller: Controller) -> None:
    controller.hosts.entries["b"] = HostEntry("b", "ssh", state=ONLINE)
    spec = DeploymentSpec(name="m", engine="custom-x", model={"path": "/models/m.gguf"}, hosts=["b"])
    await controller.deploy(spec)
    with pytest.raises(CapyError) as err:
        await controller.cordons.remove_host("b")
    assert err.value.code == "host_in_use"
    with pytest.raises(CapyError) as err:
        await controller.cordons.remove_host(LOCAL)
    assert err.value.code == "host_is_local"


async def test_add_refuses_relative_key_paths_and_taken_names(controller: Controller) -> None:
    with pytest.raises(CapyError) as err:
        await controller.hosts.add("b", "root@10.0.0.2", identity="id_ed25519")
    assert err.value.code == "invalid_path"
    with pytest.raises(CapyError) as err:
        await controller.hosts.add(LOCAL, "root@10.0.0.2")
    assert err.value.code == "host_exists"
    assert controller.store.list_hosts() == []


async def test_free_port_skips_ports_that_listen_on_the_host(controller: Controller, monkeypatch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        picks = iter([busy, 31337, 31338])
        monkeypatch.setattr(random, "randint", lambda a, b: next(picks))
        # "local" runs the same /proc/net/tcp reading a remote host gets over SSH.
        port = await controller.hosts.free_port(LOCAL, taken={31337})
    assert port == 31338


def test_host_commands_parse() -> None:
    args = build_parser().parse_args(["host", "add", "b", "--ssh", "root@10.0.0.2", "--port", "2222",
                                      "--identity", "/k", "--known-hosts", "/kh"])
    assert (args.name, args.ssh, args.port, args.identity, args.known_hosts) == ("b", "root@10.0.0.2", 2222, "/k",
                                                                                 "/kh")
    for argv in (["host", "list", "--json"], ["host", "remove", "b"], ["host", "check", "b"],
                 ["list", "hosts"], ["host-info", "--json"]):
        assert build_parser().parse_args(argv).func
