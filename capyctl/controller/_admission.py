"""Requests at one deployment's door: who waits, who is inside, and when the next may enter.

Admission never changes a deployment's state. A request that finds the deployment not ready asks
its actor for a wake (joining the one under way) and waits; one that finds it ready enters. The
actor drains what is inside before a park or stop.

A ready deployment whose room another waits for closes its door (controller/_turns.py): the
requests already waiting still enter, new ones wait for its next turn; they do not make it busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Protocol

from ..errors import CapyError, QueueFull, Unavailable
from ._lifecycle import DeploymentState
from ._services import DeploymentServices
from ._turns import Pulse, RoomWaitTimeout, WakeCancelled, wait_for_beat

log = logging.getLogger("capyctl.controller")

Progress = Callable[[str], None]


class Busy(CapyError):
    """A park or eviction refused: requests are in flight or waiting (or did not finish in time)."""

    code = "deployment_busy"
    status = 409


class AdmittingDeployment(Protocol):
    """What admission reads of its deployment (DeploymentActor provides it)."""

    controller: DeploymentServices
    state: DeploymentState
    reason: str | None

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> Any: ...
    @property
    def has_pending_commands(self) -> bool: ...
    def backoff_left(self) -> float: ...  # seconds a failed deployment still refuses wakes
    def backoff(self) -> float: ...
    def request_wake(self) -> asyncio.Future: ...  # a wake for waiting requests, or the one under way
    def answered(self) -> None: ...  # a client's request was answered (the first after a wake ends its timeline)


class Admission:
    def __init__(self, deployment: AdmittingDeployment) -> None:
        self._deployment = deployment
        self.in_flight = 0
        self.waiting = 0
        self.last_used = 0.0
        # Wall-clock times of the last answer and of the door's closing (None: open), for the
        # timeline of a park that makes room (controller/_timeline.py).
        self.last_answer_at: float | None = None
        self.door_closed_at: float | None = None
        # Waiting requests by ticket (their place in the daemon's order), and the first ticket the
        # door no longer admits while another deployment waits for this one's room (None: open).
        self._tickets: set[int] = set()
        self._door_mark: int | None = None
        self._door_pulse = Pulse()  # beats when the door opens or the state changes
        # What waiting requests are told of their wait (Router.acquire's progress), while they wait.
        self._listeners: list[Progress] = []
        self._proofs_in_flight = 0  # of in_flight: the proof after a wake, drained as a request is
        self._idle = asyncio.Event()
        self._idle.set()
        # Set while nothing is in flight: a drain waits for it, not a poll.
        self._no_flight = asyncio.Event()
        self._no_flight.set()

    @property
    def name(self) -> str:
        return self._deployment.name

    @property
    def busy(self) -> bool:
        """Requests in flight or waiting to enter. Requests held at a closed door wait for its
        next turn, and do not count."""
        return self.in_flight > 0 or self._admitted_waiting() > 0

    @property
    def serving_clients(self) -> bool:
        """Client requests in flight or waiting to enter; the proof after a wake is none of them."""
        return self.in_flight > self._proofs_in_flight or self._admitted_waiting() > 0

    @property
    def door_open(self) -> bool:
        return self._door_mark is None

    def _may_enter_now(self) -> bool:
        d = self._deployment
        return d.state == DeploymentState.READY and not d.has_pending_commands and self._door_mark is None

    def admit_now(self) -> bool:
        """Admit one request at once if nothing stands in its way (ready, no command queued, its
        hosts usable); False, with nothing marked, when it must go through ``admit``."""
        if self._may_enter_now() and self._deployment.controller.placement_error(self._deployment) is None:
            self._enter()
            return True
        return False

    async def admit(self, progress: Progress | None = None) -> None:
        """Wait until this request may enter (ready, nothing queued before it, the door open for
        it), waking the deployment if needed; ``progress`` hears of the wait as it goes."""
        d, ctl = self._deployment, self._deployment.controller
        blocked = ctl.placement_error(d)
        if blocked is not None:
            raise blocked
        if self._may_enter_now():
            self._enter()
            return
        if d.state == DeploymentState.FAILED and d.backoff_left() > 0:
            raise Unavailable(f"deployment {d.name!r} failed: {d.reason}; it is retried after "
                              f"{d.backoff():.0f}s", code="deployment_failed", retry_after=d.backoff_left())
        if self.waiting >= min(d.spec.queue, ctl.queue_per_deployment):
            raise QueueFull(f"deployment {d.name!r} has {self.waiting} requests waiting, its limit",
                            retry_after=self._retry_after())
        if ctl.total_waiting() >= ctl.queue_total:
            raise QueueFull(f"{ctl.total_waiting()} requests are waiting across all deployments, "
                            "the limit", retry_after=self._retry_after())
        ticket = ctl.admission_ticket()
        self.waiting += 1
        self._tickets.add(ticket)
        if progress is not None:
            self._listeners.append(progress)
        self._idle.clear()
        admitted = False
        try:
            # Room held by busy deployments is waited for (swap.wait_max), then the wake itself.
            bound = ctl.room_wait_max + d.spec.timeouts.wake
            deadline = time.monotonic() + bound
            told_door = False
            while True:
                if d.state == DeploymentState.READY and not d.has_pending_commands:
                    if self._door_mark is None or ticket < self._door_mark:
                        admitted = True
                        break
                    beat = self._door_pulse.waiter()
                    if progress is not None and not told_door:
                        progress(f"waiting for {d.name}: {self.in_flight + self._admitted_waiting()} "
                                 "requests ahead, then another model's turn")
                        told_door = True
                    await self._wait_at_door(beat, deadline)
                    continue
                future = d.request_wake()
                remaining = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(asyncio.shield(future), timeout=max(remaining, 0.001))
                except asyncio.TimeoutError:
                    raise Unavailable(f"deployment {d.name!r} did not become ready within "
                                      f"{bound:.0f}s", code="wake_timeout",
                                      retry_after=5) from None
                except (RoomWaitTimeout, WakeCancelled):
                    raise  # its own code and Retry-After: the deployment did not fail
                except CapyError as exc:
                    raise Unavailable(f"deployment {d.name!r} could not be woken: {exc.message}",
                                      code="wake_failed", detail={"cause": exc.code}) from None
        finally:
            self.waiting -= 1
            self._tickets.discard(ticket)
            if progress is not None:
                self._listeners.remove(progress)
            if admitted:
                self._enter()  # from waiting to in flight with nothing between: never idle meanwhile
            else:
                self._idle_if_done()

    def release(self) -> None:
        self.in_flight -= 1
        self._flight_changed()
        self.last_used = self.last_answer_at = time.time()
        self._deployment.answered()
        self._idle_if_done()

    def _enter(self) -> None:
        self.in_flight += 1
        self._no_flight.clear()
        self.last_used = time.time()
        self._idle.clear()

    def _admitted_waiting(self) -> int:
        """Waiting requests its door lets in: every one while it is open."""
        mark = self._door_mark
        if mark is None:
            return self.waiting
        return sum(1 for ticket in self._tickets if ticket < mark)

    def _idle_if_done(self) -> None:
        """Nothing in flight or let in any more: it is idle, and wakes waiting for its room may
        take it (controller/_turns.py)."""
        if not self.busy:
            self._idle.set()
            self._deployment.controller.room_changed()

    async def _wait_at_door(self, beat: asyncio.Future, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RoomWaitTimeout(f"deployment {self._deployment.name!r} kept yielding its turn to others past "
                                  "this request's wait bound", retry_after=1.0)
        await wait_for_beat(beat, remaining)

    def _retry_after(self) -> float:
        return 1.0 if self._deployment.state == DeploymentState.READY else 5.0

    # -- taking turns (controller/_turns.py) ------------------------------------------------------

    def close_door(self, mark: int) -> None:
        """Admit only the waiting requests whose ticket is below ``mark``; later ones wait for the
        door to open (another deployment's turn comes first)."""
        if self._door_mark is None:
            self.door_closed_at = time.time()
        self._door_mark = mark if self._door_mark is None else min(self._door_mark, mark)
        self._idle_if_done()

    def open_door(self) -> None:
        if self._door_mark is not None:
            self._door_mark = self.door_closed_at = None
            self._door_pulse.beat()

    def oldest_ticket(self) -> int | None:
        return min(self._tickets, default=None)

    def state_changed(self) -> None:
        """The deployment's state changed: requests waiting at its door look again."""
        self._door_pulse.beat()

    # -- for the actor ----------------------------------------------------------------------------

    def tell_waiting(self, line: str) -> None:
        """A wake's progress, to every request waiting for it."""
        for listener in list(self._listeners):
            try:
                listener(f"waking {self._deployment.name}: {line}")
            except Exception:  # a listener is the proxy's; it must not break the wake
                log.warning("deployment %s: a waiting request's progress listener failed", self._deployment.name,
                            exc_info=True)

    async def wait_idle(self) -> None:
        """Until nothing is in flight or let in."""
        await self._idle.wait()

    async def drain(self, timeout: float, *, evicting: bool) -> None:
        """Until nothing is in flight (requests that wait for a wake do not hold the engine);
        Busy after ``timeout``, or at once when ``evicting`` and any request is in or let in."""
        name = self._deployment.name
        if evicting and self.busy:
            raise Busy(f"deployment {name!r} has requests in flight or waiting", code="deployment_busy")
        try:
            await asyncio.wait_for(self._drained(), timeout=timeout)
        except asyncio.TimeoutError:
            raise Busy(f"deployment {name!r} still had {self.in_flight} request(s) in flight after "
                       f"{timeout:.0f}s", code="drain_timeout") from None

    async def _drained(self) -> None:
        await self._no_flight.wait()

    def _flight_changed(self) -> None:
        if self.in_flight > 0:
            self._no_flight.clear()
        else:
            self._no_flight.set()

    @contextlib.contextmanager
    def hold_as_request(self) -> Iterator[None]:
        """In flight as a request is (the proof after a wake), so that a park or stop drains it;
        not a client's request (serving_clients)."""
        self.in_flight += 1
        self._proofs_in_flight += 1
        self._idle.clear()
        self._no_flight.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            self._proofs_in_flight -= 1
            self._flight_changed()
            self._idle_if_done()
