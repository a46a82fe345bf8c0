"""Placement and eviction: where a deployment goes and who makes room for it.

The eviction rule comes from the original CapyCTL: victims are idle instances, least recently
used first; the set of victims is minimal (fewest victims; among sets of equal size the one whose
most recently used member was used longest ago, then the next, and so on); a victim parks in place
when its parked footprint fits in the host's RAM, else it stops.

Replicas of one deployment (``Request.siblings``, each charged under its own name) spread where
room allows: among the options with the fewest victims, the planner prefers cards no sibling
holds (counting each sibling on each of the option's cards), then a host with fewer siblings on
it, before the tie-breakers above. Two replicas share a card only when no option with as few
victims avoids it. A sibling is never a victim: evicting an idle replica to start another of the
same deployment gains nothing. A sibling counts where its process lives (running, starting,
stopping, or parked in place, which wakes on its cards); a stopped one holds no place.

Finding the fewest victims is a small multi-dimensional covering problem (one dimension per card
the deployment needs, plus the host's RAM, plus its cores when they are planned). It is solved exactly by a branch and bound that
branches on the dimension with the fewest contributors and prunes with the sum of the largest
contributions that are left; real inputs (a handful of cards, tens of resident deployments)
are solved in microseconds to milliseconds, see benchmarks/planner.py.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from itertools import combinations
from math import comb
from typing import Iterable, Sequence

from ..errors import CapyError, Conflict, InvalidRequest
from ._ledger import Ledger, Placement
from ._model import (FULL_STATES, Candidate, NoRoom, Plan, Request, Victim, cpu_domain, format_amount, format_size,
                     gpu_domain, ram_domain)

# States in which a deployment may be evicted: ready instances, and parked-in-place ones that
# still hold host RAM (stopping those is the only way to get that RAM back).
_EVICTABLE = frozenset({"ready", "parked"})
_HOLDS_ITS_MEMORY = frozenset({"starting", "ready", "waking"})
# Most sets of identical cards tried on one host (8 cards taken 4 at a time are 70).
MAX_CARD_SETS = 256


@dataclass(frozen=True)
class _Item:
    """One possible victim for one placement option."""

    eviction_order: tuple[int, float]  # (wake cost class, last used): smaller is evicted first
    deployment: str
    vector: tuple[int, ...]  # bytes it frees on each short domain, if stopped


@dataclass(frozen=True)
class _Option:
    host: str
    gpus: tuple[int, ...]


def plan(request: Request, ledger: Ledger, candidates: Iterable[Candidate], now: float) -> Plan:
    """Choose where ``request.deployment`` starts (or wakes) and which idle deployments make room.

    A deployment parked in place wakes where it is (its process and weights are there). Otherwise
    every allowed host is tried, and on each every set of ``footprint.gpus`` identical cards (same
    model name and total memory). The winner has the fewest victims, then the fewest of the
    option's cards held by sibling replicas, then the fewest siblings on its host, then the victims cheapest to
    wake again (their measured wake time, by wake_cost_class) and least recently used, then the tightest fit (the least memory left over on its cards, keeping large
    holes for large models), then the earlier host and lower card indices.

    ``now`` is part of the interface for rules that weigh idle time; the current rule orders
    victims by their wake cost class, then ``last_used``.
    Raises ``NoRoom`` (code ``no_room``) when no option works even after evicting every idle
    candidate, ``Conflict`` when the deployment is itself parking or stopping, and a
    ``CapyError`` with code ``ledger_out_of_sync`` when a candidate's state is not the ledger's.
    """
    fp = request.footprint
    own = ledger.get(request.deployment)
    if own is not None and own.state in _HOLDS_ITS_MEMORY:
        return Plan(request.deployment, own.host, own.gpus, ())
    if own is not None and own.state in ("parking", "stopping"):
        raise Conflict(f"deployment {request.deployment!r} is {own.state}; plan its wake once that is done",
                       code="deployment_in_transition")

    activity = _check_candidates(request.deployment, ledger, candidates, now)
    # Siblings are left out of the victims' pool only; the NoRoom sentence still names them.
    evictable = {name: c for name, c in activity.items() if name not in request.siblings}
    siblings = [p for p in map(ledger.get, sorted(request.siblings)) if p is not None and p.process_lives]
    parked_here = own is not None and own.parked_in_place
    if parked_here:
        assert own is not None
        if len(own.gpus) != fp.gpus:
            raise InvalidRequest(
                f"deployment {request.deployment!r} is parked in place on {len(own.gpus)} GPUs but now asks for "
                f"{fp.gpus}; stop it before starting it with the new footprint", code="footprint_changed")
        options = [_Option(own.host, own.gpus)]
    else:
        allowed = ledger.hosts if request.hosts is None else tuple(h for h in ledger.hosts if h in request.hosts)
        options = [opt for host in allowed
                   for opt in _host_options(ledger, host, fp.gpus,
                                              lambda dom: _card_cost(ledger, request, dom, evictable, siblings))]

    best_key: tuple | None = None
    best: tuple[_Option, list[_Item], dict[str, int]] | None = None
    eligible_by_host: dict[str, list[tuple[Candidate, dict[str, int]]]] = {}
    # Between equal options, the manifest's order of hosts (its preference), else the ledger's.
    host_rank = {h: i for i, h in enumerate(dict.fromkeys([*(request.hosts or ()), *ledger.hosts]))}
    # Per domain, the most it could offer: what is free plus all that evictable deployments hold.
    # Options with a domain that cannot reach its need are skipped before any search (on a host
    # with many cards most combinations fail this way).
    ceiling: dict[str, int] = {}
    for option in options:
        if option.host not in eligible_by_host:
            eligible_by_host[option.host] = _eligible(ledger, option.host, evictable)
            for _, held in eligible_by_host[option.host]:
                for dom, amount in held.items():
                    ceiling[dom] = ceiling.get(dom, 0) + amount
        needs = _needs(ledger, request, option)
        avail = {dom: _available(ledger, own if parked_here else None, dom, need) for dom, need in needs.items()}
        if any(avail[dom] + ceiling.get(dom, 0) < need for dom, need in needs.items()):
            continue
        short = [dom for dom, need in needs.items() if need > avail[dom]]
        items = sorted(
            (_Item(eviction_order(c), c.deployment, tuple(held.get(dom, 0) for dom in short))
             for c, held in eligible_by_host[option.host]),
            key=lambda it: (it.eviction_order, it.deployment))
        items = [it for it in items if any(it.vector)]
        max_k = len(items) if best_key is None else min(len(items), best_key[0])
        chosen = _fewest_victims(items, tuple(needs[d] - avail[d] for d in short), max_k)
        if chosen is None:
            continue
        freed = {dom: sum(ledger.holders(dom).get(it.deployment, 0) for it in chosen) for dom in needs}
        leftover = sum(avail[d] + freed[d] - needs[d] for d in needs if d.startswith("gpu:"))
        key = (len(chosen), _shared_cards(siblings, option), sum(p.host == option.host for p in siblings),
               _lru_key(chosen), leftover, host_rank[option.host], option.gpus)
        if best_key is None or key < best_key:
            best_key, best = key, (option, chosen, {d: avail[d] + freed[d] - needs[d] for d in needs})

    if best is None:
        raise _no_room(request, ledger, options, activity, own if parked_here else None)
    option, chosen, slack = best
    return Plan(request.deployment, option.host, option.gpus,
                _actions(ledger, option.host, chosen, slack[ram_domain(option.host)]))


# States in which a deployment is about to hold its memory (starting, waking) or to give it back
# (parking, stopping) on its own: a wake waits for it as for a busy one.
_IN_TRANSITION = FULL_STATES - {"ready"}


def plan_when_idle(request: Request, ledger: Ledger, candidates: Iterable[Candidate], now: float) -> Plan:
    """The plan ``plan`` would make for ``request`` once every deployment that may be evicted is
    idle: busy ones done with their requests, those in transition ready. Its victims are who must
    yield the room, the busy ones among them included. Raises ``NoRoom`` when even that is not
    enough: room that waiting will never bring (deployments that are never evicted, memory used
    outside CapyCTL, a host too small).

    The controller asks when ``plan`` found no room, to tell a wake that should wait its turn
    (controller/_turns.py) from one that cannot succeed."""
    trial = ledger.copy()
    idle = []
    for c in candidates:
        state = c.state
        placed = trial.get(c.deployment)
        if c.deployment != request.deployment and not c.never_evict and placed is not None \
                and placed.state in _IN_TRANSITION:
            trial.set_state(c.deployment, "ready")
            state = "ready"
        idle.append(replace(c, state=state, busy=False))
    return plan(request, trial, idle, now)


def idle_to_park(deployments: Iterable[Candidate], now: float) -> list[str]:
    """Ready deployments idle for at least their ``idle_park_after``, least recently used first.
    Busy deployments and ``never_evict`` ones are never listed."""
    due = [c for c in deployments
           if c.state == "ready" and not c.busy and not c.never_evict
           and c.idle_park_after is not None and now - c.last_used >= c.idle_park_after]
    return [c.deployment for c in sorted(due, key=lambda c: (c.last_used, c.deployment))]


# -- options and needs ---------------------------------------------------------------------------

def _host_options(ledger: Ledger, host: str, gpus: int, card_cost) -> list[_Option]:
    """Every set of ``gpus`` identical cards on ``host``. Where a group of identical cards has more
    than MAX_CARD_SETS such sets (16 cards taken 8 at a time: 12,870), only sets of its cheapest
    cards are tried, each card costed alone (``card_cost``): on such hosts the fewest-victims
    guarantee holds among those cards."""
    if gpus == 0:
        return [_Option(host, ())]
    groups: dict[tuple, list[int]] = {}
    for dom in ledger.host_domains(host):
        if dom.kind == "gpu":
            assert dom.index is not None
            groups.setdefault(dom.card_type, []).append(dom.index)
    options = []
    for indices in groups.values():
        if len(indices) < gpus:
            continue
        keep = len(indices)
        while keep > gpus and comb(keep, gpus) > MAX_CARD_SETS:
            keep -= 1
        if keep < len(indices):
            indices = sorted(indices, key=lambda i: card_cost(gpu_domain(host, i)))[:keep]
        options += [_Option(host, combo) for combo in combinations(sorted(indices), gpus)]
    return options


def _shared_cards(siblings: list[Placement], option: _Option) -> int:
    """How many (sibling, card) pairs the option shares: 0 when no sibling holds any of its cards."""
    return sum(index in p.gpus for p in siblings if p.host == option.host for index in option.gpus)


def _card_cost(ledger: Ledger, request: Request, domain: str, activity: dict[str, Candidate],
               siblings: list[Placement]) -> tuple:
    """How hard one card is to free for the request on its own: victims needed, siblings on it
    (replicas spread), their recency, free memory."""
    need = request.footprint.gpu_need(ledger.domains[domain].capacity)
    deficit = need - ledger.free(domain)
    host = ledger.domains[domain].host
    index = ledger.domains[domain].index
    shared = sum(p.host == host and index in p.gpus for p in siblings)
    items = sorted((_Item(eviction_order(c), c.deployment, (held[domain],)) for c, held in _eligible(ledger, host, activity)
                    if held.get(domain, 0) > 0), key=lambda it: (it.eviction_order, it.deployment))
    chosen = _fewest_in_component(items, (deficit,), len(items))
    if chosen is None:
        return (1, 0, shared, (), -ledger.free(domain))
    return (0, len(chosen), shared, _lru_key(chosen), -ledger.free(domain))


def _needs(ledger: Ledger, request: Request, option: _Option) -> dict[str, int]:
    fp = request.footprint
    needs = {}
    for index in option.gpus:
        dom = gpu_domain(option.host, index)
        needs[dom] = fp.gpu_need(ledger.domains[dom].capacity)
    needs[ram_domain(option.host)] = fp.ram
    if fp.cores and cpu_domain(option.host) in ledger.domains:
        needs[cpu_domain(option.host)] = fp.cores
    return needs


def _available(ledger: Ledger, own_parked: Placement | None, domain: str, need: int) -> int:
    """What ``need`` may use on ``domain``: its free memory, plus, for a deployment waking in place,
    what it holds itself (up to ``need``) and the pending release it will take back (as ``Ledger``
    absorbs it). What it holds beyond ``need`` is pending release once it wakes, not free: counting
    it would lend it to a victim's park (the plan's RAM slack) before the inventory confirms it."""
    free = ledger.free(domain)
    if own_parked is None:
        return free
    held = ledger.holders(domain).get(own_parked.deployment, 0)
    pending = ledger.pending(domain).get(own_parked.deployment, 0)
    return free + min(held, need) + min(pending, max(0, need - held))


def _check_candidates(deployment: str, ledger: Ledger, candidates: Iterable[Candidate],
                      now: float) -> dict[str, Candidate]:
    activity = {}
    for c in candidates:
        if c.deployment == deployment:
            continue
        placed = ledger.get(c.deployment)
        if placed is not None and placed.state != c.state:
            raise CapyError(f"deployment {c.deployment!r} is {c.state} for the controller but {placed.state} "
                            "in the memory ledger; every state change must reach the ledger",
                            code="ledger_out_of_sync", status=500)
        activity[c.deployment] = c
    return activity


def _eligible(ledger: Ledger, host: str, activity: dict[str, Candidate]) -> list[tuple[Candidate, dict[str, int]]]:
    """Idle candidates on ``host`` that may be evicted, with what each holds on each domain."""
    held: dict[str, dict[str, int]] = {}
    for dom in ledger.host_domains(host):
        for deployment, amount in ledger.holders(dom.id).items():
            held.setdefault(deployment, {})[dom.id] = amount
    out = []
    for deployment, charges in held.items():
        c = activity.get(deployment)
        if c is not None and not c.busy and not c.never_evict and c.state in _EVICTABLE:
            out.append((c, charges))
    return out


# -- the covering search ---------------------------------------------------------------------------

# Wake times (seconds, measured for each deployment's latest wake) that count as the same cost: a
# victim whose wake is cheap (a host_backed park, a small model) is evicted before one that is
# costly to bring back; within a class, the least recently used goes first.
WAKE_COST_CLASSES = (1.0, 10.0, 60.0)


def wake_cost_class(wake_seconds: float | None) -> int:
    """0 for a wake under a second ... len(WAKE_COST_CLASSES) for the slowest; an unmeasured wake
    counts as the second class (a few seconds: a stop and start of a small model)."""
    if wake_seconds is None:
        return 1
    return next((i for i, bound in enumerate(WAKE_COST_CLASSES) if wake_seconds < bound), len(WAKE_COST_CLASSES))


def eviction_order(candidate: Candidate) -> tuple[int, float]:
    return (wake_cost_class(candidate.wake_seconds), candidate.last_used)


def _lru_key(chosen: Sequence[_Item]) -> tuple:
    return tuple(sorted(((it.eviction_order, it.deployment) for it in chosen), reverse=True))


def _fewest_victims(items: list[_Item], deficit: tuple[int, ...], max_k: int) -> list[_Item] | None:
    """The best set of at most ``max_k`` items whose vectors cover ``deficit`` (items oldest first):
    fewest items, then the most recently used member as old as possible, then the next, and so on.

    Dimensions no item links (cards whose holders hold nothing on the other short domains) are
    independent problems: solved apart, their best sets add up to the best set, because adding the
    same disjoint set to two candidate sets keeps their order."""
    open_dims = [d for d, need in enumerate(deficit) if need > 0]
    if not open_dims:
        return []
    parent = {d: d for d in open_dims}

    def root(d: int) -> int:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    for it in items:
        dims = [d for d in open_dims if it.vector[d] > 0]
        for d in dims[1:]:
            parent[root(d)] = root(dims[0])
    components: dict[int, list[int]] = {}
    for d in open_dims:
        components.setdefault(root(d), []).append(d)
    by_name = {it.deployment: it for it in items}
    chosen: list[_Item] = []
    for dims in components.values():
        part = _fewest_in_component(
            [_Item(it.eviction_order, it.deployment, tuple(it.vector[d] for d in dims))
             for it in items if any(it.vector[d] > 0 for d in dims)],
            tuple(deficit[d] for d in dims), max_k - len(chosen))
        if part is None:
            return None
        chosen += [by_name[it.deployment] for it in part]
    return sorted(chosen, key=lambda it: (it.eviction_order, it.deployment))


def _fewest_in_component(items: list[_Item], deficit: tuple[int, ...], max_k: int) -> list[_Item] | None:
    if all(d <= 0 for d in deficit):
        return []
    vectors = [it.vector for it in items]
    pool = tuple(range(len(items)))
    size = next((k for k in range(1, max_k + 1) if _covers(vectors, pool, k, deficit)), None)
    if size is None:
        return None
    chosen: list[int] = []
    limit, left = len(items), deficit
    for remaining in range(size, 0, -1):
        # The newest member as old as possible: the first j that still leaves a cover among older items.
        for j in range(remaining - 1, limit):
            rest = tuple(d - v for d, v in zip(left, vectors[j]))
            if _covers(vectors, tuple(range(j)), remaining - 1, rest):
                chosen.append(j)
                limit, left = j, rest
                break
        else:  # pragma: no cover - the size search proved a cover exists
            raise AssertionError("covering search lost its solution")
    return [items[j] for j in sorted(chosen)]


def _covers(vectors: list[tuple[int, ...]], pool: tuple[int, ...], k: int, deficit: tuple[int, ...]) -> bool:
    """Whether at most ``k`` vectors from ``pool`` sum to at least ``deficit`` on every dimension."""
    open_dims = [d for d, need in enumerate(deficit) if need > 0]
    if not open_dims:
        return True
    if k == 0:
        return False
    contributors = {d: [i for i in pool if vectors[i][d] > 0] for d in open_dims}
    for d in open_dims:
        # Bound: even the k largest contributions left cannot close this dimension.
        if sum(heapq.nlargest(k, (vectors[i][d] for i in contributors[d]))) < deficit[d]:
            return False
    # Some chosen vector must contribute to the hardest dimension: branch on which one, excluding
    # the ones already tried so no set is explored twice.
    branch_dim = min(open_dims, key=lambda d: len(contributors[d]))
    remaining = set(pool)
    for i in sorted(contributors[branch_dim], key=lambda i: -vectors[i][branch_dim]):
        remaining.discard(i)
        rest = tuple(need - v for need, v in zip(deficit, vectors[i]))
        if _covers(vectors, tuple(sorted(remaining)), k - 1, rest):
            return True
    return False


def _actions(ledger: Ledger, host: str, chosen: list[_Item], ram_slack: int) -> tuple[Victim, ...]:
    """Park each victim that can park in place while its parked footprint still fits in the RAM
    left over, the most recently used first (the likeliest to be asked for again); stop the rest."""
    actions: dict[str, str] = {}
    for it in sorted(chosen, key=lambda it: (it.eviction_order, it.deployment), reverse=True):
        placed = ledger.get(it.deployment)
        assert placed is not None
        parked_ram = placed.footprint.parked_ram
        if placed.state == "ready" and parked_ram is not None and parked_ram <= ram_slack:
            actions[it.deployment] = "park"
            ram_slack -= parked_ram
        else:
            actions[it.deployment] = "stop"
    return tuple(Victim(it.deployment, actions[it.deployment]) for it in chosen)  # type: ignore[arg-type]


# -- the error -------------------------------------------------------------------------------------

def _no_room(request: Request, ledger: Ledger, options: list[_Option], activity: dict[str, Candidate],
             own_parked: Placement | None) -> NoRoom:
    fp = request.footprint
    need = []
    if fp.gpus:
        each = "a whole card" if fp.gpu_memory is None else f"{format_size(fp.gpu_memory)} free on each"
        need.append(f"{fp.gpus} identical GPUs with {each}" if fp.gpus > 1 else f"a GPU with {each.replace(' on each', '')}")
    need.append(f"{format_size(fp.ram)} of host RAM")
    if fp.cores:
        need.append(format_amount(cpu_domain(""), fp.cores))
    hosts = list(dict.fromkeys(o.host for o in options))
    allowed = ledger.hosts if request.hosts is None else tuple(request.hosts)
    if own_parked is not None:
        where = f"on host {own_parked.host} where it is parked in place"
    else:
        where = "on any host" if request.hosts is None else f"on host {' or '.join(allowed)}"
    sentence = f"No room for deployment {request.deployment!r}: it needs {' and '.join(need)} {where}."
    detail: dict = {"deployment": request.deployment,
                    "needs": {"gpus": fp.gpus, "gpu_memory": fp.gpu_memory, "ram": fp.ram, "cores": fp.cores}, "hosts": {}}
    if not hosts:
        known = [h for h in allowed if ram_domain(h) in ledger.domains]
        if not known:
            sentence += " None of those hosts is known."
        else:
            sentence += (f" No such host has {fp.gpus} identical GPUs (same model and memory)." if fp.gpus > 1
                         else " No such host has a GPU.")
        return NoRoom(sentence, detail=detail)
    parts = []
    for host in hosts:
        domains = sorted({d for o in options if o.host == host for d in _needs(ledger, request, o)},
                         key=lambda d: (d.startswith("ram:"), d))
        free = {d: _available(ledger, own_parked, d, 0) for d in domains}
        held: dict[str, dict[str, list[str]]] = {"busy": {}, "never evicted": {}, "in transition": {}, "replicas": {}}
        for dom in domains:
            for deployment, amount in ledger.holders(dom).items():
                if own_parked is not None and deployment == own_parked.deployment:
                    continue
                c = activity.get(deployment)
                why = ("replicas" if deployment in request.siblings
                       else "busy" if c is not None and c.busy else "never evicted" if c is not None and c.never_evict
                       else "in transition" if c is None or c.state not in ("ready", "parked") else None)
                if why:
                    held[why].setdefault(deployment, []).append(f"{format_amount(dom, amount)} on {dom}")
        blocked = {why: [f"{dep} ({', '.join(where)})" for dep, where in deps.items()]
                   for why, deps in held.items()}
        pending = [f"{dep} ({format_size(amount)} on {dom})" for dom in domains
                   for dep, amount in ledger.pending(dom).items()]
        external = [f"{format_size(ledger.external(dom))} on {dom}" for dom in domains if ledger.external(dom)]
        text = f"On {host}, free: " + ", ".join(f"{d} {format_amount(d, v)}" for d, v in free.items())
        for why, holders in blocked.items():
            if holders:
                text += f"; held by {'its other replicas' if why == 'replicas' else why + ' deployments'}: " \
                    + ", ".join(holders)
        if pending:
            text += "; not yet confirmed released: " + ", ".join(pending)
        if external:
            text += "; used outside CapyCTL: " + ", ".join(external)
        parts.append(text + ".")
        detail["hosts"][host] = {"free": free, **{k.replace(" ", "_"): v for k, v in blocked.items()},
                                 "pending_release": pending, "external": external}
    return NoRoom(sentence + " " + " ".join(parts), detail=detail)

