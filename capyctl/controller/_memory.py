"""Bridge between the controller's actors and the pure scheduler (capyctl.scheduler).

The ledger is kept in step with every actor's state (``observe``); ``plan`` asks the planner
who must make room; ``charge`` records the plan once the victims are out of the way.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..config import DaemonConfig
from ..scheduler import Candidate, Footprint, GpuCard, HostResources, Ledger, Plan, Request
from ..scheduler import plan as plan_placement
from ..spec import parse_size

if TYPE_CHECKING:
    from ._actor import DeploymentActor

LOCAL = "local"


def _ram_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _model_size(actor: "DeploymentActor") -> int:
    path = actor.model_path or getattr(actor.spec.model, "path", None)
    try:
        if path and os.path.isfile(path):
            return os.path.getsize(path)
        if path and os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    except OSError:
        pass
    return 0


def footprint(actor: "DeploymentActor") -> Footprint:
    """What the deployment needs: its manifest's budgets, else an estimate from the model's size."""
    spec = actor.spec
    size = _model_size(actor)
    # Weights plus KV cache and runtime: measured 177 MB RSS for a 98 MB GGUF at -c 2048.
    ram = spec.resources.ram or int(size * 1.5) + (128 << 20)
    in_place = spec.park == "auto" and actor.controller.adapter(spec).park_method(spec) == "in_place"
    # vLLM sleep level 1 keeps the weights in host RAM; level 2 and SGLang's release keep nothing.
    parked_ram = (size if spec.park_level == 1 else 0) if in_place else None
    gpus = spec.gpus_needed
    return Footprint(gpus=gpus, gpu_memory=spec.resources.gpu_memory if gpus else None, ram=ram,
                     parked_ram=parked_ram)


def _local_gpus() -> tuple[GpuCard, ...]:
    """This host's cards from NVML; none on a host without NVML (a CPU host)."""
    from ..hosts import host_inventory
    return host_inventory().resources().gpus


class MemoryPlanner:
    def __init__(self, config: DaemonConfig, local_gpus: "tuple[GpuCard, ...] | None" = None) -> None:
        budget = os.environ.get("CAPYCTL_RAM_BUDGET")
        ram_total = parse_size(budget) if budget else _ram_total()
        reserve = 0 if budget else config.host_ram_reserve
        gpus = _local_gpus() if local_gpus is None else tuple(local_gpus)
        self.ledger = Ledger([HostResources(name=LOCAL, ram_total=ram_total, ram_reserve=reserve, gpus=gpus)])
        self._last_plan: tuple[Plan, Request] | None = None

    def set_host(self, name: str, resources: HostResources) -> None:
        """Budget a (remote) host from its inventory; ``resources.name`` is ignored for ``name``."""
        self.ledger.add_host(HostResources(name, resources.ram_total, resources.ram_reserve, resources.gpus))

    def plan(self, actor: "DeploymentActor", actors: list["DeploymentActor"], now: float,
             hosts: tuple[str, ...] = (LOCAL,)):
        """Victims to evict before ``actor`` can start on one of ``hosts``: [(actor, "park" | "stop")].
        Raises NoRoom. ``planned_host`` tells where the plan puts it."""
        if actor.spec.nodes > 1:
            return []
        for other in actors:
            self.observe(other)
        hosts = tuple(h for h in hosts if h in self.ledger.hosts) or hosts
        request = Request(actor.name, footprint(actor), hosts=hosts)
        candidates = [Candidate(a.name, a.state, a.last_used, busy=a.busy or not a._commands.empty(),
                                never_evict=a.spec.park == "never", idle_park_after=a.spec.idle_park_after)
                      for a in actors if a is not actor and self.ledger.get(a.name) is not None]
        result = plan_placement(request, self.ledger, candidates, now)
        self._last_plan = (result, request)
        by_name = {a.name: a for a in actors}
        return [(by_name[v.deployment], v.action) for v in result.victims]

    def planned_host(self, actor: "DeploymentActor") -> str | None:
        if self._last_plan and self._last_plan[0].deployment == actor.name:
            return self._last_plan[0].host
        return None

    def gpus_for(self, actor: "DeploymentActor") -> tuple[int, ...]:
        """The card indices the ledger placed ``actor`` on (empty for a CPU deployment)."""
        placed = self.ledger.get(actor.name)
        return placed.gpus if placed is not None else ()

    def charge(self, actor: "DeploymentActor") -> None:
        if actor.spec.nodes > 1:
            return
        if self._last_plan and self._last_plan[0].deployment == actor.name:
            plan, request = self._last_plan
            self.ledger.apply(plan, request)
        self._last_plan = None

    def observe(self, actor: "DeploymentActor") -> None:
        """Keep the ledger's state of ``actor`` equal to the actor's."""
        if actor.spec.nodes > 1:
            return  # multi-node groups are placed by their manifest's hosts, not budgeted here
        placed = self.ledger.get(actor.name)
        state = actor.state
        if placed is None:
            if state in ("stopped", "failed") or (state == "parked" and not actor.parked_in_place):
                return
            if actor.host not in self.ledger.hosts:
                return  # a host not budgeted (yet): nothing to charge it on
            self.ledger.place(actor.name, footprint(actor), actor.host, (), state,
                              in_place=actor.parked_in_place if state == "parked" else None)
            return
        if placed.state != state or (state == "parked" and placed.in_place != actor.parked_in_place):
            self.ledger.set_state(actor.name, state, in_place=actor.parked_in_place if state == "parked" else None)
        if state in ("stopped", "failed") or (state == "parked" and not actor.parked_in_place):
            # The unit is gone (stop_unit waits for it), so its memory is free again.
            self.ledger.confirm_released(actor.name)

    def forget(self, name: str) -> None:
        self.ledger.forget(name)
        self.ledger.confirm_released(name)
