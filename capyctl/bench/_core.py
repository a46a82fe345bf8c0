"""capyctl-bench: performance figures of any OpenAI-compatible endpoint, CapyCTL's first.

Measures time to first token, decode tokens/s, prompt processing tokens/s by prompt length,
concurrent streams (aggregate tokens/s, per-stream time to first token), wake latency of a
parked deployment against a cold start (through CapyCTL's management API or its CLI), and
/v1/systemone latency and decision accuracy on a small labelled suite. With ``--task embed``
it measures an embedding deployment instead: /v1/embeddings latency, inputs/s and prompt
tokens/s by batch size and input length, and wake. Writes report.json and report.md; PNG
charts when matplotlib imports.

This file is standard library only and imports nothing from CapyCTL, so it can be copied and
run anywhere: ``python3 capyctl_bench.py --base-url http://127.0.0.1:8000 --model NAME``.
It is the core of the package ``capyctl.bench``; benchmarks/capyctl_bench.py is generated
from it (``python -m capyctl.bench --write-standalone PATH``) and a test keeps them equal.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

# Version 2 added, keeping every version-1 key:
#   report["task"]: "generate" or "embed" (also in report["config"], with "embedding_batches").
#   report["embeddings"] (task "embed" only): {"dimension": int, "batch_sizes": [int],
#     "input_lengths": [int] (target tokens per input), "points": [{"batch_size": int,
#     "target_tokens": int, "prompt_tokens_per_input": float | None (from usage.prompt_tokens),
#     "latency_s": summary, "inputs_per_s": summary, "prompt_tokens_per_s": summary}]},
#     one point per batch size and input length, batch sizes outermost; summary is summarize()'s.
#   report["wake"]["measures"]: "first_token" (generate: the *_ttft_s keys are times to the first
#     token) or "embedding" (embed: they are times to a whole one-input embeddings answer).
#   report["systemone"], when supported, besides "supported", "latency_s" and "statuses":
#     "accuracy": float | None (correct / questions), "correct": int, "questions": int (asked over
#     all passes, unanswered ones count as wrong), "cases": int, "passes": int, "per_case":
#     [{"name": str, "expected": {question id: answer}, "got": [{question id: answer | None}, one
#     per pass], "correct": int, "asked": int}]; answers in /v1/systemone's own shape.
#   report["interleaved_with"] (only when measured beside other endpoints, run_benchmarks): the
#     other endpoints' base URLs; each repetition went to every endpoint in turn (interleave).
REPORT_VERSION = 2
TASKS = ("generate", "embed")
DEFAULT_EMBEDDING_BATCHES = (1, 4, 16)
# Each input length multiplies the embeddings section by every batch size; three keep it short.
EMBEDDING_MAX_LENGTHS = 3
DEFAULT_PROMPT_LENGTHS = (16, 32, 64, 128, 256, 512)
DEFAULT_CONCURRENCY = (1, 2, 4, 8)
# Words that most tokenizers keep as one token each (with their leading space), so a prompt of
# N words is close to N tokens; the report uses the engine's own prompt_tokens count anyway.
_WORDS = ("river grass water sun tree stone cloud rain wind leaf bird fish lake hill road field "
          "house light night day warm cold green blue red small big old new long short").split()


class BenchError(Exception):
    """A benchmark that cannot go on, with a stable snake_case code and a human sentence."""

    def __init__(self, message: str, *, code: str = "bench_failed") -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


# ---------------------------------------------------------------- the endpoint

@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: ``base_url`` with or without the trailing /v1."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout: float = 300.0

    def _parts(self) -> tuple[str, str, int, str]:
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise BenchError(f"the base URL {self.base_url!r} is not an http(s) URL", code="invalid_base_url")
        prefix = url.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        return url.scheme, url.hostname, url.port or (443 if url.scheme == "https" else 80), prefix

    def connection(self) -> http.client.HTTPConnection:
        scheme, host, port, _ = self._parts()
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        return cls(host, port, timeout=self.timeout)

    def path(self, route: str) -> str:
        return self._parts()[3] + route

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


@dataclass
class StreamResult:
    """One streamed chat completion as the client saw it; times in seconds from sending."""

    ok: bool
    status: int
    ttft: float | None = None  # first chunk with content
    total: float = 0.0
    content_chunks: int = 0
    completion_tokens: int | None = None  # from the usage chunk, when the engine sends one
    prompt_tokens: int | None = None
    done: bool = False  # saw "data: [DONE]"
    error: str | None = None
    text: str = ""
    last_token_at: float | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.content_chunks

    @property
    def decode_tps(self) -> float | None:
        """Tokens per second after the first one (the first one is prompt processing)."""
        if self.ttft is None or self.last_token_at is None or self.tokens < 2:
            return None
        span = self.last_token_at - self.ttft
        return (self.tokens - 1) / span if span > 0 else None


def chat_body(endpoint: Endpoint, prompt: str, max_tokens: int, *, stream: bool,
              ignore_eos: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": endpoint.model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        # llama-server, vLLM and SGLang accept it: every answer is exactly max_tokens long,
        # so runs compare like with like. --no-ignore-eos for servers that refuse it.
        body["ignore_eos"] = True
    return body


def stream_chat(endpoint: Endpoint, prompt: str, max_tokens: int, *, ignore_eos: bool = True,
                body: dict[str, Any] | None = None) -> StreamResult:
    """Send one streaming chat completion and read it to its end."""
    payload = json.dumps(body or chat_body(endpoint, prompt, max_tokens, stream=True,
                                           ignore_eos=ignore_eos)).encode()
    conn = endpoint.connection()
    started = time.perf_counter()
    try:
        conn.request("POST", endpoint.path("/v1/chat/completions"), body=payload, headers=endpoint.headers())
        response = conn.getresponse()
        if response.status != 200:
            text = response.read().decode(errors="replace")
            return StreamResult(ok=False, status=response.status, total=time.perf_counter() - started,
                                error=text[:500])
        result = StreamResult(ok=False, status=200)
        parts: list[str] = []
        while True:
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                result.done = True
                break
            event = json.loads(data)
            if "error" in event:
                result.error = json.dumps(event["error"])[:500]
                continue
            now = time.perf_counter() - started
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content")
                if piece:
                    result.content_chunks += 1
                    parts.append(piece)
                    result.last_token_at = now
                    if result.ttft is None:
                        result.ttft = now
            usage = event.get("usage")
            if usage:
                result.completion_tokens = usage.get("completion_tokens")
                result.prompt_tokens = usage.get("prompt_tokens")
        result.total = time.perf_counter() - started
        result.text = "".join(parts)
        result.ok = result.done and result.error is None and result.ttft is not None
        if not result.done and result.error is None:
            result.error = "the stream ended without data: [DONE]"
        return result
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return StreamResult(ok=False, status=0, total=time.perf_counter() - started,
                            error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def post_json(endpoint: Endpoint, route: str, body: dict[str, Any]) -> tuple[int, Any, float]:
    """Status, parsed answer (None when not JSON) and seconds of one non-streaming request."""
    conn = endpoint.connection()
    started = time.perf_counter()
    try:
        conn.request("POST", endpoint.path(route), body=json.dumps(body).encode(), headers=endpoint.headers())
        response = conn.getresponse()
        raw = response.read()
        seconds = time.perf_counter() - started
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw), seconds
    except ValueError:
        return response.status, None, seconds


def make_prompt(words: int, nonce: str) -> str:
    """A prompt of about ``words`` tokens that starts with ``nonce``, so no prompt cache serves it."""
    rng = random.Random(nonce)
    filler = " ".join(rng.choice(_WORDS) for _ in range(max(words - 4, 1)))
    return f"{nonce}: {filler}"


def _nonce() -> str:
    return f"run{random.getrandbits(40):x}"


# ---------------------------------------------------------------- statistics

def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, p95, min, max and count of the values that exist."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0, "median": None, "p95": None, "min": None, "max": None}
    p95 = statistics.quantiles(xs, n=20, method="inclusive")[-1] if len(xs) >= 2 else xs[0]
    median = statistics.median(xs)
    # Interpolation can round one ulp past the data ((x + x) / 2 > x); keep them within it.
    median, p95 = min(max(median, xs[0]), xs[-1]), min(max(p95, median), xs[-1])
    return {"n": len(xs), "median": median, "p95": p95, "min": xs[0], "max": xs[-1]}


# ---------------------------------------------------------------- controlling CapyCTL

class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._socket_path)
        self.sock = sock


class Control:
    """Parks, stops and reads a deployment through CapyCTL's management API socket or its CLI."""

    def __init__(self, *, api_socket: str | None = None, cli: Sequence[str] | None = None,
                 timeout: float = 600.0) -> None:
        if not api_socket and not cli:
            raise BenchError("give the management API socket or the capyctl command", code="no_control")
        self.api_socket = api_socket
        self.cli = list(cli) if cli else None
        self.timeout = timeout

    def _api(self, method: str, route: str) -> Any:
        conn = _UnixHTTPConnection(self.api_socket or "", self.timeout)
        try:
            conn.request(method, route, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
        except OSError as exc:
            raise BenchError(f"the management API at {self.api_socket} is unreachable: {exc}",
                             code="control_unreachable") from None
        finally:
            conn.close()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = {"raw": raw.decode(errors="replace")[:300]}
        if response.status >= 400:
            raise BenchError(f"{method} {route} answered {response.status}: {json.dumps(answer)[:300]}",
                             code="control_failed")
        return answer

    def _run_cli(self, *args: str) -> str:
        out = subprocess.run([*(self.cli or []), *args], capture_output=True, text=True, timeout=self.timeout)
        if out.returncode != 0:
            raise BenchError(f"{' '.join(self.cli or [])} {' '.join(args)} exited {out.returncode}: "
                             f"{out.stderr.strip()[:300]}", code="control_failed")
        return out.stdout

    def action(self, verb: str, deployment: str) -> None:
        """``park``, ``stop`` or ``wake``; returns when CapyCTL has done it."""
        if self.api_socket:
            self._api("POST", f"/v1/deployments/{urllib.parse.quote(deployment, safe='')}/{verb}")
        else:
            self._run_cli(verb, "deployment", deployment)

    def state(self, deployment: str) -> str:
        if self.api_socket:
            info = self._api("GET", f"/v1/deployments/{urllib.parse.quote(deployment, safe='')}")
        else:
            info = json.loads(self._run_cli("status", "deployment", deployment, "--json"))
        return str(info.get("state"))


# ---------------------------------------------------------------- measurements

@dataclass
class BenchConfig:
    runs: int = 5
    max_tokens: int = 64
    prompt_lengths: tuple[int, ...] = DEFAULT_PROMPT_LENGTHS
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    concurrency_tokens: int = 32
    wake_runs: int = 3
    systemone_runs: int = 10  # at least this many requests: whole passes over SYSTEMONE_SUITE
    ignore_eos: bool = True
    deployment: str | None = None  # for park/stop; the model name when None
    skip: frozenset[str] = field(default_factory=frozenset)  # section names to leave out
    task: str = "generate"  # "embed": an embedding deployment, measured through /v1/embeddings
    embedding_batches: tuple[int, ...] = DEFAULT_EMBEDDING_BATCHES  # inputs per /v1/embeddings request


def _require_ok(result: StreamResult, what: str) -> StreamResult:
    if not result.ok:
        raise BenchError(f"{what} failed (HTTP {result.status}): {result.error}", code="request_failed")
    return result


def interleave(endpoints: Sequence[Endpoint], reps: int, trial: Callable[[Endpoint], Any], *,
               start: int = 0) -> list[list[Any]]:
    """``reps`` trials on each endpoint, each repetition sent to every endpoint in turn, the order
    rotating (A B, B A, A B, ...); the trials' results by endpoint.

    On a machine where other work comes and goes, endpoints measured one after the other see
    different machines: a llama-server with as many threads as cores decoded at 120 tokens/s alone
    and at 2 to 22 beside one busy process (docs/benchmarks.md, "Recipes"). Turn by turn, such a
    load falls on every endpoint alike, so their ratio holds where their figures do not.
    """
    results: list[list[Any]] = [[] for _ in endpoints]
    for i in range(start, start + reps):
        for j in range(len(endpoints)):
            k = (i + j) % len(endpoints)
            results[k].append(trial(endpoints[k]))
    return results


def latency_points(endpoints: Sequence[Endpoint], config: BenchConfig) -> list[dict[str, Any]]:
    """Time to first token and decode tokens/s of single streams, one after another; per endpoint."""
    def trial(endpoint: Endpoint) -> StreamResult:
        return _require_ok(stream_chat(endpoint, make_prompt(32, _nonce()), config.max_tokens,
                                       ignore_eos=config.ignore_eos), "a latency stream")
    return [{"max_tokens": config.max_tokens,
             "ttft_s": summarize([r.ttft for r in results]),
             "decode_tokens_per_s": summarize([r.decode_tps for r in results]),
             "completion_tokens": summarize([r.tokens for r in results])}
            for results in interleave(endpoints, config.runs, trial)]


def measure_latency(endpoint: Endpoint, config: BenchConfig) -> dict[str, Any]:
    """Time to first token and decode tokens/s of single streams, one after another."""
    return latency_points([endpoint], config)[0]


def prompt_sweep_points(endpoints: Sequence[Endpoint], config: BenchConfig) -> list[list[dict[str, Any]]]:
    """Prompt processing speed by length (prompt tokens / time to the first token); per endpoint."""
    points: list[list[dict[str, Any]]] = [[] for _ in endpoints]
    for words in config.prompt_lengths:
        def trial(endpoint: Endpoint) -> StreamResult:
            return _require_ok(stream_chat(endpoint, make_prompt(words, _nonce()), 1, ignore_eos=config.ignore_eos),
                               f"a {words}-word prompt")
        for mine, results in zip(points, interleave(endpoints, max(1, config.runs // 2), trial)):
            rated = [r for r in results if r.prompt_tokens and r.ttft]
            counts = [r.prompt_tokens for r in rated]
            mine.append({"target_tokens": words, "prompt_tokens": statistics.median(counts) if counts else None,
                         "ttft_s": summarize([r.ttft for r in results]),
                         "prompt_tokens_per_s": summarize([r.prompt_tokens / r.ttft for r in rated])})
    return points


def measure_prompt_sweep(endpoint: Endpoint, config: BenchConfig) -> list[dict[str, Any]]:
    """Prompt processing speed by length: prompt tokens / time to the first token."""
    return prompt_sweep_points([endpoint], config)[0]


def run_streams(endpoint: Endpoint, streams: int, max_tokens: int, *, ignore_eos: bool = True,
                prompt_words: int = 16, prompt: str | None = None) -> tuple[list[StreamResult], float]:
    """``streams`` streams at once, each in its own thread; their results and the wall time.

    Each stream gets a prompt of its own unless ``prompt`` is given: one prompt for all lets
    the engine's prompt cache skip prompt processing, so a load test measures the streams.
    """
    prompts = [prompt or make_prompt(prompt_words, _nonce()) for _ in range(streams)]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=streams) as pool:
        results = list(pool.map(lambda p: stream_chat(endpoint, p, max_tokens, ignore_eos=ignore_eos), prompts))
    return results, time.perf_counter() - started


def concurrency_points(endpoints: Sequence[Endpoint], config: BenchConfig) -> list[list[dict[str, Any]]]:
    """Per stream count, one round of that many streams at once; per endpoint."""
    points: list[list[dict[str, Any]]] = [[] for _ in endpoints]
    for n, streams in enumerate(config.concurrency):
        def trial(endpoint: Endpoint) -> tuple[list[StreamResult], float]:
            return run_streams(endpoint, streams, config.concurrency_tokens, ignore_eos=config.ignore_eos)
        for mine, ((results, wall),) in zip(points, interleave(endpoints, 1, trial, start=n)):
            failed = [r for r in results if not r.ok]
            tokens = sum(r.tokens for r in results if r.ok)
            mine.append({"streams": streams, "wall_s": wall, "failed": len(failed),
                         "errors": sorted({r.error or "" for r in failed})[:5],
                         "aggregate_tokens_per_s": tokens / wall if wall > 0 else None,
                         "ttft_s": summarize([r.ttft for r in results if r.ok]),
                         "per_stream_ttft_s": [r.ttft for r in results],
                         "per_stream_decode_tokens_per_s": summarize([r.decode_tps for r in results if r.ok])})
    return points


def measure_concurrency(endpoint: Endpoint, config: BenchConfig) -> list[dict[str, Any]]:
    return concurrency_points([endpoint], config)[0]


def post_embeddings(endpoint: Endpoint, inputs: list[str], what: str) -> tuple[dict[str, Any], float]:
    """One POST /v1/embeddings of ``inputs``: the answer, checked to hold one vector per input, and seconds."""
    try:
        status, answer, took = post_json(endpoint, "/v1/embeddings", {"model": endpoint.model, "input": inputs})
    except (OSError, http.client.HTTPException) as exc:
        raise BenchError(f"{what} failed: {type(exc).__name__}: {exc}", code="request_failed") from None
    if status != 200:
        raise BenchError(f"{what} failed (HTTP {status}): {json.dumps(answer)[:500]}", code="request_failed")
    data = answer.get("data") if isinstance(answer, dict) else None
    if (not isinstance(data, list) or len(data) != len(inputs)
            or not all(isinstance(d, dict) and isinstance(d.get("embedding"), list) and d["embedding"]
                       for d in data)):
        raise BenchError(f"{what} did not answer one vector per input: {json.dumps(answer)[:300]}",
                         code="bad_embeddings")
    return answer, took


def _usage_prompt_tokens(answer: dict[str, Any]) -> int | None:
    usage = answer.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else None


def embeddings_points(endpoints: Sequence[Endpoint], config: BenchConfig) -> list[dict[str, Any]]:
    """Latency, inputs/s and prompt tokens/s of /v1/embeddings by batch size and input length; per endpoint."""
    lengths = list(config.prompt_lengths[:EMBEDDING_MAX_LENGTHS])
    dimensions: list[set[int]] = [set() for _ in endpoints]
    points: list[list[dict[str, Any]]] = [[] for _ in endpoints]
    for batch in config.embedding_batches:
        for words in lengths:
            def trial(endpoint: Endpoint) -> tuple[dict[str, Any], float]:
                # A nonce per input, so no prompt or embedding cache answers a repeated text.
                inputs = [make_prompt(words, _nonce()) for _ in range(batch)]
                return post_embeddings(endpoint, inputs, f"a batch of {batch} {words}-word inputs")
            for i, answers in enumerate(interleave(endpoints, config.runs, trial)):
                seconds, input_rates, token_rates, per_input = [], [], [], []
                for answer, took in answers:
                    dimensions[i].update(len(d["embedding"]) for d in answer["data"])
                    seconds.append(took)
                    input_rates.append(batch / took if took > 0 else None)
                    tokens = _usage_prompt_tokens(answer)
                    if tokens is not None:
                        per_input.append(tokens / batch)
                        token_rates.append(tokens / took if took > 0 else None)
                points[i].append({"batch_size": batch, "target_tokens": words,
                                  "prompt_tokens_per_input": statistics.median(per_input) if per_input else None,
                                  "latency_s": summarize(seconds), "inputs_per_s": summarize(input_rates),
                                  "prompt_tokens_per_s": summarize(token_rates)})
    out = []
    for dims, mine in zip(dimensions, points):
        if len(dims) > 1:
            raise BenchError(f"the vectors have different dimensions: {sorted(dims)}", code="bad_embeddings")
        out.append({"dimension": dims.pop() if dims else None, "batch_sizes": list(config.embedding_batches),
                    "input_lengths": lengths, "points": mine})
    return out


def measure_embeddings(endpoint: Endpoint, config: BenchConfig) -> dict[str, Any]:
    """Latency, inputs/s and prompt tokens/s of /v1/embeddings by batch size and input length."""
    return embeddings_points([endpoint], config)[0]


def _first_answer_after(endpoint: Endpoint, config: BenchConfig, what: str) -> float:
    """Seconds to the first token of a short chat, or for embed to a whole one-input embedding."""
    if config.task == "embed":
        return post_embeddings(endpoint, [make_prompt(16, _nonce())], what)[1]
    r = _require_ok(stream_chat(endpoint, make_prompt(16, _nonce()), 2, ignore_eos=config.ignore_eos), what)
    assert r.ttft is not None
    return r.ttft


def measure_wake(endpoint: Endpoint, control: Control, config: BenchConfig) -> dict[str, Any]:
    """Parked → first answer against stopped → first answer, alternating so drift hits both."""
    deployment = config.deployment or endpoint.model
    warm, parked, cold = [], [], []
    for _ in range(config.wake_runs):
        warm.append(_first_answer_after(endpoint, config, "a warm request"))  # also makes sure it is up
        control.action("park", deployment)
        state = control.state(deployment)
        if state != "parked":
            raise BenchError(f"after park the deployment is {state!r}, not parked", code="park_failed")
        parked.append(_first_answer_after(endpoint, config, "a request to the parked deployment"))
        control.action("stop", deployment)
        cold.append(_first_answer_after(endpoint, config, "a request to the stopped deployment"))
    warm_median = summarize(warm)["median"]
    parked_median, cold_median = summarize(parked)["median"], summarize(cold)["median"]
    # The *_ttft_s names stay for version-1 readers; "measures" says what they time for this task.
    return {"deployment": deployment, "measures": "embedding" if config.task == "embed" else "first_token",
            "warm_ttft_s": summarize(warm), "parked_ttft_s": summarize(parked), "cold_ttft_s": summarize(cold),
            "wake_over_cold": parked_median / cold_median if parked_median and cold_median else None,
            "wake_over_warm": parked_median / warm_median if parked_median and warm_median else None}


# A labelled suite for /v1/systemone: states whose answers a person would not dispute, so a wrong
# answer is the model's. Expected answers are in the route's own answer shape (capyctl/proxy/
# _systemone.py, format_answer): noul {"type": "noul", "noul": P(yes)} (1.0 = yes, 0.0 = no),
# choice {"type": "choice", "choice": label}, score {"type": "score", "score": level index}.
SYSTEMONE_SUITE: tuple[dict[str, Any], ...] = (
    {"name": "refund_request",
     "body": {"state": "The user wrote: 'Please cancel my order and refund me.'",
              "questions": {"refund": {"type": "noul", "instructions": "Does the user ask for a refund?"}}},
     "expected": {"refund": {"type": "noul", "noul": 1.0}}},
    {"name": "happy_customer",
     "body": {"state": "The user wrote: 'Thank you! The package arrived on time and everything works perfectly.'",
              "questions": {"refund": {"type": "noul", "instructions": "Does the user ask for a refund?"},
                            "mood": {"type": "choice", "instructions": "How does the user feel?",
                                     "criteria": {"angry": None, "happy": None, "sad": None}}}},
     "expected": {"refund": {"type": "noul", "noul": 0.0}, "mood": {"type": "choice", "choice": "happy"}}},
    {"name": "angry_customer",
     "body": {"state": "The user wrote: 'This is the third time you sent me the wrong item. I am furious!'",
              "questions": {"mood": {"type": "choice", "instructions": "How does the user feel?",
                                     "criteria": {"angry": None, "happy": None, "sad": None}}}},
     "expected": {"mood": {"type": "choice", "choice": "angry"}}},
    {"name": "opening_hours",
     "body": {"state": "The user wrote: 'What are your opening hours on Sunday?'",
              "questions": {"question": {"type": "noul", "instructions": "Does the user ask a question?"},
                            "topic": {"type": "choice", "instructions": "What is the message about?",
                                      "criteria": {"opening hours": None, "billing": None, "shipping": None}}}},
     "expected": {"question": {"type": "noul", "noul": 1.0},
                  "topic": {"type": "choice", "choice": "opening hours"}}},
    {"name": "language",
     "body": {"state": "The user wrote: 'Bonjour, je voudrais changer mon adresse de livraison.'",
              "questions": {"language": {"type": "choice", "instructions": "Which language is the message in?",
                                         "criteria": {"English": None, "French": None, "German": None}}}},
     "expected": {"language": {"type": "choice", "choice": "French"}}},
    {"name": "arithmetic",
     "body": {"state": "The student wrote: 2 + 2 = 5.",
              "questions": {"correct": {"type": "noul", "instructions": "Is the student's sum correct?"}}},
     "expected": {"correct": {"type": "noul", "noul": 0.0}}},
    {"name": "weather",
     "body": {"state": "The thermometer shows 38 degrees Celsius in the shade and the sun is burning.",
              "questions": {"weather": {"type": "choice", "instructions": "What is the weather like?",
                                        "criteria": {"hot": None, "mild": None, "cold": None}},
                            "freezing": {"type": "noul", "instructions": "Is it freezing?"}}},
     "expected": {"weather": {"type": "choice", "choice": "hot"}, "freezing": {"type": "noul", "noul": 0.0}}},
    {"name": "star_rating",
     "body": {"state": "The user rated the product 5 out of 5 stars.",
              "questions": {"stars": {"type": "score", "instructions": "How many stars did the user give?",
                                      "criteria": ["1 star", "2 stars", "3 stars", "4 stars", "5 stars"]}}},
     "expected": {"stars": {"type": "score", "score": 4}}},
)


def systemone_answer_is_right(expected: dict[str, Any], got: Any) -> bool:
    """Whether an answer of /v1/systemone picks what ``expected`` names.

    noul: on the expected side of 0.5 (exactly 0.5 is no answer); choice: the same label;
    score: the expected level is the nearest one to the answered (expected-value) score.
    """
    if not isinstance(got, dict) or got.get("type") != expected["type"]:
        return False
    kind = expected["type"]
    value = got.get(kind)
    if kind == "choice":
        return bool(value == expected["choice"])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == "noul":
        return value > 0.5 if expected["noul"] >= 0.5 else value < 0.5
    return abs(value - expected[kind]) < 0.5


def measure_systemone(endpoint: Endpoint, config: BenchConfig) -> dict[str, Any]:
    """Latency over every request, and accuracy of the answers to SYSTEMONE_SUITE.

    The suite is asked in passes, as many as make at least ``systemone_runs`` requests.
    """
    passes = max(1, -(-config.systemone_runs // len(SYSTEMONE_SUITE)))
    seconds: list[float] = []
    statuses: dict[int, int] = {}
    per_case: list[dict[str, Any]] = [
        {"name": case["name"], "expected": case["expected"], "got": [], "correct": 0, "asked": 0}
        for case in SYSTEMONE_SUITE]
    for _ in range(passes):
        for case, result in zip(SYSTEMONE_SUITE, per_case):
            status, answer, took = post_json(endpoint, "/v1/systemone", {"model": endpoint.model, **case["body"]})
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200:
                seconds.append(took)
            elif not seconds and status in (400, 404, 501):
                # The endpoint does not serve it for this model: say so once, do not hammer it.
                return {"supported": False, "status": status, "error": answer}
            answers = answer.get("answers") if status == 200 and isinstance(answer, dict) else None
            got = {qid: answers.get(qid) if isinstance(answers, dict) else None for qid in case["expected"]}
            result["got"].append(got)
            result["asked"] += len(got)
            result["correct"] += sum(systemone_answer_is_right(case["expected"][qid], got[qid]) for qid in got)
    correct, questions = sum(r["correct"] for r in per_case), sum(r["asked"] for r in per_case)
    return {"supported": True, "latency_s": summarize(seconds), "statuses": statuses,
            "accuracy": correct / questions if questions else None, "correct": correct, "questions": questions,
            "cases": len(SYSTEMONE_SUITE), "passes": passes, "per_case": per_case}


SECTIONS = ("latency", "prompt_sweep", "concurrency", "wake", "systemone", "embeddings")
# What a task measures; wake, when control is given, runs for both.
_TASK_SECTIONS = {"generate": ("latency", "prompt_sweep", "concurrency", "systemone"), "embed": ("embeddings",)}


def run_benchmark(endpoint: Endpoint, config: BenchConfig, *, control: Control | None = None,
                  log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every section of ``config.task`` not skipped; wake needs ``control``. Returns the report as a dict."""
    return run_benchmarks([endpoint], [config], control=control, log=log)[0]


# The sections whose repetitions run_benchmarks sends to every endpoint in turn (see interleave).
_INTERLEAVED: dict[str, Callable[[Sequence[Endpoint], BenchConfig], list[Any]]] = {
    "latency": latency_points, "prompt_sweep": prompt_sweep_points, "concurrency": concurrency_points,
    "embeddings": embeddings_points}


def run_benchmarks(endpoints: Sequence[Endpoint], configs: Sequence[BenchConfig], *, control: Control | None = None,
                   log: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """A report per endpoint, measured together: each repetition of latency, prompt_sweep,
    concurrency and embeddings goes to every endpoint in turn (``interleave``), so that what else
    the machine does falls on all of them alike. ``configs[i]`` is endpoint i's; they may differ
    only in ``skip`` and ``deployment``. systemone runs on each endpoint that asks for it, one after
    the other; wake only on the first endpoint, with ``control``."""
    if len(endpoints) != len(configs) or not endpoints:
        raise BenchError("give one config per endpoint", code="invalid_config")
    config = configs[0]
    if config.task not in TASKS:
        raise BenchError(f"the task {config.task!r} is not one of {', '.join(TASKS)}", code="invalid_task")
    if any(replace(c, skip=config.skip, deployment=config.deployment) != config for c in configs[1:]):
        raise BenchError("endpoints measured together need the same settings (skip aside)", code="invalid_config")
    reports: list[dict[str, Any]] = [{
        "version": REPORT_VERSION, "task": c.task, "started_at": time.time(), "base_url": e.base_url,
        "model": e.model, "config": {k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in asdict(c).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    } for e, c in zip(endpoints, configs)]
    if len(endpoints) > 1:
        for i, report in enumerate(reports):
            report["interleaved_with"] = [e.base_url for j, e in enumerate(endpoints) if j != i]
    log("warming up")
    for endpoint in endpoints:
        if config.task == "embed":
            post_embeddings(endpoint, ["Hello"], "the warm-up request")
        else:
            _require_ok(stream_chat(endpoint, "Hello", 4, ignore_eos=config.ignore_eos), "the warm-up request")
    for name in _TASK_SECTIONS[config.task]:
        members = [i for i, c in enumerate(configs) if name not in c.skip]
        if not members:
            continue
        log(f"measuring {name}" + (f" on {len(members)} endpoints in turn" if len(members) > 1 else ""))
        if name in _INTERLEAVED:
            figures = _INTERLEAVED[name]([endpoints[i] for i in members], config)
        else:  # systemone: a suite of questions, not repetitions to interleave
            figures = [measure_systemone(endpoints[i], configs[i]) for i in members]
        for i, figure in zip(members, figures):
            reports[i][name] = figure
    if control is not None and "wake" not in configs[0].skip:
        log("measuring wake")
        reports[0]["wake"] = measure_wake(endpoints[0], control, configs[0])
    for report in reports:
        report["finished_at"] = time.time()
    return reports


# ---------------------------------------------------------------- output

def _fmt(value: Any, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value * scale:.{digits}f}{unit}"


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# capyctl-bench: {report['model']} at {report['base_url']}", "",
             f"Machine: {report['machine']['cpus']} CPUs, {report['machine']['platform']}.", ""]
    if "latency" in report:
        lat = report["latency"]
        lines += ["## Single stream", "", "| metric | median | p95 |", "|---|---|---|",
                  f"| time to first token | {_fmt(lat['ttft_s']['median'], ' ms', 1000)} | "
                  f"{_fmt(lat['ttft_s']['p95'], ' ms', 1000)} |",
                  f"| decode tokens/s ({lat['max_tokens']} tokens) | {_fmt(lat['decode_tokens_per_s']['median'])} | "
                  f"{_fmt(lat['decode_tokens_per_s']['p95'])} |", ""]
    if "prompt_sweep" in report:
        lines += ["## Prompt processing by length", "",
                  "| prompt tokens | time to first token (median) | prompt tokens/s (median) |", "|---|---|---|"]
        for p in report["prompt_sweep"]:
            lines.append(f"| {_fmt(p['prompt_tokens'], digits=0)} | {_fmt(p['ttft_s']['median'], ' ms', 1000)} | "
                         f"{_fmt(p['prompt_tokens_per_s']['median'])} |")
        lines.append("")
    if "concurrency" in report:
        lines += ["## Concurrent streams", "",
                  "| streams | aggregate tokens/s | TTFT median | TTFT p95 | failed |", "|---|---|---|---|---|"]
        for p in report["concurrency"]:
            lines.append(f"| {p['streams']} | {_fmt(p['aggregate_tokens_per_s'])} | "
                         f"{_fmt(p['ttft_s']['median'], ' ms', 1000)} | {_fmt(p['ttft_s']['p95'], ' ms', 1000)} | "
                         f"{p['failed']} |")
        lines.append("")
    if "embeddings" in report:
        e = report["embeddings"]
        lines += ["## Embeddings", "", f"Vector dimension: {_fmt(e['dimension'], digits=0)}.", "",
                  "| batch | input tokens | latency median | latency p95 | inputs/s (median) | "
                  "prompt tokens/s (median) |", "|---|---|---|---|---|---|"]
        for p in e["points"]:
            tokens = p["prompt_tokens_per_input"]
            tokens = p["target_tokens"] if tokens is None else tokens  # no usage: the target length
            lines.append(f"| {p['batch_size']} | {_fmt(tokens, digits=0)} | "
                         f"{_fmt(p['latency_s']['median'], ' ms', 1000)} | {_fmt(p['latency_s']['p95'], ' ms', 1000)}"
                         f" | {_fmt(p['inputs_per_s']['median'])} | {_fmt(p['prompt_tokens_per_s']['median'])} |")
        lines.append("")
    if "wake" in report:
        w = report["wake"]
        # A version-1 report has no "measures"; it always timed the first token.
        what = "embedding answer" if w.get("measures") == "embedding" else "first token"
        lines += ["## Wake against cold start", "", f"| from | {what} (median) | p95 |", "|---|---|---|",
                  f"| ready | {_fmt(w['warm_ttft_s']['median'], ' ms', 1000)} | {_fmt(w['warm_ttft_s']['p95'], ' ms', 1000)} |",
                  f"| parked | {_fmt(w['parked_ttft_s']['median'], ' ms', 1000)} | "
                  f"{_fmt(w['parked_ttft_s']['p95'], ' ms', 1000)} |",
                  f"| stopped (cold) | {_fmt(w['cold_ttft_s']['median'], ' ms', 1000)} | "
                  f"{_fmt(w['cold_ttft_s']['p95'], ' ms', 1000)} |", "",
                  f"Wake / cold start: {_fmt(w['wake_over_cold'], digits=3)}.", ""]
    if "systemone" in report:
        s = report["systemone"]
        lines += ["## /v1/systemone", ""]
        if s.get("supported"):
            lines += [f"Latency median {_fmt(s['latency_s']['median'], ' ms', 1000)}, "
                      f"p95 {_fmt(s['latency_s']['p95'], ' ms', 1000)} ({s['latency_s']['n']} requests).", ""]
            if "accuracy" in s:  # version 2
                lines += [f"Accuracy {_fmt(s['accuracy'], '%', 100)}: {s['correct']} of {s['questions']} answers "
                          f"right over {s['cases']} labelled cases ({s['passes']} pass(es)).", "",
                          "| case | right | asked |", "|---|---|---|"]
                lines += [f"| {c['name']} | {c['correct']} | {c['asked']} |" for c in s["per_case"]]
                lines.append("")
        else:
            lines += [f"Not served for this model (HTTP {s.get('status')}).", ""]
    return "\n".join(lines)


def write_charts(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNG charts when matplotlib is importable; an empty list otherwise."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    if report.get("prompt_sweep"):
        xs = [p["prompt_tokens"] or p["target_tokens"] for p in report["prompt_sweep"]]
        ys = [p["prompt_tokens_per_s"]["median"] or 0 for p in report["prompt_sweep"]]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(xs, ys, marker="o")
        ax.set(xscale="log", xlabel="prompt tokens", ylabel="prompt tokens/s", title="Prompt processing")
        written.append(out_dir / "prompt_sweep.png")
        fig.savefig(written[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    if report.get("concurrency"):
        xs = [p["streams"] for p in report["concurrency"]]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(xs, [p["aggregate_tokens_per_s"] or 0 for p in report["concurrency"]], marker="o")
        ax.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="Concurrency")
        written.append(out_dir / "concurrency.png")
        fig.savefig(written[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    if report.get("embeddings") and report["embeddings"]["points"]:
        points = report["embeddings"]["points"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for words in report["embeddings"]["input_lengths"]:
            line = [p for p in points if p["target_tokens"] == words]
            ax.plot([p["batch_size"] for p in line], [p["inputs_per_s"]["median"] or 0 for p in line], marker="o",
                    label=f"{words} tokens per input")
        batches = report["embeddings"]["batch_sizes"]
        ax.set(xscale="log", xlabel="inputs per request (batch size)", ylabel="inputs/s", title="Embeddings")
        ax.set_xticks(batches, labels=[str(b) for b in batches])
        ax.legend()
        written.append(out_dir / "embeddings.png")
        fig.savefig(written[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    if report.get("wake"):
        w = report["wake"]
        labels = ["ready", "parked", "stopped"]
        values = [(w[k]["median"] or 0) * 1000 for k in ("warm_ttft_s", "parked_ttft_s", "cold_ttft_s")]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(labels, values)
        what = "embedding answer" if w.get("measures") == "embedding" else "first token"
        ax.set(ylabel=f"{what} (ms)", title="Wake against cold start")
        written.append(out_dir / "wake.png")
        fig.savefig(written[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    return written


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.md").write_text(render_markdown(report) + "\n")
    return [out_dir / "report.json", out_dir / "report.md", *write_charts(report, out_dir)]


# ---------------------------------------------------------------- command line

def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} needs positive integers")
    return values


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="capyctl-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("CAPYCTL_BASE_URL", "http://127.0.0.1:8000"),
                        help="the OpenAI-compatible endpoint (default $CAPYCTL_BASE_URL or http://127.0.0.1:8000)")
    parser.add_argument("--api-key", default=os.environ.get("CAPYCTL_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                        help="API key (default $CAPYCTL_API_KEY, then $OPENAI_API_KEY)")
    parser.add_argument("--model", required=True, help="model (deployment or alias) to measure")
    parser.add_argument("--out", default="capyctl-bench-report", help="directory for report.json, report.md, charts")
    parser.add_argument("--runs", type=int, default=5, help="repetitions of each single-stream measurement")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per single stream")
    parser.add_argument("--prompt-lengths", type=_int_list, default=DEFAULT_PROMPT_LENGTHS,
                        help="prompt sweep, in tokens (default 16,32,64,128,256,512)")
    parser.add_argument("--concurrency", type=_int_list, default=DEFAULT_CONCURRENCY,
                        help="concurrent stream counts (default 1,2,4,8)")
    parser.add_argument("--concurrency-tokens", type=int, default=32, help="tokens per concurrent stream")
    parser.add_argument("--api-socket", help="CapyCTL management API socket, to measure wake against cold start")
    parser.add_argument("--capyctl", help="capyctl command, to park and stop through the CLI instead of the socket")
    parser.add_argument("--deployment", help="deployment to park and stop (default: the model)")
    parser.add_argument("--wake-runs", type=int, default=3)
    parser.add_argument("--systemone-runs", type=int, default=10)
    parser.add_argument("--task", choices=TASKS, default="generate",
                        help="generate: chat sections and /v1/systemone; embed: /v1/embeddings (default generate)")
    parser.add_argument("--embedding-batches", type=_int_list, default=DEFAULT_EMBEDDING_BATCHES,
                        help="inputs per /v1/embeddings request, for --task embed (default 1,4,16)")
    parser.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {','.join(SECTIONS)}")
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for strict servers)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    skip = frozenset(s.strip() for s in args.skip.split(",") if s.strip())
    unknown = skip - set(SECTIONS)
    if unknown:
        print(f"capyctl-bench: unknown section(s) {', '.join(sorted(unknown))}; known: {', '.join(SECTIONS)}",
              file=sys.stderr)
        return 2
    endpoint = Endpoint(args.base_url, args.model, args.api_key, timeout=args.timeout)
    config = BenchConfig(runs=args.runs, max_tokens=args.max_tokens, prompt_lengths=args.prompt_lengths,
                         concurrency=args.concurrency, concurrency_tokens=args.concurrency_tokens,
                         wake_runs=args.wake_runs, systemone_runs=args.systemone_runs,
                         ignore_eos=not args.no_ignore_eos, deployment=args.deployment, skip=skip,
                         task=args.task, embedding_batches=args.embedding_batches)
    control = None
    if args.api_socket or args.capyctl:
        control = Control(api_socket=args.api_socket, cli=args.capyctl.split() if args.capyctl else None)
    try:
        report = run_benchmark(endpoint, config, control=control,
                               log=lambda m: print(f"capyctl-bench: {m}", file=sys.stderr))
    except BenchError as exc:
        print(f"capyctl-bench: {exc}", file=sys.stderr)
        return 1
    paths = write_report(report, Path(args.out))
    print(render_markdown(report))
    print(f"capyctl-bench: wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
