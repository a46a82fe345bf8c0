"""llama-server (llama.cpp): park means stop the unit; the key comes from LLAMA_API_KEY."""

from __future__ import annotations

from typing import ClassVar

from ..spec import DeploymentSpec, EngineSpec
from ._base import (EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, cuda_environment, has_flag,
                    require_path, user_environment)
from ._gguf import read_string_metadata

# llama-server's default context (0) means "as trained", which is 128k tokens for many models and
# a KV cache far larger than the weights; a bounded default keeps memory predictable.
DEFAULT_CONTEXT = 4096
# -ngl larger than any model's layer count offloads all of them.
ALL_LAYERS = "999"
# Model families trained to answer /v1/systemone natively (DESIGN.md); SmolLM2 and friends are not.
NATIVE_DECISION_MODELS = ("clef", "laya", "openjev")
KEY_ENV_NAME = "LLAMA_API_KEY"


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
    base_capabilities: ClassVar[frozenset[str]] = frozenset({"chat", "completions", "logprobs", "tools"})

    def capabilities(self, engine: EngineSpec, *, deployment: DeploymentSpec | None = None,
                     model_path: str | None = None) -> frozenset[str]:
        caps = set(super().capabilities(engine, deployment=deployment, model_path=model_path))
        if deployment is not None and has_flag(deployment.engine_args, "--embedding", "--embeddings"):
            caps.add("embeddings")
        if model_path is not None and is_native_decision_model(model_path):
            caps.add("systemone")
        return frozenset(caps)

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        return "stop"

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        extra = list(ctx.deployment.engine_args)
        argv = [require_path(ctx), "-m", ctx.model_path, "--host", ctx.host, "--port", str(ctx.port),
                "--alias", ctx.deployment.name, "--jinja"]
        if not has_flag(extra, "-c", "--ctx-size"):
            argv += ["-c", str(DEFAULT_CONTEXT)]
        if ctx.cpu_threads is not None and not has_flag(extra, "-t", "--threads"):
            argv += ["-t", str(ctx.cpu_threads)]
        if ctx.gpu_indices and not has_flag(extra, "-ngl", "--gpu-layers", "--n-gpu-layers"):
            argv += ["-ngl", ALL_LAYERS]
        argv += extra
        return LaunchPlan(
            argv=argv,
            environment={**user_environment(ctx), **cuda_environment(ctx)},
            secret_environment={KEY_ENV_NAME: ctx.key_env},
            health_path=self.health_path,
            served_model=None,  # llama-server serves its one model whatever name the body carries
            key_env=ctx.key_env,
        )
