"""Which hosts take deployments: the operator's cordons and drains, the hosts a deployment may
start on (or why it cannot be served because of its hosts), and each host as the API shows it."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from ..config import DaemonConfig
from ..errors import CapyError, Conflict, Unavailable
from ..store import Store
from ._hosts import HostRegistry
from ._lifecycle import RUNNING, Command

log = logging.getLogger("capyctl.controller")

Actors = Callable[[], Mapping[str, Any]]  # the deployments' actors by name, as they are now


class Cordons:
    """Hosts closed to new placements (``capyctl drain host``), and the host operations that
    must see them: placement, adding and removing a host, describing one."""

    def __init__(self, config: DaemonConfig, store: Store, hosts: HostRegistry, actors: Actors) -> None:
        self._config = config
        self._store = store
        self._hosts = hosts
        self._actors = actors
        # host -> since; the store keeps them across restarts, this copy keeps a request's
        # admission free of SQLite.
        self._cordoned: dict[str, float] = store.cordons()

    @property
    def cordoned(self) -> Mapping[str, float]:
        """Cordoned host -> when it was cordoned."""
        return self._cordoned

    def cordon(self, host: str) -> None:
        """Close ``host`` to new placements (kept in the store: a restart keeps it closed)."""
        self._hosts.get(host)  # an unknown host is a 404
        self._store.cordon(host)
        self._cordoned = self._store.cordons()
        log.info("host %s cordoned: no new placement lands there", host)

    def uncordon(self, host: str) -> bool:
        self._hosts.get(host)
        opened = self._store.uncordon(host)
        self._cordoned = self._store.cordons()
        if opened:
            log.info("host %s uncordoned: it takes placements again", host)
        return opened

    async def drain(self, host: str) -> dict:
        """Cordon ``host``, then park every deployment placed there out of place (its memory is
        released there and a wake does not land there again); one that may run elsewhere and
        was serving is woken on another host (moved)."""
        self.cordon(host)
        results = []
        for name in self.describe_host(host)["deployments"]:
            actor = self._actors().get(name)
            if actor is None:
                continue
            was_serving = actor.state in RUNNING
            row: dict[str, Any] = {"name": name, "action": "parked", "error": None}
            try:
                # Out of place: weights kept in this host's RAM would bring the next wake back here.
                await actor.submit(Command.PARK, in_place_ok=False, reason=f"host {host} drained")
                if was_serving and actor.spec.nodes == 1 and actor.spec.park != "never":
                    try:
                        others = self.allowed_hosts(actor)
                    except CapyError:
                        others = ()
                    if others:
                        await actor.submit(Command.WAKE)
                        row["action"] = "moved"
            except CapyError as exc:
                row["error"] = exc.to_dict()
            results.append(row | {"state": actor.state, "host": actor.host})
        return {"host": host, "cordoned": True, "deployments": results,
                "drained": all(r["error"] is None for r in results)}

    # -- placement

    def placement_error(self, actor: Any) -> CapyError | None:
        """Why a request for ``actor`` cannot be served now because of its hosts, or None."""
        placed = actor.state in RUNNING or actor.parked_in_place
        if self._cordoned and actor.state not in RUNNING:
            # Refused before a wake starts: a cordon is the operator's choice, not the deployment's failure.
            try:
                self.allowed_hosts(actor)
            except CapyError as exc:
                if exc.code == "host_cordoned":
                    return exc
        if placed:
            entry = self._hosts.entries.get(actor.host)
            if entry is not None and not entry.connected and not (actor.spec.on_host_loss == "move"
                                                              and actor.has_pending_commands):
                return self._hosts.offline_error(actor.host, actor.name)
            return None  # a deployment that moves off a lost host: requests wait for its wake elsewhere
        wanted = actor.spec.hosts
        if wanted and not any(h in self._hosts.entries and self._hosts.entries[h].online for h in wanted):
            known = [h for h in wanted if h in self._hosts.entries]
            if known:
                return self._hosts.offline_error(known[0], actor.name)
        return None

    def allowed_hosts(self, actor: Any) -> tuple[str, ...]:
        """The online hosts ``actor`` may start on: its manifest's ``hosts``, else every online host."""
        cordoned = self._cordoned
        if actor.parked_in_place:
            if actor.host in cordoned:
                raise _cordoned_error(actor, [actor.host])
            return (actor.host,)
        wanted = actor.spec.hosts or list(self._hosts.entries)
        for name in wanted:
            self._hosts.get(name)  # an unknown host is an error, not an offline one
        if actor.spec.nodes > 1:
            closed = [h for h in wanted[:actor.spec.nodes] if h in cordoned]
        else:
            closed = [h for h in wanted if h in cordoned]
            wanted = [h for h in wanted if h not in cordoned]
        if closed and (actor.spec.nodes > 1 or not wanted):
            raise _cordoned_error(actor, closed)
        online = tuple(h for h in wanted if self._hosts.entries[h].online)
        if not online:
            raise self._hosts.offline_error(wanted[0], actor.name)
        return online

    # -- hosts as the operator adds, removes and sees them

    async def add_host(self, name: str, target: str, **options: Any) -> dict:
        await self._hosts.add(name, target, **options)
        return self.describe_host(name)

    async def remove_host(self, name: str) -> None:
        actors = self._actors().values()
        users = [a.name for a in actors if a.host == name and (a.state in RUNNING or a.parked_in_place)]
        if users:
            raise Conflict(f"host {name!r} runs deployments {', '.join(sorted(users))}; stop them first",
                           code="host_in_use")
        pinned = [a.name for a in actors if name in a.spec.hosts]
        if pinned:
            raise Conflict(f"deployments {', '.join(sorted(pinned))} name host {name!r} in their manifest; "
                           "delete them or deploy them elsewhere first", code="host_in_use")
        await self._hosts.remove(name)
        self._store.uncordon(name)
        self._cordoned = self._store.cordons()

    def describe_host(self, name: str) -> dict:
        row = self._hosts.describe(name)
        row["engines"] = sorted({e.type for e in self._store.list_engines()})
        row["deployments"] = sorted(a.name for a in self._actors().values()
                                    if a.host == name and (a.state in RUNNING or a.parked_in_place))
        cordoned_at = self._cordoned.get(name)
        row["cordoned"] = cordoned_at is not None
        row["cordoned_at"] = cordoned_at
        row["dev_controls"] = self._config.dev_controls(name)
        return row

    def inspect_host(self, name: str) -> dict:
        row = self.describe_host(name)
        entry = self._hosts.get(name)
        actors = self._actors()
        row["inventory"] = entry.info
        row["deployment_states"] = {d: actors[d].state for d in row["deployments"] if d in actors}
        row["placeable"] = sorted(a.name for a in actors.values()
                                  if not a.spec.hosts or name in a.spec.hosts)
        return row


def _cordoned_error(actor: Any, closed: list[str]) -> CapyError:
    many = len(closed) > 1
    return Unavailable(f"deployment {actor.name!r} may only run on host{'s' if many else ''} "
                       f"{', '.join(closed)}, which {'are' if many else 'is'} drained; "
                       f"'capyctl uncordon host {closed[0]}' opens it again", code="host_cordoned")
