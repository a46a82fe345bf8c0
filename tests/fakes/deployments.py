"""A fake of what the memory planner reads of a deployment (capyctl.controller._services.PlacedDeployment),
for planner tests that need no actor, systemd or engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

from capyctl.engines import adapter_for


def _controller() -> SimpleNamespace:
    return SimpleNamespace(adapter=lambda spec: adapter_for(spec.engine))


@dataclass
class PlacedDeploymentFake:
    """The fields of DeploymentActor the planner reads; its controller answers only ``adapter``."""

    spec: object
    state: str = "stopped"
    last_used: float = 0.0
    busy: bool = False
    parked_in_place: bool = False
    host: str = "local"
    model_path: str | None = None
    controller: object = field(default_factory=_controller)
    _commands: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def has_pending_commands(self) -> bool:
        return not self._commands.empty()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def unit(self) -> str:
        return f"capyctl-{self.spec.name}.service"
