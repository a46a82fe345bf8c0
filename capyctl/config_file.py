"""The daemon's configuration file, ``/etc/capyctl/config.yaml``.

Precedence, highest first: a command-line flag, an environment variable, this file, the
built-in default. The file is optional: a missing default file means the defaults; a file
named by ``--config`` or ``CAPYCTL_CONFIG`` must exist. Unknown keys and bad values are
errors that name the file, the field and the line (the manifest loader's machinery).

``systemctl reload capyctl`` (SIGHUP) reads the file again: what can change live is applied
at once (``LIVE_FIELDS``), what needs a restart is logged and reported, and a broken file is
refused whole, the running daemon keeping its old configuration.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .config import BODIES_MEMORY_MAX_DEFAULT, DEFAULT_LISTEN, DaemonConfig
from .spec._units import Duration, Size
from .spec.loader import ManifestError, Problem, _problems, load_yaml

DEFAULT_CONFIG_PATH = "/etc/capyctl/config.yaml"
CONFIG_ENV = "CAPYCTL_CONFIG"
MAX_CONFIG_BYTES = 1 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")

log = logging.getLogger("capyctl.config")


class ConfigError(ManifestError):
    """A configuration file that cannot be used; one line a problem, FILE:LINE: FIELD: message."""

    code = "invalid_config"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QueueConfig(_Strict):
    total: int = Field(default=256, ge=1, le=1_000_000,
                       description="Most requests waiting across all deployments; more get 429.")
    per_deployment: int = Field(default=64, ge=1, le=100_000,
                                description="Most requests waiting for one deployment, whatever its manifest's "
                                            "`queue` says (the smaller of the two applies); more get 429.")


class SwapConfig(_Strict):
    """How deployments that cannot be resident together take turns (docs/engines-and-parking.md)."""

    quantum: Duration = Field(default=5.0, ge=0, le=3600,
                              description="Once a deployment has waited this long for room held by busy ones, "
                                          "those stop taking new requests, finish what they have, and park.")
    wait_max: Duration = Field(default=30.0, gt=0, le=86_400,
                               description="Longest a deployment waits for room held by busy ones; past it its "
                                           "requests get 503 `room_wait_timeout` with Retry-After.")
    order: Literal["batches", "arrival"] = Field(
        default="batches", description="batches: a woken deployment serves every request queued for it before "
        "it yields; arrival: requests are served in arrival order, one swap each time the model changes "
        "(llama-swap's and Ollama's way; a baseline for benchmarks/contention.py).")


class DoorConfig(_Strict):
    """The proxy's client connections under hostile load (capyctl/proxy/_door.py, docs/security.md)."""

    head_timeout: Duration = Field(default=10.0, gt=0, le=3600,
                                   description="A request head must be whole this long after its connection "
                                   "opened, or after the first byte that follows the previous answer; past it the "
                                   "connection is answered 408 `request_head_timeout` and closed.")
    connections_max: int = Field(default=1024, ge=2, le=1_000_000,
                                 description="Most client connections open at once; past it 503 "
                                 "`too_many_connections`.")
    per_address_max: int = Field(default=256, ge=1, le=1_000_000,
                                 description="Most client connections open at once from one client address; past "
                                 "it that address gets 503 `too_many_connections_from_address`.")
    keyed_reserve: int = Field(default=256, ge=0, description="Of connections_max, the slots only ever held "
                               "by connections that carried a valid API key; connections without one give way "
                               "to newer connections rather than take them.")
    keepalive_timeout: Duration = Field(default=75.0, gt=0, le=86_400,
                                        description="An idle kept-alive client connection is closed after this "
                                        "long.")

    @model_validator(mode="after")
    def _reserve_under_cap(self) -> "DoorConfig":
        if self.keyed_reserve >= self.connections_max:
            raise ValueError(f"keyed_reserve ({self.keyed_reserve}) must be less than connections_max "
                             f"({self.connections_max})")
        return self


class BodiesConfig(_Strict):
    """Request bodies held in memory across the whole daemon (capyctl/bodies.py, docs/security.md)."""

    memory_max: Size = Field(default=BODIES_MEMORY_MAX_DEFAULT, ge=1 << 20, description="Most bytes of request "
                             "bodies held in memory at once, the proxy's (JSON bodies, the in-memory part of "
                             "uploads) and the management API's together; a request that finds no room is "
                             "refused at once with 503 `request_bodies_busy` and Retry-After.")


class HostConfig(_Strict):
    dev_controls: bool = Field(
        default=True, description="Allow engine development controls on this host (vLLM sleep mode, SGLang "
        "memory release, a custom engine's park call); false: its deployments park by stopping.")


class ConfigFile(_Strict):
    """What ``/etc/capyctl/config.yaml`` may hold. Every field is optional."""

    listen: str = Field(default=DEFAULT_LISTEN, description="HOST:PORT of the OpenAI endpoint when the daemon "
                        "binds it itself (`capyctl start standalone`); the packaged service listens where "
                        "capyctl.socket says.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info")
    ram_reserve: Size | None = Field(default=None, description="Host RAM kept free for the host itself "
                                     "(default 1GiB); CapyCTL budgets the rest. Not with ram_budget.")
    ram_budget: Size | None = Field(default=None, description="Host RAM CapyCTL may budget for deployments; "
                                    "the rest is kept for the host. Not with ram_reserve.")
    cpu_reserve: int | None = Field(default=None, ge=0, description="Cores kept for the daemon, its proxy and "
                                    "the host, never given to an engine (the first ones the daemon may run on; "
                                    "always at least one core is left to engines). Default: 1 on a host with 4 "
                                    "or more cores, 0 below (see docs/engines-and-parking.md, Cores on CPU hosts).")
    queue: QueueConfig = Field(default_factory=QueueConfig)
    swap: SwapConfig = Field(default_factory=SwapConfig)
    door: DoorConfig = Field(default_factory=DoorConfig)
    bodies: BodiesConfig = Field(default_factory=BodiesConfig)
    wait_progress: bool = Field(default=True, description="A streamed request that waits for room or a wake gets "
                                "SSE comment lines (`: waking NAME: ...`) at most every second until the engine "
                                "answers; false: it waits silently, as a non-streamed request does.")
    idle_park_after: Duration | None = Field(default=None, description="Park a deployment after this long "
                                             "without a request when its manifest sets no idle_park_after.")
    admin_token_file: Path | None = Field(default=None, description="File holding the admin token (created "
                                          "0600 if missing); default <state>/credentials/admin.token.")
    hosts: dict[str, HostConfig] = Field(default_factory=dict, description="Per host (\"local\" for this "
                                         "one, or a name from `capyctl host add`): its settings.")

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"must be HOST:PORT, such as 127.0.0.1:8000, not {value!r}")
        return value

    @field_validator("admin_token_file")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"must be an absolute path, not {str(value)!r}")
        return value

    @model_validator(mode="after")
    def _one_ram_setting(self) -> "ConfigFile":
        if self.ram_reserve is not None and self.ram_budget is not None:
            raise ValueError("give ram_reserve or ram_budget, not both")
        return self

    def dev_controls(self, host: str) -> bool:
        entry = self.hosts.get(host)
        return True if entry is None else entry.dev_controls


# Fields a reload applies to the running daemon; any other change is reported as needing a restart.
LIVE_FIELDS = ("log_level", "ram_reserve", "ram_budget", "cpu_reserve", "queue", "swap", "wait_progress",
               "idle_park_after", "hosts", "bodies")
RESTART_FIELDS = ("listen", "admin_token_file", "door")


def parse_config(text: str, source: str) -> ConfigFile:
    root, data = load_yaml(text, source, max_bytes=MAX_CONFIG_BYTES, error=ConfigError)
    if data is None:
        return ConfigFile()  # an empty file (or only comments) means the defaults
    if not isinstance(data, dict):
        line = root.start_mark.line + 1 if root is not None else None
        raise ConfigError(source, [Problem("", line, f"must be a mapping of settings, got a {type(data).__name__}")])
    try:
        return ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, _problems(exc, root)) from None


def config_path(flag: str | None = None, env: dict[str, str] | None = None) -> tuple[Path, bool]:
    """The file to read and whether it was asked for (a flag or CAPYCTL_CONFIG) rather than the default."""
    env = os.environ if env is None else env
    if flag:
        return Path(flag), True
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]), True
    return Path(DEFAULT_CONFIG_PATH), False


def load_config(path: Path, *, required: bool) -> ConfigFile:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise ConfigError(str(path), [Problem("", None, "no such file")]) from None
        return ConfigFile()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), [Problem("", None, f"cannot be read: {exc}")]) from None
    return parse_config(text, str(path))


@dataclass
class Overrides:
    """What flags and the environment set, each winning over the file."""

    listen: str | None = None
    log_level: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, *, listen: str | None = None) -> "Overrides":
        env = os.environ if env is None else env
        return cls(listen=listen or env.get("CAPYCTL_LISTEN") or None,
                   log_level=(env.get("CAPYCTL_LOG_LEVEL") or "").lower() or None)


def apply(config: DaemonConfig, file: ConfigFile, overrides: Overrides) -> None:
    """Set ``config`` from the file and the overrides (in place: the controller reads it live)."""
    config.file = file
    config.listen = overrides.listen or file.listen
    config.log_level = overrides.log_level or file.log_level
    config.queue_total = file.queue.total
    config.queue_per_deployment = file.queue.per_deployment
    config.swap_quantum = file.swap.quantum
    config.swap_wait_max = file.swap.wait_max
    config.swap_order = file.swap.order
    config.bodies_memory_max = file.bodies.memory_max
    config.wait_progress = file.wait_progress
    config.host_ram_reserve = file.ram_reserve if file.ram_reserve is not None else DaemonConfig.host_ram_reserve
    config.host_ram_budget = file.ram_budget
    config.host_cpu_reserve = file.cpu_reserve
    config.idle_park_after = file.idle_park_after
    config.admin_token_file = file.admin_token_file


def build_config(*, path: Path, required: bool, overrides: Overrides, bus_address: str | None = None) -> DaemonConfig:
    file = load_config(path, required=required)
    config = DaemonConfig(bus_address=bus_address)
    config.config_path = path
    config.config_required = required
    config.overrides = overrides
    apply(config, file, overrides)
    return config


def changes(old: ConfigFile, new: ConfigFile) -> tuple[list[str], list[str]]:
    """(fields applied live, fields that need a restart) between two files."""
    live = [f for f in LIVE_FIELDS if getattr(old, f) != getattr(new, f)]
    restart = [f for f in RESTART_FIELDS if getattr(old, f) != getattr(new, f)]
    return live, restart


def set_log_level(level: str) -> None:
    logging.getLogger().setLevel(level.upper())
