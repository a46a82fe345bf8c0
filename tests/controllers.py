"""A real Controller for unit tests, over a test's stand-in for systemd's D-Bus client."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

from capyctl.config import DaemonConfig, Paths


class RecordingSystemd:
    """A stand-in for CapyCTL's systemd D-Bus client (capyctl.systemd) on which every unit stays
    as it is asked to be: it starts, its gate opens, it stops, it never changes state by itself and
    its memory is not known. It records what it was asked: ``started`` the transient units, in
    order, and ``events`` ("start", unit), ("describe", unit) and ("stop", unit) by unit name."""

    def __init__(self) -> None:
        self.started: list[Any] = []
        self.events: list[tuple[str, str]] = []

    async def unit_state(self, name):
        return None

    async def open_gate(self, name):
        return True

    async def start_transient(self, unit, **_):
        self.started.append(unit)
        self.events.append(("start", unit.name))

    async def set_description(self, name, description):
        self.events.append(("describe", name))

    async def watch(self, name):
        await asyncio.Event().wait()  # the unit never changes state
        yield  # pragma: no cover

    async def stop_unit(self, name, timeout=30.0):
        self.events.append(("stop", name))

    async def memory_current(self, unit):
        return None


def custom_engine(name: str = "custom-x") -> Any:
    """A custom engine's registration, as `capyctl engine add` records it (capyctl.spec.EngineSpec):
    what a deployment naming ``name`` needs to be recorded by Controller.deploy. Nothing runs it."""
    from capyctl.spec import EngineSpec

    return EngineSpec(kind="engine", name=name, type="custom", cmd=[f"/opt/{name}/serve", "--port", "{port}"])


@contextlib.asynccontextmanager
async def vllm_controller(tmp_path: Path, systemd: Any,
                          config: DaemonConfig | None = None) -> AsyncIterator[tuple[Any, Path]]:
    """A Controller over ``systemd``, its state under ``tmp_path``, vLLM registered as engine
    ``vllm`` (an empty venv: nothing runs it) and an empty model directory: (controller, model)."""
    from capyctl.controller import Controller
    from capyctl.spec import EngineSpec
    from capyctl.store import Store

    state = tmp_path / "state"
    state.mkdir()
    store = Store(state / "state.db")
    config = config or DaemonConfig()
    config.paths = Paths(state_dir=state, runtime_dir=tmp_path / "run")
    ctl = Controller(config, store, systemd)
    ctl.paths.secrets_dir.mkdir(parents=True)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    store.put_engine(EngineSpec.model_validate({"kind": "engine", "name": "vllm", "type": "vllm", "path": str(venv)}))
    model = tmp_path / "model"
    model.mkdir()
    try:
        yield ctl, model
    finally:
        await ctl.close()
        store.close()
