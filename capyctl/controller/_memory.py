"""Bridge between the controller's actors and the pure scheduler (capyctl.scheduler).

The ledger is kept in step with every actor's state (``observe``); ``plan`` asks the planner
who must make room; ``charge`` records the plan once the victims are out of the way.

What a deployment is charged: its manifest's ``resources``, else an estimate from its model
(weights, KV cache at its context, the engine's buffers), corrected once it is ready by what
was measured (``measure``: NVML's per-process GPU memory of the unit's processes, the unit's
cgroup memory for RAM). GPU memory a stopped deployment held stays charged (pending release)
until NVML shows no process of it on the card (``refresh_gpus``): drivers free memory some time
after a process exits, and a start on memory that is not free yet fails.

Cores are planned as memory is (scheduler: the ``cpu:<host>`` domain): a deployment's manifest
``resources.cpus``, else, for a CPU deployment, its engine's default from the model
(``default_cores``), at most the most cores a host offers; the ledger says which cores it holds
(``cores_for``), its unit is pinned to them and its engine's threads follow them.

A multi-node group is budgeted per member: ``<name>#rank<r>`` is placed on the member's host
with the per-node footprint (tensor_parallel / nodes cards), and its cards are what that
member's unit is given.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
from dataclasses import asdict, replace
from typing import Any, Iterable

from ..config import ENGINE_CPU_WEIGHT, DaemonConfig
from ..engines._base import flag_value
from ..errors import CapyError
from ..scheduler import (Candidate, Core, Footprint, GpuCard, HostResources, Ledger, Plan, Request, gpu_domain,
                         ram_domain)
from ..scheduler import plan as plan_placement
from ..scheduler import plan_when_idle
from ..spec import parse_size

from ._lifecycle import DeploymentState
from ._services import PlacedDeployment

log = logging.getLogger("capyctl.controller")

LOCAL = "local"

# vLLM checks at start that the card's free memory covers ceil(total * --gpu-memory-utilization)
# (request_memory, vllm/v1/worker/utils.py, 0.32.0), measured once its own CUDA context exists:
# that context counts twice in the check. So the fraction leaves it out of the budget (at most
# an eighth of the budget), then rounds down to a thousandth: two deployments whose budgets add
# up to a card start one after the other.
STARTUP_HEADROOM = 512 << 20
# vLLM / SGLang besides weights and KV cache: CUDA context, activations of the profiling batch,
# CUDA graphs, NCCL buffers.
ENGINE_OVERHEAD = 2 << 30
# What a measurement is rounded up by: an engine's use grows a little with traffic (RAM more).
GPU_MEASURE_MARGIN = 1.02
RAM_MEASURE_MARGIN = 1.10
RAM_MEASURE_SLACK = 64 << 20
_PREALLOCATING = ("vllm", "sglang", "tensorfold")


def _ram_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _model_path(actor: PlacedDeployment) -> str | None:
    return actor.model_path or getattr(actor.spec.model, "path", None)


def _model_size(actor: PlacedDeployment) -> int:
    path = _model_path(actor)
    try:
        if path and os.path.isfile(path):
            return os.path.getsize(path)
        if path and os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    except OSError:
        pass
    return 0


def _hf_kv_bytes_per_token(model_dir: str) -> int | None:
    """K+V bytes per token over all layers, from a Hugging Face config.json (16-bit cache)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return 2 * layers * kv_heads * head_dim * 2


def _hf_context(model_dir: str, args: list[str]) -> int:
    # vLLM --max-model-len, SGLang --context-length; else the model's own maximum.
    given = flag_value(args, "--max-model-len", "--context-length")
    if given:
        # vLLM reads "32k" as 32,000 and "32K" as 32,768 (human_readable_int, vllm/utils/argparse_utils.py).
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?)", given.strip())
        if match:
            number, suffix = match.groups()
            scale = {"": 1, "k": 10**3, "m": 10**6, "K": 2**10, "M": 2**20}[suffix]
            if int(float(number) * scale) > 0:
                return int(float(number) * scale)
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        return int(config.get("max_position_embeddings") or 4096)
    except (OSError, ValueError, TypeError, AttributeError):
        return 4096


def estimate_gpu_memory(actor: PlacedDeployment) -> int | None:
    """Bytes on each of the deployment's cards when its manifest gives no ``gpu_memory``: the
    weights and KV cache at its context split over its tensor-parallel ranks, plus the engine's
    buffers. None when the model is not on disk yet or the engine is unknown (a whole card)."""
    spec = actor.spec
    kind = getattr(actor.controller.adapter(spec), "kind", None)
    path = _model_path(actor)
    size = _model_size(actor)
    if not path or size <= 0:
        return None
    args = list(spec.engine_args)
    if kind == "llama.cpp":
        from ..engines._gpu_layers import context_size, gguf_layout
        from ..engines.llamacpp import DEFAULT_CONTEXT
        layout = gguf_layout(path)
        if layout is None:
            return None
        cards = max(1, spec.gpus_needed)
        return math.ceil(layout.full_offload(context_size(args, DEFAULT_CONTEXT, layout), cards) / cards)
    if kind in _PREALLOCATING and os.path.isdir(path):
        kv = _hf_kv_bytes_per_token(path)
        if kv is None:
            return None
        # Room for two sequences of the full context: vLLM refuses to start when its KV cache
        # cannot hold one (and serves one request at a time with exactly one).
        total = size + 2 * kv * _hf_context(path, args)
        return math.ceil(total / max(1, spec.tensor_parallel)) + ENGINE_OVERHEAD
    return None


def footprint(actor: PlacedDeployment, largest_card: int | None = None, most_cores: int | None = None) -> Footprint:
    """What the deployment needs on each host it runs on: its manifest's budgets, else estimates.
    A GPU estimate at least as large as ``largest_card`` asks for whole cards; an engine's default
    cores are at most ``most_cores`` (the manifest's are checked against the host at deploy time)."""
    spec = actor.spec
    size = _model_size(actor)
    adapter = actor.controller.adapter(spec)
    # Weights plus KV cache and runtime (measured 177 MB RSS for a 98 MB GGUF at -c 2048), and
    # the host-RAM prompt cache the engine was told it may fill (llama-server --cache-ram).
    ram = spec.resources.ram or int(size * 1.5) + (128 << 20) + adapter.prompt_cache_ram(spec, _model_path(actor))
    # The tier resolved against the actor's host (engines/_tiers.py): restart parks by stopping,
    # deep keeps nothing, host_backed what the engine says (vLLM level 1's and SGLang's CPU backup
    # of the weights; a custom engine's declared park).
    tier = getattr(actor, "park_tier", None)
    in_place = spec.park == "auto" and adapter.park_method(spec) == "in_place" and tier != "restart"
    parked_ram = (adapter.parked_host_bytes(spec, size) if tier in (None, "host_backed") else 0) if in_place else None
    gpus = spec.gpus_needed
    gpu_memory = spec.resources.gpu_memory if gpus else None
    if gpus and gpu_memory is None:
        gpu_memory = estimate_gpu_memory(actor)
        if gpu_memory is not None and largest_card is not None and gpu_memory >= largest_card:
            gpu_memory = None
    cores = spec.resources.cpus
    if cores is None:
        cores = (adapter.default_cores(spec, size) or 0) if not gpus else 0
        cores = min(cores, most_cores) if most_cores else cores
    return Footprint(gpus=gpus, gpu_memory=gpu_memory, ram=ram, parked_ram=parked_ram, cores=cores)


def gpu_memory_fraction(budget: int, card_total: int) -> float:
    """The share of a card's TOTAL memory to give an engine whose plan is ``budget`` bytes on it
    (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static): the budget less its startup
    headroom, rounded down to a thousandth (see STARTUP_HEADROOM)."""
    if card_total <= 0:
        raise CapyError("a GPU with no memory cannot hold a budget", code="invalid_gpu")
    usable = min(budget, card_total) - min(STARTUP_HEADROOM, budget // 8)
    return max(0.001, math.floor(usable * 1000 / card_total) / 1000)


def gpu_order_environment(gpu_indices: Iterable[int]) -> dict[str, str]:
    """CUDA numbers devices fastest first by default, NVML (and so the ledger, DeviceAllow and
    CUDA_VISIBLE_DEVICES here) by PCI bus: on a host with different cards the same index names
    different cards. CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA count as NVML does."""
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"} if list(gpu_indices) else {}


def cpu_fields(spec: Any, cores: tuple[Core, ...]) -> dict[str, Any]:
    """A unit's CPU settings (systemd.TransientUnit): pinned to every CPU of its planned cores
    (AllowedCPUs=, CPUAffinity=), or, where its cores are not planned, its manifest's cpus as a
    CPUQuota=; below the daemon's CPU weight either way."""
    from ..hosts import format_cpu_list
    if cores:
        return {"allowed_cpus": format_cpu_list(cpu for core in cores for cpu in core), "cpu_quota": None,
                "cpu_weight": ENGINE_CPU_WEIGHT}
    return {"allowed_cpus": None, "cpu_quota": spec.resources.cpus, "cpu_weight": ENGINE_CPU_WEIGHT}


def member_name(deployment: str, rank: int) -> str:
    """The ledger's name for one member of a multi-node group."""
    return f"{deployment}#rank{rank}"


def _local_gpus() -> tuple[GpuCard, ...]:
    """This host's cards from NVML; none on a host without NVML (a CPU host)."""
    from ..hosts import host_inventory
    return host_inventory().resources().gpus


def _local_cores() -> tuple[Core, ...]:
    """The cores this daemon may run on (and so place engines on): its affinity, by core."""
    from ..hosts import cores_of
    return tuple(cores_of(os.sched_getaffinity(0)))


def _stopped(actor: PlacedDeployment) -> bool:
    return actor.state in (DeploymentState.STOPPED, DeploymentState.FAILED) \
        or (actor.state == DeploymentState.PARKED and not actor.parked_in_place)


class MemoryPlanner:
    def __init__(self, config: DaemonConfig, local_gpus: "tuple[GpuCard, ...] | None" = None,
                 local_cores: "tuple[Core, ...] | None" = None) -> None:
        gpus = _local_gpus() if local_gpus is None else tuple(local_gpus)
        self._local_cores = _local_cores() if local_cores is None else tuple(local_cores)
        self._core_reserve: dict[str, int] = {}  # host -> cores kept out of the plan there
        self.ledger = Ledger()
        self._add_host(self._local_resources(config, gpus, self._local_cores))
        self._last_plan: tuple[str, list[tuple[Plan, Request]]] | None = None
        self._config = config
        self._adopted_cpus: dict[str, frozenset[int]] = {}  # deployment -> CPUs its adopted unit runs on

    @property
    def idle_park_default(self) -> float | None:
        return self._config.idle_park_after

    @staticmethod
    def _local_resources(config: DaemonConfig, gpus: "tuple[GpuCard, ...]",
                         cores: "tuple[Core, ...]") -> HostResources:
        # A budget (CAPYCTL_RAM_BUDGET, which wins, or the config file's ram_budget) is the RAM
        # CapyCTL may use whatever the host has; otherwise the host's RAM less the reserve.
        budget = os.environ.get("CAPYCTL_RAM_BUDGET")
        if budget:
            ram_total, ram_reserve = parse_size(budget), 0
        elif config.host_ram_budget is not None:
            ram_total, ram_reserve = config.host_ram_budget, 0
        else:
            ram_total, ram_reserve = _ram_total(), config.host_ram_reserve
        return HostResources(name=LOCAL, ram_total=ram_total, ram_reserve=ram_reserve, gpus=gpus, cores=cores,
                             core_reserve=config.cpu_reserve_for(len(cores)))

    def rebudget_local(self, config: DaemonConfig) -> None:
        """Apply a reloaded RAM or core reserve or RAM budget to this host; charges stay where they are."""
        gpus = tuple(GpuCard(d.index, d.model, d.capacity) for d in self.ledger.domains.values()
                     if d.kind == "gpu" and d.host == LOCAL)
        self._add_host(self._local_resources(config, gpus, self._local_cores))

    def set_host(self, name: str, resources: HostResources) -> None:
        """Budget a (remote) host from its inventory; ``resources.name`` is ignored for ``name``."""
        self._add_host(replace(resources, name=name))

    def _add_host(self, resources: HostResources) -> None:
        self.ledger.add_host(resources)
        self._core_reserve[resources.name] = min(resources.core_reserve, len(resources.cores))

    def footprint(self, actor: PlacedDeployment) -> Footprint:
        cards = [d.capacity for d in self.ledger.domains.values() if d.kind == "gpu"]
        cores = [d.capacity for d in self.ledger.domains.values() if d.kind == "cpu"]
        return footprint(actor, max(cards) if cards else None, max(cores) if cores else None)

    def host_cores(self, host: str) -> int | None:
        """How many cores engines may be given on ``host``; None where its cores are unknown."""
        return len(self.ledger.host_cores(host)) if host in self.ledger.hosts and self.ledger.host_cores(host) \
            else None

    # -- placement ------------------------------------------------------------------------------

    def plan(self, actor: PlacedDeployment, actors: list[PlacedDeployment], now: float,
             hosts: tuple[str, ...] = (LOCAL,)):
        """Victims to evict before ``actor`` can start on one of ``hosts``: [(actor, "park" | "stop")].
        A multi-node group places one member on each of its manifest's first ``nodes`` hosts.
        Raises NoRoom. ``planned_host`` tells where the plan puts it."""
        victims, plans = self._plan(actor, actors, now, hosts, plan_placement)
        self._last_plan = (actor.name, plans)
        return victims

    def yielders(self, actor: PlacedDeployment, actors: list[PlacedDeployment], now: float,
                 hosts: tuple[str, ...] = (LOCAL,)) -> list[PlacedDeployment]:
        """After ``plan`` found no room: who must yield it once idle (busy deployments, and those
        starting, waking or parking among them), as ``scheduler.plan_when_idle`` sees it. Raises
        NoRoom when waiting for them would not bring the room either. Records no plan."""
        victims, _ = self._plan(actor, actors, now, hosts, plan_when_idle)
        return [victim for victim, _action in victims]

    def _plan(self, actor: PlacedDeployment, actors: list[PlacedDeployment], now: float,
              hosts: tuple[str, ...], planner: Any) -> tuple[list, list[tuple[Plan, Request]]]:
        for other in actors:
            self.observe(other)
        fp = self.footprint(actor)
        candidates = [Candidate(a.name, a.state, a.last_used, busy=a.busy or a.has_pending_commands,
                                never_evict=a.spec.park == "never",
                                idle_park_after=a.spec.idle_park_after if a.spec.idle_park_after is not None
                                else self.idle_park_default,
                                wake_seconds=(getattr(a, "park_record", None) or {}).get("wake_seconds"))
                      for a in actors if a is not actor and self.ledger.get(a.name) is not None]
        if actor.spec.nodes > 1:
            requests = [Request(member_name(actor.name, rank), fp, hosts=(host,))
                        for rank, host in enumerate(actor.spec.hosts[:actor.spec.nodes])]
        else:
            # The other replicas of its deployment: placement spreads them and never evicts one.
            requests = [Request(actor.name, fp, hosts=tuple(h for h in hosts if h in self.ledger.hosts) or hosts,
                                siblings=frozenset(getattr(actor, "sibling_names", ())))]
        # Members go one after the other on a trial ledger, each seeing what the ones before took.
        trial = self.ledger.copy() if len(requests) > 1 else self.ledger
        plans: list[tuple[Plan, Request]] = []
        victims: dict[str, str] = {}
        for request in requests:
            result = planner(request, trial, candidates, now)
            plans.append((result, request))
            for victim in result.victims:
                victims.setdefault(victim.deployment, victim.action)
            if trial is not self.ledger:
                trial.apply(result, request)
                states = {p.deployment: p.state for p in trial.placements()}
                candidates = [replace(c, state=states[c.deployment]) for c in candidates]
        by_name = {a.name: a for a in actors}
        return [(by_name[name], action) for name, action in victims.items()], plans

    def planned_host(self, actor: PlacedDeployment) -> str | None:
        if self._last_plan and self._last_plan[0] == actor.name:
            return self._last_plan[1][0][0].host
        return None

    def gpus_for(self, actor: PlacedDeployment, rank: int | None = None) -> tuple[int, ...]:
        """The card indices the ledger placed ``actor`` (or its member ``rank``) on; empty for a CPU one."""
        placed = self.ledger.get(actor.name if rank is None else member_name(actor.name, rank))
        return placed.gpus if placed is not None else ()

    def cores_problem(self, spec: Any, hosts: Iterable[str]) -> str | None:
        """Why the manifest's ``resources.cpus`` can never be given on ``hosts`` (the hosts it may
        run on; for a group, each member's host), else None. Hosts whose cores are unknown are not
        held against it."""
        wanted = spec.resources.cpus
        if wanted is None:
            return None
        known = {h: n for h in hosts if (n := self.host_cores(h)) is not None}
        short = {h: n for h, n in known.items() if n < wanted}
        if not short or (spec.nodes == 1 and len(short) < len(known)):
            return None
        where = ", ".join(f"host {h!r} has {n}" + (f" ({self._core_reserve[h]} more kept by cpu_reserve)"
                                                    if self._core_reserve.get(h) else "")
                          for h, n in short.items())
        return f"asks for {wanted} cores, more than CapyCTL may give one engine: {where}"

    def adopting(self, name: str, cpus: str | None) -> None:
        """A unit a previous daemon started is being adopted, pinned to ``cpus`` (its "cpus"
        marker): when the ledger first places it, it keeps the cores made of those CPUs."""
        from ..hosts import parse_cpu_list
        try:
            self._adopted_cpus[name] = frozenset(parse_cpu_list(cpus)) if cpus else frozenset()
        except ValueError:
            self._adopted_cpus.pop(name, None)

    def cores_for(self, actor: PlacedDeployment, rank: int | None = None) -> tuple[Core, ...]:
        """The cores the ledger gave ``actor`` (or its member ``rank``); empty where none are planned."""
        return self.ledger.cores_of(actor.name if rank is None else member_name(actor.name, rank))

    def launch_memory(self, actor: PlacedDeployment, rank: int | None = None) -> tuple[float | None, int | None]:
        """(share of each planned card's total memory, bytes on each) to launch with, from the plan.
        A deployment planned on whole cards gets (None: the engine's default, the card's size)."""
        placed = self.ledger.get(actor.name if rank is None else member_name(actor.name, rank))
        if placed is None or not placed.gpus:
            return None, None
        capacity = min(self.ledger.domains[gpu_domain(placed.host, i)].capacity for i in placed.gpus)
        if placed.footprint.gpu_memory is None:
            return None, capacity
        budget = min(placed.footprint.gpu_memory, capacity)
        return gpu_memory_fraction(budget, capacity), budget

    def charge(self, actor: PlacedDeployment) -> None:
        if self._last_plan and self._last_plan[0] == actor.name:
            for plan, request in self._last_plan[1]:
                self.ledger.apply(plan, request)
        self._last_plan = None

    # -- keeping the ledger in step ---------------------------------------------------------------

    def observe(self, actor: PlacedDeployment) -> None:
        """Keep the ledger's state of ``actor`` (of each of its members) equal to the actor's."""
        names = ([member_name(actor.name, r) for r in range(actor.spec.nodes)] if actor.spec.nodes > 1
                 else [actor.name])
        for name in names:
            self._observe_one(actor, name, actor.host if actor.spec.nodes == 1 else None)

    def _observe_one(self, actor: PlacedDeployment, name: str, host: str | None) -> None:
        placed = self.ledger.get(name)
        state = actor.state
        in_place = actor.parked_in_place if state == "parked" else None
        if placed is None:
            if host is None or _stopped(actor) or host not in self.ledger.hosts:
                return  # members are placed by a plan only; a host not budgeted has nothing to charge
            fp = self.footprint(actor)
            if fp.gpus:
                return  # which cards an adopted GPU unit holds is unknown here: not budgeted until restarted
            cpus = self._adopted_cpus.pop(name, frozenset())
            cores = tuple(core for core in self.ledger.host_cores(host) if set(core) <= cpus)
            self.ledger.place(name, fp, host, (), state, in_place=in_place, cores=cores)
            return
        if placed.state != state or (state == "parked" and placed.in_place != actor.parked_in_place):
            self.ledger.set_state(name, state, in_place=in_place)
        if _stopped(actor):
            # The unit is gone (stop_unit waits for it), and with its cgroup its host RAM. Its GPU
            # memory stays pending until NVML shows no process of it on the card (refresh_gpus).
            self.ledger.confirm_released(name, ram_domain(placed.host))

    def forget(self, name: str) -> None:
        for placed in self.ledger.placements():
            if placed.deployment == name or placed.deployment.startswith(name + "#rank"):
                self.ledger.forget(placed.deployment)
                self.ledger.confirm_released(placed.deployment, ram_domain(placed.host))

    # -- measurements (the controller reads them; the scheduler stays pure) -----------------------

    def pending_gpu_hosts(self, hosts: Iterable[str] | None = None) -> list[str]:
        """Hosts with GPU memory pending release (worth an NVML look before planning)."""
        wanted = None if hosts is None else set(hosts)
        out = []
        for dom in self.ledger.domains.values():
            if dom.kind == "gpu" and (wanted is None or dom.host in wanted) and self.ledger.pending(dom.id) \
                    and dom.host not in out:
                out.append(dom.host)
        return out

    def observe_gpus(self, host: str, gpus: list[dict[str, Any]]) -> None:
        """Feed one host's NVML view (``HostInventory.to_dict()["gpus"]``) into the ledger: each
        card's free memory and its processes by deployment (members of a group included)."""
        for gpu in gpus:
            dom = gpu_domain(host, int(gpu["index"]))
            if dom not in self.ledger.domains:
                continue
            used_by = _used_by(gpu)
            for placed in self.ledger.placements():
                base = placed.deployment.split("#rank", 1)[0]
                if placed.deployment != base and placed.host == host and base in used_by:
                    used_by[placed.deployment] = used_by[base]
            self.ledger.observe_card(dom, int(gpu["memory_free"]), used_by)

    def correct(self, actor: PlacedDeployment, gpus: list[dict[str, Any]] | None, ram: int | None) -> dict:
        """Replace ``actor``'s estimated charges by what was measured once it was ready: its
        processes' memory on each of its cards (NVML), its unit's cgroup memory (RAM). A budget the
        manifest gives is kept (the engine was told to stay within it). Returns what changed."""
        placed = self.ledger.get(actor.name)
        if placed is None or placed.state != "ready":
            return {}
        changed: dict[str, int] = {}
        gpu_memory = None
        if placed.gpus and actor.spec.resources.gpu_memory is None and gpus is not None:
            on_cards = [_used_by(g).get(actor.name, 0) for g in gpus if int(g["index"]) in placed.gpus]
            if on_cards and max(on_cards) > 0:
                gpu_memory = math.ceil(max(on_cards) * GPU_MEASURE_MARGIN)
                changed["gpu_memory"] = gpu_memory
        ram_charge = None
        if actor.spec.resources.ram is None and ram:
            # Measured at ready, the prompt cache is still empty: what it may grow into stays charged.
            cache = actor.controller.adapter(actor.spec).prompt_cache_ram(actor.spec, _model_path(actor))
            ram_charge = math.ceil(ram * RAM_MEASURE_MARGIN) + RAM_MEASURE_SLACK + cache
            changed["ram"] = ram_charge
        if changed:
            self.ledger.correct(actor.name, gpu_memory=gpu_memory, ram=ram_charge)
        return changed


def _used_by(gpu: dict[str, Any]) -> dict[str, int]:
    used: dict[str, int] = {}
    for proc in gpu.get("processes") or []:
        deployment = proc.get("deployment")
        if deployment and proc.get("used_memory"):
            used[deployment] = used.get(deployment, 0) + int(proc["used_memory"])
    return used


async def read_gpus(ctl: Any, host: str) -> list[dict[str, Any]] | None:
    """NVML's view of ``host``'s cards as host-info reports them; None when it cannot be read."""
    if host == LOCAL:
        from ..hosts import NvmlUnavailable, gpu_inventory
        from ._hosts import attribute_gpu_processes
        try:
            gpus = [asdict(g) for g in await asyncio.to_thread(gpu_inventory)]
        except NvmlUnavailable:
            return None
        try:
            systemd = ctl.hosts.systemd(LOCAL)
        except CapyError:
            systemd = None
        await attribute_gpu_processes(systemd, gpus)
        return gpus
    entry = ctl.hosts.get(host)
    if entry.ssh is None or not entry.online:
        return None
    try:
        info = await ctl.hosts.remote_host_info(entry.ssh)
    except CapyError:
        return None
    if info.get("nvml_error") and not info.get("gpus"):
        return None
    entry.info = info
    return list(info.get("gpus") or [])


async def refresh_gpus(ctl: Any, hosts: Iterable[str]) -> None:
    """Before a plan: read NVML on the hosts where GPU memory is pending release, so memory the
    driver has freed is free again in the ledger (and memory still held stays charged)."""
    for host in ctl.memory.pending_gpu_hosts(hosts):
        gpus = await read_gpus(ctl, host)
        if gpus is not None:
            ctl.memory.observe_gpus(host, gpus)


async def measure(ctl: Any, actor: PlacedDeployment) -> dict:
    """Once ``actor`` is ready: measure what it really uses and correct its estimated charges."""
    spec = actor.spec
    placed = ctl.memory.ledger.get(actor.name)
    if spec.nodes > 1 or placed is None or placed.state != "ready":
        return {}
    want_gpu = bool(placed.gpus) and spec.resources.gpu_memory is None
    want_ram = spec.resources.ram is None
    if not (want_gpu or want_ram):
        return {}
    gpus = await read_gpus(ctl, actor.host) if placed.gpus else None
    ram = None
    if want_ram:
        try:
            ram = await ctl.hosts.systemd(actor.host).memory_current(actor.unit)
        except CapyError:
            ram = None
    if gpus is not None:
        ctl.memory.observe_gpus(actor.host, gpus)
    changed = ctl.memory.correct(actor, gpus, ram)
    if changed:
        log.info("deployment %s: charges corrected to what was measured: %s", actor.name, changed)
    return changed


# How long a plan that found no room waits for GPU memory pending release to show free in NVML
# (a process's memory is freed as its CUDA context is torn down, shortly after it exits).
RELEASE_WAIT_S = 10.0
RELEASE_POLL_S = 0.25


async def wait_released(ctl: Any, hosts: Iterable[str], timeout: float = RELEASE_WAIT_S) -> bool:
    """Poll NVML until no GPU memory is pending release on ``hosts``; False if some still was
    after ``timeout`` (or there was none to wait for)."""
    hosts = list(hosts)
    if not ctl.memory.pending_gpu_hosts(hosts):
        return False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        await refresh_gpus(ctl, hosts)
        if not ctl.memory.pending_gpu_hosts(hosts):
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(RELEASE_POLL_S)
