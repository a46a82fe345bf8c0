"""The controller: owns every deployment's actor, implements the proxy's Router, reconciles
with systemd after a restart, makes room for a wake, and parks idle deployments."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import aiohttp

from ..config import DaemonConfig, deployment_from_unit
from ..errors import CapyError, Conflict, NotFound, Unavailable
from ..proxy.connector import EngineConnector
from ..proxy.router import ModelEntry, Upstream
from ..scheduler import NoRoom
from ..spec import DeploymentSpec, EngineSpec
from ..store import Store
from ._actor import (FAILED, PARKED, READY, RUNNING_STATES, Busy, DeploymentActor, Progress,
                     _no_progress)
from ._hosts import LOCAL, HostRegistry
from ._memory import MemoryPlanner, refresh_gpus, wait_released
from ._memory import measure as measure_memory

log = logging.getLogger("capyctl.controller")

IDLE_CHECK_INTERVAL_S = 1.0


class Controller:
    def __init__(self, config: DaemonConfig, store: Store, systemd: Any) -> None:
        self.config = config
        self.paths = config.paths
        self.store = store
        self.systemd = systemd
        self.actors: dict[str, DeploymentActor] = {}
        self.http: aiohttp.ClientSession | None = None
        self.memory = MemoryPlanner(config)
        self.hosts = HostRegistry(store, self.paths.runtime_dir, systemd, ram_reserve=config.host_ram_reserve,
                                  on_offline=self._host_offline, on_online=self._host_online,
                                  on_resources=self.memory.set_host)
        self._placement_lock = asyncio.Lock()
        self._ports: dict[str, tuple[str, int]] = {}  # deployment -> (host, engine port there)
        self._idle_task: asyncio.Task | None = None
        self._listeners: list[Callable[[DeploymentActor], None]] = []
        self._measuring: set[asyncio.Task] = set()

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load deployments from the store and adopt the units a previous daemon left running."""
        self.paths.secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.paths.secrets_dir, 0o700)
        # No pool limit: 200 concurrent streams must not queue inside the client.
        self.http = aiohttp.ClientSession(connector=EngineConnector(limit=0, resolve=self._engine_socket),
                                          timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        for dep in self.store.list_deployments():
            revision = self.store.current_revision(dep.name)
            if revision is not None:
                actor = self.actors[dep.name] = DeploymentActor(self, revision)
                runtime = self.store.get_runtime(dep.name)
                if runtime is not None:
                    actor.host = runtime.host
        await self.hosts.start()
        for host in self.hosts.online_names():
            await self.reconcile(host)
        self._idle_task = asyncio.create_task(self._park_idle_loop(), name="idle-parker")

    async def reconcile(self, host: str = LOCAL) -> None:
        """Adopt the units on ``host`` that match their recorded launch; stop ours that do not."""
        systemd = self.hosts.systemd(host)
        units = {u.name: u for u in await systemd.list_units("capyctl-*.service")}
        adopting = []
        for name, actor in self.actors.items():
            if actor.host != host:
                continue
            unit = units.pop(actor.unit, None)
            runtime = self.store.get_runtime(name)
            was_placed = actor.state in RUNNING_STATES or actor.parked_in_place
            # Multi-node groups are not adopted: their members are restarted on the next request.
            if unit is not None and unit.active_state in ("active", "activating", "reloading") and runtime \
                    and runtime.launch_id and unit.markers.get("launch") == runtime.launch_id \
                    and actor.spec.nodes == 1:
                adopting.append(actor.submit("adopt", unit_state=unit, runtime=runtime))
            else:
                if unit is not None and unit.active_state == "failed":
                    actor.state = FAILED
                    actor.reason = "the engine's unit failed while CapyCTL was not running"
                    actor.failed_at = time.monotonic() - 3600  # no backoff: the next request retries
                elif was_placed:
                    # Its engine went away while the host was out of reach.
                    adopting.append(actor.submit("unit_exited", code="unit_lost",
                                                 message=f"its unit was gone when host {host!r} came back"))
                elif runtime and runtime.state == PARKED:
                    actor.state = PARKED
                if unit is not None and unit.active_state != "failed":
                    # A unit of ours that does not match the recorded launch: stop it rather than
                    # serve an unknown revision with a key we do not have.
                    log.warning("stopping %s on %s: it does not match the recorded launch", unit.name, host)
                    await systemd.stop_unit(unit.name, actor.spec.timeouts.stop)
        for unit in units.values():
            # Only units CapyCTL launched carry its markers; a unit that merely matches the name
            # pattern (an admin's own capyctl-foo.service) is none of our business. A deployment
            # recorded under that name (a group's worker, one placed elsewhere) is left alone too.
            owner = unit.markers.get("deployment")
            if owner == deployment_from_unit(unit.name) and owner not in self.actors \
                    and unit.active_state in ("active", "activating"):
                log.warning("stopping %s on %s: no deployment of that name is recorded", unit.name, host)
                await systemd.stop_unit(unit.name, 30)
        if adopting:
            await asyncio.gather(*adopting, return_exceptions=True)

    async def close(self, *, stop_units: bool = False) -> None:
        """Stop the daemon's own tasks. Engine units keep serving unless ``stop_units``."""
        if self._idle_task:
            self._idle_task.cancel()
        if stop_units:
            await asyncio.gather(*(a.submit("stop") for a in self.actors.values()), return_exceptions=True)
        await asyncio.gather(*(a.close() for a in self.actors.values()), return_exceptions=True)
        await self.hosts.close()
        if self.http:
            await self.http.close()

    # -- engines, models, ports, secrets ------------------------------------------------------------

    def _engine_socket(self, label: str) -> str | None:
        """The unix socket of the engine a connection label (``<launch>.<deployment>.engine``) names."""
        launch, _, rest = label.partition(".")
        actor = self.actors.get(rest.rpartition(".")[0])
        if actor is None or actor.launch_id != launch:
            return None
        return actor.engine_socket()

    def engine_for(self, spec: DeploymentSpec) -> EngineSpec:
        registered = self.store.get_engine(spec.engine)
        if registered is not None:
            return registered
        if spec.engine == "llama.cpp":
            # An unregistered llama.cpp deployment uses llama-server from PATH.
            path = shutil.which("llama-server")
            if path:
                return EngineSpec(kind="engine", name="llama.cpp", type="llama.cpp", path=path)
        raise CapyError(f"no engine named {spec.engine!r} is registered"
                        + (" and no llama-server is on PATH" if spec.engine == "llama.cpp" else "")
                        + "; register one with 'capyctl engine add PATH'", code="engine_not_found", status=400)

    def engine_kind(self, spec: DeploymentSpec) -> str:
        registered = self.store.get_engine(spec.engine)
        return registered.type if registered else spec.engine

    def adapter(self, spec: DeploymentSpec):
        from ..engines import adapter_for
        registered = self.store.get_engine(spec.engine)
        return adapter_for(registered.type if registered else spec.engine, registered)

    async def resolve_model(self, spec: DeploymentSpec, engine: EngineSpec, progress: Progress):
        from ..sources import resolve_model

        def report(what: str, done: int, total: int | None) -> None:
            if total:
                progress(f"{what}: {done / 2**20:.0f} / {total / 2**20:.0f} MiB")
            else:
                progress(what)
        return await resolve_model(spec.model, engine_kind=engine.type, models_dir=self.paths.models_dir,
                                   progress=report)

    def gpu_device_nodes(self, host: str, indices: list[int]) -> list[str]:
        """The /dev/nvidia* nodes a unit on ``host`` may open for these cards (DeviceAllow)."""
        if not indices:
            return []
        if host == LOCAL:
            from ..hosts import device_nodes
            return device_nodes(indices)
        # A remote card's minor number comes from its host-info; the index is the usual fallback.
        info = self.hosts.get(host).info or {}
        minors = {int(g["index"]): g.get("minor_number") for g in info.get("gpus") or []}
        return [f"/dev/nvidia{minors.get(i) if minors.get(i) is not None else i}" for i in indices] + \
            ["/dev/nvidiactl", "/dev/nvidia-uvm"]

    def cpu_threads(self, spec: DeploymentSpec, host: str = LOCAL) -> int | None:
        if spec.resources.cpus:
            return max(1, int(spec.resources.cpus))
        if host != LOCAL:
            return (self.hosts.get(host).info or {}).get("cpu_count") or None
        return os.cpu_count()

    async def lease_port(self, name: str, host: str = LOCAL) -> int:
        """A loopback port for the engine on ``host`` (asked of the host itself when remote)."""
        if name in self._ports and self._ports[name][0] == host:
            return self._ports[name][1]
        used = {port for h, port in self._ports.values() if h == host}
        if host != LOCAL:
            port = await self.hosts.free_port(host, used)
            self._ports[name] = (host, port)
            return port
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in used:
                self._ports[name] = (host, port)
                return port
        raise CapyError("no free loopback port for the engine", code="no_port")

    def claim_port(self, name: str, port: int | None, host: str = LOCAL) -> None:
        if port:
            self._ports[name] = (host, port)

    def release_port(self, name: str) -> None:
        self._ports.pop(name, None)

    def _secret_path(self, name: str) -> Path:
        return self.paths.secrets_dir / f"{name}.env"

    async def write_secret_env_on(self, host: str, name: str, env: dict[str, str]) -> Path:
        """The 0600 environment file with the per-launch key, on the host the unit runs on."""
        if host == LOCAL:
            return self.write_secret_env(name, env)
        path = self._secret_path(name)
        content = "".join(f"{key}={value}\n" for key, value in env.items()).encode()
        await self.hosts.write_private_file(host, path, content)
        return path

    async def read_secret_key_on(self, host: str, name: str) -> str | None:
        if host == LOCAL:
            return self.read_secret_key(name)
        text = await self.hosts.read_file(host, self._secret_path(name))
        for line in (text or "").splitlines():
            key, _, value = line.partition("=")
            if key == "CAPYCTL_ENGINE_KEY":
                return value
        return None

    def write_secret_env(self, name: str, env: dict[str, str]) -> Path:
        path = self._secret_path(name)
        _write_private(path, "".join(f"{key}={value}\n" for key, value in env.items()))
        return path

    @property
    def secret_dir(self) -> str:
        """Where an engine's secret files (LaunchPlan.secret_files) are written, 0700 root."""
        return str(self.paths.secrets_dir)

    async def write_secret_files_on(self, host: str, files: dict[str, str]) -> None:
        """An engine's secret files (SGLang's --config with its key), 0600, on the unit's host."""
        for name, text in files.items():
            path = self.paths.secrets_dir / name
            if host == LOCAL:
                _write_private(path, text)
            else:
                await self.hosts.write_private_file(host, path, text.encode())

    async def remove_secret_files_on(self, host: str, names: list[str]) -> None:
        paths = [self.paths.secrets_dir / name for name in names]
        if host == LOCAL:
            for path in paths:
                path.unlink(missing_ok=True)
        elif paths and self.hosts.entries.get(host) is not None:
            try:
                await self.hosts.run(host, ["rm", "-f", *map(str, paths)])
            except CapyError as exc:
                log.warning("could not remove secret files %s on %s: %s", names, host, exc)

    def read_secret_key(self, name: str) -> str | None:
        try:
            for line in self._secret_path(name).read_text().splitlines():
                key, _, value = line.partition("=")
                if key == "CAPYCTL_ENGINE_KEY":
                    return value
        except FileNotFoundError:
            return None
        return None

    def remove_secret_env(self, name: str) -> None:
        self._secret_path(name).unlink(missing_ok=True)

    async def remove_secret_env_on(self, host: str, name: str) -> None:
        """The launch's environment file, on the host its unit ran on (an offline host keeps it)."""
        if host == LOCAL:
            self.remove_secret_env(name)
        elif self.hosts.entries.get(host) is not None:
            try:
                await self.hosts.run(host, ["rm", "-f", str(self._secret_path(name))])
            except CapyError as exc:
                log.warning("could not remove the key file of %s on %s: %s", name, host, exc)

    async def journal(self, unit: str, lines: int, host: str = LOCAL) -> list[str]:
        if host != LOCAL:
            return await self.hosts.journal(host, unit, lines)
        from ..systemd import journal_tail
        return await journal_tail(unit, lines)

    # -- hosts --------------------------------------------------------------------------------------

    def systemd_on(self, host: str) -> Any:
        """The systemd of ``host`` (raises host_offline while it is offline)."""
        return self.hosts.systemd(host)

    def host_state(self, host: str) -> str:
        entry = self.hosts.entries.get(host)
        return entry.state if entry is not None else "unknown"

    def host_address(self, host: str) -> str:
        """The SSH target a host was added with (``user@address[:port]``)."""
        return self.hosts.get(host).record.address

    async def free_port_on(self, host: str) -> int:
        return await self.hosts.free_port(host, set())

    async def forward_port(self, host: str, remote_port: int) -> int:
        return await self.hosts.forward_port(host, remote_port)

    async def forward_socket(self, host: str, remote_path: str) -> str:
        return await self.hosts.forward_socket(host, remote_path)

    def has_forward(self, host: str, local: int | str | None) -> bool:
        return self.hosts.has_forward(host, local)

    async def cancel_forward(self, host: str, local: int | str) -> None:
        await self.hosts.cancel_forward(host, local)

    def placement_error(self, actor: DeploymentActor) -> CapyError | None:
        """Why a request for ``actor`` cannot be served now because of its hosts, or None."""
        placed = actor.state in RUNNING_STATES or actor.parked_in_place
        if placed:
            entry = self.hosts.entries.get(actor.host)
            if entry is not None and not entry.online:
                return self.hosts.offline_error(actor.host, actor.name)
            return None
        wanted = actor.spec.hosts
        if wanted and not any(h in self.hosts.entries and self.hosts.entries[h].online for h in wanted):
            known = [h for h in wanted if h in self.hosts.entries]
            if known:
                return self.hosts.offline_error(known[0], actor.name)
        return None

    def allowed_hosts(self, actor: DeploymentActor) -> tuple[str, ...]:
        """The online hosts ``actor`` may start on: its manifest's ``hosts``, else every online host."""
        if actor.parked_in_place:
            return (actor.host,)
        wanted = actor.spec.hosts or list(self.hosts.entries)
        for name in wanted:
            self.hosts.get(name)  # an unknown host is an error, not an offline one
        online = tuple(h for h in wanted if self.hosts.entries[h].online)
        if not online:
            raise self.hosts.offline_error(wanted[0], actor.name)
        return online

    async def _host_offline(self, host: str) -> None:
        for actor in self.actors.values():
            if actor.host == host:
                actor.host_lost()

    async def _host_online(self, host: str) -> None:
        # The poller marks the host online after this returns, so reconcile through its entry.
        entry = self.hosts.get(host)
        state, entry.state = entry.state, "online"
        try:
            await self.reconcile(host)
        except BaseException:
            entry.state = state
            raise

    async def add_host(self, name: str, target: str, **options: Any) -> dict:
        await self.hosts.add(name, target, **options)
        return self.describe_host(name)

    async def remove_host(self, name: str) -> None:
        users = [a.name for a in self.actors.values()
                 if a.host == name and (a.state in RUNNING_STATES or a.parked_in_place)]
        if users:
            raise Conflict(f"host {name!r} runs deployments {', '.join(sorted(users))}; stop them first",
                           code="host_in_use")
        pinned = [a.name for a in self.actors.values() if name in a.spec.hosts]
        if pinned:
            raise Conflict(f"deployments {', '.join(sorted(pinned))} name host {name!r} in their manifest; "
                           "delete them or deploy them elsewhere first", code="host_in_use")
        await self.hosts.remove(name)

    def describe_host(self, name: str) -> dict:
        row = self.hosts.describe(name)
        row["engines"] = sorted({e.type for e in self.store.list_engines()})
        row["deployments"] = sorted(a.name for a in self.actors.values()
                                    if a.host == name and (a.state in RUNNING_STATES or a.parked_in_place))
        return row

    # -- making room --------------------------------------------------------------------------------

    async def make_room(self, actor: DeploymentActor, progress: Progress) -> None:
        """Park or stop idle deployments until ``actor`` fits; busy ones are never touched."""
        async with self._placement_lock:
            for attempt in range(5):
                hosts = self.allowed_hosts(actor)
                # GPU memory of stopped deployments counts until NVML shows it free (_memory.py).
                gpu_hosts = tuple(actor.spec.hosts[:actor.spec.nodes]) if actor.spec.nodes > 1 else hosts
                await refresh_gpus(self, gpu_hosts)
                try:
                    victims = self.memory.plan(actor, list(self.actors.values()), time.time(), hosts)
                except NoRoom:
                    if not await wait_released(self, gpu_hosts):
                        raise
                    victims = self.memory.plan(actor, list(self.actors.values()), time.time(), hosts)
                if not victims:
                    actor.host = self.memory.planned_host(actor) or hosts[0]
                    self.memory.charge(actor)
                    return
                try:
                    for victim, action in victims:
                        progress(f"making room: {action} {victim.name}")
                        await asyncio.wait_for(
                            # Parking a stop-only engine stops its unit; "stop" here only
                            # forbids an in-place park whose weights would not fit in RAM.
                            victim.submit("park", evicting=True, in_place_ok=action == "park",
                                          reason=f"made room for {actor.name}"),
                            timeout=victim.spec.timeouts.park + victim.spec.timeouts.stop + 5)
                except Busy:
                    continue  # a victim got a request meanwhile: plan again
            raise Unavailable(f"could not make room for {actor.name!r}: deployments kept becoming busy",
                              code="no_room")

    def on_state_change(self, actor: DeploymentActor) -> None:
        self.memory.observe(actor)
        if actor.state == READY:
            # Charges estimated from the model are corrected by what the engine really uses.
            task = asyncio.create_task(self._measure(actor), name=f"measure:{actor.name}")
            self._measuring.add(task)
            task.add_done_callback(self._measuring.discard)
        for listener in self._listeners:
            listener(actor)

    async def _measure(self, actor: DeploymentActor) -> None:
        try:
            await measure_memory(self, actor)
        except Exception:  # a failed measurement keeps the estimate; it must not hurt the deployment
            log.warning("deployment %s: measuring its memory failed", actor.name, exc_info=True)

    async def _park_idle_loop(self) -> None:
        while True:
            await asyncio.sleep(IDLE_CHECK_INTERVAL_S)
            now = time.time()
            for actor in list(self.actors.values()):
                after = actor.spec.idle_park_after
                if after is None or actor.state != READY or actor.busy or actor.spec.park == "never":
                    continue
                if now - (actor.last_used or now) >= after and not actor.has_pending_commands:
                    actor.submit("park", evicting=True, reason=f"idle for {after:.0f}s")

    # -- Router (for the proxy) ---------------------------------------------------------------------

    def _lookup(self, model: str) -> DeploymentActor:
        actor = self.actors.get(model)
        if actor is None:
            for candidate in self.actors.values():
                if model in candidate.spec.aliases:
                    return candidate
            raise NotFound(f"the model {model!r} does not exist", code="model_not_found")
        return actor

    def models(self) -> list[ModelEntry]:
        entries = []
        for actor in self.actors.values():
            for ident in [actor.name, *actor.spec.aliases]:
                entries.append(ModelEntry(id=ident, deployment=actor.name, state=actor.state,
                                          engine=actor.spec.engine, created=int(actor.revision.created_at),
                                          capabilities=actor.capabilities))
        return entries

    @asynccontextmanager
    async def acquire(self, model: str) -> AsyncIterator[Upstream]:
        actor = self._lookup(model)
        await actor.admit()
        try:
            yield actor.upstream()
        finally:
            actor.release()

    def stats(self) -> dict[str, dict[str, float]]:
        return {a.name: {"queue_depth": a.waiting, "in_flight": a.in_flight, "wakes": a.wakes, "parks": a.parks,
                         "ready": 1.0 if a.state == READY else 0.0} for a in self.actors.values()}

    @property
    def queue_total(self) -> int:
        return self.config.queue_total

    def record_runtime(self, name: str, state: str, **fields: Any) -> None:
        self.store.put_runtime(name, state, **fields)

    def gpus_for(self, actor: DeploymentActor, rank: int | None = None) -> tuple[int, ...]:
        return self.memory.gpus_for(actor, rank)

    def launch_memory(self, actor: DeploymentActor, rank: int | None = None) -> tuple[float | None, int | None]:
        return self.memory.launch_memory(actor, rank)

    def total_waiting(self) -> int:
        return sum(a.waiting for a in self.actors.values())

    # -- management operations ----------------------------------------------------------------------

    def get(self, name: str) -> DeploymentActor:
        actor = self.actors.get(name)
        if actor is None:
            raise NotFound(f"no deployment named {name!r}", code="deployment_not_found")
        return actor

    async def deploy(self, spec: DeploymentSpec, *, activate: bool = False,
                     progress: Progress = _no_progress) -> DeploymentActor:
        self.engine_for(spec)  # refuse an unknown engine before anything is recorded
        revision, new = self.store.put_deployment(spec)
        actor = self.actors.get(spec.name)
        if actor is None:
            actor = self.actors[spec.name] = DeploymentActor(self, revision)
            progress(f"recorded revision {revision.revision}")
        elif new:
            progress(f"revision {revision.revision} replaces {actor.revision.revision}")
            was_running = actor.state in RUNNING_STATES or (actor.state == PARKED and actor.parked_in_place)
            if was_running:
                await actor.submit("stop")
            actor.revision = revision
            if was_running:
                activate = True
        else:
            progress(f"revision {revision.revision} is unchanged")
        if activate:
            await actor.submit("wake", progress=progress)
        return actor

    async def park(self, name: str) -> DeploymentActor:
        actor = self.get(name)
        await actor.submit("park", reason="parked by request")
        return actor

    async def wake(self, name: str) -> DeploymentActor:
        actor = self.get(name)
        await actor.submit("wake")
        return actor

    async def stop(self, name: str) -> DeploymentActor:
        actor = self.get(name)
        await actor.submit("stop")
        self.store.set_desired(name, "stopped")
        return actor

    async def delete(self, name: str) -> None:
        actor = self.get(name)
        if actor.busy:
            raise Conflict(f"deployment {name!r} has requests in flight; stop it first", code="deployment_busy")
        await actor.submit("delete")
        self.actors.pop(name, None)
        self.store.delete_deployment(name)
        self.memory.forget(name)

    async def describe(self, name: str) -> dict:
        actor = self.get(name)
        info = actor.describe()
        info["memory_current"] = None
        if actor.state in RUNNING_STATES or actor.parked_in_place:
            try:
                info["memory_current"] = await self.hosts.systemd(actor.host).memory_current(actor.unit)
            except Exception:
                pass
        return info


def _write_private(path: Path, text: str) -> None:
    """A 0600 file written whole or not at all (a temporary file renamed in place): a reader
    such as systemd at exec time never sees half a key."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
