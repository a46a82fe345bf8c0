"""asyncio client of systemd's manager over D-Bus, as CapyCTL uses it for engine units."""

from __future__ import annotations

import asyncio
import contextlib
import signal as signal_module
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from capyctl.errors import SystemdError

from ._dbus import (MANAGER_IFACE, MANAGER_PATH, PROPERTIES_IFACE, SERVICE_IFACE, SYSTEMD,
                    UNIT_IFACE, Manager, Service, Unit, add_match, remove_match, unwrap)
from . import _gate
from ._units import TransientUnit, markers_from_environment, unit_object_path

_UNSET = 2**64 - 1  # systemd's "infinity" / "not set" for uint64 properties
_BUSY_STATES = frozenset({"active", "activating", "reloading", "deactivating"})
_DONE_STATES = frozenset({"inactive", "failed"})
# ExecMainCode values (siginfo si_code of the main process' exit).
CLD_EXITED, CLD_KILLED, CLD_DUMPED = 1, 2, 3


@dataclass(frozen=True)
class UnitState:
    name: str
    active_state: str
    sub_state: str
    load_state: str
    result: str | None = None
    main_pid: int = 0
    exec_main_status: int = 0
    exec_main_code: int = 0
    memory_current: int | None = None
    memory_max: int | None = None
    control_group: str = ""
    markers: dict[str, str] = field(default_factory=dict)
    n_restarts: int = 0
    description: str = ""

    @property
    def is_running(self) -> bool:
        return self.active_state in _BUSY_STATES

    @property
    def is_failed(self) -> bool:
        return self.active_state == "failed"


def _uint(value: Any) -> int | None:
    if value is None or value == _UNSET:
        return None
    return int(value)


def _state_from(name: str, unit: dict[str, Any], service: dict[str, Any]) -> UnitState:
    return UnitState(
        name=unit.get("Id", name) or name,
        active_state=unit.get("ActiveState", ""),
        sub_state=unit.get("SubState", ""),
        load_state=unit.get("LoadState", ""),
        result=service.get("Result"),
        main_pid=int(service.get("MainPID", 0) or 0),
        exec_main_status=int(service.get("ExecMainStatus", 0) or 0),
        exec_main_code=int(service.get("ExecMainCode", 0) or 0),
        memory_current=_uint(service.get("MemoryCurrent")),
        memory_max=_uint(service.get("MemoryMax")),
        control_group=service.get("ControlGroup", "") or "",
        markers=markers_from_environment(list(service.get("Environment", []) or [])),
        n_restarts=int(service.get("NRestarts", 0) or 0),
        description=unit.get("Description", ""),
    )


def failure_reason(state: UnitState) -> str:
    """A stable code for why a unit stopped.

    systemd 252 on cgroup v1 (this project's test machines) never reports
    Result=oom-kill: the memory cgroup's OOM killer shows up as Result=signal with
    ExecMainStatus=9 (SIGKILL). CapyCTL SIGKILLs an engine only inside stop_unit, so a
    SIGKILL of a memory-capped unit that died on its own is read as out_of_memory.
    """
    result = state.result or ""
    if result == "oom-kill":
        return "out_of_memory"
    if result in ("signal", "core-dump"):
        if state.exec_main_status == signal_module.SIGKILL and state.memory_max is not None:
            return "out_of_memory"
        return "signal"
    return {
        "success": "none",
        "exit-code": "exit_code",
        "timeout": "timeout",
        "start-limit-hit": "start_limit",
        "resources": "resources",
        "protocol": "protocol",
        "watchdog": "watchdog",
        "exec-condition": "condition",
        "": "unknown",
    }.get(result, result.replace("-", "_"))


def failure_message(state: UnitState) -> str:
    """A human sentence for the same facts."""
    reason = failure_reason(state)
    if reason == "out_of_memory":
        limit = f" of {state.memory_max} bytes" if state.memory_max else ""
        return f"{state.name} was killed for going over its memory limit{limit}."
    if reason == "exit_code":
        return f"{state.name} exited with status {state.exec_main_status}."
    if reason == "signal":
        try:
            sig = signal_module.Signals(state.exec_main_status).name
        except ValueError:
            sig = f"signal {state.exec_main_status}"
        return f"{state.name} was killed by {sig}."
    if reason == "none":
        return f"{state.name} stopped normally."
    return f"{state.name} failed: {state.result}."


class SystemdClient:
    """One D-Bus connection to a systemd system manager.

    ``fs_root`` is where that systemd's filesystem is seen from here ("/" normally;
    ``/proc/<pid>/root`` for a sandbox), used only to read cgroup files.
    """

    def __init__(self, bus: MessageBus, fs_root: Path) -> None:
        self._bus = bus
        self._fs_root = fs_root
        self.manager = Manager(bus)
        self._job_waiters: dict[str, asyncio.Future[str]] = {}
        self._finished_jobs: dict[str, str] = {}
        self._watchers: dict[str, set[asyncio.Queue[tuple[Any, ...]]]] = {}
        self._unit_watchers: dict[str, set[asyncio.Queue[tuple[Any, ...]]]] = {}
        self._match_refs: dict[str, int] = {}
        bus.add_message_handler(self._on_message)

    @classmethod
    async def connect(cls, address: str | None = None, *, fs_root: str | Path = "/") -> "SystemdClient":
        try:
            if address is None:
                bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
            else:
                bus = await MessageBus(bus_address=address).connect()
        except (OSError, EOFError, ValueError) as exc:
            where = address or "the system bus"
            raise SystemdError(f"Cannot connect to {where}: {exc}", code="dbus_unavailable") from exc
        except Exception as exc:  # dbus-fast raises its own AuthError and friends
            where = address or "the system bus"
            raise SystemdError(f"Cannot connect to {where}: {exc}", code="dbus_unavailable") from exc
        client = cls(bus, Path(fs_root))
        try:
            # Job and unit signals are broadcast: the bus routes them to us only with a match.
            await add_match(bus, f"type='signal',sender='{SYSTEMD}',path='{MANAGER_PATH}',"
                                 f"interface='{MANAGER_IFACE}'")
            await client.manager.subscribe()
        except SystemdError as exc:
            bus.disconnect()
            raise SystemdError(f"systemd does not answer on {address or 'the system bus'}: {exc.message}",
                               code="dbus_unavailable") from exc
        return client

    async def close(self) -> None:
        for fut in self._job_waiters.values():
            if not fut.done():
                fut.set_exception(SystemdError("The systemd client was closed.", code="dbus_unavailable"))
        self._bus.disconnect()
        with contextlib.suppress(Exception):
            await self._bus.wait_for_disconnect()

    async def __aenter__(self) -> "SystemdClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- signals -----------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        if msg.message_type != MessageType.SIGNAL:
            return
        if msg.interface == MANAGER_IFACE:
            if msg.member == "JobRemoved":
                _id, job, _unit, result = msg.body
                fut = self._job_waiters.pop(job, None)
                if fut is not None and not fut.done():
                    fut.set_result(result)
                elif fut is None:
                    # The signal can beat our own method reply: keep it for wait_job.
                    self._finished_jobs[job] = result
                    if len(self._finished_jobs) > 512:
                        self._finished_jobs.pop(next(iter(self._finished_jobs)))
            elif msg.member in ("UnitNew", "UnitRemoved"):
                name, _path = msg.body
                for queue in self._unit_watchers.get(name, ()):
                    queue.put_nowait((msg.member,))
        elif msg.interface == PROPERTIES_IFACE and msg.member == "PropertiesChanged":
            iface, changed, invalidated = msg.body
            for queue in self._watchers.get(msg.path or "", ()):
                queue.put_nowait(("PropertiesChanged", iface, unwrap(changed), list(invalidated)))

    async def _wait_job(self, job: str, timeout: float) -> str:
        if job in self._finished_jobs:
            return self._finished_jobs.pop(job)
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._job_waiters[job] = fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise SystemdError(f"systemd job {job} did not finish within {timeout:g} s.",
                               code="job_timeout") from None
        finally:
            self._job_waiters.pop(job, None)

    async def _match(self, rule: str) -> None:
        if self._match_refs.get(rule, 0) == 0:
            await add_match(self._bus, rule)
        self._match_refs[rule] = self._match_refs.get(rule, 0) + 1

    async def _unmatch(self, rule: str) -> None:
        self._match_refs[rule] -= 1
        if self._match_refs[rule] == 0:
            del self._match_refs[rule]
            # A bus already gone holds no rule. (A remote host's bus goes with its SSH master, which
            # the daemon's stop ends at once: a RemoveMatch written to it then fails in dbus_fast's
            # writer, whose error no one awaits, and asyncio logs it as an ERROR.)
            if self._bus.connected:
                with contextlib.suppress(Exception):
                    await remove_match(self._bus, rule)

    # -- reading -----------------------------------------------------------------

    async def _unit_path(self, name: str) -> str | None:
        try:
            return await self.manager.get_unit(name)
        except SystemdError as exc:
            if exc.code == "unit_not_found":
                return None
            raise

    async def _properties(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        unit = await Unit(self._bus, path).get_all()
        service: dict[str, Any] = {}
        if str(unit.get("Id", "")).endswith(".service"):
            service = await Service(self._bus, path).get_all()
        return unit, service

    async def unit_state(self, name: str) -> UnitState | None:
        """The unit's state, or None when systemd has no such unit loaded."""
        path = await self._unit_path(name)
        if path is None:
            return None
        try:
            unit, service = await self._properties(path)
        except SystemdError as exc:
            if exc.code == "unit_not_found":
                return None  # collected between GetUnit and GetAll
            raise
        if unit.get("LoadState") == "not-found":
            return None
        return _state_from(name, unit, service)

    async def unit_of_pid(self, pid: int) -> str | None:
        """The name of the unit a process runs in, or None (no unit, or no such process).

        systemd answers for every process, also where /proc/<pid>/cgroup cannot be read (hidepid,
        another pid namespace)."""
        try:
            path = await self.manager.get_unit_by_pid(pid)
            name = await Unit(self._bus, path).get("Id")
        except SystemdError as exc:
            if exc.code == "unit_not_found":
                return None
            raise
        return str(name) if name else None

    async def list_units(self, pattern: str = "capyctl-*.service") -> list[UnitState]:
        rows = await self.manager.list_units_by_patterns([], [pattern])
        states = []
        for row in rows:
            state = await self.unit_state(row[0])
            if state is not None:
                states.append(state)
        return sorted(states, key=lambda s: s.name)

    async def memory_current(self, name: str) -> int | None:
        """Bytes the unit's cgroup uses now; None when the unit has no cgroup."""
        state = await self.unit_state(name)
        if state is None:
            raise SystemdError(f"There is no unit {name}.", code="unit_not_found")
        if state.memory_current is not None:
            return state.memory_current
        if not state.control_group:
            return None
        # cgroup v1: systemd may leave MemoryCurrent unset; the memory controller knows.
        for candidate in (f"sys/fs/cgroup/memory{state.control_group}/memory.usage_in_bytes",
                          f"sys/fs/cgroup/unified{state.control_group}/memory.current",
                          f"sys/fs/cgroup{state.control_group}/memory.current"):
            path = self._fs_root / candidate
            with contextlib.suppress(OSError, ValueError):
                return int(path.read_text().strip())
        return None

    async def memory_peak(self, name: str) -> int | None:
        """The most the unit's cgroup has used since it started, in bytes; None when the kernel does
        not keep it (memory.peak came with Linux 5.19; systemd 252 has no MemoryPeak property)."""
        state = await self.unit_state(name)
        if state is None or not state.control_group:
            return None
        for candidate in (f"sys/fs/cgroup{state.control_group}/memory.peak",
                          f"sys/fs/cgroup/unified{state.control_group}/memory.peak",
                          f"sys/fs/cgroup/memory{state.control_group}/memory.max_usage_in_bytes"):
            with contextlib.suppress(OSError, ValueError):
                return int((self._fs_root / candidate).read_text().strip())
        return None

    def cgroup_file(self, state: UnitState, controller: str, filename: str) -> Path:
        """Path (from here) of a cgroup v1 controller file of the unit."""
        return self._fs_root / f"sys/fs/cgroup/{controller}{state.control_group}" / filename

    async def watch(self, name: str) -> AsyncIterator[UnitState]:
        """Yield the unit's state now (if loaded) and after every change systemd signals.

        Driven by PropertiesChanged; ends when systemd unloads the unit.
        """
        path = unit_object_path(name)
        rule = (f"type='signal',sender='{SYSTEMD}',path='{path}',"
                f"interface='{PROPERTIES_IFACE}',member='PropertiesChanged'")
        queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._watchers.setdefault(path, set()).add(queue)
        self._unit_watchers.setdefault(name, set()).add(queue)
        await self._match(rule)
        try:
            unit: dict[str, Any] = {}
            service: dict[str, Any] = {}
            last: UnitState | None = None
            # Registered before the first read, so no change between the two is lost.
            with contextlib.suppress(SystemdError):
                if await self._unit_path(name) is not None:
                    unit, service = await self._properties(path)
            if unit and unit.get("LoadState") != "not-found":
                last = _state_from(name, unit, service)
                yield last
            while True:
                event = await queue.get()
                if event[0] == "UnitRemoved":
                    if queue.empty():
                        return
                    continue
                if event[0] == "UnitNew":
                    with contextlib.suppress(SystemdError):
                        unit, service = await self._properties(path)
                else:
                    _, iface, changed, invalidated = event
                    target = unit if iface == UNIT_IFACE else service if iface == SERVICE_IFACE else None
                    if target is None:
                        continue
                    target.update(changed)
                    for prop in invalidated:
                        with contextlib.suppress(SystemdError):
                            target[prop] = await (Unit if target is unit else Service)(self._bus, path).get(prop)
                if not unit:
                    continue
                state = _state_from(name, unit, service)
                if state != last:
                    last = state
                    yield state
        finally:
            self._watchers[path].discard(queue)
            self._unit_watchers[name].discard(queue)
            await self._unmatch(rule)

    # -- changing ----------------------------------------------------------------

    async def reset_failed(self, name: str) -> None:
        try:
            await self.manager.reset_failed_unit(name)
        except SystemdError as exc:
            if exc.code != "unit_not_found":
                raise

    async def start_transient(self, unit: TransientUnit, *, timeout: float = 60.0) -> UnitState:
        """Start ``unit``; returns once systemd has exec'd its command.

        A failed or inactive leftover of the same name is reset first; a running one
        is an error (``unit_exists``): CapyCTL adopts or stops it, never replaces it.
        """
        properties = unit.properties()
        existing = await self.unit_state(unit.name)
        if existing is not None:
            if existing.is_running:
                raise SystemdError(f"{unit.name} is already {existing.active_state}.", code="unit_exists",
                                   status=409)
            await self.reset_failed(unit.name)
        try:
            job = await self.manager.start_transient_unit(unit.name, "fail", properties)
        except SystemdError as exc:
            if exc.code in ("unit_exists", "dbus_unavailable", "access_denied"):
                raise
            raise SystemdError(f"systemd did not accept {unit.name}: {exc.message}", code="start_failed",
                               detail=exc.detail) from exc
        result = await self._wait_job(job, timeout)
        state = await self.unit_state(unit.name)
        if result != "done" or state is None:
            detail: dict[str, Any] = {"job_result": result}
            if state is not None:
                detail.update(result=state.result, exec_main_status=state.exec_main_status)
            raise SystemdError(f"{unit.name} did not start (job {result}).", code="start_failed",
                               detail=detail)
        return state

    async def open_gate(self, name: str, settle: float = 1.0) -> bool:
        """Continue a unit started with ``gated=True`` (an armed unit, held at its gate: _gate.py):
        True once its main process was sent SIGCONT, False when it is not waiting there (not
        active, gone, its command already running, or this systemd's processes not visible here).

        A unit started a moment ago gets ``settle`` seconds to reach its gate. Only for the systemd
        of this machine and pid namespace (the daemon's own host): the pid is looked up here.
        """
        state = await self.unit_state(name)
        if state is None or state.active_state != "active" or self._fs_root != Path("/"):
            return False
        return await _gate.open_gate(state.main_pid, state.control_group, settle)

    async def set_description(self, name: str, description: str) -> None:
        """Change a loaded unit's Description while it runs (what ``systemctl status`` and
        ``list-units`` show); ``unit_not_found`` when systemd has no such unit."""
        # systemd's src/core/dbus-unit.c: bus_unit_set_properties() passes every property the unit
        # type does not take itself to bus_unit_set_live_property(), whose "Description" branch
        # calls unit_set_description() at any time during the unit's life, not only while a
        # transient unit is created (bus_unit_set_transient_property()). So in the source of
        # systemd 239 and of 252, the version of this project's machines and test sandbox. Of a
        # transient unit the setting is a drop-in in the transient directory (src/core/unit.c,
        # unit_drop_in_dir()), removed with the unit: a later unit of the same name starts with
        # its own Description. A name systemd has no unit of is refused with NoSuchUnit
        # (src/core/dbus-manager.c, method_set_unit_properties() -> bus_unit_validate_load_state()).
        await self.manager.set_unit_properties(name, True, [("Description", Variant("s", description))])

    async def stop_unit(self, name: str, timeout: float = 30.0) -> UnitState | None:
        """Stop the unit and return once it has no processes left.

        After ``timeout`` seconds every process of the unit gets SIGKILL. Returns the
        last state seen (None if systemd unloaded the unit, as it does after a clean
        stop of a transient unit).
        """
        current = await self.unit_state(name)
        if current is None or current.active_state in _DONE_STATES:
            return current
        events = self.watch(name)
        try:
            try:
                # The watch yields the current state at once, unless the unit vanished.
                first = await asyncio.wait_for(anext(events, None), 10)
            except asyncio.TimeoutError:
                return None
            if first is None or first.active_state in _DONE_STATES:
                return first
            try:
                await self.manager.stop_unit(name)
            except SystemdError as exc:
                if exc.code == "unit_not_found":
                    return None
                raise
            last = first

            async def until_done() -> None:
                nonlocal last
                async for state in events:
                    last = state
                    if state.active_state in _DONE_STATES:
                        return

            try:
                await asyncio.wait_for(until_done(), timeout)
                return last
            except asyncio.TimeoutError:
                pass
            with contextlib.suppress(SystemdError):
                await self.manager.kill_unit(name, "all", signal_module.SIGKILL)
            if await self.unit_state(name) is None:
                return None
            events = self.watch(name)  # the old generator was closed by the cancellation
            await asyncio.wait_for(until_done(), 30.0)
            return last
        finally:
            await events.aclose()
