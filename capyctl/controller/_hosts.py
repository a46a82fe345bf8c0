"""The hosts a controller drives: "local" (the daemon's own systemd) and one entry per SSH host.

An SSH host is reached through one ``SshHost`` ControlMaster: its systemd over a forwarded
unix socket to its D-Bus system bus, its engines over forwarded loopback ports, and
``capyctl host-info --json`` run there for its memory and GPUs. A restart begins with the
inventory last read (the store keeps it) and reads it again once the host's units are adopted, so
adopting waits only for the handshake and the bus. A background task polls
every SSH host's master (``alive()``, no network round trip) every ``POLL_INTERVAL_S``; a
dead master marks the host offline (its deployments answer 503 ``host_offline``) and the
task reconnects with a backoff. ``reconnect()`` re-creates every forward at the same local
socket path and port, so the controller only reconnects D-Bus and reconciles the host's units.

Remote hosts are assumed to have the same engine and model paths as the controller's host
(the same install, or a shared filesystem): ``engine add`` records a local path and the
unit on the remote host runs that path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ..config import deployment_from_unit
from ..errors import CapyError, Conflict, NotFound, Unavailable
from ..hosts.ssh import SshHost
from ..scheduler import GpuCard, HostResources
from ..store import Host, Store

if TYPE_CHECKING:
    from ..systemd import SystemdClient

log = logging.getLogger("capyctl.hosts")

LOCAL = "local"


class HostState(StrEnum):
    """An SSH host's connection, as `capyctl list hosts` shows it. One writer: HostRegistry._enter.

        OFFLINE ──connect at start, host add──> ONLINE ──master gone──> OFFLINE
        OFFLINE ──reconnect──> RECONCILING ──units adopted or stopped──> ONLINE
                                           ──reconcile broke──> OFFLINE
    """

    ONLINE = "online"
    # Connected again after a loss, its units being adopted or stopped: its bus and forwards are
    # used, but nothing is placed there until it is ONLINE, so that no new launch meets a unit the
    # reconcile stops.
    RECONCILING = "reconciling"
    OFFLINE = "offline"


ONLINE, RECONCILING, OFFLINE = HostState.ONLINE, HostState.RECONCILING, HostState.OFFLINE
HOST_TRANSITIONS: dict[HostState, frozenset[HostState]] = {
    OFFLINE: frozenset({ONLINE, RECONCILING, OFFLINE}),  # (offline again: a new reason)
    RECONCILING: frozenset({ONLINE, OFFLINE}),
    ONLINE: frozenset({OFFLINE}),
}
POLL_INTERVAL_S = 2.0
RECONNECT_BACKOFF_MAX_S = 10.0
START_CONNECTIONS = 16  # SSH sessions opened at once when the daemon starts (connections, then inventories)
# How long a broken engine connection waits to see its host's SSH master end (confirm_lost): the
# master closes its forwards as it dies, a moment before it exits.
LOSS_CONFIRM_S = 1.0
# Ports CapyCTL leases for engines on remote hosts (their loopback; never reachable from outside).
REMOTE_PORT_RANGE = (20000, 60999)


def local_capyctl() -> str:
    """This capyctl's path; a remote host without capyctl on its PATH is tried at the same path."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if os.path.isabs(argv0) and os.path.basename(argv0) == "capyctl":
        return argv0
    return shutil.which("capyctl") or "capyctl"


@dataclass
class HostEntry:
    """One host the controller can run deployments on."""

    name: str
    kind: str  # local | ssh
    systemd: "SystemdClient | None" = None
    ssh: SshHost | None = None
    record: Host | None = None
    state: HostState = OFFLINE  # written by HostRegistry._enter alone
    reason: str | None = None
    info: dict | None = None  # the host's `capyctl host-info --json`
    info_read_at: float | None = None
    info_remembered: bool = False  # info is the last daemon's, to be read again (refresh_remembered)
    bus_socket: str | None = None
    since: float = field(default_factory=time.time)
    next_attempt: float = 0.0
    backoff: float = 1.0

    @property
    def online(self) -> bool:
        """Usable, new placements included."""
        return self.state == ONLINE

    @property
    def connected(self) -> bool:
        """Its bus and forwards may be used (online, or being reconciled)."""
        return self.state in (ONLINE, RECONCILING)

    @property
    def remote(self) -> bool:
        return self.kind == "ssh"

    def resources(self, ram_reserve: int) -> HostResources:
        info = self.info or {}
        gpus = tuple(GpuCard(int(g["index"]), str(g["name"]), int(g["memory_total"])) for g in info.get("gpus") or [])
        # A host-info without "cores" (capyctl missing there, or older) leaves its cores unplanned.
        cores = tuple(tuple(int(cpu) for cpu in core) for core in info.get("cores") or [])
        return HostResources(self.name, int(info.get("ram_total") or 0), ram_reserve, gpus, cores)


def parse_target(target: str) -> tuple[str | None, str]:
    """``[user@]address`` -> (user, address)."""
    user, sep, address = target.rpartition("@")
    return (user or None) if sep else None, address


async def attribute_gpu_processes(systemd: Any, gpus: list[dict]) -> None:
    """Name the unit and deployment of each GPU process (host-info's ``gpus``) whose cgroup /proc
    did not show (the packaged daemon runs with ProtectProc=invisible; a process may live in another
    pid namespace): the system manager knows every process's unit (GetUnitByPID)."""
    if systemd is None:
        return
    for gpu in gpus:
        for proc in gpu.get("processes") or []:
            if proc.get("unit") is not None:
                continue
            with contextlib.suppress(CapyError):
                unit = await systemd.unit_of_pid(int(proc["pid"]))
                deployment = deployment_from_unit(unit) if unit else None
                if deployment is not None:
                    proc["unit"], proc["deployment"] = unit, deployment


async def _several_at_once(work: Callable[[HostEntry], Awaitable[None]], entries: list[HostEntry]) -> None:
    """``work`` for every entry, at most START_CONNECTIONS at once: a big fleet does not open
    all its SSH sessions together."""
    slots = asyncio.Semaphore(START_CONNECTIONS)

    async def one(entry: HostEntry) -> None:
        async with slots:
            await work(entry)

    await asyncio.gather(*(one(entry) for entry in entries))


class HostRegistry:
    """Every host by name. ``on_offline``/``on_online`` are the controller's callbacks."""

    def __init__(self, store: Store, runtime_dir: Path, local_systemd: Any, *, ram_reserve: int,
                 on_offline: Callable[[str], Awaitable[None]], on_online: Callable[[str], Awaitable[None]],
                 on_resources: Callable[[str, HostResources], None]) -> None:
        self.store = store
        self.runtime_dir = Path(runtime_dir)
        self.ram_reserve = ram_reserve
        self._on_offline = on_offline
        self._on_online = on_online
        self._on_resources = on_resources
        self.entries: dict[str, HostEntry] = {LOCAL: HostEntry(LOCAL, "local", systemd=local_systemd, state=ONLINE)}
        self._poll_task: asyncio.Task | None = None
        self._refresh_task: asyncio.Task | None = None
        self._locks: dict[str, asyncio.Lock] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect every recorded SSH host, several at once; a host connected is online (the
        controller reconciles it next), an unreachable one starts offline and is retried."""
        entries = []
        for record in self.store.list_hosts():
            if record.kind != "ssh" or record.name == LOCAL:
                continue
            entry = self.entries[record.name] = HostEntry(record.name, "ssh", ssh=self._ssh_for(record),
                                                          record=record)
            entries.append(entry)

        async def connect(entry: HostEntry) -> None:
            try:
                await self._connect(entry, remembered=self.store.host_inventory(entry.name))
            except CapyError as exc:
                self._mark_offline(entry, exc.message)
                return
            self._remember(entry)
            self._enter(entry, ONLINE)

        # (One host after another, a restart waited for every handshake, bus and inventory in turn.)
        await _several_at_once(connect, entries)
        self._poll_task = asyncio.create_task(self._poll_loop(), name="host-poller")

    def refresh_remembered(self) -> asyncio.Task | None:
        """Read again, in the background, each online host's inventory that ``start`` took from the
        store (its GPUs or RAM may have changed while no daemon watched). The task reading them,
        done when every one is read or left (``close`` cancels it); None when none was stale."""
        stale = [e for e in self.entries.values() if e.remote and e.online and e.info_remembered]
        if not stale:
            return None
        self._refresh_task = asyncio.create_task(self._refresh(stale), name="host-inventories")
        return self._refresh_task

    async def _refresh(self, entries: list[HostEntry]) -> None:
        async def refresh(entry: HostEntry) -> None:
            async with self._lock(entry.name):
                if not entry.online or not entry.info_remembered or entry.ssh is None:
                    return  # gone offline: its reconnect reads the inventory afresh
                try:
                    info = await self.remote_host_info(entry.ssh)
                except CapyError as exc:
                    log.info("host %s: inventory not read again (%s); keeping the last one", entry.name, exc.code)
                    return
                self._set_info(entry, info, time.time())
                self._remember(entry)
                log.info("host %s: inventory read again", entry.name)

        await _several_at_once(refresh, entries)

    async def close(self) -> None:
        for task in (self._poll_task, self._refresh_task):
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for entry in list(self.entries.values()):
            if entry.remote:
                await self._disconnect(entry)

    def _ssh_for(self, record: Host) -> SshHost:
        return SshHost(name=record.name, target=record.address or record.name,
                       runtime_dir=self.runtime_dir / "hosts", port=record.port,
                       identity_file=record.identity, known_hosts=record.known_hosts)

    async def _connect(self, entry: HostEntry, remembered: tuple[dict, float] | None = None) -> None:
        """Open (or reopen) the master and the bus connection, and read the host's inventory unless
        ``remembered`` (the store's, at start) stands in for it until ``refresh_remembered``."""
        from ..systemd import SystemdClient
        assert entry.ssh is not None
        if entry.bus_socket is None:
            await entry.ssh.start()
            entry.bus_socket = await entry.ssh.forward_unix()
        else:
            await entry.ssh.reconnect()  # the bus socket and engine ports come back where they were
        if entry.systemd is not None:
            await self._close_bus(entry)
        entry.systemd = await SystemdClient.connect("unix:path=" + entry.bus_socket)
        if remembered is None:
            self._set_info(entry, await self.remote_host_info(entry.ssh), time.time())
        else:
            self._set_info(entry, *remembered)
            entry.info_remembered = True

    def _set_info(self, entry: HostEntry, info: dict, read_at: float) -> None:
        entry.info, entry.info_read_at, entry.info_remembered = info, read_at, False
        self._on_resources(entry.name, entry.resources(self.ram_reserve))

    def _remember(self, entry: HostEntry) -> None:
        """Keep a freshly read inventory for the next start (the host must be recorded)."""
        if entry.info is not None and not entry.info_remembered:
            self.store.put_host_inventory(entry.name, entry.info)

    async def _disconnect(self, entry: HostEntry) -> None:
        await self._close_bus(entry)
        if entry.ssh is not None:
            with contextlib.suppress(CapyError, OSError):
                await entry.ssh.close()
        entry.bus_socket = None

    @staticmethod
    async def _close_bus(entry: HostEntry) -> None:
        client, entry.systemd = entry.systemd, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 5)

    @staticmethod
    def _enter(entry: HostEntry, state: HostState, reason: str | None = None) -> None:
        if state not in HOST_TRANSITIONS[entry.state]:
            raise AssertionError(f"host {entry.name}: {entry.state} -> {state} is no transition of HostState")
        entry.state, entry.reason, entry.since = state, reason, time.time()

    def _mark_offline(self, entry: HostEntry, reason: str) -> None:
        if entry.state != OFFLINE or entry.reason is None:
            log.warning("host %s is offline: %s", entry.name, reason)
        self._enter(entry, OFFLINE, reason)
        entry.backoff = 1.0
        entry.next_attempt = time.monotonic() + entry.backoff

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            for entry in list(self.entries.values()):
                if not entry.remote or entry.name not in self.entries:
                    continue
                try:
                    await self._poll(entry)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("host %s: poll failed", entry.name)

    async def _poll(self, entry: HostEntry) -> None:
        assert entry.ssh is not None
        async with self._lock(entry.name):
            if entry.online:
                if not await entry.ssh.alive():
                    await self._lost(entry)
                return
            if time.monotonic() < entry.next_attempt:
                return
            try:
                await self._connect(entry)
            except CapyError as exc:
                entry.reason = exc.message
                entry.backoff = min(entry.backoff * 2, RECONNECT_BACKOFF_MAX_S)
                entry.next_attempt = time.monotonic() + entry.backoff
                log.info("host %s: reconnect failed (%s); next try in %.0fs", entry.name, exc.code, entry.backoff)
                return
            self._remember(entry)
            log.info("host %s is reachable again; reconciling its units", entry.name)
            self._enter(entry, RECONCILING)
            try:
                await self._on_online(entry.name)
            except CapyError as exc:
                log.warning("host %s: reconcile after reconnect failed: %s", entry.name, exc)
            except BaseException:
                # Connected, not reconciled: reconnected and reconciled at the next look.
                self._enter(entry, OFFLINE, "its reconcile after the reconnect broke off")
                raise
            self._enter(entry, ONLINE)

    async def _lost(self, entry: HostEntry) -> None:
        """The master of an online host is gone (the host's lock held)."""
        self._mark_offline(entry, "the SSH connection was lost")
        # Before the bus closes (which may take seconds): deployments that move must have their
        # move queued before a request could find them ready on a dead connection.
        await self._on_offline(entry.name)
        await self._close_bus(entry)

    async def confirm_lost(self, name: str) -> bool:
        """A connection to an engine on ``name`` broke: whether the host's SSH master is gone (now,
        or within LOSS_CONFIRM_S), and if so the host is offline and its moves queued by the time
        this returns, without waiting for the poller's next look."""
        entry = self.entries.get(name)
        if entry is None or entry.ssh is None:
            return False
        if entry.online and not await entry.ssh.ends_within(LOSS_CONFIRM_S):
            return False  # the master runs: the engine itself broke the connection
        async with self._lock(name):
            if entry.online and not await entry.ssh.alive():
                await self._lost(entry)
        return not entry.online

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    # -- lookups -------------------------------------------------------------------------------

    def get(self, name: str) -> HostEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise NotFound(f"no host named {name!r}; add it with 'capyctl host add {name} --ssh ADDRESS'",
                           code="host_not_found")
        return entry

    def offline_error(self, name: str, deployment: str | None = None) -> Unavailable:
        entry = self.get(name)
        who = f"deployment {deployment!r} runs on host {name!r}, which" if deployment else f"host {name!r}"
        return Unavailable(f"{who} is offline: {entry.reason or 'unreachable'}", code="host_offline",
                           retry_after=5, detail={"host": name})

    def require_connected(self, name: str, deployment: str | None = None) -> HostEntry:
        """The host's entry, if its bus and forwards may be used (online, or being reconciled)."""
        entry = self.get(name)
        if not entry.connected:
            raise self.offline_error(name, deployment)
        return entry

    def systemd(self, name: str) -> Any:
        entry = self.require_connected(name)
        if entry.systemd is None:
            raise self.offline_error(name)
        return entry.systemd

    def online_names(self) -> list[str]:
        return [n for n, e in self.entries.items() if e.online]

    # -- operations on a host ------------------------------------------------------------------

    async def run(self, name: str, argv: list[str], *, input: bytes | None = None,
                  timeout: float = 60.0) -> tuple[int, bytes, bytes]:
        """Run argv on the host (locally for "local")."""
        entry = self.require_connected(name)
        if entry.ssh is None:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(input), timeout)
            return proc.returncode or 0, out, err
        return await entry.ssh.run(argv, input=input, timeout=timeout)

    async def write_private_file(self, name: str, path: Path, content: bytes) -> None:
        """A 0600 file in a 0700 directory on a remote host, written through SSH (never on argv)."""
        rc, _, err = await self.run(
            name, ["sh", "-c", 'umask 077 && mkdir -p "$1" && install -m 600 /dev/stdin "$2"', "sh",
                   str(path.parent), str(path)], input=content)
        if rc != 0:
            raise CapyError(f"could not write {path} on host {name!r}: {err.decode(errors='replace').strip()}",
                            code="remote_write_failed", status=502)

    async def read_file(self, name: str, path: Path) -> str | None:
        rc, out, _ = await self.run(name, ["cat", str(path)])
        return out.decode(errors="replace") if rc == 0 else None

    async def free_port(self, name: str, taken: set[int]) -> int:
        """A port nothing listens on (TCP, IPv4 or IPv6) on the host's loopback."""
        rc, out, _ = await self.run(name, ["cat", "/proc/net/tcp", "/proc/net/tcp6"])
        listening = set()
        for line in out.decode(errors="replace").splitlines()[1:]:
            parts = line.split()
            if len(parts) > 3 and parts[3] == "0A" and ":" in parts[1]:
                with contextlib.suppress(ValueError):
                    listening.add(int(parts[1].rsplit(":", 1)[1], 16))
        for _ in range(200):
            port = random.randint(*REMOTE_PORT_RANGE)
            if port not in listening and port not in taken:
                return port
        raise CapyError(f"no free loopback port on host {name!r}", code="no_port")

    async def forward_port(self, name: str, remote_port: int) -> int:
        entry = self.require_connected(name)
        assert entry.ssh is not None
        return await entry.ssh.forward_tcp(remote_port)

    async def forward_socket(self, name: str, remote_path: str) -> str:
        """A local unix socket (0600: ssh's StreamLocalBindMask) relayed to ``remote_path`` on host ``name``."""
        entry = self.require_connected(name)
        assert entry.ssh is not None
        return await entry.ssh.forward_unix(remote_path)

    async def cancel_forward(self, name: str, local_port: int | str) -> None:
        entry = self.entries.get(name)
        if entry is None or entry.ssh is None:
            return
        with contextlib.suppress(CapyError):
            await entry.ssh.cancel_forward(local_port)

    def has_forward(self, name: str, local_port: int | str | None) -> bool:
        entry = self.entries.get(name)
        if entry is None or entry.ssh is None or local_port is None:
            return False
        return any(f["local"] == str(local_port) for f in entry.ssh.forwards())

    async def journal(self, name: str, unit: str, lines: int) -> list[str]:
        rc, out, err = await self.run(name, ["journalctl", "--no-pager", "--output=cat", f"--unit={unit}",
                                             f"--lines={lines}"], timeout=30)
        if rc != 0:
            raise CapyError(f"journalctl on host {name!r} failed: {err.decode(errors='replace').strip()}",
                            code="journal_unavailable", status=502)
        return out.decode(errors="replace").splitlines()

    def ssh_prefix(self, name: str) -> list[str]:
        """argv prefix running a command on the host through its master (journalctl --follow)."""
        entry = self.require_connected(name)
        assert entry.ssh is not None
        ssh = entry.ssh
        return [ssh.ssh_binary, *ssh._base_options(), "-o", "ControlMaster=no", "-T", ssh.target, "--"]

    @staticmethod
    async def remote_host_info(ssh: SshHost) -> dict:
        """The host's ``capyctl host-info --json``; without capyctl there, its RAM and CPUs from /proc."""
        script = ('for c in capyctl "$1"; do command -v "$c" >/dev/null 2>&1 && exec "$c" host-info --json; done; '
                  'exit 127')
        rc, out, _ = await ssh.run(["sh", "-c", script, "sh", local_capyctl()], timeout=60)
        if rc == 0:
            with contextlib.suppress(ValueError):
                return json.loads(out)
        rc, out, _ = await ssh.run(["sh", "-c", "hostname; nproc; cat /proc/meminfo"], timeout=30)
        lines = out.decode(errors="replace").splitlines()
        mem = {}
        for line in lines[2:]:
            match = re.match(r"(\w+):\s+(\d+) kB", line)
            if match:
                mem[match.group(1)] = int(match.group(2)) * 1024
        return {"hostname": lines[0] if lines else ssh.name, "gpus": [], "ram_total": mem.get("MemTotal", 0),
                "ram_available": mem.get("MemAvailable", 0),
                "cpu_count": int(lines[1]) if len(lines) > 1 and lines[1].isdigit() else 0,
                "nvml_error": "capyctl is not installed on the host; GPUs unknown"}

    # -- management ----------------------------------------------------------------------------

    async def add(self, name: str, target: str, *, port: int | None = None, identity: str | None = None,
                  known_hosts: str | None = None, unified_memory: bool | None = None) -> HostEntry:
        """Connect, verify and record an SSH host. The host key must already be known."""
        if name in self.entries:
            raise Conflict(f"a host named {name!r} exists already", code="host_exists")
        for label, path in (("identity file", identity), ("known_hosts file", known_hosts)):
            if path is not None and not os.path.isabs(path):
                raise CapyError(f"the {label} must be an absolute path, not {path!r}", code="invalid_path", status=400)
        record = Host(name, "ssh", target, port, identity, time.time(), known_hosts)
        entry = HostEntry(name, "ssh", ssh=self._ssh_for(record), record=record)
        async with self._lock(name):
            try:
                await self._connect(entry)
            except BaseException:
                await self._disconnect(entry)
                raise
            if unified_memory is None:
                # Whether a park that keeps weights in host RAM frees anything there (engines/_tiers.py).
                from ..hosts import unified_memory_default
                names = [str(g.get("name") or "") for g in (entry.info or {}).get("gpus") or []]
                unified_memory = unified_memory_default(names)
                if unified_memory is None:
                    await self._disconnect(entry)
                    raise CapyError(f"host {name!r} has {', '.join(sorted(set(names)))}: whether its GPU and host memory "
                                    "are one pool is not known from the GPU alone; say it with --unified-memory yes|no",
                                    code="unified_memory_unknown", status=400)
            entry.record = self.store.put_host(name, "ssh", address=target, port=port, identity=identity,
                                               known_hosts=known_hosts, unified_memory=unified_memory)
            self._remember(entry)
            self._enter(entry, ONLINE)
            self.entries[name] = entry
        return entry

    async def remove(self, name: str) -> None:
        if name == LOCAL:
            raise CapyError("the local host cannot be removed", code="host_is_local", status=400)
        entry = self.get(name)
        async with self._lock(name):
            self.store.remove_host(name)
            self.entries.pop(name, None)
            await self._disconnect(entry)

    async def check(self, name: str) -> dict:
        entry = self.get(name)
        if entry.ssh is None:
            started = time.monotonic()
            version = await asyncio.to_thread(subprocess.run, ["systemctl", "--version"], capture_output=True,
                                              text=True)
            match = re.match(r"systemd (\d+)", version.stdout)
            return {"host": name, "target": None, "reachable": True,
                    "latency_ms": round((time.monotonic() - started) * 1000, 1),
                    "systemd_version": int(match.group(1)) if match else None,
                    "host_info": await self.local_inventory()}
        report = await entry.ssh.check([local_capyctl()])
        if report.get("host_info") is None and report.get("reachable"):
            with contextlib.suppress(CapyError):
                report["host_info"] = await self.remote_host_info(entry.ssh)
        return report

    def describe(self, name: str) -> dict:
        entry = self.get(name)
        info = entry.info or {}
        row: dict[str, Any] = {"name": name, "kind": entry.kind, "state": entry.state, "reason": entry.reason,
                               "since": entry.since, "target": entry.record.address if entry.record else None,
                               "hostname": info.get("hostname"), "inventory_read_at": entry.info_read_at,
                               "unified_memory": entry.record.unified_memory if entry.record else None}
        gpus = info.get("gpus") or []
        row["gpus"] = len(gpus)
        if gpus:
            row["memory_total"] = sum(int(g["memory_total"]) for g in gpus)
            row["memory_free"] = sum(int(g["memory_free"]) for g in gpus)
        else:
            row["memory_total"] = info.get("ram_total")
            row["memory_free"] = info.get("ram_available")
        return row

    def set_local_info(self, info: dict) -> None:
        self.entries[LOCAL].info = info

    async def local_inventory(self) -> dict:
        """This host's ``host-info`` (NVML, RAM, CPUs), its GPU processes attributed to units."""
        from ..hosts import host_inventory
        info = (await asyncio.to_thread(host_inventory)).to_dict()
        entry = self.entries.get(LOCAL)
        await attribute_gpu_processes(entry.systemd if entry is not None else None, info.get("gpus") or [])
        return info
