"""A deployment's lifecycle (capyctl/controller/_lifecycle.py) and the actor that keeps it
(capyctl/controller/_actor.py).

The table's own shape is checked plainly. Then a hypothesis state machine drives random command
sequences against the real Controller and actors: deploy, park, wake, stop, the engine's unit
exiting on its own (now, or as it starts), a daemon restart (once all is quiet, with units that
fail while no daemon runs, or cut short in the middle of a command), and client requests sent
beside every command so that requests and commands interleave.
What stands in for the outside: systemd (``FakeSystemd`` below, which models units, their
states, their watches and their markers), the engine's HTTP side (health, vLLM's sleep and
wake_up, answered from the fake unit's state), one 80 GiB card (tests/fakes/fake_nvml.py), and
the proof after a wake (it needs a served model), as in tests/unit/test_turns.py.

What it asserts:
- every change of state a listener (``Controller.subscribe``) sees is in the table
  (``_lifecycle.allowed``); no command or request ever answers ``invalid_transition`` or
  ``internal_error``;
- once a rule has settled (no command queued or running), every deployment rests (``RESTING``),
  with no request counted in flight or waiting, and its unit agrees with its state (a ready one's
  unit runs its launch, a stopped or failed one has none running, ...);
- no request is lost: each is served or refused with a stable error code, within a bound (and,
  every engine here being healthy in 20 ms, never with wake_timeout, drain_timeout or unit_exists);
- after a daemon restart each recorded deployment is back, in the state its unit calls for.

Sequences it found that fail are replayed at the end of this file, as hypothesis printed them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import io
import os
import re
import shutil
import sys
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from capyctl.config import DaemonConfig, Paths, unit_name
from capyctl.controller import _actor, _lifecycle
from capyctl.controller._actor import DeploymentActor
from capyctl.controller._lifecycle import RESTING, TRANSITIONS, DeploymentState, allowed
from capyctl.controller._proof import WakeProof
from capyctl.errors import CapyError, EngineError, SystemdError
from capyctl.proxy.connector import label_of
from capyctl.scheduler import _model as scheduler_model
from capyctl.spec import EngineSpec, parse_manifest
from capyctl.systemd import UnitState

S = DeploymentState
GiB = 1 << 30
ARM_PARKED_ENV = "CAPYCTL_ARM_PARKED"  # "0": a park by stopping does not arm the next launch


# -- the table ---------------------------------------------------------------------------------------


def test_the_scheduler_knows_the_same_states_as_the_lifecycle():
    values = [state.value for state in DeploymentState]
    assert list(scheduler_model.STATES) == values
    assert set(typing.get_args(scheduler_model.State)) == set(values)


def test_every_state_has_a_row_and_rows_name_only_states():
    assert set(TRANSITIONS) == set(DeploymentState)
    for old, row in TRANSITIONS.items():
        assert row <= set(DeploymentState), old
    assert RESTING <= set(DeploymentState)


def test_failed_is_reachable_from_every_state_and_staying_is_always_allowed():
    for state in DeploymentState:
        assert allowed(state, S.FAILED), state
        assert allowed(state, state), state


def test_the_parked_sub_state_has_a_row_for_each_and_leads_back_to_not_parked():
    from capyctl.controller._park_modes import PARKED_TRANSITIONS, Parked, parked_allowed
    assert set(PARKED_TRANSITIONS) == set(Parked)
    for old, row in PARKED_TRANSITIONS.items():
        assert row <= set(Parked) and old not in row
        assert parked_allowed(old, old)
        assert Parked.NO in row or old == Parked.NO  # every way of parking ends in a wake, stop or failure
    # Arming needs a stopped unit; an engine asleep in place is never armed; a stopped unit does
    # not fall asleep.
    for old, new in ((Parked.NO, Parked.ARMED), (Parked.IN_PLACE, Parked.ARMED), (Parked.STOPPED, Parked.IN_PLACE),
                     (Parked.ARMED, Parked.IN_PLACE)):
        assert not parked_allowed(old, new), (old, new)


async def test_the_actor_refuses_a_parked_sub_state_change_its_table_does_not_allow(tmp_path):
    from capyctl.controller._park_modes import InvalidParkedTransition, Parked
    from capyctl.spec import parse_manifest
    from tests.controllers import vllm_controller

    class _Systemd:
        async def watch(self, name):
            await asyncio.Event().wait()
            yield  # pragma: no cover

    async with vllm_controller(tmp_path, _Systemd()) as (ctl, model):
        actor = await ctl.deploy(parse_manifest(f"name: a\nengine: vllm\nmodel: {{path: {model}}}\n"))
        with pytest.raises(InvalidParkedTransition) as refused:
            actor._set_parked(Parked.ARMED)
        assert refused.value.code == "invalid_parked_transition" and actor.parked == Parked.NO
        actor._set_parked(Parked.STOPPED)
        actor._set_parked(Parked.ARMED)
        assert actor.describe()["armed"] is True and actor.describe()["parked"] == "armed"


def test_some_changes_are_not_allowed():
    assert not allowed(S.PARKED, S.READY)  # a wake goes through WAKING
    assert not allowed(S.STOPPED, S.STOPPING)
    assert not allowed(S.STARTING, S.PARKED)
    assert not allowed(S.STOPPING, S.READY)
    assert not allowed(S.PARKING, S.STOPPED)
    # and some that are, which the actor's handlers rely on
    assert allowed(S.STOPPED, S.READY)  # adopt
    assert allowed(S.PARKING, S.READY)  # a park that found requests it may not wait for
    assert allowed(S.READY, S.WAKING)  # the proof after a wake failed


def test_every_state_is_reachable_from_stopped_and_every_state_leads_to_rest():
    def reachable(start):
        seen, todo = {start}, [start]
        while todo:
            for nxt in TRANSITIONS[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert reachable(S.STOPPED) == set(DeploymentState)
    for state in DeploymentState:
        assert reachable(state) & RESTING, state
        # a command that entered a passing state can always end it in a resting one
        if state not in RESTING:
            assert TRANSITIONS[state] & RESTING, state


# -- the stand-ins -------------------------------------------------------------------------------------

_BUSY = frozenset({"active", "activating", "reloading", "deactivating"})
_DONE = frozenset({"inactive", "failed"})
ENGINE_LOAD_S = 0.02  # from the engine's start to its first healthy answer
ENGINE_CRASH_S = 0.005  # an engine that exits as it starts does so this long after
UNIT_STOP_S = 0.001  # from SIGTERM to the unit's exit


@dataclass
class _Unit:
    name: str
    markers: dict[str, str]
    description: str
    gated: bool
    active_state: str = "active"
    sub_state: str = "running"
    result: str = "success"
    exec_main_code: int = 0
    exec_main_status: int = 0
    # The engine inside (what its HTTP routes answer): healthy from this loop time, asleep after a park.
    healthy_at: float = float("inf")
    asleep: bool = False
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # set when a stop job ends

    def snapshot(self) -> UnitState:
        return UnitState(name=self.name, active_state=self.active_state, sub_state=self.sub_state,
                         load_state="loaded", result=self.result, exec_main_code=self.exec_main_code,
                         exec_main_status=self.exec_main_status, markers=dict(self.markers),
                         control_group=f"/capyctl.slice/{self.name}", description=self.description)


@dataclass
class FakeSystemd:
    """systemd's D-Bus client as the controller uses it (capyctl/systemd/_client.py), for one host.

    Modelled: transient units that start active (a gated one held at its gate until ``open_gate``),
    their markers read back through ``list_units``/``unit_state``; ``stop_unit`` takes a unit
    through deactivating to inactive and unloads it (CollectMode=inactive), while a unit that
    failed stays loaded as failed until the next start of its name resets it (and a stop leaves it
    so); ``start_transient`` refuses a name that is still running (unit_exists); ``watch`` yields
    the unit's state now and every later change, asynchronously through a queue as D-Bus signals
    arrive, and ends when the unit is unloaded. ``exit`` is the engine exiting on its own (the unit
    fails); names in ``crash_at_start`` fail that way just after their engine next starts.
    Not modelled: start jobs and their timeouts, cgroups and memory (None), the journal."""

    units: dict[str, _Unit] = field(default_factory=dict)
    crash_at_start: set[str] = field(default_factory=set)
    _watchers: dict[str, set[asyncio.Queue]] = field(default_factory=dict)
    _timers: list[asyncio.TimerHandle] = field(default_factory=list)
    # What happened to units and engines (and, told by the test, to deployments), counted: a
    # test may wait for the n-th (``cut_at``) to cut the daemon short right there.
    happenings: int = 0
    cut_at: int | None = None
    cut: asyncio.Event = field(default_factory=asyncio.Event)

    def happened(self) -> None:
        self.happenings += 1
        if self.cut_at is not None and self.happenings >= self.cut_at:
            self.cut.set()

    # -- what the controller calls
    async def unit_state(self, name: str) -> UnitState | None:
        unit = self.units.get(name)
        return unit.snapshot() if unit else None

    async def list_units(self, pattern: str = "capyctl-*.service") -> list[UnitState]:
        return [u.snapshot() for name, u in sorted(self.units.items()) if fnmatch.fnmatchcase(name, pattern)]

    async def start_transient(self, unit, *, timeout: float = 60.0) -> UnitState:
        await asyncio.sleep(0)
        existing = self.units.get(unit.name)
        if existing is not None:
            if existing.active_state in _BUSY:
                raise SystemdError(f"{unit.name} is already {existing.active_state}.", code="unit_exists", status=409)
            self._unload(unit.name)  # reset-failed of a leftover
        started = self.units[unit.name] = _Unit(unit.name, dict(unit.markers), unit.description, unit.gated)
        self.happened()
        if not unit.gated:
            self._engine_starts(started)
        self._publish(started)
        return started.snapshot()

    async def open_gate(self, name: str, settle: float = 1.0) -> bool:
        unit = self.units.get(name)
        if unit is None or unit.active_state != "active" or not unit.gated:
            return False
        unit.gated = False
        self._engine_starts(unit)
        self.happened()
        return True

    async def stop_unit(self, name: str, timeout: float = 30.0) -> UnitState | None:
        unit = self.units.get(name)
        if unit is None or unit.active_state in _DONE:
            return unit.snapshot() if unit else None
        if unit.active_state != "deactivating":
            # The stop job: it goes on whether or not its caller waits for it (a second stop joins it).
            unit.active_state, unit.sub_state = "deactivating", "stop-sigterm"
            self._publish(unit)
            self._timers.append(asyncio.get_running_loop().call_later(UNIT_STOP_S, self._stopped, unit))
            self.happened()
        await unit.stopped.wait()
        return unit.snapshot()

    async def watch(self, name: str):
        queue: asyncio.Queue = asyncio.Queue()
        self._watchers.setdefault(name, set()).add(queue)
        try:
            unit = self.units.get(name)
            if unit is not None:
                yield unit.snapshot()
            while True:
                state = await queue.get()
                if state is None:  # unloaded
                    return
                yield state
        finally:
            self._watchers[name].discard(queue)

    async def reset_failed(self, name: str) -> None:
        unit = self.units.get(name)
        if unit is not None and unit.active_state == "failed":
            self._unload(name)

    async def set_description(self, name: str, description: str) -> None:
        unit = self.units.get(name)
        if unit is None:
            raise SystemdError(f"{name} is not loaded", code="unit_not_found", status=404)
        unit.description = description

    async def memory_current(self, name: str) -> int | None:
        return None

    async def memory_peak(self, name: str) -> int | None:
        return None

    async def unit_of_pid(self, pid: int) -> str | None:
        return None

    # -- what the test does to it
    def exit(self, name: str, status: int = 1) -> bool:
        """The unit's main process exits with ``status`` on its own: the unit fails."""
        unit = self.units.get(name)
        if unit is None or unit.active_state != "active":
            return False
        unit.active_state, unit.sub_state, unit.result = "failed", "failed", "exit-code"
        unit.exec_main_code, unit.exec_main_status = 1, status
        self._publish(unit)
        self.happened()
        return True

    def active(self, name: str) -> _Unit | None:
        unit = self.units.get(name)
        return unit if unit is not None and unit.active_state in _BUSY else None

    def engine(self, base_url: str) -> _Unit | None:
        """The unit whose engine a base URL made by the actor reaches (its launch label)."""
        launch = label_of(base_url).partition(".")[0]
        for unit in self.units.values():
            if unit.markers.get("launch") == launch:
                return unit
        return None

    def cancel_timers(self) -> None:
        for timer in self._timers:
            timer.cancel()

    def _engine_starts(self, unit: _Unit) -> None:
        loop = asyncio.get_running_loop()
        unit.healthy_at = loop.time() + ENGINE_LOAD_S
        if unit.name in self.crash_at_start:
            self.crash_at_start.discard(unit.name)
            self._timers.append(loop.call_later(ENGINE_CRASH_S, self.exit, unit.name, 139))

    def _stopped(self, unit: _Unit) -> None:
        unit.active_state, unit.sub_state, unit.result = "inactive", "dead", "success"
        self._publish(unit)
        if self.units.get(unit.name) is unit:
            self._unload(unit.name)
        unit.stopped.set()
        self.happened()

    def _publish(self, unit: _Unit) -> None:
        for queue in self._watchers.get(unit.name, ()):
            queue.put_nowait(unit.snapshot())

    def _unload(self, name: str) -> None:
        self.units.pop(name, None)
        for queue in self._watchers.get(name, ()):
            queue.put_nowait(None)


_systemd: FakeSystemd | None = None  # the running example's, for the engine's fake routes


async def _engine_health(self, session, base_url, key) -> bool:
    # As vLLM's /health: the server answers once it is up, asleep or not (sleep mode frees the
    # weights, not the process).
    unit = _systemd.engine(base_url) if _systemd else None
    return unit is not None and unit.active_state == "active" and not unit.gated \
        and asyncio.get_running_loop().time() >= unit.healthy_at


async def _engine_sleep(self, session, base_url, key, level) -> None:
    unit = _systemd.engine(base_url) if _systemd else None
    if unit is None or unit.active_state != "active" or unit.gated:
        raise EngineError("vLLM sleep: no engine answered", code="park_failed")
    unit.asleep = True  # the engine acts on the call as it arrives, whether or not its caller waits on
    _systemd.happened()
    await asyncio.sleep(0.002)


async def _engine_wake_up(self, session, base_url, key, level, model_path=None) -> None:
    unit = _systemd.engine(base_url) if _systemd else None
    if unit is None or unit.active_state != "active":
        raise EngineError("vLLM wake: no engine answered", code="wake_failed")
    unit.asleep = False
    _systemd.happened()
    if unit.name in _systemd.crash_at_start:
        _systemd._engine_starts(unit)  # it exits as it wakes
    await asyncio.sleep(0.002)


# -- the machine ---------------------------------------------------------------------------------------

NAMES = ("a", "b", "c")  # a parks in place (vLLM's sleep), b and c by stopping; any two fit the card
REQUEST_HOLD_S = 0.015
# Longer than any wait a request may be made to do: swap.wait_max (1.5 s) + timeouts.wake (2 s).
REQUEST_BOUND_S = 10.0
COMMAND_BOUND_S = 20.0
SETTLE_BOUND_S = 15.0
STEP_BOUND_S = 60.0  # a whole rule: past the bounds above, something waits that nothing bounds
BAD_CODES = {"internal_error", "invalid_transition"}
# Every engine here answers its health check 20 ms after it starts, every request is answered in
# 15 ms and only the daemon starts units: a wake that timed out or a park still waiting for requests
# after timeouts.park was stuck, and a start refused because the unit already runs lost track of it.
STUCK_CODES = {"wake_timeout", "drain_timeout", "unit_exists"}
STABLE_CODE = re.compile(r"[a-z][a-z0-9_]*")
traffic = st.lists(st.sampled_from(NAMES), max_size=4)
lead = st.sampled_from([0.0, 0.002, 0.03])  # how long requests go first
operations = st.tuples(st.sampled_from(["deploy", "park", "wake", "stop", "exit"]), st.sampled_from(NAMES))

SEEN: set[tuple[str, str]] = set()  # every change of state seen, across examples
ANSWERS: dict[str, int] = {}  # request outcomes, across examples


def _manifest(name: str, model: Path, variant: int):
    return parse_manifest(
        f"name: {name}\nengine: vllm\nmodel: {{path: {model}}}\n"
        f"resources: {{gpus: 1, gpu_memory: 30GiB, ram: 1GiB}}\n"
        f"park: {'auto' if name == 'a' else 'stop'}\n"
        + ("queue: 2\n" if name == "b" else "")
        + "timeouts: {start: 2s, wake: 2s, park: 1s, stop: 1s}\n"
        f"env: {{VARIANT: '{variant}'}}\n")


def _counting_handlers(init):
    """DeploymentActor.__init__, and each command handler wrapped to count itself while it runs:
    a rule has settled when no actor has a command queued or running."""

    def wrapped_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.lifecycle_test_running = 0
        for command, handler in list(self._handlers.items()):
            self._handlers[command] = _counted(self, handler)

    return wrapped_init


def _counted(actor, handler):
    async def run(**args):
        actor.lifecycle_test_running += 1
        try:
            return await handler(**args)
        finally:
            actor.lifecycle_test_running -= 1
    return run


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        global _systemd
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = Path(tempfile.mkdtemp(prefix="capyctl-lifecycle-"))
        self.systemd = _systemd = FakeSystemd()
        from capyctl.store import Store
        (self.tmp / "state").mkdir()
        self.store = Store(self.tmp / "state" / "state.db")
        venv = self.tmp / "venv"
        (venv / "bin").mkdir(parents=True)
        self.store.put_engine(EngineSpec.model_validate(
            {"kind": "engine", "name": "vllm", "type": "vllm", "path": str(venv)}))
        self.model = self.tmp / "model"
        self.model.mkdir()
        self.config = DaemonConfig()
        self.config.paths = Paths(state_dir=self.tmp / "state", runtime_dir=self.tmp / "run")
        self.config.swap_quantum, self.config.swap_wait_max = 0.3, 1.5
        self.config.idle_park_after = None
        self.problems: list[str] = []
        self.history: list[str] = []
        self.last: dict[int, tuple[DeploymentActor, DeploymentState]] = {}
        self.variants: dict[str, int] = {}
        self._env = os.environ.get(ARM_PARKED_ENV)
        self._backoff = _actor.RESTART_BACKOFF_S
        self.ctl = None
        self.loop.run_until_complete(self._start_daemon())

    def teardown(self) -> None:
        global _systemd
        try:
            if self.ctl is not None:
                before = len(self.problems)
                self.loop.run_until_complete(self._bounded(self.ctl.close()))
                if len(self.problems) > before:  # (problems before it were raised by the rule)
                    raise AssertionError("\n".join(self.problems[before:]))
        finally:
            self.systemd.cancel_timers()
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            self.store.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            _systemd = None
            _actor.RESTART_BACKOFF_S = self._backoff
            if self._env is None:
                os.environ.pop(ARM_PARKED_ENV, None)
            else:
                os.environ[ARM_PARKED_ENV] = self._env

    # -- plumbing
    async def _start_daemon(self) -> None:
        from capyctl.controller import Controller
        self.ctl = Controller(self.config, self.store, self.systemd)
        self.ctl.subscribe(self._observe)
        await self.ctl.start()

    def _observe(self, actor: DeploymentActor) -> None:
        old = self.last.get(id(actor), (actor, S.STOPPED))[1]  # an actor is born STOPPED
        new = actor.state
        if new != old:
            self.history.append(f"{actor.name}: {old} -> {new} ({actor.reason})")
            SEEN.add((str(old), str(new)))
            self.systemd.happened()
            if not _lifecycle.allowed(old, new):
                self.problems.append(f"{actor.name} went from {old} to {new}, which the table does not allow")
        self.last[id(actor)] = (actor, new)

    def _error(self, what: str, exc: CapyError) -> None:
        code, cause = exc.code, (exc.detail or {}).get("cause") if isinstance(exc.detail, dict) else None
        if code in BAD_CODES | STUCK_CODES or cause in BAD_CODES | STUCK_CODES \
                or not STABLE_CODE.fullmatch(code or ""):
            self.problems.append(f"{what} failed with {code}" + (f" (cause {cause})" if cause else "")
                                 + f": {exc.message}")

    async def _request(self, name: str) -> None:
        served = False
        try:
            async with asyncio.timeout(REQUEST_BOUND_S) as bound:
                async with self.ctl.acquire(name) as upstream:
                    if upstream.deployment != name:
                        self.problems.append(f"a request to {name} was sent to {upstream.deployment}")
                    await asyncio.sleep(REQUEST_HOLD_S)
                served = True
        except TimeoutError:
            if bound.expired():
                self.problems.append(f"a request to {name} was neither served nor refused in {REQUEST_BOUND_S}s")
            else:
                self.problems.append(f"a request to {name} raised TimeoutError")
        except CapyError as exc:
            ANSWERS[exc.code] = ANSWERS.get(exc.code, 0) + 1
            self._error(f"a request to {name}", exc)
        except Exception as exc:  # noqa: BLE001 - anything else is lost
            self.problems.append(f"a request to {name} raised {exc!r}")
        if served:
            ANSWERS["served"] = ANSWERS.get("served", 0) + 1

    async def _command(self, what: str, make) -> None:
        try:
            async with asyncio.timeout(COMMAND_BOUND_S) as bound:
                await make()
        except TimeoutError:
            self.problems.append(f"{what} did not return in {COMMAND_BOUND_S}s" if bound.expired()
                                 else f"{what} raised TimeoutError")
        except CapyError as exc:
            self._error(what, exc)

    async def _with_traffic(self, requests: list[str], first: float, what: str, make) -> None:
        """``make()``'s command, with ``requests`` sent just before it (``first`` seconds before)."""
        clients = [asyncio.ensure_future(self._request(name)) for name in requests]
        if first:
            await asyncio.sleep(first)
        if make is not None:
            await self._command(what, make)
        await asyncio.gather(*clients)
        await self._settle()

    async def _settle(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_BOUND_S
        quiet = 0
        while quiet < 5:  # a few rounds with nothing queued, so a watch's late news is seen too
            await asyncio.sleep(0.002)
            busy = [a.name for a in self.ctl.actors.values()
                    if a.lifecycle_test_running or a.has_pending_commands]
            quiet = 0 if busy else quiet + 1
            if busy and loop.time() > deadline:
                self.problems.append(f"commands of {busy} still queued or running after {SETTLE_BOUND_S}s")
                return

    def _run(self, coro) -> None:
        self.loop.run_until_complete(self._bounded(coro))
        self._assert_no_problems()

    async def _bounded(self, coro) -> None:
        """``coro``, or after STEP_BOUND_S a problem that shows where every task then waited."""
        step = asyncio.ensure_future(coro)
        await asyncio.wait({step}, timeout=STEP_BOUND_S)
        if step.done():
            return step.result()
        stacks = []
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                out = io.StringIO()
                task.print_stack(limit=8, file=out)
                stacks.append(out.getvalue())
        self.problems.append(f"a step did not end in {STEP_BOUND_S}s; its tasks then:\n" + "\n".join(stacks))
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await step

    def _assert_no_problems(self) -> None:
        if self.problems:
            raise AssertionError("\n".join(self.problems) + "\nlast changes of state:\n  "
                                 + "\n  ".join(self.history[-30:]))

    # -- rules
    @initialize(arm=st.booleans(), retry_at_once=st.booleans())
    def configure(self, arm: bool, retry_at_once: bool) -> None:
        # A park by stopping arms the next launch (or not); a failed deployment is retried at
        # once by the next wake (or refused with deployment_failed for the whole example).
        os.environ[ARM_PARKED_ENV] = "1" if arm else "0"
        _actor.RESTART_BACKOFF_S = 0.0 if retry_at_once else 60.0
        for name in ("a", "b"):
            self.variants[name] = 0
            self._run(self._command(f"deploy {name}", lambda n=name: self.ctl.deploy(_manifest(n, self.model, 0))))

    def _operation(self, kind: str, name: str, *, variant: int | None = None, activate: bool = False):
        """(what it is, a coroutine function doing it): an operator's command or the engine's exit."""
        if kind == "deploy":
            variant = 1 - self.variants.get(name, 0) if variant is None else variant
            self.variants[name] = variant
            return (f"deploy {name} (variant {variant}, activate {activate})",
                    lambda: self.ctl.deploy(_manifest(name, self.model, variant), activate=activate))
        if kind == "exit":
            async def crash():
                self.systemd.exit(unit_name(name))
            return f"{name}'s unit exits", crash
        return f"{kind} {name}", lambda: getattr(self.ctl, kind)(name)

    @rule(name=st.sampled_from(NAMES), variant=st.integers(0, 1), activate=st.booleans(), requests=traffic,
          first=lead)
    def deploy(self, name, variant, activate, requests, first):
        """Deploy (a new revision when the variant changed: a running deployment restarts on it)."""
        self._run(self._with_traffic(requests, first, *self._operation("deploy", name, variant=variant,
                                                                         activate=activate)))

    @rule(name=st.sampled_from(NAMES), requests=traffic, first=lead)
    def park(self, name, requests, first):
        self._run(self._with_traffic(requests, first, *self._operation("park", name)))

    @rule(name=st.sampled_from(NAMES), requests=traffic, first=lead)
    def wake(self, name, requests, first):
        self._run(self._with_traffic(requests, first, *self._operation("wake", name)))

    @rule(name=st.sampled_from(NAMES), requests=traffic, first=lead)
    def stop(self, name, requests, first):
        self._run(self._with_traffic(requests, first, *self._operation("stop", name)))

    @rule(name=st.sampled_from(NAMES), requests=traffic, first=lead)
    def engine_exits(self, name, requests, first):
        """The engine's unit exits on its own, while ``requests`` go on."""
        self._run(self._with_traffic(requests, first, *self._operation("exit", name)))

    @rule(name=st.sampled_from(NAMES), requests=traffic, first=lead)
    def engine_exits_as_it_starts(self, name, requests, first):
        """The next start (or wake) of the engine exits before it is healthy; requests wake it."""
        self.systemd.crash_at_start.add(unit_name(name))
        self._run(self._with_traffic([name, *requests], first, "requests", None))

    @rule(requests=traffic.filter(bool), first=lead, unknown=st.booleans())
    def requests(self, requests, first, unknown):
        """Requests alone; with ``unknown``, one for a model nobody deployed (model_not_found)."""
        self._run(self._with_traffic(requests + ["nobody"] * unknown, first, "requests", None))

    @rule(one=operations, other=operations, requests=traffic, gap=lead)
    def two_at_once(self, one, other, requests, gap):
        """Two operations (two operators, or one and the engine) ``gap`` seconds apart, with requests."""
        async def both():
            later = asyncio.ensure_future(self._after(gap, self._command(*self._operation(*other))))
            await self._command(*self._operation(*one))
            await later
        self._run(self._with_traffic(requests, 0.0, f"{one} and {other}", both))

    @staticmethod
    async def _after(delay: float, coro) -> None:
        await asyncio.sleep(delay)
        await coro

    @rule(failing=st.sets(st.sampled_from(NAMES)))
    def restart_daemon(self, failing):
        """The daemon restarts once all is quiet, units untouched; those of ``failing`` exit while it is down."""
        self._run(self._restart(failing))

    @rule(operation=operations, requests=traffic, cut_at=st.integers(1, 8))
    def restart_daemon_mid_command(self, operation, requests, cut_at):
        """The daemon restarts in the middle of an operation with requests: right after the
        ``cut_at``-th thing that happens to a deployment, its unit or its engine (a change of state,
        a unit started or stopped, an engine put to sleep), or once all is done if fewer happen.
        Its clients are cut off with it."""
        async def cut_short():
            self.systemd.cut_at, self.systemd.happenings = cut_at, 0
            self.systemd.cut.clear()
            clients = [asyncio.ensure_future(self._request(name)) for name in requests]
            command = asyncio.ensure_future(self._command(*self._operation(*operation)))
            everything = asyncio.ensure_future(asyncio.gather(*clients, command))
            cut = asyncio.ensure_future(self.systemd.cut.wait())
            await asyncio.wait([everything, cut], return_when=asyncio.FIRST_COMPLETED)
            self.systemd.cut_at = None
            for task in (*clients, command, cut):
                task.cancel()
            await asyncio.gather(everything, cut, return_exceptions=True)
            self.history.append(f"-- cut short after {self.systemd.happenings} happenings")
            await self._restart(set(), settled=False)
        self._run(cut_short())

    async def _restart(self, failing: set[str], settled: bool = True) -> None:
        before = {name: (a.state, a.describe()["armed"]) for name, a in self.ctl.actors.items()}
        await self.ctl.close()
        self.ctl = None
        failed_while_down = {name for name in failing if self.systemd.exit(unit_name(name))}
        units = {name: self.systemd.units.get(unit_name(name)) for name in before}
        self.history.append(f"-- daemon restart; units that failed meanwhile: {sorted(failed_while_down)}")
        await self._start_daemon()
        await self._settle()
        recorded = {d.name for d in self.store.list_deployments()}
        if set(self.ctl.actors) != recorded or recorded != set(before):
            self.problems.append(f"after the restart the daemon has {sorted(self.ctl.actors)}, "
                                 f"the store {sorted(recorded)}, before it {sorted(before)}")
            return
        if not settled:
            return  # cut short mid-command: what it comes back as is for the invariants to judge
        for name, (state, armed) in before.items():
            unit = units[name]
            if name in failed_while_down:
                # A unit that failed while no daemon watched it: failed (an armed unit's gate shell
                # never ran an engine: parked is as good).
                expected = {S.FAILED, S.PARKED} if state == S.PARKED and armed else {S.FAILED}
            elif state == S.FAILED and unit is None:
                expected = {S.FAILED, S.STOPPED}  # nothing left to adopt: a wake starts it either way
            else:
                # A running unit is adopted as it was (ready, or parked in place), a parked one with
                # no unit is parked, a stopped one stays stopped, a failed one stays failed.
                expected = {state}
            now = self.ctl.actors[name].state
            if now not in expected:
                shown = f"{unit.active_state} unit" if unit else "no unit"
                self.problems.append(f"{name} was {state} ({shown}) before the daemon restarted and is {now} "
                                     f"after it ({self.ctl.actors[name].reason}); expected {' or '.join(sorted(expected))}")

    # -- invariants (checked after every rule, each rule having settled)
    @invariant()
    def every_deployment_rests_with_no_request_left(self):
        if self.ctl is None:
            return
        for actor in self.ctl.actors.values():
            assert actor.state in RESTING, f"{actor.name} is {actor.state} with no command running"
            assert (actor.in_flight, actor.waiting) == (0, 0), \
                f"{actor.name}: {actor.in_flight} requests in flight and {actor.waiting} waiting, with none sent"

    @invariant()
    def every_unit_agrees_with_its_deployment(self):
        if self.ctl is None:
            return
        for actor in self.ctl.actors.values():
            unit = self.systemd.active(actor.unit)
            shown = "none running" if unit is None else \
                f"{unit.active_state}, launch {unit.markers.get('launch')}, gated {unit.gated}, asleep {unit.asleep}"
            why = f"{actor.name} is {actor.state} (launch {actor.launch_id}); its unit: {shown}"
            if actor.state == S.READY:
                agrees = unit is not None and not unit.gated and not unit.asleep \
                    and unit.markers.get("launch") == actor.launch_id
            elif actor.state == S.PARKED and actor.parked_in_place:
                agrees = unit is not None and unit.asleep and unit.markers.get("launch") == actor.launch_id
            elif actor.state == S.PARKED:
                # parked by stopping: no unit, or the next launch's, held at its gate (armed)
                agrees = (unit is None and actor.parked == "stopped") or \
                    (unit is not None and unit.gated and actor.parked == "armed" and actor.describe()["armed"])
            else:
                agrees = unit is None
            assert agrees, why
            # The parked sub-state (controller/_park_modes.py) is "no" whenever it is not parked.
            if actor.state != S.PARKED:
                assert actor.parked == "no", f"{why}; parked {actor.parked}"


@pytest.fixture
def stand_ins(monkeypatch):
    from capyctl.engines.vllm import VllmAdapter
    from tests.fakes.fake_nvml import FakeDevice, FakeNvml

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([FakeDevice("NVIDIA H100 80GB HBM3", "GPU-h100",
                                                                    minor=0, total=80 * GiB)]))
    monkeypatch.delenv("CAPYCTL_UNIFIED_MEMORY", raising=False)
    # The engine: its health, sleep and wake_up answered from the fake unit it runs in.
    monkeypatch.setattr(VllmAdapter, "health", _engine_health)
    monkeypatch.setattr(VllmAdapter, "park", _engine_sleep)
    monkeypatch.setattr(VllmAdapter, "wake", _engine_wake_up)

    # The proof after a wake needs a served model (as in test_turns.py).
    async def proven(self, *args, **kwargs):
        return None

    monkeypatch.setattr(WakeProof, "check", proven)
    monkeypatch.setattr(WakeProof, "after_requests", lambda self, seconds: None)
    monkeypatch.setattr(DeploymentActor, "__init__", _counting_handlers(DeploymentActor.__init__))

    async def no_journal(unit, lines):
        return []

    monkeypatch.setattr("capyctl.systemd.journal_tail", no_journal)
    monkeypatch.setenv(ARM_PARKED_ENV, "1")  # restored after the test; each example sets its own


def test_random_command_sequences_keep_the_lifecycle(stand_ins):
    SEEN.clear()
    ANSWERS.clear()
    run_state_machine_as_test(LifecycleMachine, settings=settings(
        max_examples=40, stateful_step_count=15, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    # Not vacuous: the sequences went through the lifecycle's main paths (adoption at a restart
    # included), and requests were both served and refused.
    must = {("stopped", "starting"), ("starting", "ready"), ("ready", "parking"), ("parking", "parked"),
            ("parked", "waking"), ("waking", "ready"), ("ready", "stopping"), ("stopping", "stopped"),
            ("ready", "failed"), ("starting", "failed"), ("failed", "stopping"), ("stopped", "ready")}
    assert must <= SEEN, sorted(must - SEEN)
    assert ANSWERS.get("served", 0) > 50 and sum(ANSWERS.values()) > ANSWERS["served"], ANSWERS


# -- failing sequences the state machine found (shrunk by hypothesis), replayed -----------------------------


@contextlib.contextmanager
def _machine():
    state = LifecycleMachine()
    try:
        yield state
    finally:
        state.teardown()


def test_a_deployment_stopped_after_its_engine_failed_is_still_stopped_after_a_daemon_restart(stand_ins):
    """Its failed unit stays loaded (CollectMode=inactive keeps failed units, and stop_unit leaves a
    unit that is no longer running as it is); the next daemon's reconcile must not read it as a
    failure that happened while no daemon ran. (Found too as a deployment parked while its engine
    exited: parked before the restart, failed after it.)"""
    with _machine() as state:
        state.configure(arm=False, retry_at_once=False)
        state.engine_exits_as_it_starts(first=0.0, name="a", requests=[])
        state.stop(first=0.0, name="a", requests=[])
        state.restart_daemon(failing=set())


def test_a_daemon_restart_during_an_in_place_park_does_not_serve_from_the_sleeping_engine(stand_ins):
    """The daemon stops right after vLLM was asked to sleep, before the park was recorded: the next
    daemon finds the unit running, recorded ``parking``, and must not adopt it as ready."""
    with _machine() as state:
        state.configure(arm=True, retry_at_once=True)
        state.wake(first=0.0, name="a", requests=[])
        state.restart_daemon_mid_command(cut_at=2, operation=("park", "a"), requests=[])
        state.every_deployment_rests_with_no_request_left()
        state.every_unit_agrees_with_its_deployment()


def test_the_daemon_closes_though_an_actor_is_cancelled_as_its_park_drained(stand_ins):
    """Controller.close() cancels each actor's task once and waits for it. On Python 3.11,
    asyncio.wait_for returns its inner result when the cancellation lands after that result is
    ready (the cancellation is lost; CPython gh-86296, fixed in 3.12): a park whose drain had just
    ended then goes on to PARKED, the actor's loop waits for its next command, and close() waits
    for it forever. The state machine found it cut short mid-eviction; here the close is timed
    with a listener so it lands at that moment: as the park's drain (which has nothing to wait
    for) ends."""
    with _machine() as state:
        state.configure(arm=False, retry_at_once=True)
        state.wake(first=0.0, name="b", requests=[])

        async def close_as_the_drain_ends():
            ctl, actor = state.ctl, state.ctl.actors["b"]
            closing: list[asyncio.Future] = []

            def close_at_parking(changed):
                if changed is actor and changed.state == S.PARKING and not closing:
                    closing.append(asyncio.ensure_future(ctl.close()))

            ctl.subscribe(close_at_parking)
            park = asyncio.ensure_future(ctl.park("b"))
            await asyncio.wait({park}, timeout=2.0)
            assert closing, "the park never began"
            done, _ = await asyncio.wait(closing, timeout=5.0)
            stuck = not done
            if stuck:  # let teardown end the example: cancel the actor again, as a fix would
                actor._task.cancel()
                await asyncio.wait(closing, timeout=5.0)
            state.ctl = None
            assert not stuck, f"Controller.close() did not return in 5 s; b is {actor.state}"

        state.loop.run_until_complete(close_as_the_drain_ends())


def test_an_exit_of_the_parked_engine_does_not_disarm_the_launch_armed_after_it(stand_ins):
    """The engine exits as it is parked (its in-place park then fails, and the park stops the unit);
    the park then arms the next launch (a new unit of the same name, held at its gate). The old unit's exit, queued as UNIT_EXITED meanwhile, is
    handled after the park and taken for the armed unit's: the deployment forgets the armed unit,
    which keeps running, and the next wake's start of the unit is refused (unit_exists)."""
    with _machine() as state:
        state.configure(arm=True, retry_at_once=False)
        state.wake(first=0.0, name="a", requests=[])
        state.two_at_once(gap=0.0, one=("park", "a"), other=("exit", "a"), requests=[])
        state.every_unit_agrees_with_its_deployment()
        state.wake(first=0.0, name="a", requests=[])
