"""TensorFold (github.com/ashhart/TensorFold): ``tensorfold serve MODEL``; parks in place through its
level-2 sleep prototype where that exists (one CUDA GPU, a model family with a sleep adapter), else
stops. It answers ``/v1/decisions``, onto which the proxy maps CapyCTL's ``/v1/systemone``.

Facts followed, by file of that repository:
- src/tensorfold/cli_args.py: ``serve`` takes the model as a POSITIONAL argument (a directory or a
  Hugging Face id; there is no ``--model``), ``--host``, ``--port``, ``--name`` (the model id clients
  ask for), ``--tp`` only 1 or 2 and "one GPU per machine", and ``--no-update-check`` (also
  ``TENSORFOLD_NO_UPDATE_CHECK=1``). The server binds ``(host, port)`` over TCP (src/tensorfold/cli.py:
  ``Server((args.host, int(args.port)), ...)`` / ``serve(app, args.host, int(args.port))``); there is no
  unix-socket option.
- docs/api.md "API keys": keys come from ``--api-key`` (argv: never), comma-separated
  ``TENSORFOLD_API_KEY``, or ``--api-key-file PATH`` (one key a line; startup refuses a file other
  users may read, which a 0400 systemd credential is not); ``Authorization: Bearer``; ``/health``
  stays open.
- docs/model-sleep.md and src/tensorfold/server/lifecycle_http.py: ``--enable-sleep-mode``; the sleep
  token comes from the environment variable ``TENSORFOLD_SLEEP_TOKEN`` (renamed with
  ``--sleep-token-env``), sent as ``Authorization: Bearer``, and is separate from the API keys
  (the lifecycle routes take only the sleep token). ``POST /sleep?level=2`` (level 2 only: anything
  else is 400 ``unsupported_sleep_level``), ``POST /wake_up``, ``GET /is_sleeping``; 404 when sleep is
  off. Sleep drains accepted requests itself (``--sleep-timeout``, 409 ``sleep_drain_timeout``);
  a failed wake is 503 and stays asleep. Supported: single-device CUDA, families ``qwen3_5`` and
  ``nemotron_h``; Metal (MLX), level 1 and tensor parallelism are not implemented
  (src/tensorfold/cuda/sleep.py is torch.cuda only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import aiohttp

from ..errors import CapyError, EngineError
from ..spec import DeploymentSpec
from ._base import (EngineAdapter, LaunchContext, LaunchPlan, ParkMethod, call, cuda_environment, has_flag,
                    in_place_allowed, require_path, unsupported_task, user_environment)

KEY_ENV_NAME = "TENSORFOLD_API_KEY"  # docs/api.md "API keys"
SLEEP_TOKEN_ENV_NAME = "TENSORFOLD_SLEEP_TOKEN"  # docs/model-sleep.md: the default of --sleep-token-env
SLEEP_FLAG = "--enable-sleep-mode"
# The only level the prototype has (lifecycle_http.py refuses any other with 400): weights and
# device caches are released and reloaded from the checkpoint on wake.
SLEEP_LEVEL = 2
# docs/model-sleep.md: "The reference adapters support single-device CUDA dense Qwen (`qwen3_5`) ...
# and Nemotron-H (`nemotron_h`)"; the plan (docs/plans/model-sleep-level2.md) refuses other opt-ins.
SLEEP_FAMILIES = frozenset({"qwen3_5", "nemotron_h"})


def model_type(model_path: str) -> str | None:
    """The ``model_type`` of a checkpoint directory's config.json (TensorFold's family key), or None."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    kind = config.get("model_type")
    if not isinstance(kind, str):
        text = config.get("text_config")
        kind = text.get("model_type") if isinstance(text, dict) else None
    return kind if isinstance(kind, str) else None


class TensorFoldAdapter(EngineAdapter):
    kind = "tensorfold"
    # docs/api.md "Route" table: /v1/chat/completions (with tools), /v1/completions, /v1/messages and
    # /v1/messages/count_tokens, /tokenize and /v1/tokenize, /detokenize and /v1/detokenize, POST
    # /v1/responses, GET and DELETE /v1/responses/{id}, /v1/decisions. No embeddings, rerank, score,
    # audio or /v1/responses/input_tokens. Token log-probabilities exist only for Flash Next on one
    # GPU (docs/api.md), so not "logprobs".
    base_capabilities: ClassVar[frozenset[str]] = frozenset({
        "chat", "completions", "tools", "decisions", "messages", "tokenize", "tokenize_v1", "responses",
        "responses_get", "responses_delete"})
    unix_socket: ClassVar[bool] = False  # TCP only (src/tensorfold/cli.py binds (host, port))

    def check_task(self, deployment: DeploymentSpec) -> None:
        if deployment.task != "generate":
            raise unsupported_task(deployment, "TensorFold", "it serves text generation only (docs/api.md lists no "
                                   "embeddings or rerank route); use task: generate, or llama.cpp, vLLM or SGLang")

    def parked_host_bytes(self, deployment: DeploymentSpec, model_bytes: int) -> int:
        # TensorFold has level 2 only: weights and KV released, re-read on wake (docs/model-sleep.md).
        return 0

    def park_tier_refusal(self, deployment: DeploymentSpec, tier: str) -> str | None:
        if tier == "host_backed":
            return "TensorFold's sleep prototype has level 2 only (docs/model-sleep.md): use park_tier: deep"
        if deployment.gpus_needed != 1 or deployment.nodes != 1:
            return "TensorFold sleeps only on one CUDA GPU on one machine (docs/model-sleep.md)"
        return None

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        if not in_place_allowed(target):
            return "stop"
        if isinstance(target, LaunchContext):
            return "in_place" if self._sleep_enabled(target) else "stop"
        # Without a launch context only the deployment's shape is known: one GPU on one machine.
        # A model family without a sleep adapter is then found at park time (/sleep answers 404,
        # see park), and the controller stops the unit instead.
        return "in_place" if target.gpus_needed == 1 and target.nodes == 1 else "stop"

    @staticmethod
    def _sleep_platform(ctx: LaunchContext) -> bool:
        # Single-device CUDA only: no sleep on a CPU launch, across GPUs or across machines.
        return len(ctx.gpu_indices) == 1 and ctx.nnodes == 1

    def _sleep_enabled(self, ctx: LaunchContext) -> bool:
        if not self._sleep_platform(ctx):
            return False
        if has_flag(ctx.deployment.engine_args, SLEEP_FLAG):
            return True  # the user vouches for the family
        return model_type(ctx.model_path) in SLEEP_FAMILIES

    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        self.check_task(ctx.deployment)
        venv = require_path(ctx)
        dep = ctx.deployment
        if dep.tensor_parallel > 1 or ctx.nnodes > 1:
            # cli_args.py: --tp is 1 or 2, "GPUs (one per machine)", with --rank/--master per machine:
            # TensorFold does not split a model over the GPUs of one host.
            raise CapyError(
                f"deployment {dep.name!r}: TensorFold serves a model on one GPU per machine and CapyCTL does "
                "not launch its two-machine mode (--tp 2 --rank --master); use tensor_parallel: 1 and nodes: 1",
                code="tensor_parallel_unsupported", status=400)
        argv = [f"{venv}/bin/tensorfold", "serve", ctx.model_path, "--host", ctx.host, "--port", str(ctx.port),
                "--name", dep.name]
        environment = {**user_environment(ctx), **cuda_environment(ctx),
                       # A unit must not ask GitHub for releases at every start (cli_args.py).
                       "TENSORFOLD_NO_UPDATE_CHECK": "1"}
        secret_environment: dict[str, str] = {}
        if ctx.key_file is not None:
            argv += ["--api-key-file", ctx.key_file]  # docs/api.md "API keys": the unit's credential
        else:
            secret_environment[KEY_ENV_NAME] = ctx.key_env
        if self.park_method(ctx) == "in_place":
            if not has_flag(dep.engine_args, SLEEP_FLAG):
                argv.append(SLEEP_FLAG)
            # The sleep token is the per-launch key too: only CapyCTL holds it, the unit's credential
            # shell exports it from the key credential (never argv), and park/wake send it as the bearer.
            secret_environment[SLEEP_TOKEN_ENV_NAME] = ctx.key_env
        argv += dep.engine_args
        return LaunchPlan(argv=argv, environment=environment, secret_environment=secret_environment,
                          health_path=self.health_path, served_model=dep.name, key_env=ctx.key_env)

    async def park(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
        """``POST /sleep?level=2``. TensorFold drains accepted requests itself; CapyCTL drained first anyway.

        ``level`` is ignored: the prototype has level 2 only (weights reloaded from disk on wake).
        """
        try:
            body = await call(session, "POST", base_url, "/sleep", key, params={"level": str(SLEEP_LEVEL)},
                              code="park_failed", what="TensorFold sleep level 2")
        except EngineError as exc:
            if exc.detail.get("status") == 404:
                # lifecycle_http.py: the routes exist only with --enable-sleep-mode.
                raise EngineError("TensorFold runs without --enable-sleep-mode (its model family has no sleep "
                                  "adapter, or no single CUDA GPU): it cannot park in place",
                                  code="park_unsupported", detail=exc.detail) from None
            raise
        if not (isinstance(body, dict) and body.get("is_sleeping") is True):
            raise EngineError(f"TensorFold /sleep answered {str(body)[:200]!r}, not a sleeping state",
                              code="engine_protocol_error")

    async def wake(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int,
                   model_path: str | None = None) -> None:
        """``POST /wake_up``: returns once the runtime is reloaded (503 and still asleep if that failed)."""
        body = await call(session, "POST", base_url, "/wake_up", key, code="wake_failed", what="TensorFold wake_up")
        if not (isinstance(body, dict) and body.get("ready") is True):
            raise EngineError(f"TensorFold /wake_up answered {str(body)[:200]!r}, not a ready state",
                              code="engine_protocol_error")

    async def is_parked(self, session: aiohttp.ClientSession, base_url: str, key: str | None) -> bool | None:
        try:
            body = await call(session, "GET", base_url, "/is_sleeping", key, code="engine_error",
                              what="TensorFold is_sleeping")
        except EngineError as exc:
            if exc.detail.get("status") == 404:
                return False  # sleep is off: the engine never sleeps
            raise
        if isinstance(body, dict) and isinstance(body.get("is_sleeping"), bool):
            return body["is_sleeping"]
        raise EngineError(f"TensorFold /is_sleeping answered {str(body)[:200]!r}, not {{\"is_sleeping\": bool}}",
                          code="engine_protocol_error")
