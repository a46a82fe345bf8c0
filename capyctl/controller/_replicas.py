"""A deployment's replicas (manifest ``replicas``): which one serves each request, and when one is
added or parked.

Routing follows llm-d's prefix-cache scorer rather than LiteLLM's or GPUStack's load-only
routers: an engine that served the start of a prompt recently still holds its KV state (its
slots, its host-RAM prompt cache), so sending the next turn of that conversation to it skips
the prefill. A prompt is cut into blocks whose hashes chain (block i's hash covers blocks 0..i),
so one hash names a whole prefix; each replica's deepest matching block is how much of the
prompt it has seen. The request goes to the ready replica with the deepest match unless it has
more than ``affinity_slack`` requests beyond the least busy ready replica; otherwise, and with no
match, to the least busy (fewest requests in flight or waiting). The index is bounded by
construction (PREFIX_BLOCKS_REMEMBERED blocks, least recently used dropped first), and a prompt
is hashed up to MAX_PREFIX_BLOCKS blocks only.

Scaling reads the same load: past ``scale_up_load`` requests per ready replica for
``scale_up_after``, one replica more (up to ``max``), woken only where room is free or held by
idle deployments (never by making a busier deployment yield); a ready replica beyond ``min`` with
no request for ``scale_down_after`` parks. While any replica serves, ``min`` are kept ready, so a
replica that failed is started again after its back-off.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from ..config import replica_name, replica_of
from ._lifecycle import DeploymentState

# Characters per hashed block of a prompt: a conversation's next turn adds about this much or
# more, so its own blocks are told from the shared system prompt's.
PREFIX_BLOCK_CHARS = 256
# A prompt is hashed up to this many blocks (the time a request spends on it stays small).
MAX_PREFIX_BLOCKS = 512
# Blocks remembered per deployment, least recently used dropped first.
PREFIX_BLOCKS_REMEMBERED = 32768

# A replica whose engine connection broke stays out of routing this long at most when its launch
# does not change: a dead engine is reported by systemd within moments and a hung one by the
# liveness watchdog (timeouts.unresponsive), while a connection broken by anything else (a reset
# on a healthy engine) must not keep a replica out for good.
SUSPECT_S = 30.0

# A replica a decision woke is not decided on again for this long: a wake that found no room
# (scaling never makes busy deployments yield theirs) is retried, not repeated every second.
DECISION_RETRY_S = 10.0

_COMING = frozenset({DeploymentState.STARTING, DeploymentState.WAKING})


def prefix_hashes(prompt: str | None) -> tuple[int, ...]:
    """The chained hashes of ``prompt``'s whole blocks: hash i covers blocks 0..i. Python's own
    string hash: the index lives in this process only, so its per-process salt is no harm."""
    if not prompt:
        return ()
    out = []
    running = 0
    end = min(len(prompt) // PREFIX_BLOCK_CHARS, MAX_PREFIX_BLOCKS) * PREFIX_BLOCK_CHARS
    for start in range(0, end, PREFIX_BLOCK_CHARS):
        running = hash((running, prompt[start:start + PREFIX_BLOCK_CHARS]))
        out.append(running)
    return tuple(out)


class PrefixIndex:
    """Which replicas served each prompt prefix recently, bounded to ``capacity`` blocks."""

    def __init__(self, capacity: int = PREFIX_BLOCKS_REMEMBERED) -> None:
        self.capacity = capacity
        self._served_by: OrderedDict[int, dict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._served_by)

    def depths(self, hashes: Iterable[int]) -> dict[str, int]:
        """Per replica, how many leading blocks of the prompt it served (its deepest match)."""
        depth: dict[str, int] = {}
        for i, h in enumerate(hashes, 1):
            for replica in self._served_by.get(h, ()):
                depth[replica] = i
        return depth

    def record(self, hashes: Iterable[int], replica: str) -> None:
        served = self._served_by
        for h in hashes:
            replicas = served.get(h)
            if replicas is None:
                replicas = served[h] = {}
            else:
                served.move_to_end(h)
            replicas[replica] = None
        while len(served) > self.capacity:
            served.popitem(last=False)

    def forget(self, replica: str) -> None:
        """``replica`` lost what it held (it stopped, parked or failed): it matches nothing now."""
        for replicas in self._served_by.values():
            replicas.pop(replica, None)


class Replica(Protocol):
    """What routing and scaling read of one replica (DeploymentActor provides it)."""

    state: DeploymentState
    launch_id: str | None

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> Any: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def busy(self) -> bool: ...
    @property
    def last_used(self) -> float: ...
    ready_since: float  # wall-clock time it last became ready
    @property
    def has_pending_commands(self) -> bool: ...
    @property
    def requests(self) -> Any: ...
    def backoff_left(self) -> float: ...  # seconds a failed replica still refuses wakes


def load(replica: Replica) -> int:
    return replica.in_flight + replica.waiting


@dataclass(frozen=True)
class ScaleDecision:
    """One replica to add or park, and why (the journal's line and /metrics' reason)."""

    replica: str
    direction: str  # "up" | "down" | "min"
    reason: str


class ReplicaSet:
    """The replicas of one deployment, replica 1 (the deployment's own name) first."""

    def __init__(self, deployment: str) -> None:
        self.deployment = deployment
        self.members: dict[int, Any] = {}  # index -> DeploymentActor
        self.prefixes = PrefixIndex()
        # Taken out of routing at once when the proxy lost its connection to it, until its launch
        # changes (the engine restarted) or SUSPECT_S passed: name -> (launch id then, until when).
        self._suspects: dict[str, tuple[str | None, float]] = {}
        # Stopped or drained by an operator: out of routing and scaling until woken by name.
        self.held: set[str] = set()
        # Replaced by a rolling revision: out of routing while its requests finish.
        self.draining: set[str] = set()
        self._over_since: float | None = None
        self._decided_at: dict[str, float] = {}  # replica -> when a decision last woke it

    # -- membership ---------------------------------------------------------------------------

    @property
    def primary(self) -> Any:
        return self.members[1]

    @property
    def spec(self) -> Any:
        return self.primary.spec

    def ordered(self) -> list[Any]:
        return [self.members[i] for i in sorted(self.members)]

    def names(self) -> list[str]:
        return [replica_name(self.deployment, i) for i in sorted(self.members)]

    @property
    def replicated(self) -> bool:
        return len(self.members) > 1

    # -- routing ------------------------------------------------------------------------------

    def routable(self, replica: Replica) -> bool:
        if replica.state != DeploymentState.READY or replica.has_pending_commands:
            return False
        if replica.name in self.held or replica.name in self.draining:
            return False
        if replica.name in self._suspects and self._suspected(replica):
            return False
        return replica.requests.door_open

    def _suspected(self, replica: Replica) -> bool:
        launch, until = self._suspects.get(replica.name, (None, 0.0))
        if launch == replica.launch_id and time.monotonic() < until:
            return True
        self._suspects.pop(replica.name, None)  # a new launch, or the bound passed: routable again
        return False

    def ready(self) -> list[Any]:
        return [r for r in self.ordered() if self.routable(r)]

    def pick_ready(self, hashes: tuple[int, ...]) -> Any | None:
        """The ready replica this request goes to (None: none is ready)."""
        ready = self.ready()
        if not ready:
            return None
        least = min(ready, key=load)
        if not hashes or len(ready) == 1:
            return least
        depths = self.prefixes.depths(hashes)
        deepest = max((depths.get(r.name, 0) for r in ready), default=0)
        if deepest == 0:
            return least
        holder = min((r for r in ready if depths.get(r.name, 0) == deepest), key=load)
        slack = self.spec.replicas.affinity_slack
        return holder if load(holder) - load(least) <= slack else least

    def member(self, name: str | None) -> Any | None:
        """The replica named ``name`` when it is one of these (a request pinned to the engine that
        keeps its stored response); None otherwise."""
        if name is None:
            return None
        deployment, index = replica_of(name)
        return self.members.get(index) if deployment == self.deployment else None

    def to_wake(self) -> Any:
        """The replica a request waits for when none is ready: one already starting, else the
        first that may start (not held, not failed within its back-off), else replica 1."""
        candidates = [r for r in self.ordered() if r.name not in self.held and r.name not in self.draining]
        # One whose engine connection just broke is tried last: it is about to fail or restart.
        candidates.sort(key=lambda r: r.name in self._suspects and self._suspected(r))
        for r in candidates:
            if r.state in _COMING:
                return r
        for r in candidates:
            if r.state != DeploymentState.FAILED or r.backoff_left() <= 0:
                return r
        return candidates[0] if candidates else self.primary

    def served(self, hashes: tuple[int, ...], replica: Replica) -> None:
        if hashes:
            self.prefixes.record(hashes, replica.name)

    def lost(self, replica: Replica) -> None:
        """The proxy's connection to ``replica`` broke: no request goes there until it starts again
        (a new launch) or SUSPECT_S passed."""
        self._suspects[replica.name] = (replica.launch_id, time.monotonic() + SUSPECT_S)
        self.prefixes.forget(replica.name)

    def went_away(self, replica: Replica) -> None:
        """``replica`` stopped serving (parked, stopped, failed): its prompt prefixes went with it."""
        self.prefixes.forget(replica.name)

    # -- scaling ------------------------------------------------------------------------------

    def scale(self, now: float | None = None) -> list[ScaleDecision]:
        """What to add or park now (called about once a second). Nothing while no replica serves
        or starts: the next request wakes one, as it wakes a deployment without replicas."""
        now = time.monotonic() if now is None else now
        spec = self.spec.replicas
        members = [r for r in self.ordered() if r.name not in self.held and r.name not in self.draining]
        up = [r for r in members if r.state == DeploymentState.READY or r.state in _COMING]
        if not up:
            self._over_since = None
            return []
        out: list[ScaleDecision] = []
        startable = [r for r in members if r not in up and not r.has_pending_commands
                     and (r.state != DeploymentState.FAILED or r.backoff_left() <= 0)
                     and now - self._decided_at.get(r.name, -DECISION_RETRY_S) >= DECISION_RETRY_S]
        # Keep min while it serves (a replica that failed comes back after its back-off).
        if len(up) < spec.min and startable:
            for r in startable[:spec.min - len(up)]:
                self._decided_at[r.name] = now
                out.append(ScaleDecision(r.name, "min", f"{len(up)} of min {spec.min} replicas serving"))
            return out
        ready = [r for r in up if r.state == DeploymentState.READY]
        coming = len(up) - len(ready)
        per_ready = sum(load(r) for r in members) / max(len(ready), 1)
        if per_ready > spec.scale_up_load and coming == 0 and len(up) < spec.max and startable:
            if self._over_since is None:
                self._over_since = now
            elif now - self._over_since >= spec.scale_up_after:
                self._over_since = None
                self._decided_at[startable[0].name] = now
                return [ScaleDecision(startable[0].name, "up",
                                      f"{per_ready:.1f} requests per ready replica for "
                                      f"{spec.scale_up_after:.0f}s (scale_up_load {spec.scale_up_load:g})")]
        elif per_ready <= spec.scale_up_load:
            self._over_since = None
        # Park one idle replica beyond min at a time, the highest-numbered first.
        if len(ready) > spec.min:
            wall = time.time()
            for r in reversed(ready):
                idle = wall - max(r.last_used or 0.0, r.ready_since)  # never used: idle since it is ready
                if not r.busy and not r.has_pending_commands and idle >= spec.scale_down_after:
                    return [ScaleDecision(r.name, "down", f"no request for {idle:.0f}s "
                                          f"(scale_down_after {spec.scale_down_after:.0f}s), beyond min {spec.min}")]
        return out
