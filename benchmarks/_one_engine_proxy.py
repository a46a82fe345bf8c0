"""The CapyCTL proxy in a process of its own, in front of one engine (proxy_overhead's
OneEngineRouter), so that a benchmark's client does not share the proxy's event loop — as
nginx does not. Prints "ready PORT" on stdout once it listens; stops on SIGTERM.

``--engine-client aiohttp`` makes the same proxy reach its engine through aiohttp's ClientSession
rather than its own engine client (capyctl/proxy/_engine_side.py), as it does where that client is
unavailable: issue 45 keeps the hand-made client only if it pays, and proxy_hop.py measures both
in one run. No product switch: the app's engine pool is emptied after its own startup ran.

Run: .venv/bin/python benchmarks/_one_engine_proxy.py --upstream URL --launch-key K (--client-key C | --store DB) --port P
     [--engine-client own|aiohttp]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import AsyncIterator

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_overhead import OneEngineRouter  # noqa: E402

from capyctl import eventloop  # noqa: E402
from capyctl.daemon import StoreKeys  # noqa: E402
from capyctl.proxy import DoorSettings, KeyGrant, StaticKeys, Upstream, build_app, serve  # noqa: E402
# The app key of the proxy's own engine client: the one place the benchmarks name it (its module
# may move as capyctl/proxy is split; the import follows it here).
from capyctl.proxy._app import POOL  # noqa: E402
from capyctl.store import Store  # noqa: E402


def use_aiohttp_engine_client(app: web.Application) -> None:
    """After the proxy's own startup made its engine pool, set the pool to None: every exchange
    then goes through aiohttp's ClientSession (the proxy's path where its engine client is
    unavailable, capyctl/proxy/_app.py's _open_upstream). Appended last to cleanup_ctx, so it runs
    after the proxy's context that made the pool (and that context still closes it)."""
    async def without_pool(app: web.Application) -> AsyncIterator[None]:
        app[POOL] = None
        yield

    app.cleanup_ctx.append(without_pool)


def own_engine_client_missing(app: web.Application) -> None:
    """Fail the start where the proxy has no engine client of its own (no httptools): a
    comparison of the two clients would then compare aiohttp's with itself."""
    async def check(app: web.Application) -> AsyncIterator[None]:
        if app.get(POOL) is None:
            raise SystemExit("_one_engine_proxy: the proxy has no engine client of its own here "
                             "(httptools missing?); --engine-client own cannot be measured")
        yield

    app.cleanup_ctx.append(check)


async def run(args: argparse.Namespace) -> None:
    upstream = Upstream("smol", args.upstream, args.launch_key, "llama.cpp", frozenset({"chat", "completions"}))
    # --store: keys checked against the daemon's SQLite store as the daemon does; else in memory.
    keys = StoreKeys(Store(args.store)) if args.store else StaticKeys({args.client_key: KeyGrant("bench")})
    app = build_app(OneEngineRouter(upstream), keys)
    if args.engine_client == "aiohttp":
        use_aiohttp_engine_client(app)
    else:
        own_engine_client_missing(app)
    runner = await serve(app, host_port=f"127.0.0.1:{args.port}", door=DoorSettings())  # as the daemon serves it
    eventloop.freeze_startup_objects()  # as the daemon does once it serves (capyctl/daemon.py)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"ready {runner.addresses[0][1]}", flush=True)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--launch-key", required=True)
    parser.add_argument("--client-key", help="the one client key (without --store)")
    parser.add_argument("--store", help="a CapyCTL state database whose API keys are checked, as the daemon does")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--engine-client", choices=("own", "aiohttp"), default="own",
                        help="the proxy's own engine client (default), or aiohttp's ClientSession")
    eventloop.run(run(parser.parse_args()))  # the daemon's loop: uvloop where installed
