"""The usage view: how full each memory domain is and what each deployment holds.

It joins three sources the controller already has: the ledger (what is reserved: active
charges, memory pending release, use nobody explains), live measurements (NVML's free memory
and per-process use on each card, MemAvailable, each unit's cgroup memory) and the actors
(state, requests in flight, the last request).

A figure that could not be measured is null and its reason is in the row's ``unknown`` map
(``{"available": "NVML could not be read: ..."}``): a missing figure must never read as zero,
or an agent would conclude a card is empty. Measurements are taken at most every
``MEASURE_EVERY_S`` seconds, so two readers a moment apart (``capyctl usage`` and the MCP usage
tool) see the same figures; ``measured_at`` says when they were taken.

Cores (a ``cpu:<host>`` domain, counted in cores) are not measured: the ledger assigns them, so
what it says a deployment holds is what its unit is pinned to, and each deployment row lists
its cores (``cores``: per host, the CPU ids and how many cores).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..errors import CapyError
from ..hosts import format_cpu_list
from ._lifecycle import RUNNING
from ._hosts import LOCAL
from ._memory import member_name

MEASURE_EVERY_S = 2.0
READ_TIMEOUT_S = 15.0


class _Snapshot:
    def __init__(self, taken_at: float) -> None:
        self.taken_at = taken_at
        self.inventory: dict[str, dict[str, Any]] = {}  # host -> host-info dict
        self.inventory_unknown: dict[str, str] = {}  # host -> why there is none
        self.unit_memory: dict[str, int | None] = {}  # deployment -> cgroup bytes
        self.unit_memory_unknown: dict[str, str] = {}


class UsageView:
    """``GET /v1/usage``: one per controller; keeps the latest measurements for MEASURE_EVERY_S."""

    def __init__(self, ctl: Any) -> None:
        self.ctl = ctl
        self._snapshot: _Snapshot | None = None
        self._lock = asyncio.Lock()

    async def view(self) -> dict:
        snapshot = await self._measurements()
        ctl = self.ctl
        ledger = ctl.memory.ledger
        hosts = []
        for host in _host_names(ctl):
            hosts.append(_host_row(ctl, ledger, host, snapshot))
        deployments = [_deployment_row(ctl, ledger, actor, snapshot)
                       for actor in sorted(ctl.actors.values(), key=lambda a: a.name)]
        return {"measured_at": snapshot.taken_at, "hosts": hosts, "deployments": deployments}

    async def _measurements(self) -> _Snapshot:
        async with self._lock:
            now = time.time()
            if self._snapshot is not None and now - self._snapshot.taken_at < MEASURE_EVERY_S:
                return self._snapshot
            snapshot = _Snapshot(now)
            await asyncio.gather(*(self._read_host(host, snapshot) for host in _host_names(self.ctl)),
                                 *(self._read_unit(actor, snapshot) for actor in self.ctl.actors.values()))
            self._snapshot = snapshot
            return snapshot

    async def _read_host(self, host: str, snapshot: _Snapshot) -> None:
        ctl = self.ctl
        if host == LOCAL:
            try:
                snapshot.inventory[host] = await ctl.hosts.local_inventory()
            except Exception as exc:  # /proc unreadable: say so rather than fail the whole view
                snapshot.inventory_unknown[host] = f"this host's inventory could not be read: {exc}"
            return
        entry = ctl.hosts.entries.get(host)
        if entry is None or entry.ssh is None or not entry.online:
            reason = entry.reason if entry is not None and entry.reason else "it is not connected"
            snapshot.inventory_unknown[host] = f"host {host!r} is {entry.state if entry else 'unknown'}: {reason}"
            return
        try:
            snapshot.inventory[host] = await asyncio.wait_for(ctl.hosts.remote_host_info(entry.ssh), READ_TIMEOUT_S)
        except asyncio.TimeoutError:
            snapshot.inventory_unknown[host] = f"host-info over SSH took longer than {READ_TIMEOUT_S:.0f}s"
        except CapyError as exc:
            snapshot.inventory_unknown[host] = f"host-info over SSH failed: {exc.message}"

    async def _read_unit(self, actor: Any, snapshot: _Snapshot) -> None:
        if actor.spec.nodes > 1:
            snapshot.unit_memory_unknown[actor.name] = "RAM of a multi-node group's members is not measured here"
            return
        if not (actor.state in RUNNING or actor.parked_in_place):
            snapshot.unit_memory[actor.name] = 0  # no unit, no cgroup: it holds no RAM
            return
        try:
            systemd = self.ctl.hosts.systemd(actor.host)
            used = await asyncio.wait_for(systemd.memory_current(actor.unit), READ_TIMEOUT_S)
        except asyncio.TimeoutError:
            snapshot.unit_memory_unknown[actor.name] = "systemd did not answer for the unit's memory in time"
            return
        except CapyError as exc:
            snapshot.unit_memory_unknown[actor.name] = f"the unit's memory could not be read: {exc.message}"
            return
        if used is None:
            snapshot.unit_memory_unknown[actor.name] = "systemd keeps no memory accounting for the unit"
        else:
            snapshot.unit_memory[actor.name] = used


def _host_names(ctl: Any) -> list[str]:
    names = list(ctl.memory.ledger.hosts)
    names += sorted(h for h in ctl.hosts.entries if h not in names)
    return names


def _cards(snapshot: _Snapshot, host: str) -> dict[int, dict] | None:
    info = snapshot.inventory.get(host)
    if info is None or (info.get("nvml_error") and not info.get("gpus")):
        return None
    return {int(g["index"]): g for g in info.get("gpus") or []}


def _no_cards_reason(snapshot: _Snapshot, host: str) -> str:
    if host in snapshot.inventory_unknown:
        return snapshot.inventory_unknown[host]
    return f"NVML could not be read: {snapshot.inventory[host].get('nvml_error')}"


def _host_row(ctl: Any, ledger: Any, host: str, snapshot: _Snapshot) -> dict:
    row: dict[str, Any] = {"host": host, "state": ctl.host_state(host), "domains": [], "unknown": {}}
    if host not in ledger.hosts:
        row["unknown"]["domains"] = "CapyCTL has not read this host's inventory yet, so nothing is budgeted on it"
        return row
    info = snapshot.inventory.get(host)
    cards = _cards(snapshot, host)
    for dom in ledger.host_domains(host):
        pending = sum(ledger.pending(dom.id).values())
        d: dict[str, Any] = {
            "id": dom.id, "kind": dom.kind, "index": dom.index, "model": dom.model,
            "capacity": dom.capacity,
            "available": None,
            "reserved": sum(ledger.holders(dom.id).values()) + pending,
            "pending_release": pending,
            "external": ledger.external(dom.id),
            "unreserved": ledger.free(dom.id),
            "unknown": {},
        }
        if dom.kind == "cpu":
            d["available"] = dom.capacity - sum(ledger.holders(dom.id).values())  # assigned, not sampled
        elif dom.kind == "ram":
            if info is None:
                d["unknown"]["available"] = snapshot.inventory_unknown[host]
            else:
                d["available"] = info.get("ram_available")
        elif cards is None:
            d["unknown"]["available"] = _no_cards_reason(snapshot, host)
        elif dom.index not in cards:
            d["unknown"]["available"] = f"NVML no longer shows GPU {dom.index} on host {host!r}"
        else:
            d["available"] = int(cards[dom.index]["memory_free"])
        row["domains"].append(d)
    return row


def _deployment_row(ctl: Any, ledger: Any, actor: Any, snapshot: _Snapshot) -> dict:
    name = actor.name
    idle = None
    unknown: dict[str, str] = {}
    if actor.last_used:
        idle = max(0.0, snapshot.taken_at - actor.last_used)
    else:
        unknown["idle_seconds"] = "no request for it since the daemon started"
    row: dict[str, Any] = {
        "name": name, "state": actor.state, "host": actor.host, "in_flight": actor.in_flight,
        "waiting": actor.waiting, "last_request_at": actor.last_used or None, "idle_seconds": idle,
        "domains": [], "unknown": unknown, "cores": [],
    }
    ledger_names = {name} | {member_name(name, r) for r in range(actor.spec.nodes)} if actor.spec.nodes > 1 \
        else {name}
    domains: dict[str, dict[str, Any]] = {}

    def domain(dom_id: str) -> dict[str, Any]:
        if dom_id not in domains:
            domains[dom_id] = {"id": dom_id, "reserved": 0, "pending_release": 0, "held": None, "unknown": {}}
        return domains[dom_id]

    for held_as in sorted(ledger_names):
        placed = ledger.get(held_as)
        if placed is not None and placed.cores and placed.process_lives:
            row["cores"].append({"host": placed.host, "count": len(placed.cores),
                                 "cpus": format_cpu_list(placed.cpus)})
    for dom_id in ledger.domains:
        for held_as in ledger_names:
            reserved = ledger.holders(dom_id).get(held_as, 0)
            pending = ledger.pending(dom_id).get(held_as, 0)
            if reserved or pending:
                domain(dom_id)["reserved"] += reserved + pending
                domain(dom_id)["pending_release"] += pending
    # Measured: its processes on every card NVML shows, and its unit's cgroup for host RAM.
    for host in ({actor.host} | {ledger.get(n).host for n in ledger_names if ledger.get(n)}):
        cards = _cards(snapshot, host)
        for dom_id, d in domains.items():
            dom = ledger.domains.get(dom_id)
            if dom is not None and dom.host == host and dom.kind == "gpu" and cards is None:
                d["unknown"]["held"] = _no_cards_reason(snapshot, host)
        for index, card in (cards or {}).items():
            procs = [p for p in card.get("processes") or [] if p.get("deployment") == name]
            dom_id = f"gpu:{host}:{index}"
            if not procs:
                if dom_id in domains:
                    domains[dom_id]["held"] = 0
                continue
            d = domain(dom_id)
            if any(p.get("used_memory") is None for p in procs):
                d["unknown"]["held"] = "the driver does not report this process's GPU memory"
            else:
                d["held"] = sum(int(p["used_memory"]) for p in procs)
    ram_id = f"ram:{actor.host}"
    if name in snapshot.unit_memory and (snapshot.unit_memory[name] or ram_id in domains):
        domain(ram_id)["held"] = snapshot.unit_memory[name]
    elif name in snapshot.unit_memory_unknown:
        domain(ram_id)["unknown"]["held"] = snapshot.unit_memory_unknown[name]
    for dom_id, d in domains.items():
        if dom_id.startswith("cpu:"):
            d["held"] = d["reserved"]  # the cores its unit is pinned to
        if d["held"] is None and "held" not in d["unknown"]:
            d["unknown"]["held"] = "not measured"
    row["domains"] = [domains[k] for k in sorted(domains)]
    return row

