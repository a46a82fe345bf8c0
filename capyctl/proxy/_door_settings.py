"""The door's limits (capyctl/proxy/_door.py; the configuration file's ``door:``, config_file.DoorConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CapyError


@dataclass(frozen=True, slots=True)
class DoorSettings:
    """The door's limits (config_file.DoorConfig, the configuration file's ``door:``)."""

    head_timeout: float = 10.0
    connections_max: int = 1024
    per_address_max: int = 256
    keyed_reserve: int = 256
    keepalive_timeout: float = 75.0

    def __post_init__(self) -> None:
        if not self.head_timeout > 0 or not self.keepalive_timeout > 0:
            raise CapyError("The door's head_timeout and keepalive_timeout must be more than 0.",
                            code="invalid_door_settings", status=400)
        if self.per_address_max < 1 or not 0 <= self.keyed_reserve < self.connections_max:
            raise CapyError("The door needs per_address_max of 1 or more and a keyed_reserve from 0 to less "
                            "than connections_max.", code="invalid_door_settings", status=400)

    @property
    def unkeyed_max(self) -> int:
        """The slots connections without a valid key may hold."""
        return self.connections_max - self.keyed_reserve
