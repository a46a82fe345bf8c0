"""Taking turns: deployments that cannot be resident together, used at once.

A wake that finds no room asks the planner whether it would once every deployment that may be
evicted is idle (``scheduler.plan_when_idle``). If not, the wake fails (``no_room``): waiting
would never bring that room. If so, the room is held by busy deployments (or ones starting,
waking, parking) that will give it up: the wake waits in the line kept here, and the deployment
is never failed for it.

::

    request for B ──► B's wake ──► plan ──room──► evict idle victims, start B
                                    │
                                    no room now, room once A is idle
                                    ▼
                   B joins the line ──waited ≥ quantum──► A's door closes: A admits the
                        │                                 requests already waiting for it,
                        │                                 no new ones (they wait at the door)
                        ▼
        A idle ──► beat ──► B, first in line, plans again ──► evicts A, wakes, serves its queue;
                                                              B leaves the line, A's door opens
        B waited ≥ wait_max ──► its requests get 503 room_wait_timeout (Retry-After); B stays parked

Who plans: anyone may take room that is free; a wake that must evict someone, or wait, goes in
line order (first come, first served), so a deployment that has waited is not overtaken by one
whose request came later. A closed door is how a busy deployment gives up its turn without
refusing anyone: the requests it admits are its batch, and every request that finds it closed
waits for its next turn. With ``order: batches`` the batch is every request waiting when the
door closed; with ``order: arrival`` it is only those that arrived before the waiting
deployment's oldest request, and the door closes at once: requests are then served in the
order they came, one swap each time the model changes (the baseline benchmarks/contention.py
measures batches against).

Requests hold tickets (one counter for the whole daemon) in the order they began to wait; a
door's mark is the first ticket it no longer admits.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from ..config import DaemonConfig
from ..errors import Unavailable


class RoomWaitTimeout(Unavailable):
    """A deployment waited for room held by busy deployments longer than ``swap.wait_max``."""

    code = "room_wait_timeout"


class WakeCancelled(Unavailable):
    """A wake that waited for room was overtaken by another command (a stop, a delete)."""

    code = "wake_cancelled"


class Door(Protocol):
    """A deployment as the line sees it: whether it admits new requests (its Admission implements it)."""

    name: str

    def close_door(self, mark: int) -> None: ...
    def open_door(self) -> None: ...
    def oldest_ticket(self) -> int | None: ...


class Pulse:
    """Wakes every task waiting on it at the next beat. A task takes its waiter before it checks
    what it waits for, so a beat between the check and the wait is not missed."""

    def __init__(self) -> None:
        self._future: asyncio.Future | None = None

    def waiter(self) -> asyncio.Future:
        if self._future is None or self._future.done():
            self._future = asyncio.get_running_loop().create_future()
        return self._future

    def beat(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)
        self._future = None


async def wait_for_beat(beat: asyncio.Future, timeout: float) -> None:
    """Until ``beat`` or ``timeout`` seconds, whichever comes first."""
    try:
        await asyncio.wait_for(asyncio.shield(beat), timeout=max(timeout, 0.0))
    except asyncio.TimeoutError:
        pass


@dataclass
class _Waiting:
    since: float  # Turns.clock() when it joined the line
    closed: set[str] = field(default_factory=set)  # doors closed for it


class Turns:
    """The line of deployments waiting for room, the doors closed for them, and the tickets."""

    def __init__(self, config: DaemonConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        # What a wait in line is measured with (the quantum, swap.wait_max): time.monotonic, or a
        # test's clock that moves only when told (tests/unit/test_turns.py).
        self.clock = clock
        self._line: dict[str, _Waiting] = {}  # oldest first (dicts keep insertion order)
        self._pulse = Pulse()
        self._tickets = 0

    # -- settings (read live: a reload applies them) --------------------------------------------

    @property
    def quantum(self) -> float:
        return 0.0 if self.arrival else self._config.swap_quantum

    @property
    def wait_max(self) -> float:
        return self._config.swap_wait_max

    @property
    def arrival(self) -> bool:
        return self._config.swap_order == "arrival"

    # -- tickets -------------------------------------------------------------------------------

    def ticket(self) -> int:
        """The next request's place in the daemon-wide order of waiting."""
        self._tickets += 1
        return self._tickets

    # -- the line ------------------------------------------------------------------------------

    def join(self, name: str) -> float:
        """Put ``name`` in line (once); when it joined."""
        return self._line.setdefault(name, _Waiting(self.clock())).since

    def in_line(self, name: str) -> bool:
        return name in self._line

    def may_evict(self, name: str) -> bool:
        """Whether ``name`` may take a plan that evicts someone: nobody older waits."""
        return next(iter(self._line), name) == name

    def ahead_of(self, name: str) -> int:
        for position, waiting in enumerate(self._line):
            if waiting == name:
                return position
        return len(self._line)

    @property
    def anyone_waiting(self) -> bool:
        return bool(self._line)

    def waiting(self) -> dict[str, float]:
        """Who waits for room, and since when (Turns.clock()), oldest first."""
        return {name: w.since for name, w in self._line.items()}

    def leave(self, name: str, doors: dict[str, Door]) -> None:
        """``name`` got its room or stopped waiting: open the doors closed for it alone."""
        waiting = self._line.pop(name, None)
        if waiting is None:
            return
        held = {door for other in self._line.values() for door in other.closed}
        for door in waiting.closed - held:
            if door in doors:
                doors[door].open_door()
        self.changed()

    def yield_to(self, name: str, yielders: Iterable[Door], waiter: Door) -> list[str]:
        """Close the doors of ``yielders`` for ``name`` once it has waited a quantum; the doors
        closed now (empty before the quantum, or when they already were)."""
        waiting = self._line.get(name)
        if waiting is None or self.clock() - waiting.since < self.quantum:
            return []
        if self.arrival:
            oldest = waiter.oldest_ticket()
            mark = oldest if oldest is not None else self._tickets + 1
        else:
            mark = self._tickets + 1
        closed = []
        for door in yielders:
            if door.name not in waiting.closed:
                door.close_door(mark)
                waiting.closed.add(door.name)
                closed.append(door.name)
        return closed

    # -- waking waiters -------------------------------------------------------------------------

    def beat(self) -> asyncio.Future:
        """The next beat: taken before a waiter checks whether it may go on."""
        return self._pulse.waiter()

    def changed(self) -> None:
        """Room may have changed (a deployment went idle, changed state, left the line)."""
        if self._line:
            self._pulse.beat()
