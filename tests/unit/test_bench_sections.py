"""The benchmark client's task-aware sections, against a small in-process OpenAI-compatible server:
``--task embed`` (the embeddings section, wake by embeddings) and /v1/systemone accuracy.

tests/fakes/fake_openai.py runs as a subprocess and has no /v1/systemone, so this file carries
its own server: one thread per request, counting what it was asked, answering as a test sets.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from capyctl.bench import BenchConfig, BenchError, Endpoint, build_parser, render_markdown, run_benchmark
from capyctl.bench import _core
from capyctl.proxy import _systemone

DIMENSION = 8


class _Server:
    """What the handler answers with, and what it was asked."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.routes: Counter[str] = Counter()
        self.embedding_batches: list[int] = []  # inputs per /v1/embeddings request, in order
        self.embedding_words: list[int] = []  # words of every input, in order
        self.systemone_states: list[str] = []
        # state -> (status, answers); a state not listed gets 404, as an engine without the route.
        self.systemone: dict[str, tuple[int, dict[str, Any]]] = {}
        self.vectors_short = False  # answer one vector fewer than asked
        self.base_url = ""


def _handler(server: _Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, status: int, body: Any) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with server.lock:
                server.routes[self.path] += 1
            if self.path == "/v1/chat/completions":
                self._chat(body)
            elif self.path == "/v1/embeddings":
                self._embeddings(body)
            elif self.path == "/v1/systemone":
                with server.lock:
                    server.systemone_states.append(body["state"])
                status, answers = server.systemone.get(body["state"], (404, {}))
                self._json(status, {"model": body["model"], "answers": answers} if status == 200
                           else {"error": {"message": "no systemone here"}})
            else:
                self._json(404, {"error": "no such route"})

        def _chat(self, body: dict[str, Any]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            pieces = ["a"] * int(body.get("max_tokens") or 1)
            for piece in pieces:
                self.wfile.write(b"data: " + json.dumps({"choices": [{"delta": {"content": piece}}]}).encode()
                                 + b"\n\n")
            usage = {"prompt_tokens": 10, "completion_tokens": len(pieces)}
            self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

        def _embeddings(self, body: dict[str, Any]) -> None:
            texts = [body["input"]] if isinstance(body["input"], str) else list(body["input"])
            with server.lock:
                server.embedding_batches.append(len(texts))
                server.embedding_words.extend(len(t.split()) for t in texts)
            count = len(texts) - 1 if server.vectors_short else len(texts)
            words = sum(len(t.split()) for t in texts)
            self._json(200, {"object": "list", "model": body["model"],
                             "data": [{"object": "embedding", "index": i, "embedding": [0.5] * DIMENSION}
                                      for i in range(count)],
                             "usage": {"prompt_tokens": words, "total_tokens": words}})

    return Handler


@pytest.fixture
def server():
    state = _Server()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    state.base_url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def _endpoint(server: _Server) -> Endpoint:
    return Endpoint(server.base_url, "m", timeout=10)


class _FakeControl:
    """Control's two calls, recorded; the deployment is always where it was sent."""

    def __init__(self) -> None:
        self.actions: list[tuple[str, str]] = []

    def action(self, verb: str, deployment: str) -> None:
        self.actions.append((verb, deployment))

    def state(self, deployment: str) -> str:
        return "parked"


# ---------------------------------------------------------------- embeddings

def test_embed_runs_the_embeddings_section_and_no_chat(server, tmp_path):
    config = BenchConfig(runs=2, prompt_lengths=(16, 32, 64, 128), embedding_batches=(1, 3), task="embed")
    report = run_benchmark(_endpoint(server), config)
    assert server.routes["/v1/chat/completions"] == 0 and server.routes["/v1/systemone"] == 0
    for chat_section in ("latency", "prompt_sweep", "concurrency", "systemone", "wake"):
        assert chat_section not in report
    assert report["version"] == 2 and report["task"] == "embed"
    assert report["config"]["task"] == "embed" and list(report["config"]["embedding_batches"]) == [1, 3]
    e = report["embeddings"]
    assert e["dimension"] == DIMENSION
    assert e["batch_sizes"] == [1, 3]
    assert e["input_lengths"] == [16, 32, 64]  # the prompt lengths, at most the first three
    assert [(p["batch_size"], p["target_tokens"]) for p in e["points"]] == [
        (1, 16), (1, 32), (1, 64), (3, 16), (3, 32), (3, 64)]
    # The warm-up's one input, then every point's batch, config.runs times over.
    assert server.embedding_batches == [1] + [1] * 6 + [3] * 6
    for p in e["points"]:
        # make_prompt(N) has N - 3 words and the server counts a token per word.
        assert p["prompt_tokens_per_input"] == p["target_tokens"] - 3
        assert p["latency_s"]["n"] == 2 and p["inputs_per_s"]["n"] == 2 and p["prompt_tokens_per_s"]["n"] == 2
        lat, rate = p["latency_s"], p["inputs_per_s"]
        assert lat["min"] <= lat["median"] <= lat["max"]
        # inputs/s is this point's batch over each request's seconds.
        assert rate["max"] == pytest.approx(p["batch_size"] / lat["min"])
        tokens_rate = p["prompt_tokens_per_s"]["max"]
        assert tokens_rate == pytest.approx(p["batch_size"] * (p["target_tokens"] - 3) / lat["min"])

    paths = _core.write_report(report, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "## Embeddings" in text and f"Vector dimension: {DIMENSION}." in text
    assert "| 3 | 61 | " in text  # batch of 3, 64-token target: 61 tokens per input from usage
    assert "## Single stream" not in text and "## /v1/systemone" not in text
    if importlib.util.find_spec("matplotlib") is None:
        return  # charts are optional
    assert tmp_path / "embeddings.png" in paths
    assert (tmp_path / "embeddings.png").read_bytes().startswith(b"\x89PNG")


def test_generate_skips_the_embeddings_section(server):
    config = BenchConfig(runs=1, max_tokens=3, prompt_lengths=(16,), concurrency=(2,), concurrency_tokens=2,
                         systemone_runs=1)
    report = run_benchmark(_endpoint(server), config)
    assert server.routes["/v1/embeddings"] == 0
    assert "embeddings" not in report and report["task"] == "generate"
    assert report["latency"]["completion_tokens"]["median"] == 3
    assert report["systemone"] == {"supported": False, "status": 404,
                                   "error": {"error": {"message": "no systemone here"}}}
    assert server.routes["/v1/systemone"] == 1  # refused once: not asked again


def test_wake_of_an_embedding_deployment_times_embeddings_requests(server):
    control = _FakeControl()
    config = BenchConfig(task="embed", wake_runs=2, deployment="emb", skip=frozenset({"embeddings"}))
    report = run_benchmark(_endpoint(server), config, control=control)  # type: ignore[arg-type]
    assert server.routes["/v1/chat/completions"] == 0
    assert "embeddings" not in report
    w = report["wake"]
    assert w["measures"] == "embedding"
    assert w["warm_ttft_s"]["n"] == w["parked_ttft_s"]["n"] == w["cold_ttft_s"]["n"] == 2
    assert control.actions == [("park", "emb"), ("stop", "emb")] * 2
    assert server.embedding_batches == [1] * 7  # the warm-up, then warm, parked, stopped twice
    assert "| from | embedding answer (median) | p95 |" in render_markdown(report)


def test_wake_of_a_generate_deployment_still_times_first_tokens(server):
    report = run_benchmark(_endpoint(server), BenchConfig(wake_runs=1, skip=frozenset(_core.SECTIONS) - {"wake"}),
                           control=_FakeControl())  # type: ignore[arg-type]
    assert report["wake"]["measures"] == "first_token"
    assert server.routes["/v1/embeddings"] == 0 and server.routes["/v1/chat/completions"] == 4


def test_an_answer_without_one_vector_per_input_stops_the_run(server):
    server.vectors_short = True
    with pytest.raises(BenchError) as info:
        run_benchmark(_endpoint(server), BenchConfig(task="embed", runs=1, prompt_lengths=(16,),
                                                     embedding_batches=(2,)))
    assert info.value.code == "bad_embeddings"


def test_an_unknown_task_is_refused():
    with pytest.raises(BenchError) as info:
        run_benchmark(Endpoint("http://127.0.0.1:9", "m"), BenchConfig(task="rerank"))
    assert info.value.code == "invalid_task"


def test_the_command_line_runs_the_embed_task(server, tmp_path):
    args = build_parser().parse_args(["--base-url", server.base_url, "--model", "m", "--task", "embed",
                                      "--embedding-batches", "2,5", "--runs", "1", "--prompt-lengths", "16",
                                      "--out", str(tmp_path / "out")])
    assert (args.task, args.embedding_batches) == ("embed", (2, 5))
    assert _core.run_from_args(args) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["embeddings"]["batch_sizes"] == [2, 5]
    assert server.embedding_batches == [1, 2, 5]


@pytest.mark.parametrize("argv", [["--task", "rerank"], ["--embedding-batches", "0,4"]])
def test_bad_task_options_are_usage_errors(argv):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--model", "m", *argv])
    assert info.value.code == 2


# ---------------------------------------------------------------- /v1/systemone accuracy

def _noul(p: float) -> dict[str, Any]:
    return {"type": "noul", "noul": p}


def _choice(label: str, *labels: str) -> dict[str, Any]:
    probabilities = {name: (0.8 if name == label else 0.2 / len(labels)) for name in (label, *labels)}
    return {"type": "choice", "choice": label, "probabilities": probabilities, "confidence": 0.7}


FOUR_CASES = (
    {"name": "yes", "body": {"state": "s-yes", "questions": {"q": {"type": "noul", "instructions": "yes?"}}},
     "expected": {"q": _noul(1.0)}},
    {"name": "pick", "body": {"state": "s-pick", "questions": {"q": {"type": "choice", "instructions": "which?",
                                                                      "criteria": {"a": None, "b": None}}}},
     "expected": {"q": {"type": "choice", "choice": "a"}}},
    {"name": "level", "body": {"state": "s-level", "questions": {"q": {"type": "score", "instructions": "how?",
                                                                       "criteria": ["0", "1", "2", "3", "4"]}}},
     "expected": {"q": {"type": "score", "score": 4}}},
    {"name": "no", "body": {"state": "s-no", "questions": {"q": {"type": "noul", "instructions": "no?"}}},
     "expected": {"q": _noul(0.0)}},
)


def test_systemone_accuracy_counts_right_and_wrong_answers(server, monkeypatch):
    monkeypatch.setattr(_core, "SYSTEMONE_SUITE", FOUR_CASES)
    server.systemone = {
        "s-yes": (200, {"q": _noul(0.9)}),  # right
        "s-pick": (200, {"q": _choice("a", "b")}),  # right
        "s-level": (200, {"q": {"type": "score", "score": 3.6, "legend": {}, "probabilities": {},
                                "confidence": 0.5}}),  # right: level 4 is the nearest
        "s-no": (200, {"q": _noul(0.7)}),  # wrong: the expected answer is no
    }
    s = _core.measure_systemone(_endpoint(server), BenchConfig(systemone_runs=1))
    assert (s["supported"], s["accuracy"], s["correct"], s["questions"]) == (True, 0.75, 3, 4)
    assert (s["cases"], s["passes"]) == (4, 1)
    assert s["latency_s"]["n"] == 4 and s["statuses"] == {200: 4}
    assert [(c["name"], c["correct"], c["asked"]) for c in s["per_case"]] == [
        ("yes", 1, 1), ("pick", 1, 1), ("level", 1, 1), ("no", 0, 1)]
    assert s["per_case"][3]["expected"] == {"q": _noul(0.0)} and s["per_case"][3]["got"] == [{"q": _noul(0.7)}]
    text = render_markdown({"model": "m", "base_url": "http://x", "machine": {"cpus": 1, "platform": "p"},
                            "systemone": s})
    assert "Accuracy 75.0%: 3 of 4 answers right over 4 labelled cases" in text
    assert "| no | 0 | 1 |" in text


def test_systemone_runs_whole_passes_and_counts_failures_as_wrong(server, monkeypatch):
    monkeypatch.setattr(_core, "SYSTEMONE_SUITE", FOUR_CASES)
    server.systemone = {
        "s-yes": (200, {"q": _noul(0.5)}),  # no answer either way: wrong
        "s-pick": (200, {"q": _noul(0.9)}),  # the wrong type: wrong
        "s-level": (500, {}),  # an engine error after a success: asked, not answered
        "s-no": (200, {}),  # the question left out: wrong
    }
    s = _core.measure_systemone(_endpoint(server), BenchConfig(systemone_runs=5))
    assert s["passes"] == 2  # 5 requests asked for: two whole passes of four
    assert server.systemone_states == ["s-yes", "s-pick", "s-level", "s-no"] * 2
    assert (s["accuracy"], s["correct"], s["questions"]) == (0.0, 0, 8)
    assert s["statuses"] == {200: 6, 500: 2} and s["latency_s"]["n"] == 6
    assert s["per_case"][2]["got"] == [{"q": None}, {"q": None}]


def test_systemone_not_served_returns_early(server):
    s = _core.measure_systemone(_endpoint(server), BenchConfig(systemone_runs=20))
    assert s["supported"] is False and s["status"] == 404
    assert server.routes["/v1/systemone"] == 1


def test_the_labelled_suite_is_valid_for_the_route_and_its_answers_fit_the_questions():
    suite = _core.SYSTEMONE_SUITE
    assert 6 <= len(suite) <= 12
    assert len({case["name"] for case in suite}) == len(suite)
    for case in suite:
        parsed = _systemone.validate_request({"model": "m", **case["body"]})
        _systemone.check_answerable(parsed)
        _systemone.check_decidable(parsed)
        assert set(case["expected"]) == set(parsed.questions), case["name"]
        for qid, expected in case["expected"].items():
            question = parsed.questions[qid]
            assert expected["type"] == question.type, (case["name"], qid)
            keys = _systemone.option_keys(question)
            if expected["type"] == "noul":
                assert expected["noul"] in (0.0, 1.0)
            elif expected["type"] == "choice":
                assert expected["choice"] in keys
            else:
                assert str(expected["score"]) in keys
            # The route's own answer for a certain model is graded right.
            certain = {key: 1.0 if key == _expected_key(expected) else 0.0 for key in keys}
            assert _core.systemone_answer_is_right(expected, _systemone.format_answer(question, certain))
    assert {q["type"] for case in suite for q in case["expected"].values()} == {"noul", "choice", "score"}


def _expected_key(expected: dict[str, Any]) -> str:
    if expected["type"] == "noul":
        return "true" if expected["noul"] == 1.0 else "false"
    return str(expected[expected["type"]])


def test_a_version_one_systemone_section_still_renders():
    s = {"supported": True, "latency_s": _core.summarize([0.1, 0.2]), "statuses": {200: 2}}
    text = render_markdown({"model": "m", "base_url": "http://x", "machine": {"cpus": 1, "platform": "p"},
                            "systemone": s})
    assert "Latency median 150.0 ms" in text and "Accuracy" not in text


@pytest.mark.parametrize(("expected", "got", "right"), [
    (_noul(1.0), _noul(0.51), True), (_noul(1.0), _noul(0.5), False), (_noul(0.0), _noul(0.49), True),
    (_noul(0.0), _noul(0.9), False), (_noul(1.0), {"type": "noul", "noul": True}, False),
    ({"type": "choice", "choice": "a"}, _choice("a", "b"), True),
    ({"type": "choice", "choice": "a"}, _choice("b", "a"), False),
    ({"type": "score", "score": 4}, {"type": "score", "score": 3.6}, True),
    ({"type": "score", "score": 4}, {"type": "score", "score": 3.4}, False),
    ({"type": "score", "score": 0}, {"type": "score", "score": 0.2}, True),
    ({"type": "score", "score": 0}, {"type": "choice", "choice": "0"}, False),
    ({"type": "score", "score": 2}, None, False),
])
def test_answers_are_graded_by_the_option_they_pick(expected, got, right):
    assert _core.systemone_answer_is_right(expected, got) is right


# ---------------------------------------------------------------- endpoints measured together

def test_interleave_sends_each_repetition_to_every_endpoint_in_turn_the_order_rotating():
    a, b = Endpoint("http://a", "a"), Endpoint("http://b", "b")
    calls: list[str] = []
    results = _core.interleave([a, b], 3, lambda e: calls.append(e.model) or f"{e.model}{len(calls)}")
    assert calls == ["a", "b", "b", "a", "a", "b"]  # A B, B A, A B: neither side always first
    assert results == [["a1", "a4", "a5"], ["b2", "b3", "b6"]]
    assert _core.interleave([a, b], 1, lambda e: e.model, start=1) == [["a"], ["b"]]


def test_endpoints_measured_together_alternate_request_by_request(server, monkeypatch):
    asked: list[str] = []
    real = _core.stream_chat

    def recording(endpoint, *args, **kwargs):
        asked.append(endpoint.model)
        return real(endpoint, *args, **kwargs)
    monkeypatch.setattr(_core, "stream_chat", recording)
    config = BenchConfig(runs=4, max_tokens=3, prompt_lengths=(8,), concurrency=(1,), concurrency_tokens=2,
                         skip=frozenset({"systemone"}))
    a, b = Endpoint(server.base_url, "a", timeout=10), Endpoint(server.base_url, "b", timeout=10)
    ra, rb = _core.run_benchmarks([a, b], [config, config])
    assert asked[:2] == ["a", "b"]  # the warm-ups
    assert asked[2:10] == ["a", "b", "b", "a", "a", "b", "b", "a"]  # latency: 4 runs each, in turn
    for report, mine, other in ((ra, a, b), (rb, b, a)):
        assert report["latency"]["decode_tokens_per_s"]["n"] == 4 and report["latency"]["completion_tokens"]["median"] == 3
        assert [p["target_tokens"] for p in report["prompt_sweep"]] == [8]
        assert report["concurrency"][0]["failed"] == 0
        assert report["model"] == mine.model and report["interleaved_with"] == [other.base_url]


def test_endpoints_measured_together_keep_their_own_sections_and_need_the_same_settings(server):
    server.systemone["The user wrote: 'Please cancel my order and refund me.'"] = (200, {})
    config = BenchConfig(runs=1, max_tokens=2, prompt_lengths=(8,), concurrency=(1,), systemone_runs=1,
                         skip=frozenset({"prompt_sweep", "concurrency"}))
    direct = BenchConfig(runs=1, max_tokens=2, prompt_lengths=(8,), concurrency=(1,), systemone_runs=1,
                         skip=frozenset({"prompt_sweep", "concurrency", "systemone"}))
    ra, rb = _core.run_benchmarks([_endpoint(server), _endpoint(server)], [config, direct])
    assert "systemone" in ra and "systemone" not in rb and "latency" in ra and "latency" in rb
    with pytest.raises(BenchError) as err:
        _core.run_benchmarks([_endpoint(server), _endpoint(server)], [config, BenchConfig(runs=2)])
    assert err.value.code == "invalid_config"
