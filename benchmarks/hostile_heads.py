"""Keyed clients while one client holds thousands of half-sent request heads (slowloris).

A sandboxed host (tests/integration/capyhost.py, as daemon_scale.py) with one deployment of
daemon_scale.py's instant engine (nginx answering at once: the attack is on the daemon's door, not
on an engine). Two phases in one run:

1. ``--keyed`` clients (from 127.0.0.1, each with the key) send 1-token chat requests in a loop
   for ``--baseline-seconds``: the same clients without the attack;
2. the same clients for ``--attack-seconds`` while an attacker, a process of its own on a
   loopback address of its own (``--attacker-address``, 127.0.0.2) with its open-files limit
   raised, opens up to ``--connections`` connections to the proxy, at most ``--connect-rate`` a
   second, sends a request line on each and then one byte of the head a second, never its end.
   A connection the server closes is opened again (within the same rate), so that the attacker
   holds as many as the server lets it.

Keyed requests go on a new connection each (``--keepalive`` reuses them), as a client that opens
one per request does: a door that lets no new connection in is then felt. Reported: the keyed
requests answered and failed (by status and code, or the exception) and their p50/p99 in each
phase; of the attacker's connections, how many were accepted, refused (TCP, or answered, with the
status and code), closed by the server without an answer, and when (seconds from their opening,
against the head deadline, ``--head-deadline``, 10 s unless the daemon was configured otherwise
through ``--config``); the daemon's open descriptors at their peak and its limit; and the
deployment's state after (an attack on the door must not mark the engine unreachable).

Needs root (the sandbox) and nginx (scripts/bench unpacks Debian's package).
Run: .venv/bin/python benchmarks/hostile_heads.py [--connections 5000] [--attack-seconds 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _sandbox_daemon import (Report, Watch, deploy_all, deployment_states, host_pid, open_files_limit,  # noqa: E402
                             raise_open_files)
from bench_summary import p99  # noqa: E402

# The head the attacker starts and never ends: a request line at once, then a byte a second.
REQUEST_LINE = b"POST /v1/chat/completions HTTP/1.1\r\n"
TRICKLE = b"Host: 127.0.0.1\r\nContent-Type: application/json\r\nX-Slow: "


# ---------------------------------------------------------------- the attacker (its own process)

@dataclass(eq=False)  # (held in a set: by identity)
class Held:
    """One connection of the attacker's: when it opened, what the server answered, when it closed it."""

    sock: socket.socket
    opened: float
    sent: int = 0
    answer: bytes = b""
    closed: float | None = None


def answer_label(answer: bytes) -> str:
    """``<status> <code>`` of an HTTP answer the server sent before closing (the code from an
    OpenAI-shaped error body when there is one), or ``<status>``; ``unparsed`` otherwise."""
    head, _, body = answer.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return "unparsed"
    label = parts[1].decode()
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return label
    return f"{label} {code}"


def next_byte(sent: int) -> bytes:
    """The byte of the trickled head after ``sent`` of them: the headers above, then the value
    of the last one, growing a byte at a time."""
    return TRICKLE[sent:sent + 1] if sent < len(TRICKLE) else b"a"


class Attacker:
    def __init__(self, target: tuple[str, int], source: str, connections: int, rate: float,
                 connect_timeout: float = 5.0) -> None:
        self.target, self.source = target, source
        self.connections, self.rate, self.connect_timeout = connections, rate, connect_timeout
        self.held: list[Held] = []  # every connection accepted, open or closed
        self.open: set[Held] = set()
        self.connecting = 0
        self.attempts = 0
        self.connect_failed: dict[str, int] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    async def run(self, seconds: float) -> dict[str, object]:
        self.loop = asyncio.get_running_loop()
        started = time.monotonic()
        end = started + seconds
        next_trickle = started + 1.0
        tasks: set[asyncio.Task] = set()
        while (now := time.monotonic()) < end:
            # Open (or open again) up to the target, at most `rate` connections a second overall.
            allowed = int(self.rate * (now - started)) - self.attempts
            room = self.connections - len(self.open) - self.connecting
            for _ in range(max(0, min(allowed, room))):
                self.attempts += 1  # counted now: the task runs only at the loop's next turn
                self.connecting += 1
                task = asyncio.ensure_future(self._open())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if now >= next_trickle:
                self._trickle()
                next_trickle += 1.0
            await asyncio.sleep(0.01)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return self.report(end)

    async def _open(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((self.source, 0))
            await asyncio.wait_for(self.loop.sock_connect(sock, self.target), self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            why = "timeout" if isinstance(exc, asyncio.TimeoutError) else errno.errorcode.get(exc.errno, str(exc.errno))
            self.connect_failed[why] = self.connect_failed.get(why, 0) + 1
            return
        except asyncio.CancelledError:
            sock.close()
            raise
        finally:
            self.connecting -= 1
        held = Held(sock, time.monotonic())
        self.held.append(held)
        self.open.add(held)
        self.loop.add_reader(sock.fileno(), self._readable, held)
        try:
            sock.send(REQUEST_LINE)
        except BlockingIOError:
            pass
        except OSError:
            self._closed(held)

    def _readable(self, held: Held) -> None:
        try:
            data = held.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            held.answer += data
        else:
            self._closed(held)

    def _closed(self, held: Held) -> None:
        if held.closed is not None:
            return
        held.closed = time.monotonic()
        self.open.discard(held)
        self.loop.remove_reader(held.sock.fileno())
        held.sock.close()

    def _trickle(self) -> None:
        for held in list(self.open):
            try:
                if held.sock.send(next_byte(held.sent)) == 1:
                    held.sent += 1
            except BlockingIOError:
                pass
            except OSError:
                self._closed(held)

    def report(self, end: float) -> dict[str, object]:
        answered: dict[str, int] = {}
        for held in self.held:
            if held.answer:
                label = answer_label(held.answer)
                answered[label] = answered.get(label, 0) + 1
        closed = [h for h in self.held if h.closed is not None]
        figures = {
            "address": self.source, "target_connections": self.connections, "attempts": self.attempts,
            "connected": len(self.held), "connect_failed": self.connect_failed, "answered": answered,
            "closed_silently": sum(1 for h in closed if not h.answer),
            "closed_after_s": [round(h.closed - h.opened, 3) for h in closed],
            # For each accepted connection: how long the server let it live (to the end, if it still does).
            "lived_s": [round((h.closed if h.closed is not None else end) - h.opened, 3) for h in self.held],
            "still_open": [h.closed is None for h in self.held],
            "open_at_end": len(self.open),
        }
        for held in list(self.open):
            self._closed(held)
        return figures


def held_figures(attacker: dict, deadline: float, slack: float) -> dict[str, object]:
    """What the attacker's connections say of the head deadline: how many outlived it (lived
    longer than ``deadline + slack`` seconds, closed then or still open at the end) and how many
    the server closed within it."""
    lived, still_open = attacker.get("lived_s") or [], attacker.get("still_open") or []
    bound = deadline + slack
    return {"outlived_deadline": sum(1 for t in lived if t > bound),
            "closed_within_deadline": sum(1 for t, o in zip(lived, still_open) if not o and t <= bound),
            "longest_lived_s": max(lived, default=None)}


def run_attacker(args: argparse.Namespace) -> None:
    """The attacker's process: attack, then write what it saw as JSON to ``--attacker-out``."""
    raise_open_files()
    attacker = Attacker(("127.0.0.1", args.port), args.attacker_address, args.connections, args.connect_rate)
    figures = asyncio.run(attacker.run(args.attack_seconds))
    args.attacker_out.write_text(json.dumps(figures))


# ---------------------------------------------------------------- the keyed clients

async def keyed_clients(url: str, key: str, model: str, clients: int, seconds: float, *, keepalive: bool,
                        timeout: float) -> dict[str, object]:
    """``clients`` loops of 1-token chat requests for ``seconds``: latencies of the answered ones,
    failures by status and code or exception."""
    latencies: list[float] = []
    failed: dict[str, int] = {}
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {key}"}
    end = time.monotonic() + seconds

    async def client() -> None:
        connector = aiohttp.TCPConnector(limit=1, force_close=not keepalive)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            while time.monotonic() < end:
                started = time.perf_counter()
                why = None
                try:
                    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                        answer = await r.read()
                        if r.status != 200:
                            why = answer_label(b"HTTP/1.1 %d x\r\n\r\n" % r.status + answer)
                except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
                    why = type(exc).__name__
                if why is None:
                    latencies.append(time.perf_counter() - started)
                else:
                    failed[why] = failed.get(why, 0) + 1
                    await asyncio.sleep(0.05)  # a refused client does not spin

    await asyncio.gather(*(client() for _ in range(clients)))
    return {"requests": len(latencies) + sum(failed.values()), "answered": len(latencies),
            "failed": sum(failed.values()), "failed_by": failed,
            "p50_s": statistics.median(latencies) if latencies else None,
            "p99_s": p99(latencies) if latencies else None, "latency_s": latencies}


# ---------------------------------------------------------------- the run

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=5000, help="half heads the attacker holds at most")
    parser.add_argument("--connect-rate", type=float, default=500.0, help="the attacker's connections a second")
    parser.add_argument("--attacker-address", default="127.0.0.2")
    parser.add_argument("--keyed", type=int, default=8, help="keyed clients")
    parser.add_argument("--keepalive", action="store_true", help="keyed clients reuse their connection")
    parser.add_argument("--baseline-seconds", type=float, default=15.0)
    parser.add_argument("--attack-seconds", type=float, default=30.0)
    parser.add_argument("--request-timeout", type=float, default=15.0, help="the most a keyed request may take")
    parser.add_argument("--head-deadline", type=float, default=10.0,
                        help="the daemon's head deadline the half heads are judged against")
    parser.add_argument("--deadline-slack", type=float, default=2.0,
                        help="seconds past the deadline still counted within it (the trickle's and the "
                             "deadline's own granularity)")
    parser.add_argument("--config", type=Path, help="a daemon configuration file (CAPYCTL_CONFIG), e.g. door limits")
    parser.add_argument("--nginx")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)  # the attacker's process only
    parser.add_argument("--attacker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attacker_out is not None:
        run_attacker(args)
        return
    result: dict[str, object] = {"connections": args.connections, "connect_rate": args.connect_rate,
                                 "keyed_clients": args.keyed, "keepalive": args.keepalive,
                                 "baseline_s": args.baseline_seconds, "attack_s": args.attack_seconds,
                                 "head_deadline_s": args.head_deadline, "deadline_slack_s": args.deadline_slack}
    report = Report("hostile_heads", args.json, result)

    model = report.model_or_end()
    # Here, not above: the attacker's process (this file too) starts sooner without them.
    from daemon_scale import instant_engine
    from proxy_vs_nginx import find_nginx
    from tests.integration.capyhost import CapyHost
    nginx = find_nginx(args.nginx)
    host = CapyHost()
    host.boot()
    try:
        if args.config is not None:
            config = host.root / "config.yaml"
            shutil.copyfile(args.config, config)
            config.chmod(0o644)
            host.env["CAPYCTL_CONFIG"] = str(config)
        host.start_daemon()
        deploy_all(host, instant_engine(host, nginx), "instant", ["instant-0"], model)
        key = host.create_key("--name", "bench")
        pid = host_pid(host)
        if pid is None:
            raise RuntimeError("the daemon's process was not found in its sandbox's cgroup")
        result["open_files_limit"] = open_files_limit(pid)

        def keyed(seconds: float) -> dict[str, object]:
            return asyncio.run(keyed_clients(host.base_url, key, "instant-0", args.keyed, seconds,
                                             keepalive=args.keepalive, timeout=args.request_timeout))

        warm = keyed(1.0)  # the engine's connections made, code paths run once
        if not warm["answered"]:
            raise RuntimeError(f"no keyed request was answered before the attack: {warm['failed_by']}")
        baseline = keyed(args.baseline_seconds)
        out = host.root / "attacker.json"
        watch = Watch(pid, every=0.5).start()
        attacker = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--port", str(host.port), "--attacker-out", str(out),
                                     "--attacker-address", args.attacker_address, "--connections",
                                     str(args.connections), "--connect-rate", str(args.connect_rate),
                                     "--attack-seconds", str(args.attack_seconds)])
        try:
            attack = keyed(args.attack_seconds)
            attacker.wait(timeout=args.attack_seconds + 60)
        finally:
            if attacker.poll() is None:
                attacker.kill()
                attacker.wait()
            watch.stop()
        heads = json.loads(out.read_text())
        heads.update(held_figures(heads, args.head_deadline, args.deadline_slack))
        result.update({"keyed": {"baseline": baseline, "attack": attack}, "attacker": heads,
                       "daemon": {"fds_peak": watch.fds_peak, "rss_peak_bytes": watch.rss_peak},
                       "states_after": deployment_states(host)})
    except Exception as exc:  # noqa: BLE001 - the bench reports why and the run goes on
        report.failed(host, exc)
    finally:
        host.teardown()
    print(render(result))
    report.finish()


def render(result: dict) -> str:
    base, attack = result["keyed"]["baseline"], result["keyed"]["attack"]
    heads = result["attacker"]

    def phase(name: str, p: dict) -> str:
        return (f"{name:16}{p['answered']:>9}{p['failed']:>8}{_ms(p['p50_s']):>11}{_ms(p['p99_s']):>11}  "
                + ", ".join(f"{n} {why}" for why, n in sorted(p["failed_by"].items(), key=lambda kv: -kv[1])))

    lines = [f"{result['keyed_clients']} keyed clients ({'kept-alive' if result['keepalive'] else 'a new connection'} "
             f"each request), {result['baseline_s']:.0f} s alone then {result['attack_s']:.0f} s under attack:",
             f"{'':16}{'answered':>9}{'failed':>8}{'p50':>11}{'p99':>11}",
             phase("without attack", base), phase("under attack", attack)]
    if base["p99_s"] and attack["p99_s"]:
        lines.append(f"p99 under attack / without: {attack['p99_s'] / base['p99_s']:.2f}x")
    closed = heads["closed_after_s"]
    lines += [f"attacker ({heads['address']}, up to {heads['target_connections']} half heads, "
              f"{result['connect_rate']:.0f} connections/s): {heads['attempts']} tried, {heads['connected']} accepted, "
              f"not accepted: {_counts(heads['connect_failed'])}",
              f"  answered before closing: {_counts(heads['answered'])}; closed without an answer: "
              f"{heads['closed_silently']}; open at the end: {heads['open_at_end']}",
              "  closed by the server after (s from opening): "
              + (f"min {min(closed):.1f}, median {statistics.median(closed):.1f}, max {max(closed):.1f}" if closed
                 else "none closed"),
              f"  head deadline {result['head_deadline_s']:.0f} s (+{result['deadline_slack_s']:.0f} s): "
              f"{heads['outlived_deadline']} outlived it, {heads['closed_within_deadline']} closed within it; "
              f"longest lived {heads['longest_lived_s']} s",
              f"daemon: open descriptors at most {result['daemon']['fds_peak']} (limit {result.get('open_files_limit')}), "
              f"RSS at most {result['daemon']['rss_peak_bytes'] / 2**20:.1f} MiB; deployments after: "
              + ", ".join(f"{n} {s}" for n, s in sorted(result["states_after"].items()))]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.2f} ms"


def _counts(by: dict[str, int]) -> str:
    return ", ".join(f"{n} {why}" for why, n in sorted(by.items(), key=lambda kv: -kv[1])) or "none"


if __name__ == "__main__":
    main()
