"""Several people using two or three models at once on a RAM budget that holds one (issue 31).

Each scenario is a fresh sandboxed host (systemd as PID 1, the real daemon: tests/integration/
capyhost.py) with the real llama-server and the bundled SmolLM2 model, on ``ram_budget: 3GiB``:

- ``big-N`` deployments of the bundled model with ``resources: {ram: 2GiB}``: one fits at a time;
- one small deployment of the same model, ``small``, with ``resources: {ram: 512MiB}`` and
  ``park: never``: resident beside whichever big one runs, never evicted.

Before the clients begin, the big ones are started one after the other (each start evicts the one
before, which parks as it would after a while of use), and the last one and ``small`` answer one
request (a first prompt, outside the window). Then
``--clients`` (8) client tasks each send one 8-token chat request after another (``max_tokens: 8``,
``temperature: 0``, not streamed) for ``--seconds``, alternating between the big models (client i
starts at model i mod N). ``small`` gets no request by default: it holds its room (the budget then
holds one big model, as in the issue) and must stay resident (its evictions and state are kept).
``--light-period 1`` adds a light client asking it once a second (it counts for "no failed
request", not for the big models' shares or the answer counts); see LIGHT_PERIOD_S for why it is
off. A failed request is not retried: the client goes on to its next model, as the issue's
reproduction did.

Scenarios, all in one invocation (``--scenarios`` picks some):

- ``one``: one big model, all 8 clients on it (and the light client): the upper bound;
- ``two-batches``, ``three-batches``: two or three big models, ``swap.order: batches``;
- ``two-arrival``, ``three-arrival``: the same with ``swap.order: arrival`` (requests served in
  arrival order, one swap each time the model changes): the baseline batches are measured against;
- ``two-mixed`` (issue 47): ``two-batches`` with the light client asking ``small`` once a second,
  and each deployment asking for a core of its own (``resources.cpus: 1``), so that the planner
  keeps ``small`` on cores the big ones do not compute on. Before its window, ``small`` answers
  LIGHT_ALONE_REQUESTS requests alone: its latency under the swaps is judged against that (a
  p99 against a p99 from 100 samples a side; under that, as at 10 alone and one a second under
  load, the slowest against the slowest: bench_summary.mixed_rows).

Each multi-model scenario also records its swaps' phases from the daemon's timelines (the "wake
timeline" journal lines, capyctl/controller/_timeline.py) and the engine's own start by hand
(benchmarks/_own_start.py) in the same run, one request and the turn's requests at once.

Per scenario: answered and failed requests (failed by HTTP status and error code), swaps (the
daemon's ``capyctl_wakes`` and ``capyctl_evictions`` of the big models over the window, from
/metrics), each big model's share of the answers, p50 / p99 / max latency of answered requests,
the daemon's wakes (median of the "ready in" lines it logs at the end of each wake) and the
deployments' states after the run (a ``failed`` one is named).
bench_summary.py judges the goals of issue 31: no failed request; each model at least a fifth of
the answers; p99 at most one ``swap.quantum`` plus, for each other model, the one-model run's p99
and one swap (bench_goals.contention_p99_bound); at least half the answers of ``one``.

Needs root (the sandbox), llama-server (scripts/setup) and the SmolLM2 package.
Run: .venv/bin/python benchmarks/contention.py [--seconds 40] [--scenarios one,two-batches,...]
     [--quantum 5s] [--wait-max 30s] [--json FILE]
With ``--json DIR/NAME.json``, each scenario's daemon journal is kept as ``DIR/NAME.SCENARIO.journal``.
``--daemon-src DIR``: run the daemon from another source tree (a folder holding ``capyctl/``, such as
``git archive OLD capyctl | tar -x -C DIR``; not under /tmp, which the sandbox does not share),
to measure code from before a change on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _own_start import engine_own_start  # noqa: E402
from bench_summary import p99  # noqa: E402

RAM_BUDGET = "3GiB"
BIG_RAM = "2GiB"
SMALL_RAM = "512MiB"
SMALL = "small"
LIGHT = "light"  # the light client's name in the records
# No light client by default: on 2 cores, two llama-servers computing at once (each with a thread
# per core) stalled each other's requests for 9-30 s (their own print_timing lines: an 8-token chat
# took 8.7 s on one and 8.9 s on the other), and the one-model run fell from 420 answers in 30 s to
# 60: the CPU's contention, not the swaps this measures. --light-period 1 puts it back.
LIGHT_PERIOD_S = 0.0
PROMPT = "Say hi."
STAGGER_S = 0.05  # between the clients' first requests: see client_start_s


@dataclass(frozen=True)
class Scenario:
    name: str
    models: int  # big deployments
    order: str  # swap.order
    # Mixed load (issue 47): the light client asks the small model once a second while the big ones
    # take turns, and every deployment asks for one core of its own (resources.cpus: 1).
    mixed: bool = False


SCENARIOS = {s.name: s for s in (Scenario("one", 1, "batches"), Scenario("two-batches", 2, "batches"),
                                 Scenario("two-arrival", 2, "arrival"), Scenario("three-batches", 3, "batches"),
                                 Scenario("three-arrival", 3, "arrival"),
                                 Scenario("two-mixed", 2, "batches", mixed=True))}
MIXED_LIGHT_PERIOD_S = 1.0
LIGHT_ALONE_REQUESTS = 10  # the small model's latency alone, before a mixed scenario's window


def big_names(count: int) -> list[str]:
    return [f"big-{i + 1}" for i in range(count)]


# ---------------------------------------------------------------- pure helpers (tests/unit/test_bench_summary.py)

def client_models(client: int, models: Sequence[str], count: int) -> list[str]:
    """The first ``count`` models client ``client`` asks for: starting at ``client mod N``, then each in turn."""
    return [models[(client + k) % len(models)] for k in range(count)]


def summarize(records: Iterable[Sequence[Any]], models: Sequence[str], seconds: float) -> dict[str, Any]:
    """Figures of one scenario from its requests, each ``[client, model, start_s, end_s, status, code]``
    (status 200 answered; anything else failed, ``code`` the error body's code or what the client saw).
    The big models' figures (answers, shares, latency) leave the light client out; failures count
    everyone's, the light client's also on their own."""
    records = list(records)
    main = [r for r in records if r[0] != LIGHT]
    answered = [r for r in main if r[4] == 200]
    failed = [r for r in records if r[4] != 200]
    by_code: dict[str, int] = {}
    for r in failed:
        key = f"{r[4]} {r[5] or ''}".strip()
        by_code[key] = by_code.get(key, 0) + 1
    answers = {m: sum(1 for r in answered if r[1] == m) for m in models}
    latencies = sorted(r[3] - r[2] for r in answered)
    light = [r for r in records if r[0] == LIGHT]
    light_ok = sorted(r[3] - r[2] for r in light if r[4] == 200)
    return {
        "requests": len(main), "answered": len(answered), "failed": len(failed), "failed_by_code": by_code,
        "answers": answers,
        "shares": {m: (n / len(answered) if answered else 0.0) for m, n in answers.items()},
        "min_share": min((n / len(answered) for n in answers.values()), default=0.0) if answered else 0.0,
        "answers_per_s": len(answered) / seconds if seconds else None,
        "p50_s": statistics.median(latencies) if latencies else None,
        "p99_s": p99(latencies) if latencies else None,
        "max_s": max((r[3] - r[2] for r in records), default=None),
        "light": {"requests": len(light), "answered": len(light_ok), "failed": len(light) - len(light_ok),
                  "p50_s": statistics.median(light_ok) if light_ok else None,
                  "p99_s": p99(light_ok) if light_ok else None,
                  "max_s": light_ok[-1] if light_ok else None},
    }


_SAMPLE = re.compile(r'^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$')


def metric_values(text: str, name: str) -> dict[str, float]:
    """Per-deployment values of one metric in a Prometheus text exposition (a counter's ``_total``
    sample counts as its name): {deployment: value}."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or match["name"] not in (name, name + "_total"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
        if "deployment" in labels:
            found[labels["deployment"]] = float(match["value"])
    return found


def delta(before: dict[str, float], after: dict[str, float], names: Iterable[str]) -> int:
    """How much the metric grew over the window, summed over ``names``."""
    return int(round(sum(after.get(n, 0.0) - before.get(n, 0.0) for n in names)))


# "deployment NAME: ready in 0.543s, woken from its park (...)" (controller/_actor.py, _Laps), after
# journalctl -o short-unix's "SECONDS HOST UNIT[PID]: " prefix.
_READY = re.compile(r"^(?P<t>\d+\.\d+) .*deployment (?P<name>\S+): ready in (?P<total>[\d.]+)s, (?P<kind>[^(]+)")


def wakes_in(journal: str, names: Iterable[str], since: float) -> list[dict[str, Any]]:
    """The wakes and starts of ``names`` the daemon logged at or after ``since`` (Unix seconds)."""
    names = set(names)
    found = []
    for line in journal.splitlines():
        match = _READY.match(line)
        if match and match["name"].rstrip(":") in names and float(match["t"]) >= since:
            found.append({"deployment": match["name"].rstrip(":"), "at": float(match["t"]),
                          "seconds": float(match["total"]), "kind": match["kind"].strip().rstrip(",")})
    return found


# ---------------------------------------------------------------- the load

# "deployment NAME: wake timeline {...}" (controller/_actor.py), logged once a wake's first answer
# came (or it left ready without one): its phases, and the parks it evicted (controller/_timeline.py).
_TIMELINE = re.compile(r"^(?P<t>\d+\.\d+) .*deployment (?P<name>\S+): wake timeline (?P<record>\{.*\})\s*$")


def swaps_in(journal: str, names: Iterable[str], since: float) -> list[dict[str, Any]]:
    """The timelines of the wakes of ``names`` after ``since`` that evicted another and answered:
    the swaps of the window."""
    wanted, out = set(names), []
    for line in journal.splitlines():
        match = _TIMELINE.match(line)
        if match and match["name"] in wanted and float(match["t"]) >= since:
            record = json.loads(match["record"])
            if record.get("swap_seconds") is not None:
                out.append({"deployment": match["name"], **record})
    return out


def swap_phases(swaps: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Median seconds of each phase over the swaps: the evicted deployment's park phases
    ("park: ..."), the incoming wake's, and the swap itself (last answer to first answer). A phase
    is the median over the swaps that had it."""
    from capyctl.controller._timeline import phase_seconds
    by_phase: dict[str, list[float]] = {}
    for swap in swaps:
        for evicted in swap.get("evicted") or []:
            for phase, seconds in phase_seconds(evicted).items():
                by_phase.setdefault(f"park: {phase}", []).append(seconds)
        for phase, seconds in phase_seconds(swap).items():
            by_phase.setdefault(phase, []).append(seconds)
        by_phase.setdefault("swap", []).append(float(swap["swap_seconds"]))
    return {phase: statistics.median(values) for phase, values in by_phase.items()}


async def _ask(http: Any, url: str, key: str, model: str) -> tuple[int, str | None]:
    import aiohttp
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0}
    try:
        async with http.post(url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
            raw = await r.read()
            if r.status == 200:
                return 200, None
            try:
                code = (json.loads(raw).get("error") or {}).get("code")
            except (ValueError, AttributeError):
                code = None
            return r.status, code or raw[:60].decode("utf-8", "replace")
    except asyncio.TimeoutError:
        return 0, "client_timeout"
    except aiohttp.ClientError as exc:
        return 0, type(exc).__name__


def client_start_s(client: int, stagger: float) -> float:
    """When client ``client`` sends its first request, in seconds from the start: one after the other.

    Started all at once, the clients raced for the first turn. Client 0's request for a parked model
    closes the resident model's door only once its wake has planned; requests for the resident model
    that reached the daemon before that entered at once. Whether they did decided, in the first
    milliseconds, which of two steady patterns a whole ``arrival`` run kept: every client on one model
    at a time (a swap per batch of eight), or requests alternating model by model (a swap per request,
    as arrival order means). Runs of the same code fell either way, so two runs could not be compared.
    Started ``stagger`` apart (far longer than a plan takes), every run starts the same way.
    """
    return client * stagger


async def load(url: str, key: str, models: Sequence[str], clients: int, seconds: float,
               request_timeout: float, light_period: float = LIGHT_PERIOD_S,
               stagger: float = STAGGER_S) -> tuple[list[list[Any]], float]:
    """The clients for ``seconds``; every request as [client, model, start_s, end_s, status, code]
    (seconds from the start). No request starts after ``seconds``; each ends within ``request_timeout``.
    Client ``i`` starts at ``client_start_s(i, stagger)``.
    The light client asks ``small`` every ``light_period`` seconds (0: no light client)."""
    import aiohttp
    records: list[list[Any]] = []
    began = time.monotonic()
    deadline = began + seconds

    async def client(i: int, http: aiohttp.ClientSession) -> None:
        await asyncio.sleep(client_start_s(i, stagger))
        k = 0
        while time.monotonic() < deadline:
            model = models[(i + k) % len(models)]
            k += 1
            start = time.monotonic()
            status, code = await _ask(http, url, key, model)
            records.append([i, model, start - began, time.monotonic() - began, status, code])

    async def light(http: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            start = time.monotonic()
            status, code = await _ask(http, url, key, SMALL)
            end = time.monotonic()
            records.append([LIGHT, SMALL, start - began, end - began, status, code])
            await asyncio.sleep(max(0.0, min(light_period - (end - start), deadline - time.monotonic())))

    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        tasks = [client(i, http) for i in range(clients)] + ([light(http)] if light_period > 0 else [])
        await asyncio.wait_for(asyncio.gather(*tasks), seconds + request_timeout + 30)
    return records, time.monotonic() - began


# ---------------------------------------------------------------- one scenario on a fresh host

def _config(scenario: Scenario, quantum: str, wait_max: str) -> str:
    return (f"ram_budget: {RAM_BUDGET}\nswap:\n  quantum: {quantum}\n  wait_max: {wait_max}\n"
            f"  order: {scenario.order}\n")


def _manifest(name: str, model: str, ram: str, extra: str = "", cpus: int | None = None) -> str:
    resources = f"{{ram: {ram}" + (f", cpus: {cpus}" if cpus else "") + "}"
    return f"name: {name}\nengine: llama\nmodel:\n  path: {model}\nresources: {resources}\n{extra}"


async def _alone(url: str, key: str, model: str, count: int) -> list[float]:
    """``count`` requests to ``model`` one after another with nothing else running: its latency alone."""
    import aiohttp
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for _ in range(count):
            began = time.monotonic()
            status, code = await _ask(http, url, key, model)
            if status != 200:
                raise RuntimeError(f"a request to {model} alone: {status} {code}")
            out.append(time.monotonic() - began)
    return out


async def _warm(url: str, key: str, models: Sequence[str]) -> None:
    import aiohttp
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for model in models:
            status, code = await _ask(http, url, key, model)
            if status != 200:
                raise RuntimeError(f"warm-up request to {model}: {status} {code}")


def _metrics(url: str, key: str) -> str:
    import urllib.request
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return r.read().decode()


def run_scenario(scenario: Scenario, args: argparse.Namespace, binary: str, model: str) -> dict[str, Any]:
    from tests.integration.capyhost import CapyHost
    host = CapyHost()
    config = host.root / "config.yaml"
    host.env["CAPYCTL_CONFIG"] = str(config)
    if args.daemon_src:
        host.env["PYTHONPATH"] = str(args.daemon_src)
    bigs = big_names(scenario.models)
    result: dict[str, Any] = {"models": bigs, "order": scenario.order}
    try:
        host.boot()
        config.write_text(_config(scenario, args.quantum, args.wait_max))
        host.start_daemon()
        host.cli("engine", "add", binary, "--name", "llama")
        cpus = 1 if scenario.mixed else None
        small = host.write_manifest(SMALL, _manifest(SMALL, model, SMALL_RAM, "park: never\n", cpus))
        host.cli("deploy", "model", "--file", str(small), "--activate", "--wait")
        # Each big one started in turn: starting the next evicts the one before, which parks (its next
        # launch armed), as after a while of use; the last one stays resident.
        for name in bigs:
            path = host.write_manifest(name, _manifest(name, model, BIG_RAM, cpus=cpus))
            host.cli("deploy", "model", "--file", str(path), "--activate", "--wait")
        key = host.create_key("--name", "bench")
        asyncio.run(_warm(host.base_url, key, [bigs[-1], SMALL]))  # a first prompt, outside the window
        light_period = MIXED_LIGHT_PERIOD_S if scenario.mixed else args.light_period
        if scenario.mixed:
            result["light_alone_s"] = asyncio.run(_alone(host.base_url, key, SMALL, LIGHT_ALONE_REQUESTS))
        before = _metrics(host.base_url, key)
        since = time.time()
        records, wall = asyncio.run(load(host.base_url, key, bigs, args.clients, args.seconds,
                                         args.request_timeout, light_period, args.stagger))
        after = _metrics(host.base_url, key)
        journal = host.sh("journalctl", "-u", "capytest-daemon.service", "-u", "capyctl-*.service", "-o",
                          "short-unix", "--no-pager", check=False).stdout  # the engines' own lines too
        states = {d["name"]: [d.get("state"), d.get("reason")] for d in host.cli_json("list", "deployments")}
        if scenario.models > 1 and args.own_start_runs:
            # The engine's own start beside the swaps, in the same run, after the window (the daemon idle).
            launch = host.cli_json("inspect", "deployment", bigs[0])["launch_command"]
            own = engine_own_start(launch, host.root / "own-start", args.own_start_runs, PROMPT, batch=args.clients)
            result["own_start_s"], result["own_start_batch_s"] = own["one"], own["batch"]
    except Exception as exc:  # noqa: BLE001 - the scenario reports why and the run goes on
        tail = host.daemon_journal(30) if host.booted else ""
        result["error"] = f"{type(exc).__name__}: {str(exc)[:400]}" + (f"\n{tail[-1500:]}" if tail else "")
        return result
    finally:
        host.teardown()
    wakes = wakes_in(journal, bigs, since)
    swaps = swaps_in(journal, bigs, since)
    if args.json:  # the daemon's whole journal, to read what it did and when (Unix seconds)
        (args.json.parent / f"{args.json.stem}.{scenario.name}.journal").write_text(journal)
    result.update(summarize(records, bigs, args.seconds))
    result.update({
        "wall_s": wall,
        "wakes": delta(metric_values(before, "capyctl_wakes"), metric_values(after, "capyctl_wakes"), bigs),
        "evictions": delta(metric_values(before, "capyctl_evictions"), metric_values(after, "capyctl_evictions"),
                           bigs),
        "small_evictions": delta(metric_values(before, "capyctl_evictions"),
                                 metric_values(after, "capyctl_evictions"), [SMALL]),
        "wake_s": [w["seconds"] for w in wakes], "wake_kinds": sorted({w["kind"] for w in wakes}),
        "window_start_unix": since, "wake_log": wakes,
        "one_wake_s": statistics.median(w["seconds"] for w in wakes) if wakes else None,
        "states": states, "records": records,
        "swaps": len(swaps), "swap_phases_s": swap_phases(swaps) if swaps else {},
        "swap_s": [float(w["swap_seconds"]) for w in swaps],
        # What a batch took to serve, on average: the window less its swaps, per turn.
        "batch_s": (args.seconds - sum(float(w["swap_seconds"]) for w in swaps)) / len(swaps) if swaps else None,
    })
    return result


def _seconds(text: str) -> float:
    from capyctl.spec._units import parse_duration
    return parse_duration(text)


def render(result: dict[str, Any]) -> str:
    """The printout: one line per scenario."""
    lines = [f"{result['clients']} clients, {result['seconds']:.0f} s a scenario, 8-token chats; budget "
             f"{RAM_BUDGET}, big models {BIG_RAM} each, '{SMALL}' {SMALL_RAM} resident; swap.quantum "
             f"{result['quantum_s']:g} s, wait_max {result['wait_max_s']:g} s",
             f"{'scenario':15}{'answered':>9}{'failed':>8}{'swaps':>6}{'min share':>10}{'p50':>9}{'p99':>9}"
             f"{'max':>9}{'wake':>8}  failed by code; states"]

    def s(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}s"

    for name, r in result["scenarios"].items():
        if r.get("error"):
            lines.append(f"{name:15}error: {r['error'].splitlines()[0]}")
            continue
        bad = {n: st for n, st in r["states"].items() if st[0] == "failed" or (n == SMALL and st[0] != "ready")}
        lines.append(f"{name:15}{r['answered']:>9}{r['failed']:>8}{r['wakes']:>6}{r['min_share']:>10.2f}"
                     f"{s(r['p50_s']):>9}{s(r['p99_s']):>9}{s(r['max_s']):>9}{s(r['one_wake_s']):>8}  "
                     f"{r['failed_by_code'] or '-'}" + (f"; failed: {bad}" if bad else ""))
    lines += phase_table(result)
    return "\n".join(lines)


def phase_table(result: dict[str, Any]) -> list[str]:
    """Each scenario's median swap phases (ms) beside the engine's own start by hand."""
    scenarios = {n: r for n, r in result["scenarios"].items() if r.get("swap_phases_s")}
    if not scenarios:
        return []
    phases: list[str] = []
    for r in scenarios.values():
        phases += [p for p in r["swap_phases_s"] if p not in phases]
    lines = ["", "median of each phase of the swaps (ms; 'park: ' the evicted model's, then the incoming wake's)",
             f"{'phase':32}" + "".join(f"{n:>15}" for n in scenarios)]
    for phase in phases:
        lines.append(f"{phase:32}" + "".join(
            f"{r['swap_phases_s'][phase] * 1000:>15.0f}" if phase in r["swap_phases_s"] else f"{'-':>15}"
            for r in scenarios.values()))
    for key, label in (("own_start_s", "own start, one request"),
                       ("own_start_batch_s", f"own start, {result['clients']} at once")):
        own = {n: statistics.median(r[key]) for n, r in scenarios.items() if r.get(key)}
        lines.append(f"{'engine ' + label:32}" + "".join(
            f"{own[n] * 1000:>15.0f}" if n in own else f"{'n/a':>15}" for n in scenarios))
        lines.append(f"{'swap / ' + label:32}" + "".join(
            f"{r['swap_phases_s']['swap'] / own[n]:>14.2f}x" if n in own else f"{'n/a':>15}"
            for n, r in scenarios.items()))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="how long the clients send, per scenario")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of {', '.join(SCENARIOS)}")
    parser.add_argument("--quantum", default="5s", help="swap.quantum")
    parser.add_argument("--wait-max", default="30s", help="swap.wait_max")
    parser.add_argument("--request-timeout", type=float, help="per request; default wait_max + 60 s")
    parser.add_argument("--light-period", type=float, default=LIGHT_PERIOD_S,
                        help="seconds between the light client's requests to the small model (0: none)")
    parser.add_argument("--stagger", type=float, default=STAGGER_S,
                        help="seconds between the clients' first requests (0: all at once, racing)")
    parser.add_argument("--own-start-runs", type=int, default=3,
                        help="starts of the engine by hand per multi-model scenario (0: none)")
    parser.add_argument("--daemon-src", type=Path, help="run the daemon from this tree (holding capyctl/)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    wanted = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    result: dict[str, Any] = {"seconds": args.seconds, "clients": args.clients, "stagger_s": args.stagger,
                              "scenarios": {}}

    def finish(error: str | None = None) -> None:
        if error:
            result["error"] = error
            print(f"contention: {error}", file=sys.stderr)
        if args.json:
            args.json.write_text(json.dumps(result))
        if error:
            sys.exit(1)

    unknown = [name for name in wanted if name not in SCENARIOS]
    if unknown:
        finish(f"no scenario {', '.join(unknown)} (there are {', '.join(SCENARIOS)})")
    from tests.integration.capyhost import llama_server_path, smollm2_path
    binary, model = llama_server_path(), smollm2_path()
    if binary is None or model is None:
        finish("needs llama-server (scripts/build-llama-server) and the SmolLM2 package (scripts/setup)")
    if os.geteuid() != 0:
        finish("needs root: CapyCTL runs in a sandbox with systemd as PID 1")
    if args.daemon_src and not (args.daemon_src / "capyctl" / "__init__.py").is_file():
        finish(f"--daemon-src {args.daemon_src} holds no capyctl/")
    result["quantum_s"], result["wait_max_s"] = _seconds(args.quantum), _seconds(args.wait_max)
    if args.request_timeout is None:
        args.request_timeout = result["wait_max_s"] + 60
    result["request_timeout_s"] = args.request_timeout
    source = args.daemon_src or HERE.parent
    commit = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result["daemon"] = str(args.daemon_src) if args.daemon_src else commit
    # A SIGTERM (scripts/bench stopped) ends the run through the finally clauses: each host torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for name in wanted:
        print(f"scenario {name}: {SCENARIOS[name].models} big model(s), order {SCENARIOS[name].order}, "
              f"{args.seconds:.0f} s (daemon from {source})", flush=True)
        result["scenarios"][name] = run_scenario(SCENARIOS[name], args, binary, model)
    print(render(result))
    finish()


if __name__ == "__main__":
    main()
