"""One deployment's state machine, owned by one asyncio task.

Every change of state goes through the actor's command queue (``submit``), so two requests
never race a wake and a park never cuts a request short; the actor is the one writer of its
state, and ``_set`` checks every change against the table in controller/_lifecycle.py.
Requests do not change state: they only count themselves (waiting, in flight) and ask for a
wake, joining the one under way.

                wake                  healthy (and proven)
  STOPPED -------------> STARTING -------------------------> READY <---------------+
   ^   |                                                     |  ^  |                |
   |   |                                                park |  |  | stop           | healthy
   |   |                                                     v  |  |                | (and proven)
   |   |                                               PARKING -+  |                |
   |   |                                                  |  busy  |                |
   |   |                                                  v        |       wake     |
   |   +--------------- adopt, restore -------------->  PARKED ----|----------> WAKING
   |                                                      |        |
   |                   stop                               v        v
   +------------------------------------------------- STOPPING <---+

  FAILED is reached from any state: the unit exits, the engine hangs, a start times out, or a
  command errs half-way. It leaves by wake (after its back-off) to STARTING, by stop to
  STOPPING, and by adopt (a host came back with its unit) to READY or PARKED.
  READY -> WAKING: the proof after a wake failed, and the engine restarts cleanly.
  STOPPED -> READY: adopt, a unit a previous daemon started that is still healthy.

The table (TRANSITIONS) is the authority; the picture is its summary. A command that errs
half-way leaves the deployment FAILED rather than in a state no command is running.

A ready deployment whose room another waits for closes its door (controller/_turns.py): the
requests already waiting still enter, new ones wait for its next turn; they do not make it busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from ..config import engine_credentials_dir, engine_socket_path, engine_socket_runtime_directory, unit_name
from ..errors import CapyError, QueueFull, Unavailable
from ..proxy.connector import socket_base_url
from ..proxy.router import Upstream
from ..engines._tiers import RESTART, TIER_SLEEP_LEVEL
from ..spec import DeploymentSpec, PathModel
from ..store import Revision
from ._confine import engine_location
from ._group import ModelGroup
from ._keys import new_engine_key
from ._lifecycle import RESTING, RUNNING, Command, DeploymentState, InvalidTransition, allowed
from ._parking import (MAX_PROOF_FAILURES, generate_proof, proof_mismatch, rounded)
from ._parking import new_record as new_park_record
from ._parking import now as wall_clock
from . import _prompt_cache as prompt_cache
from ._liveness import Liveness, hung_stop_grace
from ._members import UnitMembers, group_members
from ._memory import gpu_order_environment
from ._services import DeploymentServices
from ._turns import Pulse, RoomWaitTimeout, WakeCancelled, wait_for_beat

log = logging.getLogger("capyctl.controller")

# How long a failed deployment refuses wakes before trying again (doubles per failure, capped).
RESTART_BACKOFF_S = 2.0
RESTART_BACKOFF_MAX_S = 300.0

Progress = Callable[[str], None]


# The health poll's interval while a start is young (the first 2 s), then 50 ms, backing off after 30 s.
HEALTH_POLL_S = 0.01
# "0" turns off arming at a park (_arm): every wake from a park by stopping then starts its unit.
ARM_PARKED_ENV = "CAPYCTL_ARM_PARKED"


def arm_parked_units() -> bool:
    return os.environ.get(ARM_PARKED_ENV, "1").strip().lower() not in ("0", "no", "false", "off")


# A restart wake's proof waits for the requests it woke for to be answered, at most this long
# under steady traffic (then it runs beside them).
PROOF_IDLE_WAIT_S = 30.0


@dataclass(frozen=True)
class _Presealed:
    """A key sealed for the next launch on ``host``: its credentials for TransientUnit."""

    host: str
    key: str
    credentials: dict[str, str]
    encrypted: frozenset[str]


async def _sealed_already(presealed: _Presealed) -> tuple[dict[str, str], frozenset[str]]:
    return presealed.credentials, presealed.encrypted


class _Laps:
    """Seconds each stage of a wake took (make room, credentials and confinement, unit start, health,
    proof): the journal line of every wake, so that a slow one says where its time went."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self._last = time.monotonic()

    def lap(self, stage: str) -> None:
        now = time.monotonic()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._last
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{stage} {seconds * 1000:.0f} ms" for stage, seconds in self.stages.items())


def no_progress(_: str) -> None:
    """The progress of a command nobody watches."""


class Busy(CapyError):
    code = "deployment_busy"
    status = 409


@dataclass
class _Queued:
    """A submitted command: its handler's arguments and the future its caller awaits."""

    command: Command
    future: asyncio.Future
    args: dict[str, Any] = field(default_factory=dict)


class DeploymentActor:
    def __init__(self, controller: DeploymentServices, revision: Revision) -> None:
        self.controller = controller
        self.revision = revision
        self.state = DeploymentState.STOPPED  # written by _set alone
        self.reason: str | None = None
        self.journal: list[str] = []
        self.in_flight = 0
        self.waiting = 0
        # Waiting requests by ticket (their place in the daemon's order), and the first ticket the
        # door no longer admits while another deployment waits for this one's room (None: open).
        self._waiting_tickets: set[int] = set()
        self._door_mark: int | None = None
        self._door_pulse = Pulse()  # beats when the door opens or the state changes
        # What waiting requests are told of their wait (Router.acquire's progress), while they wait.
        self._waiting_listeners: list[Progress] = []
        self.last_used = 0.0
        self.failures = 0
        self.failed_at = 0.0
        self.wakes = 0
        self.parks = 0
        # What the running launch is.
        self.launch_id: str | None = None
        # The host the unit runs on, the engine's port there, and the local end of its SSH
        # forward (None on the local host, where the proxy reaches the engine directly).
        self.host: str = "local"
        self.port: int | None = None
        self.local_port: int | None = None
        # An engine served on a unix socket (see capyctl/proxy/connector.py): its path on the
        # engine's host, and on a remote host the local end of its SSH stream-local forward.
        self.socket_path: str | None = None
        self.local_socket: str | None = None
        # Names of the launch's secret files beside its environment file (SGLang's --config).
        self.secret_files: list[str] = []
        self.key: str | None = None
        # The next launch's key, sealed when the deployment parked by stopping (_preseal).
        self._presealed: _Presealed | None = None
        # A park by stopping starts the next launch's unit at once, held at its gate (_arm): what
        # that launch was planned with, compared at the wake; None when no unit is armed.
        self._armed: tuple | None = None
        self.model_path: str | None = None
        self.model_commit: str | None = revision.model_commit
        self.parked_in_place = False
        self._laps = _Laps()  # the current wake's stages (_do_wake)
        # A restart wake's proof, after its requests (held so the running task is not collected).
        self._proof_task: asyncio.Task | None = None
        self._proofs_in_flight = 0  # of in_flight: the proof counts as a request, for a park to drain it
        # The park record (tier reached, wake seconds, proof after wake, the proof's reference),
        # kept in the store across daemon restarts (_parking.py).
        self.park_record: dict[str, Any] = controller.load_park_record(self.name) or new_park_record(RESTART)
        # Known from the spec before any launch, so the proxy refuses a route the engine lacks
        # without waking the model; every launch refines it with the model's resolved path.
        self.capabilities: frozenset[str] = self.spec_capabilities()
        self.served_model: str | None = None
        # The engine's command line and the environment the adapter and the manifest gave it at
        # the last launch (no secret: keys travel as credentials), for `capyctl recipe run`'s
        # launch of the same engine without CapyCTL.
        self.launch_command: dict | None = None
        self._upstream: tuple[tuple, DeploymentSpec, Upstream] | None = None  # see upstream()
        self._commands: asyncio.Queue[_Queued] = asyncio.Queue()
        self._queued_other_than_wake = 0  # queued commands that change course (see redirected)
        self._wake_for_requests = False  # the running wake was asked by requests (_do_wake)
        self._wake_future: asyncio.Future | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._unit_exited = asyncio.Event()
        self._watch_task: asyncio.Task | None = None
        # A deployment with nodes > 1 is a group of units, one per host (see _members.py).
        self.group: Any = None
        self._group_watch: asyncio.Task | None = None
        self._expect_exit = False
        # Probes the engine while DeploymentState.READY; a hung one is failed (see _liveness.py).
        self.liveness = Liveness(self)
        # Each command's one handler: grep finds who answers a command here, and who asks by its name.
        self._handlers: dict[Command, Callable[..., Any]] = {
            Command.WAKE: self._do_wake,
            Command.PARK: self._do_park,
            Command.STOP: self._do_stop,
            Command.DELETE: self._do_delete,
            Command.ADOPT: self._do_adopt,
            Command.RESTORE_PARKED: self._do_restore_parked,
            Command.FAILED_WHILE_AWAY: self._do_failed_while_away,
            Command.UNIT_EXITED: self._do_unit_exited,
            Command.ENGINE_UNRESPONSIVE: self._do_engine_unresponsive,
            Command.RESTART_AFTER_FAILED_PROOF: self._do_restart_after_failed_proof,
        }
        self._task = asyncio.create_task(self._run(), name=f"deployment:{self.name}")

    # -- identity ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.revision.deployment

    @property
    def spec(self) -> DeploymentSpec:
        return self.revision.spec

    @property
    def unit(self) -> str:
        return unit_name(self.name)

    @property
    def busy(self) -> bool:
        """Requests in flight or waiting to enter: it is not parked or evicted then. Requests held
        at its closed door wait for its next turn, and do not count."""
        return self.in_flight > 0 or self._admitted_waiting() > 0

    @property
    def serving_clients(self) -> bool:
        """Client requests in flight or waiting to enter; the proof after a wake is none of them."""
        return self.in_flight > self._proofs_in_flight or self._admitted_waiting() > 0

    @property
    def has_pending_commands(self) -> bool:
        """A park, wake or stop is queued: the deployment is about to change."""
        return not self._commands.empty()

    @property
    def abandoned(self) -> bool:
        """The running wake was asked by requests and none waits any more (their clients left):
        a wait for room ends rather than evict someone to serve nobody."""
        return self._wake_for_requests and self.waiting == 0

    @property
    def redirected(self) -> bool:
        """A command other than a wake (a stop, a park, a delete) waits behind the one running: a
        wake that waits for room gives way to it. Another wake only joins the one under way."""
        return self._queued_other_than_wake > 0

    @property
    def systemd(self) -> Any:
        """The systemd of the host this deployment runs on (raises host_offline while it is offline)."""
        return self.controller.systemd_on(self.host)

    @property
    def remote(self) -> bool:
        return self.host != "local"

    def upstream(self) -> Upstream:
        """Where the proxy sends this deployment's requests now. The proxy asks on every request,
        and the engine's kind is a store read (a SELECT and a validated spec, 12 us warm and
        several times that between llama-server's token steps), so the Upstream is kept for as
        long as what it is made of stays the same: one per launch and address."""
        made_of = (self.launch_id, self.host, self.port, self.local_port, self.socket_path, self.local_socket,
                   self.key, self.capabilities, self.served_model)
        cached = self._upstream
        if cached is not None and cached[0] == made_of and cached[1] is self.spec:
            return cached[2]
        upstream = self._make_upstream()
        self._upstream = (made_of, self.spec, upstream)
        return upstream

    def _make_upstream(self) -> Upstream:
        if self.socket_path is not None:
            return Upstream(deployment=self.name, base_url=socket_base_url(self.name, self.launch_id or "none"),
                            api_key=self.key, engine=self.controller.engine_kind(self.spec),
                            capabilities=self.capabilities, served_model=self.served_model,
                            unix_socket=self.engine_socket(), verdict=self._verdict_of(self.launch_id))
        port = self.local_port if self.remote else self.port
        return Upstream(deployment=self.name, base_url=f"http://127.0.0.1:{port}", api_key=self.key,
                        engine=self.controller.engine_kind(self.spec), capabilities=self.capabilities,
                        served_model=self.served_model, verdict=self._verdict_of(self.launch_id))

    def _verdict_of(self, launch: str | None) -> Callable[[], CapyError | None]:
        return lambda: self.liveness.verdict(launch)

    def spec_capabilities(self) -> frozenset[str]:
        """What the adapter declares from the spec alone: the model's path when the manifest names
        one on this host (a Hub model has none until it is downloaded); empty while the engine
        is not registered (the deployment cannot start then either)."""
        model_path = self.spec.model.path if isinstance(self.spec.model, PathModel) else None
        try:
            engine = self.controller.engine_for(self.spec)
            adapter = self.controller.adapter(self.spec)
        except CapyError:
            return frozenset()
        return adapter.capabilities(engine, deployment=self.spec, model_path=model_path)

    @property
    def park_tier(self) -> str:
        """The tier this deployment parks at on its host (engines/_tiers.py); ``restart`` once
        repeated failed proofs turned its in-place park off."""
        from ..engines._tiers import resolve_park_tier
        if self.park_record.get("in_place_disabled"):
            return RESTART
        try:
            adapter = self.controller.adapter(self.spec)
        except CapyError:
            return RESTART
        return resolve_park_tier(adapter, self.spec, unified_memory=self.controller.unified_memory(self.host))

    def parsers(self) -> dict | None:
        """The tool-call and reasoning parsers its launch renders, and why (vLLM, SGLang)."""
        try:
            choice = self.controller.adapter(self.spec).parsers(self.spec, self.model_path or self._spec_model_path())
        except CapyError:
            return None
        return choice.to_dict() if choice is not None else None

    def _spec_model_path(self) -> str | None:
        return self.spec.model.path if isinstance(self.spec.model, PathModel) else None

    def _save_park_record(self, **changes: Any) -> None:
        self.park_record = {**self.park_record, **changes}
        self.controller.save_park_record(self.name, self.park_record)

    def engine_socket(self) -> str | None:
        """The unix socket this daemon reaches the engine on (local: the engine's own; remote: the forward)."""
        return self.local_socket if self.remote else self.socket_path

    # -- admission (called from request handlers; never changes state) ------------------------

    def admit_now(self) -> bool:
        """Admit one request at once if nothing stands in its way (ready, no command queued, its
        hosts usable); False, with nothing marked, when it must go through ``admit``."""
        if self.state == DeploymentState.READY and self._commands.empty() and self._door_mark is None \
                and self.controller.placement_error(self) is None:
            self._enter()
            return True
        return False

    async def admit(self, progress: Progress | None = None) -> None:
        """Wait until this request may enter (ready, nothing queued before it, the door open for
        it), waking the deployment if needed; ``progress`` hears of the wait as it goes."""
        blocked = self.controller.placement_error(self)
        if blocked is not None:
            raise blocked
        if self.state == DeploymentState.READY and self._commands.empty() and self._door_mark is None:
            self._enter()
            return
        if self.state == DeploymentState.FAILED and time.monotonic() - self.failed_at < self._backoff():
            raise Unavailable(f"deployment {self.name!r} failed: {self.reason}; it is retried after "
                              f"{self._backoff():.0f}s", code="deployment_failed",
                              retry_after=self._backoff() - (time.monotonic() - self.failed_at))
        if self.waiting >= min(self.spec.queue, self.controller.queue_per_deployment):
            raise QueueFull(f"deployment {self.name!r} has {self.waiting} requests waiting, its limit",
                            retry_after=self._retry_after())
        if self.controller.total_waiting() >= self.controller.queue_total:
            raise QueueFull(f"{self.controller.total_waiting()} requests are waiting across all deployments, "
                            "the limit", retry_after=self._retry_after())
        ticket = self.controller.admission_ticket()
        self.waiting += 1
        self._waiting_tickets.add(ticket)
        if progress is not None:
            self._waiting_listeners.append(progress)
        self._idle.clear()
        admitted = False
        try:
            # Room held by busy deployments is waited for (swap.wait_max), then the wake itself.
            bound = self.controller.room_wait_max + self.spec.timeouts.wake
            deadline = time.monotonic() + bound
            told_door = False
            while True:
                if self.state == DeploymentState.READY and self._commands.empty():
                    if self._door_mark is None or ticket < self._door_mark:
                        admitted = True
                        break
                    beat = self._door_pulse.waiter()
                    if progress is not None and not told_door:
                        progress(f"waiting for {self.name}: {self.in_flight + self._admitted_waiting()} "
                                 "requests ahead, then another model's turn")
                        told_door = True
                    await self._wait_at_door(beat, deadline)
                    continue
                future = self._request_wake()
                remaining = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(asyncio.shield(future), timeout=max(remaining, 0.001))
                except asyncio.TimeoutError:
                    raise Unavailable(f"deployment {self.name!r} did not become ready within "
                                      f"{bound:.0f}s", code="wake_timeout",
                                      retry_after=5) from None
                except (RoomWaitTimeout, WakeCancelled):
                    raise  # its own code and Retry-After: the deployment did not fail
                except CapyError as exc:
                    raise Unavailable(f"deployment {self.name!r} could not be woken: {exc.message}",
                                      code="wake_failed", detail={"cause": exc.code}) from None
        finally:
            self.waiting -= 1
            self._waiting_tickets.discard(ticket)
            if progress is not None:
                self._waiting_listeners.remove(progress)
            if admitted:
                self._enter()  # from waiting to in flight with nothing between: never idle meanwhile
            else:
                self._idle_if_done()

    def _admitted_waiting(self) -> int:
        """Waiting requests its door lets in: every one while it is open."""
        mark = self._door_mark
        if mark is None:
            return self.waiting
        return sum(1 for ticket in self._waiting_tickets if ticket < mark)

    def _idle_if_done(self) -> None:
        """Nothing in flight or let in any more: it is idle, and wakes waiting for its room may
        take it (controller/_turns.py)."""
        if not self.busy:
            self._idle.set()
            self.controller.room_changed()

    async def _wait_at_door(self, beat: asyncio.Future, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RoomWaitTimeout(f"deployment {self.name!r} kept yielding its turn to others past this "
                                  "request's wait bound", retry_after=1.0)
        await wait_for_beat(beat, remaining)

    # -- taking turns (controller/_turns.py) ------------------------------------------------------

    def close_door(self, mark: int) -> None:
        """Admit only the waiting requests whose ticket is below ``mark``; later ones wait for the
        door to open (another deployment's turn comes first)."""
        self._door_mark = mark if self._door_mark is None else min(self._door_mark, mark)
        self._idle_if_done()

    def open_door(self) -> None:
        if self._door_mark is not None:
            self._door_mark = None
            self._door_pulse.beat()

    def oldest_ticket(self) -> int | None:
        return min(self._waiting_tickets, default=None)

    def _tell_waiting(self, line: str) -> None:
        """A wake's progress, to every request waiting for it."""
        for listener in list(self._waiting_listeners):
            try:
                listener(f"waking {self.name}: {line}")
            except Exception:  # a listener is the proxy's; it must not break the wake
                log.warning("deployment %s: a waiting request's progress listener failed", self.name, exc_info=True)

    def _enter(self) -> None:
        self.in_flight += 1
        self.last_used = time.time()
        self._idle.clear()

    def release(self) -> None:
        self.in_flight -= 1
        self.last_used = time.time()
        self._idle_if_done()

    def _retry_after(self) -> float:
        return 1.0 if self.state == DeploymentState.READY else 5.0

    def _backoff(self) -> float:
        return min(RESTART_BACKOFF_S * 2 ** max(self.failures - 1, 0), RESTART_BACKOFF_MAX_S)

    def _request_wake(self) -> asyncio.Future:
        if self._wake_future is None or self._wake_future.done():
            self._wake_future = self.submit(Command.WAKE, progress=self._tell_waiting, for_requests=True)
        return self._wake_future

    # -- commands -----------------------------------------------------------------------------

    def submit(self, command: Command, **args: Any) -> asyncio.Future:
        """Queue ``command`` for the actor's task; the future gives its handler's result."""
        command = Command(command)  # refuses a name that is no command at once, in the caller
        future = asyncio.get_running_loop().create_future()
        # A caller that stops waiting must not leave "exception never retrieved" noise behind.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._commands.put_nowait(_Queued(command, future, args))
        if command.changes_course:
            self._queued_other_than_wake += 1
        return future

    async def _run(self) -> None:
        while True:
            queued = await self._commands.get()
            command = queued.command
            if command.changes_course:
                self._queued_other_than_wake -= 1
            if queued.future.cancelled():
                continue
            try:
                result = await self._handlers[command](**queued.args)
            except asyncio.CancelledError:
                if not queued.future.done():
                    queued.future.cancel()
                raise
            except CapyError as exc:
                self._settle(command, exc)
                if not queued.future.done():
                    queued.future.set_exception(exc)
            except Exception as exc:  # a bug must not kill the actor; the caller sees it
                log.exception("deployment %s: %s failed", self.name, command)
                error = CapyError(f"{command} failed: {exc!r}", code="internal_error")
                self._settle(command, error)
                if not queued.future.done():
                    queued.future.set_exception(error)
            else:
                if not queued.future.done():
                    queued.future.set_result(result)
            if command is Command.DELETE and queued.future.done() and not queued.future.exception():
                return

    def _settle(self, command: Command, error: CapyError) -> None:
        """After a command that erred: a deployment it left half-way (parking, stopping, ...) is
        failed with the error, so that no state outlasts the command that entered it."""
        if self.state not in RESTING:
            self.reason_code = error.code
            self._set(DeploymentState.FAILED, f"{error.code}: {command} failed: {error.message}")

    def _set(self, state: DeploymentState, reason: str | None = None) -> None:
        """The one place a deployment's state changes; the change must be in _lifecycle.TRANSITIONS."""
        if not allowed(self.state, state):
            raise InvalidTransition(f"deployment {self.name!r} may not go from {self.state} to {state}")
        if state != self.state:
            log.info("deployment %s: %s -> %s%s", self.name, self.state, state, f" ({reason})" if reason else "")
        self.state = state
        self.reason = reason
        self._door_pulse.beat()
        self.liveness.follow(state == DeploymentState.READY)
        self.controller.record_runtime(self.name, state, reason=reason, host=self.host, launch_id=self.launch_id,
                                       port=self.port, model_path=self.model_path)
        self.controller.on_state_change(self)

    # -- wake ---------------------------------------------------------------------------------

    async def _do_wake(self, progress: Progress = no_progress, for_requests: bool = False) -> str:
        """``for_requests``: asked by waiting requests (not by an operator), so a wait for room
        ends once none of them waits any more (``abandoned``)."""
        self._wake_for_requests = for_requests
        if self.state == DeploymentState.READY:
            return self.state
        if self.state == DeploymentState.FAILED and time.monotonic() - self.failed_at < self._backoff():
            raise Unavailable(f"failed: {self.reason}", code="deployment_failed")
        if self.spec.nodes > 1:
            return await self._wake_group(progress)
        started = time.monotonic()
        self._laps = laps = _Laps()
        # A wake from a park is proven against what the model generated before it; a start records that.
        woken_from_park = self.state == DeploymentState.PARKED
        woken_in_place = False
        async with self._start_failures():
            await self.controller.make_room(self, progress)
            laps.lap("make room")
            if self.state == DeploymentState.PARKED and self.parked_in_place and await self._unit_active():
                self._set(DeploymentState.WAKING)
                progress("waking the engine in place")
                adapter = self.controller.adapter(self.spec)
                await asyncio.wait_for(
                    adapter.wake(self.controller.http, self.upstream().base_url, self.key,
                                 TIER_SLEEP_LEVEL.get(self.park_record.get("tier") or "", 1),
                                 model_path=self.model_path),
                    timeout=self.spec.timeouts.wake)
                self.parked_in_place = False
                woken_in_place = True
                laps.lap("wake in place")
            else:
                self._set(DeploymentState.STARTING if self.state in (DeploymentState.STOPPED, DeploymentState.FAILED) else DeploymentState.WAKING)
                if not await self._open_armed(progress):
                    await self._launch(progress)
            await self._wait_healthy(progress, self.spec.timeouts.start)
            laps.lap("health")
            restoring = not woken_in_place and bool(prompt_cache.pending_files(self.park_record))
            if restoring:
                # The proof goes first: any new task moves llama-server's idle slots into its
                # host-RAM cache and empties them (--cache-idle-slots), so a proof after the
                # requests would take the restored conversation out of the slot the next park saves.
                await self._prove(progress, woken_from_park, time.monotonic() - started)
                laps.lap("proof")
                await self._restore_prompt_cache(progress)
                laps.lap("restore prompt cache")
            elif woken_from_park and not woken_in_place:
                # A wake that started the unit afresh is a clean start of the same files, as a cold
                # start is: the requests it woke for go first, its proof follows them.
                self._prove_after_requests(time.monotonic() - started)
            else:
                await self._prove(progress, woken_from_park, time.monotonic() - started)
                laps.lap("proof")
        self.failures = 0
        self.wakes += 1
        self._set(DeploymentState.READY)
        log.info("deployment %s: ready in %.3fs, %s (%s)", self.name, time.monotonic() - started,
                 "woken from its park" if woken_from_park else "started", laps)
        progress(f"ready in {time.monotonic() - started:.1f}s")
        return self.state

    @contextlib.asynccontextmanager
    async def _start_failures(self) -> AsyncIterator[None]:
        """A start or wake that times out or errs fails the deployment (stopping its unit)."""
        try:
            yield
        except (RoomWaitTimeout, WakeCancelled):
            raise  # it waited for room busy deployments hold, and left its state as it was
        except asyncio.TimeoutError:
            await self._fail("start_timeout", f"not healthy within {self.spec.timeouts.start:.0f}s")
            raise Unavailable(f"deployment {self.name!r} did not become healthy in time", code="wake_timeout")
        except CapyError as exc:
            if self.state != DeploymentState.FAILED:
                await self._fail(exc.code, exc.message)
            raise

    def _reference_key(self) -> str:
        """What a proof's reference is valid for: the same revision, model files and engine."""
        return f"{self.revision.revision}:{self.model_path}:{self.model_commit}"

    async def _generate_proof(self) -> str:
        return await asyncio.wait_for(
            generate_proof(self.controller.http, self.upstream().base_url, self.key,
                           self.served_model or self.name, self.capabilities),
            timeout=self.spec.timeouts.wake)

    async def _prove(self, progress: Progress, woken_from_park: bool, wake_seconds: float) -> None:
        """At a start, record what the model generates for the proof prompt (once per revision and
        model); after a wake, generate it again and compare. A failed proof restarts the engine
        cleanly (a cold start is the floor, and its generation becomes the reference); after
        MAX_PROOF_FAILURES in a row the in-place park is turned off, with the reason."""
        failure = await self._check_proof(woken_from_park, wake_seconds)
        if failure is None:
            return
        progress("the wake failed its proof; restarting the engine")
        await self._restart_clean(progress)

    def _prove_after_requests(self, wake_seconds: float) -> None:
        """The proof of a wake that restarted the unit, once the requests it woke for are answered
        (or after PROOF_IDLE_WAIT_S of steady traffic): a restart wake costs what a start costs,
        and the proof does not share the engine's batch with those requests. A failed proof
        restarts the engine through the command queue (_do_restart_after_failed_proof)."""
        launch = self.launch_id

        def current() -> bool:
            return self.state == DeploymentState.READY and self.launch_id == launch

        async def prove() -> None:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=PROOF_IDLE_WAIT_S)
            except asyncio.TimeoutError:
                pass
            if not current():
                return  # parked, stopped or restarted first: the next wake is proven on its own
            if self.controller.room_wanted():
                # Another deployment waits for room (_turns.py): the proof would only hold this one
                # resident for it. A restart wake is a clean start of the same files; the proof
                # runs after a wake that nobody waits behind.
                self._record_wake(wake_seconds, {"result": "skipped",
                                                 "reason": "another deployment waited for room"})
                return
            # In flight as a request is, so that a park or stop drains it: stopped mid-generation,
            # llama-server did not exit on SIGTERM until systemd killed it 30 s later.
            self.in_flight += 1
            self._proofs_in_flight += 1
            self._idle.clear()
            try:
                failure = await self._check_proof(True, wake_seconds, current=current)
            except Exception:
                log.exception("deployment %s: the proof after its wake failed to run", self.name)
                return
            finally:
                self.in_flight -= 1
                self._proofs_in_flight -= 1
                self._idle_if_done()
            if failure is not None and current():
                self.submit(Command.RESTART_AFTER_FAILED_PROOF, launch=launch)

        self._proof_task = asyncio.create_task(prove(), name=f"proof:{self.name}")

    async def _do_restart_after_failed_proof(self, launch: str | None) -> str:
        if self.state != DeploymentState.READY or self.launch_id != launch:
            return self.state  # that launch is gone already
        self._set(DeploymentState.WAKING, "restarting: the wake failed its proof")
        try:
            await self._drain(self.spec.timeouts.park, evicting=False)
        except Busy:
            pass  # as an explicit stop: the restart goes ahead after the grace time
        async with self._start_failures():
            await self._restart_clean(no_progress)
        self._set(DeploymentState.READY)
        return self.state

    async def _restart_clean(self, progress: Progress) -> None:
        """Stop the engine and start it again; its generation becomes the proof's reference."""
        await self._stop_unit()
        await self._launch(progress)
        await self._wait_healthy(progress, self.spec.timeouts.start)
        text = await self._generate_proof()
        self._save_park_record(reference={"key": self._reference_key(), "prompt_tokens": None, "text": text})

    async def _check_proof(self, woken_from_park: bool, wake_seconds: float,
                           current: Callable[[], bool] | None = None) -> str | None:
        """Generate the proof and record its result; the failure (a sentence) or None. ``current``:
        whether the launch proven still serves (a proof running beside the actor's commands)."""
        reference = self.park_record.get("reference")
        valid = isinstance(reference, dict) and reference.get("key") == self._reference_key()
        if not woken_from_park and valid:
            return None
        try:
            text = await self._generate_proof()
        except (CapyError, asyncio.TimeoutError) as exc:
            if current is not None and not current():
                return None  # parked or stopped while it generated: not the engine's fault
            if isinstance(exc, CapyError) and exc.code == "proof_unavailable":
                if woken_from_park:
                    self._record_wake(wake_seconds, {"result": "skipped", "reason": exc.message})
                return None
            if not woken_from_park:
                raise CapyError(f"the engine could not generate the proof's reference: {exc}",
                                code="proof_failed") from None
            failure = f"the proof's generation failed: {exc or 'timed out'}"
        else:
            if not valid or not woken_from_park:
                self._save_park_record(reference={"key": self._reference_key(), "prompt_tokens": None, "text": text})
                if woken_from_park:
                    self._record_wake(wake_seconds, {"result": "recorded", "reason": "no reference for this revision "
                                                     "and model yet: recorded this generation as it"})
                return None
            if text == reference["text"]:
                self._record_wake(wake_seconds, {"result": "passed"}, proof_failures=0)
                return None
            failure = proof_mismatch(reference["text"], text)
        failures = int(self.park_record.get("proof_failures") or 0) + 1
        disabled = self.park_record.get("in_place_disabled")
        if failures >= MAX_PROOF_FAILURES and disabled is None and self.park_record.get("parked_in_place"):
            disabled = (f"{failures} wakes in a row failed their proof (the last: {failure}); "
                        "parking stops the unit until the deployment is redeployed")
        self._record_wake(wake_seconds, {"result": "failed", "reason": failure}, proof_failures=failures,
                          in_place_disabled=disabled)
        log.warning("deployment %s: the wake failed its proof (%s); restarting the engine", self.name, failure)
        return failure

    def _record_wake(self, wake_seconds: float, proof: dict, **changes: Any) -> None:
        self._save_park_record(wake_seconds=rounded(wake_seconds), woken_at=wall_clock(),
                               proof={**proof, "at": wall_clock()}, **changes)

    async def _unit_active(self) -> bool:
        state = await self.systemd.unit_state(self.unit)
        return state is not None and state.active_state == "active"

    def _launch_inputs(self) -> tuple:
        """What a launch is planned from that can change while a deployment is parked: its host,
        revision and engine registration, the cards and memory share placement gives it, its
        threads and the host's settings. An armed unit whose inputs changed is not used."""
        ctl = self.controller
        return (self.host, self.revision.revision, ctl.engine_for(self.spec), ctl.gpus_for(self),
                ctl.launch_memory(self), ctl.cpu_threads(self.spec, self.host), ctl.dev_controls(self.host),
                ctl.unified_memory(self.host))

    def _can_arm(self) -> bool:
        # Local only: open_gate pins the gate shell by its pid, which a remote host's is not here.
        # A group's members are launched by _members.py, each of its own.
        return not self.remote and self.spec.nodes == 1 and arm_parked_units()

    async def _arm(self) -> None:
        """After a park by stopping: start the next launch's unit now, held at its gate, so the
        wake only opens the gate. systemd's sandboxed start (about 50 ms here, most of it mount
        namespaces; benchmarks/wake_vs_manual.py) leaves the wake's path; the gate shell holds
        no GPU and about a MiB of RAM. Its failure only means the wake starts the unit."""
        self._laps = _Laps()
        try:
            await self._launch(no_progress, gated=True)
        except Exception as exc:  # arming is an optimisation: whatever failed, the park stands
            expected = isinstance(exc, (CapyError, OSError))
            log.log(logging.INFO if expected else logging.WARNING,
                    "deployment %s: the next launch was not armed at the park (%s); the wake will start it",
                    self.name, exc, exc_info=not expected)
            with contextlib.suppress(CapyError):
                await self._stop_unit()
            return
        self._armed = self._launch_inputs()

    async def _open_armed(self, progress: Progress) -> bool:
        """Open the armed unit's gate; False (the unit stopped, if there was one) when the wake
        must launch afresh: nothing armed, its inputs changed, or it no longer waits at its gate."""
        armed, self._armed = self._armed, None
        if armed is None:
            return False
        if armed == self._launch_inputs() and await self.systemd.open_gate(self.unit):
            progress(f"opened the gate of unit {self.unit}, started at the park")
            self._laps.lap("open gate")
            return True
        log.info("deployment %s: the unit armed at the park was not used (its launch changed, or it left "
                 "its gate); starting afresh", self.name)
        await self._stop_unit()
        return False

    async def _launch(self, progress: Progress, *, gated: bool = False) -> None:
        from ..engines import LaunchContext  # the controller is the one place engines are used
        from ..systemd import TransientUnit

        ctl = self.controller
        engine = ctl.engine_for(self.spec)
        adapter = ctl.adapter(self.spec)
        progress(f"resolving model {self._model_label()}")
        resolved = await ctl.resolve_model(self.spec, engine, progress)
        self.model_path = resolved.path
        if resolved.revision and resolved.revision != self.model_commit:
            self.model_commit = resolved.revision
        await self._drop_forward()
        self.port = await ctl.lease_port(self.name, self.host)
        presealed, self._presealed = self._presealed, None
        if presealed is not None and presealed.host != self.host:
            presealed = None
        self.key = presealed.key if presealed is not None else new_engine_key()
        self.launch_id = secrets.token_hex(8)
        gpu_indices = list(ctl.gpus_for(self))
        # The planned share of each card, so two models planned on one card both fit (_memory.py).
        gpu_fraction, gpu_budget = ctl.launch_memory(self)
        # Engines that can serve on a unix socket do, in the unit's own 0700 runtime directory:
        # nobody but root (CapyCTL) reaches its routes, development controls included.
        socket_path = engine_socket_path(self.name) if adapter.unix_socket else None
        ctx = LaunchContext(deployment=self.spec, engine=engine, model_path=resolved.path, port=self.port,
                            gpu_indices=gpu_indices, cpu_threads=ctl.cpu_threads(self.spec, self.host),
                            socket_path=socket_path, gpu_memory_fraction=gpu_fraction,
                            gpu_memory_budget=gpu_budget, secret_dir=engine_credentials_dir(self.unit),
                            dev_controls=ctl.dev_controls(self.host),
                            unified_memory=ctl.unified_memory(self.host),
                            prompt_cache_dir=prompt_cache.prompt_cache_dir(self.name)
                            if self._keeps_prompt_cache() else None)
        plan = adapter.build_launch(ctx)
        self.socket_path = plan.socket_path
        self.capabilities = adapter.capabilities(engine, deployment=self.spec, model_path=resolved.path)
        self.served_model = plan.served_model
        self.launch_command = {"argv": list(plan.argv), "environment": {**plan.environment, **self.spec.env}}
        # The key and SGLang's config file become systemd credentials of the unit: no environment
        # file, property or argv holds them, and only the unit's own user can read them.
        devices = ctl.gpu_device_nodes(self.host, gpu_indices)
        self._laps.lap("prepare")
        # Sealing the credentials and probing what the unit may see are independent round trips
        # to the host (systemd-creds, a shell): both at once, off the wake's critical path. A key
        # sealed at the park is used as it is when the launch has no other secret file.
        secret_files = plan.secret_file_contents(self.key)
        if presealed is not None and not secret_files:
            sealing = _sealed_already(presealed)
        else:
            sealing = ctl.launch_credentials_on(self.host, self.name, self.key, secret_files)
        (credentials, encrypted), confined = await asyncio.gather(
            sealing, ctl.engine_confinement(self.host, self.name, engine_location(engine), resolved.path, devices))
        self.secret_files = sorted(plan.secret_files)
        self._laps.lap("credentials and confinement")
        environment = {**confined.environment, **plan.environment, **gpu_order_environment(gpu_indices),
                       **self.spec.env}
        unit = TransientUnit(
            name=self.unit,
            description=f"CapyCTL deployment {self.name} (rev {self.revision.revision}, {engine.type}"
                        + ("; started at its park, held at its gate until a wake)" if gated else ")"),
            gated=gated,
            argv=plan.argv, environment=environment,
            credentials=credentials, encrypted_credentials=encrypted,
            credential_environment=plan.credential_environment(), **confined.unit_fields(),
            working_directory="/",  # engines need no cwd; state_dir may sit under a PrivateTmp path
            memory_max=self.spec.resources.ram, memory_high=None,
            cpu_quota=self.spec.resources.cpus, tasks_max=self.spec.resources.tasks_max,
            devices=devices,
            runtime_directory=engine_socket_runtime_directory(self.name) if plan.socket_path else None,
            private_network=plan.socket_path is not None,
            markers={"deployment": self.name, "revision": str(self.revision.revision), "launch": self.launch_id,
                     "port": str(self.port), **({"socket": plan.socket_path} if plan.socket_path else {}),
                     **({"gate": "armed"} if gated else {})})
        # Persist launch id and port before the unit exists: adoption needs them (the reason
        # stays: an armed park's is why it parked).
        self._set(self.state, self.reason)
        progress(f"starting unit {self.unit}" + (f" on host {self.host}" if self.remote else "")
                 + (" held at its gate" if gated else ""))
        self._unit_exited.clear()
        self._expect_exit = False
        await self.systemd.start_transient(unit)
        self._laps.lap("unit start")
        self._start_watch()
        await self._ensure_forward()

    async def _ensure_forward(self) -> None:
        """On a remote host, a local socket (or port) forwarded to the engine's socket (or loopback port) there."""
        if not self.remote:
            return
        hosts = self.controller
        if self.socket_path is not None:
            if not hosts.has_forward(self.host, self.local_socket):
                self.local_socket = await hosts.forward_socket(self.host, self.socket_path)
        elif self.port and not hosts.has_forward(self.host, self.local_port):
            self.local_port = await hosts.forward_port(self.host, self.port)

    async def _drop_forward(self) -> None:
        if self.local_port is not None:
            await self.controller.cancel_forward(self.host, self.local_port)
            self.local_port = None
        if self.local_socket is not None:
            await self.controller.cancel_forward(self.host, self.local_socket)
            self.local_socket = None

    def _model_label(self) -> str:
        m = self.spec.model
        return getattr(m, "hf", None) or getattr(m, "path", "")

    async def _wait_healthy(self, progress: Progress, timeout: float) -> None:
        adapter = self.controller.adapter(self.spec)
        base = self.upstream().base_url
        began = time.monotonic()
        last_note = began
        delay = HEALTH_POLL_S
        while True:
            if self._unit_exited.is_set():
                raise CapyError(f"the engine exited before it was healthy: {self.reason or 'see its journal'}",
                                code=self.reason_code or "engine_exited")
            if await adapter.health(self.controller.http, base, self.key):
                return
            now = time.monotonic()
            if now - began > timeout:
                raise asyncio.TimeoutError
            if now - last_note >= 5:
                progress(f"waiting for the engine's health check ({now - began:.0f}s)")
                last_note = now
            # The exit watcher wakes this loop at once. A loopback health probe costs about a
            # millisecond, so poll every 10 ms while a wake is young, as a script starting the
            # engine by hand would (half an interval is added to each wake on average: backing
            # off to 0.5 s cost ~0.5 s per wake, benchmarks/wake_vs_manual.py), and back off only
            # for long loads of big models.
            try:
                await asyncio.wait_for(self._unit_exited.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass
            if now - began > 2:
                delay = max(delay, 0.05)
            if now - began > 30:
                delay = min(delay * 1.5, 0.5)

    reason_code: str | None = None

    async def _fail(self, code: str, message: str) -> None:
        self.failures += 1
        self.failed_at = time.monotonic()
        self.reason_code = code
        try:
            self.journal = await self.controller.journal(self.unit, 20, self.host)
        except Exception:
            self.journal = []
        # A unit that failed to become healthy is stopped so it holds no memory.
        if not self._unit_exited.is_set():
            self._expect_exit = True
            try:
                await self.systemd.stop_unit(self.unit, self.spec.timeouts.stop)
            except CapyError:
                pass
        self.parked_in_place = False
        self._set(DeploymentState.FAILED, f"{code}: {message}")
        if self._wake_future is not None and not self._wake_future.done():
            self._wake_future.set_exception(Unavailable(message, code=code))

    # -- watching the unit ----------------------------------------------------------------------

    def _start_watch(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(self._watch(), name=f"watch:{self.name}")

    async def _watch(self) -> None:
        from ..systemd import failure_message, failure_reason
        try:
            systemd = self.systemd
            async for st in systemd.watch(self.unit):
                if st.active_state in ("failed", "inactive"):
                    if not self._expect_exit:
                        self.reason_code = failure_reason(st)
                        self.reason = f"{self.reason_code}: {failure_message(st)}"
                        self.submit(Command.UNIT_EXITED, code=self.reason_code, message=failure_message(st))
                    self._unit_exited.set()
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("deployment %s: watching %s failed", self.name, self.unit)

    async def _do_unit_exited(self, code: str, message: str) -> None:
        if self.state == DeploymentState.PARKED and not self.parked_in_place:
            self._armed = None  # the armed unit is gone: the wake starts one
        if self.state == DeploymentState.FAILED or (self.state in (DeploymentState.STOPPED, DeploymentState.PARKED, DeploymentState.STOPPING) and not self.parked_in_place):
            return
        await self._fail(code, message)

    async def _do_engine_unresponsive(self, launch_id: str | None, silent: float) -> None:
        """The liveness watchdog found the engine silent: fail the deployment and stop the unit
        (SIGTERM and SIGCONT, SIGKILL after a short grace), which cuts the
        requests in flight; the verdict, recorded first,
        tells the proxy what to answer them. The restart policy (backoff) applies as for a crash."""
        if self.state != DeploymentState.READY or launch_id != self.launch_id:
            return  # that launch is gone or no longer serving: nothing to judge
        error = self.liveness.condemn(launch_id, silent)
        if self.group is not None:
            await self._stop_group()  # every member, not only the head's unit
        else:  # a short grace before SIGKILL, not timeouts.stop: requests in flight wait for the exit
            self._expect_exit = True
            try:
                await self.systemd.stop_unit(self.unit, hung_stop_grace(self.spec.timeouts.stop))
            except CapyError as exc:
                log.warning("deployment %s: stopping the hung engine failed: %s", self.name, exc)
        await self._fail(error.code, error.message)

    # -- park and stop ----------------------------------------------------------------------------

    async def _drain(self, timeout: float, *, evicting: bool) -> None:
        if evicting and self.busy:
            raise Busy(f"deployment {self.name!r} has requests in flight or waiting", code="deployment_busy")
        try:
            await asyncio.wait_for(self._wait_in_flight_zero(), timeout=timeout)
        except asyncio.TimeoutError:
            raise Busy(f"deployment {self.name!r} still had {self.in_flight} request(s) in flight after "
                       f"{timeout:.0f}s", code="drain_timeout") from None

    async def _wait_in_flight_zero(self) -> None:
        # Requests that wait for a wake do not hold the engine; only those in flight do.
        while self.in_flight > 0:
            await asyncio.sleep(0.05)

    async def _do_park(self, evicting: bool = False, reason: str | None = None, in_place_ok: bool = True,
                       idle: bool = False) -> str:
        """``evicting``: refuse (Busy) rather than wait for requests in flight; ``idle``: the idle
        parker's, which evicts for nobody, so the next launch is sealed and armed as at a park by request."""
        if self.spec.park == "never" and evicting:
            raise Busy(f"deployment {self.name!r} has park: never", code="park_never")
        if self.group is not None:
            return await self._park_group(evicting, reason)
        if self.state == DeploymentState.PARKED and self.parked_in_place and not in_place_ok:
            await self._stop_unit()  # its weights held host RAM that another deployment needs
            self.parked_in_place = False
            self._set(DeploymentState.PARKED, reason)
            return self.state
        if self.state not in (DeploymentState.READY, DeploymentState.STARTING, DeploymentState.WAKING):
            return self.state
        adapter = self.controller.adapter(self.spec)
        tier = self.park_tier
        in_place = adapter.park_method(self.spec) == "in_place" and self.spec.park == "auto" and in_place_ok \
            and tier in TIER_SLEEP_LEVEL
        self._set(DeploymentState.PARKING, reason)
        try:
            await self._drain(self.spec.timeouts.park, evicting=evicting)
        except Busy:
            self._set(DeploymentState.READY)
            raise
        if in_place:
            try:
                await asyncio.wait_for(
                    adapter.park(self.controller.http, self.upstream().base_url, self.key, TIER_SLEEP_LEVEL[tier]),
                    timeout=self.spec.timeouts.park)
                self.parked_in_place = True
            except (CapyError, asyncio.TimeoutError) as exc:
                log.warning("deployment %s: in-place park failed (%s); stopping the unit", self.name, exc)
                in_place = False
        saved_cache = None
        if not in_place:
            saved_cache = await self._save_prompt_cache()
            await self._stop_unit()
            self.parked_in_place = False
        self.parks += 1
        self._set(DeploymentState.PARKED, reason)
        # What the park really released: memory NVML or the cgroup still shows stays charged.
        retained = await self.controller.retain_after_park(self) if in_place else {}
        self._save_park_record(tier=tier if in_place else RESTART, parked_at=wall_clock(), parked_in_place=in_place,
                               retained=retained, prompt_cache=saved_cache)
        if not in_place and (idle or not evicting):
            await self._preseal()
            if self._can_arm():
                await self._arm()
        return self.state

    def _prompt_cache_identity(self) -> dict:
        return prompt_cache.identity(self.model_path, engine_location(self.controller.engine_for(self.spec)),
                                     list(self.spec.engine_args))

    def _keeps_prompt_cache(self) -> bool:
        # Local only: the identity is read from the files as the daemon's host sees them.
        return not self.remote and self.controller.adapter(self.spec).keeps_prompt_cache(self.spec)

    async def _save_prompt_cache(self) -> dict | None:
        """Before a park stops the unit: the engine saves its prompt cache (_prompt_cache.py)."""
        if not self._keeps_prompt_cache():
            return None
        return await prompt_cache.save(
            self.controller.adapter(self.spec), self.controller.http, self.upstream().base_url, self.key,
            budget=self.spec.prompt_cache.disk, timeout=self.spec.timeouts.park,
            directory=prompt_cache.prompt_cache_dir(self.name), identity_now=self._prompt_cache_identity())

    async def _restore_prompt_cache(self, progress: Progress) -> None:
        """After a wake's health check, before any request is admitted."""
        saved = self.park_record.get("prompt_cache") or {}
        progress(f"restoring the prompt cache saved at the park ({saved.get('tokens', 0)} tokens)")
        result = await prompt_cache.restore(
            self.controller.adapter(self.spec), self.controller.http, self.upstream().base_url, self.key, saved,
            timeout=self.spec.timeouts.wake, directory=prompt_cache.prompt_cache_dir(self.name),
            identity_now=self._prompt_cache_identity())
        self._save_park_record(prompt_cache={**result, "at": wall_clock()})

    def _drop_prompt_cache(self) -> None:
        """A stop or delete: a cache saved at a park is not kept past it."""
        files = prompt_cache.pending_files(self.park_record)
        if files:
            prompt_cache.remove_files(prompt_cache.prompt_cache_dir(self.name), files)
            self._save_park_record(prompt_cache={"state": prompt_cache.DROPPED, "why": "the deployment was stopped",
                                                 "files": [], "tokens": 0})

    async def _preseal(self) -> None:
        """Seal the next launch's key now, while nobody waits, so the wake that restarts the unit
        skips systemd-creds (about 15 ms of a wake, benchmarks/wake_vs_manual.py). Only once the
        unit is stopped: the file is the one its key was read from. Not on an eviction, whose
        park another deployment's wake is waiting for; a failure here only means the wake seals."""
        key = new_engine_key()
        try:
            credentials, encrypted = await self.controller.launch_credentials_on(self.host, self.name, key, {})
        except (OSError, CapyError) as exc:
            log.info("deployment %s: the next launch's key was not sealed at the park (%s); the wake will",
                     self.name, exc)
            return
        self._presealed = _Presealed(self.host, key, credentials, encrypted)

    async def _stop_unit(self) -> None:
        self._armed = None
        self._expect_exit = True
        await self.systemd.stop_unit(self.unit, self.spec.timeouts.stop)
        self._unit_exited.set()
        # The unit is gone: its watch has nothing left to say, and what it still had queued
        # (the stop's own states) must not reach the next launch, which clears _expect_exit and
        # may start at once (an armed park does).
        if self._watch_task is not None and not self._watch_task.done():
            self._watch_task.cancel()
        self._watch_task = None
        await self._drop_forward()
        self.controller.release_port(self.name)

    def host_lost(self) -> None:
        """The host went offline: its bus connection is gone, so the unit watch on it is too.
        The state stays as it was (requests answer host_offline); reconciling after the
        reconnect adopts the unit again or fails the deployment."""
        if self._watch_task and not self._watch_task.done():
            self._watch_task.cancel()

    async def _do_stop(self) -> str:
        if self.group is not None:
            await self._stop_group()
        if self.state in (DeploymentState.STOPPED,):
            return self.state
        if self.state in (DeploymentState.READY, DeploymentState.STARTING, DeploymentState.WAKING, DeploymentState.PARKED, DeploymentState.FAILED):
            self._set(DeploymentState.STOPPING)
            try:
                await self._drain(self.spec.timeouts.park, evicting=False)
            except Busy:
                pass  # an explicit stop goes ahead after the grace time
            await self._stop_unit()
        self._drop_prompt_cache()
        self.parked_in_place = False
        self.failures = 0
        self._set(DeploymentState.STOPPED)
        return self.state

    async def _do_delete(self) -> str:
        await self._do_stop()
        if self._watch_task:
            self._watch_task.cancel()
        # The key files on the unit's host; an offline host keeps them until they are reused.
        self._presealed = None
        await self.controller.remove_secret_key_on(self.host, self.name)
        await self.controller.remove_secret_files_on(self.host, self.secret_files)
        return "deleted"

    async def _do_restore_parked(self) -> str:
        """Reconcile found it recorded parked and no unit of it running: parked by stopping."""
        if self.state == DeploymentState.STOPPED:
            self.parked_in_place = False
            self._set(DeploymentState.PARKED, self.reason)
        return self.state

    async def _do_failed_while_away(self) -> str:
        """Reconcile found its unit failed while no daemon watched it: failed, with no back-off
        (the next request retries at once)."""
        if self.state in RESTING:
            self.failed_at = time.monotonic() - RESTART_BACKOFF_MAX_S
            self.parked_in_place = False
            self._set(DeploymentState.FAILED, "the engine's unit failed while CapyCTL was not running")
        return self.state

    async def _do_adopt(self, unit_state: Any, runtime: Any) -> str:
        """Take over a unit a previous daemon started: no restart of a healthy engine."""
        self.launch_id = runtime.launch_id
        self.host = runtime.host
        self.port = runtime.port
        self.model_path = runtime.model_path
        self.socket_path = unit_state.markers.get("socket") or None
        self.key = await self.controller.read_secret_key_on(self.host, self.name)
        self.controller.claim_port(self.name, self.port, self.host)
        # After a reconnect the SSH master re-created the forward on the same local port.
        await self._ensure_forward()
        if self._watch_task and not self._watch_task.done():
            self._watch_task.cancel()
        self._watch_task = None
        engine = self.controller.engine_for(self.spec)
        adapter = self.controller.adapter(self.spec)
        self.capabilities = adapter.capabilities(engine, deployment=self.spec, model_path=self.model_path)
        if runtime.state == DeploymentState.PARKED and unit_state.markers.get("gate") == "armed":
            # Armed at a park by the previous daemon, which alone knew what it was planned with:
            # stopped, so the next wake starts a launch planned here.
            await self._stop_unit()
            self.parked_in_place = False
            self._set(DeploymentState.PARKED, "adopted")
            return self.state
        self._unit_exited.clear()
        self._expect_exit = False
        self._start_watch()
        if runtime.state == DeploymentState.PARKED:
            self.parked_in_place = True
            self._set(DeploymentState.PARKED, "adopted")
            return self.state
        try:
            await self._wait_healthy(no_progress, self.spec.timeouts.start)
        except (asyncio.TimeoutError, CapyError) as exc:
            await self._fail("adopt_failed", f"adopted unit is not healthy: {exc}")
            return self.state
        self._set(DeploymentState.READY)
        return self.state

    # -- multi-node groups ------------------------------------------------------------------------

    async def _wake_group(self, progress: Progress) -> str:
        """Start (head first) or wake the group; the head's API is this deployment's upstream.
        Group members are not budgeted by the scheduler: they are placed by ``hosts``."""

        started = time.monotonic()
        # Each member is budgeted on its host; idle deployments there make room (_memory.py). A
        # wait for room busy deployments hold that ends unserved leaves the group as it was.
        try:
            await self.controller.make_room(self, progress)
        except (RoomWaitTimeout, WakeCancelled):
            raise
        except CapyError as exc:
            await self._fail(exc.code, exc.message)
            raise
        try:
            if self.group is None or self.group.state == DeploymentState.FAILED:
                members = group_members(self)
                head = members[0].host
                self.members = UnitMembers(self)
                in_place = self.controller.adapter(self.spec).park_method(self.spec) == "in_place"
                self.group = ModelGroup(
                    self.name, self.controller.engine_kind(self.spec), members, self.members,
                    dist_port=await self.controller.free_port_on(head),
                    park_in_place=in_place and self.spec.park == "auto",
                    start_timeout=self.spec.timeouts.start, stop_timeout=self.spec.timeouts.stop)
            self.host = self.group.head.member.host
            self.socket_path = None  # group heads serve on TCP: their members must reach each other
            if self.group.state == DeploymentState.PARKED and self.group.park_in_place:
                self._set(DeploymentState.WAKING)
                progress("waking the group through its head")
                await asyncio.wait_for(self.group.wake(), timeout=self.spec.timeouts.wake)
            else:
                self.launch_id = secrets.token_hex(8)
                self._set(DeploymentState.STARTING if self.state in (DeploymentState.STOPPED, DeploymentState.FAILED) else DeploymentState.WAKING)
                progress(f"starting {len(self.group.launches)} members, the head on host {self.host}")
                await self.group.start()
            self.port = self.members.ports[0]
            self.local_port = self.members.head_local_port
        except asyncio.TimeoutError:
            await self._fail("wake_timeout", f"the group did not wake within {self.spec.timeouts.wake:.0f}s")
            raise Unavailable(f"deployment {self.name!r} did not wake in time", code="wake_timeout")
        except CapyError as exc:
            self._unit_exited.set()  # the group stopped its members itself
            await self._fail(exc.code, exc.message)
            raise
        self.parked_in_place = False
        if self._group_watch is None or self._group_watch.done():
            self._group_watch = asyncio.create_task(self._watch_group(self.group), name=f"group:{self.name}")
        self.failures = 0
        self.wakes += 1
        self._set(DeploymentState.READY)
        progress(f"ready in {time.monotonic() - started:.1f}s")
        return self.state

    async def _watch_group(self, group: Any) -> None:
        failure = await group.wait_failed()
        if group is self.group:
            self._unit_exited.set()
            self.submit(Command.UNIT_EXITED, code=failure.code, message=failure.message)

    async def _park_group(self, evicting: bool, reason: str | None) -> str:
        if self.state != DeploymentState.READY:
            return self.state
        self._set(DeploymentState.PARKING, reason)
        try:
            await self._drain(self.spec.timeouts.park, evicting=evicting)
        except Busy:
            self._set(DeploymentState.READY)
            raise
        if self.group.park_in_place:
            await asyncio.wait_for(self.group.park(), timeout=self.spec.timeouts.park)
        else:
            # Parked by stopping its members: the group stays, and the next wake starts it again.
            self._cancel_group_watch()
            await self.group.park()
            self._unit_exited.set()
        self.parked_in_place = self.group.park_in_place
        self.parks += 1
        self._set(DeploymentState.PARKED, reason)
        return self.state

    async def _stop_group(self) -> None:
        """Stop every member and forget the group (the next wake makes a new one)."""
        group, self.group = self.group, None
        self._cancel_group_watch()
        await group.stop()
        self._unit_exited.set()

    def _cancel_group_watch(self) -> None:
        if self._group_watch is not None:
            self._group_watch.cancel()
            self._group_watch = None

    # -- reporting --------------------------------------------------------------------------------

    def describe(self) -> dict:
        spec = self.spec
        return {
            "name": self.name, "state": self.state, "reason": self.reason, "revision": self.revision.revision,
            "engine": spec.engine, "unit": self.unit, "model": self._model_label(),
            "model_commit": self.model_commit, "port": self.port if self.state in RUNNING else None,
            "socket": self.socket_path if self.state in RUNNING or self.parked_in_place else None,
            "hosts": spec.hosts[:spec.nodes] if spec.nodes > 1
            else [self.host] if self.launch_id or not spec.hosts else spec.hosts,
            "host_state": self._host_state(), "in_flight": self.in_flight, "waiting": self.waiting,
            "last_used": self.last_used or None, "parked_in_place": self.parked_in_place,
            "armed": self._armed is not None,
            # Taking turns (_turns.py): its door closed while another deployment waits for its room.
            "door": "open" if self._door_mark is None else "closed",
            "wakes": self.wakes, "parks": self.parks, "aliases": spec.aliases,
            "park_tier": self.park_tier,
            "park_record": {k: v for k, v in self.park_record.items() if k != "reference"},
            "parsers": self.parsers(),
            # Members (units) serving against those the deployment has (`nodes`): DeploymentState.READY "1/1", "0/2".
            "members": {"ready": spec.nodes if self.state == DeploymentState.READY else 0, "desired": spec.nodes},
            "journal": self.journal if self.state == DeploymentState.FAILED else [],
        }

    def _host_state(self) -> str:
        return self.controller.host_state(self.host)

    async def close(self) -> None:
        self.liveness.stop()
        for task in (self._task, self._watch_task):
            if task and not task.done():
                task.cancel()
        for task in (self._task, self._watch_task):
            if task:
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
