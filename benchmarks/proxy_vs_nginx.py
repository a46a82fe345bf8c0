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
  otherwise land on their turns);

- capyctl and aiohttp-server on another Python (``--other-python PATH``, repeatable: the ``python``
  of a venv with CapyCTL and its locked dependencies, as ``PYTHON=python3.13
  CAPYCTL_VENV=.venv-py3.13 scripts/setup venv`` makes it): the same two processes under that
  interpreter, named "capyctl (3.13)" and "aiohttp-server (3.13)" (bench_summary.on_python), the
  proxy among direct, nginx and CapyCTL's turns (latency, streams, concurrent streams), the relay
  on the latency turns. aiohttp starts a connection's task and each request's handler eagerly
  from Python 3.12 on (aiohttp/web_protocol.py: ``eager_start=True`` under
  ``sys.version_info >= (3, 12)``), so the same proxy's added latency differs by Python (issue 57).

Prints latency of small requests (median, p95), time to first chunk and chunks/s of streams
one at a time, aggregate chunks/s of 1, 8 and 64 concurrent streams (``--concurrency``; the
engine gets one slot per stream), and the ratios capyctl/nginx and capyctl/direct;
``--json FILE`` writes every sample. nginx: ``--nginx PATH``, else $CAPYCTL_NGINX, else nginx on PATH
(scripts/bench unpacks Debian's package into /var/cache/capyctl-build/nginx).
Run: .venv/bin/python benchmarks/proxy_vs_nginx.py [--requests 60] [--streams 8] [--tokens 64]
     [--concurrency 1,8,64] [--rounds 3] [--litellm PATH] [--other-python PATH] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_summary import AIOHTTP_SERVER, minor, on_python  # noqa: E402
from proxy_overhead import (CLIENT_KEY, find_model, free_port, load_arguments, one_request,  # noqa: E402
                            one_stream, p95, shuffled)

HERE = Path(__file__).resolve().parent
# What an --other-python interpreter runs first: the proxy's and the relay's scripts imported from
# this folder (sys.argv[1]), all they import with them (CapyCTL from this checkout, as they put it
# first on sys.path), then its version and aiohttp's printed.
PROBE = ("import sys; sys.path.insert(0, sys.argv[1]); import _aiohttp_relay, _one_engine_proxy, aiohttp; "
         "print('%d.%d.%d' % sys.version_info[:3], aiohttp.__version__)")

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


def add_other_python(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--other-python, repeatable, for proxy_vs_nginx.py and proxy_hop.py."""
    parser.add_argument("--other-python", action="append", default=[], metavar="PATH",
                        help="also run the CapyCTL proxy and aiohttp's bare relay (_aiohttp_relay.py) under this "
                             "interpreter (a venv's python with CapyCTL installed), as paths of their own named "
                             "'capyctl (3.13)' and 'aiohttp-server (3.13)'; repeatable, one per Python")
    return parser


def other_pythons(executables: Sequence[str], own: str | None = None) -> dict[str, dict[str, str]]:
    """Each --other-python by its major.minor: {"3.13": {"executable": PATH, "version": "3.13.0",
    "aiohttp": "3.14.5"}}, from PROBE run under it. Exits, saying why, where one does not run or
    cannot import what the proxy's process imports, or is the Python of this process (``own``, by
    default this one's version) or of another --other-python: its paths would bear the same name."""
    own = own or platform.python_version()
    found: dict[str, dict[str, str]] = {}
    for executable in executables:
        try:
            probe = subprocess.run([executable, "-c", PROBE, str(HERE)], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            sys.exit(f"--other-python {executable}: {exc}")
        words = probe.stdout.split()
        if probe.returncode != 0 or len(words) != 2:
            why = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
            sys.exit(f"--other-python {executable}: cannot run the proxy there: {why}")
        version, aiohttp_version = words
        label = minor(version)
        assert label is not None
        if label == minor(own):
            sys.exit(f"--other-python {executable} is Python {version}, the minor version running this benchmark "
                     f"({own}): its paths would be this Python's")
        if label in found:
            sys.exit(f"--other-python {executable} is Python {version}, as --other-python "
                     f"{found[label]['executable']} is: one interpreter a Python")
        found[label] = {"executable": executable, "version": version, "aiohttp": aiohttp_version}
    return found


def relay_command(python: str, upstream: str, launch_key: str, port: int) -> list[str]:
    """benchmarks/_aiohttp_relay.py under ``python``: aiohttp's server with none of CapyCTL's work."""
    return [python, str(HERE / "_aiohttp_relay.py"), "--upstream", upstream, "--launch-key", launch_key,
            "--port", str(port)]


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


def arguments() -> argparse.ArgumentParser:
    parser = load_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--nginx")
    parser.add_argument("--concurrency", type=int_list, default=[1, 8, 64],
                        help="concurrent stream counts (default 1,8,64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each concurrent stream count per path")
    parser.add_argument("--litellm", help="LiteLLM's `litellm` command (its proxy), measured as a fourth path")
    add_other_python(parser)
    parser.add_argument("--json", type=Path, help="write every sample and figure as JSON here")
    return parser


async def main() -> None:
    args = arguments().parse_args()
    nginx = find_nginx(args.nginx)
    others = other_pythons(args.other_python)
    slots = max(args.concurrency + [4])

    engine_port, launch_key = free_port(), secrets.token_hex(16)
    prefix = Path(tempfile.mkdtemp(prefix="capyctl-bench-nginx-"))
    nginx_port, proxy_port, litellm_port, floor_port = free_port(), free_port(), free_port(), free_port()
    aiohttp_port = free_port()
    # On each other Python: the CapyCTL proxy's port, then aiohttp's bare relay's.
    other_ports = {version: (free_port(), free_port()) for version in others}
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
        for python, port in [(sys.executable, proxy_port)] + [(o["executable"], other_ports[v][0])
                                                              for v, o in others.items()]:
            processes.append(subprocess.Popen(
                [python, str(HERE / "_one_engine_proxy.py"),
                 "--upstream", f"http://127.0.0.1:{engine_port}", "--launch-key", launch_key,
                 "--client-key", CLIENT_KEY, "--port", str(port)], stdout=subprocess.DEVNULL))
        # The floor (_minimal_relay.py): a relay on the same event loop and parser with none of
        # CapyCTL's work, on the latency turns only (it relays no stream), so that every run shows
        # how much of CapyCTL's added latency is its own per-request work and how much Python's.
        processes.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve().parent / "_minimal_relay.py"),
             "--upstream-port", str(engine_port), "--launch-key", launch_key, "--port", str(floor_port)],
            stdout=subprocess.DEVNULL))
        for python, port in [(sys.executable, aiohttp_port)] + [(o["executable"], other_ports[v][1])
                                                                for v, o in others.items()]:
            processes.append(subprocess.Popen(relay_command(python, f"http://127.0.0.1:{engine_port}", launch_key,
                                                            port), stdout=subprocess.DEVNULL))
        litellm = None
        if args.litellm:
            litellm = start_litellm(args.litellm, prefix, engine_port, launch_key, litellm_port)
            processes.append(litellm)
        paths = {"direct": (f"http://127.0.0.1:{engine_port}", launch_key),
                 "nginx": (f"http://127.0.0.1:{nginx_port}", CLIENT_KEY),
                 "capyctl": (f"http://127.0.0.1:{proxy_port}", CLIENT_KEY)}
        # The same proxy on each other Python, among the turns of the one above (issue 57).
        capyctl_on = [on_python("capyctl", version) for version in others]
        paths.update({on_python("capyctl", version): (f"http://127.0.0.1:{ports[0]}", CLIENT_KEY)
                      for version, ports in other_ports.items()})
        async with aiohttp.ClientSession() as http:
            await wait_healthy(http, paths["direct"][0], "llama-server")
            await wait_healthy(http, paths["nginx"][0], "nginx")
            await wait_healthy(http, paths["capyctl"][0], "the CapyCTL proxy")
            for version in others:
                await wait_healthy(http, paths[on_python("capyctl", version)][0],
                                   f"the CapyCTL proxy on Python {version}")
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
            # direct, nginx and CapyCTL (on each Python) take turns; LiteLLM is measured in a pass of its
            # own after them:
            # it keeps working for milliseconds after it answers, and with a few rounds per stream count
            # the shuffled order spread that unevenly over the others (8 streams through CapyCTL read
            # 0.90x to 1.02x of direct with LiteLLM among the turns, 1.00x without).
            passes = [{n: paths[n] for n in ("direct", "nginx", "capyctl", *capyctl_on)}]
            if "litellm" in paths:
                passes.append({"litellm": paths["litellm"]})
            relays = {"floor": (f"http://127.0.0.1:{floor_port}", CLIENT_KEY),
                      AIOHTTP_SERVER: (f"http://127.0.0.1:{aiohttp_port}", CLIENT_KEY),
                      **{on_python(AIOHTTP_SERVER, version): (f"http://127.0.0.1:{ports[1]}", CLIENT_KEY)
                         for version, ports in other_ports.items()}}
            await wait_listening(floor_port)
            await wait_listening(aiohttp_port)
            for ports in other_ports.values():
                await wait_listening(ports[1])
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

    names = list(paths) + [name for name in latency if name not in paths]  # the relays: floor, aiohttp-server
    rows = [("latency median (max_tokens 1)", {n: statistics.median(v) for n, v in latency.items()}, ms),
            ("latency p95", {n: p95(v) for n, v in latency.items()}, ms),
            ("time to first chunk median", {n: statistics.median(v) for n, v in ttfc.items()}, ms),
            ("stream chunks/s median", {n: statistics.median(v) for n, v in rate.items()}, lambda v: f"{v:.1f}")]
    rows += [(f"chunks/s, {s} concurrent streams", {n: statistics.median(p["chunks_per_s"]) for n, p in point.items()},
              lambda v: f"{v:.1f}") for s, point in concurrency.items()]
    print(f"machine: {os.cpu_count()} cpus; {args.requests} small requests, {args.streams} streams of "
          f"{args.tokens} tokens on each path, then {args.rounds} rounds of {','.join(map(str, args.concurrency))} "
          f"concurrent streams; nginx {nginx}")
    print(f"Python {platform.python_version()} (aiohttp {aiohttp.__version__}) for every path not marked"
          + "".join(f"; ({version}): Python {o['version']} (aiohttp {o['aiohttp']}), {o['executable']}"
                    for version, o in others.items()))
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
            "engine_slots": slots, "nginx": nginx, "litellm": litellm_status,
            # The Python of every path not named on_python(path, version), and the others by version.
            "python": platform.python_version(), "aiohttp": aiohttp.__version__, "other_pythons": others,
            "latency_s": latency,
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
