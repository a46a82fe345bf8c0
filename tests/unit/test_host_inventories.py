"""The host registry's start and its inventories, without SSH: ``_several_at_once`` (a fleet's
hosts handled together, at most START_CONNECTIONS at once), ``start`` (recorded hosts connected
together, each beginning with the inventory the store kept) and ``refresh_remembered`` (those
inventories read again in the background: a fresh one replaces and is kept, a host that cannot be
read keeps its last one, a host gone offline is left to its reconnect).

Order is shown by events, never by wall-clock bounds. The rig test with real sshd is
tests/integration/test_many_hosts.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from capyctl.controller import _hosts
from capyctl.controller._hosts import LOCAL, OFFLINE, ONLINE, HostEntry, HostRegistry
from capyctl.errors import CapyError
from capyctl.scheduler import HostResources
from capyctl.store import Store
from capyctl.systemd import SystemdClient
from tests.unit.test_hosts import NoSystemd

GIB = 1 << 30


def _info(hostname: str, ram_gib: int) -> dict:
    return {"hostname": hostname, "gpus": [], "ram_total": ram_gib * GIB, "ram_available": ram_gib * GIB // 2,
            "cpu_count": 8, "nvml_error": None}


async def _until(condition, what: str) -> None:
    """Yield to the loop until ``condition()`` holds (a bound on turns, not on time)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


class FakeSsh:
    """A host's SshHost as the registry uses it: the handshake waits for ``gate``, and a look at
    the master (``alive``) for ``looking``; ``reachable`` False is a host whose master is gone."""

    def __init__(self, name: str, *, reachable: bool = True) -> None:
        self.name = name
        self.reachable = reachable
        self.gate = asyncio.Event()
        self.gate.set()
        self.in_handshake = False
        self.looking = asyncio.Event()
        self.looking.set()
        self.in_look = False
        self.closed = False

    async def start(self) -> None:
        self.in_handshake = True
        try:
            await self.gate.wait()
        finally:
            self.in_handshake = False
        if not self.reachable:
            raise CapyError(f"ssh to {self.name}: Connection refused", code="ssh_failed", status=502)

    async def forward_unix(self, remote_path: str = "/run/dbus/system_bus_socket") -> str:
        return f"/run/test/{self.name}.bus"

    async def alive(self) -> bool:
        self.in_look = True
        try:
            await self.looking.wait()
        finally:
            self.in_look = False
        return self.reachable

    async def ends_within(self, seconds: float) -> bool:
        return not self.reachable

    async def close(self) -> None:
        self.closed = True


class FakeBus:
    async def close(self) -> None:
        pass


class Registry:
    """A HostRegistry over a real store, its SSH and D-Bus stood in for, and what it tells the
    controller (``on_resources``, ``on_offline``) and reads over SSH (``remote_host_info``) recorded."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.store = Store(tmp_path / "state.db")
        self.resources: list[HostResources] = []
        self.ssh: dict[str, FakeSsh] = {}
        self.asked: list[str] = []  # remote_host_info's calls, by host
        self.answers: dict[str, dict | CapyError] = {}
        self.holds: dict[str, asyncio.Event] = {}  # a read of the host's inventory waits for its event
        self.reading: set[str] = set()
        self.offline: list[str] = []  # on_offline's calls, by host

        async def went_offline(name: str) -> None:
            self.offline.append(name)

        async def no_reconnect(name: str) -> None:
            raise AssertionError("no host comes back online in these tests")

        self.registry = HostRegistry(self.store, tmp_path / "run", NoSystemd(), ram_reserve=GIB,
                                     on_offline=went_offline, on_online=no_reconnect,
                                     on_resources=lambda name, res: self.resources.append(res))
        monkeypatch.setattr(self.registry, "_ssh_for", lambda record: self.ssh.setdefault(record.name,
                                                                                          FakeSsh(record.name)))
        monkeypatch.setattr(self.registry, "remote_host_info", self._remote_host_info)

        async def connect(address: str | None = None, **_) -> FakeBus:
            return FakeBus()

        monkeypatch.setattr(SystemdClient, "connect", connect)
        monkeypatch.setattr(_hosts, "POLL_INTERVAL_S", 3600.0)  # the poller never looks during a test

    async def _remote_host_info(self, ssh: FakeSsh) -> dict:
        self.asked.append(ssh.name)
        self.reading.add(ssh.name)
        try:
            if ssh.name in self.holds:
                await self.holds[ssh.name].wait()
        finally:
            self.reading.discard(ssh.name)
        answer = self.answers[ssh.name]
        if isinstance(answer, CapyError):
            raise answer
        return answer

    def record(self, name: str, remembered: dict | None = None, *, reachable: bool = True) -> FakeSsh:
        self.store.put_host(name, "ssh", address=f"root@{name}")
        if remembered is not None:
            self.store.put_host_inventory(name, remembered)
        ssh = self.ssh[name] = FakeSsh(name, reachable=reachable)
        return ssh

    def entry(self, name: str) -> HostEntry:
        return self.registry.entries[name]


@pytest.fixture
async def hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    rig = Registry(tmp_path, monkeypatch)
    yield rig
    await rig.registry.close()
    rig.store.close()


# -- _several_at_once --------------------------------------------------------------------------------


async def test_several_at_once_runs_start_connections_together_and_never_more() -> None:
    limit = _hosts.START_CONNECTIONS
    assert limit > 1  # one at a time was the slow start this replaced
    entries = [HostEntry(f"h{i}", "ssh") for i in range(limit + 3)]
    release = {e.name: asyncio.Event() for e in entries}
    running: set[str] = set()
    done: list[str] = []
    most = 0

    async def work(entry: HostEntry) -> None:
        nonlocal most
        running.add(entry.name)
        most = max(most, len(running))
        await release[entry.name].wait()
        running.discard(entry.name)
        done.append(entry.name)

    task = asyncio.create_task(_hosts._several_at_once(work, entries))
    await _until(lambda: len(running) == limit, f"{limit} at work together")
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(running) == limit and not task.done()  # the others wait for a slot
    # A slot given back lets exactly one more in; a slow host holds back nobody but itself.
    first = sorted(running)[0]
    release[first].set()
    await _until(lambda: done == [first], "the first one done")
    await _until(lambda: len(running) == limit, "one more let in")
    assert first not in running
    for event in release.values():
        event.set()
    await task
    assert sorted(done) == sorted(e.name for e in entries) and most == limit  # each once, never more at once


async def test_several_at_once_with_no_entries_does_nothing() -> None:
    async def work(entry: HostEntry) -> None:
        raise AssertionError("no entry, no work")

    await _hosts._several_at_once(work, [])


# -- start ------------------------------------------------------------------------------------------


async def test_start_connects_the_hosts_together_from_their_remembered_inventories(hosts: Registry) -> None:
    a = hosts.record("a", _info("node-a", 64))
    b = hosts.record("b", _info("node-b", 32), reachable=False)
    c = hosts.record("c", _info("node-c", 16))
    for ssh in (a, b, c):
        ssh.gate.clear()
    start = asyncio.create_task(hosts.registry.start())
    # Every handshake is under way before any has finished: not one host after another.
    await _until(lambda: a.in_handshake and b.in_handshake and c.in_handshake, "three handshakes at once")
    for ssh in (a, b, c):
        ssh.gate.set()
    await start
    # What the store kept stands in until refresh_remembered: start read nothing over SSH.
    assert hosts.asked == []
    for name, ram in (("a", 64), ("c", 16)):
        entry = hosts.entry(name)
        assert entry.online and entry.info_remembered and entry.info["ram_total"] == ram * GIB
    assert sorted((r.name, r.ram_total) for r in hosts.resources) == [("a", 64 * GIB), ("c", 16 * GIB)]
    # The unreachable host starts offline, its reason shown, and is retried by the poller.
    assert hosts.entry("b").state == OFFLINE and "Connection refused" in hosts.entry("b").reason
    assert hosts.entry(LOCAL).online


async def test_start_reads_the_inventory_of_a_host_the_store_has_none_for(hosts: Registry) -> None:
    hosts.record("a")
    hosts.answers["a"] = _info("node-a", 48)
    await hosts.registry.start()
    entry = hosts.entry("a")
    assert hosts.asked == ["a"] and entry.online and not entry.info_remembered
    assert hosts.store.host_inventory("a")[0] == _info("node-a", 48)  # kept for the next start
    assert hosts.registry.refresh_remembered() is None  # nothing stale: nothing to read again


# -- refresh_remembered ------------------------------------------------------------------------------


async def test_refresh_reads_remembered_inventories_again_in_the_background(hosts: Registry) -> None:
    for name in ("a", "b"):
        hosts.record(name, _info(f"old-{name}", 64))
    await hosts.registry.start()
    hosts.resources.clear()
    hosts.answers = {"a": _info("new-a", 128), "b": _info("new-b", 96)}
    hosts.holds = {"a": asyncio.Event(), "b": asyncio.Event()}
    task = hosts.registry.refresh_remembered()
    assert task is not None and not task.done()  # returns at once; the reads go on
    await _until(lambda: hosts.reading == {"a", "b"}, "both hosts read at once")
    assert hosts.entry("a").info == _info("old-a", 64) and hosts.entry("a").info_remembered
    hosts.holds["a"].set()
    hosts.holds["b"].set()
    await task
    for name, ram in (("a", 128), ("b", 96)):
        entry = hosts.entry(name)
        assert entry.info == _info(f"new-{name}", ram) and not entry.info_remembered
        assert entry.info_read_at is not None and entry.online
        assert hosts.store.host_inventory(name)[0] == _info(f"new-{name}", ram)  # the next start's
    # The scheduler is told each host's new memory.
    assert sorted((r.name, r.ram_total, r.ram_reserve) for r in hosts.resources) == [
        ("a", 128 * GIB, GIB), ("b", 96 * GIB, GIB)]
    assert sorted(hosts.asked) == ["a", "b"]


async def test_a_host_whose_inventory_cannot_be_read_again_keeps_its_last_one(hosts: Registry) -> None:
    hosts.record("a", _info("old-a", 64))
    hosts.record("b", _info("old-b", 32))
    await hosts.registry.start()
    read_at = hosts.entry("b").info_read_at
    hosts.resources.clear()
    hosts.answers = {"a": _info("new-a", 128),
                     "b": CapyError("ssh to b: timed out", code="ssh_timeout", status=504)}
    await hosts.registry.refresh_remembered()  # the failure stays inside: the task ends well
    b = hosts.entry("b")
    assert b.online and b.info == _info("old-b", 32) and b.info_read_at == read_at
    assert b.info_remembered  # still the last daemon's
    assert hosts.store.host_inventory("b")[0] == _info("old-b", 32)
    # The other host's read is not held back by it.
    assert hosts.entry("a").info == _info("new-a", 128) and not hosts.entry("a").info_remembered
    assert [r.name for r in hosts.resources] == ["a"]


async def test_refresh_reads_only_online_hosts_that_still_have_a_remembered_inventory(hosts: Registry) -> None:
    for name in ("on", "off"):
        hosts.record(name, _info(name, 8))
    hosts.record("fresh")  # the store kept no inventory: start reads it
    hosts.answers = {"fresh": _info("fresh", 8), "on": _info("on", 16)}
    await hosts.registry.start()
    assert hosts.asked == ["fresh"]
    hosts.ssh["off"].reachable = False  # lost since: an engine connection there broke
    assert await hosts.registry.confirm_lost("off") and hosts.offline == ["off"]
    await hosts.registry.refresh_remembered()
    assert hosts.asked == ["fresh", "on"]  # not the offline host, not the fresh one again, not local
    off = hosts.entry("off")
    assert off.state == OFFLINE and off.info == _info("off", 8) and off.info_remembered


async def test_a_host_lost_before_its_refresh_is_left_to_its_reconnect(hosts: Registry) -> None:
    hosts.record("a", _info("old-a", 64))
    await hosts.registry.start()
    entry, ssh = hosts.entry("a"), hosts.ssh["a"]
    hosts.answers = {"a": _info("new-a", 128)}
    # An engine connection on a broke and its master is gone: confirm_lost holds the host while it
    # looks at the master (the poller would do the same), and the look is held here.
    ssh.reachable = False
    ssh.looking.clear()
    lost = asyncio.create_task(hosts.registry.confirm_lost("a"))
    await _until(lambda: ssh.in_look, "the master being looked at")
    task = hosts.registry.refresh_remembered()
    assert task is not None  # a was online with its remembered inventory when it was asked
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done() and hosts.asked == []  # the refresh waits for the host
    ssh.looking.set()
    assert await lost and hosts.offline == ["a"]
    await task
    assert entry.state == OFFLINE and hosts.asked == [] and entry.info == _info("old-a", 64)
    assert hosts.store.host_inventory("a")[0] == _info("old-a", 64)


async def test_close_stops_a_refresh_in_flight(hosts: Registry) -> None:
    hosts.record("a", _info("old-a", 64))
    await hosts.registry.start()
    hosts.answers = {"a": _info("new-a", 128)}
    hosts.holds = {"a": asyncio.Event()}  # never set: the host does not answer
    task = hosts.registry.refresh_remembered()
    await _until(lambda: hosts.reading == {"a"}, "the read under way")
    await hosts.registry.close()
    assert task.cancelled() and hosts.ssh["a"].closed
    assert hosts.entry("a").info == _info("old-a", 64)


async def test_an_inventory_read_afresh_while_a_refresh_waited_is_not_read_again(hosts: Registry) -> None:
    # A refresh waits for the host (its lock) behind whatever holds it: the poller's reconnect,
    # which reads the inventory afresh, or here a refresh asked before it. Once the host is its
    # own, it reads only what is still the last daemon's.
    hosts.record("a", _info("old-a", 64))
    await hosts.registry.start()
    entry = hosts.entry("a")
    hosts.answers = {"a": _info("new-a", 128)}
    hosts.holds = {"a": asyncio.Event()}
    first = hosts.registry.refresh_remembered()
    await _until(lambda: hosts.reading == {"a"}, "the first read under way, the host held")
    second = hosts.registry.refresh_remembered()
    assert second is not None  # asked while a's inventory was still the remembered one
    for _ in range(20):
        await asyncio.sleep(0)
    assert not second.done() and hosts.asked == ["a"]  # the second waits for the host
    hosts.holds["a"].set()
    await first
    read_at = entry.info_read_at
    await second
    assert hosts.asked == ["a"] and entry.info == _info("new-a", 128) and entry.info_read_at == read_at
    assert entry.state == ONLINE
