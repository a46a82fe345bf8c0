"""A fake vLLM OpenAI server for machines without a GPU, speaking vLLM's documented protocol.

    python tests/fakes/fake_vllm.py --host 127.0.0.1 --port P --model NAME [--api-key-env VLLM_API_KEY]
        [--enable-sleep-mode] [--token-delay S]
    python tests/fakes/fake_vllm.py serve MODEL --host H --port P ...   (the `vllm serve` shape)

As in vLLM: the key (--api-key, else $VLLM_API_KEY) guards only /v1 routes; the development
routes (/sleep, /wake_up, /is_sleeping, /collective_rpc, /reset_prefix_cache) exist only with
VLLM_SERVER_DEV_MODE=1, and sleeping needs --enable-sleep-mode. The default sleep ABORTS running
requests (counted as "aborted" on GET /fake/stats); ``?mode=wait`` waits for them instead.
Sleep level 2 discards the weights: after /wake_up, generation fails until
/collective_rpc {"method": "reload_weights"} reloads them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_openai import FakeEngine, common_arguments, serve  # noqa: E402

TAGS = ("weights", "kv_cache")


class FakeVllm(FakeEngine):
    label = "fake-vllm"
    owned_by = "vllm"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.sleep_mode: bool = args.enable_sleep_mode
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
        self.asleep: set[str] = set()  # which of TAGS are released
        self.weights_discarded = False
        self.stats.update({"sleep_calls": 0, "wake_calls": 0, "collective_rpc": [], "reset_prefix_cache": 0,
                           "last_sleep_level": None})

    def needs_auth(self, path: str) -> bool:
        return path.startswith("/v1")  # vLLM's --api-key middleware guards /v1 only

    def unavailable_reason(self) -> str | None:
        if self.asleep:
            return f"The engine is sleeping ({', '.join(sorted(self.asleep))} released)."
        if self.weights_discarded:
            return "The weights were discarded by sleep level 2 and not reloaded (collective_rpc reload_weights)."
        return None

    def stats_snapshot(self) -> dict[str, Any]:
        return {**super().stats_snapshot(), "sleeping": bool(self.asleep), "asleep_tags": sorted(self.asleep),
                "weights_discarded": self.weights_discarded}

    def extra_routes(self, app: web.Application) -> None:
        if not self.dev_mode:
            return
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        app.router.add_post("/collective_rpc", self.collective_rpc)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)

    async def sleep(self, request: web.Request) -> web.Response:
        if not self.sleep_mode:
            return self.error("Sleep mode is not enabled: launch with --enable-sleep-mode.", "InternalServerError", 500)
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            return self.error("level must be an integer", "BadRequestError", 400)
        if level not in (1, 2):
            return self.error(f"level must be 1 or 2, got {level}", "BadRequestError", 400)
        mode = request.query.get("mode", "abort")
        if mode == "wait":
            while self.running:
                await asyncio.sleep(0.01)
        elif mode == "abort":
            self.abort_all()
            while self.running:  # let the aborted handlers finish their answers
                await asyncio.sleep(0.01)
        else:
            return self.error(f"mode must be abort or wait, got {mode!r}", "BadRequestError", 400)
        self.stats["sleep_calls"] += 1
        self.stats["last_sleep_level"] = level
        self.asleep = set(TAGS)
        if level == 2:
            self.weights_discarded = True
        return web.Response(status=200)

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", None) or list(TAGS)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            return self.error(f"unknown tags {unknown}", "BadRequestError", 400)
        self.stats["wake_calls"] += 1
        self.asleep.difference_update(tags)
        return web.Response(status=200)

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": bool(self.asleep)})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return self.error("the body is not JSON", "BadRequestError", 400)
        method = body.get("method") if isinstance(body, dict) else None
        if not isinstance(method, str):
            return self.error("collective_rpc needs a method", "BadRequestError", 400)
        self.stats["collective_rpc"].append(method)
        if method == "reload_weights":
            if "weights" in self.asleep:
                return self.error("cannot reload weights: their memory is released; wake_up?tags=weights first",
                                  "InternalServerError", 500)
            self.weights_discarded = False
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.stats["reset_prefix_cache"] += 1
        return web.Response(status=200)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # `vllm serve MODEL ...`
        argv = ["--model", argv[1], *argv[2:]] if len(argv) > 1 else argv[1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    common_arguments(parser, default_key_env="VLLM_API_KEY")
    args, _unknown = parser.parse_known_args(argv)  # real engine flags the fake does not model
    serve(FakeVllm(args), args.host, args.port, args.startup_delay)


if __name__ == "__main__":
    main()
