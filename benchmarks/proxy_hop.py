"""What one hop through the CapyCTL proxy costs, with nothing else in the measurement.

The engine here answers at once: nginx returning a fixed chat completion (no model, no
inference noise), so the time a request takes is the network stack plus the proxies.
Three paths, alternated request by request in an order shuffled each turn (proxy_overhead.shuffled):

- direct: client -> engine;
- nginx: client -> nginx (its own process, one worker, keepalive upstream, proxy_buffering off) -> engine;
- capyctl: client -> the CapyCTL proxy in its own process (benchmarks/_one_engine_proxy.py,
  key checked against a real SQLite store as the daemon does) -> engine;
- capyctl-aiohttp-client: the same proxy reaching the engine through aiohttp's ClientSession
  instead of its own engine client (capyctl/proxy/_engine_side.py; _one_engine_proxy.py
  --engine-client aiohttp): what the hand-made client saves, measured in the same run (issue 45
  keeps it only if that is at least bench_goals.ENGINE_CLIENT_PAYS a request in a scripts/bench
  run, whose summary row says KEEP or DELETE; a run of this script alone decides nothing);
- floor: benchmarks/_minimal_relay.py, the least a Python proxy on the same event loop and parser
  can do (no key, no model read, no admission, no metrics): how much of CapyCTL's hop is its own
  work rather than Python's;
- aiohttp-server: benchmarks/_aiohttp_relay.py, aiohttp's server as CapyCTL configures it relaying
  through CapyCTL's engine client, none of CapyCTL's work: aiohttp's own share of the hop;
- capyctl (3.13) and aiohttp-server (3.13), with ``--other-python PATH`` (repeatable; a venv's
  python with CapyCTL installed, as ``PYTHON=python3.13 CAPYCTL_VENV=.venv-py3.13 scripts/setup venv``
  makes it): the CapyCTL proxy and aiohttp's relay again, under that interpreter, on the same turns
  (issue 57). aiohttp starts a connection's task and each request's handler eagerly from Python 3.12
  on, on the loop's next turn before (aiohttp/web_protocol.py: ``eager_start=True`` under
  ``sys.version_info >= (3, 12)``): the hop of the same code by Python.

Prints median and p95 latency of each, the hop each proxy adds over direct, the ratio of
CapyCTL's hop to nginx's, and what the hand-made engine client saves (latency paired by turn, and
the proxy's CPU per request). ``--profile DIR`` records the proxy with py-spy while it runs and
writes py-spy's flame graph (SVG), its collapsed stacks and the top functions there.
Run: .venv/bin/python benchmarks/proxy_hop.py [--requests 2000] [--profile DIR] [--other-python PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The path of the proxy reaching its engine through aiohttp's client, and what the hand-made client
# must save a request to stay (issue 45), named where the table judges it.
import bench_goals as G  # noqa: E402
from bench_summary import AIOHTTP_CLIENT, AIOHTTP_SERVER, on_python  # noqa: E402
from proxy_overhead import CLIENT_KEY, free_port, p95, shuffled  # noqa: E402
from proxy_vs_nginx import (add_other_python, find_nginx, other_pythons, relay_command, start_nginx,  # noqa: E402
                            wait_healthy, wait_listening)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capyctl.store import Store  # noqa: E402

ANSWER = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "smol",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                                  "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

# Two nginx processes, each with one worker: the engine, and nginx as the proxy in front of it.
# (One process for both would hand requests to its own engine without a process switch, which
# no real engine allows, and make nginx's hop look free.)
ENGINE_SERVER = """\
    server {{  # the engine: answers at once
        listen 127.0.0.1:{engine_port};
        keepalive_requests 1000000;
        location / {{ default_type application/json; return 200 '{answer}'; }}
    }}"""
PROXY_SERVER = """\
    upstream engine {{ server 127.0.0.1:{engine_port}; keepalive 32; }}
    server {{  # nginx as the proxy
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Authorization "Bearer launch";
            proxy_buffering off;
        }}
    }}"""


def engine_client_saves(latency: dict[str, list[float]], cpu: dict[str, float]) -> dict[str, float]:
    """What the proxy's own engine client saves over aiohttp's: the median of the latency
    differences turn by turn (each turn took one request on every path, so a turn's two samples
    saw the same machine), and the difference of the proxy's CPU per request."""
    pairs = zip(latency[AIOHTTP_CLIENT], latency["capyctl"])
    return {"latency_s": statistics.median(a - b for a, b in pairs),
            "cpu_s": cpu[AIOHTTP_CLIENT] - cpu["capyctl"]}


async def one(http: aiohttp.ClientSession, url: str, key: str) -> float:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    started = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        assert r.status == 200, r.status
    return time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(paths: dict[str, tuple[str, str]], requests: int, proxy_pids: dict[str, int],
                  cpu: dict[str, float]) -> dict[str, list[float]]:
    latency: dict[str, list[float]] = {name: [] for name in paths}
    async with aiohttp.ClientSession() as http:
        for name, (url, _) in paths.items():
            if name.startswith(AIOHTTP_SERVER):  # _aiohttp_relay.py answers chat completions only
                await wait_listening(int(url.rpartition(":")[2]))
            else:
                await wait_healthy(http, url, name, path="/health" if name.startswith("capyctl") else "/")
        for _ in range(50):  # warm pools and caches
            for url, key in paths.values():
                await one(http, url, key)
        for name, pid in proxy_pids.items():
            url, key = paths[name]
            before = cpu_seconds(pid)
            for _ in range(requests):  # the proxy's own CPU per request, with nothing else going through it
                await one(http, url, key)
            cpu[name] = (cpu_seconds(pid) - before) / requests
        for turn in range(requests):
            for name, (url, key) in shuffled(paths, turn):
                latency[name].append(await one(http, url, key))
    return latency


def profile_report(svg: Path, raw: Path, out: Path) -> None:
    """The functions py-spy saw most often (self and total), from its raw collapsed stacks."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        samples += n
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + n
    lines = [f"py-spy samples: {samples} (flame graph: {svg.name})", "", "top self time:"]
    lines += [f"  {n / samples:6.1%}  {frame}" for frame, n in sorted(own.items(), key=lambda kv: -kv[1])[:15]]
    lines += ["", "top total time:"]
    lines += [f"  {n / samples:6.1%}  {frame}" for frame, n in sorted(total.items(), key=lambda kv: -kv[1])[:25]]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:18]))


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--nginx")
    parser.add_argument("--profile", type=Path, help="record the proxy with py-spy; write results here")
    add_other_python(parser)
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    return parser


def main() -> None:
    args = arguments().parse_args()
    nginx = find_nginx(args.nginx)
    others = other_pythons(args.other_python)
    prefix = Path(tempfile.mkdtemp(prefix="capyctl-bench-hop-"))
    engine_port, nginx_port, proxy_port, plain_port, floor_port, relay_port = (free_port() for _ in range(6))
    # The CapyCTL proxy (its own engine client) and aiohttp's relay on each other Python, by name.
    other_ports = {on_python(name, version): free_port() for version in others for name in ("capyctl", AIOHTTP_SERVER)}
    servers = {"engine": ENGINE_SERVER.format(engine_port=engine_port, answer=ANSWER),
               "proxy": PROXY_SERVER.format(engine_port=engine_port, port=nginx_port)}
    _, store_key = Store(prefix / "state.db").create_key("bench")  # the daemon's keys, in SQLite
    processes: list[subprocess.Popen] = []
    try:
        for name, server in servers.items():
            processes.append(start_nginx(nginx, prefix / name, server, stderr=subprocess.DEVNULL))
        proxies = {}
        upstream = f"http://127.0.0.1:{engine_port}"
        for name, port, client, python in (
                ("capyctl", proxy_port, "own", sys.executable), (AIOHTTP_CLIENT, plain_port, "aiohttp", sys.executable),
                *((on_python("capyctl", v), other_ports[on_python("capyctl", v)], "own", o["executable"])
                  for v, o in others.items())):
            proxies[name] = subprocess.Popen(
                [python, str(Path(__file__).resolve().parent / "_one_engine_proxy.py"),
                 "--upstream", upstream, "--launch-key", "launch",
                 "--port", str(port), "--store", str(prefix / "state.db"), "--engine-client", client],
                stdout=subprocess.DEVNULL)
            processes.append(proxies[name])
        for name, port, python in ((AIOHTTP_SERVER, relay_port, sys.executable),
                                   *((on_python(AIOHTTP_SERVER, v), other_ports[on_python(AIOHTTP_SERVER, v)],
                                      o["executable"]) for v, o in others.items())):
            proxies[name] = subprocess.Popen(relay_command(python, upstream, "launch", port), stdout=subprocess.DEVNULL)
            processes.append(proxies[name])
        proxies["floor"] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve().parent / "_minimal_relay.py"), "--upstream-port",
             str(engine_port), "--launch-key", "launch", "--port", str(floor_port)], stdout=subprocess.DEVNULL)
        processes.append(proxies["floor"])
        proxy = proxies["capyctl"]
        paths = {"direct": (f"http://127.0.0.1:{engine_port}", CLIENT_KEY),
                 "nginx": (f"http://127.0.0.1:{nginx_port}", CLIENT_KEY),
                 "capyctl": (f"http://127.0.0.1:{proxy_port}", store_key),
                 AIOHTTP_CLIENT: (f"http://127.0.0.1:{plain_port}", store_key),
                 "floor": (f"http://127.0.0.1:{floor_port}", CLIENT_KEY),
                 AIOHTTP_SERVER: (f"http://127.0.0.1:{relay_port}", CLIENT_KEY),
                 **{name: (f"http://127.0.0.1:{port}", store_key if name.startswith("capyctl") else CLIENT_KEY)
                    for name, port in other_ports.items()}}
        cpu: dict[str, float] = {}
        latency = asyncio.run(measure(paths, args.requests, {n: p.pid for n, p in proxies.items()}, cpu))
        if args.profile:
            # A second pass, recorded: py-spy pauses the process it samples, so the figures above
            # are taken without it (with it, the hop measured some four times longer).
            args.profile.mkdir(parents=True, exist_ok=True)
            py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            # Two recordings of the same pass: py-spy's own flame graph, and collapsed stacks to rank.
            spies = [subprocess.Popen([py_spy, "record", "--pid", str(proxy.pid), "--rate", "250", "--format", fmt,
                                       "--output", str(args.profile / name)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for fmt, name in (("flamegraph", "proxy-hop.svg"), ("raw", "proxy-hop.collapsed"))]
            time.sleep(1.0)  # both attached
            asyncio.run(measure({"capyctl": paths["capyctl"]}, args.requests // 2, {"capyctl": proxy.pid}, {}))
            for spy in spies:
                spy.send_signal(2)  # py-spy writes its output on SIGINT
            for spy in spies:
                spy.wait(timeout=60)
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
        shutil.rmtree(prefix, ignore_errors=True)

    med = {name: statistics.median(v) for name, v in latency.items()}
    tail = {name: p95(v) for name, v in latency.items()}
    hop = {name: med[name] - med["direct"] for name in paths if name != "direct"}
    print(f"machine: {os.cpu_count()} cpus; {args.requests} requests on each path, alternated; engine: nginx "
          "answering at once")
    print(f"{'':24}" + "".join(f"{n:>24}" for n in paths))
    print(f"{'median (us)':24}" + "".join(f"{med[n] * 1e6:>24.0f}" for n in paths))
    print(f"{'p95 (us)':24}" + "".join(f"{tail[n] * 1e6:>24.0f}" for n in paths))
    print(f"{'hop over direct (us)':24}{'':>24}" + "".join(f"{hop[n] * 1e6:>24.0f}" for n in paths if n in hop))
    # nginx's hop is tens of microseconds, within the noise of a busy machine: no ratio when it is not above 0.
    print("capyctl hop / nginx hop: " + (f"{hop['capyctl'] / hop['nginx']:.2f}x" if hop["nginx"] > 0 else
                                         "n/a (nginx's hop was within the noise)"))
    print(f"CapyCTL proxy CPU per request: {cpu['capyctl'] * 1e6:.0f} us "
          f"(through aiohttp's client to the engine: {cpu[AIOHTTP_CLIENT] * 1e6:.0f} us)")
    saved = engine_client_saves(latency, cpu)
    print(f"engine client: the hand-made one saves {saved['latency_s'] * 1e6:.0f} us a request (median of the "
          f"differences turn by turn; medians {med['capyctl'] * 1e6:.0f} against {med[AIOHTTP_CLIENT] * 1e6:.0f} us) "
          f"and {saved['cpu_s'] * 1e6:.0f} us of proxy CPU: {G.ENGINE_CLIENT_PAYS.judge(saved['latency_s'])} "
          f"({G.ENGINE_CLIENT_PAYS.shown}; issue 45's verdict is the figure of a scripts/bench run, "
          "not of this script run alone)")
    print(f"floor, a minimal Python relay (_minimal_relay.py): hop {hop['floor'] * 1e6:.0f} us, "
          f"CPU {cpu['floor'] * 1e6:.0f} us/request")
    print(f"Python {platform.python_version()} for every path not marked: capyctl's hop {hop['capyctl'] * 1e6:.0f} us, "
          f"aiohttp's server alone {hop[AIOHTTP_SERVER] * 1e6:.0f} us (CPU {cpu[AIOHTTP_SERVER] * 1e6:.0f} us/request)")
    for version, other in others.items():
        name, relay = on_python("capyctl", version), on_python(AIOHTTP_SERVER, version)
        less = statistics.median(a - b for a, b in zip(latency["capyctl"], latency[name]))
        print(f"Python {other['version']} ({other['executable']}): capyctl's hop {hop[name] * 1e6:.0f} us, "
              f"{abs(less) * 1e6:.0f} us {'less' if less >= 0 else 'more'} than on {platform.python_version()} "
              f"(paired by turn), CPU {cpu[name] * 1e6:.0f} us/request; aiohttp's server alone "
              f"{hop[relay] * 1e6:.0f} us (CPU {cpu[relay] * 1e6:.0f} us/request)")
    if args.json:
        args.json.write_text(json.dumps({"requests": args.requests, "median_s": med, "p95_s": tail,
                                         "hop_s": hop, "capyctl_per_request_s": cpu["capyctl"],
                                         "cpu_per_request_s": cpu, "engine_client_saves": saved,
                                         # The Python of every path not named on_python(path, version),
                                         # and the others by version.
                                         "python": platform.python_version(), "aiohttp": aiohttp.__version__,
                                         "other_pythons": others, "samples": latency}))
    if args.profile and (args.profile / "proxy-hop.collapsed").exists():
        profile_report(args.profile / "proxy-hop.svg", args.profile / "proxy-hop.collapsed",
                       args.profile / "proxy-hop-top.txt")



if __name__ == "__main__":
    main()
