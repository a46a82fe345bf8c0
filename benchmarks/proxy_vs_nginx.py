"""The CapyCTL proxy against nginx as a plain reverse proxy, in front of the same llama-server.

Three paths to one llama-server (SmolLM2 135M), measured in the same run and alternated
request by request, in an order shuffled each turn (proxy_overhead.shuffled), so that drift in the
machine's load and what one path leaves behind hit all alike:

- direct: the client talks to llama-server;
- nginx: Debian's nginx 1.22, one worker, ``proxy_buffering off``, HTTP/1.1 keepalive to the
  engine, and the engine's key set on the way (as CapyCTL swaps the client's key for it);
- capyctl: the CapyCTL proxy in a process of its own (benchmarks/_one_engine_proxy.py), with
  a key check, admission through a one-engine router and pass-through streaming.

- floor, on the latency turns only: ``_minimal_relay.py``, a relay on the same event loop and
  parser with none of CapyCTL's work (no key, no model read, no admission, no metrics; it relays
  no stream), so that a run shows how much of CapyCTL's added latency is its own;
- aiohttp-server, on the latency turns only: ``_aiohttp_relay.py``, aiohttp's web server as CapyCTL
  configures it, relaying through CapyCTL's engine client with none of CapyCTL's work, so that a
  run shows how much of the added latency is the one HTTP server that faces clients;

- litellm (``--litellm PATH``, the ``litellm`` command of a venv with ``litellm[proxy]``):
  LiteLLM's proxy, one worker, with the same llama-server as an OpenAI-compatible backend,
  measured in a pass of its own after the three above (what it does after answering would
  otherwise land on their turns).

Prints latency of small requests (median, p95), time to first chunk and chunks/s of streams
one at a time, aggregate chunks/s of 1, 8 and 64 concurrent streams (``--concurrency``; the
engine gets one slot per stream), and the ratios capyctl/nginx and capyctl/direct;
``--json FILE`` writes every sample. nginx: ``--nginx PATH``, else $CAPYCTL_NGINX, else nginx on PATH
(scripts/bench unpacks Debian's package into /var/cache/capyctl-build/nginx).
Run: .venv/bin/python benchmarks/proxy_vs_nginx.py [--requests 60] [--streams 8] [--tokens 64]
     [--concurrency 1,8,64] [--rounds 3] [--litellm PATH] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_overhead import (CLIENT_KEY, find_model, free_port, load_arguments, one_request,  # noqa: E402
                            one_stream, p95, shuffled)

# nginx with one worker, its files in a folder of its own; {server}: the http block's servers.
NGINX_MAIN = """\
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
{server}
}}
"""
# nginx as CapyCTL's pool behaves towards llama-server, or a run ends on nginx's 502:
# - keepalive_timeout 4s: llama-server closes a connection idle for 5 s (Keep-Alive: timeout=5);
#   CapyCTL keeps 4 s for the same reason (capyctl/proxy/connector.py ENGINE_KEEPALIVE_S);
# - proxy_next_upstream error non_idempotent: a POST sent on a kept-alive connection the engine
#   closed meanwhile is sent again on a new one, as CapyCTL's pool does (_upstream.py). nginx's
#   docs (ngx_http_proxy_module, proxy_next_upstream): "requests with a non-idempotent method
#   (POST, LOCK, PATCH) are not passed to the next server if a request has been sent to an upstream
#   server (1.9.13); enabling this option explicitly allows retrying such requests". A run with 64
#   concurrent streams ended on nginx's 502 without it and completed with it (one upstream server).
PROXY_SERVER = """\
    upstream llama {{ server 127.0.0.1:{engine_port}; keepalive 32; keepalive_timeout 4s; }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 8m;
        location / {{
            proxy_pass http://llama;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Authorization "Bearer {launch_key}";
            proxy_buffering off;
            proxy_read_timeout 600s;
            proxy_next_upstream error non_idempotent;
        }}
    }}"""


def start_nginx(nginx: str, folder: Path, server: str, **popen: object) -> subprocess.Popen:
    """nginx serving ``server`` (NGINX_MAIN's servers), with its configuration and files in ``folder``."""
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    (folder / "nginx.conf").write_text(NGINX_MAIN.format(prefix=folder, server=server))
    return subprocess.Popen([nginx, "-p", str(folder), "-c", str(folder / "nginx.conf"),
                             "-e", str(folder / "error.log")], **popen)  # type: ignore[arg-type]


def find_nginx(explicit: str | None) -> str:
    for candidate in (explicit, os.environ.get("CAPYCTL_NGINX"), shutil.which("nginx"),
                      "/var/cache/capyctl-build/nginx/root/usr/sbin/nginx", "/usr/sbin/nginx"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    sys.exit("nginx is not installed: scripts/bench unpacks Debian's nginx package, or give --nginx PATH")


async def wait_healthy(http: aiohttp.ClientSession, url: str, what: str, path: str = "/health") -> None:
    for _ in range(600):
        try:
            async with http.get(url + path) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    sys.exit(f"{what} did not become healthy")


LITELLM_CONFIG = """\
model_list:
  - model_name: smol
    litellm_params:
      model: openai/smol
      api_base: http://127.0.0.1:{engine_port}/v1
      api_key: {launch_key}
litellm_settings:
  drop_params: true
general_settings:
  master_key: {client_key}
"""


def start_litellm(binary: str, prefix: Path, engine_port: int, launch_key: str, port: int) -> subprocess.Popen:
    """LiteLLM's proxy, one worker, for the same llama-server as an OpenAI-compatible backend."""
    (prefix / "litellm.yaml").write_text(LITELLM_CONFIG.format(engine_port=engine_port, launch_key=launch_key,
                                                               client_key=CLIENT_KEY))
    # No network: the model cost map from the package, no telemetry; errors only in its log.
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
           "LITELLM_TELEMETRY": "False", "DISABLE_ADMIN_UI": "True", "NO_DOCS": "True"}
    return subprocess.Popen([binary, "--config", str(prefix / "litellm.yaml"), "--host", "127.0.0.1",
                             "--port", str(port), "--num_workers", "1"], env=env, cwd=prefix,
                            stdout=open(prefix / "litellm.log", "wb"), stderr=subprocess.STDOUT)


async def concurrent_streams(http: aiohttp.ClientSession, url: str, key: str, streams: int,
                             tokens: int) -> dict[str, float]:
    """``streams`` streams at once: aggregate chunks/s from the first request sent to the last chunk."""
    started = time.perf_counter()
    results = await asyncio.gather(*(one_stream(http, url, key, tokens) for _ in range(streams)))
    wall = time.perf_counter() - started
    chunks = sum(c for _, _, c in results)
    return {"chunks_per_s": chunks / wall, "wall_s": wall, "chunks": chunks,
            "ttfc_median_s": statistics.median(t for t, _, _ in results)}


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


async def main() -> None:
    parser = load_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--nginx")
    parser.add_argument("--concurrency", type=int_list, default=[1, 8, 64],
                        help="concurrent stream counts (default 1,8,64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each concurrent stream count per path")
    parser.add_argument("--litellm", help="LiteLLM's `litellm` command (its proxy), measured as a fourth path")
    parser.add_argument("--json", type=Path, help="write every sample and figure as JSON here")
    args = parser.parse_args()
    nginx = find_nginx(args.nginx)
    slots = max(args.concurrency + [4])

    engine_port, launch_key = free_port(), secrets.token_hex(16)
    prefix = Path(tempfile.mkdtemp(prefix="capyctl-bench-nginx-"))
    nginx_port, proxy_port, litellm_port, floor_port = free_port(), free_port(), free_port(), free_port()
    aiohttp_port = free_port()
    processes: list[subprocess.Popen] = []
    litellm_status: dict[str, object] = {"measured": False, "error": "not asked for (--litellm)"}
    try:
        # One slot per concurrent stream (--parallel) and one KV pool shared by them (--kv-unified),
        # so 64 streams decode together on every path rather than queueing for llama-server's
        # default 4 slots; the same engine serves every path. The pool holds every stream's prompt
        # (with the chat template's system prompt, under 128 tokens) and its tokens at once.
        processes.append(subprocess.Popen(
            [args.llama_server, "-m", find_model(), "--host", "127.0.0.1", "--port", str(engine_port),
             "-c", str(max(2048, (args.tokens + 128) * slots)), "--parallel", str(slots), "--kv-unified", "-t", "2",
             "--api-key", launch_key], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        processes.append(start_nginx(nginx, prefix, PROXY_SERVER.format(engine_port=engine_port, port=nginx_port,
                                                                        launch_key=launch_key),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        processes.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve().parent / "_one_engine_proxy.py"),
             "--upstream", f"http://127.0.0.1:{engine_port}", "--launch-key", launch_key,
             "--client-key", CLIENT_KEY, "--port", str(proxy_port)], stdout=subprocess.DEVNULL))
        # The floor (_minimal_relay.py): a relay on the same event loop and parser with none of
        # CapyCTL's work, on the latency turns only (it relays no stream), so that every run shows
        # how much of CapyCTL's added latency is its own per-request work and how much Python's.
        processes.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve().parent / "_minimal_relay.py"),
             "--upstream-port", str(engine_port), "--launch-key", launch_key, "--port", str(floor_port)],
            stdout=subprocess.DEVNULL))
        processes.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve().parent / "_aiohttp_relay.py"),
             "--upstream", f"http://127.0.0.1:{engine_port}", "--launch-key", launch_key, "--port", str(aiohttp_port)],
            stdout=subprocess.DEVNULL))
        litellm = None
        if args.litellm:
            litellm = start_litellm(args.litellm, prefix, engine_port, launch_key, litellm_port)
            processes.append(litellm)
        paths = {"direct": (f"http://127.0.0.1:{engine_port}", launch_key),
                 "nginx": (f"http://127.0.0.1:{nginx_port}", CLIENT_KEY),
                 "capyctl": (f"http://127.0.0.1:{proxy_port}", CLIENT_KEY)}
        async with aiohttp.ClientSession() as http:
            await wait_healthy(http, paths["direct"][0], "llama-server")
            await wait_healthy(http, paths["nginx"][0], "nginx")
            await wait_healthy(http, paths["capyctl"][0], "the CapyCTL proxy")
            if litellm is not None:
                error = await wait_litellm(http, f"http://127.0.0.1:{litellm_port}", litellm, prefix)
                if error is None:
                    paths["litellm"] = (f"http://127.0.0.1:{litellm_port}", CLIENT_KEY)
                    litellm_status = {"measured": True, "binary": args.litellm}
                else:
                    litellm_status = {"measured": False, "error": error}
                    print(f"LiteLLM: {error}; going on without it", file=sys.stderr)
            latency: dict[str, list[float]] = {name: [] for name in paths}
            ttfc: dict[str, list[float]] = {name: [] for name in paths}
            rate: dict[str, list[float]] = {name: [] for name in paths}
            concurrency: dict[str, dict[str, dict[str, list[float]]]] = {
                str(streams): {name: {"chunks_per_s": [], "wall_s": [], "ttfc_median_s": []} for name in paths}
                for streams in args.concurrency}
            # direct, nginx and CapyCTL take turns; LiteLLM is measured in a pass of its own after them:
            # it keeps working for milliseconds after it answers, and with a few rounds per stream count
            # the shuffled order spread that unevenly over the others (8 streams through CapyCTL read
            # 0.90x to 1.02x of direct with LiteLLM among the turns, 1.00x without).
            passes = [{n: paths[n] for n in ("direct", "nginx", "capyctl")}]
            if "litellm" in paths:
                passes.append({"litellm": paths["litellm"]})
            relays = {"floor": (f"http://127.0.0.1:{floor_port}", CLIENT_KEY),
                      "aiohttp-server": (f"http://127.0.0.1:{aiohttp_port}", CLIENT_KEY)}
            await wait_listening(floor_port)
            await wait_listening(aiohttp_port)
            latency.update({name: [] for name in relays})
            for group in passes:
                requests = {**group, **relays} if "capyctl" in group else group
                for _ in range(3):  # warm every path (connection pools, prompt cache)
                    for url, key in requests.values():
                        await one_request(http, url, key)
                for turn in range(args.requests):
                    for name, (url, key) in shuffled(requests, turn):
                        latency[name].append(await one_request(http, url, key))
                for turn in range(args.streams):
                    for name, (url, key) in shuffled(group, turn):
                        t, r, _ = await one_stream(http, url, key, args.tokens)
                        ttfc[name].append(t)
                        rate[name].append(r)
                for streams in args.concurrency:
                    point = concurrency[str(streams)]
                    for turn in range(args.rounds):  # alternate the paths round by round
                        for name, (url, key) in shuffled(group, turn):
                            figures = await concurrent_streams(http, url, key, streams, args.tokens)
                            for field in point[name]:
                                point[name][field].append(figures[field])
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(prefix, ignore_errors=True)

    def ms(v: float) -> str:
        return f"{v * 1000:.2f} ms"

    names = list(paths) + ["floor", "aiohttp-server"]
    rows = [("latency median (max_tokens 1)", {n: statistics.median(v) for n, v in latency.items()}, ms),
            ("latency p95", {n: p95(v) for n, v in latency.items()}, ms),
            ("time to first chunk median", {n: statistics.median(v) for n, v in ttfc.items()}, ms),
            ("stream chunks/s median", {n: statistics.median(v) for n, v in rate.items()}, lambda v: f"{v:.1f}")]
    rows += [(f"chunks/s, {s} concurrent streams", {n: statistics.median(p["chunks_per_s"]) for n, p in point.items()},
              lambda v: f"{v:.1f}") for s, point in concurrency.items()]
    print(f"machine: {os.cpu_count()} cpus; {args.requests} small requests, {args.streams} streams of "
          f"{args.tokens} tokens on each path, then {args.rounds} rounds of {','.join(map(str, args.concurrency))} "
          f"concurrent streams; nginx {nginx}")
    width = max(12, *(len(n) + 2 for n in names))
    print(f"{'':34}" + "".join(f"{n:>{width}}" for n in names) + f"{'capyctl/nginx':>15}{'capyctl/direct':>16}")
    for label, values, fmt in rows:
        print(f"{label:34}" + "".join(f"{fmt(values[n]) if n in values else '-':>{width}}" for n in names)
              + f"{values['capyctl'] / values['nginx']:>15.3f}{values['capyctl'] / values['direct']:>16.3f}")
    overheads = {n: statistics.median(latency[n]) - statistics.median(latency["direct"]) for n in names[1:]}
    print(f"{'overhead over direct (median)':34}{'':>{width}}" + "".join(f"{ms(v):>{width}}" for v in overheads.values()))
    if args.json:
        args.json.write_text(json.dumps({
            "requests": args.requests, "streams": args.streams, "tokens": args.tokens, "rounds": args.rounds,
            "engine_slots": slots, "nginx": nginx, "litellm": litellm_status, "latency_s": latency,
            "ttfc_s": ttfc, "stream_chunks_per_s": rate, "concurrency": concurrency}))


async def wait_listening(port: int) -> None:
    """Once something accepts connections on 127.0.0.1:``port`` (a process just started)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        writer.close()
        return


async def wait_litellm(http: aiohttp.ClientSession, url: str, process: subprocess.Popen,
                       prefix: Path) -> str | None:
    """None once LiteLLM answers a chat completion; else why it did not (it loads for a while)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = (prefix / "litellm.log").read_text(errors="replace").strip().splitlines()[-3:]
            return f"LiteLLM's proxy exited {process.returncode}: {' | '.join(tail)}"
        try:
            async with http.get(url + "/health/liveliness") as r:
                if r.status == 200:
                    await one_request(http, url, CLIENT_KEY)
                    return None
        except (aiohttp.ClientError, AssertionError):
            pass
        await asyncio.sleep(0.5)
    return "LiteLLM's proxy did not answer within 180 s"


if __name__ == "__main__":
    asyncio.run(main())
