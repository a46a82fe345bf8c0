"""aiohttp's web server, configured as CapyCTL serves its proxy, relaying each request through
CapyCTL's engine client with none of CapyCTL's own work: no door, no key, no body budget, no
model read, no admission, no metrics, no error shapes. proxy_vs_nginx.py measures it beside
CapyCTL's proxy, so that every run shows how much of the added latency is aiohttp's server itself
(the one HTTP server that faces clients since issue 45) and how much is CapyCTL's per request.

It takes only what the benchmarks send: POST /v1/chat/completions with a JSON body, answered
whole with the engine's status and body (it relays no stream: latency turns only).

Run: .venv/bin/python benchmarks/_aiohttp_relay.py --upstream URL --launch-key K --port P
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capyctl import eventloop  # noqa: E402
from capyctl.proxy import serve  # noqa: E402
# The proxy's own engine client (the module is private to capyctl/proxy; the benchmarks name it
# here, as _one_engine_proxy.py names the app key of its pool).
from capyctl.proxy._engine_pool import EnginePool  # noqa: E402


async def run(args: argparse.Namespace) -> None:
    pool = EnginePool(connect_timeout=10)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {args.launch_key}"}

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        answer = await pool.request("POST", args.upstream, "/v1/chat/completions", body, headers)
        try:
            data = await answer.read()
        finally:
            answer.close()
        return web.Response(status=answer.status, body=data,
                            headers={"Content-Type": answer.header("Content-Type", "application/json")})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = await serve(app, host_port=f"127.0.0.1:{args.port}")  # the proxy's server settings, no door
    eventloop.freeze_startup_objects()
    print(f"ready {runner.addresses[0][1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        pool.close()
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--launch-key", required=True)
    parser.add_argument("--port", type=int, default=0)
    eventloop.run(run(parser.parse_args()))  # the daemon's loop: uvloop where installed
