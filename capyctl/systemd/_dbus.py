"""Thin typed wrappers of the systemd D-Bus interfaces CapyCTL uses.

One class per interface (org.freedesktop.systemd1.Manager, .Unit, .Service), each
turning method calls into awaitables with Python types and D-Bus errors into
SystemdError. No state beyond the bus connection lives here.
"""

from __future__ import annotations

from typing import Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from capyctl.errors import SystemdError

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER_IFACE = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
PROPERTIES_IFACE = "org.freedesktop.DBus.Properties"

# D-Bus error names mapped to CapyCTL's stable codes.
_ERROR_CODES = {
    "org.freedesktop.systemd1.NoSuchUnit": "unit_not_found",
    "org.freedesktop.systemd1.LoadFailed": "unit_not_found",
    # GetUnitByPID of a process outside every unit, or gone (src/core/dbus-manager.c, BUS_ERROR_NO_UNIT_FOR_PID).
    "org.freedesktop.systemd1.NoUnitForPID": "unit_not_found",
    "org.freedesktop.systemd1.UnitExists": "unit_exists",
    # A unit's object path that systemd no longer exports: the unit was collected between our
    # finding its path and calling it (sd-bus answers an unknown path so; the Manager's own path
    # always exists, so from these interfaces it only ever means a unit gone).
    "org.freedesktop.DBus.Error.UnknownObject": "unit_not_found",
    "org.freedesktop.DBus.Error.AccessDenied": "access_denied",
    "org.freedesktop.DBus.Error.ServiceUnknown": "dbus_unavailable",
    "org.freedesktop.DBus.Error.NoReply": "dbus_unavailable",
    "org.freedesktop.DBus.Error.Disconnected": "dbus_unavailable",
}


def unwrap(value: Any) -> Any:
    """Variants (possibly nested) to plain Python values."""
    if isinstance(value, Variant):
        return unwrap(value.value)
    if isinstance(value, list):
        return [unwrap(v) for v in value]
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    return value


class _Interface:
    interface: str = ""

    def __init__(self, bus: MessageBus, path: str) -> None:
        self.bus = bus
        self.path = path

    async def _call(self, member: str, signature: str = "", body: list[Any] | None = None,
                    *, interface: str | None = None, what: str = "") -> list[Any]:
        try:
            reply = await self.bus.call(Message(
                destination=SYSTEMD, path=self.path, interface=interface or self.interface,
                member=member, signature=signature, body=body or []))
        except (OSError, EOFError) as exc:
            raise SystemdError(f"The systemd D-Bus connection is gone ({exc}).",
                               code="dbus_unavailable") from exc
        if reply is None:
            raise SystemdError("systemd sent no reply.", code="dbus_unavailable")
        if reply.message_type == MessageType.ERROR:
            text = reply.body[0] if reply.body else reply.error_name
            code = _ERROR_CODES.get(reply.error_name or "", "systemd_error")
            subject = f" {what}" if what else ""
            raise SystemdError(f"systemd refused {member}{subject}: {text}", code=code,
                               detail={"dbus_error": reply.error_name})
        return reply.body

    async def get_all(self) -> dict[str, Any]:
        (props,) = await self._call("GetAll", "s", [self.interface], interface=PROPERTIES_IFACE)
        return unwrap(props)

    async def get(self, name: str) -> Any:
        (value,) = await self._call("Get", "ss", [self.interface, name], interface=PROPERTIES_IFACE)
        return unwrap(value)


class Manager(_Interface):
    interface = MANAGER_IFACE

    def __init__(self, bus: MessageBus) -> None:
        super().__init__(bus, MANAGER_PATH)

    async def subscribe(self) -> None:
        """Ask systemd to emit unit and job signals to this connection."""
        await self._call("Subscribe")

    async def get_unit(self, name: str) -> str:
        (path,) = await self._call("GetUnit", "s", [name], what=name)
        return path

    async def get_unit_by_pid(self, pid: int) -> str:
        (path,) = await self._call("GetUnitByPID", "u", [pid], what=f"for PID {pid}")
        return path

    async def start_transient_unit(self, name: str, mode: str,
                                   properties: list[tuple[str, Variant]]) -> str:
        (job,) = await self._call("StartTransientUnit", "ssa(sv)a(sa(sv))",
                                  [name, mode, [list(p) for p in properties], []], what=name)
        return job

    async def stop_unit(self, name: str, mode: str = "replace") -> str:
        (job,) = await self._call("StopUnit", "ss", [name, mode], what=name)
        return job

    async def kill_unit(self, name: str, who: str, signal: int) -> None:
        await self._call("KillUnit", "ssi", [name, who, signal], what=name)

    async def reset_failed_unit(self, name: str) -> None:
        await self._call("ResetFailedUnit", "s", [name], what=name)

    async def set_unit_properties(self, name: str, runtime: bool,
                                  properties: list[tuple[str, Variant]]) -> None:
        await self._call("SetUnitProperties", "sba(sv)", [name, runtime, [list(p) for p in properties]],
                         what=name)

    async def list_units_by_patterns(self, states: list[str], patterns: list[str]) -> list[list[Any]]:
        (units,) = await self._call("ListUnitsByPatterns", "asas", [states, patterns])
        return units


class Unit(_Interface):
    interface = UNIT_IFACE


class Service(_Interface):
    interface = SERVICE_IFACE


async def add_match(bus: MessageBus, rule: str) -> None:
    await _bus_daemon_call(bus, "AddMatch", rule)


async def remove_match(bus: MessageBus, rule: str) -> None:
    await _bus_daemon_call(bus, "RemoveMatch", rule)


async def _bus_daemon_call(bus: MessageBus, member: str, rule: str) -> None:
    reply = await bus.call(Message(
        destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
        interface="org.freedesktop.DBus", member=member, signature="s", body=[rule]))
    if reply is not None and reply.message_type == MessageType.ERROR:
        raise SystemdError(f"The bus refused {member} {rule!r}: {reply.body}", code="dbus_unavailable")
