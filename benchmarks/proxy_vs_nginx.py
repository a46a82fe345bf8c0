"""The CapyCTL proxy against nginx as a plain reverse proxy, in front of the same llama-server.

Three paths to one llama-server (SmolLM2 135M), measured in the same run and alternated
request by request so that drift in the machine's load hits all alike:

- direct: the client talks to llama-server;
- nginx: Debian's nginx 1.22, one worker, ``proxy_buffering off``, HTTP/1.1 keepalive to the
  engine, and the engine's key set on the way (as CapyCTL swaps the client's key for it);
- capyctl: the CapyCTL proxy in a process of its own (benchmarks/_one_engine_proxy.py), with
  a key check, admission through a one-engine router and pass-through streaming.

Prints latency of small requests (median, p95), time to first chunk and chunks/s of streams,
and the ratios capyctl/nginx. nginx: ``--nginx PATH``, else $CAPYCTL_NGINX, else nginx on PATH
(scripts/bench unpacks Debian's package into /var/cache/capyctl-build/nginx).
Run: .venv/bin/python benchmarks/proxy_vs_nginx.py [--requests 60] [--streams 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_overhead import (CLIENT_KEY, find_model, free_port, load_arguments, one_request,  # noqa: E402
                            one_stream, p95)

NGINX_CONF = """\
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
    upstream llama {{ server 127.0.0.1:{engine_port}; keepalive 32; }}
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
        }}
    }}
}}
"""


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


async def main() -> None:
    parser = load_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--nginx")
    args = parser.parse_args()
    nginx = find_nginx(args.nginx)

    engine_port, launch_key = free_port(), secrets.token_hex(16)
    prefix = Path(tempfile.mkdtemp(prefix="capyctl-bench-nginx-"))
    nginx_port, proxy_port = free_port(), free_port()
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / sub).mkdir()
    (prefix / "nginx.conf").write_text(NGINX_CONF.format(prefix=prefix, engine_port=engine_port, port=nginx_port,
                                                         launch_key=launch_key))
    processes: list[subprocess.Popen] = []
    try:
        processes.append(subprocess.Popen(
            [args.llama_server, "-m", find_model(), "--host", "127.0.0.1", "--port", str(engine_port),
             "-c", "2048", "-t", "2", "--api-key", launch_key], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        processes.append(subprocess.Popen(
            [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "error.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        processes.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve().parent / "_one_engine_proxy.py"),
             "--upstream", f"http://127.0.0.1:{engine_port}", "--launch-key", launch_key,
             "--client-key", CLIENT_KEY, "--port", str(proxy_port)], stdout=subprocess.DEVNULL))
        paths = {"direct": (f"http://127.0.0.1:{engine_port}", launch_key),
                 "nginx": (f"http://127.0.0.1:{nginx_port}", CLIENT_KEY),
                 "capyctl": (f"http://127.0.0.1:{proxy_port}", CLIENT_KEY)}
        latency = {name: [] for name in paths}
        ttfc = {name: [] for name in paths}
        rate = {name: [] for name in paths}
        async with aiohttp.ClientSession() as http:
            await wait_healthy(http, paths["direct"][0], "llama-server")
            await wait_healthy(http, paths["nginx"][0], "nginx")
            await wait_healthy(http, paths["capyctl"][0], "the CapyCTL proxy")
            for _ in range(3):  # warm every path (connection pools, prompt cache)
                for url, key in paths.values():
                    await one_request(http, url, key)
            for _ in range(args.requests):
                for name, (url, key) in paths.items():
                    latency[name].append(await one_request(http, url, key))
            for _ in range(args.streams):
                for name, (url, key) in paths.items():
                    t, r, _ = await one_stream(http, url, key, args.tokens)
                    ttfc[name].append(t)
                    rate[name].append(r)
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
        shutil.rmtree(prefix, ignore_errors=True)

    def ms(v: float) -> str:
        return f"{v * 1000:.2f} ms"

    rows = [("latency median (max_tokens 1)", {n: statistics.median(v) for n, v in latency.items()}, ms),
            ("latency p95", {n: p95(v) for n, v in latency.items()}, ms),
            ("time to first chunk median", {n: statistics.median(v) for n, v in ttfc.items()}, ms),
            ("stream chunks/s median", {n: statistics.median(v) for n, v in rate.items()}, lambda v: f"{v:.1f}")]
    print(f"machine: {os.cpu_count()} cpus; {args.requests} small requests, {args.streams} streams of "
          f"{args.tokens} tokens on each path; nginx {nginx}")
    print(f"{'':30}{'direct':>12}{'nginx':>12}{'capyctl':>12}{'capyctl/nginx':>15}")
    for label, values, fmt in rows:
        print(f"{label:30}{fmt(values['direct']):>12}{fmt(values['nginx']):>12}{fmt(values['capyctl']):>12}"
              f"{values['capyctl'] / values['nginx']:>15.3f}")
    overhead_nginx = statistics.median(latency["nginx"]) - statistics.median(latency["direct"])
    overhead_capy = statistics.median(latency["capyctl"]) - statistics.median(latency["direct"])
    print(f"{'overhead over direct (median)':30}{'':>12}{ms(overhead_nginx):>12}{ms(overhead_capy):>12}")


if __name__ == "__main__":
    asyncio.run(main())
