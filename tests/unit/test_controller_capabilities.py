"""A deployment's routes are known from its spec before its first launch: the proxy refuses a
route the engine lacks (route_not_served) without waking, or even starting, the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capyctl.config import DaemonConfig, Paths
from capyctl.controller import Controller
from capyctl.controller._actor import DeploymentActor
from capyctl.errors import CapyError
from capyctl.spec import EngineSpec, parse_manifest
from capyctl.store import Store
from tests.unit.test_gpu_layers import write_gguf


class NoSystemd:
    """Nothing here may reach systemd: no deployment is started."""

    def __getattr__(self, name: str):
        raise AssertionError(f"systemd.{name} was used")


@pytest.fixture
async def controller(tmp_path: Path):
    store = Store(tmp_path / "state.db")
    ctl = Controller(DaemonConfig(paths=Paths(state_dir=tmp_path / "state", runtime_dir=tmp_path / "run")),
                     store, NoSystemd())
    for kind in ("llama.cpp", "vllm", "tensorfold"):
        store.put_engine(EngineSpec.model_validate({"kind": "engine", "name": kind, "type": kind,
                                                    "path": str(tmp_path / kind)}))
    yield ctl
    await ctl.close()
    store.close()


def entry(ctl: Controller, model: str):
    return next(e for e in ctl.models() if e.id == model)


async def test_a_never_launched_deployment_lists_its_routes(controller, tmp_path):
    gguf = write_gguf(tmp_path / "smol.gguf", {"general.architecture": "llama"}, 4096)
    actor = await controller.deploy(parse_manifest(
        f"name: vectors\nengine: llama.cpp\nmodel: {{path: {gguf}}}\ntask: embed\naliases: [vec]\n"))
    assert actor.state == "stopped" and actor.launch_id is None
    for model in ("vectors", "vec"):
        assert {"embeddings", "chat", "tokenize"} <= entry(controller, model).capabilities
    hub = await controller.deploy(parse_manifest("name: ranker\nengine: vllm\nmodel: {hf: org/ranker}\ntask: rerank\n"))
    assert hub.capabilities == {"rerank", "score", "tokenize"}  # no model path yet: the task alone decides


async def test_the_model_path_refines_them_before_a_launch(controller, tmp_path):
    whisper = tmp_path / "whisper"
    whisper.mkdir()
    (whisper / "config.json").write_text(json.dumps({"architectures": ["WhisperForConditionalGeneration"]}))
    actor = await controller.deploy(parse_manifest(f"name: ears\nengine: vllm\nmodel: {{path: {whisper}}}\n"))
    assert actor.capabilities == {"transcriptions", "tokenize"}


async def test_a_new_revision_changes_them_and_a_reloaded_actor_has_them(controller, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    manifest = f"name: m\nengine: vllm\nmodel: {{path: {model}}}\n"
    actor = await controller.deploy(parse_manifest(manifest))
    assert "chat" in actor.capabilities and "embeddings" not in actor.capabilities
    await controller.deploy(parse_manifest(manifest + "task: embed\n"))
    assert "chat" not in entry(controller, "m").capabilities and "embeddings" in entry(controller, "m").capabilities
    # As Controller.start makes actors from the store after a daemon restart.
    reloaded = DeploymentActor(controller, controller.store.current_revision("m"))
    try:
        assert reloaded.capabilities == actor.capabilities
    finally:
        reloaded._task.cancel()


async def test_a_task_the_engine_cannot_serve_is_refused_before_it_is_recorded(controller, tmp_path):
    with pytest.raises(CapyError) as err:
        await controller.deploy(parse_manifest(f"name: tf\nengine: tensorfold\nmodel: {{path: {tmp_path}}}\n"
                                               "task: embed\n"))
    assert err.value.code == "task_unsupported" and err.value.status == 400
    assert controller.store.current_revision("tf") is None and "tf" not in controller.actors


async def test_one_model_is_looked_up_without_building_every_entry(controller, tmp_path, monkeypatch):
    """The proxy asks for the one model a request names (Controller.model_entry): the same entry
    models() lists, for a name and an alias; None for an unknown model."""
    gguf = write_gguf(tmp_path / "smol.gguf", {"general.architecture": "llama"}, 4096)
    for name in ("a", "b", "c"):
        await controller.deploy(parse_manifest(f"name: {name}\nengine: llama.cpp\nmodel: {{path: {gguf}}}\n"
                                               f"aliases: [{name}-alias]\n"))
    expected = {e.id: e for e in controller.models()}
    monkeypatch.setattr(controller, "models", lambda: pytest.fail("models() built for one request"))
    for model in ("a", "b-alias", "c"):
        assert controller.model_entry(model) == expected[model]
    assert controller.model_entry("nope") is None
