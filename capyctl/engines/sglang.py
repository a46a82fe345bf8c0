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
  0600 YAML file and /proc/PID/cmdline shows only its path.
- The key guards every route but /health*, /ready*, /metrics* (utils/auth.py
  decide_request_auth); release/resume are ADMIN_OPTIONAL: with only --api-key set they need
  that key.
- No unix socket: the HTTP server is uvicorn/granian on --host/--port only
  (entrypoints/http_server.py _setup_and_run_http_server).
"""

from __future__ import annotations

import logging
import math

import aiohttp

from ..errors import CapyError
from ..spec import DeploymentSpec
from ._base import (SECRET_FILE_KEY, EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, call,
                    cuda_environment, has_flag, in_place_allowed, require_gpus_for_tp, require_path,
                    user_environment)

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


class SglangAdapter(EngineAdapter):
    kind = "sglang"
    unix_socket = False  # uvicorn.Config(host=..., port=...) only: no unix socket in 0.5.23

    def __init__(self) -> None:
        # (base_url, key) -> the tags this adapter released on that launch and has not resumed.
        # The per-launch key tells launches apart even when a port is reused.
        self._released: dict[tuple[str, str | None], frozenset[str]] = {}

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        return "in_place" if in_place_allowed(target) else "stop"

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
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
                            "file, and this launch has no secret directory to write it to",
                            code="secret_dir_missing", status=500)
        if self.park_method(ctx) == "in_place":
            # Both: the memory saver makes the release possible, the CPU backup makes the weights survive it.
            argv += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
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

    async def wake(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
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

    def released_tags(self, base_url: str, key: str | None) -> frozenset[str] | None:
        """What this adapter released on a launch and has not resumed; None if it never parked it."""
        return self._released.get((base_url, key))

    def _record(self, launch: tuple[str, str | None], tags: frozenset[str]) -> None:
        self._released.pop(launch, None)
        self._released[launch] = tags  # newest last
        while len(self._released) > MAX_RECORDS:
            del self._released[next(iter(self._released))]
