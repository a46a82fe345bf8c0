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
    client = Path(__file__).resolve().parents[2] / "capyctl" / "systemd" / "_client.py"
    assert "UnknownObject" not in client.read_text()
