"""Where CapyCTL keeps things, resolved once from the environment.

The system service uses the FHS paths; ``CAPYCTL_STATE_DIR`` and
``CAPYCTL_RUNTIME_DIR`` move them (tests, a user's own instance).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_STATE_DIR = "/var/lib/capyctl"
DEFAULT_RUNTIME_DIR = "/run/capyctl"
DEFAULT_LISTEN = "127.0.0.1:8000"
UNIT_PREFIX = "capyctl-"
SLICE = "capyctl.slice"
# Hosts with at least this many cores keep one for the daemon by default (cpu_reserve).
SMALL_HOST_CORES = 4
# CPUWeight= of every engine unit: half systemd's default of 100, which the daemon's own unit
# has (capyctl.slice has the same weight against system.slice: units/capyctl.slice), so that
# under contention for a CPU the daemon and its proxy get twice the engines' share.
ENGINE_CPU_WEIGHT = 50
# Request bodies held in memory at once across the daemon (bodies.memory_max: capyctl/bodies.py).
BODIES_MEMORY_MAX_DEFAULT = 256 << 20


@dataclass(frozen=True)
class Paths:
    state_dir: Path
    runtime_dir: Path

    @property
    def database(self) -> Path:
        return self.state_dir / "state.db"

    @property
    def api_socket(self) -> Path:
        return self.runtime_dir / "api.sock"

    @property
    def models_dir(self) -> Path:
        return self.state_dir / "models"

    @property
    def secrets_dir(self) -> Path:
        """0700 directory with one 0600 environment file per engine launch (its per-launch key)."""
        return self.state_dir / "secrets"

    @property
    def credentials_dir(self) -> Path:
        """0700 directory with the admin token and the operator key (0600 each)."""
        return self.state_dir / "credentials"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Paths":
        env = os.environ if env is None else env
        return cls(
            state_dir=Path(env.get("CAPYCTL_STATE_DIR", DEFAULT_STATE_DIR)),
            runtime_dir=Path(env.get("CAPYCTL_RUNTIME_DIR", DEFAULT_RUNTIME_DIR)),
        )


@dataclass
class DaemonConfig:
    """What ``capyctl start standalone`` and the system service run with."""

    paths: Paths = field(default_factory=Paths.from_env)
    listen: str = DEFAULT_LISTEN
    # D-Bus address of the system bus to drive; None means the default system bus.
    bus_address: str | None = None
    admin_token: str | None = None
    queue_per_deployment: int = 64
    queue_total: int = 256
    # Deployments that cannot be resident together take turns (controller/_room.py): a resident one
    # stops taking new requests once another has waited swap_quantum seconds for its room; no
    # deployment waits for room longer than swap_wait_max; "batches" or "arrival" (config_file.SwapConfig).
    swap_quantum: float = 5.0
    swap_wait_max: float = 30.0
    swap_order: str = "batches"
    # Bytes of request bodies held in memory at once, daemon-wide (capyctl/bodies.py).
    bodies_memory_max: int = BODIES_MEMORY_MAX_DEFAULT
    # SSE comment lines to a streamed request while it waits for room or a wake.
    wait_progress: bool = True
    # RAM kept free for the host itself when CPU deployments are budgeted.
    host_ram_reserve: int = 1 << 30
    # Or, instead, the RAM CapyCTL may budget on each host (the rest is the reserve); None: unset.
    host_ram_budget: int | None = None
    # Cores kept for the daemon, its proxy and the host, never given to an engine (the first
    # ones); None: cpu_reserve_for's default.
    host_cpu_reserve: int | None = None
    # Idle-park for deployments whose manifest sets no idle_park_after; None: only to make room.
    idle_park_after: float | None = None
    log_level: str = "info"
    # None: <state>/credentials/admin.token.
    admin_token_file: Path | None = None
    # Where the settings came from (capyctl/config_file.py), so a reload (SIGHUP) reads it again.
    config_path: Path | None = None
    config_required: bool = False
    file: Any = None  # the ConfigFile last applied; None: built without a file (tests)
    overrides: Any = None  # the flags and environment that win over the file

    def ram_reserve_for(self, ram_total: int) -> int:
        """RAM kept for a host with ``ram_total`` bytes: the budget's complement when one is set."""
        if self.host_ram_budget is not None and ram_total:
            return max(0, ram_total - self.host_ram_budget)
        return self.host_ram_reserve

    def cpu_reserve_for(self, cores: int) -> int:
        """Cores kept out of the plan on a host with ``cores`` of them. By default one from
        SMALL_HOST_CORES up, none below: on a small host a core kept idle for the daemon would
        cost a large share of what engines could use, and there the daemon keeps its share by
        CPU weight instead (ENGINE_CPU_WEIGHT). Never all of them."""
        wanted = self.host_cpu_reserve if self.host_cpu_reserve is not None else int(cores >= SMALL_HOST_CORES)
        return max(0, min(wanted, cores - 1))

    def dev_controls(self, host: str) -> bool:
        """Whether ``host`` allows engine development controls (the file's hosts.<name>.dev_controls)."""
        return True if self.file is None else self.file.dev_controls(host)


def unit_name(deployment: str) -> str:
    return f"{UNIT_PREFIX}{deployment}.service"


# A deployment's replicas (manifest `replicas`): the first is the deployment itself, the others
# `<name>@<k>` (units capyctl-<name>@<k>.service, found with `systemctl status 'capyctl-<name>*'`).
# Deployment names never hold '@' (spec NAME_PATTERN), so no replica name is another deployment's.
REPLICA_MARK = "@"


def replica_name(deployment: str, index: int) -> str:
    """The name of ``deployment``'s replica ``index`` (1-based): its actor, unit, port and ledger charge."""
    return deployment if index == 1 else f"{deployment}{REPLICA_MARK}{index}"


def replica_of(name: str) -> tuple[str, int]:
    """(deployment, replica index) of a replica's name; a deployment's own name is its replica 1."""
    deployment, mark, index = name.partition(REPLICA_MARK)
    return (deployment, int(index)) if mark and index.isdigit() else (name, 1)


# Engines that serve on a unix socket do so in their unit's RuntimeDirectory=, which systemd
# creates 0700 for the unit's user at start and removes at stop: /run/capyctl-engine/<name>.
ENGINE_RUNTIME_PARENT = "capyctl-engine"


def engine_socket_runtime_directory(deployment: str) -> str:
    """The unit's RuntimeDirectory= (relative to /run) that holds its engine socket."""
    return f"{ENGINE_RUNTIME_PARENT}/{deployment}"


def engine_socket_path(deployment: str) -> str:
    # A name of at most 63 characters keeps this under the 108 bytes of sockaddr_un.sun_path.
    return f"/run/{engine_socket_runtime_directory(deployment)}/engine.sock"


def engine_credentials_dir(unit: str) -> str:
    """Where systemd puts a unit's credentials (LoadCredential=) for its processes: a directory
    of its own, readable only by the unit's user (systemd.exec(5), "Credentials")."""
    return f"/run/credentials/{unit}"


def deployment_from_unit(unit: str) -> str | None:
    if unit.startswith(UNIT_PREFIX) and unit.endswith(".service"):
        return unit[len(UNIT_PREFIX):-len(".service")]
    return None
