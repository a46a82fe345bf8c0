"""TensorFold: no park API, so park means stop; serves /v1/systemone natively."""

from __future__ import annotations

from typing import ClassVar

from ..spec import DeploymentSpec
from ._base import (EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, cuda_environment, require_path,
                    user_environment)

KEY_ENV_NAME = "TENSORFOLD_API_KEY"


class TensorFoldAdapter(EngineAdapter):
    kind = "tensorfold"
    base_capabilities: ClassVar[frozenset[str]] = frozenset({"chat", "completions", "systemone"})

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        # The weights stay in the page cache after a stop, so a restart is the wake.
        return "stop"

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        venv = require_path(ctx)
        argv = [f"{venv}/bin/tensorfold", "serve", "--model", ctx.model_path, "--host", ctx.host,
                "--port", str(ctx.port), *ctx.deployment.engine_args]
        return LaunchPlan(argv=argv, environment={**user_environment(ctx), **cuda_environment(ctx)},
                          secret_environment={KEY_ENV_NAME: ctx.key_env}, health_path=self.health_path,
                          served_model=None, key_env=ctx.key_env)
