"""The CapyCTL proxy in a process of its own, in front of one engine (proxy_overhead's
OneEngineRouter), so that a benchmark's client does not share the proxy's event loop — as
nginx does not. Prints "ready PORT" on stdout once it listens; stops on SIGTERM.

Run: .venv/bin/python benchmarks/_one_engine_proxy.py --upstream URL --launch-key K (--client-key C | --store DB) --port P
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_overhead import OneEngineRouter  # noqa: E402

from capyctl import eventloop  # noqa: E402
from capyctl.daemon import StoreKeys  # noqa: E402
from capyctl.proxy import KeyGrant, StaticKeys, Upstream, build_app, serve  # noqa: E402
from capyctl.store import Store  # noqa: E402


async def run(args: argparse.Namespace) -> None:
    upstream = Upstream("smol", args.upstream, args.launch_key, "llama.cpp", frozenset({"chat", "completions"}))
    # --store: keys checked against the daemon's SQLite store as the daemon does; else in memory.
    keys = StoreKeys(Store(args.store)) if args.store else StaticKeys({args.client_key: KeyGrant("bench")})
    runner = await serve(build_app(OneEngineRouter(upstream), keys), host_port=f"127.0.0.1:{args.port}")
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
    eventloop.run(run(parser.parse_args()))  # the daemon's loop: uvloop where installed
