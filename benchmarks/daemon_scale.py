"""The real daemon at scale: 8 deployments behind its one proxy, and its idle RSS, flat or not.

A sandboxed host (systemd as PID 1, the daemon as a Type=notify service: tests/integration/
capyhost.py) with 8 deployments of a custom engine that answers at once: nginx, one process,
returning a fixed chat completion and 200 on /health (no model, no inference, so 100,000
requests take minutes and the daemon's own cost is what shows). Then:

- the daemon's RSS (VmRSS) once idle after a few requests to each deployment;
- ``--requests`` chat completions (1 token, non-streaming) at ``--concurrency`` at once, spread
  round-robin over the 8 deployments: throughput, median and p99 latency per deployment;
- the daemon's RSS once idle after them (flat or growing), and its peak (VmHWM).

Needs root (the sandbox) and nginx (scripts/bench unpacks Debian's package).
Run: .venv/bin/python benchmarks/daemon_scale.py [--requests 100000] [--concurrency 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_summary import p99, render_scale  # noqa: E402
from proxy_vs_nginx import find_nginx  # noqa: E402
from _sandbox_daemon import Report, deploy_all  # noqa: E402
from tests.integration.capyhost import CapyHost  # noqa: E402

# The engine's one answer to every POST: a completion that is both a chat completion (message)
# and a text completion (text), so the daemon's post-start proof reads text from either route.
ANSWER = json.dumps({"id": "cmpl-1", "object": "chat.completion", "created": 0, "model": "instant",
                     "choices": [{"index": 0, "text": "Hi", "message": {"role": "assistant", "content": "Hi"},
                                  "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
# The engine: nginx in one process (master_process off: the unit has no capability to switch a
# worker's user), everything it writes under the unit's private /tmp, its log on stderr.
ENGINE_CONF = """\
master_process off;
daemon off;
pid /tmp/nginx.pid;
error_log stderr warn;
events { worker_connections 1000; }  # under the unit's 1024 open files
http {
    access_log off;
    client_body_temp_path /tmp/body;
    proxy_temp_path /tmp/proxy;
    fastcgi_temp_path /tmp/fastcgi;
    uwsgi_temp_path /tmp/uwsgi;
    scgi_temp_path /tmp/scgi;
    keepalive_requests 1000000;
    server {
        listen 127.0.0.1:@PORT@;
        location / { default_type application/json; return 200 '@ANSWER@'; }
    }
}
"""
ENGINE_REGISTRATION = """\
kind: engine
name: instant
type: custom
cmd: ["/bin/sh", "-c", "sed s/@PORT@/$1/ {template} > /tmp/nginx.conf && exec {nginx} -p /tmp/ -c /tmp/nginx.conf -e stderr", "instant-engine", "{{port}}"]
health: /health
capabilities: [chat, completions]
"""


def instant_engine(host: CapyHost, nginx: str) -> str:
    """The instant engine's registration, its nginx configuration template written where the
    engine's unit can read it."""
    template = host.root / "instant-engine.conf"
    template.write_text(ENGINE_CONF.replace("@ANSWER@", ANSWER))
    template.chmod(0o644)
    host.root.chmod(0o755)
    return ENGINE_REGISTRATION.format(template=template, nginx=nginx)


def rss(host: CapyHost, pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process in the sandbox, in bytes."""
    status = host.sh("cat", f"/proc/{pid}/status").stdout
    fields = {line.split(":")[0]: line.split()[1] for line in status.splitlines() if line.startswith("Vm")}
    return {"rss": int(fields["VmRSS"]) * 1024, "hwm": int(fields["VmHWM"]) * 1024}


async def one(http: aiohttp.ClientSession, url: str, key: str, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    started = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{model}: HTTP {r.status}")
    return time.perf_counter() - started


async def load(url: str, key: str, models: list[str], requests: int, concurrency: int,
               ) -> tuple[dict[str, list[float]], float]:
    """``requests`` requests over ``models`` round-robin, ``concurrency`` at a time."""
    samples: dict[str, list[float]] = {m: [] for m in models}
    counter = iter(range(requests))

    async def worker(http: aiohttp.ClientSession) -> None:
        for i in counter:
            model = models[i % len(models)]
            samples[model].append(await one(http, url, key, model))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        started = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        return samples, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--deployments", type=int, default=8)
    parser.add_argument("--settle", type=float, default=3.0, help="idle seconds before reading RSS")
    parser.add_argument("--nginx")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result: dict[str, object] = {"requests": args.requests, "concurrency": args.concurrency}
    report = Report("daemon_scale", args.json, result)

    model = report.model_or_end()
    nginx = find_nginx(args.nginx)
    host = CapyHost().boot()
    try:
        host.start_daemon()
        names = [f"instant-{i}" for i in range(args.deployments)]
        deploy_all(host, instant_engine(host, nginx), "instant", names, model)
        key = host.create_key("--name", "bench")
        pid = host.daemon_pid()

        async def few() -> None:
            async with aiohttp.ClientSession() as http:
                for _ in range(3):
                    for name in names:
                        await one(http, host.base_url, key, name)
        asyncio.run(few())
        time.sleep(args.settle)
        few_rss = rss(host, pid)
        result["rss_few_bytes"] = few_rss["rss"]
        print(f"daemon idle RSS after {3 * len(names)} requests: {few_rss['rss'] / 2**20:.1f} MiB", flush=True)

        samples, wall = asyncio.run(load(host.base_url, key, names, args.requests, args.concurrency))
        time.sleep(args.settle)
        after = rss(host, pid)
        result.update({
            "rss_after_bytes": after["rss"], "rss_peak_bytes": after["hwm"], "wall_s": wall,
            "total_rps": args.requests / wall,
            "deployments": {name: {"n": len(v), "throughput_rps": len(v) / wall, "median_s": statistics.median(v),
                                   "p99_s": p99(v)} for name, v in samples.items()},
        })
    except Exception as exc:  # noqa: BLE001 - the bench reports why and the run goes on
        report.failed(host, exc)
    finally:
        host.teardown()
    print(render_scale(result))
    print(f"daemon idle RSS after {args.requests:,} requests: {result['rss_after_bytes'] / 2**20:.1f} MiB "
          f"({(result['rss_after_bytes'] - result['rss_few_bytes']) / 2**20:+.1f} MiB); "
          f"peak {result['rss_peak_bytes'] / 2**20:.1f} MiB")
    report.finish()


if __name__ == "__main__":
    main()
