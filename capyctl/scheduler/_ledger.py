"""The memory ledger: what each deployment is charged on each memory domain.

Three kinds of charge make up a domain's use:

* active: what a deployment holds in its current state (the table in ``Ledger``'s docstring);
* pending release: memory a deployment held before a state change that lowered its charge,
  until the controller confirms it free (``confirm_released``) or an observation of the domain's
  free memory accounts for it (``observe_free``). GPU drivers free memory some time after a
  process exits or sleeps, and placing on memory that is not yet free makes the next start fail;
* external: use the latest observation showed and no deployment explains (another process,
  a deployment using more than it declared).

A host's cores are a domain too (``cpu:<host>``), counted in whole cores, with no pending release
(a core is free once the process that ran on it is gone, and ``stopping`` still holds it) and
nothing external. Besides the count, the ledger chooses which cores a deployment gets
(``Placement.cores``): two deployments that hold cores never hold the same one unless the domain
is over-committed (an adopted unit, a host re-added with fewer cores).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from ..errors import InvalidRequest, NotFound
from ._model import (FULL_STATES, STATES, Core, Domain, Footprint, HostResources, Plan, Request, cpu_domain,
                     gpu_domain, ram_domain)


@dataclass(frozen=True)
class Placement:
    """Where the ledger has a deployment, with the footprint and state it charges by.
    ``in_place`` tells, for state ``parked``, whether it parked in place (its weights in host RAM).
    ``cores`` are the cores it was given (empty where its cores are not planned); they stay on
    the placement while it holds none, as the ones it prefers the next time it starts."""

    deployment: str
    host: str
    gpus: tuple[int, ...]
    footprint: Footprint
    state: str
    in_place: bool = False
    cores: tuple[Core, ...] = ()

    @property
    def parked_in_place(self) -> bool:
        return self.state == "parked" and self.in_place

    @property
    def process_lives(self) -> bool:
        """Whether its engine process exists (running, or parked in place): then it holds its cores."""
        return self.state in FULL_STATES or self.parked_in_place

    @property
    def cpus(self) -> tuple[int, ...]:
        """The CPU ids of its cores, sorted (what its unit's AllowedCPUs=/CPUAffinity= list)."""
        return tuple(sorted(cpu for core in self.cores for cpu in core))


class Ledger:
    """Memory charged per domain (``gpu:<host>:<index>``, ``ram:<host>``), by deployment state.

    ===========================================  =====================================
    state                                        charged
    ===========================================  =====================================
    starting, ready, waking, parking, stopping   footprint: gpu memory on each card + ram + cores
    parked in place (vLLM sleep level 1)         host RAM ``parked_ram`` + cores
    parked by stop / level 2, stopped, failed    nothing
    ===========================================  =====================================

    A change that lowers a charge leaves the difference pending release. A deployment that
    wakes from parked in place takes its released memory back (the same process re-allocates
    it), so its pending release on those domains shrinks by what it takes.

    Pure bookkeeping: no I/O, no clock, not thread-safe (one asyncio controller owns it).
    """

    def __init__(self, hosts: Iterable[HostResources] = ()) -> None:
        self._domains: dict[str, Domain] = {}
        self._host_names: list[str] = []
        self._cores: dict[str, tuple[Core, ...]] = {}  # host -> the cores engines may be given
        self._placements: dict[str, Placement] = {}
        self._active: dict[str, dict[str, int]] = {}  # domain -> deployment -> bytes
        self._pending: dict[str, dict[str, int]] = {}  # domain -> deployment -> bytes, oldest first
        self._external: dict[str, int] = {}
        # domain -> bytes a deployment parked in place was measured still holding (``retain``).
        self._retained: dict[str, dict[str, int]] = {}
        for host in hosts:
            self.add_host(host)

    # -- hosts and domains ------------------------------------------------------------------

    def add_host(self, host: HostResources) -> None:
        """Budget a host's GPUs and RAM. Adding a host already known replaces its capacities."""
        indices = [card.index for card in host.gpus]
        if len(set(indices)) != len(indices):
            raise InvalidRequest(f"host {host.name!r} lists a GPU index twice: {indices}", code="invalid_host")
        if host.ram_reserve < 0 or host.ram_total < 0:
            raise InvalidRequest(f"host {host.name!r} has a negative RAM total or reserve", code="invalid_host")
        cpus = [cpu for core in host.cores for cpu in core]
        if host.core_reserve < 0 or len(set(cpus)) != len(cpus) or any(not core for core in host.cores):
            raise InvalidRequest(f"host {host.name!r} lists a CPU twice, an empty core or a negative core reserve",
                                 code="invalid_host")
        if host.name not in self._host_names:
            self._host_names.append(host.name)
        for domain_id in [d for d, dom in self._domains.items() if dom.host == host.name]:
            del self._domains[domain_id]
        ram = Domain(ram_domain(host.name), "ram", host.name, max(0, host.ram_total - host.ram_reserve))
        self._domains[ram.id] = ram
        self._cores[host.name] = host.placeable_cores
        if host.placeable_cores:
            cores = Domain(cpu_domain(host.name), "cpu", host.name, len(host.placeable_cores))
            self._domains[cores.id] = cores
        for card in sorted(host.gpus, key=lambda c: c.index):
            dom = Domain(gpu_domain(host.name, card.index), "gpu", host.name, card.memory_total,
                         card.index, card.model)
            self._domains[dom.id] = dom
        for dom_id in self._domains:
            self._active.setdefault(dom_id, {})
            self._pending.setdefault(dom_id, {})

    @property
    def domains(self) -> Mapping[str, Domain]:
        """Every domain by id, hosts in the order they were added, RAM first, then cores, GPUs by index."""
        return self._domains

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(self._host_names)

    def host_domains(self, host: str) -> list[Domain]:
        return [d for d in self._domains.values() if d.host == host]

    # -- deployments ------------------------------------------------------------------------

    def place(self, deployment: str, footprint: Footprint, host: str, gpus: Iterable[int],
              state: str = "starting", *, in_place: bool | None = None, cores: Iterable[Core] = ()) -> None:
        """Record where ``deployment`` runs (a plan's host and cards) and its state.

        Moving it elsewhere leaves what it held on its old domains pending release.
        ``in_place`` matters for state ``parked`` only; None means "as its footprint allows".
        ``cores``: the cores it should keep if they are free (a unit adopted on the cores it runs
        on); otherwise it keeps the ones it had, else gets the first free ones.
        """
        cards = tuple(gpus)
        if ram_domain(host) not in self._domains:
            raise NotFound(f"host {host!r} is not in the ledger", code="unknown_host")
        if len(cards) != footprint.gpus or len(set(cards)) != len(cards):
            raise InvalidRequest(f"deployment {deployment!r} needs {footprint.gpus} distinct GPUs, "
                                 f"got card indices {list(cards)}", code="invalid_placement")
        for index in cards:
            if gpu_domain(host, index) not in self._domains:
                raise NotFound(f"host {host!r} has no GPU {index}", code="unknown_gpu")
        self._check_state(state)
        old = self._placements.get(deployment)
        preferred = tuple(cores) or (old.cores if old is not None and old.host == host else ())
        self._commit(Placement(deployment, host, cards, footprint, state,
                               self._resolve_in_place(footprint, state, in_place), preferred))

    def set_state(self, deployment: str, state: str, *, in_place: bool | None = None) -> None:
        """Change a placed deployment's state (``in_place`` as in ``place``)."""
        current = self.get(deployment)
        if current is None:
            raise NotFound(f"deployment {deployment!r} has no placement in the ledger", code="not_placed")
        self._check_state(state)
        self._commit(Placement(deployment, current.host, current.gpus, current.footprint, state,
                               self._resolve_in_place(current.footprint, state, in_place), current.cores))

    def retain(self, deployment: str, held: Mapping[str, int]) -> None:
        """A deployment parked in place was measured after its park (NVML per process, its cgroup)
        still holding ``held`` bytes per domain: that much stays charged (at least its tier's
        charge), taken back from its pending release, until it wakes, stops or is measured again."""
        current = self.get(deployment)
        if current is None or not current.parked_in_place:
            return
        before = self._charges(current)
        self._retained[deployment] = {d: int(v) for d, v in held.items() if d in self._domains and v > 0}
        self._apply_charges(deployment, before, self._charges(current), absorb=True)

    def retained(self, deployment: str) -> dict[str, int]:
        """What ``retain`` recorded for a deployment still parked in place (empty otherwise)."""
        current = self.get(deployment)
        return dict(self._retained.get(deployment, {})) if current is not None and current.parked_in_place else {}

    def forget(self, deployment: str) -> None:
        """Drop a deleted deployment; what it held stays pending release."""
        if deployment in self._placements:
            self._apply_charges(deployment, self._charges(self._placements[deployment]), {}, absorb=False)
            del self._placements[deployment]
            self._retained.pop(deployment, None)

    def get(self, deployment: str) -> Placement | None:
        return self._placements.get(deployment)

    def placements(self) -> list[Placement]:
        return list(self._placements.values())

    def apply(self, plan: Plan, request: Request) -> None:
        """Record a plan as the controller starts carrying it out: victims parked in place or
        stopped (their memory pending release), the planned deployment placed and starting."""
        for victim in plan.victims:
            if victim.action == "park":
                self.set_state(victim.deployment, "parked", in_place=True)
            else:
                self.set_state(victim.deployment, "stopped")
        current = self.get(plan.deployment)
        if current is not None and current.state in FULL_STATES and current.host == plan.host \
                and current.gpus == plan.gpus:
            return  # already holds its memory there
        self.place(plan.deployment, request.footprint, plan.host, plan.gpus,
                   "waking" if current is not None and current.parked_in_place else "starting")

    # -- releases and observations ----------------------------------------------------------

    def confirm_released(self, deployment: str, domain: str | None = None) -> None:
        """The inventory shows ``deployment`` no longer holds memory on ``domain`` (None: anywhere)."""
        targets = [domain] if domain is not None else list(self._pending)
        for dom in targets:
            self._pending.get(dom, {}).pop(deployment, None)

    def observe_free(self, domain: str, free: int) -> None:
        """Feed the free memory the inventory measured on ``domain`` (NVML's free for a GPU,
        MemAvailable for RAM).

        Use beyond the active charges is first explained by pending releases, oldest kept
        longest (they are the most likely still held): pending releases are cleared, newest
        first, or trimmed until they add up to no more than that use; any use left unexplained
        becomes the domain's external charge until the next observation. Afterwards the domain's
        charges equal what was observed, except that an observation never lowers anything below
        the active charges (a deployment still starting may not have allocated yet).
        """
        dom = self._require(domain)
        unexplained = dom.capacity - free - sum(self._active[domain].values())
        pending = self._pending[domain]
        if unexplained <= 0:
            pending.clear()
            self._external[domain] = 0
            return
        held = sum(pending.values())
        for deployment in reversed(list(pending)):
            if held <= unexplained:
                break
            amount = pending[deployment]
            cut = min(amount, held - unexplained)
            if cut == amount:
                del pending[deployment]
            else:
                pending[deployment] = amount - cut
            held -= cut
        self._external[domain] = unexplained - held

    def observe_card(self, domain: str, free: int, used_by: Mapping[str, int]) -> None:
        """Feed what NVML shows on one GPU: its free memory and the memory each deployment's
        processes use there (processes mapped to their units; one that cannot be mapped counts
        only in ``free``).

        A pending release is confirmed once no process of its deployment is on the card, and
        trimmed to what its processes still use while some are (a process that is exiting, or
        one parked in place that kept part of its memory). The use that no active charge and no
        remaining pending release explains becomes the card's external charge (another program,
        a process NVML could not map, a deployment using more than it is charged).

        Unlike ``observe_free``, a release whose deployment still shows processes on the card is
        never cleared because a deployment that is starting has not allocated its charge yet.
        """
        dom = self._require(domain)
        if dom.kind != "gpu":
            raise InvalidRequest(f"{domain!r} is not a GPU", code="not_a_gpu")
        pending = self._pending[domain]
        for deployment in list(pending):
            held = used_by.get(deployment, 0)
            if held <= 0:
                del pending[deployment]
            else:
                pending[deployment] = min(pending[deployment], held)
        unexplained = dom.capacity - free - sum(self._active[domain].values()) - sum(pending.values())
        self._external[domain] = max(0, unexplained)

    def correct(self, deployment: str, *, gpu_memory: int | None = None, ram: int | None = None) -> None:
        """Replace estimates in a placed deployment's footprint by what was measured once it ran:
        ``gpu_memory`` on each of its cards, ``ram`` of host RAM (None: keep). A correction is not
        a release: memory charged by an estimate that turned out too high was never held, so the
        difference is not left pending."""
        current = self.get(deployment)
        if current is None:
            raise NotFound(f"deployment {deployment!r} has no placement in the ledger", code="not_placed")
        fp = current.footprint
        if gpu_memory is not None and not fp.gpus:
            raise InvalidRequest(f"deployment {deployment!r} has no GPU to correct", code="invalid_placement")
        new_fp = replace(fp, gpu_memory=fp.gpu_memory if gpu_memory is None else gpu_memory,
                         ram=fp.ram if ram is None else ram)
        new = replace(current, footprint=new_fp)
        old_charges, new_charges = self._charges(current), self._charges(new)
        self._placements[deployment] = new
        for dom in old_charges.keys() | new_charges.keys():
            if dom not in self._domains:
                continue
            if new_charges.get(dom, 0):
                self._active[dom][deployment] = new_charges[dom]
            else:
                self._active[dom].pop(deployment, None)

    # -- queries ----------------------------------------------------------------------------

    def charged(self, domain: str) -> int:
        """Everything charged on ``domain``: active + pending release + external."""
        self._require(domain)
        return (sum(self._active[domain].values()) + sum(self._pending[domain].values())
                + self._external.get(domain, 0))

    def free(self, domain: str) -> int:
        """Capacity minus charges; negative when over-committed (e.g. releases not yet confirmed)."""
        return self._require(domain).capacity - self.charged(domain)

    def holders(self, domain: str) -> dict[str, int]:
        """Active charges on ``domain`` by deployment."""
        self._require(domain)
        return dict(self._active[domain])

    def pending(self, domain: str) -> dict[str, int]:
        """Charges pending release on ``domain`` by deployment."""
        self._require(domain)
        return dict(self._pending[domain])

    def external(self, domain: str) -> int:
        self._require(domain)
        return self._external.get(domain, 0)

    def cores_of(self, deployment: str) -> tuple[Core, ...]:
        """The cores the ledger gave ``deployment`` (held while its process lives, preferred after)."""
        placed = self._placements.get(deployment)
        return placed.cores if placed is not None else ()

    def host_cores(self, host: str) -> tuple[Core, ...]:
        """The cores engines may be given on ``host`` (its reserve left out); empty: not planned."""
        return self._cores.get(host, ())

    def overcommitted(self) -> list[str]:
        """Domains whose charges exceed their capacity."""
        return [d for d in self._domains if self.free(d) < 0]

    def copy(self) -> "Ledger":
        """An independent ledger with the same hosts and charges (for what-if checks)."""
        other = Ledger()
        other._domains = dict(self._domains)
        other._host_names = list(self._host_names)
        other._cores = dict(self._cores)
        other._placements = dict(self._placements)
        other._active = {d: dict(v) for d, v in self._active.items()}
        other._pending = {d: dict(v) for d, v in self._pending.items()}
        other._external = dict(self._external)
        other._retained = {d: dict(v) for d, v in self._retained.items()}
        return other

    # -- internals --------------------------------------------------------------------------

    def _require(self, domain: str) -> Domain:
        try:
            return self._domains[domain]
        except KeyError:
            raise NotFound(f"memory domain {domain!r} is not in the ledger", code="unknown_domain") from None

    @staticmethod
    def _check_state(state: str) -> None:
        if state not in STATES:
            raise InvalidRequest(f"{state!r} is not a deployment state ({', '.join(STATES)})", code="invalid_state")

    @staticmethod
    def _resolve_in_place(footprint: Footprint, state: str, in_place: bool | None) -> bool:
        if state != "parked":
            return False
        if in_place is None:
            return footprint.parks_in_place
        if in_place and not footprint.parks_in_place:
            raise InvalidRequest("a deployment without a parked footprint cannot park in place",
                                 code="invalid_state")
        return in_place

    def _charges(self, placement: Placement) -> dict[str, int]:
        fp = placement.footprint
        if placement.state in FULL_STATES:
            charges = {}
            for index in placement.gpus:
                dom = gpu_domain(placement.host, index)
                if dom in self._domains:  # a host re-added without this card holds nothing there
                    charges[dom] = fp.gpu_need(self._domains[dom].capacity)
            charges[ram_domain(placement.host)] = fp.ram
            charges.update(self._core_charge(placement))
            return {d: v for d, v in charges.items() if v > 0}
        if placement.parked_in_place:
            charges = {ram_domain(placement.host): fp.parked_ram} if fp.parked_ram else {}
            for dom, held in self._retained.get(placement.deployment, {}).items():
                charges[dom] = max(charges.get(dom, 0), held)
            charges.update(self._core_charge(placement))
            return charges
        return {}

    def _core_charge(self, placement: Placement) -> dict[str, int]:
        dom = cpu_domain(placement.host)
        return {dom: placement.footprint.cores} if placement.footprint.cores and dom in self._domains else {}

    def _give_cores(self, new: Placement) -> Placement:
        """``new`` with the cores it holds: none while its process does not live or its cores are
        not planned; the ones it prefers (``new.cores``) when all are free and still placeable;
        else the first free ones in the host's order. Where too few are free (a placement the
        planner did not make), taken cores fill the rest: the domain shows over-committed."""
        want = new.footprint.cores
        placeable = self._cores.get(new.host, ())
        if not want or not placeable:
            return replace(new, cores=()) if new.cores else new
        if not new.process_lives:
            return new  # it holds none; the ones it had stay its preference
        taken = {core for other in self._placements.values()
                 if other.deployment != new.deployment and other.host == new.host and other.process_lives
                 for core in other.cores}
        preferred = [core for core in new.cores if core in placeable and core not in taken]
        if len(preferred) == want == len(new.cores):
            return new
        free = [core for core in placeable if core not in taken]
        chosen = (free + [core for core in placeable if core in taken])[:want]
        return replace(new, cores=tuple(sorted(chosen)))

    def _commit(self, new: Placement) -> None:
        new = self._give_cores(new)
        old = self._placements.get(new.deployment)
        old_charges = self._charges(old) if old is not None else {}
        if not new.parked_in_place:
            self._retained.pop(new.deployment, None)  # measured for that park only
        # Only a wake from parked in place re-takes memory the same process just released.
        absorb = old is not None and old.parked_in_place and new.state in FULL_STATES
        self._placements[new.deployment] = new
        self._apply_charges(new.deployment, old_charges, self._charges(new), absorb=absorb)

    def _apply_charges(self, deployment: str, old: dict[str, int], new: dict[str, int], *, absorb: bool) -> None:
        for dom in old.keys() | new.keys():
            before, after = old.get(dom, 0), new.get(dom, 0)
            if dom not in self._domains:  # its host was replaced without this card
                continue
            pending = self._pending[dom]
            if after < before and self._domains[dom].kind != "cpu":
                pending[deployment] = pending.get(deployment, 0) + before - after
            elif after > before and absorb and deployment in pending:
                left = pending[deployment] - (after - before)
                if left > 0:
                    pending[deployment] = left
                else:
                    del pending[deployment]
            if after:
                self._active[dom][deployment] = after
            else:
                self._active[dom].pop(deployment, None)
