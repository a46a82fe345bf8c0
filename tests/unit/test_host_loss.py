"""A lost host's deployments (issue 36): ``on_host_loss: wait`` keeps them where they are
(requests answer host_offline until the host is back); ``move`` forgets the unit there, wakes
elsewhere, and the host's reconcile stops the old unit when it comes back: never two copies.

No SSH here: hosts are registry entries set online or offline by hand, as tests/unit/test_hosts.py
does; the rig test with real sshd is tests/integration/test_federation.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from capyctl.config import DaemonConfig, Paths
from capyctl.controller import Controller, DeploymentActor, DeploymentState
from capyctl.controller._hosts import OFFLINE, ONLINE, HostEntry
from capyctl.spec import DeploymentSpec, ManifestError, parse_manifest
from capyctl.store import Store
from capyctl.systemd import UnitState
from tests.controllers import custom_engine
from tests.unit.test_hosts import NoSystemd


class HostSystemd:
    """The systemd of host b as reconcile sees it: the units it lists, the ones it is told to stop."""

    def __init__(self, units: list[UnitState]) -> None:
        self.units = units
        self.stopped: list[str] = []

    async def list_units(self, pattern: str = "capyctl-*.service") -> list[UnitState]:
        return list(self.units)

    async def stop_unit(self, name: str, timeout: float = 30.0) -> None:
        self.stopped.append(name)


@pytest.fixture
async def controller(tmp_path: Path):
    store = Store(tmp_path / "state.db")
    store.put_engine(custom_engine())
    config = DaemonConfig(paths=Paths(state_dir=tmp_path / "state", runtime_dir=tmp_path / "run"))
    ctl = Controller(config, store, NoSystemd())
    ctl.hosts.entries["b"] = HostEntry("b", "ssh", state=ONLINE)
    yield ctl
    await ctl.close()
    store.close()


async def _serving_on_b(ctl: Controller, on_host_loss: str) -> DeploymentActor:
    spec = DeploymentSpec(name="m", engine="custom-x", model={"path": "/models/m.gguf"}, hosts=["b", "local"],
                          on_host_loss=on_host_loss)
    actor = await ctl.deploy(spec)
    actor.state, actor.host, actor.port, actor.key, actor.launch_id = \
        DeploymentState.READY, "b", 40123, "launch-key", "launch-on-b"
    return actor


async def _lose_b(ctl: Controller) -> None:
    ctl.hosts.entries["b"].state = OFFLINE
    await ctl._host_offline("b")  # what the host poller calls when b's SSH master is gone


def test_the_manifest_field_is_off_by_default_and_refused_for_a_group() -> None:
    base = "name: m\nengine: vllm\nmodel: {path: /models/m}\n"
    assert parse_manifest(base).on_host_loss == "wait"
    assert parse_manifest(base + "on_host_loss: move\n").on_host_loss == "move"
    with pytest.raises(ManifestError) as err:
        parse_manifest(base + "hosts: [a, b]\nnodes: 2\ntensor_parallel: 2\non_host_loss: move\n")
    assert ":7: on_host_loss: " in str(err.value) and "multi-node" in str(err.value)  # its line, its field
    with pytest.raises(ManifestError) as err:
        parse_manifest(base + "on_host_loss: elsewhere\n")
    assert "on_host_loss" in str(err.value)


async def test_a_deployment_that_waits_answers_host_offline_and_stays(controller: Controller) -> None:
    actor = await _serving_on_b(controller, "wait")
    await _lose_b(controller)
    assert not actor.has_pending_commands  # nothing queued for the loss
    # The actor's queue runs in order: once a loss of a host it is not on (which changes nothing)
    # is answered, whatever b's loss might have queued before it has run too.
    assert await actor.submit("host_lost", host="c") == DeploymentState.READY
    assert actor.state == DeploymentState.READY and actor.host == "b"
    error = controller.placement_error(actor)
    assert error is not None and error.code == "host_offline"


async def test_a_deployment_that_may_move_leaves_the_lost_host_and_wakes_elsewhere(
        controller: Controller, monkeypatch) -> None:
    woken: list[str] = []
    asked, hold = asyncio.Event(), asyncio.Event()

    async def wake(self, progress=None, for_requests=False):
        woken.append(self.state)
        asked.set()
        await hold.wait()  # the wake's own work is another test's: here, that it is asked for
        return self.state

    monkeypatch.setattr(DeploymentActor, "_do_wake", wake)
    actor = await _serving_on_b(controller, "move")
    controller.hosts.entries["b"].state = OFFLINE
    actor.host_lost("b")
    # Queued, not yet run: a request that comes now waits for the move, not a dead connection.
    assert actor.has_pending_commands and controller.placement_error(actor) is None
    admitted = asyncio.ensure_future(actor.requests.admit())
    await asyncio.wait_for(asked.wait(), 10)  # a hang guard: the wake is asked for, however slowly
    assert woken == [DeploymentState.PARKED] and not admitted.done()
    assert actor.launch_id is None and not actor.parked_in_place and "'b' was lost" in actor.reason
    # Recorded with no launch: if b returns first, its reconcile stops the old unit, adopts nothing.
    runtime = controller.store.get_runtime("m")
    assert runtime.state == DeploymentState.PARKED and runtime.launch_id is None
    assert controller.placement_error(actor) is None  # local is online: its next wake may go there
    hold.set()
    admitted.cancel()


async def test_a_move_leaves_a_deployment_placed_elsewhere_alone(controller: Controller) -> None:
    actor = await _serving_on_b(controller, "move")
    actor.host = "local"  # it already runs elsewhere
    assert await actor.submit("host_lost", host="b") == DeploymentState.READY
    assert actor.launch_id == "launch-on-b"


def _unit(deployment: str, launch: str) -> UnitState:
    return UnitState(name=f"capyctl-{deployment}.service", active_state="active", sub_state="running",
                     load_state="loaded", markers={"deployment": deployment, "launch": launch})


async def test_the_old_unit_of_a_deployment_that_moved_is_stopped_when_its_host_returns(
        controller: Controller) -> None:
    actor = await _serving_on_b(controller, "move")
    actor.host, actor.launch_id = "local", "launch-on-local"  # it moved while b was lost
    stranger = UnitState(name="capyctl-admin.service", active_state="active", sub_state="running",
                         load_state="loaded")  # an admin's own unit: no markers, none of ours
    b = HostSystemd([_unit("m", "launch-on-b"), stranger])
    controller.hosts.entries["b"].systemd = b
    await controller.reconcile("b")
    assert b.stopped == ["capyctl-m.service"]
    assert actor.state == DeploymentState.READY and actor.host == "local"


async def test_a_moved_deployment_still_parked_is_not_adopted_back_from_its_old_unit(
        controller: Controller, monkeypatch) -> None:
    monkeypatch.setattr(DeploymentActor, "_do_wake", lambda self, **_: asyncio.sleep(0, self.state))
    actor = await _serving_on_b(controller, "move")
    controller.hosts.entries["b"].state = OFFLINE
    actor.host_lost("b")
    await actor.submit("host_lost", host="b")  # the queue has run the first one by now
    assert actor.state == DeploymentState.PARKED and actor.host == "b"
    b = HostSystemd([_unit("m", "launch-on-b")])
    controller.hosts.entries["b"].state, controller.hosts.entries["b"].systemd = ONLINE, b
    await controller.reconcile("b")
    assert b.stopped == ["capyctl-m.service"] and actor.state == DeploymentState.PARKED


async def test_a_group_never_moves(controller: Controller) -> None:
    spec = DeploymentSpec(name="g", engine="custom-x", model={"path": "/models/m"}, hosts=["b", "local"], nodes=2,
                          tensor_parallel=2)
    actor = await controller.deploy(spec)
    actor.state, actor.host = DeploymentState.READY, "b"
    actor.host_lost("b")
    assert not actor.has_pending_commands


class Master:
    """Host b's SSH master as confirm_lost sees it: ending (its host lost) or running."""

    def __init__(self, ending: bool) -> None:
        self.ending = ending
        self.asked = 0

    async def alive(self) -> bool:
        return not self.ending

    async def ends_within(self, seconds: float) -> bool:
        self.asked += 1
        return self.ending

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("on_host_loss,ending,moved", [("move", True, True), ("move", False, False),
                                                       ("wait", True, False)])
async def test_a_broken_engine_connection_confirms_a_loss_without_the_poller(
        controller: Controller, monkeypatch, on_host_loss: str, ending: bool, moved: bool) -> None:
    # The proxy asks (Router.engine_lost) when a request's engine connection broke before its answer:
    # it sends the request again only to a deployment moving off a host whose master has ended.
    hold = asyncio.Event()

    async def wake(self, progress=None, for_requests=False):
        await hold.wait()
        return self.state

    monkeypatch.setattr(DeploymentActor, "_do_wake", wake)
    actor = await _serving_on_b(controller, on_host_loss)
    master = controller.hosts.entries["b"].ssh = Master(ending)
    assert await controller.engine_lost(actor.upstream()) is moved
    assert controller.hosts.entries["b"].online is not moved
    assert master.asked == (1 if on_host_loss == "move" else 0)
    if moved:  # offline, and the move queued, before the proxy asks for the deployment again
        assert actor.has_pending_commands and controller.placement_error(actor) is None
        assert await controller.engine_lost(actor.upstream())  # a second request: known already
    hold.set()


async def test_nothing_is_placed_on_a_host_while_its_units_are_reconciled(controller: Controller,
                                                                         monkeypatch) -> None:
    # A wake placed on b while b's reconcile runs would start a unit of the very name the reconcile
    # may be stopping there (the old copy of a deployment that moved): b is a candidate only once
    # its reconcile is over; its bus is usable throughout.
    spec = DeploymentSpec(name="m", engine="custom-x", model={"path": "/models/m.gguf"}, hosts=["b", "local"],
                          on_host_loss="move")
    actor = await controller.deploy(spec)
    seen = []

    class Reconciled(HostSystemd):
        async def list_units(self, pattern: str = "capyctl-*.service") -> list[UnitState]:
            seen.append((entry.state, controller.cordons.allowed_hosts(actor)))
            return []

    async def reconnected(entry: HostEntry, remembered=None) -> None:
        entry.systemd = Reconciled([])

    entry = controller.hosts.entries["b"]
    entry.state, entry.ssh, entry.next_attempt = OFFLINE, Master(ending=False), 0.0
    monkeypatch.setattr(controller.hosts, "_connect", reconnected)
    await controller.hosts._poll(entry)  # the poller's reconnect
    assert seen == [("reconciling", ("local",))]
    assert entry.online and controller.cordons.allowed_hosts(actor) == ("b", "local")


def test_a_host_s_state_moves_only_along_its_table() -> None:
    from capyctl.controller._hosts import RECONCILING, HostRegistry
    entry = HostEntry("b", "ssh", state=ONLINE)
    with pytest.raises(AssertionError, match="online -> reconciling"):
        HostRegistry._enter(entry, RECONCILING)  # an online host is lost first, then reconnected
    HostRegistry._enter(entry, OFFLINE, "the SSH connection was lost")
    HostRegistry._enter(entry, RECONCILING)
    assert (entry.state, entry.reason, entry.connected, entry.online) == ("reconciling", None, True, False)
