"""The controller: owns every deployment's actor, implements the proxy's Router, reconciles
with systemd after a restart, makes room for a wake, and parks idle deployments."""

from __future__ import annotations

import asyncio
import dataclasses
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
from ..proxy.router import DurationCounts, MemoryGauge, ModelEntry, Upstream
from ..scheduler import NoRoom
from ..spec import DeploymentSpec, EngineSpec
from ..store import Store
from ._actor import Busy, DeploymentActor, Progress, no_progress
from ._lifecycle import RUNNING, Command, DeploymentState
from ._hosts import LOCAL, HostRegistry
from . import _parking as parking
from ._memory import MemoryPlanner, refresh_gpus, wait_released
from ._turns import RoomWaitTimeout, Turns, WakeCancelled, wait_for_beat
from ._parking import park_stats
from ._memory import measure as measure_memory

log = logging.getLogger("capyctl.controller")

IDLE_CHECK_INTERVAL_S = 1.0
# A wake waiting for room plans again at every change (Turns.changed) and at least this often,
# so that a change nobody announced (memory freed outside CapyCTL) is seen too.
ROOM_RECHECK_S = 1.0


class Controller:
    def __init__(self, config: DaemonConfig, store: Store, systemd: Any) -> None:
        self.config = config
        self.paths = config.paths
        self.store = store
        self.systemd = systemd
        self.actors: dict[str, DeploymentActor] = {}
        self.http: aiohttp.ClientSession | None = None
        self.memory = MemoryPlanner(config)
        self.turns = Turns(config)  # deployments waiting for room held by busy ones (_turns.py)
        self.hosts = HostRegistry(store, self.paths.runtime_dir, systemd, ram_reserve=config.host_ram_reserve,
                                  on_offline=self._host_offline, on_online=self._host_online,
                                  on_resources=self._host_resources)
        self._placement_lock = asyncio.Lock()
        self._ports: dict[str, tuple[str, int]] = {}  # deployment -> (host, engine port there)
        # host -> whether systemd-creds encrypts credentials there (None: not tried yet)
        self._sealing: dict[str, bool] = {}
        self._idle_task: asyncio.Task | None = None
        self._listeners: list[Callable[[DeploymentActor], None]] = []
        self._measuring: set[asyncio.Task] = set()
        # Hosts closed to new placements (capyctl drain host), host -> since; the store keeps them
        # across restarts, this copy keeps a request's admission free of SQLite.
        self.cordoned: dict[str, float] = store.cordons()
        # For /metrics: parks (or stops) to make room, per victim; wake durations per deployment.
        self.evictions: dict[str, int] = {}
        self._wake_started: dict[str, float] = {}
        self._wake_durations: dict[str, DurationCounts] = {}
        self._usage: Any = None

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
            was_placed = actor.state in RUNNING or actor.parked_in_place
            # Multi-node groups are not adopted: their members are restarted on the next request.
            if unit is not None and unit.active_state in ("active", "activating", "reloading") and runtime \
                    and runtime.launch_id and unit.markers.get("launch") == runtime.launch_id \
                    and actor.spec.nodes == 1:
                adopting.append(actor.submit(Command.ADOPT, unit_state=unit, runtime=runtime))
            else:
                if unit is not None and unit.active_state == "failed":
                    adopting.append(actor.submit(Command.FAILED_WHILE_AWAY))
                elif was_placed:
                    # Its engine went away while the host was out of reach.
                    adopting.append(actor.submit(Command.UNIT_EXITED, code="unit_lost",
                                                 message=f"its unit was gone when host {host!r} came back"))
                elif runtime and runtime.state == DeploymentState.PARKED:
                    adopting.append(actor.submit(Command.RESTORE_PARKED))
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
            await asyncio.gather(*(a.submit(Command.STOP) for a in self.actors.values()), return_exceptions=True)
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
        """The key file a unit loads as its KEY_CREDENTIAL (LoadCredential= reads it as root)."""
        return self.paths.secrets_dir / f"{name}.key"

    def _legacy_env_path(self, name: str) -> Path:
        # Before engine keys were credentials: an EnvironmentFile= with CAPYCTL_ENGINE_KEY=<key>.
        # Still read when adopting a unit an earlier version started, and removed with the key.
        return self.paths.secrets_dir / f"{name}.env"

    async def write_secret_key_on(self, host: str, name: str, key: str) -> Path:
        """The 0600 file with the per-launch key, on the host the unit runs on; the unit loads it
        as a credential, so the key is in no environment file, property or argv."""
        path = self._secret_path(name)
        if host == LOCAL:
            _write_private(path, key + "\n")
        else:
            await self.hosts.write_private_file(host, path, (key + "\n").encode())
        return path

    def _sealed_path(self, stem: str) -> Path:
        # A credential encrypted by systemd-creds (LoadCredentialEncrypted=); see launch_credentials_on.
        return self.paths.secrets_dir / f"{stem}.cred"

    async def launch_credentials_on(self, host: str, key_file: str, key: str,
                                    files: dict[str, str]) -> tuple[dict[str, str], frozenset[str]]:
        """Write one launch's credentials on the host its unit runs on: the per-launch key (the
        credential KEY_CREDENTIAL, file ``key_file``) and each of ``files`` (LaunchPlan.secret_files:
        credential name -> text). Each is encrypted with ``systemd-creds encrypt`` where the host
        has it (its host key, and its TPM2 where present), so no secret lies in the clear on disk;
        elsewhere it is a 0600 file in the 0700 secrets directory. Returns the credentials for
        TransientUnit (name -> file) and the names that are encrypted."""
        from ..engines import KEY_CREDENTIAL
        wanted = {KEY_CREDENTIAL: (key_file, (key + "\n").encode()),
                  **{name: (name, text.encode()) for name, text in files.items()}}
        credentials: dict[str, str] = {}
        sealed: set[str] = set()
        for credential, (stem, content) in wanted.items():
            path = self._sealed_path(stem)
            if await self._seal_on(host, credential, path, content):
                credentials[credential] = str(path)
                sealed.add(credential)
                # A clear copy from an earlier launch (or version) must not outlive this one.
                await self._remove_files_on(host, [self._secret_path(stem) if stem == key_file
                                                   else self.secret_file_path(stem)])
                continue
            if stem == key_file:
                credentials[credential] = str(await self.write_secret_key_on(host, key_file, key))
            else:
                await self.write_secret_files_on(host, {stem: content.decode()})
                credentials[credential] = str(self.secret_file_path(stem))
        return credentials, frozenset(sealed)

    async def _seal_on(self, host: str, credential: str, path: Path, content: bytes) -> bool:
        """``systemd-creds encrypt`` of ``content`` into ``path`` on ``host``; False where the host
        cannot (no systemd-creds, systemd older than 250, no writable host key), remembered so the
        next launch does not try again."""
        if self._sealing.get(host) is False:
            return False
        if host == LOCAL:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        argv = ["systemd-creds", "encrypt", f"--name={credential}", "-", str(path)]
        try:
            rc, _, err = await self.hosts.run(host, argv, input=content)
        except (OSError, CapyError) as exc:  # FileNotFoundError: no systemd-creds on this machine
            rc, err = 1, str(exc).encode()
        if rc == 0 and host == LOCAL:
            path.chmod(0o600)
        elif rc == 0:
            rc, _, err = await self.hosts.run(host, ["chmod", "0600", str(path)])
        if rc != 0:
            if self._sealing.get(host) is None:
                log.warning("engine keys on host %s are 0600 files, not encrypted credentials: systemd-creds "
                            "encrypt failed: %s", host, err.decode(errors="replace").strip()[:300])
            self._sealing[host] = False
            return False
        self._sealing[host] = True
        return True

    async def _remove_files_on(self, host: str, paths: list[Path]) -> None:
        if host == LOCAL:
            for path in paths:
                path.unlink(missing_ok=True)
        elif self.hosts.entries.get(host) is not None:
            try:
                await self.hosts.run(host, ["rm", "-f", *map(str, paths)])
            except CapyError as exc:
                log.warning("could not remove %s on %s: %s", ", ".join(map(str, paths)), host, exc)

    async def _unseal_on(self, host: str, credential: str, path: Path) -> str | None:
        """The text of an encrypted credential this daemon wrote (adoption after a restart)."""
        try:
            rc, out, _ = await self.hosts.run(host, ["systemd-creds", "decrypt", f"--name={credential}",
                                                     str(path), "-"])
        except (OSError, CapyError):
            return None
        return out.decode().strip() or None if rc == 0 else None

    async def read_secret_key_on(self, host: str, name: str) -> str | None:
        from ..engines import KEY_CREDENTIAL
        sealed = self._sealed_path(name)
        if host != LOCAL or sealed.exists():
            key = await self._unseal_on(host, KEY_CREDENTIAL, sealed)
            if key is not None:
                return key
        if host == LOCAL:
            return self.read_secret_key(name)
        text = await self.hosts.read_file(host, self._secret_path(name))
        if text is not None:
            return text.strip() or None
        return _key_of_env_file(await self.hosts.read_file(host, self._legacy_env_path(name)))

    def secret_file_path(self, name: str) -> Path:
        """Where a LaunchPlan.secret_files file is written (the source of its credential)."""
        return self.paths.secrets_dir / name

    async def engine_confinement(self, host: str, deployment: str, engine_path: str | None, model_path: str,
                                 devices: list[str]):
        """What the engine unit may see (controller/_confine.py), probed on its own host."""
        from ._confine import confinement, probe_host, probe_local

        async def run(argv: list[str]) -> tuple[int, bytes, bytes]:
            return await self.hosts.run(host, argv)

        if host == LOCAL:
            probe = probe_local(engine_path, model_path, devices)
        else:
            probe = await probe_host(run, engine_path, model_path, devices)
        confined = confinement(self.paths, deployment, engine_path, model_path, devices, probe)
        repos = [p for p in confined.bind_read_only_paths if p.startswith(str(self.paths.models_dir) + "/")]
        if repos:
            # The daemon downloads under UMask=0077 (units/capyctl.service): a Hub repository bound
            # into an engine unit must be readable by its unprivileged user. Other local users still
            # cannot reach it: the state directory above it is 0750 root:capyctl.
            rc, _, err = await self.hosts.run(host, ["chmod", "-R", "o+rX", *repos])
            if rc != 0:
                raise CapyError(f"could not make the model {model_path} readable for its engine on host {host!r}: "
                                f"{err.decode(errors='replace').strip()}", code="model_unreadable", status=500)
        return confined

    async def write_secret_files_on(self, host: str, files: dict[str, str]) -> None:
        """An engine's secret files (SGLang's --config with its key), 0600, on the unit's host."""
        for name, text in files.items():
            path = self.secret_file_path(name)
            if host == LOCAL:
                _write_private(path, text)
            else:
                await self.hosts.write_private_file(host, path, text.encode())

    async def remove_secret_files_on(self, host: str, names: list[str]) -> None:
        """A launch's secret files, clear or encrypted, on the host its unit ran on."""
        if names:
            await self._remove_files_on(host, [p for n in names for p in (self.secret_file_path(n),
                                                                          self._sealed_path(n))])

    def read_secret_key(self, name: str) -> str | None:
        try:
            return self._secret_path(name).read_text().strip() or None
        except FileNotFoundError:
            pass
        try:
            return _key_of_env_file(self._legacy_env_path(name).read_text())
        except FileNotFoundError:
            return None

    async def remove_secret_key_on(self, host: str, name: str) -> None:
        """The launch's key file (clear, encrypted or a legacy environment file), on the host its
        unit ran on (an offline host keeps it)."""
        await self._remove_files_on(host, [self._secret_path(name), self._legacy_env_path(name),
                                           self._sealed_path(name)])

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
        placed = actor.state in RUNNING or actor.parked_in_place
        if self.cordoned and actor.state not in RUNNING:
            # Refused before a wake starts: a cordon is the operator's choice, not the deployment's failure.
            try:
                self.allowed_hosts(actor)
            except CapyError as exc:
                if exc.code == "host_cordoned":
                    return exc
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
        cordoned = self.cordoned
        if actor.parked_in_place:
            if actor.host in cordoned:
                raise self._cordoned_error(actor, [actor.host])
            return (actor.host,)
        wanted = actor.spec.hosts or list(self.hosts.entries)
        for name in wanted:
            self.hosts.get(name)  # an unknown host is an error, not an offline one
        if actor.spec.nodes > 1:
            closed = [h for h in wanted[:actor.spec.nodes] if h in cordoned]
        else:
            closed = [h for h in wanted if h in cordoned]
            wanted = [h for h in wanted if h not in cordoned]
        if closed and (actor.spec.nodes > 1 or not wanted):
            raise self._cordoned_error(actor, closed)
        online = tuple(h for h in wanted if self.hosts.entries[h].online)
        if not online:
            raise self.hosts.offline_error(wanted[0], actor.name)
        return online

    # -- cordons and drains ------------------------------------------------------------------------

    @staticmethod
    def _cordoned_error(actor: DeploymentActor, closed: list[str]) -> CapyError:
        many = len(closed) > 1
        return Unavailable(f"deployment {actor.name!r} may only run on host{'s' if many else ''} "
                           f"{', '.join(closed)}, which {'are' if many else 'is'} drained; "
                           f"'capyctl uncordon host {closed[0]}' opens it again", code="host_cordoned")

    def cordon(self, host: str) -> None:
        """Close ``host`` to new placements (kept in the store: a restart keeps it closed)."""
        self.hosts.get(host)  # an unknown host is a 404
        self.store.cordon(host)
        self.cordoned = self.store.cordons()
        log.info("host %s cordoned: no new placement lands there", host)

    def uncordon(self, host: str) -> bool:
        self.hosts.get(host)
        opened = self.store.uncordon(host)
        self.cordoned = self.store.cordons()
        if opened:
            log.info("host %s uncordoned: it takes placements again", host)
        return opened

    async def drain(self, host: str) -> dict:
        """Cordon ``host``, then park every deployment placed there out of place (its memory is
        released there and a wake does not land there again); one that may run elsewhere and
        was serving is woken on another host (moved)."""
        self.cordon(host)
        results = []
        for name in self.describe_host(host)["deployments"]:
            actor = self.actors.get(name)
            if actor is None:
                continue
            was_serving = actor.state in RUNNING
            row: dict[str, Any] = {"name": name, "action": "parked", "error": None}
            try:
                # Out of place: weights kept in this host's RAM would bring the next wake back here.
                await actor.submit(Command.PARK, in_place_ok=False, reason=f"host {host} drained")
                if was_serving and actor.spec.nodes == 1 and actor.spec.park != "never":
                    try:
                        others = self.allowed_hosts(actor)
                    except CapyError:
                        others = ()
                    if others:
                        await actor.submit(Command.WAKE)
                        row["action"] = "moved"
            except CapyError as exc:
                row["error"] = exc.to_dict()
            results.append(row | {"state": actor.state, "host": actor.host})
        return {"host": host, "cordoned": True, "deployments": results,
                "drained": all(r["error"] is None for r in results)}

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
                 if a.host == name and (a.state in RUNNING or a.parked_in_place)]
        if users:
            raise Conflict(f"host {name!r} runs deployments {', '.join(sorted(users))}; stop them first",
                           code="host_in_use")
        pinned = [a.name for a in self.actors.values() if name in a.spec.hosts]
        if pinned:
            raise Conflict(f"deployments {', '.join(sorted(pinned))} name host {name!r} in their manifest; "
                           "delete them or deploy them elsewhere first", code="host_in_use")
        await self.hosts.remove(name)
        self.store.uncordon(name)
        self.cordoned = self.store.cordons()

    def describe_host(self, name: str) -> dict:
        row = self.hosts.describe(name)
        row["engines"] = sorted({e.type for e in self.store.list_engines()})
        row["deployments"] = sorted(a.name for a in self.actors.values()
                                    if a.host == name and (a.state in RUNNING or a.parked_in_place))
        cordoned_at = self.cordoned.get(name)
        row["cordoned"] = cordoned_at is not None
        row["cordoned_at"] = cordoned_at
        row["dev_controls"] = self.config.dev_controls(name)
        return row

    # -- making room --------------------------------------------------------------------------------

    async def make_room(self, actor: DeploymentActor, progress: Progress) -> None:
        """Park or stop idle deployments until ``actor`` fits; busy ones are never touched. Where
        busy deployments hold the room, wait for it in line (controller/_turns.py), at most
        ``swap.wait_max``; raises NoRoom at once where waiting would not bring it."""
        try:
            await self._make_room(actor, progress)
        finally:
            self.turns.leave(actor.name, self.actors)

    async def _make_room(self, actor: DeploymentActor, progress: Progress) -> None:
        told = ""
        while True:
            beat = self.turns.beat()  # before looking: a change while we look is not missed
            async with self._placement_lock:
                placed, yielders = await self._place(actor, progress)
                if placed:
                    return
                since = self.turns.join(actor.name)
                closed = self.turns.yield_to(actor.name, yielders, actor)
                if closed:
                    log.info("deployment %s: waited %.1fs for room; %s finish what they have, then yield",
                             actor.name, time.monotonic() - since, ", ".join(closed))
            waited = time.monotonic() - since
            if waited >= self.turns.wait_max:
                raise RoomWaitTimeout(
                    f"deployment {actor.name!r} waited {waited:.0f}s for room held by busy deployments "
                    f"(swap.wait_max is {self.turns.wait_max:.0f}s)",
                    retry_after=max(1.0, self.turns.quantum), detail={"waited": round(waited, 3)})
            ahead = self.turns.ahead_of(actor.name)
            note = (f"waiting for room held by {', '.join(sorted(y.name for y in yielders))}" if yielders
                    else "waiting for its turn to make room") + (f"; {ahead} deployment(s) ahead" if ahead else "")
            if note != told:
                progress(note)
                told = note
            if actor.redirected:
                raise WakeCancelled(f"deployment {actor.name!r} was asked to do something else while it waited "
                                    "for room", retry_after=1.0)
            if actor.abandoned:
                raise WakeCancelled(f"no request waits for deployment {actor.name!r} any more: its wake stopped "
                                    "waiting for room", retry_after=1.0)
            # Look again at the next change, when the quantum is up, and at least every ROOM_RECHECK_S.
            until_quantum = self.turns.quantum - waited
            await wait_for_beat(beat, min(self.turns.wait_max - waited, ROOM_RECHECK_S,
                                          until_quantum if until_quantum > 0 else ROOM_RECHECK_S))

    async def _place(self, actor: DeploymentActor, progress: Progress) -> tuple[bool, list[DeploymentActor]]:
        """Under the placement lock: plan ``actor``'s placement, evict idle victims and plan again
        until it fits (True, []) or must wait: (False, the deployments that must yield the room,
        or [] when only its turn in line is missing). Raises NoRoom when waiting would not help.
        The lock is held from the evictions to the charge, so the room they free is not taken by
        another wake (the victims' own, say) in between."""
        while True:
            hosts = self.allowed_hosts(actor)
            # GPU memory of stopped deployments counts until NVML shows it free (_memory.py).
            gpu_hosts = tuple(actor.spec.hosts[:actor.spec.nodes]) if actor.spec.nodes > 1 else hosts
            await refresh_gpus(self, gpu_hosts)
            actors = list(self.actors.values())
            try:
                victims = self.memory.plan(actor, actors, time.time(), hosts)
            except NoRoom:
                if await wait_released(self, gpu_hosts):
                    continue
                return False, self.memory.yielders(actor, actors, time.time(), hosts)
            if not victims:
                actor.host = self.memory.planned_host(actor) or hosts[0]
                self.memory.charge(actor)
                return True, []
            if not self.turns.may_evict(actor.name):
                return False, []  # an older wake waits for room: it evicts first
            try:
                for victim, action in victims:
                    progress(f"making room: {action} {victim.name}")
                    await asyncio.wait_for(
                        # Parking a stop-only engine stops its unit; "stop" here only
                        # forbids an in-place park whose weights would not fit in RAM.
                        victim.submit(Command.PARK, evicting=True, in_place_ok=action == "park",
                                      reason=f"made room for {actor.name}"),
                        timeout=victim.spec.timeouts.park + victim.spec.timeouts.stop + 5)
                    self.evictions[victim.name] = self.evictions.get(victim.name, 0) + 1
            except Busy:
                pass  # a victim got a request meanwhile: plan again

    def subscribe(self, listener: Callable[[DeploymentActor], None]) -> Callable[[], None]:
        """Call ``listener(actor)`` on every change of a deployment's state, and when one is deployed or
        deleted (the dashboard's event stream); returns the call that unsubscribes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _tell_listeners(self, actor: DeploymentActor) -> None:
        for listener in list(self._listeners):
            try:
                listener(actor)
            except Exception:  # a listener is an observer: it must not break a state change
                log.warning("a state listener failed on %s", actor.name, exc_info=True)

    def on_state_change(self, actor: DeploymentActor) -> None:
        self.memory.observe(actor)
        self.turns.changed()
        if actor.state in (DeploymentState.STARTING, DeploymentState.WAKING):
            self._wake_started.setdefault(actor.name, time.monotonic())
        elif actor.name in self._wake_started:
            started = self._wake_started.pop(actor.name)
            if actor.state == DeploymentState.READY:  # a failed wake is not a duration of a wake
                self._wake_durations.setdefault(actor.name, DurationCounts()).observe(time.monotonic() - started)
        if actor.state == DeploymentState.READY:
            # Charges estimated from the model are corrected by what the engine really uses.
            task = asyncio.create_task(self._measure(actor), name=f"measure:{actor.name}")
            self._measuring.add(task)
            task.add_done_callback(self._measuring.discard)
        self._tell_listeners(actor)

    def _host_resources(self, name: str, resources: Any) -> None:
        # The reserve follows the configuration (ram_reserve, or ram_budget's complement), read
        # at each inventory so that a reload applies to every host.
        self.memory.set_host(name, dataclasses.replace(
            resources, ram_reserve=self.config.ram_reserve_for(resources.ram_total)))

    def reconfigured(self) -> None:
        """A reload changed the configuration in place: apply what is not read at each use
        (the RAM budgets); queue caps, idle-park and development controls are read live."""
        self.memory.rebudget_local(self.config)
        for name, entry in self.hosts.entries.items():
            if entry.remote and entry.info:
                self._host_resources(name, entry.resources(0))

    def idle_park_after(self, actor: DeploymentActor) -> float | None:
        """The manifest's idle_park_after, else the configuration's default."""
        after = actor.spec.idle_park_after
        return after if after is not None else self.config.idle_park_after

    def dev_controls(self, host: str) -> bool:
        return self.config.dev_controls(host)

    # -- parking you can check (_parking.py) -------------------------------------------------------

    def unified_memory(self, host: str) -> bool:
        return parking.unified_memory(self, host)

    def load_park_record(self, name: str) -> dict | None:
        return self.store.park_record(name)

    def save_park_record(self, name: str, record: dict) -> None:
        self.store.put_park_record(name, record)

    async def retain_after_park(self, actor: DeploymentActor) -> dict[str, int]:
        """Measure what ``actor``'s in-place park left held (NVML per process, its cgroup) and keep
        that charged in the ledger; returns it by domain (empty: all released, or not measurable)."""
        try:
            held = await parking.measure_retained(self, actor)
        except Exception:  # a failed measurement keeps the tier's charge
            log.warning("deployment %s: measuring what its park released failed", actor.name, exc_info=True)
            return {}
        self.memory.ledger.retain(actor.name, held)
        if held:
            log.warning("deployment %s: its park left %s held; that stays charged", actor.name, held)
        return held

    def check_park_tier(self, spec: DeploymentSpec) -> None:
        """Refuse a declared park_tier the engine or any of the deployment's hosts cannot deliver."""
        from ..engines._tiers import check_park_tier
        adapter = self.adapter(spec)
        for host in (spec.hosts[:spec.nodes] or [LOCAL]):
            check_park_tier(adapter, spec, host=host, unified_memory=self.unified_memory(host))

    @property
    def queue_per_deployment(self) -> int:
        return self.config.queue_per_deployment

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
                after = self.idle_park_after(actor)
                if after is None or actor.state != DeploymentState.READY or actor.busy or actor.spec.park == "never":
                    continue
                if now - (actor.last_used or now) >= after and not actor.has_pending_commands:
                    actor.submit(Command.PARK, evicting=True, idle=True, reason=f"idle for {after:.0f}s")

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
        return [self._entry(actor, ident) for actor in self.actors.values()
                for ident in [actor.name, *actor.spec.aliases]]

    def model_entry(self, model: str) -> ModelEntry | None:
        try:
            return self._entry(self._lookup(model), model)
        except NotFound:
            return None

    @staticmethod
    def _entry(actor: DeploymentActor, ident: str) -> ModelEntry:
        return ModelEntry(id=ident, deployment=actor.name, state=actor.state, engine=actor.spec.engine,
                          created=int(actor.revision.created_at), capabilities=actor.capabilities)

    def try_acquire(self, model: str) -> tuple[Upstream, Callable[[], None]] | None:
        try:
            actor = self._lookup(model)
        except NotFound:
            return None  # acquire() raises model_not_found
        return (actor.upstream(), actor.release) if actor.admit_now() else None

    @asynccontextmanager
    async def acquire(self, model: str, progress: Callable[[str], None] | None = None) -> AsyncIterator[Upstream]:
        actor = self._lookup(model)
        await actor.admit(progress)
        try:
            yield actor.upstream()
        finally:
            actor.release()

    def stats(self) -> dict[str, dict[str, float]]:
        return {a.name: {"queue_depth": a.waiting, "in_flight": a.in_flight, "wakes": a.wakes, "parks": a.parks,
                         "evictions": self.evictions.get(a.name, 0),
                         "ready": 1.0 if a.state == DeploymentState.READY else 0.0, **park_stats(a.park_record)}
                for a in self.actors.values()}

    def wake_durations(self) -> dict[str, DurationCounts]:
        return {name: counts for name, counts in self._wake_durations.items() if name in self.actors}

    async def memory_gauges(self) -> list[MemoryGauge]:
        from ._usage import UsageView
        if self._usage is None:
            self._usage = UsageView(self)
        try:
            view = await self._usage.view()
        except Exception:  # a scrape must not fail because one host could not be measured
            log.warning("metrics: measuring memory failed", exc_info=True)
            return []
        held: dict[str, dict[str, int]] = {}
        for dep in view["deployments"]:
            for d in dep["domains"]:
                if d["held"] is not None:
                    held.setdefault(d["id"], {})[dep["name"]] = d["held"]
        return [MemoryGauge(domain=d["id"], kind=d["kind"], host=host["host"], index=d["index"],
                            capacity=d["capacity"], available=d["available"], reserved=d["reserved"],
                            held=held.get(d["id"], {}))
                for host in view["hosts"] for d in host["domains"]]

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

    def admission_ticket(self) -> int:
        return self.turns.ticket()

    def room_changed(self) -> None:
        self.turns.changed()

    def room_wanted(self) -> bool:
        return self.turns.anyone_waiting

    @property
    def room_wait_max(self) -> float:
        return self.turns.wait_max

    # -- management operations ----------------------------------------------------------------------

    def get(self, name: str) -> DeploymentActor:
        actor = self.actors.get(name)
        if actor is None:
            raise NotFound(f"no deployment named {name!r}", code="deployment_not_found")
        return actor

    async def deploy(self, spec: DeploymentSpec, *, activate: bool = False,
                     progress: Progress = no_progress) -> DeploymentActor:
        self.engine_for(spec)  # refuse an unknown engine before anything is recorded
        self.adapter(spec).check_task(spec)  # and a task its engine cannot be started for
        self.check_park_tier(spec)  # and a park tier its engine or host cannot deliver
        revision, new = self.store.put_deployment(spec)
        actor = self.actors.get(spec.name)
        if actor is None:
            actor = self.actors[spec.name] = DeploymentActor(self, revision)
            progress(f"recorded revision {revision.revision}")
        elif new:
            progress(f"revision {revision.revision} replaces {actor.revision.revision}")
            was_running = actor.state in RUNNING or (actor.state == DeploymentState.PARKED and actor.parked_in_place)
            if was_running:
                await actor.submit(Command.STOP)
            actor.revision = revision
            actor.capabilities = actor.spec_capabilities()
            if was_running:
                activate = True
        else:
            progress(f"revision {revision.revision} is unchanged")
        self._tell_listeners(actor)  # a new deployment or revision, before any state change
        if activate:
            await actor.submit(Command.WAKE, progress=progress)
        return actor

    async def park(self, name: str) -> DeploymentActor:
        actor = self.get(name)
        await actor.submit(Command.PARK, reason="parked by request")
        return actor

    async def wake(self, name: str) -> DeploymentActor:
        actor = self.get(name)
        await actor.submit(Command.WAKE)
        return actor

    async def stop(self, name: str) -> DeploymentActor:
        actor = self.get(name)
        await actor.submit(Command.STOP)
        self.store.set_desired(name, "stopped")
        return actor

    async def delete(self, name: str) -> None:
        actor = self.get(name)
        if actor.serving_clients:  # (the proof after a wake is drained by the delete's stop)
            raise Conflict(f"deployment {name!r} has requests in flight; stop it first", code="deployment_busy")
        await actor.submit(Command.DELETE)
        self.actors.pop(name, None)
        self.store.delete_deployment(name)
        self.store.remove_park_record(name)
        self.memory.forget(name)
        self._tell_listeners(actor)

    async def inspect(self, name: str) -> dict:
        """Everything known about one deployment: its state, manifest, revisions, last launch
        record, memory plan and the host settings that apply to it."""
        info = await self.describe(name)
        actor = self.get(name)
        record = self.store.get_deployment(name)
        runtime = self.store.get_runtime(name)
        info["desired"] = record.desired if record else None
        info["spec"] = actor.spec.model_dump(mode="json")
        info["revisions"] = [{"revision": r.revision, "spec_hash": r.spec_hash, "model_commit": r.model_commit,
                              "created_at": r.created_at} for r in self.store.revisions(name)]
        info["runtime"] = dataclasses.asdict(runtime) if runtime else None
        info["idle_park_after"] = self.idle_park_after(actor)
        info["gpus"] = list(self.gpus_for(actor)) if actor.spec.nodes == 1 else None
        info["dev_controls"] = self.config.dev_controls(actor.host)
        info["cordoned_host"] = actor.host in self.cordoned
        info["launch_command"] = actor.launch_command
        return info

    def inspect_host(self, name: str) -> dict:
        row = self.describe_host(name)
        entry = self.hosts.get(name)
        row["inventory"] = entry.info
        row["deployment_states"] = {d: self.actors[d].state for d in row["deployments"] if d in self.actors}
        row["placeable"] = sorted(a.name for a in self.actors.values()
                                  if not a.spec.hosts or name in a.spec.hosts)
        return row

    async def describe(self, name: str) -> dict:
        actor = self.get(name)
        info = actor.describe()
        since = self.turns.waiting().get(name)
        info["waiting_for_room"] = None if since is None else {
            "seconds": round(time.monotonic() - since, 3), "ahead": self.turns.ahead_of(name)}
        info["memory_current"] = info["memory_peak"] = None
        if actor.state in RUNNING or actor.parked_in_place:
            systemd = self.hosts.systemd(actor.host)
            try:
                info["memory_current"] = await systemd.memory_current(actor.unit)
                # Read from the cgroup filesystem, which is this machine's: a remote unit's is not here.
                info["memory_peak"] = None if actor.remote else await systemd.memory_peak(actor.unit)
            except Exception:
                pass
        return info


def _key_of_env_file(text: str | None) -> str | None:
    for line in (text or "").splitlines():
        key, _, value = line.partition("=")
        if key == "CAPYCTL_ENGINE_KEY":
            return value
    return None


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
