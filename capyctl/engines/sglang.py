"""SGLang: parks in place by releasing its memory occupation (memory saver), else stops.

Facts from SGLang 0.5.23's source (the wheel's sglang/srt/...):

- Flags are generated from the config fields (arg_groups/arg_utils.py, ``--`` + field name with
  "-"): ``--tp-size`` (alias ``--tensor-parallel-size``; ``--tp`` works only as an argparse
  abbreviation), ``--enable-memory-saver``, ``--enable-weights-cpu-backup`` (fields/exec_.py),
  ``--mem-fraction-static`` (fields/schedule.py), ``--nnodes --node-rank --dist-init-addr``
  (fields/parallel.py), ``--api-key`` (fields/serving.py).
- ``POST /release_memory_occupation`` and ``/resume_memory_occupation`` take ``{"tags": [...]}``;
  a null or empty list means every tag, ``GPU_MEMORY_ALL_TYPES`` = kv_cache, weights, cuda_graph
  (constants.py; managers/scheduler_components/weight_updater.py). They answer 200 with a null
  body; an exception raised before the scheduler answers 400 ``{"error": {"message": ...}}``
  (entrypoints/http_server.py, _create_error_response).
- The scheduler asserts it is idle before a release, and a resume does
  ``offload_tags.remove(tag)`` (KeyError for a tag not released); torch_memory_saver exits the
  process when a paused region is paused again. Any of these kills the WHOLE server
  (scheduler.py run_scheduler_process sends SIGQUIT; the handler kills the process tree), so
  the caller drains first and this adapter releases once and resumes only what it released.
- Without ``--enable-weights-cpu-backup`` the weights region is paused with no host copy
  (model_runner_components/load_model_utils.py, memory_saver_adapter.region(...,
  enable_cpu_backup=...)): resume maps fresh, uninitialised memory and the model answers garbage.
- No environment variable holds the API key (environ.py). ``--config FILE.yaml`` is merged into
  the arguments inside the process (utils/server_args_config_parser.py), so the key lives in a
  YAML file, loaded into the unit as a systemd credential (0400, the unit's user), and
  /proc/PID/cmdline shows only its path.
- The key guards every route but /health*, /ready*, /metrics* (utils/auth.py
  decide_request_auth); release/resume are ADMIN_OPTIONAL: with only --api-key set they need
  that key.
- No unix socket: the HTTP server is uvicorn/granian on --host/--port only
  (entrypoints/http_server.py _setup_and_run_http_server).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import aiohttp

from ..errors import CapyError, EngineError
from ..spec import DeploymentSpec, EngineSpec
from ._parsers import ParserChoice, choose_parsers, parser_flags
from ._tiers import HOST_BACKED, resolve_park_tier
from ._base import (SECRET_FILE_KEY, EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, call,
                    cuda_environment, flag_value, has_flag, in_place_allowed, registered_capabilities, require_gpus_for_tp,
                    require_path, user_environment)

log = logging.getLogger(__name__)

# sglang/srt/constants.py GPU_MEMORY_ALL_TYPES (0.5.23): everything the memory saver can release.
# The CUDA graphs' memory is released too, or a parked model keeps holding it.
PARK_TAGS: tuple[str, ...] = ("kv_cache", "weights", "cuda_graph")

# SGLang's config merger accepts only .yaml/.yml files (server_args_config_parser.py).
CONFIG_SUFFIX = ".sglang.yaml"

# How many launches' release records are kept: one per launch, kept after the wake so that a
# second wake of the same launch resumes nothing. Old launches' records are dropped first.
MAX_RECORDS = 1024


def config_file_name(ctx: LaunchContext) -> str:
    return f"{ctx.deployment.name}{CONFIG_SUFFIX}"


def config_file_text() -> str:
    # Double-quoted: a hex key of digits only would otherwise load as a YAML int (and lose its
    # leading zeros), and SGLang passes str(value) on as --api-key.
    return f'api-key: "{SECRET_FILE_KEY}"\n'


# srt/entrypoints/http_server.py registers every route whatever the flags; what answers depends on
# whether the model generates (tokenizer_manager.is_generation, False with --is-embedding:
# configs/model_config.py is_generation_model). With a generating model: /v1/chat/completions,
# /v1/completions, POST /v1/responses and GET /v1/responses/{response_id}, /v1/messages and
# /v1/messages/count_tokens, /tokenize and /v1/tokenize, /detokenize and /v1/detokenize, /v1/score
# (log-probabilities of label tokens for a causal LM), /v1/systemone (its own answer, the same request
# shape: entrypoints/systemone/protocol.py), chat logprobs. /v1/embeddings needs --is-embedding
# (tokenizer_manager.py refuses an EmbeddingReqInput while is_generation); /v1/rerank without a Qwen3
# reranker template is a cross-encoder request (openai/serving_rerank.py _detect_rerank_backend),
# like /v1/score for a *ForSequenceClassification model, both with --is-embedding.
GENERATION_CAPABILITIES = frozenset({"chat", "completions", "responses", "responses_get", "messages", "tokenize",
                                     "tokenize_v1", "score", "systemone", "logprobs"})
POOLING_CAPABILITIES = {
    "embed": frozenset({"embeddings", "tokenize", "tokenize_v1"}),
    "rerank": frozenset({"rerank", "score", "tokenize", "tokenize_v1"}),
}
# arg_groups/fields/model.py: "Whether to use a CausalLM as an embedding model"; embedding and
# cross-encoder architectures turn it on by themselves (arg_groups/model_hook.py).
EMBEDDING_FLAG = "--is-embedding"
# HiCache, the host-RAM tier of SGLang's radix cache (arg_groups/fields/memory.py, 0.5.23).
HICACHE_FLAGS = ("--enable-hierarchical-cache", "--enable-hicache")
# /v1/audio/transcriptions picks an adapter by a substring of the model's architecture
# (openai/transcription_adapters/base.py resolve_adapter; the keys its modules register), and
# falls back to Whisper's for any other model.
TRANSCRIPTION_ARCHITECTURE_KEYS = ("Whisper", "Qwen2Audio", "Qwen3ASR", "GlmAsr", "GraniteSpeech", "MiMoV2ASR")


def deployment_task(deployment: DeploymentSpec) -> str:
    """The deployment's task; for ``generate`` (the default), ``embed`` when engine_args say --is-embedding."""
    if deployment.task == "generate" and has_flag(deployment.engine_args, EMBEDDING_FLAG):
        return "embed"
    return deployment.task


def transcribes(model_path: str) -> bool:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list):
        return False
    return any(isinstance(arch, str) and key in arch for arch in architectures for key in TRANSCRIPTION_ARCHITECTURE_KEYS)


class SglangAdapter(EngineAdapter):
    kind = "sglang"
    unix_socket = False  # uvicorn.Config(host=..., port=...) only: no unix socket in 0.5.23
    base_capabilities = GENERATION_CAPABILITIES

    def capabilities(self, engine: EngineSpec, *, deployment: DeploymentSpec | None = None,
                     model_path: str | None = None) -> frozenset[str]:
        task = deployment_task(deployment) if deployment is not None else "generate"
        caps = set(GENERATION_CAPABILITIES if task == "generate" else POOLING_CAPABILITIES[task])
        if task == "generate" and model_path is not None and transcribes(model_path):
            caps.add("transcriptions")
        return frozenset(caps | registered_capabilities(engine))

    def __init__(self) -> None:
        # (base_url, key) -> the tags this adapter released on that launch and has not resumed.
        # The per-launch key tells launches apart even when a port is reused.
        self._released: dict[tuple[str, str | None], frozenset[str]] = {}

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        return "in_place" if in_place_allowed(target) else "stop"

    def parsers(self, deployment: DeploymentSpec, model_path: str | None) -> ParserChoice | None:
        if deployment_task(deployment) != "generate":
            return None
        return choose_parsers(self.kind, deployment, model_path)

    def check_task(self, deployment: DeploymentSpec) -> None:
        self.check_hicache(deployment)

    def check_hicache(self, deployment: DeploymentSpec) -> None:
        """Without --hicache-size, HiCache sizes its host pool by --hicache-ratio (twice the GPU
        pool by default) or a fraction of the host's free memory (arg_groups/hicache_hook.py,
        mem_cache/pool_host/base.py): nothing a plan can count before the engine runs."""
        args = list(deployment.engine_args)
        if has_flag(args, *HICACHE_FLAGS) and not has_flag(args, "--hicache-size"):
            raise CapyError(f"deployment {deployment.name!r} turns on SGLang's hierarchical cache without "
                            "--hicache-size, so its host memory is sized by SGLang at start and no memory plan "
                            "can hold it; add --hicache-size GB (per rank) to engine_args",
                            code="prompt_cache_unbounded", status=400, detail={"field": "engine_args"})

    def park_tier_refusal(self, deployment: DeploymentSpec, tier: str) -> str | None:
        return None  # host_backed: --enable-weights-cpu-backup; deep: the memory saver alone

    def prompt_cache_ram(self, deployment: DeploymentSpec, model_path: str | None) -> int:
        # HiCache's host pool (--enable-hierarchical-cache / --enable-hicache): --hicache-size is
        # "GB" (10^9 bytes) for each rank's pool (arg_groups/fields/memory.py; mem_cache/pool_host/
        # base.py), SGLang 0.5.23. check_task refuses HiCache without it.
        args = list(deployment.engine_args)
        if not has_flag(args, *HICACHE_FLAGS):
            return 0
        try:
            size = float(flag_value(args, "--hicache-size") or 0)
        except ValueError:
            return 0  # SGLang refuses the value itself
        ranks = max(1, deployment.tensor_parallel // max(1, deployment.nodes))
        return int(size * 10**9) * ranks

    def parked_host_bytes(self, deployment: DeploymentSpec, model_bytes: int) -> int:
        from ._tiers import in_place_tier
        return model_bytes if in_place_tier(deployment) == "host_backed" else 0

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        self.check_task(ctx.deployment)
        venv = require_path(ctx)
        # The total across nodes: SGLang runs tp_size // nnodes ranks per node
        # (entrypoints/engine.py _calculate_rank_ranges) and asserts divisibility (validation_hook.py).
        tp = require_gpus_for_tp(ctx)
        user = ctx.deployment.engine_args
        argv = [f"{venv}/bin/python", "-m", "sglang.launch_server", "--model-path", ctx.model_path,
                "--host", ctx.host, "--port", str(ctx.port), "--served-model-name", ctx.deployment.name]
        secret_files: dict[str, str] = {}
        if has_flag(user, "--config", "--api-key"):
            raise CapyError(
                f"deployment {ctx.deployment.name!r}: engine_args must not set --config or --api-key; CapyCTL "
                "gives SGLang its per-launch key through the one --config file SGLang accepts",
                code="engine_args_conflict", status=400)
        if ctx.secret_dir is not None:
            name = config_file_name(ctx)
            argv += ["--config", f"{ctx.secret_dir.rstrip('/')}/{name}"]
            secret_files[name] = config_file_text()
        else:
            # The key on the command line would show in /proc/PID/cmdline to every local user.
            raise CapyError(f"deployment {ctx.deployment.name!r}: SGLang takes its key only from a --config "
                            "file, and this launch has no credentials directory to load it into",
                            code="secret_dir_missing", status=500)
        if deployment_task(ctx.deployment) != "generate" and not has_flag(user, EMBEDDING_FLAG):
            argv.append(EMBEDDING_FLAG)
        choice = self.parsers(ctx.deployment, ctx.model_path)
        if choice is not None:
            argv += parser_flags(self.kind, choice, user)
        if self.park_method(ctx) == "in_place":
            # The memory saver makes the release possible; the CPU backup (host_backed) keeps a pinned
            # host copy of the weights through it. Without the backup (deep) the released weights are
            # gone and wake re-reads them from disk (update_weights_from_disk).
            argv.append("--enable-memory-saver")
            if resolve_park_tier(self, ctx.deployment, unified_memory=ctx.unified_memory) == HOST_BACKED:
                argv.append("--enable-weights-cpu-backup")
        if tp > 1 and not has_flag(user, "--tp-size", "--tensor-parallel-size", "--tp"):
            argv += ["--tp-size", str(tp)]
        if ctx.gpu_memory_fraction is not None and not has_flag(user, "--mem-fraction-static"):
            # SGLang sizes its static pool (weights + KV cache) as this fraction of the memory FREE on
            # the card when it starts (min over its ranks), not of the card's total, and keeps the rest
            # for activations and CUDA graphs (model_runner_components/kv_pool_runtime.py,
            # distributed/bootstrap.py measure_pre_model_load_memory). On an otherwise empty card the
            # two agree; the plan's fraction of the total is emitted as given.
            # Rounded down: never more than the plan gives.
            argv += ["--mem-fraction-static", str(math.floor(ctx.gpu_memory_fraction * 10000 + 1e-6) / 10000)]
        argv += user
        return LaunchPlan(argv=argv, environment={**user_environment(ctx), **cuda_environment(ctx)},
                          secret_environment={}, health_path=self.health_path,
                          served_model=ctx.deployment.name, key_env=ctx.key_env, secret_files=secret_files)

    async def park(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
        """``POST /release_memory_occupation`` with every tag, once per launch.

        SGLang crashes if a request is running (drain first, the caller's job) or if a released
        region is released again, so a launch already released is left as it is.
        """
        launch = (base_url, key)
        if self._released.get(launch):
            return
        await call(session, "POST", base_url, "/release_memory_occupation", key, json={"tags": list(PARK_TAGS)},
                   code="park_failed", what="SGLang release_memory_occupation")
        self._record(launch, frozenset(PARK_TAGS))

    async def wake(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int,
                   model_path: str | None = None) -> None:
        """``POST /resume_memory_occupation`` with exactly the tags this launch released.

        Resuming a tag that is not released crashes SGLang, so a launch with nothing released
        resumes nothing. A launch this adapter never saw (the daemon restarted while it was
        parked in place) was parked by this adapter's one release of PARK_TAGS.
        """
        launch = (base_url, key)
        tags = self._released.get(launch, frozenset(PARK_TAGS))
        if not tags:
            return
        # In SGLang's own order (weight_updater.py applies cuda_graph, weights, kv_cache whatever
        # the list order); the list names each tag once, as each is removed from offload_tags once.
        await call(session, "POST", base_url, "/resume_memory_occupation", key,
                   json={"tags": [t for t in PARK_TAGS if t in tags]},
                   code="wake_failed", what="SGLang resume_memory_occupation")
        self._record(launch, frozenset())
        if level == 2 and "weights" in tags:
            await self._reload_weights(session, base_url, key, model_path)

    async def _reload_weights(self, session: aiohttp.ClientSession, base_url: str, key: str | None,
                              model_path: str | None) -> None:
        """The deep tier: launched without --enable-weights-cpu-backup, the resumed weights region is
        fresh memory, so the checkpoint is read again: ``POST /update_weights_from_disk
        {"model_path"}`` answers ``{"success", "message", "num_paused_requests"}``, 400 when it failed
        (entrypoints/http_server.py update_weights_from_disk, managers/io_struct.py)."""
        if model_path is None:
            raise EngineError("SGLang deep wake needs the model's path to re-read its weights",
                              code="wake_failed", detail={"path": "/update_weights_from_disk"})
        body = await call(session, "POST", base_url, "/update_weights_from_disk", key,
                          json={"model_path": model_path}, code="wake_failed",
                          what="SGLang update_weights_from_disk")
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"SGLang update_weights_from_disk answered {str(body)[:200]}",
                              code="wake_failed", detail={"path": "/update_weights_from_disk"})

    def released_tags(self, base_url: str, key: str | None) -> frozenset[str] | None:
        """What this adapter released on a launch and has not resumed; None if it never parked it."""
        return self._released.get((base_url, key))

    def _record(self, launch: tuple[str, str | None], tags: frozenset[str]) -> None:
        self._released.pop(launch, None)
        self._released[launch] = tags  # newest last
        while len(self._released) > MAX_RECORDS:
            del self._released[next(iter(self._released))]
