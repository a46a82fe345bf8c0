"""vLLM: parks in place through its sleep mode (development controls), else stops."""

from __future__ import annotations

import aiohttp

from ..errors import EngineError
from ..spec import DeploymentSpec
from ._base import (EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, call, cuda_environment,
                    in_place_allowed, require_gpus_for_tp, require_path, user_environment)

KEY_ENV_NAME = "VLLM_API_KEY"


class VllmAdapter(EngineAdapter):
    kind = "vllm"

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        return "in_place" if in_place_allowed(target) else "stop"

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        venv = require_path(ctx)
        tp = require_gpus_for_tp(ctx)
        argv = [f"{venv}/bin/vllm", "serve", ctx.model_path, "--host", ctx.host, "--port", str(ctx.port),
                "--served-model-name", ctx.deployment.name]
        env = {**user_environment(ctx), **cuda_environment(ctx)}
        if self.park_method(ctx) == "in_place":
            argv.append("--enable-sleep-mode")
            # /sleep, /wake_up, /is_sleeping, /collective_rpc exist only in development mode.
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if tp > 1:
            argv += ["--tensor-parallel-size", str(tp)]
        argv += ctx.deployment.engine_args
        return LaunchPlan(argv=argv, environment=env, secret_environment={KEY_ENV_NAME: ctx.key_env},
                          health_path=self.health_path, served_model=ctx.deployment.name, key_env=ctx.key_env)

    async def park(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
        """``POST /sleep?level=N``. vLLM's default sleep ABORTS running requests: drain first."""
        if level not in (1, 2):
            raise EngineError(f"vLLM sleep level must be 1 or 2, got {level}", code="park_level_invalid", status=400)
        await call(session, "POST", base_url, "/sleep", key, params={"level": str(level)},
                   code="park_failed", what=f"vLLM sleep level {level}")

    async def wake(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
        if level == 2:
            # Level 2 discarded the weights: reallocate them, load them in place, then the KV cache,
            # and drop prefix-cache entries computed with the old weights (vLLM sleep-mode docs).
            await call(session, "POST", base_url, "/wake_up", key, params={"tags": "weights"},
                       code="wake_failed", what="vLLM wake (weights)")
            await call(session, "POST", base_url, "/collective_rpc", key, json={"method": "reload_weights"},
                       code="wake_failed", what="vLLM reload_weights")
            await call(session, "POST", base_url, "/wake_up", key, params={"tags": "kv_cache"},
                       code="wake_failed", what="vLLM wake (kv_cache)")
            await call(session, "POST", base_url, "/reset_prefix_cache", key,
                       code="wake_failed", what="vLLM reset_prefix_cache")
        else:
            await call(session, "POST", base_url, "/wake_up", key, code="wake_failed", what="vLLM wake")

    async def is_parked(self, session: aiohttp.ClientSession, base_url: str, key: str | None) -> bool | None:
        body = await call(session, "GET", base_url, "/is_sleeping", key, code="engine_error",
                          what="vLLM is_sleeping")
        if isinstance(body, dict) and isinstance(body.get("is_sleeping"), bool):
            return body["is_sleeping"]
        raise EngineError(f"vLLM /is_sleeping answered {str(body)[:200]!r}, not {{\"is_sleeping\": bool}}",
                          code="engine_protocol_error")
