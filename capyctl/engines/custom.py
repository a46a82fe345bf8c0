"""A server described by its registration: a command template, a health path, optional park/wake calls."""

from __future__ import annotations

import aiohttp

from ..errors import EngineError
from ..spec import DeploymentSpec, EngineSpec
from ..spec.models import HttpCall
from ._base import (EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, call, cuda_environment, unsupported_task,
                    user_environment)

# No {key}: a key on the command line shows in /proc/PID/cmdline (EngineSpec refuses it); the
# server reads CAPYCTL_ENGINE_KEY, or its own variable named by key_env, from the environment.
PLACEHOLDERS = ("port", "host", "model", "name")


def render_cmd(template: list[str], ctx: LaunchContext) -> list[str]:
    """Fill {port} {host} {model} {name}; other braces (JSON arguments) stay as written."""
    values = {"port": str(ctx.port), "host": ctx.host, "model": ctx.model_path, "name": ctx.deployment.name}
    out = []
    for part in template:
        for name in PLACEHOLDERS:
            part = part.replace("{" + name + "}", values[name])
        out.append(part)
    return out


class CustomAdapter(EngineAdapter):
    """Bound to one registration, since the health path and park/wake calls live in it."""

    kind = "custom"

    def __init__(self, engine: EngineSpec | None = None) -> None:
        self.engine = engine

    @property
    def health_path(self) -> str:  # type: ignore[override]
        return self.engine.health if self.engine is not None else "/health"

    def capabilities(self, engine: EngineSpec, *, deployment: DeploymentSpec | None = None,
                     model_path: str | None = None) -> frozenset[str]:
        return frozenset(engine.capabilities)  # a custom server is exactly what its registration says

    def check_task(self, deployment: DeploymentSpec) -> None:
        # CapyCTL knows no flag of a custom server: what it serves is its registration's capabilities.
        if deployment.task != "generate":
            raise unsupported_task(deployment, "a custom engine", "CapyCTL has no flag to start it for a task: pass the "
                                   "server's own flags in engine_args and list its routes in the engine "
                                   "registration's capabilities (embeddings, rerank, ...)")

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        engine = target.engine if isinstance(target, LaunchContext) else self.engine
        deployment = target.deployment if isinstance(target, LaunchContext) else target
        if engine is None or engine.park is None or deployment.park == "stop" \
                or deployment.declared_park_tier == "restart":
            return "stop"
        return "in_place"

    def park_tier_refusal(self, deployment: DeploymentSpec, tier: str) -> str | None:
        # What the manifest's park call keeps is the manifest author's to declare; CapyCTL charges it so.
        if self.engine is None or self.engine.park is None:
            return "this custom engine's registration has no park and wake calls: it parks by stopping the unit"
        return None

    def parked_host_bytes(self, deployment: DeploymentSpec, model_bytes: int) -> int:
        return 0 if deployment.declared_park_tier == "deep" else model_bytes

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        self.check_task(ctx.deployment)
        if not ctx.engine.cmd:
            raise EngineError(f"custom engine {ctx.engine.name!r} has no cmd", code="engine_cmd_missing", status=400)
        argv = render_cmd(ctx.engine.cmd, ctx) + list(ctx.deployment.engine_args)
        return LaunchPlan(argv=argv, environment={**user_environment(ctx), **cuda_environment(ctx)},
                          # CAPYCTL_ENGINE_KEY always, and the registration's own variable: the
                          # unit's credential shell exports both from the key credential.
                          secret_environment={ctx.key_env: ctx.key_env,
                                              **({ctx.engine.key_env: ctx.key_env} if ctx.engine.key_env else {})},
                          health_path=ctx.engine.health, served_model=None,
                          key_env=ctx.key_env)

    def _bound_call(self, which: str) -> HttpCall:
        http = getattr(self.engine, which, None) if self.engine is not None else None
        if http is None:
            raise EngineError(f"this custom engine declares no {which} call; stop the unit instead",
                              code="park_unsupported")
        return http

    async def park(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
        """The registration's ``park`` call. The caller must have drained in-flight requests first."""
        http = self._bound_call("park")
        await call(session, http.method, base_url, http.path, key, json=http.body, code="park_failed",
                   what=f"custom park {http.method} {http.path}")

    async def wake(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int,
                   model_path: str | None = None) -> None:
        http = self._bound_call("wake")
        await call(session, http.method, base_url, http.path, key, json=http.body, code="wake_failed",
                   what=f"custom wake {http.method} {http.path}")
