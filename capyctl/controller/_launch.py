"""One launch of a deployment's engine: the unit it runs in, planned from the manifest, the engine's
adapter and what placement gave it; the wait for its health; and what a unit's description says.

``prepare_unit`` plans; it starts nothing and changes no state. The actor takes the plan, records
the launch, and starts the unit (controller/_actor.py ``_launch``).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..config import engine_credentials_dir, engine_socket_path, engine_socket_runtime_directory
from ..descriptors import is_shortage
from ..errors import CapyError
from ._confine import engine_location
from ._keys import new_engine_key
from ._lifecycle import DeploymentState
from ._memory import cpu_fields, gpu_order_environment
from ._services import DeploymentServices, PlacedDeployment
from ._timeline import CREDENTIALS, PREPARE, Timeline

Progress = Callable[[str], None]

# The health poll's interval while a start is young, before it backs off (wait_healthy).
HEALTH_POLL_S = 0.01
# "0" turns off arming at a park (DeploymentActor._arm): every wake from a park by stopping
# then starts its unit.
ARM_PARKED_ENV = "CAPYCTL_ARM_PARKED"


def arm_parked_units() -> bool:
    return os.environ.get(ARM_PARKED_ENV, "1").strip().lower() not in ("0", "no", "false", "off")


# What `systemctl status` and `systemctl list-units` say a deployment's unit is doing, after
# "CapyCTL deployment NAME (rev N, ENGINE): ". The actor changes it with every state its unit
# lives through, so that systemctl and `capyctl list` agree.
PARKED_ARMED, PARKED_IN_PLACE = "parked_armed", "parked_in_place"
UNIT_PHASES: dict[str, str] = {
    DeploymentState.STARTING: "starting",
    DeploymentState.WAKING: "waking",
    DeploymentState.READY: "serving",
    DeploymentState.PARKING: "parking",
    PARKED_ARMED: "parked; its next launch is held at its gate until a wake",
    PARKED_IN_PLACE: "parked in place; the engine sleeps until a wake",
    DeploymentState.STOPPING: "stopping",
}


def unit_description(name: str, revision: int, engine_type: str, phase: str) -> str:
    return f"CapyCTL deployment {name} (rev {revision}, {engine_type}): {UNIT_PHASES.get(phase, phase)}"


@dataclass(frozen=True)
class Presealed:
    """A key sealed for the next launch on ``host``: its credentials for TransientUnit."""

    host: str
    key: str
    credentials: dict[str, str]
    encrypted: frozenset[str]


async def _sealed_already(presealed: Presealed) -> tuple[dict[str, str], frozenset[str]]:
    return presealed.credentials, presealed.encrypted


@dataclass(frozen=True)
class PreparedUnit:
    """A planned launch: the unit to start and what the deployment records of it."""

    unit: Any  # systemd.TransientUnit
    launch_id: str
    port: int
    key: str
    model_path: str
    model_revision: str | None
    socket_path: str | None
    capabilities: frozenset[str]
    served_model: str | None
    # The engine's command line and the environment the adapter and the manifest gave it (no
    # secret: keys travel as credentials), for `capyctl recipe run`'s launch without CapyCTL.
    launch_command: dict
    secret_files: list[str]


def spec_capabilities(ctl: DeploymentServices, spec: Any) -> frozenset[str]:
    """What the adapter declares from the spec alone, before any launch (so the proxy refuses a
    route the engine lacks without waking the model): the model's path when the manifest names
    one on this host (a Hub model has none until it is downloaded); empty while the engine is
    not registered (the deployment cannot start then either)."""
    model_path = spec_model_path(spec)
    try:
        engine = ctl.engine_for(spec)
        adapter = ctl.adapter(spec)
    except CapyError:
        return frozenset()
    return adapter.capabilities(engine, deployment=spec, model_path=model_path)


def spec_model_path(spec: Any) -> str | None:
    """The model's path when the manifest names one on this host (a Hub model has none until
    it is downloaded)."""
    from ..spec import PathModel
    return spec.model.path if isinstance(spec.model, PathModel) else None


def model_label(spec: Any) -> str:
    m = spec.model
    return getattr(m, "hf", None) or getattr(m, "path", "")


async def prepare_unit(ctl: DeploymentServices, deployment: PlacedDeployment, *, revision: int,
                       presealed: Presealed | None, gated: bool, prompt_cache_dir: str | None,
                       phase: str, progress: Progress, timeline: Timeline) -> PreparedUnit:
    """Plan ``deployment``'s next launch on its host: resolve its model, lease its port, make its
    key (or use the one sealed at its park), build the engine's command line, seal its
    credentials and probe what its unit may see. ``gated``: the unit waits at its gate.
    ``phase``: what its description says it does (UNIT_PHASES)."""
    from ..engines import LaunchContext  # the controller is the one place engines are used
    from ..systemd import TransientUnit

    spec, name, host = deployment.spec, deployment.name, deployment.host
    engine = ctl.engine_for(spec)
    adapter = ctl.adapter(spec)
    progress(f"resolving model {model_label(spec)}")
    resolved = await ctl.resolve_model(spec, engine, progress)
    port = await ctl.lease_port(name, host)
    key = presealed.key if presealed is not None else new_engine_key()
    launch_id = secrets.token_hex(8)
    gpu_indices = list(ctl.gpus_for(deployment))
    # The planned share of each card, so two models planned on one card both fit (_memory.py).
    gpu_fraction, gpu_budget = ctl.launch_memory(deployment)
    # The cores the plan gave it: its unit is pinned to them and its threads follow them.
    cores = ctl.cores_for(deployment)
    # Engines that can serve on a unix socket do, in the unit's own 0700 runtime directory:
    # nobody but root (CapyCTL) reaches its routes, development controls included.
    socket_path = engine_socket_path(name) if adapter.unix_socket else None
    ctx = LaunchContext(deployment=spec, engine=engine, model_path=resolved.path, port=port,
                        gpu_indices=gpu_indices, cpu_threads=ctl.cpu_threads(spec, host, cores), cores=cores,
                        socket_path=socket_path, gpu_memory_fraction=gpu_fraction,
                        gpu_memory_budget=gpu_budget, secret_dir=engine_credentials_dir(deployment.unit),
                        dev_controls=ctl.dev_controls(host), unified_memory=ctl.unified_memory(host),
                        prompt_cache_dir=prompt_cache_dir)
    plan = adapter.build_launch(ctx)
    # The key and SGLang's config file become systemd credentials of the unit: no environment
    # file, property or argv holds them, and only the unit's own user can read them.
    devices = ctl.gpu_device_nodes(host, gpu_indices)
    timeline.lap(PREPARE)
    # Sealing the credentials and probing what the unit may see are independent round trips
    # to the host (systemd-creds, a shell): both at once, off the wake's critical path. A key
    # sealed at the park is used as it is when the launch has no other secret file.
    secret_files = plan.secret_file_contents(key)
    if presealed is not None and not secret_files:
        sealing = _sealed_already(presealed)
    else:
        sealing = ctl.launch_credentials_on(host, name, key, secret_files)
    (credentials, encrypted), confined = await asyncio.gather(
        sealing, ctl.engine_confinement(host, name, engine_location(engine), resolved.path, devices))
    timeline.lap(CREDENTIALS)
    environment = {**confined.environment, **plan.environment, **gpu_order_environment(gpu_indices), **spec.env}
    cpu = cpu_fields(spec, cores)
    unit = TransientUnit(
        name=deployment.unit, description=unit_description(name, revision, engine.type, phase), gated=gated,
        argv=plan.argv, environment=environment,
        credentials=credentials, encrypted_credentials=encrypted,
        credential_environment=plan.credential_environment(), **confined.unit_fields(),
        working_directory="/",  # engines need no cwd; state_dir may sit under a PrivateTmp path
        memory_max=spec.resources.ram, memory_high=None,
        **cpu, tasks_max=spec.resources.tasks_max,
        devices=devices,
        runtime_directory=engine_socket_runtime_directory(name) if plan.socket_path else None,
        private_network=plan.socket_path is not None,
        markers={"deployment": name, "revision": str(revision), "launch": launch_id,
                 "port": str(port), **({"socket": plan.socket_path} if plan.socket_path else {}),
                 # The CPUs it is pinned to: a daemon that adopts the unit keeps them in its ledger.
                 **({"cpus": cpu["allowed_cpus"]} if cpu["allowed_cpus"] else {}),
                 **({"gate": "armed"} if gated else {})})
    return PreparedUnit(
        unit=unit, launch_id=launch_id, port=port, key=key, model_path=resolved.path,
        model_revision=resolved.revision, socket_path=plan.socket_path,
        capabilities=adapter.capabilities(engine, deployment=spec, model_path=resolved.path),
        served_model=plan.served_model,
        launch_command={"argv": list(plan.argv), "environment": {**plan.environment, **spec.env}},
        secret_files=sorted(plan.secret_files))


async def preseal(ctl: DeploymentServices, host: str, name: str) -> Presealed:
    """Seal a next launch's key now (raises OSError or CapyError where it cannot)."""
    key = new_engine_key()
    credentials, encrypted = await ctl.launch_credentials_on(host, name, key, {})
    return Presealed(host, key, credentials, encrypted)


async def wait_healthy(adapter: Any, http: Any, base_url: str, key: str | None, *, exited: asyncio.Event,
                       exit_error: Callable[[], CapyError], timeout: float, progress: Progress) -> None:
    """Until the engine answers its health check; ``exit_error()`` is raised once ``exited`` is
    set (its unit is gone), asyncio.TimeoutError after ``timeout`` seconds."""
    began = time.monotonic()
    last_note = began
    delay = HEALTH_POLL_S
    while True:
        if exited.is_set():
            raise exit_error()
        try:
            if await adapter.health(http, base_url, key):
                return
        except CapyError as exc:
            if not is_shortage(exc):  # (the daemon's descriptor shortage, logged: not an answer; poll on)
                raise
        now = time.monotonic()
        if now - began > timeout:
            raise asyncio.TimeoutError
        if now - last_note >= 5:
            progress(f"waiting for the engine's health check ({now - began:.0f}s)")
            last_note = now
        # The exit watcher wakes this loop at once. A loopback health probe is cheap, so poll
        # often while a wake is young, as a script starting the engine by hand would (half an
        # interval is added to each wake on average; benchmarks/wake_vs_manual.py measured a
        # slower poll's cost), and back off only for long loads of big models.
        try:
            await asyncio.wait_for(exited.wait(), timeout=delay)
        except asyncio.TimeoutError:
            pass
        if now - began > 2:
            delay = max(delay, 0.05)
        if now - began > 30:
            delay = min(delay * 1.5, 0.5)
