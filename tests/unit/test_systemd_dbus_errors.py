"""D-Bus errors become CapyCTL's stable codes through one table (capyctl/systemd/_dbus.py), so
callers test a code, never the text of an error name."""

from __future__ import annotations

import asyncio

import pytest
from dbus_fast import Message, MessageType

from capyctl.errors import SystemdError
from capyctl.systemd._dbus import Unit


class _Bus:
    """Answers every call with the D-Bus error ``name``, as systemd's bus would."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def call(self, message: Message) -> Message:
        return Message(message_type=MessageType.ERROR, error_name=self.name, reply_serial=1, signature="s",
                       body=["no such object"])


@pytest.mark.parametrize("error,code", [
    ("org.freedesktop.DBus.Error.UnknownObject", "unit_not_found"),  # a unit collected under us
    ("org.freedesktop.systemd1.NoSuchUnit", "unit_not_found"),
    ("org.freedesktop.DBus.Error.AccessDenied", "access_denied"),
    ("org.example.Unheard", "systemd_error"),
])
def test_a_dbus_error_name_maps_to_its_code(error: str, code: str) -> None:
    unit = Unit(_Bus(error), "/org/freedesktop/systemd1/unit/capyctl_2dx_2eservice")  # type: ignore[arg-type]
    with pytest.raises(SystemdError) as info:
        asyncio.run(unit.get_all())
    assert info.value.code == code and info.value.detail["dbus_error"] == error


def test_no_caller_reads_error_names_itself() -> None:
    from pathlib import Path
    package = Path(__file__).resolve().parents[2] / "capyctl" / "systemd"
    readers = [p.name for p in sorted(package.glob("*.py")) if p.name != "_dbus.py" and "UnknownObject" in p.read_text()]
    assert readers == []


def test_set_description_sends_set_unit_properties_and_maps_no_such_unit() -> None:
    """SetUnitProperties(name, runtime=True, [("Description", s)]); a unit systemd does not have
    answers NoSuchUnit, which the table makes unit_not_found."""
    from pathlib import Path

    from capyctl.systemd import SystemdClient

    sent: list[Message] = []

    class _Recording(_Bus):
        def add_message_handler(self, handler: object) -> None:
            pass

        async def call(self, message: Message) -> Message:
            sent.append(message)
            return await super().call(message)

    client = SystemdClient(_Recording("org.freedesktop.systemd1.NoSuchUnit"), Path("/"))  # type: ignore[arg-type]
    with pytest.raises(SystemdError) as info:
        asyncio.run(client.set_description("capyctl-gone.service", "parked"))
    assert info.value.code == "unit_not_found"
    [message] = sent
    assert (message.interface, message.member, message.signature) == (
        "org.freedesktop.systemd1.Manager", "SetUnitProperties", "sba(sv)")
    name, runtime, [[prop, value]] = message.body
    assert (name, runtime, prop, value.signature, value.value) == (
        "capyctl-gone.service", True, "Description", "s", "parked")
