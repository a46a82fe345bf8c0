"""SGLang: parks in place by releasing memory occupation (memory saver), else stops."""

from __future__ import annotations

import aiohttp

from ..spec import DeploymentSpec
from ._base import (EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, call, cuda_environment,
                    in_place_allowed, require_gpus_for_tp, require_path, user_environment)

MEMORY_TAGS = ["weights", "kv_cache"]


class SglangAdapter(EngineAdapter):
    kind = "sglang"

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        return "in_place" if in_place_allowed(target) else "stop"

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        venv = require_path(ctx)
        tp = require_gpus_for_tp(ctx)
        # SGLang reads its key only from --api-key; systemd expands the reference at exec time.
        argv = [f"{venv}/bin/python", "-m", "sglang.launch_server", "--model-path", ctx.model_path,
                "--host", ctx.host, "--port", str(ctx.port), "--served-model-name", ctx.deployment.name,
                "--api-key", ctx.key_ref]
        if self.park_method(ctx) == "in_place":
            argv.append("--enable-memory-saver")
        if tp > 1:
            argv += ["--tp", str(tp)]
        argv += ctx.deployment.engine_args
        return LaunchPlan(argv=argv, environment={**user_environment(ctx), **cuda_environment(ctx)},
                          secret_environment={}, health_path=self.health_path,
                          served_model=ctx.deployment.name, key_env=ctx.key_env)

    async def park(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
        """``POST /release_memory_occupation``. SGLang asserts no request is running: drain first."""
        await call(session, "POST", base_url, "/release_memory_occupation", key, json={"tags": MEMORY_TAGS},
                   code="park_failed", what="SGLang release_memory_occupation")

    async def wake(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
        await call(session, "POST", base_url, "/resume_memory_occupation", key, json={"tags": MEMORY_TAGS},
                   code="wake_failed", what="SGLang resume_memory_occupation")
