"""A fake SGLang server for machines without a GPU, speaking SGLang's documented protocol.

    python tests/fakes/fake_sglang.py --host 127.0.0.1 --port P --model NAME [--api-key KEY |
        --api-key-env NAME] [--enable-memory-saver] [--token-delay S]
    (also `--model-path M`, as `python -m sglang.launch_server` takes it)

As in SGLang: the key guards every route but /health and /metrics; POST /release_memory_occupation
and /resume_memory_occupation take {"tags": ["weights", "kv_cache"]} and assert that no request is
running: with one in flight they answer 500 with the assertion message (counted as
"release_refused" on GET /fake/stats). While memory is released, generation answers 503.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_openai import FakeEngine, common_arguments, serve  # noqa: E402

TAGS = ("weights", "kv_cache")


class FakeSglang(FakeEngine):
    label = "fake-sglang"
    owned_by = "sglang"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.memory_saver: bool = args.enable_memory_saver
        self.released: set[str] = set()
        self.stats.update({"release_calls": 0, "resume_calls": 0, "release_refused": 0})

    def needs_auth(self, path: str) -> bool:
        return not (path.startswith("/health") or path.startswith("/metrics") or path.startswith("/fake/"))

    def unavailable_reason(self) -> str | None:
        if self.released:
            return f"Memory occupation is released ({', '.join(sorted(self.released))})."
        return None

    def stats_snapshot(self) -> dict[str, Any]:
        return {**super().stats_snapshot(), "released_tags": sorted(self.released)}

    def extra_routes(self, app: web.Application) -> None:
        app.router.add_post("/release_memory_occupation", self.release)
        app.router.add_post("/resume_memory_occupation", self.resume)

    async def _tags(self, request: web.Request) -> list[str] | web.Response:
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError:
            return self.error("the body is not JSON", "BadRequestError", 400)
        tags = (body or {}).get("tags") or list(TAGS)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            return self.error(f"unknown tags {unknown}", "BadRequestError", 400)
        return list(tags)

    def _assert_idle(self, what: str) -> web.Response | None:
        if self.running:
            self.stats["release_refused"] += 1
            return web.Response(status=500, text=(
                f"AssertionError: {what} should be called only when no ongoing request "
                f"({len(self.running)} running)"))
        return None

    async def release(self, request: web.Request) -> web.Response:
        if not self.memory_saver:
            return self.error("release_memory_occupation needs --enable-memory-saver", "InternalServerError", 500)
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        refused = self._assert_idle("release_memory_occupation")
        if refused:
            return refused
        self.stats["release_calls"] += 1
        self.released.update(tags)
        return web.json_response({"success": True, "message": "Succeeded to release memory occupation."})

    async def resume(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        refused = self._assert_idle("resume_memory_occupation")
        if refused:
            return refused
        self.stats["resume_calls"] += 1
        self.released.difference_update(tags)
        return web.json_response({"success": True, "message": "Succeeded to resume memory occupation."})


class FakeSglangHead(FakeSglang):
    """Rank 0 of a multi-node group (``--nnodes N --node-rank 0 --dist-init-addr HEAD:PORT``):
    the HTTP API plus the rendezvous port workers join (fake_multinode's protocol); /health is
    503 until every rank has joined, as SGLang's head only serves once the group is complete."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        from fake_multinode import Head
        self.group = Head(args)

    async def health(self, request: web.Request) -> web.Response:
        joined = len(self.group.joined)
        return web.Response(status=200 if joined == self.group.args.nnodes else 503,
                            text=f"{joined}/{self.group.args.nnodes} ranks joined")

    def app(self) -> web.Application:
        app = super().app()

        async def rendezvous(app: web.Application):
            from fake_multinode import split_addr
            host, port = split_addr(self.group.args.dist_init_addr)
            server = await asyncio.start_server(self.group.on_worker, host, port)
            yield
            server.close()

        app.cleanup_ctx.append(rendezvous)
        return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--model-path", dest="model", required=True)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp", type=int, default=1)
    # SGLang's multi-node launch: the same --nnodes and --dist-init-addr on every node.
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-init-addr", default=None)
    parser.add_argument("--join-timeout", type=float, default=10.0)
    common_arguments(parser, default_key_env=None)
    args, _unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.nnodes > 1:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        if args.node_rank > 0:  # a worker serves no HTTP: it joins the head and lives with it
            from fake_multinode import run_worker
            sys.exit(asyncio.run(run_worker(args)))
        serve(FakeSglangHead(args), args.host, args.port, args.startup_delay)
        return
    serve(FakeSglang(args), args.host, args.port, args.startup_delay)


if __name__ == "__main__":
    main()
