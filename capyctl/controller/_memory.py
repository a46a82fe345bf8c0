"""Bridge between the controller's actors and the pure scheduler (capyctl.scheduler)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..config import DaemonConfig

if TYPE_CHECKING:
    from ._actor import DeploymentActor


def _ram_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def footprint_ram(actor: "DeploymentActor") -> int:
    """RAM a CPU deployment needs: its manifest's budget, else an estimate from the model file."""
    if actor.spec.resources.ram:
        return actor.spec.resources.ram
    path = actor.model_path or getattr(actor.spec.model, "path", None)
    try:
        size = os.path.getsize(path) if path and os.path.isfile(path) else 0
    except OSError:
        size = 0
    # Weights plus KV cache and runtime: measured 177 MB RSS for a 98 MB GGUF at -c 2048.
    return int(size * 1.5) + (128 << 20)


class MemoryPlanner:
    def __init__(self, config: DaemonConfig) -> None:
        budget = os.environ.get("CAPYCTL_RAM_BUDGET")
        from ..spec import parse_size
        self.ram_capacity = parse_size(budget) if budget else max(_ram_total() - config.host_ram_reserve, 0)

    def plan(self, actor: "DeploymentActor", actors: list["DeploymentActor"], now: float):
        from ._actor import READY
        held = {a.name: footprint_ram(a) for a in actors if a is not actor and self._holds(a)}
        need = footprint_ram(actor)
        free = self.ram_capacity - sum(held.values())
        if need <= free:
            return []
        idle = sorted((a for a in actors if a is not actor and a.state == READY and not a.busy
                       and a.spec.park != "never" and a._commands.empty()), key=lambda a: a.last_used)
        victims = []
        for victim in idle:
            victims.append((victim, "stop" if not victim.parked_in_place else "park"))
            free += held.get(victim.name, 0)
            if need <= free:
                return [(v, "park") for v, _ in victims]
        from ..errors import Unavailable
        raise Unavailable(f"{actor.name!r} needs {need >> 20} MiB of RAM; {max(free, 0) >> 20} MiB can be freed",
                          code="no_room")

    @staticmethod
    def _holds(actor: "DeploymentActor") -> bool:
        from ._actor import RUNNING_STATES
        return actor.state in RUNNING_STATES or actor.state == "stopping"

    def charge(self, actor: "DeploymentActor") -> None:
        pass

    def observe(self, actor: "DeploymentActor") -> None:
        pass

    def forget(self, name: str) -> None:
        pass
