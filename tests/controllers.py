"""A real Controller for unit tests, over a test's stand-in for systemd's D-Bus client."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

from capyctl.config import DaemonConfig, Paths


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
