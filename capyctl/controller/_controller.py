"""The controller: owns every deployment's actor, implements the proxy's Router, reconciles
with systemd after a restart, makes room for a wake, and parks idle deployments. Engine secrets,
ports, host cordons and the /metrics figures are kept by its services (_secrets.py, _ports.py,
_cordons.py, _metrics.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import aiohttp

from ..config import DaemonConfig, deployment_from_unit, replica_of
from ..errors import CapyError, Conflict, NotFound
from ..proxy.connector import REPLICA_IN_LABEL, EngineConnector
from ..proxy.router import DurationCounts, MemoryGauge, ModelEntry, Upstream
from ..scheduler import NoRoom
from ..spec import DeploymentSpec, EngineSpec
from ..store import Revision, Store
from ._actor import DeploymentActor, Progress, no_progress
from ._admission import Busy
from ._launch import spec_capabilities
from ._lifecycle import RUNNING, Command, DeploymentState
from ._hosts import LOCAL, HostRegistry
from . import _parking as parking
from ._memory import MemoryPlanner, refresh_gpus, wait_released
from ._turns import RoomWaitTimeout, Turns, WakeCancelled, wait_for_beat
from ._memory import measure as measure_memory
from ._cordons import Cordons
from ._metrics import DeploymentMetrics
from ._ports import PortLeases
from ._replicas import ReplicaSet, prefix_hashes
from ._secrets import EngineSecrets
from ._timeline import EVICT, MAKE_ROOM, WAIT_FOR_ROOM, Timeline
from ._usage import UsageView

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
        self.actors: dict[str, DeploymentActor] = {}  # by replica name (config.replica_name)
        # Each deployment's replicas, by deployment name: routing and scaling (_replicas.py).
        self.replica_sets: dict[str, ReplicaSet] = {}
        self.http: aiohttp.ClientSession | None = None
        self.memory = MemoryPlanner(config)
        self.turns = Turns(config)  # deployments waiting for room held by busy ones (_turns.py)
        self.hosts = HostRegistry(store, self.paths.runtime_dir, systemd, ram_reserve=config.host_ram_reserve,
                                  on_offline=self._host_offline, on_online=self.reconcile,
                                  on_resources=self._host_resources)
        self._placement_lock = asyncio.Lock()
        self.ports = PortLeases(self.hosts)  # engines' loopback ports (_ports.py)
        self.secrets = EngineSecrets(self.paths, self.hosts)  # engine keys and secret files (_secrets.py)
        self._idle_task: asyncio.Task | None = None
        self._listeners: list[Callable[[DeploymentActor], None]] = []
        self._measuring: set[asyncio.Task] = set()
        # Hosts closed to new placements (capyctl drain host), where a deployment may start, and
        # the host operations that must see both (_cordons.py).
        self.cordons = Cordons(config, store, self.hosts, lambda: self.actors)
        # For /metrics: evictions, wake durations, memory gauges (_metrics.py).
        self.metrics = DeploymentMetrics(lambda: self.actors, lambda: UsageView(self))

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load deployments from the store and adopt the units a previous daemon left running."""
        self.secrets.make_dir()
        # No pool limit: 200 concurrent streams must not queue inside the client.
        self.http = aiohttp.ClientSession(connector=EngineConnector(limit=0, resolve=self._engine_socket),
                                          timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        for dep in self.store.list_deployments():
            revision = self.store.current_revision(dep.name)
            if revision is not None:
                for actor in self._add_replicas(revision):
                    runtime = self.store.get_runtime(actor.name)
                    if runtime is not None:
                        actor.host = runtime.host
        await self.hosts.start()
        # Each host's units adopted at once: a restart with many hosts must not wait for each in turn.
        outcomes = await asyncio.gather(*(self.reconcile(host) for host in self.hosts.online_names()),
                                        return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        self.hosts.refresh_remembered()  # inventories taken from the store, read again now
        self._idle_task = asyncio.create_task(self._park_idle_loop(), name="idle-parker")

    async def reconcile(self, host: str = LOCAL) -> None:
        """Adopt the units on ``host`` that match their recorded launch; stop ours that do not."""
        systemd = self.hosts.systemd(host)
        units = {u.name: u for u in await systemd.list_units("capyctl-*.service")}
        # Every key the adoptions below need, in one command on the host rather than one each.
        await self.secrets.unseal_keys_on(host, [name for name, actor in self.actors.items()
                                                 if actor.host == host and actor.unit in units])
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
                self.memory.adopting(name, unit.markers.get("cpus"))
                adopting.append(actor.submit(Command.ADOPT, unit_state=unit, runtime=runtime))
            else:
                # A failed unit is news only where it was serving or parked in place: a stop, or a
                # park by stopping, leaves the unit of an engine that had failed loaded as failed.
                if unit is not None and unit.active_state == "failed" and runtime is not None \
                        and runtime.state != DeploymentState.STOPPED \
                        and (runtime.state != DeploymentState.PARKED or actor.park_record.get("parked_in_place")):
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
            # pattern (an admin's own capyctl-foo.service) is none of our business, nor is a group's
            # worker (its deployment is recorded on the head's host).
            owner = unit.markers.get("deployment")
            if owner != deployment_from_unit(unit.name) or unit.active_state not in ("active", "activating"):
                continue
            actor = self.actors.get(owner)
            if actor is None:
                log.warning("stopping %s on %s: no deployment of that name is recorded", unit.name, host)
                await systemd.stop_unit(unit.name, 30)
            elif actor.spec.nodes == 1:
                # It moved while this host was lost (on_host_loss: move): one copy serves, the other goes.
                log.warning("stopping %s on %s: the deployment moved to host %s while this host was lost",
                            unit.name, host, actor.host)
                await systemd.stop_unit(unit.name, actor.spec.timeouts.stop)
        if adopting:
            await asyncio.gather(*adopting, return_exceptions=True)
        self.secrets.forget_unsealed(host)

    async def close(self, *, stop_units: bool = False) -> None:
        """Stop the daemon's own tasks. Engine units keep serving unless ``stop_units``."""
        if self._idle_task:
            self._idle_task.cancel()
        if stop_units:
            await asyncio.gather(*(a.submit(Command.STOP) for a in self.actors.values()), return_exceptions=True)
        # Remote buses first (their SSH masters end with the daemon): a unit watch cancelled next
        # finds its bus closed, and writes nothing to a dead connection.
        await self.hosts.close()
        await asyncio.gather(*(a.close() for a in self.actors.values()), return_exceptions=True)
        if self.http:
            await self.http.close()

    # -- engines and models ------------------------------------------------------------------------

    def _engine_socket(self, label: str) -> str | None:
        """The unix socket of the engine a connection label (``<launch>.<deployment>.engine``) names."""
        launch, _, rest = label.partition(".")
        name = rest.rpartition(".")[0]
        base, mark, index = name.rpartition(REPLICA_IN_LABEL)
        for candidate in (name, f"{base}@{index}" if mark else None):  # a replica's label (socket_base_url)
            actor = self.actors.get(candidate) if candidate else None
            if actor is not None and actor.launch_id == launch:
                return actor.engine_address()[1]
        return None

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

    @staticmethod
    def engine_connections_max(kind: str, spec: DeploymentSpec) -> int | None:
        """The bound of ``kind``'s adapter on the proxy's connections to one engine of ``spec`` (proxy
        Upstream.connections_max); None where it has none or the kind is none CapyCTL knows. From
        the kind (engine_kind) rather than the registered engine: no second store read."""
        from ..engines import adapter_for
        try:
            return adapter_for(kind, None).connections_max(spec)
        except CapyError:
            return None

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

    def cpu_threads(self, spec: DeploymentSpec, host: str = LOCAL, cores: tuple = ()) -> int | None:
        """The engine's threads: one per core the plan gave it; where its cores are not planned
        (a GPU deployment, a host whose cores are unknown), its manifest's cpus, else one per CPU."""
        if cores:
            return len(cores)
        if spec.resources.cpus:
            return spec.resources.cpus
        if host != LOCAL:
            return (self.hosts.get(host).info or {}).get("cpu_count") or None
        return os.cpu_count()

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

    async def _host_offline(self, host: str) -> None:
        for actor in self.actors.values():
            if actor.host == host:
                actor.host_lost(host)

    # -- what a deployment's actor asks of the controller; see _services.DeploymentServices --------
    # Delegations to the services that do the work (and to the host registry, for forwards): the
    # actor, _members.py and _liveness.py call these on their controller.

    async def lease_port(self, name: str, host: str = LOCAL) -> int:
        return await self.ports.lease(name, host)

    def claim_port(self, name: str, port: int | None, host: str = LOCAL) -> None:
        self.ports.claim(name, port, host)

    def release_port(self, name: str) -> None:
        self.ports.release(name)

    async def free_port_on(self, host: str) -> int:
        return await self.ports.free_port_on(host)

    async def forward_port(self, host: str, remote_port: int) -> int:
        return await self.hosts.forward_port(host, remote_port)

    async def forward_socket(self, host: str, remote_path: str) -> str:
        return await self.hosts.forward_socket(host, remote_path)

    def has_forward(self, host: str, local: int | str | None) -> bool:
        return self.hosts.has_forward(host, local)

    async def cancel_forward(self, host: str, local: int | str) -> None:
        await self.hosts.cancel_forward(host, local)

    async def launch_credentials_on(self, host: str, key_file: str, key: str,
                                    files: dict[str, str]) -> tuple[dict[str, str], frozenset[str]]:
        return await self.secrets.launch_credentials_on(host, key_file, key, files)

    async def read_secret_key_on(self, host: str, name: str) -> str | None:
        return await self.secrets.read_secret_key_on(host, name)

    async def remove_secret_key_on(self, host: str, name: str) -> None:
        await self.secrets.remove_secret_key_on(host, name)

    async def remove_secret_files_on(self, host: str, names: list[str]) -> None:
        await self.secrets.remove_secret_files_on(host, names)

    def placement_error(self, actor: DeploymentActor) -> CapyError | None:
        return self.cordons.placement_error(actor)

    # -- making room --------------------------------------------------------------------------------

    async def make_room(self, actor: DeploymentActor, progress: Progress, timeline: Timeline | None = None) -> None:
        """Park or stop idle deployments until ``actor`` fits; busy ones are never touched. Where
        busy deployments hold the room, wait for it in line (controller/_turns.py), at most
        ``swap.wait_max``; raises NoRoom at once where waiting would not bring it. ``timeline``
        gets the waits for room and the evictions as phases, and the evicted parks' timelines."""
        try:
            await self._make_room(actor, progress, timeline if timeline is not None else Timeline())
        except NoRoom as exc:
            if actor.waits_for_room:
                raise
            # A replica added by scaling that finds no room is not a failed deployment: it stays as it
            # was, and scaling tries again later (_replicas.DECISION_RETRY_S).
            raise RoomWaitTimeout(f"replica {actor.name!r} was not added: {exc.message}", retry_after=1.0) from None
        finally:
            self.turns.leave(actor.name, {name: a.requests for name, a in self.actors.items()})

    async def _make_room(self, actor: DeploymentActor, progress: Progress, timeline: Timeline) -> None:
        told = ""
        while True:
            beat = self.turns.beat()  # before looking: a change while we look is not missed
            async with self._placement_lock:
                placed, yielders = await self._place(actor, progress, timeline)
                if placed:
                    return
                if not actor.waits_for_room:
                    raise RoomWaitTimeout(f"replica {actor.name!r} is added for load only where room is free or "
                                          "held by idle deployments, and busy ones hold it", retry_after=1.0)
                since = self.turns.join(actor.name)
                closed = self.turns.yield_to(actor.name, [y.requests for y in yielders], actor.requests)
                if closed:
                    log.info("deployment %s: waited %.1fs for room; %s finish what they have, then yield",
                             actor.name, self.turns.clock() - since, ", ".join(closed))
            waited = self.turns.clock() - since
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
            timeline.lap(WAIT_FOR_ROOM)  # its looks at the plan included: one entry however long

    async def _place(self, actor: DeploymentActor, progress: Progress,
                     timeline: Timeline) -> tuple[bool, list[DeploymentActor]]:
        """Under the placement lock: plan ``actor``'s placement, evict idle victims and plan again
        until it fits (True, []) or must wait: (False, the deployments that must yield the room,
        or [] when only its turn in line is missing). Raises NoRoom when waiting would not help.
        The lock is held from the evictions to the charge, so the room they free is not taken by
        another wake (the victims' own, say) in between."""
        while True:
            hosts = self.cordons.allowed_hosts(actor)
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
            timeline.lap(MAKE_ROOM)
            try:
                for victim, action in victims:
                    progress(f"making room: {action} {victim.name}")
                    await asyncio.wait_for(
                        # Parking a stop-only engine stops its unit; "stop" here only
                        # forbids an in-place park whose weights would not fit in RAM.
                        victim.submit(Command.PARK, evicting=True, in_place_ok=action == "park",
                                      reason=f"made room for {actor.name}"),
                        timeout=victim.spec.timeouts.park + victim.spec.timeouts.stop + 5)
                    self.metrics.evicted(victim.name)
                    if victim.last_park_timeline is not None:
                        timeline.evicted.append({"deployment": victim.name, **victim.last_park_timeline})
            except Busy:
                pass  # a victim got a request meanwhile: plan again
            finally:
                timeline.lap(EVICT)

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
        if actor.state != DeploymentState.READY:
            replicas = self.replica_sets.get(actor.deployment)
            if replicas is not None and replicas.replicated:
                replicas.went_away(actor)
        self.turns.changed()
        self.metrics.state_changed(actor)
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
            resources, ram_reserve=self.config.ram_reserve_for(resources.ram_total),
            core_reserve=self.config.cpu_reserve_for(len(resources.cores))))

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

    def check_cores(self, spec: DeploymentSpec, source: str = "request body: spec") -> None:
        """Refuse a manifest whose resources.cpus no host it may run on has (a manifest error
        naming the field, which the CLI places on its line in the file)."""
        from ..spec import ManifestError, Problem
        hosts = spec.hosts[:spec.nodes] if spec.nodes > 1 else (spec.hosts or list(self.hosts.entries))
        problem = self.memory.cores_problem(spec, hosts)
        if problem is not None:
            raise ManifestError(source, [Problem("resources.cpus", None, problem)])

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
                # A replica that no request reached yet (routing chose its siblings) is idle since
                # it became ready; a lone deployment never used stays as it always has.
                last = actor.last_used or (actor.ready_since if actor.spec.replicas.max > 1 else 0) or now
                if now - last >= after and not actor.has_pending_commands:
                    actor.submit(Command.PARK, evicting=True, idle=True, reason=f"idle for {after:.0f}s")
            self.scale_replicas()

    # -- replicas (_replicas.py) --------------------------------------------------------------------

    def _add_replicas(self, revision: Revision) -> list[DeploymentActor]:
        """Actors for the replicas ``revision`` asks for that do not exist yet."""
        replicas = self.replica_sets.get(revision.deployment)
        if replicas is None:
            replicas = self.replica_sets[revision.deployment] = ReplicaSet(revision.deployment)
        added = []
        for index in range(1, revision.spec.replicas.max + 1):
            if index not in replicas.members:
                actor = DeploymentActor(self, revision, index)
                self.actors[actor.name] = replicas.members[index] = actor
                added.append(actor)
        return added

    def replica_names(self, deployment: str) -> list[str]:
        replicas = self.replica_sets.get(deployment)
        return replicas.names() if replicas is not None else []

    def replicas_of(self, name: str) -> ReplicaSet:
        """The replica set of deployment ``name``, or of the replica named ``name``."""
        replicas = self.replica_sets.get(replica_of(name)[0])
        if replicas is None or name not in self.actors:
            raise NotFound(f"no deployment named {name!r}", code="deployment_not_found")
        return replicas

    def scale_replicas(self) -> None:
        """Add or park replicas by load (ReplicaSet.scale); each decision in the journal and /metrics."""
        for replicas in list(self.replica_sets.values()):
            if not replicas.replicated:
                continue
            for decision in replicas.scale():
                actor = self.actors[decision.replica]
                log.info("deployment %s: %s replica %s: %s", replicas.deployment,
                         "parking" if decision.direction == "down" else "adding", actor.name, decision.reason)
                self.metrics.scaled(actor.name, decision.direction)
                if decision.direction == "down":
                    actor.submit(Command.PARK, evicting=True, idle=True, reason=f"scaled down: {decision.reason}")
                else:
                    # Beyond the replica requests wake, none makes a busy deployment yield its room.
                    actor.submit(Command.WAKE, room_now_only=True)

    # -- Router (for the proxy) ---------------------------------------------------------------------

    def _lookup(self, model: str) -> ReplicaSet:
        """The deployment clients call ``model`` (its name or an alias); a replica's own name is
        not a model."""
        replicas = self.replica_sets.get(model)
        if replicas is None:
            for candidate in self.replica_sets.values():
                if model in candidate.spec.aliases:
                    return candidate
            raise NotFound(f"the model {model!r} does not exist", code="model_not_found")
        return replicas

    def models(self) -> list[ModelEntry]:
        return [self._entry(replicas, ident) for replicas in self.replica_sets.values()
                for ident in [replicas.deployment, *replicas.spec.aliases]]

    def model_entry(self, model: str) -> ModelEntry | None:
        try:
            return self._entry(self._lookup(model), model)
        except NotFound:
            return None

    @staticmethod
    def _entry(replicas: ReplicaSet, ident: str) -> ModelEntry:
        actor = replicas.primary
        state = actor.state
        if replicas.replicated and state != DeploymentState.READY and replicas.ready():
            state = DeploymentState.READY  # a model serves while any of its replicas does
        return ModelEntry(id=ident, deployment=replicas.deployment, state=state, engine=actor.spec.engine,
                          created=int(actor.revision.created_at), capabilities=actor.capabilities,
                          replicas=len(replicas.members))

    def try_acquire(self, model: str, prompt: str | None = None,
                    replica: str | None = None) -> tuple[Upstream, Callable[[], None]] | None:
        try:
            replicas = self._lookup(model)
        except NotFound:
            return None  # acquire() raises model_not_found
        if not replicas.replicated:
            actor = replicas.primary
            return (actor.upstream(), actor.requests.release) if actor.requests.admit_now() else None
        hashes = prefix_hashes(prompt)
        actor = replicas.member(replica) or replicas.pick_ready(hashes)
        if actor is None or not actor.requests.admit_now():
            return None
        replicas.served(hashes, actor)
        return actor.upstream(), actor.requests.release

    @asynccontextmanager
    async def acquire(self, model: str, progress: Callable[[str], None] | None = None,
                      prompt: str | None = None, replica: str | None = None) -> AsyncIterator[Upstream]:
        replicas = self._lookup(model)
        hashes: tuple[int, ...] = ()
        if replicas.replicated:
            hashes = prefix_hashes(prompt)
            actor = replicas.member(replica) or replicas.pick_ready(hashes) or replicas.to_wake()
        else:
            actor = replicas.primary
        await actor.requests.admit(progress)
        replicas.served(hashes, actor)
        try:
            yield actor.upstream()
        finally:
            actor.requests.release()

    async def engine_lost(self, upstream: Upstream) -> bool:
        actor = self.actors.get(upstream.deployment)
        if actor is None:
            return False
        replicas = self.replica_sets.get(actor.deployment)
        if replicas is not None and replicas.replicated and any(
                other is not actor and other.name not in replicas.held for other in replicas.members.values()):
            # Its siblings serve: out of routing at once, and the request goes to one of them.
            replicas.lost(actor)
            log.warning("deployment %s: replica %s lost its engine connection; its requests go to the others",
                        actor.deployment, actor.name)
            return True
        return actor.spec.on_host_loss == "move" and await self.hosts.confirm_lost(upstream.host)

    def stats(self) -> dict[str, dict[str, float]]:
        return self.metrics.stats()

    def wake_durations(self) -> dict[str, DurationCounts]:
        return self.metrics.wake_durations()

    def phase_durations(self) -> dict[tuple[str, str, str], DurationCounts]:
        return self.metrics.phase_durations()

    def timeline_recorded(self, name: str, record: dict) -> None:
        self.metrics.timeline(name, record)

    async def memory_gauges(self) -> list[MemoryGauge]:
        return await self.metrics.memory_gauges()

    @property
    def queue_total(self) -> int:
        return self.config.queue_total

    def record_runtime(self, name: str, state: str, **fields: Any) -> None:
        self.store.put_runtime(name, state, **fields)

    def gpus_for(self, actor: DeploymentActor, rank: int | None = None) -> tuple[int, ...]:
        return self.memory.gpus_for(actor, rank)

    def launch_memory(self, actor: DeploymentActor, rank: int | None = None) -> tuple[float | None, int | None]:
        return self.memory.launch_memory(actor, rank)

    def cores_for(self, actor: DeploymentActor, rank: int | None = None) -> tuple[tuple[int, ...], ...]:
        return self.memory.cores_for(actor, rank)

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
        """A deployment (its replica 1) or one replica by its own name (``chat@2``)."""
        actor = self.actors.get(name)
        if actor is None:
            raise NotFound(f"no deployment named {name!r}", code="deployment_not_found")
        return actor

    async def deploy(self, spec: DeploymentSpec, *, activate: bool = False,
                     progress: Progress = no_progress) -> DeploymentActor:
        self.engine_for(spec)  # refuse an unknown engine before anything is recorded
        self.adapter(spec).check_task(spec)  # and a task its engine cannot be started for
        self.check_park_tier(spec)  # and a park tier its engine or host cannot deliver
        self.check_cores(spec)  # and more cores than its hosts have
        revision, new = self.store.put_deployment(spec)
        replicas = self.replica_sets.get(spec.name)
        if replicas is None:
            self._add_replicas(revision)
            replicas = self.replica_sets[spec.name]
            progress(f"recorded revision {revision.revision}")
        elif new:
            progress(f"revision {revision.revision} replaces {replicas.primary.revision.revision}")
            activate = await self._roll_out(replicas, revision, progress) or activate
        else:
            progress(f"revision {revision.revision} is unchanged")
        actor = replicas.primary
        self._tell_listeners(actor)  # a new deployment or revision, before any state change
        if activate:
            await self._wake_replicas(replicas, progress)
        return actor

    async def _roll_out(self, replicas: ReplicaSet, revision: Revision, progress: Progress) -> bool:
        """Move every replica to ``revision``; True when any was serving (the deployment is woken
        after). With two or more serving, they are replaced one at a time, each out of routing while
        its requests finish and ready again before the next goes, so the others serve throughout."""
        for index in sorted(replicas.members):
            if index > revision.spec.replicas.max:
                await self._remove_replica(replicas, index)
        running = [a for a in replicas.ordered()
                   if a.state in RUNNING or (a.state == DeploymentState.PARKED and a.parked_in_place)]
        rolling = len(running) >= 2
        for actor in replicas.ordered():
            if actor not in running:
                self._set_revision(actor, revision)
        for actor in running:
            if rolling:
                log.info("deployment %s: replacing replica %s with revision %d while the others serve",
                         replicas.deployment, actor.name, revision.revision)
                progress(f"replacing replica {actor.name}")
                replicas.draining.add(actor.name)
                # The revision first: a wake that requests waiting for it queue behind the stop
                # starts the new one.
                self._set_revision(actor, revision)
            try:
                await actor.submit(Command.STOP)
                self._set_revision(actor, revision)
                if rolling:
                    await actor.submit(Command.WAKE, progress=progress)
            finally:
                replicas.draining.discard(actor.name)
        self._add_replicas(revision)
        return bool(running)

    def _set_revision(self, actor: DeploymentActor, revision: Revision) -> None:
        actor.revision = revision
        actor.capabilities = spec_capabilities(self, revision.spec)

    async def _remove_replica(self, replicas: ReplicaSet, index: int) -> None:
        """A replica the new revision no longer has: stopped, its records gone."""
        actor = replicas.members[index]
        await actor.submit(Command.DELETE)
        del replicas.members[index]
        self._forget(actor)

    def _forget(self, actor: DeploymentActor) -> None:
        self.actors.pop(actor.name, None)
        self.store.remove_runtime(actor.name)
        self.store.remove_park_record(actor.name)
        self.memory.forget(actor.name)

    async def _wake_replicas(self, replicas: ReplicaSet, progress: Progress) -> None:
        """Wake a deployment: ``replicas.min`` of its replicas (at least one), together."""
        replicas.held.clear()
        first = replicas.to_wake()
        others = [a for a in replicas.ordered() if a is not first][:max(replicas.spec.replicas.min, 1) - 1]
        await asyncio.gather(first.submit(Command.WAKE, progress=progress),
                             *(a.submit(Command.WAKE) for a in others))

    def _targets(self, name: str) -> tuple[ReplicaSet, list[DeploymentActor]]:
        """What a command for ``name`` acts on: every replica of a deployment, or one replica."""
        replicas = self.replicas_of(name)
        return replicas, (replicas.ordered() if name == replicas.deployment else [self.actors[name]])

    async def park(self, name: str) -> DeploymentActor:
        replicas, targets = self._targets(name)
        await asyncio.gather(*(a.submit(Command.PARK, reason="parked by request") for a in targets
                               if len(targets) == 1 or a.state in RUNNING))
        return self.actors[name]

    async def wake(self, name: str, progress: Progress = no_progress) -> DeploymentActor:
        replicas, targets = self._targets(name)
        if len(targets) > 1:
            await self._wake_replicas(replicas, progress)
        else:
            replicas.held.discard(name)
            await targets[0].submit(Command.WAKE, progress=progress)
        return self.actors[name]

    async def stop(self, name: str) -> DeploymentActor:
        replicas, targets = self._targets(name)
        if name != replicas.deployment:
            replicas.held.add(name)  # out of routing and scaling until woken by name
        await asyncio.gather(*(a.submit(Command.STOP) for a in targets))
        if name == replicas.deployment:
            self.store.set_desired(name, "stopped")
        return self.actors[name]

    async def drain(self, name: str) -> DeploymentActor:
        """Take one replica out of routing, let its requests finish, and park it; it stays out
        (scaling included) until woken by name. A deployment's own name drains it as a park does."""
        replicas, targets = self._targets(name)
        if name != replicas.deployment:
            replicas.held.add(name)
        await asyncio.gather(*(a.submit(Command.PARK, reason="drained by request") for a in targets
                               if a.state in RUNNING))
        return self.actors[name]

    async def delete(self, name: str) -> None:
        replicas = self.replicas_of(name)
        if name != replicas.deployment:
            raise Conflict(f"{name!r} is a replica of deployment {replicas.deployment!r}: lower its replicas "
                           "to remove it, or stop it", code="replica_not_deletable")
        for actor in replicas.ordered():
            if actor.requests.serving_clients:  # (the proof after a wake is drained by the delete's stop)
                raise Conflict(f"deployment {name!r} has requests in flight; stop it first", code="deployment_busy")
        await asyncio.gather(*(a.submit(Command.DELETE) for a in replicas.ordered()))
        del self.replica_sets[name]
        for actor in replicas.ordered():
            self._forget(actor)
        self.store.delete_deployment(name)
        self._tell_listeners(replicas.primary)

    async def inspect(self, name: str) -> dict:
        """Everything known about one deployment: its state, manifest, revisions, last launch
        record, memory plan and the host settings that apply to it."""
        info = await self.describe(name)
        actor = self.get(name)
        record = self.store.get_deployment(actor.deployment)
        runtime = self.store.get_runtime(name)
        info["desired"] = record.desired if record else None
        info["spec"] = actor.spec.model_dump(mode="json")
        info["revisions"] = [{"revision": r.revision, "spec_hash": r.spec_hash, "model_commit": r.model_commit,
                              "created_at": r.created_at} for r in self.store.revisions(actor.deployment)]
        info["runtime"] = dataclasses.asdict(runtime) if runtime else None
        info["idle_park_after"] = self.idle_park_after(actor)
        info["gpus"] = list(self.gpus_for(actor)) if actor.spec.nodes == 1 else None
        info["dev_controls"] = self.config.dev_controls(actor.host)
        info["cordoned_host"] = actor.host in self.cordons.cordoned
        info["launch_command"] = actor.launch_command
        return info

    async def describe(self, name: str) -> dict:
        actor = self.get(name)
        info = actor.describe()
        replicas = self.replica_sets.get(name)
        if replicas is not None and replicas.replicated:
            # A deployment's own status lists each of its replicas (`capyctl status`, one line each).
            info["replicas"] = [{"name": a.name, "state": a.state, "reason": a.reason, "unit": a.unit,
                                 "host": a.host, "revision": a.revision.revision, "in_flight": a.in_flight,
                                 "waiting": a.waiting, "routable": replicas.routable(a),
                                 "held": a.name in replicas.held} for a in replicas.ordered()]
        since = self.turns.waiting().get(name)
        info["waiting_for_room"] = None if since is None else {
            "seconds": round(self.turns.clock() - since, 3), "ahead": self.turns.ahead_of(name)}
        info["memory_current"] = info["memory_peak"] = None
        if actor.state in RUNNING or actor.parked_in_place:
            try:
                # Inside the try: a host that is offline has no systemd to ask (host_offline), and
                # its deployment's status must still answer, with its host_state saying why.
                systemd = self.hosts.systemd(actor.host)
                info["memory_current"] = await systemd.memory_current(actor.unit)
                # Read from the cgroup filesystem, which is this machine's: a remote unit's is not here.
                info["memory_peak"] = None if actor.remote else await systemd.memory_peak(actor.unit)
            except Exception:
                pass
        return info
