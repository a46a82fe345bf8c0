"""The scheduler's data classes: memory domains, footprints, requests, candidates and plans.

Every size is in bytes and every time is in seconds on one clock the caller chooses
(the scheduler never reads a clock: ``now`` and ``last_used`` come from the caller).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from ..errors import CapyError

State = Literal["stopped", "starting", "ready", "parking", "parked", "waking", "stopping", "failed"]
STATES: tuple[str, ...] = ("stopped", "starting", "ready", "parking", "parked", "waking", "stopping", "failed")
# A deployment in one of these states holds (or is about to hold, or has not yet released) its whole
# footprint. "stopping" is here too: until the unit is gone its memory is still in use.
FULL_STATES = frozenset({"starting", "ready", "parking", "waking", "stopping"})

Action = Literal["park", "stop"]


def gpu_domain(host: str, index: int) -> str:
    """The id of one GPU's memory: ``gpu:<host>:<index>``."""
    return f"gpu:{host}:{index}"


def ram_domain(host: str) -> str:
    """The id of one host's RAM: ``ram:<host>``."""
    return f"ram:{host}"


def cpu_domain(host: str) -> str:
    """The id of one host's cores: ``cpu:<host>`` (its capacity and charges count whole cores)."""
    return f"cpu:{host}"


# A core: the CPU ids of its hardware threads (one id without SMT), as the kernel lists them.
Core = tuple[int, ...]


def format_size(size: int) -> str:
    """Bytes as people read them in an error sentence (``7.5 GiB``, ``512 MiB``)."""
    negative = size < 0
    value = float(abs(size))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            text = f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.1f} {unit}"
            return f"-{text}" if negative else text
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class GpuCard:
    """One GPU of a host as the scheduler sees it. Cards with the same ``model`` and
    ``memory_total`` are identical and may serve together one multi-GPU deployment."""

    index: int
    model: str
    memory_total: int


@dataclass(frozen=True)
class HostResources:
    """A host's memory and cores: its GPUs, its RAM and the cores CapyCTL may place engines on.
    ``ram_reserve`` is kept for the host itself, so the RAM domain's capacity is
    ``ram_total - ram_reserve``; likewise the first ``core_reserve`` of ``cores`` are kept for the
    daemon, its proxy and the host, and never given to an engine. A host whose ``cores`` are
    unknown (empty) has no core domain: its deployments' cores are not planned there."""

    name: str
    ram_total: int
    ram_reserve: int = 0
    gpus: tuple[GpuCard, ...] = ()
    cores: tuple[Core, ...] = ()
    core_reserve: int = 0

    @property
    def placeable_cores(self) -> tuple[Core, ...]:
        return self.cores[self.core_reserve:]


@dataclass(frozen=True)
class Domain:
    """One pool the ledger budgets: a GPU's memory (``kind="gpu"``), a host's RAM (``kind="ram"``),
    both in bytes, or a host's cores (``kind="cpu"``), counted in whole cores."""

    id: str
    kind: Literal["gpu", "ram", "cpu"]
    host: str
    capacity: int
    index: int | None = None  # GPU index on its host; None for RAM
    model: str | None = None  # GPU model name; None for RAM

    @property
    def card_type(self) -> tuple[str | None, int]:
        """What makes two GPUs identical: same model name, same total memory."""
        return (self.model, self.capacity)


@dataclass(frozen=True)
class Footprint:
    """The memory one deployment needs.

    ``gpus`` identical cards with ``gpu_memory`` bytes on each (None: the whole card, an exclusive
    use), and ``ram`` bytes of host RAM while it runs. ``parked_ram`` is the host RAM its weights
    need when parked in place (vLLM sleep level 1; 0 for sleep level 2 or SGLang's release, which
    keep the process but not the weights); None means it cannot park in place and parking it stops it.
    ``cores`` whole cores of its own while its process lives (running, or parked in place); 0: its
    cores are not planned and it runs on any core.
    """

    gpus: int = 0
    gpu_memory: int | None = None
    ram: int = 0
    parked_ram: int | None = None
    cores: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 0 or self.ram < 0 or self.cores < 0 or (self.gpu_memory is not None and self.gpu_memory < 0) \
                or (self.parked_ram is not None and self.parked_ram < 0):
            raise CapyError("a footprint cannot hold a negative amount of memory, GPUs or cores",
                            code="invalid_footprint", status=400)

    @property
    def parks_in_place(self) -> bool:
        return self.parked_ram is not None

    def gpu_need(self, card_capacity: int) -> int:
        """Bytes this footprint takes on one of its cards."""
        return card_capacity if self.gpu_memory is None else self.gpu_memory


@dataclass(frozen=True)
class Request:
    """"Wake or start ``deployment``": its footprint and the hosts it may run on (None: any).

    ``siblings`` are the ledger names of the other replicas of the same deployment: the planner
    spreads replicas over cards and hosts and never evicts one to make room for another."""

    deployment: str
    footprint: Footprint
    hosts: tuple[str, ...] | None = None
    siblings: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Candidate:
    """What the controller knows about another deployment's activity.

    ``state`` must match the ledger's (the planner checks). ``busy`` means requests in flight
    or queued: a busy deployment is never a victim, and neither is one with ``never_evict``
    (manifest ``park: never``). ``idle_park_after`` (seconds, None: never by idleness) is read by
    ``idle_to_park`` only. Deployments the ledger knows but the candidates omit are never victims.
    """

    deployment: str
    state: str
    last_used: float
    busy: bool = False
    never_evict: bool = False
    idle_park_after: float | None = None
    # How long its latest wake took (the park record's wake_seconds); the planner evicts the
    # deployments that come back cheaply first (planner.wake_cost_class). None: not measured.
    wake_seconds: float | None = None


class Victim(NamedTuple):
    """One deployment to evict before the plan's deployment starts: park it in place or stop it."""

    deployment: str
    action: Action


@dataclass(frozen=True)
class Plan:
    """Where ``deployment`` goes (``host`` and its ``gpus`` card indices, empty for a CPU
    deployment) and who must make room first, in the order to evict them (least recently used first)."""

    deployment: str
    host: str
    gpus: tuple[int, ...]
    victims: tuple[Victim, ...] = field(default=())

    @property
    def domains(self) -> tuple[str, ...]:
        """The memory domains the deployment will be charged on (its cores' domain aside)."""
        return tuple(gpu_domain(self.host, i) for i in self.gpus) + (ram_domain(self.host),)


def format_amount(domain: str, amount: int) -> str:
    """An amount charged on ``domain`` as people read it: bytes, or cores on a ``cpu:`` domain."""
    if domain.startswith("cpu:"):
        return f"{amount} core" + ("" if amount == 1 else "s")
    return format_size(amount)


class NoRoom(CapyError):
    """No host has room for a deployment even after evicting every deployment that may be evicted."""

    code = "no_room"
    status = 503
