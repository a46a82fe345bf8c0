"""A deployment's replicas (issue 46) through the real daemon and the real llama-server: prefix
affinity against round robin, a replica killed under load, a revision rolled out under load, and
scaling up and down.

A sandboxed host (systemd as PID 1, the daemon as capytest-daemon.service: tests/integration/
capyhost.py) with the bundled SmolLM2 on llama.cpp. Every engine gets cores of its own where the
host has them (``resources.cpus``: half the host's cores each, 1 on a 2-core machine), so two
engines never compute on the same core. Clients use the official openai client. Four parts, each
on deployments of its own (deleted after it), each runnable alone with ``--parts``:

``affinity``  ``--conversations`` (16) conversations of ``--turns`` (6) turns, ``--concurrency`` (4)
              at a time, sharing one system prompt of some 1,000 tokens, each user turn its own
              (some 70 tokens), answers of ``--max-tokens`` (8) tokens appended to the history.
              Every turn is streamed; its time to first token and the engine's ``timings.cache_n``
              (prompt tokens taken from its cache, passed through by the proxy: llama.cpp's
              tools/server/server-common.cpp, the "timings" object) are kept.
              Prefix affinity: one deployment ``chat`` with ``replicas: 2``, the clients asking
              for ``chat``. Baseline, in the same run: client round robin over two plain
              deployments of the same model and cores, ``rr-a`` and ``rr-b``, through the same
              daemon: each client alternates its requests between them (turn t of conversation c
              goes to rr-a or rr-b by the parity of c + t), so a conversation's next turn always
              reaches the engine that did not serve its last one and finds there only the system
              prompt and its own turn before last. The baseline runs first, its deployments are
              deleted, then ``chat`` runs (never four engines on the cores at once). Before
              either, each engine answers a warm-up request of the system prompt, untimed: rr-a
              and rr-b one each; ``chat``'s replicas through ``chat`` (a replica's name is no
              model), 6 at once, so that the last finds replica 1 past ``affinity_slack`` (4) and
              goes to replica 2 (the JSON says how many each engine answered). Goal: affinity's median
              first token at most 0.5x round robin's; p90 reported beside it.
``kill``      ``killed`` with ``replicas: 2``; ``--kill-plain`` (2) clients send non-streamed
              16-token chats and ``--kill-streams`` (2) clients streamed 64-token chats for
              ``--kill-seconds`` (20); at a third of the window the engine of
              ``capyctl-killed@2.service`` is killed (``kill -9`` of its MainPID, read with
              ``systemctl show -p MainPID``). Goals: no failed non-streamed request; no stream
              cut without an error event (each stream ends with its finish_reason and [DONE], or
              with an error event the client reads as one, never a silent end).
``rollout``   ``rolled`` with ``replicas: 2`` under the same clients; after 3 s the same manifest
              with another ``env`` value is deployed (``capyctl deploy model --file ... --activate
              --wait``); the clients go on until 3 s after it returned. Goal: no failed request
              (streams with an error event or cut count as failed). Each replica's MainPID before
              and after shows the engines were replaced.
``scale``     ``scaled`` with ``replicas: {min: 1, max: 2, scale_up_load: 4, scale_up_after: 2s,
              scale_down_after: 10s}``; ``--scale-clients`` (8) clients send 16-token chats (8 in
              flight or waiting on one replica, past scale_up_load) until ``scaled@2`` has been
              ready 3 s; reported: seconds from the load's start to ``scaled@2`` ready, and from
              the load's end to ``scaled@2`` parked or stopped (the management API read every 0.25 s).

A daemon without replicas fails the part that finds it out, and the run, saying what is missing
(no ``NAME@2`` or no ``replica`` field in GET /v1/deployments, a manifest refused); the JSON keeps
every part's figures or its error. Needs root (the sandbox), llama-server (scripts/setup) and the
SmolLM2 package. On a 2-core machine whose core prefills some 120 tokens a second, the defaults take
well over 10 minutes (a first turn's 1,300 tokens take 10-30 s there); ``--conversations 4 --turns 4
--concurrency 2 --kill-seconds 15 --scale-wait 40 --scale-down-wait 30`` some 6 minutes.

Run: .venv/bin/python benchmarks/replicas.py [--parts affinity,kill,rollout,scale] [--json FILE]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import signal
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_goals as G  # noqa: E402

PARTS = ("affinity", "kill", "rollout", "scale")
RR = ("rr-a", "rr-b")  # the round-robin baseline's deployments
CHAT, KILLED, ROLLED, SCALED = "chat", "killed", "rolled", "scaled"
# With the preamble, some 1,150 tokens of SmolLM2's tokenizer (a digit is a token; kv_park.py: 85 notes ~ 2,000).
SYSTEM_NOTES = 44
LOAD_PROMPT = "Count slowly from one to one hundred, one number a line."
POLL_S = 0.25
# A replica scaled down is parked (or stopped, where its park evicted it from the plan).
PARKED = ("parked", "stopped")
AFFINITY_SLACK = 4
CONTEXT = 8192  # tokens of each engine's KV cache: 4 conversations of 6 turns (~1,800 tokens) at once  # the manifest's replicas.affinity_slack, left at its default
SCALE = {"min": 1, "max": 2, "scale_up_load": 4, "scale_up_after": "2s", "scale_down_after": "10s"}


class FeatureMissing(RuntimeError):
    """The daemon under test has no replicas (issue 46) or lacks a part of them: the run ends here."""


# ---------------------------------------------------------------- pure helpers (tests/unit/test_bench_replicas.py)

def system_prompt(nonce: str, notes: int = SYSTEM_NOTES) -> str:
    """The system prompt every conversation shares: some 1,000 tokens at 44 notes. ``nonce`` first,
    so that nothing another part or phase left in a cache matches it."""
    return (f"Session {nonce}. You are the archivist of the capybara reserve. Answer in one short sentence, "
            "from the records below only.\n" + "\n".join(
                f"Record {i}: the capybara colony at pond {i % 7} moved {i * 3} metres north and counted "
                f"{20 + i % 11} adults." for i in range(notes)))


def user_turn(conversation: int, turn: int) -> str:
    """A user turn no other conversation or turn has, some 70 tokens (over 256 characters: more
    than one of the proxy's prefix blocks)."""
    return (f"Visitor {conversation}, question {turn}: I walked past pond {(conversation + turn) % 7} at "
            f"{6 + turn}:{conversation % 6}0 and saw {conversation * 7 + turn} capybaras resting by the reeds, "
            f"{turn + 2} of them young, and a heron standing still on the far bank for {conversation + turn + 3} "
            "minutes. The water was low and the reeds were dry. Which record mentions that pond first, and how "
            "far did that colony move?")


def round_robin(conversation: int, turn: int, names: Sequence[str] = RR) -> str:
    """Client round robin: each client alternates its requests, so turn ``turn`` of ``conversation``
    goes to the deployment its parity names (the first turns of neighbouring conversations differ)."""
    return names[(conversation + turn) % len(names)]


def p90(values: Sequence[float]) -> float | None:
    values = list(values)
    if not values:
        return None
    # The inclusive method, as bench_summary.p95: never beyond the largest sample.
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) >= 2 else values[0]


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, p90 and count of a list of seconds (None where empty)."""
    values = [v for v in values if v is not None]
    return {"n": len(values), "median": statistics.median(values) if values else None, "p90": p90(values)}


def turns_summary(turns: Iterable[Sequence[Any]]) -> dict[str, Any]:
    """One routing's turns, each ``[conversation, turn, model, ttft_s, cache_n, prompt_tokens, error]``:
    first token over all answered turns and over the follow-up turns (turn 2 on), cache_n, failures."""
    turns = list(turns)
    ok = [t for t in turns if t[6] is None]
    cache = [t[4] for t in ok if t[4] is not None]
    return {"turns": len(turns), "answered": len(ok), "failed": len(turns) - len(ok),
            "failed_by": count_by(t[6] for t in turns if t[6] is not None),
            "ttft_s": spread([t[3] for t in ok]), "follow_up_ttft_s": spread([t[3] for t in ok if t[1] > 1]),
            "cache_n": spread(cache) if cache else None,
            "prompt_tokens": spread([t[5] for t in ok if t[5]]) if any(t[5] for t in ok) else None}


def affinity_figures(affinity: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """Affinity's first token against round robin's: the medians' ratio (the goal's) and the p90s'."""
    def ratio(key: str) -> float | None:
        a, b = affinity["ttft_s"][key], baseline["ttft_s"][key]
        return a / b if a is not None and b else None
    return {"median_ratio": ratio("median"), "p90_ratio": ratio("p90")}


def count_by(keys: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in keys:
        out[key] = out.get(key, 0) + 1
    return out


# A load's requests: [kind, start_s, end_s, outcome, detail]; kind "plain" or "stream"; outcome
# "ok" or "failed" for plain requests, and for streams "done" (finish_reason and [DONE]),
# "error_event" (the stream ended with an error event), "cut" (ended without either, or its
# connection broke) or "refused" (an error status before the stream began).
STREAM_OUTCOMES = ("done", "error_event", "cut", "refused")


def load_summary(records: Iterable[Sequence[Any]], at: float | None = None) -> dict[str, Any]:
    """Counts of a load's requests by kind and outcome (failures by what the client saw). ``at``
    (seconds from the load's start, the kill): the streams in flight then, by outcome."""
    records = list(records)
    plain = [r for r in records if r[0] == "plain"]
    streams = [r for r in records if r[0] == "stream"]
    failed_plain = [r for r in plain if r[3] != "ok"]
    out: dict[str, Any] = {
        "plain": {"requests": len(plain), "answered": len(plain) - len(failed_plain), "failed": len(failed_plain),
                  "failed_by": count_by(str(r[4]) for r in failed_plain)},
        "streams": {"requests": len(streams), **{o: sum(1 for r in streams if r[3] == o) for o in STREAM_OUTCOMES},
                    "not_done_by": count_by(f"{r[3]}: {r[4]}" for r in streams if r[3] != "done")},
    }
    if at is not None:
        during = [r for r in streams if r[1] <= at < r[2]]
        out["streams"]["in_flight_at"] = {"requests": len(during),
                                          **{o: sum(1 for r in during if r[3] == o) for o in STREAM_OUTCOMES}}
    # Every request not answered in full: the rollout's goal.
    out["failed"] = len(failed_plain) + sum(1 for r in streams if r[3] != "done")
    return out


def replica_entries(listing: Sequence[dict[str, Any]], deployment: str) -> dict[int, dict[str, Any]]:
    """The entries of GET /v1/deployments that are ``deployment``'s replicas, by index: those whose
    ``replica`` field names it (the daemon of issue 46), or, in a daemon without that field, its own
    entry and any ``NAME@k``."""
    out: dict[int, dict[str, Any]] = {}
    for entry in listing:
        replica = entry.get("replica")
        if isinstance(replica, dict) and replica.get("deployment") == deployment:
            out[int(replica.get("index", 1))] = entry
        elif replica is None and entry.get("name") == deployment:
            out.setdefault(1, entry)
        elif replica is None and str(entry.get("name", "")).startswith(deployment + "@"):
            index = entry["name"].rsplit("@", 1)[1]
            if index.isdigit():
                out.setdefault(int(index), entry)
    return out


def require_replicas(listing: Sequence[dict[str, Any]], deployment: str, count: int) -> dict[int, dict[str, Any]]:
    """``deployment``'s replicas, at least ``count`` of them listed each with its ``replica`` field;
    else FeatureMissing, saying what the daemon lacks."""
    entries = replica_entries(listing, deployment)
    if not entries:
        raise FeatureMissing(f"GET /v1/deployments lists no {deployment!r}")
    missing_field = sorted(i for i, e in entries.items() if not isinstance(e.get("replica"), dict))
    if missing_field:
        raise FeatureMissing(f"the daemon has no replicas (issue 46): GET /v1/deployments' entry "
                             f"{entries[missing_field[0]].get('name')!r} has no 'replica' field")
    if len(entries) < count:
        names = ", ".join(e.get("name", "?") for e in entries.values())
        raise FeatureMissing(f"the daemon has no replicas (issue 46): {deployment!r} asked for {count} replicas, "
                             f"GET /v1/deployments lists {len(entries)} ({names})")
    return entries


def first_at(samples: Sequence[tuple[float, dict[int, str]]], index: int, states: Iterable[str],
             after: float = float("-inf")) -> float | None:
    """When replica ``index`` was first seen in one of ``states`` at or after ``after``, in the
    samples ``(seconds, {index: state})`` of the poller; None if never."""
    wanted = set(states)
    return next((t for t, by in samples if t >= after and by.get(index) in wanted), None)


def back_ready(samples: Sequence[tuple[float, dict[int, str]]], index: int, after: float) -> float | None:
    """When replica ``index`` was ready again after ``after`` (a kill): its first reading ready
    after one that was not; None if it was never seen down, or never back."""
    down = next((t for t, by in samples if t >= after and by.get(index) != "ready"), None)
    return first_at(samples, index, ("ready",), down) if down is not None else None


def scale_times(samples: Sequence[tuple[float, dict[int, str]]], load_start: float,
                load_end: float | None) -> dict[str, float | None]:
    """Seconds from the load's start to replica 2 ready (``up_s``), and from the load's end (the last
    request answered) to replica 2 parked (``down_s``); None for what was not seen."""
    ready = first_at(samples, 2, ("ready",), load_start)
    parked = first_at(samples, 2, PARKED, load_end) if load_end is not None and ready is not None else None
    return {"up_s": ready - load_start if ready is not None else None,
            "down_s": parked - load_end if parked is not None and load_end is not None else None}


def manifest(name: str, model: str, replicas: Any, cpus: int | None, env: dict[str, str] | None = None,
             context: int | None = CONTEXT) -> str:
    """A deployment of the bundled model on llama.cpp; ``replicas`` a number, a mapping or None (none).
    ``context``: llama-server's ``-c``, shared by its 4 slots (the daemon's default, 4,096, holds
    fewer than 4 of the affinity part's conversations at once: the engine then retries its
    prefill a token at a time, "failed to find free space in the KV cache": llama.cpp's
    tools/server/server-context.cpp; -c is --ctx-size, common/arg.cpp)."""
    text = f"name: {name}\nengine: llama\nmodel: {{path: {model}}}\n"
    if cpus:
        text += f"resources: {{cpus: {cpus}}}\n"
    if isinstance(replicas, dict):
        text += "replicas: {" + ", ".join(f"{k}: {v}" for k, v in replicas.items()) + "}\n"
    elif replicas is not None:
        text += f"replicas: {replicas}\n"
    if context:
        text += f"engine_args: [-c, '{context}']\n"
    if env:
        text += "env: {" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in env.items()) + "}\n"
    return text


def cpus_per_engine(cores: int | None) -> int | None:
    """Cores of its own for each of two engines: half the host's; None (the engine's default) on one core."""
    return cores // 2 if cores and cores >= 2 else None


def replica_unit(deployment: str, index: int) -> str:
    return f"capyctl-{deployment}.service" if index == 1 else f"capyctl-{deployment}@{index}.service"


# ---------------------------------------------------------------- the daemon's side

class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def api_get(api_socket: Path, route: str, timeout: float = 30) -> Any:
    """GET a route of the management API (its unix socket, as the CLI reaches it)."""
    conn = _UnixHTTP(str(api_socket), timeout)
    try:
        conn.request("GET", route)
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status >= 400:
        raise RuntimeError(f"GET {route} answered {response.status}: {body[:300]!r}")
    return json.loads(body)


def listing(host: Any) -> list[dict[str, Any]]:
    return api_get(host.api_socket, "/v1/deployments")


def wait_ready(host: Any, deployment: str, count: int, timeout: float = 180) -> dict[int, dict[str, Any]]:
    """Until ``count`` replicas of ``deployment`` are ready (FeatureMissing at once where the daemon
    lists none as a replica)."""
    deadline = time.monotonic() + timeout
    while True:
        entries = require_replicas(listing(host), deployment, 1)
        ready = {i: e for i, e in entries.items() if e.get("state") == "ready"}
        if len(ready) >= count:
            return entries
        if time.monotonic() > deadline:
            states = {e.get("name"): e.get("state") for e in entries.values()}
            if len(entries) < count:
                require_replicas(listing(host), deployment, count)  # says what is missing
            raise RuntimeError(f"{deployment}: {count} replicas not ready after {timeout:.0f} s: {states}")
        time.sleep(POLL_S)


def answered_by(host: Any, unit: str) -> int:
    """Requests ``unit``'s llama-server answered so far: its journal's "print_timing: ... total time"
    lines (one a request; the slot's print_timings, llama.cpp's tools/server/server-context.cpp,
    writes 4 lines each, its name cut to "print_timing" by the log's column)."""
    out = host.sh("journalctl", "-u", unit, "--no-pager", "-o", "cat", check=False).stdout
    return sum(1 for line in out.splitlines() if "print_timing" in line and "total time" in line)


def main_pid(host: Any, unit: str) -> int | None:
    out = host.sh("systemctl", "show", "-p", "MainPID", unit, check=False).stdout.strip()  # "MainPID=1234"
    value = out.partition("=")[2]
    return int(value) if value.isdigit() and int(value) > 0 else None


class Poller:
    """Reads GET /v1/deployments every POLL_S in a thread: ``(seconds since t0, {index: state})`` of
    one deployment's replicas, and the most load (in_flight + waiting) seen on its ready ones."""

    def __init__(self, host: Any, deployment: str, t0: float) -> None:
        self.host, self.deployment, self.t0 = host, deployment, t0
        self.samples: list[tuple[float, dict[int, str]]] = []
        self.over: list[tuple[float, float]] = []  # (seconds, load per ready replica)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Poller":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                entries = replica_entries(listing(self.host), self.deployment)
                now = time.monotonic() - self.t0
                self.samples.append((now, {i: str(e.get("state")) for i, e in entries.items()}))
                ready = [e for e in entries.values() if e.get("state") == "ready"]
                if ready:
                    self.over.append((now, sum(int(e.get("in_flight") or 0) + int(e.get("waiting") or 0)
                                               for e in ready) / len(ready)))
            except Exception:  # noqa: BLE001 - a missed reading; the next one counts
                self.errors += 1
            self._stop.wait(POLL_S)

    def stop(self) -> "Poller":
        self._stop.set()
        self._thread.join(timeout=10)
        return self


# ---------------------------------------------------------------- clients (the official openai client)

def openai_client(host: Any, key: str, timeout: float = 300) -> Any:
    import openai
    return openai.OpenAI(base_url=host.base_url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def _status(exc: Exception) -> str:
    code = getattr(exc, "code", None)
    status = getattr(exc, "status_code", None)
    return f"{status} {code or ''}".strip() if status else type(exc).__name__


def _timings(obj: Any) -> dict[str, Any]:
    timings = getattr(obj, "timings", None)
    if timings is None and getattr(obj, "model_extra", None):
        timings = obj.model_extra.get("timings")
    return timings if isinstance(timings, dict) else {}


def streamed_turn(client: Any, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int | None, int]:
    """A streamed chat: seconds to its first token, its text, ``timings.cache_n`` and prompt tokens."""
    started = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    ttft, text, cache_n, prompt_tokens = None, "", None, 0
    for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if choice is not None and choice.delta.content:
            text += choice.delta.content
        if ttft is None and choice is not None and (choice.delta.content or choice.finish_reason):
            ttft = time.perf_counter() - started
        if _timings(chunk).get("cache_n") is not None:
            cache_n = int(_timings(chunk)["cache_n"])
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    if ttft is None:
        raise RuntimeError(f"{model}: no token in the answer")
    return ttft, text, cache_n, prompt_tokens


def conversation(client: Any, conversation_id: int, system: str, turns: int, max_tokens: int,
                 pick: Callable[[int, int], str]) -> list[list[Any]]:
    """One conversation's turns, each ``[conversation, turn, model, ttft_s, cache_n, prompt_tokens, error]``."""
    messages = [{"role": "system", "content": system}]
    out = []
    for turn in range(1, turns + 1):
        model = pick(conversation_id, turn)
        messages.append({"role": "user", "content": user_turn(conversation_id, turn)})
        try:
            ttft, text, cache_n, prompt_tokens = streamed_turn(client, model, messages, max_tokens)
            out.append([conversation_id, turn, model, ttft, cache_n, prompt_tokens, None])
        except Exception as exc:  # noqa: BLE001 - a failed turn is counted; the conversation goes on
            text = "I do not know."
            out.append([conversation_id, turn, model, None, None, None, _status(exc)])
        messages.append({"role": "assistant", "content": text})
    return out


def plain_request(client: Any, model: str, max_tokens: int) -> tuple[str, str]:
    try:
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": LOAD_PROMPT}],
                                                max_tokens=max_tokens, temperature=0)
        return ("ok", "") if answer.choices else ("failed", "no choices")
    except Exception as exc:  # noqa: BLE001 - every failure is counted by what the client saw
        return "failed", _status(exc)


def stream_request(client: Any, model: str, max_tokens: int) -> tuple[str, str]:
    """A streamed chat's outcome (STREAM_OUTCOMES) and what the client saw."""
    import openai
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": LOAD_PROMPT}],
                                                max_tokens=max_tokens, temperature=0, stream=True)
    except Exception as exc:  # noqa: BLE001
        return "refused", _status(exc)
    finished = False
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finished = True
    except openai.APIConnectionError as exc:  # the connection broke (APITimeoutError is one)
        return "cut", type(exc).__name__
    except openai.APIError as exc:  # an error event in the stream
        return "error_event", str(getattr(exc, "code", None) or exc.message)[:80]
    except Exception as exc:  # noqa: BLE001
        return "cut", type(exc).__name__
    return ("done", "") if finished else ("cut", "ended without finish_reason or error event")


def run_load(make_client: Callable[[], Any], model: str, plain: int, streams: int, stop: threading.Event,
             began: float, plain_tokens: int = 16,
             stream_tokens: int = 64) -> tuple[list[list[Any]], list[threading.Thread]]:
    """``plain`` and ``streams`` client threads sending one request after another until ``stop``;
    their records (see STREAM_OUTCOMES) fill the returned list as they come."""
    records: list[list[Any]] = []
    lock = threading.Lock()

    def client(kind: str) -> None:
        c = make_client()
        while not stop.is_set():
            start = time.monotonic() - began
            outcome, detail = (plain_request(c, model, plain_tokens) if kind == "plain"
                               else stream_request(c, model, stream_tokens))
            with lock:
                records.append([kind, start, time.monotonic() - began, outcome, detail])

    threads = [threading.Thread(target=client, args=(kind,), daemon=True)
               for kind in ["plain"] * plain + ["stream"] * streams]
    for t in threads:
        t.start()
    return records, threads


def end_load(stop: threading.Event, threads: Sequence[threading.Thread], timeout: float = 180) -> float:
    """Stop the clients; when the last one's request ended (monotonic)."""
    stop.set()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    return time.monotonic()


# ---------------------------------------------------------------- the parts

class Bench:
    def __init__(self, args: argparse.Namespace, host: Any, model: str) -> None:
        self.args, self.host, self.model = args, host, model
        self.cpus = cpus_per_engine(os.cpu_count())
        self.key = host.create_key("--name", "bench")

    def client(self, timeout: float = 300) -> Any:
        return openai_client(self.host, self.key, timeout)

    def deploy(self, name: str, replicas: Any, env: dict[str, str] | None = None) -> None:
        path = self.host.write_manifest(name, manifest(name, self.model, replicas, self.cpus, env))
        out = self.host.cli("deploy", "model", "--file", str(path), "--activate", "--wait", check=False)
        if out.returncode != 0:
            error = (out.stderr or out.stdout).strip()
            if replicas is not None and "replicas" in error:
                raise FeatureMissing(f"the daemon refused replicas: {error[:300]}")
            raise RuntimeError(f"deploying {name}: {error[:400]}")

    def delete(self, *names: str) -> None:
        for name in names:
            self.host.cli("delete", "deployment", name, check=False)

    # -- affinity -----------------------------------------------------------------------------

    def affinity(self) -> dict[str, Any]:
        a = self.args
        result: dict[str, Any] = {"conversations": a.conversations, "turns": a.turns, "concurrency": a.concurrency,
                                  "max_tokens": a.max_tokens, "cpus_per_engine": self.cpus,
                                  "baseline": "client round robin over two deployments, rr-a and rr-b, through the "
                                              "same daemon (each client alternates its requests)"}
        # The baseline first, on engines of its own; deleted before the replicas start.
        system = system_prompt(f"rr-{secrets.token_hex(4)}")
        try:
            for name in RR:
                self.deploy(name, None)
            self._warm({name: [name] for name in RR}, system)
            result["round_robin"], result["round_robin_wall_s"], rr_turns = self._conversations(
                system, lambda c, t: round_robin(c, t))
        finally:
            self.delete(*RR)
        system = system_prompt(f"chat-{secrets.token_hex(4)}")
        try:
            self.deploy(CHAT, 2)
            wait_ready(self.host, CHAT, 2)
            result["warm_up"] = self._warm_replicas(system)
            result["affinity"], result["affinity_wall_s"], aff_turns = self._conversations(
                system, lambda c, t: CHAT)
        finally:
            self.delete(CHAT)
        result["turns_log"] = {"round_robin": rr_turns, "affinity": aff_turns}
        result.update(affinity_figures(result["affinity"], result["round_robin"]))
        return result

    def _warm(self, targets: dict[str, list[str]], system: str) -> None:
        """One untimed request of the system prompt per engine, all at once."""
        def one(model: str) -> None:
            streamed_turn(self.client(), model, [{"role": "system", "content": system},
                                                 {"role": "user", "content": "Which pond is in record 1?"}], 2)
        models = [m for models in targets.values() for m in models]
        with ThreadPoolExecutor(len(models)) as pool:
            list(pool.map(one, models))

    def _warm_replicas(self, system: str) -> dict[str, Any]:
        """Warm both replicas through ``chat`` (a replica's name is no model: the proxy answers 404).
        The proxy sends a prompt to the replica that served its prefix unless that one has more than
        ``affinity_slack`` (4) requests beyond the other, so AFFINITY_SLACK + 2 warm-ups at once:
        the first ones fill replica 1, the last finds it past the slack and goes to replica 2. Each
        engine's journal says how many it answered; a wave more where replica 2 answered none."""
        units = {i: replica_unit(CHAT, i) for i in (1, 2)}
        before = {i: answered_by(self.host, u) for i, u in units.items()}
        waves = 0
        while waves < 3:
            waves += 1
            self._warm({"chat": [CHAT] * (AFFINITY_SLACK + 2)}, system)
            if answered_by(self.host, units[2]) > before[2]:
                break
        counts = {units[i]: answered_by(self.host, units[i]) - before[i] for i in units}
        return {"how": f"{AFFINITY_SLACK + 2} warm-ups at once through {CHAT} ({CHAT}@2 is no model name)",
                "waves": waves, "answered_by": counts, "both": all(counts.values())}

    def _conversations(self, system: str, pick: Callable[[int, int], str]) -> tuple[dict[str, Any], float, list]:
        a = self.args
        began = time.monotonic()
        with ThreadPoolExecutor(a.concurrency) as pool:
            runs = list(pool.map(lambda c: conversation(self.client(), c, system, a.turns, a.max_tokens, pick),
                                 range(a.conversations)))
        wall = time.monotonic() - began
        turns = [t for run in runs for t in run]
        summary = turns_summary(turns)
        ttft = summary["ttft_s"]
        print(f"  {len({t[2] for t in turns})} model(s): {summary['answered']} turns answered, first token median "
              f"{_ms(ttft['median'])}, p90 {_ms(ttft['p90'])}, cache_n median "
              f"{(summary['cache_n'] or {}).get('median')}, {wall:.0f} s", flush=True)
        return summary, wall, turns

    # -- kill ---------------------------------------------------------------------------------

    def kill(self) -> dict[str, Any]:
        a = self.args
        result: dict[str, Any] = {"seconds": a.kill_seconds, "plain_clients": a.kill_plain,
                                  "stream_clients": a.kill_streams}
        try:
            self.deploy(KILLED, 2)
            wait_ready(self.host, KILLED, 2)
            unit = replica_unit(KILLED, 2)
            stop, began = threading.Event(), time.monotonic()
            records, threads = run_load(lambda: self.client(120), KILLED, a.kill_plain, a.kill_streams, stop, began)
            time.sleep(a.kill_seconds / 3)
            pid = main_pid(self.host, unit)
            if pid is None:
                end_load(stop, threads)
                raise FeatureMissing(f"{unit} has no MainPID: the daemon started no second replica as that unit")
            killed_at = time.monotonic() - began
            self.host.sh("kill", "-9", str(pid))
            poller = Poller(self.host, KILLED, began).start()
            time.sleep(max(0.0, a.kill_seconds - (time.monotonic() - began)))
            end_load(stop, threads)
            poller.stop()
            back = back_ready(poller.samples, 2, killed_at)
            result.update({"unit": unit, "killed_pid": pid, "killed_at_s": killed_at,
                           "back_ready_after_s": back - killed_at if back is not None else None,
                           "states_after": {i: e.get("state") for i, e in
                                            replica_entries(listing(self.host), KILLED).items()},
                           **load_summary(records, killed_at), "records": records})
        finally:
            self.delete(KILLED)
        return result

    # -- rollout ------------------------------------------------------------------------------

    def rollout(self) -> dict[str, Any]:
        a = self.args
        result: dict[str, Any] = {"plain_clients": a.kill_plain, "stream_clients": a.kill_streams}
        try:
            self.deploy(ROLLED, 2, {"BENCH_REVISION": "1"})
            wait_ready(self.host, ROLLED, 2)
            pids_before = {i: main_pid(self.host, replica_unit(ROLLED, i)) for i in (1, 2)}
            stop, began = threading.Event(), time.monotonic()
            records, threads = run_load(lambda: self.client(120), ROLLED, a.kill_plain, a.kill_streams, stop, began)
            time.sleep(3)
            deploy_at = time.monotonic() - began
            error = None
            try:
                self.deploy(ROLLED, 2, {"BENCH_REVISION": "2"})
            except Exception as exc:  # noqa: BLE001 - reported with the load's figures
                error = f"{type(exc).__name__}: {str(exc)[:300]}"
            deployed_at = time.monotonic() - began
            time.sleep(3)
            end_load(stop, threads)
            pids_after = {i: main_pid(self.host, replica_unit(ROLLED, i)) for i in (1, 2)}
            result.update({"deploy_at_s": deploy_at, "deploy_s": deployed_at - deploy_at, "deploy_error": error,
                           "pids_before": pids_before, "pids_after": pids_after,
                           "replaced": all(pids_after[i] and pids_after[i] != pids_before[i] for i in (1, 2)),
                           "seconds": time.monotonic() - began, **load_summary(records), "records": records})
            if error:
                result["error"] = f"the new revision's deploy failed: {error}"
        finally:
            self.delete(ROLLED)
        return result

    # -- scale --------------------------------------------------------------------------------

    def scale(self) -> dict[str, Any]:
        a = self.args
        result: dict[str, Any] = {"clients": a.scale_clients, "replicas": SCALE}
        try:
            self.deploy(SCALED, SCALE)
            wait_ready(self.host, SCALED, 1)
            stop, began = threading.Event(), time.monotonic()
            poller = Poller(self.host, SCALED, began).start()
            records, threads = run_load(lambda: self.client(120), SCALED, a.scale_clients, 0, stop, began)
            deadline = began + a.scale_wait
            while time.monotonic() < deadline and first_at(poller.samples, 2, ("ready",)) is None:
                time.sleep(POLL_S)
            up = first_at(poller.samples, 2, ("ready",))
            if up is not None:
                time.sleep(3)  # both serving a while
            load_end = end_load(stop, threads) - began
            parked_by = time.monotonic() + a.scale_down_wait
            while up is not None and time.monotonic() < parked_by \
                    and first_at(poller.samples, 2, PARKED, load_end) is None:
                time.sleep(POLL_S)
            poller.stop()
            over = next((t for t, per in poller.over if per > SCALE["scale_up_load"]), None)
            result.update({"load_end_s": load_end, "over_load_at_s": over, **scale_times(poller.samples, 0.0, load_end),
                           "states_seen": sorted({s for _, by in poller.samples for s in [by.get(2)] if s}),
                           "samples": poller.samples, **load_summary(records)})
            if up is None:
                result["error"] = (f"{SCALED}@2 was not ready within {a.scale_wait:.0f} s of load past scale_up_load "
                                   f"(states seen: {result['states_seen'] or 'none listed'})")
            elif result["down_s"] is None:
                result["error"] = f"{SCALED}@2 did not park within {a.scale_down_wait:.0f} s of the load's end"
        finally:
            self.delete(SCALED)
        return result


# ---------------------------------------------------------------- printout, main

def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f} ms"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} s"


def render(result: dict[str, Any]) -> str:
    lines = [f"replicas (issue 46): {result.get('cpus')} cpus, llama-server and SmolLM2 135M"]
    parts = result.get("parts") or {}
    for name, r in parts.items():
        if r.get("error") and (name != "rollout" or "plain" not in r):
            lines.append(f"{name}: error: {r['error'].splitlines()[0]}")
            continue
        if name == "affinity":
            for side in ("round_robin", "affinity"):
                s = r[side]
                lines.append(f"  {side:12} first token median {_ms(s['ttft_s']['median'])}, p90 "
                             f"{_ms(s['ttft_s']['p90'])} (follow-up turns {_ms(s['follow_up_ttft_s']['median'])}); "
                             f"cache_n median {(s['cache_n'] or {}).get('median', 'n/a')}; {s['failed']} of "
                             f"{s['turns']} failed")
            ratio = r.get("median_ratio")
            lines.append(f"affinity: median first token {ratio:.2f}x round robin (goal "
                         f"{G.REPLICA_AFFINITY_TTFT.shown}), p90 {r.get('p90_ratio') or 0:.2f}x"
                         if ratio is not None else "affinity: no ratio")
        elif name in ("kill", "rollout"):
            p, st = r["plain"], r["streams"]
            head = (f"kill: replica 2 killed at {_s(r['killed_at_s'])}, back ready after {_s(r['back_ready_after_s'])}"
                    if name == "kill" else f"rollout: deploy took {_s(r.get('deploy_s'))}, engines replaced "
                                           f"{r.get('replaced')}" + (f", {r['error']}" if r.get("error") else ""))
            lines.append(f"{head}; plain {p['failed']} failed of {p['requests']} {p['failed_by'] or ''}; streams "
                         + ", ".join(f"{st[o]} {o}" for o in STREAM_OUTCOMES) + f" of {st['requests']}"
                         + (f" (in flight at the kill: {st['in_flight_at']})" if "in_flight_at" in st else ""))
        elif name == "scale":
            lines.append(f"scale: second replica ready {_s(r.get('up_s'))} after the load began (load past "
                         f"scale_up_load seen at {_s(r.get('over_load_at_s'))}), parked {_s(r.get('down_s'))} "
                         f"after it ended")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4, help="conversations at a time")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens of each answer in a conversation")
    parser.add_argument("--kill-seconds", type=float, default=20.0)
    parser.add_argument("--kill-plain", type=int, default=2, help="non-streamed clients (kill, rollout)")
    parser.add_argument("--kill-streams", type=int, default=2, help="streamed clients (kill, rollout)")
    parser.add_argument("--scale-clients", type=int, default=8)
    parser.add_argument("--scale-wait", type=float, default=45.0, help="most seconds of load for the second replica")
    parser.add_argument("--scale-down-wait", type=float, default=45.0, help="most seconds for it to park after")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    result: dict[str, Any] = {"cpus": os.cpu_count(), "parts": {},
                              "goals": {"affinity_median_vs_round_robin_at_most": G.REPLICA_AFFINITY_TTFT.bound,
                                        "kill_failed_at_most": G.REPLICA_KILL_FAILED.bound,
                                        "kill_streams_cut_at_most": G.REPLICA_KILL_CUT.bound,
                                        "rollout_failed_at_most": G.REPLICA_ROLLOUT_FAILED.bound}}

    def finish(error: str | None = None) -> int:
        if error:
            result["error"] = error
            print(f"replicas: {error}", file=sys.stderr)
        if args.json:
            args.json.write_text(json.dumps(result))
        return 1 if error else 0

    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        return finish(f"no part {', '.join(unknown)} (there are {', '.join(PARTS)})")
    from tests.integration.capyhost import CapyHost, llama_server_path, smollm2_path
    binary, model = llama_server_path(), smollm2_path()
    if binary is None or model is None:
        return finish("needs llama-server (scripts/setup) and the SmolLM2 package (scripts/setup)")
    if os.geteuid() != 0:
        return finish("needs root: CapyCTL runs in a sandbox with systemd as PID 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # scripts/bench stopped: the host torn down
    host = CapyHost()
    missing = None
    try:
        host.boot()
        host.start_daemon()
        host.cli("engine", "add", binary, "--name", "llama")
        bench = Bench(args, host, model)
        result["cpus_per_engine"] = bench.cpus
        for part in wanted:
            print(f"part {part}", flush=True)
            began = time.monotonic()
            try:
                result["parts"][part] = getattr(bench, part)()
            except FeatureMissing as exc:
                result["parts"][part] = {"error": str(exc)}
                missing = str(exc)
                break
            except Exception as exc:  # noqa: BLE001 - the part says why; the others go on
                tail = host.daemon_journal(30)
                result["parts"][part] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}\n{tail[-1500:]}"}
            result["parts"][part]["wall_s"] = time.monotonic() - began
    except Exception as exc:  # noqa: BLE001
        return finish(f"{type(exc).__name__}: {str(exc)[:400]}")
    finally:
        host.teardown()
    print(render(result))
    if missing:
        return finish(missing)
    failed = [p for p, r in result["parts"].items() if r.get("error")]
    return finish(f"part(s) {', '.join(failed)} failed: " + "; ".join(
        result["parts"][p]["error"].splitlines()[0] for p in failed) if failed else None)


if __name__ == "__main__":
    sys.exit(main())
