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
  READY -> PARKED: its host was lost and it may move (on_host_loss: move); it wakes elsewhere.
  STOPPED -> READY: adopt, a unit a previous daemon started that is still healthy.

The table (TRANSITIONS) is the authority; the picture is its summary. A command that errs
half-way leaves the deployment FAILED rather than in a state no command is running. Requests
wait and enter through its Admission (_admission.py); its unit is its EngineUnit (_unit.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any, AsyncIterator, Callable

from ..config import replica_name, unit_name
from ..engines._tiers import RESTART, TIER_SLEEP_LEVEL
from ..errors import CapyError, Unavailable
from ..proxy.router import Upstream
from ..spec import DeploymentSpec
from ..store import Revision
from ._admission import Admission, Busy
from ._launch import PreparedUnit, spec_capabilities
from ._lifecycle import RESTING, Command, DeploymentState, InvalidTransition, QueuedCommand, allowed
from ._liveness import Liveness, hung_stop_grace
from ._members import GroupUnits
from ._park_modes import IN_PLACE, RESTART as RESTART_MODE, InvalidParkedTransition, Parked, parked_allowed
from ._parking import new_record as new_park_record, now as wall_clock, park_tier
from ._proof import WakeProof
from ._prompt_cache import PromptCacheKeeper
from ._report import describe
from ._services import DeploymentServices
from . import _timeline as phases
from ._timeline import Timeline
from ._turns import RoomWaitTimeout, WakeCancelled
from ._unit import EngineUnit
from ._upstream import UpstreamCache

log = logging.getLogger("capyctl.controller")

# How long a failed deployment refuses wakes before trying again (doubles per failure, capped).
RESTART_BACKOFF_S = 2.0
RESTART_BACKOFF_MAX_S = 300.0

Progress = Callable[[str], None]


def no_progress(_: str) -> None:
    """The progress of a command nobody watches."""


class DeploymentActor:
    def __init__(self, controller: DeploymentServices, revision: Revision, replica: int = 1) -> None:
        self.controller = controller
        self.revision = revision
        # Its index among its deployment's replicas (manifest `replicas`; 1: the deployment's own
        # name): the name of its unit, port, key, park record and ledger charge (config.replica_name).
        self.replica = replica
        self._name = replica_name(revision.deployment, replica)
        self.ready_since = 0.0  # wall-clock time it last became ready (replica scaling's idle clock)
        # A wake that adds a replica for load takes only free room or idle deployments' room: it
        # never waits for busy ones to yield theirs (Controller.make_room).
        self.waits_for_room = True
        self.state = DeploymentState.STOPPED  # written by _set alone
        self.reason: str | None = None
        self.journal: list[str] = []
        self.requests = Admission(self)  # who waits and who is inside (_admission.py)
        self.failures = 0
        self.failed_at = 0.0
        self.wakes = 0
        self.parks = 0
        # What the running launch is.
        self.launch_id: str | None = None
        # The host the unit runs on and the engine's port there (a remote one's SSH forward: EngineUnit).
        self.host: str = "local"
        self.port: int | None = None
        # An engine served on a unix socket (capyctl/proxy/connector.py): its path on the engine's host.
        self.socket_path: str | None = None
        # Names of the launch's secret files beside its environment file (SGLang's --config).
        self.secret_files: list[str] = []
        self.key: str | None = None
        self.model_path: str | None = None
        self.model_commit: str | None = revision.model_commit
        self.parked = Parked.NO  # how it is parked, while it is (_park_modes.py); written by _set_parked alone
        self.proof = WakeProof(self)
        self.prompt_cache = PromptCacheKeeper(self)  # kept across a park by stopping
        # The park record (tier reached, wake seconds, proof after wake, the proof's reference),
        # kept in the store across daemon restarts (_parking.py).
        self.park_record: dict[str, Any] = controller.load_park_record(self.name) or new_park_record(RESTART)
        # Known from the spec before any launch, so the proxy refuses a route the engine lacks
        # without waking the model; every launch refines it with the model's resolved path.
        self.capabilities: frozenset[str] = spec_capabilities(controller, revision.spec)
        self.served_model: str | None = None
        # The engine's command line and environment at the last launch (no secret: keys travel as
        # credentials), for `capyctl recipe run`'s launch of the same engine without CapyCTL.
        self.launch_command: dict | None = None
        self._upstream = UpstreamCache(self)
        self._commands: asyncio.Queue[QueuedCommand] = asyncio.Queue()
        self._queued_other_than_wake = 0  # queued commands that change course (see redirected)
        self._wake_for_requests = False  # the running wake was asked by requests (_do_wake)
        self._wake_future: asyncio.Future | None = None
        # The latest wake's phases until its first answer ends them (answered); the latest park's.
        self._wake_timeline: Timeline | None = None
        self.last_park_timeline: dict[str, Any] | None = None
        # The next launch armed after an eviction's park, beside the wake it made room for; the
        # next command waits for it (_run), so it is one more step of the park, not a second writer.
        self._arming: asyncio.Task | None = None
        # Its one systemd unit (a single-host deployment): launch, watch, stop, arming (_unit.py).
        self.engine_unit = EngineUnit(self)
        # A deployment with nodes > 1 is a group of units, one per host (see _members.py).
        self.groups = GroupUnits(self, self._group_failed)
        # Probes the engine while it is ready; a hung one is failed (see _liveness.py).
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
            Command.HOST_LOST: self._do_host_lost,
        }
        self._task = asyncio.create_task(self._run(), name=f"deployment:{self.name}")

    # -- identity ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def deployment(self) -> str:
        """The deployment it is a replica of (its own name for replica 1)."""
        return self.revision.deployment

    @property
    def sibling_names(self) -> tuple[str, ...]:
        """The other replicas of its deployment (the planner spreads them: _planner.py)."""
        return tuple(n for n in self.controller.replica_names(self.deployment) if n != self.name)

    @property
    def spec(self) -> DeploymentSpec:
        return self.revision.spec

    @property
    def unit(self) -> str:
        return unit_name(self.name)

    @property
    def has_pending_commands(self) -> bool:
        """A park, wake or stop is queued: the deployment is about to change."""
        return not self._commands.empty()

    @property
    def abandoned(self) -> bool:
        """The running wake was asked by requests and none waits any more (their clients left):
        a wait for room ends rather than evict someone to serve nobody."""
        return self._wake_for_requests and self.requests.waiting == 0

    @property
    def redirected(self) -> bool:
        """A command other than a wake (a stop, a park, a delete) waits behind the one running: a
        wake that waits for room gives way to it. Another wake only joins the one under way."""
        return self._queued_other_than_wake > 0

    @property
    def remote(self) -> bool:
        return self.host != "local"

    def upstream(self) -> Upstream:
        """Where the proxy sends this deployment's requests now (_upstream.py)."""
        return self._upstream.get()

    def engine_address(self) -> tuple[int | None, str | None]:
        """The engine's port and unix socket as reached from here: through the SSH forward if remote."""
        if self.socket_path is not None:
            return None, self.engine_unit.local_socket if self.remote else self.socket_path
        if not self.remote:
            return self.port, None
        return (self.groups.head_local_port if self.groups.exists else self.engine_unit.local_port), None

    @property
    def park_tier(self) -> str:
        """The tier this deployment parks at on its host (_parking.park_tier)."""
        return park_tier(self.controller, self.spec, self.host, self.park_record)

    @property
    def parked_in_place(self) -> bool:
        return self.parked == Parked.IN_PLACE

    def _set_parked(self, parked: Parked) -> None:
        """The one place the parked sub-state changes; the change must be in PARKED_TRANSITIONS."""
        if not parked_allowed(self.parked, parked):
            raise InvalidParkedTransition(f"deployment {self.name!r} may not go from parked {self.parked} to {parked}")
        if parked == Parked.NO and self.parked == Parked.ARMED:
            self.engine_unit.disarm()  # what the armed unit was planned with is of no use any more
        self.parked = parked

    def save_park_record(self, **changes: Any) -> None:
        self.park_record = {**self.park_record, **changes}
        self.controller.save_park_record(self.name, self.park_record)

    # -- requests (_admission.py; they never change state) ------------------------------------------

    @property
    def busy(self) -> bool:
        """Requests in flight or let in: it is not parked or evicted then."""
        return self.requests.busy

    @property
    def in_flight(self) -> int:
        return self.requests.in_flight

    @property
    def waiting(self) -> int:
        return self.requests.waiting

    @property
    def last_used(self) -> float:
        return self.requests.last_used

    def backoff(self) -> float:
        """How long a failed deployment refuses wakes (doubles per failure, capped)."""
        return min(RESTART_BACKOFF_S * 2 ** max(self.failures - 1, 0), RESTART_BACKOFF_MAX_S)

    def backoff_left(self) -> float:
        return self.backoff() - (time.monotonic() - self.failed_at)

    def request_wake(self) -> asyncio.Future:
        """A wake for the requests waiting at the door: the one under way, or a new one."""
        if self._wake_future is None or self._wake_future.done():
            self._wake_future = self.submit(Command.WAKE, progress=self.requests.tell_waiting, for_requests=True)
        return self._wake_future

    # -- commands -----------------------------------------------------------------------------

    def submit(self, command: Command, **args: Any) -> asyncio.Future:
        """Queue ``command`` for the actor's task; the future gives its handler's result."""
        command = Command(command)  # refuses a name that is no command at once, in the caller
        future = asyncio.get_running_loop().create_future()
        # A caller that stops waiting must not leave "exception never retrieved" noise behind.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._commands.put_nowait(QueuedCommand(command, future, args))
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
            if self._arming is not None:
                arming, self._arming = self._arming, None
                try:
                    await arming
                except Exception:  # arming is an optimisation (EngineUnit.arm): the park stands
                    log.exception("deployment %s: arming after its eviction failed", self.name)
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
            self._set(DeploymentState.FAILED, f"{error.code}: {command} failed: {error.message}")

    def _set(self, state: DeploymentState, reason: str | None = None) -> None:
        """The one place a deployment's state changes; the change must be in _lifecycle.TRANSITIONS."""
        if not allowed(self.state, state):
            raise InvalidTransition(f"deployment {self.name!r} may not go from {self.state} to {state}")
        if state != self.state:
            log.info("deployment %s: %s -> %s%s", self.name, self.state, state, f" ({reason})" if reason else "")
        if state == DeploymentState.READY and self.state != state:
            self.ready_since = time.time()
        self.state = state
        self.reason = reason
        if state != DeploymentState.READY and self._wake_timeline is not None:
            self._end_wake_timeline()  # it left ready before any answer: its timeline ends unanswered
        self.requests.state_changed()
        self.liveness.follow(state == DeploymentState.READY)
        self.controller.record_runtime(self.name, state, reason=reason, host=self.host, launch_id=self.launch_id,
                                       port=self.port, model_path=self.model_path)
        self.controller.on_state_change(self)

    # -- wake ---------------------------------------------------------------------------------

    async def _do_wake(self, progress: Progress = no_progress, for_requests: bool = False,
                       room_now_only: bool = False) -> str:
        """``for_requests``: asked by waiting requests (not by an operator), so a wait for room
        ends once none of them waits any more (``abandoned``). ``room_now_only``: a replica added
        for load, which takes free or idle room and never waits for busy deployments to yield."""
        self._wake_for_requests = for_requests
        self.waits_for_room = not room_now_only
        if self.state == DeploymentState.READY:
            return self.state
        if self.state == DeploymentState.FAILED and self.backoff_left() > 0:
            raise Unavailable(f"failed: {self.reason}", code="deployment_failed")
        if self.spec.nodes > 1:
            return await self._wake_group(progress)
        started = time.monotonic()
        self._end_wake_timeline()  # the previous wake's, if no answer came since
        self.engine_unit.timeline = timeline = Timeline(phases.WAKE)
        # A wake from a park is proven against what the model generated before it; a start records that.
        woken_from_park = self.state == DeploymentState.PARKED
        woken_in_place = False
        async with self._start_failures():
            await self.controller.make_room(self, progress, timeline)
            timeline.lap(phases.MAKE_ROOM)
            if self.state == DeploymentState.PARKED and self.parked_in_place and await self.engine_unit.active():
                self._set(DeploymentState.WAKING)
                await self.engine_unit.describe(DeploymentState.WAKING)
                progress("waking the engine in place")
                await IN_PLACE.wake(self)
                woken_in_place = True
                timeline.lap(phases.WAKE_IN_PLACE)
            else:
                self._set(DeploymentState.STARTING if self.state in (DeploymentState.STOPPED, DeploymentState.FAILED) else DeploymentState.WAKING)
                await RESTART_MODE.wake(self, progress, lambda: self._launch(progress))
            await self._wait_healthy(progress, self.spec.timeouts.start)
            timeline.lap(phases.HEALTH)
            restoring = not woken_in_place and self.prompt_cache.pending()
            if restoring:
                # A restart wake is a clean start of the same files: the requests go first. Its
                # proof waits for the next park, after the save (WakeProof.before_next_park).
                self.save_park_record(prompt_cache={**await self.prompt_cache.restore(progress), "at": wall_clock()})
                timeline.lap(phases.RESTORE_PROMPT_CACHE)
                self.proof.before_next_park(time.monotonic() - started)
            elif woken_from_park and not woken_in_place:
                # A wake that started the unit afresh is a clean start of the same files, as a cold
                # start is: the requests it woke for go first, its proof follows them.
                self.proof.after_requests(time.monotonic() - started)
            else:
                await self._prove(progress, woken_from_park, time.monotonic() - started)
                timeline.lap(phases.PROOF)
        self.failures = 0
        self.wakes += 1
        await self.engine_unit.describe(DeploymentState.READY)
        self._wake_timeline = timeline  # ended by the first answer (answered) or the next change
        self._set(DeploymentState.READY)
        log.info("deployment %s: ready in %.3fs, %s (%s)", self.name, time.monotonic() - started,
                 "woken from its park" if woken_from_park else "started", timeline)
        progress(f"ready in {time.monotonic() - started:.1f}s")
        return self.state

    def answered(self) -> None:
        """A client's request was answered (Admission.release): the first after a wake ends its
        timeline."""
        timeline = self._wake_timeline
        if timeline is not None and self.state == DeploymentState.READY:
            timeline.lap(phases.FIRST_ANSWER)
            self._end_wake_timeline()

    def _end_wake_timeline(self) -> None:
        """Keep the latest wake's timeline (the park record, the journal, /metrics), with its first
        answer if one came."""
        timeline, self._wake_timeline = self._wake_timeline, None
        if timeline is None:
            return
        timeline.end()
        record = timeline.record()
        self.save_park_record(last_wake=record)
        self.controller.timeline_recorded(self.name, record)
        log.info("deployment %s: wake timeline %s", self.name, timeline.journal_line())

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

    async def _prove(self, progress: Progress, woken_from_park: bool, wake_seconds: float) -> None:
        """At a start, record what the model generates for the proof prompt (once per revision and
        model); after a wake, generate it again and compare. A failed proof restarts the engine
        cleanly (a cold start is the floor, and its generation becomes the reference); after
        MAX_PROOF_FAILURES in a row the in-place park is turned off, with the reason."""
        failure = await self.proof.check(woken_from_park, wake_seconds)
        if failure is None:
            return
        progress("the wake failed its proof; restarting the engine")
        await self._restart_clean(progress)

    async def _do_restart_after_failed_proof(self, launch: str | None) -> str:
        if self.state != DeploymentState.READY or self.launch_id != launch:
            return self.state  # that launch is gone already
        self._set(DeploymentState.WAKING, "restarting: the wake failed its proof")
        try:
            await self.requests.drain(self.spec.timeouts.park, evicting=False)
        except Busy:
            pass  # as an explicit stop: the restart goes ahead after the grace time
        async with self._start_failures():
            await self._restart_clean(no_progress)
        await self.engine_unit.describe(DeploymentState.READY)
        self._set(DeploymentState.READY)
        return self.state

    async def _restart_clean(self, progress: Progress) -> None:
        """Stop the engine and start it again; its generation becomes the proof's reference."""
        await self.engine_unit.stop()
        await self._launch(progress)
        await self._wait_healthy(progress, self.spec.timeouts.start)
        self.proof.record_reference(await self.proof.generate())

    async def _launch(self, progress: Progress) -> None:
        await self.engine_unit.launch(progress, gated=False, prompt_cache_dir=self.prompt_cache.directory())

    def record_launch(self, prepared: PreparedUnit) -> None:
        """What a launch was planned with (EngineUnit.launch), recorded before its unit starts."""
        self.launch_id, self.port, self.key = prepared.launch_id, prepared.port, prepared.key
        self.model_path, self.model_commit = prepared.model_path, prepared.model_revision or self.model_commit
        self.socket_path, self.capabilities = prepared.socket_path, prepared.capabilities
        self.served_model, self.launch_command = prepared.served_model, prepared.launch_command
        self.secret_files = prepared.secret_files
        # Persisted before the unit exists: adoption needs the launch id and port (the reason
        # stays: an armed park's is why it parked).
        self._set(self.state, self.reason)

    async def _wait_healthy(self, progress: Progress, timeout: float) -> None:
        await self.engine_unit.wait_healthy(progress, timeout, self.upstream().base_url, self.key)

    async def _fail(self, code: str, message: str) -> None:
        self.failures += 1
        self.failed_at = time.monotonic()
        try:
            self.journal = await self.controller.journal(self.unit, 20, self.host)
        except Exception:
            self.journal = []
        # A unit that failed to become healthy is stopped so it holds no memory.
        await self.engine_unit.stop_failed(self.spec.timeouts.stop)
        self._set_parked(Parked.NO)
        self._set(DeploymentState.FAILED, f"{code}: {message}")
        if self._wake_future is not None and not self._wake_future.done():
            self._wake_future.set_exception(Unavailable(message, code=code))

    async def _do_unit_exited(self, code: str, message: str, launch: str | None = None) -> None:
        if launch is not None and launch != self.launch_id:
            return  # an earlier launch's unit (a park by stopping may have armed the next already)
        if self.parked == Parked.ARMED:
            self.engine_unit.disarm()  # the armed unit is gone: the wake starts one
            self._set_parked(Parked.STOPPED)
        if self.state == DeploymentState.FAILED or (self.state in (DeploymentState.STOPPED, DeploymentState.PARKED, DeploymentState.STOPPING) and not self.parked_in_place):
            return
        await self._fail(code, message)

    async def _do_engine_unresponsive(self, launch_id: str | None, silent: float) -> None:
        """The liveness watchdog found the engine silent: fail the deployment and stop the unit (SIGTERM
        and SIGCONT, SIGKILL after a short grace), which cuts the requests in flight; the verdict,
        recorded first, tells the proxy what to answer them. The restart policy applies as for a crash."""
        if self.state != DeploymentState.READY or launch_id != self.launch_id:
            return  # that launch is gone or no longer serving: nothing to judge
        error = self.liveness.condemn(launch_id, silent)
        if self.groups.exists:
            await self._stop_group()  # every member, not only the head's unit
        else:  # a short grace before SIGKILL, not timeouts.stop: requests in flight wait for the exit
            await self.engine_unit.stop_failed(hung_stop_grace(self.spec.timeouts.stop))
        await self._fail(error.code, error.message)

    # -- park and stop ----------------------------------------------------------------------------

    async def _do_park(self, evicting: bool = False, reason: str | None = None, in_place_ok: bool = True,
                       idle: bool = False) -> str:
        """``evicting``: refuse (Busy) rather than wait for requests in flight; ``idle``: the idle
        parker's, which evicts for nobody, so the next launch is sealed and armed as at a park by request."""
        if self.spec.park == "never" and evicting:
            raise Busy(f"deployment {self.name!r} has park: never", code="park_never")
        if self.groups.exists:
            return await self._park_group(evicting, reason)
        if self.state == DeploymentState.PARKED and self.parked_in_place and not in_place_ok:
            await self.engine_unit.stop()  # its weights held host RAM that another deployment needs
            self._set_parked(Parked.STOPPED)
            self._set(DeploymentState.PARKED, reason)
            return self.state
        if self.state != DeploymentState.READY:  # (between commands a deployment is at rest)
            return self.state
        # An eviction's timeline begins at the last answer: what the deployment did from then to
        # its park is the swap's idle time (its door may have closed meanwhile for another's wake).
        last_answer = self.requests.last_answer_at if evicting else None
        timeline = Timeline(phases.PARK, began_at=last_answer)
        if last_answer is not None:
            timeline.mark("last answer", last_answer)
            if self.requests.door_closed_at is not None:
                timeline.mark("door closed", self.requests.door_closed_at)
            timeline.lap(phases.WAIT_FOR_PARK)
        adapter = self.controller.adapter(self.spec)
        tier = self.park_tier
        in_place = adapter.park_method(self.spec) == "in_place" and self.spec.park == "auto" and in_place_ok \
            and tier in TIER_SLEEP_LEVEL
        self._set(DeploymentState.PARKING, reason)
        try:
            await self.requests.drain(self.spec.timeouts.park, evicting=evicting)
        except Busy:
            self._set(DeploymentState.READY)
            raise
        timeline.lap(phases.DRAIN)
        if in_place:
            in_place = await IN_PLACE.park(self, tier)  # else it parks by stopping
            timeline.lap(phases.PARK_IN_PLACE)
        kept = {} if in_place else await RESTART_MODE.park(self, timeline)
        self.parks += 1
        self._set(DeploymentState.PARKED, reason)
        # What the park really released: memory NVML or the cgroup still shows stays charged.
        retained = await self.controller.retain_after_park(self) if in_place else {}
        self.save_park_record(tier=tier if in_place else RESTART, parked_at=wall_clock(), parked_in_place=in_place,
                               retained=retained, prompt_cache=kept.get("prompt_cache"))
        if not in_place and (idle or not evicting):
            await RESTART_MODE.arm(self)
            timeline.lap(phases.ARM)
        elif not in_place:
            # An eviction: the wake it makes room for waits for this park to return, so the next
            # launch is armed after it (the deployment's next command waits for that).
            self._arming = asyncio.create_task(RESTART_MODE.arm(self), name=f"arm:{self.name}")
        self._keep_park_timeline(timeline)
        return self.state

    def _keep_park_timeline(self, timeline: Timeline) -> None:
        timeline.end()
        self.last_park_timeline = record = timeline.record()
        self.save_park_record(last_park=record)
        self.controller.timeline_recorded(self.name, record)
        log.info("deployment %s: park timeline %s", self.name, timeline.journal_line())

    def host_lost(self, host: str) -> None:
        """``host`` went offline: its bus connection is gone, so the unit watch on it is too. With
        on_host_loss: wait the state stays (requests answer host_offline) until reconcile adopts
        the unit after the reconnect; with move, the deployment leaves the host (HOST_LOST)."""
        self.engine_unit.cancel_watch()
        if self.spec.on_host_loss == "move":  # one-host deployments only (the manifest refuses a group's)
            self.submit(Command.HOST_LOST, host=host)

    async def _do_host_lost(self, host: str) -> str:
        """Forget the unit on the lost host (Controller.reconcile stops it when the host is back;
        nothing reaches it meanwhile but that host's SSH connection) and wake elsewhere if serving."""
        if self.host != host or not (self.state == DeploymentState.READY or self.parked_in_place):
            return self.state  # not placed there: a wake under way fails or places it elsewhere
        serving = self.state == DeploymentState.READY
        await self.engine_unit.abandon()
        self.launch_id = None  # no unit of it is to be adopted there
        self._set_parked(Parked.STOPPED)
        self._set(DeploymentState.PARKED, f"host {host!r} was lost; it starts on another host at its next wake")
        if serving:
            self.submit(Command.WAKE)  # as before the loss; waiting requests join it
        return self.state

    async def _do_stop(self) -> str:
        if self.groups.exists:
            await self._stop_group()
        if self.state == DeploymentState.STOPPED:
            return self.state
        self._set(DeploymentState.STOPPING)
        try:
            await self.requests.drain(self.spec.timeouts.park, evicting=False)
        except Busy:
            pass  # an explicit stop goes ahead after the grace time
        await self.engine_unit.stop()
        dropped = self.prompt_cache.drop()
        if dropped is not None:
            self.save_park_record(prompt_cache=dropped)
        self._set_parked(Parked.NO)
        self.failures = 0
        self._set(DeploymentState.STOPPED)
        return self.state

    async def _do_delete(self) -> str:
        await self._do_stop()
        self.engine_unit.cancel_watch()
        # The key files on the unit's host; an offline host keeps them until they are reused.
        self.engine_unit.forget_presealed()
        await self.controller.remove_secret_key_on(self.host, self.name)
        await self.controller.remove_secret_files_on(self.host, self.secret_files)
        return "deleted"

    async def _do_restore_parked(self) -> str:
        """Reconcile found it recorded parked and no unit of it running: parked by stopping."""
        if self.state == DeploymentState.STOPPED:
            self._set_parked(Parked.STOPPED)
            self._set(DeploymentState.PARKED, self.reason)
        return self.state

    async def _do_failed_while_away(self) -> str:
        """Reconcile found its unit failed while no daemon watched it: failed, with no back-off
        (the next request retries at once)."""
        if self.state in RESTING:
            self.failed_at = time.monotonic() - RESTART_BACKOFF_MAX_S
            self._set_parked(Parked.NO)
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
        await self.engine_unit.ensure_forward()
        self.engine_unit.cancel_watch()
        engine = self.controller.engine_for(self.spec)
        adapter = self.controller.adapter(self.spec)
        self.capabilities = adapter.capabilities(engine, deployment=self.spec, model_path=self.model_path)
        armed = runtime.state == DeploymentState.PARKED and unit_state.markers.get("gate") == "armed"
        if armed or runtime.state in (DeploymentState.PARKING, DeploymentState.WAKING, DeploymentState.STOPPING):
            # Armed at a park by the previous daemon, which alone knew what it was planned with; or
            # cut short in a park, wake or stop, so that its engine may sleep though it answers its
            # health check (vLLM's /health does): stopped, and the next wake starts it afresh.
            await RESTART_MODE.adopt(self)
            stopping = runtime.state == DeploymentState.STOPPING
            if not stopping:
                self._set_parked(Parked.STOPPED)
            self._set(DeploymentState.STOPPED if stopping else DeploymentState.PARKED, "adopted")
            return self.state
        if runtime.state == DeploymentState.PARKED:
            await IN_PLACE.adopt(self)
            self._set(DeploymentState.PARKED, "adopted")
            return self.state
        self.engine_unit.adopted()
        try:
            await self._wait_healthy(no_progress, self.spec.timeouts.start)
        except (asyncio.TimeoutError, CapyError) as exc:
            await self._fail("adopt_failed", f"adopted unit is not healthy: {exc}")
            return self.state
        await self.engine_unit.describe(DeploymentState.READY)
        self._set(DeploymentState.READY)
        return self.state

    # -- multi-node groups ------------------------------------------------------------------------

    async def _wake_group(self, progress: Progress) -> str:
        """Start (head first) or wake the group; the head's API is this deployment's upstream.
        Each member is budgeted on its host; idle deployments there make room (_memory.py)."""
        started = time.monotonic()
        try:
            await self.controller.make_room(self, progress)
        except (RoomWaitTimeout, WakeCancelled):
            raise  # a wait for room busy deployments hold that ends unserved leaves it as it was
        except CapyError as exc:
            await self._fail(exc.code, exc.message)
            raise
        try:
            await self.groups.prepare()
            self.host = self.groups.head_host
            self.socket_path = None  # group heads serve on TCP: their members must reach each other
            if self.groups.parked_in_place:
                self._set(DeploymentState.WAKING)
                progress("waking the group through its head")
                await self.groups.wake(self.spec.timeouts.wake)
            else:
                self.launch_id = secrets.token_hex(8)
                self._set(DeploymentState.STARTING if self.state in (DeploymentState.STOPPED, DeploymentState.FAILED)
                          else DeploymentState.WAKING)
                progress(f"starting {self.groups.size} members, the head on host {self.host}")
                await self.groups.start()
            self.port = self.groups.head_port
        except asyncio.TimeoutError:
            await self._fail("wake_timeout", f"the group did not wake within {self.spec.timeouts.wake:.0f}s")
            raise Unavailable(f"deployment {self.name!r} did not wake in time", code="wake_timeout")
        except CapyError as exc:
            self.engine_unit.mark_exited()  # the group stopped its members itself
            await self._fail(exc.code, exc.message)
            raise
        self._set_parked(Parked.NO)
        self.groups.watch()
        self.failures = 0
        self.wakes += 1
        self._set(DeploymentState.READY)
        progress(f"ready in {time.monotonic() - started:.1f}s")
        return self.state

    def _group_failed(self, failure: CapyError) -> None:
        self.engine_unit.mark_exited()
        self.submit(Command.UNIT_EXITED, code=failure.code, message=failure.message)

    async def _park_group(self, evicting: bool, reason: str | None) -> str:
        if self.state != DeploymentState.READY:
            return self.state
        self._set(DeploymentState.PARKING, reason)
        try:
            await self.requests.drain(self.spec.timeouts.park, evicting=evicting)
        except Busy:
            self._set(DeploymentState.READY)
            raise
        self._set_parked(Parked.IN_PLACE if await self.groups.park(self.spec.timeouts.park) else Parked.STOPPED)
        if not self.parked_in_place:
            self.engine_unit.mark_exited()
        self.parks += 1
        self._set(DeploymentState.PARKED, reason)
        return self.state

    async def _stop_group(self) -> None:
        await self.groups.stop()
        self.engine_unit.mark_exited()

    # -- reporting --------------------------------------------------------------------------------

    def describe(self) -> dict:
        return describe(self)

    async def close(self) -> None:
        self.liveness.stop()
        if self._arming is not None:
            self._arming.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._arming
        # Cancelled again until it ends: on Python 3.11 a cancel that lands as an awaited
        # wait_for completes is lost (CPython gh-86296), and the task would wait for a command.
        while not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            self._task.result()
        await self.engine_unit.close()
