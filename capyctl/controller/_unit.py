"""A single-host deployment's systemd unit: starting it for a launch, watching it exit, stopping
it, the SSH forward to it on a remote host, and its next launch armed at a park.

An ``EngineUnit`` belongs to one deployment's actor and changes no state of it. It tells the actor
what happened through the actor's public methods: ``record_launch`` (a launch was planned, before
its unit starts) and ``submit(Command.UNIT_EXITED)`` (the unit exited on its own). A multi-node
deployment's units are its group members' (controller/_members.py).

Arming: a park by stopping starts the next launch's unit at once, held at its gate
(systemd/_gate.py), so that the wake only opens the gate; systemd's sandboxed start (mostly mount
namespaces; its cost: benchmarks/wake_vs_manual.py) leaves the wake's path. What that launch was
planned with is kept and compared at the wake: an armed unit whose inputs changed is stopped and
the wake launches afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable, Protocol

from ..errors import CapyError
from ._launch import (PARKED_ARMED, PreparedUnit, Presealed, arm_parked_units, prepare_unit, preseal,
                      unit_description, wait_healthy)
from ._lifecycle import Command
from ._services import DeploymentServices
from ._timeline import OPEN_GATE, UNIT_START, Timeline

log = logging.getLogger("capyctl.controller")

Progress = Callable[[str], None]


def _no_progress(_: str) -> None:
    """An armed launch's progress: nobody waits for it."""


class UnitOwner(Protocol):
    """The deployment an EngineUnit runs (DeploymentActor provides it)."""

    controller: DeploymentServices
    revision: Any
    host: str
    port: int | None
    socket_path: str | None
    state: Any  # DeploymentState: the phase a launch's unit describes

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> Any: ...
    @property
    def unit(self) -> str: ...
    @property
    def remote(self) -> bool: ...
    def record_launch(self, prepared: PreparedUnit) -> None: ...
    def submit(self, command: Command, **args: Any) -> asyncio.Future: ...


class EngineUnit:
    def __init__(self, owner: UnitOwner) -> None:
        self._owner = owner
        self.timeline = Timeline()  # the current wake's phases (DeploymentActor._do_wake)
        # The local end of the SSH forward to the engine on a remote host: a port, or a unix
        # socket for an engine served on one (capyctl/proxy/connector.py). None on the local host.
        self.local_port: int | None = None
        self.local_socket: str | None = None
        # The next launch's key, sealed when the deployment parked by stopping (preseal).
        self._presealed: Presealed | None = None
        # What the armed launch was planned with (launch_inputs), compared at the wake; None
        # when no unit is armed (whether one is, is the actor's parked sub-state: _park_modes.py).
        self._armed_inputs: tuple | None = None
        self._exited = asyncio.Event()  # the unit is gone (or was never started)
        self._expect_exit = False  # a stop of ours: the watch reports no exit
        self._watch_task: asyncio.Task | None = None
        # Why the unit exited on its own, as the watch read it (code, sentence).
        self.exit_code: str | None = None
        self.exit_message: str | None = None

    @property
    def systemd(self) -> Any:
        """The systemd of the host the unit runs on (raises host_offline while it is offline)."""
        return self._owner.controller.systemd_on(self._owner.host)

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    async def active(self) -> bool:
        state = await self.systemd.unit_state(self._owner.unit)
        return state is not None and state.active_state == "active"

    # -- a launch ---------------------------------------------------------------------------------

    async def launch(self, progress: Progress, *, gated: bool, prompt_cache_dir: str | None,
                     timeline: Timeline | None = None) -> None:
        """Plan the owner's next launch (_launch.py), have it recorded, and start its unit
        (``gated``: held at its gate until a wake opens it). Its phases go to ``timeline``, else
        to the current wake's."""
        owner = self._owner
        timeline = timeline if timeline is not None else self.timeline
        await self.drop_forward()
        presealed, self._presealed = self._presealed, None
        prepared = await prepare_unit(
            owner.controller, owner, revision=owner.revision.revision,
            presealed=presealed if presealed is not None and presealed.host == owner.host else None,
            gated=gated, progress=progress, timeline=timeline, prompt_cache_dir=prompt_cache_dir,
            phase=PARKED_ARMED if gated else owner.state)
        owner.record_launch(prepared)
        progress(f"starting unit {owner.unit}" + (f" on host {owner.host}" if owner.remote else "")
                 + (" held at its gate" if gated else ""))
        self._exited.clear()
        self._expect_exit = False
        self.exit_code = self.exit_message = None
        await self.systemd.start_transient(prepared.unit)
        timeline.lap(UNIT_START)
        self.start_watch()
        await self.ensure_forward()

    async def describe(self, phase: str) -> None:
        """Say in the unit's description what it does now (``systemctl status``, ``list-units``),
        in the words of _launch.UNIT_PHASES, so that systemctl and ``capyctl list`` agree. Words
        only: a failure leaves the old ones, and is logged."""
        owner = self._owner
        text = unit_description(owner.name, owner.revision.revision, owner.controller.engine_kind(owner.spec), phase)
        try:
            await self.systemd.set_description(owner.unit, text)
        except (CapyError, OSError) as exc:
            log.info("deployment %s: its unit's description was not changed to %r: %s", owner.name, text, exc)

    async def wait_healthy(self, progress: Progress, timeout: float, base_url: str, key: str | None) -> None:
        def exit_error() -> CapyError:
            return CapyError(f"the engine exited before it was healthy: "
                             f"{self.exit_code or 'engine_exited'}: {self.exit_message or 'see its journal'}",
                             code=self.exit_code or "engine_exited")

        ctl = self._owner.controller
        await wait_healthy(ctl.adapter(self._owner.spec), ctl.http, base_url, key, exited=self._exited,
                           exit_error=exit_error, timeout=timeout, progress=progress)

    # -- stopping -----------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop the unit and forget it: its watch, its forward and its port."""
        self._armed_inputs = None
        self._expect_exit = True
        await self.systemd.stop_unit(self._owner.unit, self._owner.spec.timeouts.stop)
        await self._forget()

    async def abandon(self) -> None:
        """Its host was lost and the deployment moves: forget the unit without reaching the host
        (Controller.reconcile stops the unit when the host is back). Its forward goes too, so the
        reconnect does not open a way to the old engine again."""
        self._armed_inputs = self._presealed = None
        self._expect_exit = True
        await self._forget()

    async def _forget(self) -> None:
        """The unit is gone (or out of reach): its watch has nothing left to say, and what it still
        had queued (a stop's own states) must not reach the next launch, which clears _expect_exit
        and may start at once (an armed park does). Its forward and port go with it."""
        self._exited.set()
        self.cancel_watch()
        await self.drop_forward()
        self._owner.controller.release_port(self._owner.name)

    async def stop_failed(self, timeout: float) -> None:
        """Stop a unit that failed or hung so it holds no memory; its watch sees it go."""
        if self._exited.is_set():
            return
        self._expect_exit = True
        try:
            await self.systemd.stop_unit(self._owner.unit, timeout)
        except CapyError as exc:
            log.warning("deployment %s: stopping its failed engine failed: %s", self._owner.name, exc)

    def mark_exited(self) -> None:
        """Its units are gone by other means (a group stopped its members itself)."""
        self._exited.set()

    # -- watching -----------------------------------------------------------------------------------

    def start_watch(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(self._watch(), name=f"watch:{self._owner.name}")

    def cancel_watch(self) -> None:
        """Stop watching: the unit is gone, or its host's bus connection is (reconcile adopts it
        again after the reconnect)."""
        if self._watch_task is not None and not self._watch_task.done():
            self._watch_task.cancel()
        self._watch_task = None

    async def close(self) -> None:
        """The daemon stops: stop watching (the unit keeps running)."""
        task, self._watch_task = self._watch_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def adopted(self) -> None:
        """A unit a previous daemon started runs: watch it from now on."""
        self.cancel_watch()
        self._exited.clear()
        self._expect_exit = False
        self.start_watch()

    async def _watch(self) -> None:
        from ..systemd import failure_message, failure_reason
        owner = self._owner
        launch = owner.launch_id  # the launch watched: its exit says nothing of a later one
        try:
            async for st in self.systemd.watch(owner.unit):
                if st.active_state in ("failed", "inactive"):
                    if not self._expect_exit:
                        self.exit_code, self.exit_message = failure_reason(st), failure_message(st)
                        owner.submit(Command.UNIT_EXITED, code=self.exit_code, message=self.exit_message,
                                     launch=launch)
                    self._exited.set()
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("deployment %s: watching %s failed", owner.name, owner.unit)

    # -- the forward on a remote host ---------------------------------------------------------------

    async def ensure_forward(self) -> None:
        """On a remote host, a local socket (or port) forwarded to the engine's socket (or
        loopback port) there."""
        owner = self._owner
        if not owner.remote:
            return
        hosts = owner.controller
        if owner.socket_path is not None:
            if not hosts.has_forward(owner.host, self.local_socket):
                self.local_socket = await hosts.forward_socket(owner.host, owner.socket_path)
        elif owner.port and not hosts.has_forward(owner.host, self.local_port):
            self.local_port = await hosts.forward_port(owner.host, owner.port)

    async def drop_forward(self) -> None:
        hosts, host = self._owner.controller, self._owner.host
        if self.local_port is not None:
            await hosts.cancel_forward(host, self.local_port)
            self.local_port = None
        if self.local_socket is not None:
            await hosts.cancel_forward(host, self.local_socket)
            self.local_socket = None

    # -- arming at a park ---------------------------------------------------------------------------

    def can_arm(self) -> bool:
        # Local only: open_gate pins the gate shell by its pid, which a remote host's is not here.
        # A group's members are launched by _members.py, each of its own.
        return not self._owner.remote and self._owner.spec.nodes == 1 and arm_parked_units()

    def launch_inputs(self) -> tuple:
        """What a launch is planned from that can change while a deployment is parked: its host,
        revision and engine registration, the cards and memory share placement gives it, its
        threads and the host's settings."""
        owner, ctl = self._owner, self._owner.controller
        return (owner.host, owner.revision.revision, ctl.engine_for(owner.spec), ctl.gpus_for(owner),
                ctl.launch_memory(owner), ctl.cores_for(owner), ctl.cpu_threads(owner.spec, owner.host),
                ctl.dev_controls(owner.host),
                ctl.unified_memory(owner.host))

    async def preseal(self) -> None:
        """Seal the next launch's key now, while nobody waits, so the wake that restarts the unit
        skips systemd-creds. Only once the unit is stopped: the file is the one its key was read
        from. A failure here only means the wake seals."""
        owner = self._owner
        try:
            self._presealed = await preseal(owner.controller, owner.host, owner.name)
        except (OSError, CapyError) as exc:
            log.info("deployment %s: the next launch's key was not sealed at the park (%s); the wake will",
                     owner.name, exc)

    def forget_presealed(self) -> None:
        self._presealed = None

    async def arm(self, prompt_cache_dir: str | None) -> bool:
        """After a park by stopping: start the next launch's unit now, held at its gate; whether
        it is. Its failure only means the wake starts the unit."""
        try:
            await self.launch(_no_progress, gated=True, prompt_cache_dir=prompt_cache_dir, timeline=Timeline())
        except Exception as exc:  # arming is an optimisation: whatever failed, the park stands
            expected = isinstance(exc, (CapyError, OSError))
            log.log(logging.INFO if expected else logging.WARNING,
                    "deployment %s: the next launch was not armed at the park (%s); the wake will start it",
                    self._owner.name, exc, exc_info=not expected)
            with contextlib.suppress(CapyError):
                await self.stop()
            return False
        self._armed_inputs = self.launch_inputs()
        return True

    def disarm(self) -> None:
        """The armed unit exited, or will not be used: the wake starts one."""
        self._armed_inputs = None

    async def open_armed(self, progress: Progress) -> bool:
        """Open the armed unit's gate; False (the unit stopped, if there was one) when the wake
        must launch afresh: nothing armed, its inputs changed, or it no longer waits at its gate."""
        armed, self._armed_inputs = self._armed_inputs, None
        if armed is None:
            return False
        unit = self._owner.unit
        if armed == self.launch_inputs() and await self.systemd.open_gate(unit):
            progress(f"opened the gate of unit {unit}, started at the park")
            self.timeline.lap(OPEN_GATE)
            return True
        log.info("deployment %s: the unit armed at the park was not used (its launch changed, or it left "
                 "its gate); starting afresh", self._owner.name)
        await self.stop()
        return False
