"""Many streamed requests at once through the real daemon: none dropped or cut, RSS bounded.

A sandboxed host (tests/integration/capyhost.py, as daemon_scale.py) with ``--deployments``
deployments of a stand-in engine that streams (benchmarks/_sse_engine.py: OpenAI chat chunks one
every ``--interval`` seconds, then ``data: [DONE]``; no model). Then ``--streams`` streamed chat
requests, all sent at once and spread round-robin over the deployments and over CLIENT_ADDRESSES
loopback addresses (the door's per-address cap stands for one user's connections), each asking
for ``--chunks`` chunks. Every stream is counted:

- done: status 200, every chunk, and ``data: [DONE]`` at its end;
- cut: status 200 but the stream ended (or broke) before ``[DONE]`` or with chunks missing;
- refused: another status, by status and error code;
- failed: no answer (the exception's type).

And the daemon's RSS (VmRSS): once idle before, its peak while the streams run (sampled every
0.1 s from /proc, with VmHWM beside it), and once idle after; its open descriptors at their peak.

Needs root (the sandbox) and the SmolLM2 package's file as a model path (the stand-in never reads it).
Run: .venv/bin/python benchmarks/streams_scale.py [--streams 1000] [--deployments 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _sandbox_daemon import (Report, Watch, deploy_all, deployment_states, host_pid, open_files_limit,  # noqa: E402
                             proc_status, raise_open_files)
from bench_summary import p99  # noqa: E402
from tests.integration.capyhost import CapyHost  # noqa: E402

# The stand-in runs with the system's python3 inside the engine's unit (standard library only);
# its script is copied where the unit can read it.
ENGINE_REGISTRATION = """\
kind: engine
name: streamer
type: custom
cmd: ["{python}", "{script}", "--port", "{{port}}", "--interval", "{interval}", "--chunks", "{chunks}"]
health: /health
capabilities: [chat, completions]
"""


@dataclass
class Stream:
    """What one streamed request met."""

    deployment: str
    status: int | None = None
    code: str | None = None  # the error code of a refusal
    chunks: int = 0  # content chunks read
    done: bool = False  # data: [DONE] read
    error: str | None = None  # what broke it, when something did
    first_s: float | None = None  # to the first content chunk
    total_s: float | None = None


def outcome(stream: Stream, chunks: int) -> str:
    """done, or why not: ``cut (...)``, ``refused <status> <code>`` or ``failed (<exception>)``."""
    if stream.status is None:
        return f"failed ({stream.error})"
    if stream.status != 200:
        return f"refused {stream.status}" + (f" {stream.code}" if stream.code else "")
    if stream.done and stream.chunks == chunks and stream.error is None:
        return "done"
    if stream.error is not None:
        return f"cut ({stream.error})"
    return "cut (no [DONE])" if not stream.done else f"cut ({stream.chunks} of {chunks} chunks)"


def read_events(stream: Stream, lines: list[bytes]) -> None:
    """Count the content chunks and [DONE] among the ``data:`` lines of an event stream."""
    for line in lines:
        if not line.startswith(b"data:"):
            continue  # blank lines between events, and comments (": ...") while a request waits
        data = line[5:].strip()
        if data == b"[DONE]":
            stream.done = True
            continue
        try:
            event = json.loads(data)
        except ValueError:
            stream.error = "a data line that is not JSON"
            continue
        for choice in event.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                stream.chunks += 1


async def one_stream(http: aiohttp.ClientSession, url: str, key: str, stream: Stream, chunks: int,
                     timeout: float) -> None:
    body = {"model": stream.deployment, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": chunks,
            "stream": True}
    started = time.perf_counter()
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            stream.status = r.status
            if r.status != 200:
                try:
                    stream.code = (await r.json(content_type=None))["error"]["code"]
                except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                    pass
                return
            async for line in r.content:
                seen = stream.chunks
                read_events(stream, [line])
                if stream.first_s is None and stream.chunks > seen:
                    stream.first_s = time.perf_counter() - started
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
        stream.error = type(exc).__name__
    finally:
        stream.total_s = time.perf_counter() - started


# The streams come from this many client addresses (127.0.0.1, .2, ...), as many users' would: the
# door lets one address hold door.per_address_max connections (256 by default, docs/security.md).
CLIENT_ADDRESSES = 8


async def all_streams(url: str, key: str, names: list[str], count: int, chunks: int,
                      timeout: float) -> tuple[list[Stream], float]:
    """``count`` streams at once, round-robin over ``names`` and over CLIENT_ADDRESSES addresses."""
    streams = [Stream(names[i % len(names)]) for i in range(count)]
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, local_addr=(f"127.0.0.{k + 1}", 0)))
                for k in range(CLIENT_ADDRESSES)]
    try:
        started = time.perf_counter()
        await asyncio.gather(*(one_stream(sessions[i % len(sessions)], url, key, s, chunks, timeout)
                               for i, s in enumerate(streams)))
        return streams, time.perf_counter() - started
    finally:
        for http in sessions:
            await http.close()


def summarize(streams: list[Stream], chunks: int) -> dict[str, object]:
    """The counts of the streams' outcomes, and their times (of those that were done)."""
    by: dict[str, int] = {}
    for s in streams:
        o = outcome(s, chunks)
        by[o] = by.get(o, 0) + 1
    done = [s for s in streams if outcome(s, chunks) == "done"]
    totals = [s.total_s for s in done if s.total_s is not None]
    firsts = [s.first_s for s in done if s.first_s is not None]
    return {"streams": len(streams), "done": by.pop("done", 0), "lost_by": by,
            "median_stream_s": statistics.median(totals) if totals else None,
            "p99_stream_s": p99(totals) if totals else None,
            "median_first_chunk_s": statistics.median(firsts) if firsts else None,
            "p99_first_chunk_s": p99(firsts) if firsts else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--deployments", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=20, help="content chunks each stream asks for")
    parser.add_argument("--interval", type=float, default=0.1, help="the stand-in's seconds between two chunks")
    parser.add_argument("--timeout", type=float, default=120.0, help="the most one stream may take")
    parser.add_argument("--settle", type=float, default=3.0, help="idle seconds before reading RSS")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result: dict[str, object] = {"deployments": args.deployments, "chunks": args.chunks, "interval_s": args.interval}
    report = Report("streams_scale", args.json, result)

    model = report.model_or_end()
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        report.finish("needs the system's python3 (/usr/bin) for the stand-in engine")
    raise_open_files()  # a connection a stream, all at once
    host = CapyHost().boot()
    try:
        host.start_daemon()
        script = host.root / "sse_engine.py"
        shutil.copyfile(HERE / "_sse_engine.py", script)
        script.chmod(0o644)
        host.root.chmod(0o755)
        names = [f"streamer-{i}" for i in range(args.deployments)]
        deploy_all(host, ENGINE_REGISTRATION.format(python=python, script=script, interval=args.interval,
                                                     chunks=args.chunks), "streamer", names, model)
        key = host.create_key("--name", "bench")
        pid = host_pid(host)
        if pid is None:
            raise RuntimeError("the daemon's process was not found in its sandbox's cgroup")
        result["open_files_limit"] = open_files_limit(pid)

        # A few streams first (connections to each engine made, code paths warm), then idle.
        warm, _ = asyncio.run(all_streams(host.base_url, key, names, 2 * len(names), 2, args.timeout))
        if any(outcome(s, 2) != "done" for s in warm):
            raise RuntimeError("warm-up streams: " + ", ".join(sorted({outcome(s, 2) for s in warm})))
        time.sleep(args.settle)
        before = proc_status(pid)["rss"]
        watch = Watch(pid).start()
        try:
            streams, wall = asyncio.run(all_streams(host.base_url, key, names, args.streams, args.chunks,
                                                    args.timeout))
        finally:
            watch.stop()
        time.sleep(args.settle)
        after = proc_status(pid)
        result.update(summarize(streams, args.chunks))
        result.update({"wall_s": wall, "fds_peak": watch.fds_peak, "states_after": deployment_states(host),
                       "rss_bytes": {"before": before, "peak": max(watch.rss_peak, before), "after": after["rss"],
                                     "hwm": after["hwm"], "samples": watch.samples}})
    except Exception as exc:  # noqa: BLE001 - the bench reports why and the run goes on
        report.failed(host, exc)
    finally:
        host.teardown()
    print(render(result))
    report.finish()


def render(result: dict) -> str:
    mib = 1 << 20
    rss = result["rss_bytes"]
    lost = result["streams"] - result["done"]
    lines = [f"{result['streams']:,} streams at once over {result['deployments']} deployments, {result['chunks']} "
             f"chunks each, one every {result['interval_s']} s: {result['done']:,} done, {lost} dropped or cut"
             + "".join(f"; {n} {why}" for why, n in sorted(result["lost_by"].items(), key=lambda kv: -kv[1])),
             f"all in {result['wall_s']:.1f} s; a stream {_s(result['median_stream_s'])} median, "
             f"{_s(result['p99_stream_s'])} p99; first chunk {_s(result['median_first_chunk_s'])} median, "
             f"{_s(result['p99_first_chunk_s'])} p99",
             f"daemon RSS: {rss['before'] / mib:.1f} MiB before, {rss['peak'] / mib:.1f} MiB peak "
             f"({rss['samples']} samples; VmHWM {rss['hwm'] / mib:.1f} MiB), {rss['after'] / mib:.1f} MiB after; "
             f"open descriptors at most {result['fds_peak']} (limit {result.get('open_files_limit')})",
             "deployments after: " + ", ".join(f"{n} {s}" for n, s in sorted(result["states_after"].items()))]
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


if __name__ == "__main__":
    main()
