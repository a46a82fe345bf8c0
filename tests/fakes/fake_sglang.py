"""A fake SGLang server for machines without a GPU, following SGLang 0.5.23's source.

    python tests/fakes/fake_sglang.py --model-path M --host 127.0.0.1 --port P
        [--api-key KEY | --config FILE.yaml] [--enable-memory-saver] [--enable-weights-cpu-backup]
        [--tp-size N] [--mem-fraction-static F] [--nnodes N --node-rank R --dist-init-addr H:P]
        [--token-delay S] [--startup-delay S] [--api-key-env NAME] [--join-timeout S]  (fake only)

What it follows (paths under sglang/srt/ in the 0.5.23 wheel):

- Arguments: the flag names of arg_groups/fields/*.py; unknown arguments exit with status 2
  (argparse, server_args.py prepare_server_args). ``--config FILE`` is merged as
  utils/server_args_config_parser.py does: one file, .yaml/.yml only, its keys become arguments
  placed before the command line's (so the command line wins); /proc/PID/cmdline shows the path.
- Routes (entrypoints/http_server.py): all registered whatever the flags. A generating model answers
  /v1/chat/completions, /v1/completions, /v1/responses (+ GET /v1/responses/{id}), /v1/messages,
  /v1/messages/count_tokens, /v1/score; ``--is-embedding`` (arg_groups/fields/model.py) makes it an
  embedder that answers /v1/embeddings and /v1/rerank (a cross-encoder request), which a generating
  model refuses (managers/tokenizer_manager.py). /tokenize, /v1/tokenize, /detokenize, /v1/detokenize
  answer both. The fake answers these in vLLM's shapes (fake_openai.py).
- Auth (utils/auth.py decide_request_auth): with --api-key every route needs
  ``Authorization: Bearer KEY`` except /health*, /ready*, /metrics*; 401 ``{"error": "Unauthorized"}``.
- ``POST|GET /release_memory_occupation`` and ``/resume_memory_occupation``
  (entrypoints/http_server.py): a JSON body is required (FastAPI Body(): 422 without one);
  ``{"tags": null}`` or ``[]`` means kv_cache, weights and cuda_graph (constants.py
  GPU_MEMORY_ALL_TYPES); success is 200 with a null body.
- ``POST /update_weights_from_disk {"model_path"}`` (entrypoints/http_server.py): 200
  ``{"success": true, "message", "num_paused_requests"}``, 400 with success false when the load
  fails; it restores weights lost to a resume without the CPU backup.
- What kills the whole server (managers/scheduler_components/weight_updater.py; a scheduler
  exception SIGQUITs the main process, whose handler SIGKILLs the process tree, itself included:
  managers/tokenizer_manager.py SignalHandler, utils/common.py kill_process_tree), so this fake
  SIGKILLs itself, mid-request, on:
  * a release while a request runs (``assert self.is_fully_idle()``);
  * a resume of a tag that is not released (``self.offload_tags.remove(tag)``, KeyError);
  * with --enable-memory-saver, a release of a region already paused or a resume of one not
    paused (torch_memory_saver csrc/core.cpp pause/resume: exit(1), seen by the watchdog);
  * with --enable-memory-saver, update_weights_from_disk while the weights are released;
  * with --enable-memory-saver, generation (or /health, which generates one token unless
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false) while weights or kv_cache are released: the
    scheduler has no guard, and the released pages are unmapped (the kernel faults).
- Without --enable-memory-saver the release pauses nothing (utils/torch_memory_saver_adapter.py,
  the no-op adapter) but still records the tags. With it but without
  --enable-weights-cpu-backup, releasing ``weights`` discards them (no host copy): after the
  resume the model answers garbage.
- Multi-node (entrypoints/engine.py _launch_subprocesses): rank 0 opens the dist-init port at once
  and serves this HTTP API only once every rank has joined (its schedulers are ready only then);
  each other rank serves just utils/common.py launch_dummy_health_check_server's /ping, /health
  and /health_generate (200) on its own --host/--port, also once the group has formed.
  fake_multinode.py's rendezvous stands in for torch.distributed (FakeSglangHead, run_sglang_worker).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_openai import FakeEngine, common_arguments, serve  # noqa: E402

# sglang/srt/constants.py GPU_MEMORY_ALL_TYPES
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
GARBAGE = "\ufffd"


def env_bool(name: str, default: bool) -> bool:
    """sglang/srt/environ.py EnvBool.parse."""
    value = os.environ.get(name)
    if value is None:
        return default
    value = value.lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    raise ValueError(f'"{value}" is not a valid boolean value')



async def _json_body(request: web.Request) -> Any:
    """A required JSON body, or FastAPI's 422 for a missing or broken one (the routes take a Body())."""
    raw = await request.read()
    if not raw:
        return web.json_response({"detail": [{"type": "missing", "loc": ["body"], "msg": "Field required",
                                              "input": None}]}, status=422)
    try:
        return json.loads(raw)
    except ValueError as exc:
        return web.json_response({"detail": [{"type": "json_invalid", "loc": ["body", 0],
                                              "msg": "JSON decode error", "ctx": {"error": str(exc)}}]},
                                 status=422)

class FakeSglang(FakeEngine):
    label = "fake-sglang"
    owned_by = "sglang"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.is_embedding: bool = args.is_embedding
        self.memory_saver: bool = args.enable_memory_saver
        self.weights_cpu_backup: bool = args.enable_weights_cpu_backup
        self.offload_tags: set[str] = set()  # weight_updater.py WeightUpdater.offload_tags
        self.paused: set[str] = set()  # torch_memory_saver regions unmapped (memory saver on)
        self.weights_lost = False
        self.health_generates = env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True)
        self.launch = {"tp_size": args.tp_size, "mem_fraction_static": args.mem_fraction_static,
                       "nnodes": args.nnodes, "node_rank": args.node_rank, "config": args.config}
        self.stats.update({"release_calls": 0, "resume_calls": 0})

    def needs_auth(self, path: str) -> bool:
        return not path.startswith(("/health", "/ready", "/metrics", "/fake/"))

    def stats_snapshot(self) -> dict[str, Any]:
        return {**super().stats_snapshot(), "released_tags": sorted(self.offload_tags),
                "paused_regions": sorted(self.paused), "weights_lost": self.weights_lost,
                "memory_saver": self.memory_saver, "weights_cpu_backup": self.weights_cpu_backup, **self.launch}

    def generation_routes(self, app: web.Application) -> None:
        # entrypoints/http_server.py registers every route whatever the model; --is-embedding decides
        # which answer (tokenizer_manager.is_generation).
        super().generation_routes(app)
        app.router.add_post("/v1/responses", self.generating(self.responses))
        app.router.add_get("/v1/responses/{id}", self.get_response)
        app.router.add_post("/v1/messages", self.generating(self.messages))
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/score", self.score)
        for path in ("/tokenize", "/v1/tokenize"):
            app.router.add_post(path, self.tokenize)
        for path in ("/detokenize", "/v1/detokenize"):
            app.router.add_post(path, self.detokenize)
        app.router.add_post("/v1/embeddings", self.embedding_only(self.embeddings))
        app.router.add_route("POST", "/v1/rerank", self.embedding_only(self.rerank))

    def generating(self, handler):
        async def answer(request: web.Request) -> web.StreamResponse:
            if self.is_embedding:  # Not from the source: the fake's refusal of generation by an embedder
                return self.error("this fake serves an embedding model (--is-embedding)", "BadRequestError", 400)
            return await handler(request)
        return answer

    def embedding_only(self, handler):
        async def answer(request: web.Request) -> web.StreamResponse:
            if not self.is_embedding:  # managers/tokenizer_manager.py, an EmbeddingReqInput while is_generation
                return self.error("This model does not appear to be an embedding model by default. Please add "
                                  "`--is-embedding` when launching the server or try another model.",
                                  "BadRequestError", 400)
            return await handler(request)
        return answer

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.generating(super().chat)(request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generating(super().completions)(request)

    def extra_routes(self, app: web.Application) -> None:
        for method in ("GET", "POST"):
            app.router.add_route(method, "/release_memory_occupation", self.release)
            app.router.add_route(method, "/resume_memory_occupation", self.resume)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/ready", self.ready)

    # -- the crash ---------------------------------------------------------------------------
    def crash(self, error: str) -> NoReturn:
        print(f"fake-sglang: Scheduler hit an exception: {error}", file=sys.stderr, flush=True)
        print("fake-sglang: SIGQUIT received. It usually means one child failed.", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        raise SystemExit(137)  # not reached

    def _memory_gone(self) -> bool:
        return bool(self.paused & {WEIGHTS, KV_CACHE})

    # -- generation and health ------------------------------------------------------------------
    async def _admit(self, request: web.Request) -> tuple[dict, web.Response | None]:
        body, refused = await super()._admit(request)
        if refused is None and self._memory_gone():
            self.crash(f"CUDA error: an illegal memory access was encountered (generation with "
                       f"{', '.join(sorted(self.paused))} released)")
        return body, refused

    def answer_tokens(self, prompt: str, max_tokens: int) -> tuple[list[str], str]:
        pieces, finish = super().answer_tokens(prompt, max_tokens)
        if self.weights_lost:  # uninitialised weights: tokens, but no sense
            return [GARBAGE * 3 for _ in pieces], finish
        return pieces, finish

    async def health(self, request: web.Request) -> web.Response:
        # http_server.py health_generate: /health answers at once only when generation is switched off.
        if request.path == "/health_generate" or self.health_generates:
            if self._memory_gone():
                self.crash("CUDA error: an illegal memory access was encountered (health check generation "
                           f"with {', '.join(sorted(self.paused))} released)")
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    # -- memory occupation ----------------------------------------------------------------------
    async def _tags(self, request: web.Request) -> list[str] | web.Response:
        """The request's tags, all of them for null or []; 422 as FastAPI answers a bad body."""
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        tags = body.get("tags") if isinstance(body, dict) else body
        if not isinstance(body, dict) or not (tags is None or (isinstance(tags, list)
                                                               and all(isinstance(t, str) for t in tags))):
            return web.json_response({"detail": [{"type": "model_attributes_type", "loc": ["body"],
                                                  "msg": "Input should be a valid dictionary or object",
                                                  "input": body}]}, status=422)
        return list(tags) if tags else list(ALL_TAGS)

    async def release(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        self.stats["release_calls"] += 1
        if self.running:
            self.crash("AssertionError: release_memory_occupation should be called only when server is idle. "
                       f"({len(self.running)} request(s) running)")
        self.offload_tags.update(tags)
        for tag in (KV_CACHE, WEIGHTS, CUDA_GRAPH):  # weight_updater.py's order
            if tag in tags and self.memory_saver:
                if tag in self.paused:
                    self.crash(f"[torch_memory_saver.cpp] Cannot pause allocation that is not active. tag={tag}")
                self.paused.add(tag)
        return web.json_response(None)

    async def resume(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        self.stats["resume_calls"] += 1
        for tag in tags:
            if tag not in self.offload_tags:
                self.crash(f"KeyError: {tag!r} (resume_memory_occupation of a tag that is not released)")
            self.offload_tags.remove(tag)
        for tag in (CUDA_GRAPH, WEIGHTS, KV_CACHE):  # weight_updater.py's order
            if tag in tags and self.memory_saver:
                if tag not in self.paused:
                    self.crash(f"[torch_memory_saver.cpp] Cannot resume allocation that is not paused. tag={tag}")
                self.paused.discard(tag)
                if tag == WEIGHTS and not self.weights_cpu_backup:
                    self.weights_lost = True
        return web.json_response(None)


    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """entrypoints/http_server.py update_weights_from_disk: ``{"model_path", ...}`` (a JSON body is
        required: 422 without one, as for the memory routes); 200 ``{"success": true, "message",
        "num_paused_requests"}``, 400 with success false when the load failed. The load writes the
        checkpoint into the weights' memory (managers/scheduler_components/weight_updater.py,
        model_executor/model_runner_components/weight_updater.py update_weights_from_disk):
        after a resume without the CPU backup that restores them; into a region still paused by the
        memory saver it faults, as generation does."""
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        model_path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(model_path, str):
            return web.json_response({"detail": [{"type": "missing", "loc": ["body", "model_path"],
                                                  "msg": "Field required", "input": body}]}, status=422)
        self.stats["update_weights_calls"] = self.stats.get("update_weights_calls", 0) + 1
        if WEIGHTS in self.paused:
            self.crash("CUDA error: an illegal memory access was encountered (update_weights_from_disk "
                       "into released weights)")
        if not Path(model_path).is_dir():  # the fake's stand-in for a checkpoint the loader cannot read
            # model_executor/model_runner_components/weight_updater.py: "Failed to get weights iterator: {e}."
            return web.json_response({"success": False, "num_paused_requests": 0,
                                      "message": f"Failed to get weights iterator: no checkpoint at {model_path}."},
                                     status=400)
        self.weights_lost = False
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})


class FakeSglangHead(FakeSglang):
    """Rank 0 of a multi-node group (``--nnodes N --node-rank 0 --dist-init-addr HEAD:PORT``).

    entrypoints/engine.py _launch_subprocesses: the head waits for every local scheduler's "ready"
    before it starts the tokenizer and the HTTP server (http_server.py launch_server), and a
    scheduler is ready only once torch.distributed's group of all ``nnodes`` ranks has formed and the
    model is loaded. So the rendezvous port opens at once, and the HTTP port only once every rank has
    joined (fake_multinode.py stands in for the group); before that nothing listens on it.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        from fake_multinode import Rendezvous
        self.group = Rendezvous(args.nnodes, args.dist_init_addr)

    async def health(self, request: web.Request) -> web.Response:
        if len(self.group.joined) != self.group.nnodes:
            # Not from the source: a rank lost after the group formed. Real SGLang's next collective
            # hangs or fails (torch.distributed/NCCL decide which); the fake's generation check fails.
            return web.Response(status=503)
        return await super().health(request)

    async def serve_when_formed(self) -> web.Application:
        await self.group.open()
        await self.group.complete.wait()
        app = self.app()

        async def close_rendezvous(app: web.Application) -> None:
            self.group.close()

        app.on_cleanup.append(close_rendezvous)
        return app


async def run_sglang_worker(args: argparse.Namespace) -> int:
    """A rank other than 0: entrypoints/engine.py _launch_subprocesses (node_rank >= 1) starts no
    tokenizer nor API server; once its schedulers are ready (the group formed) it serves
    utils/common.py launch_dummy_health_check_server on --host/--port: GET /ping, /health and
    /health_generate answer 200 with an empty body, whatever the ranks do; it lives as long as its
    schedulers, which here means as long as the head (fake_multinode.py).

    Not modelled: SGLang 0.5.23's worker answers SIGTERM with a warning only ("waiting for the rank-0
    ShutdownReq broadcast to stop the schedulers", engine.py sigterm_handler) and stops when rank 0
    shuts down or it is killed; this fake worker exits on SIGTERM at once."""
    from fake_multinode import run_worker

    runner: web.AppRunner | None = None

    async def dummy_health_server() -> None:
        nonlocal runner

        async def ok(request: web.Request) -> web.Response:
            return web.Response(status=200)

        app = web.Application()
        for path in ("/ping", "/health", "/health_generate"):
            app.router.add_get(path, ok)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()

    try:
        return await run_worker(args, "fake-sglang", dummy_health_server)
    finally:
        if runner is not None:
            await runner.cleanup()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fake-sglang", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # arg_groups/fields/model.py: model_path, aliases ["--model"]
    parser.add_argument("--model-path", "--model", dest="model", required=True)
    parser.add_argument("--is-embedding", action="store_true")
    # arg_groups/fields/exec_.py
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    # arg_groups/fields/parallel.py: tp_size, aliases ["--tensor-parallel-size"] ("--tp" only abbreviates it)
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-init-addr", "--nccl-init-addr", dest="dist_init_addr", default=None)
    # arg_groups/fields/schedule.py
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    # server_args.py: --config FILE (merged before parsing, see merge_config)
    parser.add_argument("--config", type=str, default=None)
    parser.add_argument("--join-timeout", type=float, default=10.0)  # fake only: a worker's wait for its head
    common_arguments(parser, default_key_env=None)
    return parser


def merge_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """utils/server_args_config_parser.py ConfigArgumentMerger.merge_config_with_args."""
    if "--config" not in argv:
        return argv
    import yaml

    indices = [i for i, a in enumerate(argv) if a == "--config"]
    if len(indices) > 1:
        raise ValueError("Multiple config files specified! Only one allowed.")
    index = indices[0]
    if index == len(argv) - 1:
        raise ValueError("No config file specified after --config flag!")
    path = Path(argv[index + 1])
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"Config file must be YAML format, got: {path.suffix}")
    if not path.exists():
        raise ValueError(f"Config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError("Config file must contain a dictionary at root level")
    store_true = {a.dest for a in parser._actions if isinstance(a, argparse._StoreTrueAction)} | {
        o[2:].replace("-", "_") for a in parser._actions if isinstance(a, argparse._StoreTrueAction)
        for o in a.option_strings if o.startswith("--")}
    config_args: list[str] = []
    for key, value in data.items():
        if isinstance(value, bool):
            if key.replace("-", "_") in store_true:
                if value:
                    config_args.append(f"--{key}")
            else:
                config_args += [f"--{key}", str(value).lower()]
        elif isinstance(value, list):
            if value:
                config_args += [f"--{key}", *(str(v) for v in value)]
        elif isinstance(value, dict):
            config_args += [f"--{key}", json.dumps(value)]
        else:
            config_args += [f"--{key}", str(value)]
    return config_args + argv[:index] + argv[index + 2:]


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(merge_config(parser, argv))
    if args.nnodes > 1:
        if args.tp_size % args.nnodes:  # arg_groups/validation_hook.py check_server_args
            raise AssertionError("tp_size must be divisible by number of nodes")
        if args.node_rank > 0:
            sys.exit(asyncio.run(run_sglang_worker(args)))
        if args.startup_delay > 0:
            time.sleep(args.startup_delay)
        # run_app awaits the group before it binds --host/--port; SIGTERM stops it cleanly once serving.
        web.run_app(FakeSglangHead(args).serve_when_formed(), host=args.host, port=args.port, print=None,
                    access_log=None)
        return
    serve(FakeSglang(args), args.host, args.port, args.startup_delay)


if __name__ == "__main__":
    main()
