"""The proxy against a fake Router and a small fake OpenAI server, both in this file.

The fake upstream speaks the OpenAI wire format (JSON, SSE ending in [DONE]); the
proxy runs on a real loopback socket through ``serve`` exactly as the daemon runs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import aiohttp
import openai
import pytest
from aiohttp import web

from capyctl.errors import CapyError, QueueFull, Unavailable
from capyctl.proxy import _app as proxy_app
from capyctl.proxy._engine_limits import EngineConnectionLimits
from capyctl.proxy._metrics import PENDING_MAX, ProxyMetrics
from capyctl.proxy import KeyGrant, ModelEntry, StaticKeys, Upstream, build_app, serve

UPSTREAM_KEY = "launch-key-123"
ADMIN_KEY = "sk-admin"
SCOPED_KEY = "sk-only-b"
HANG_GUARD = 15.0  # seconds; only ever reached when the behaviour under test is broken


async def eventually(predicate, what: str) -> None:
    """Wait for a condition another task makes true; fail (never hang) if it does not come."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)
    try:
        await asyncio.wait_for(poll(), HANG_GUARD)
    except TimeoutError:
        pytest.fail(f"never happened: {what}")


# ---------------------------------------------------------------- fake OpenAI upstream

@dataclass
class FakeOpenAI:
    """What the fake engine saw and how it should answer."""

    requests: list[tuple[str, dict, bytes]] = field(default_factory=list)  # path, headers, body
    release_second_chunk: asyncio.Event = field(default_factory=asyncio.Event)
    second_chunk_sent: bool = False
    stream_mode: str = "two_chunks"  # two_chunks | endless | die
    stream_stopped: asyncio.Event = field(default_factory=asyncio.Event)
    status: int = 200
    body: bytes = b""
    top_logprobs: dict[str, list[dict]] = field(default_factory=dict)  # keyed by question kind
    # Requests inside the engine at once (the most seen), and the connections they came on.
    inside: int = 0
    most_inside: int = 0
    connections: set[int] = field(default_factory=set)
    # When set, each request is held until this many are inside at once, or until the test sets
    # ``crowded`` (it knows no more will come in).
    hold_until_inside: int | None = None
    crowded: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        self.connections.add(id(request.transport))
        try:
            if self.hold_until_inside is not None:
                if self.inside >= self.hold_until_inside:
                    self.crowded.set()
                await asyncio.wait_for(self.crowded.wait(), HANG_GUARD)
            return await self.answer(request)
        finally:
            self.inside -= 1

    async def answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.requests.append((request.path_qs, dict(request.headers), raw))
        if request.path == "/v1/chat/completions":
            payload = json.loads(raw)
            if payload.get("stream"):
                return await self.stream(request)
            if payload.get("logprobs"):
                return self.logprobs_answer(payload)
        return web.Response(status=self.status, body=self.body, content_type="application/json")

    def logprobs_answer(self, payload: dict) -> web.Response:
        system = payload["messages"][0]["content"]
        kind = "noul" if "yes or no" in system else "choice" if "letter" in system else "score"
        top = self.top_logprobs[kind]
        return web.json_response({
            "id": "x", "object": "chat.completion", "model": payload["model"],
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": top[0]["token"]},
                         "logprobs": {"content": [{"token": top[0]["token"], "logprob": top[0]["logprob"],
                                                   "top_logprobs": top}]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
        })

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await response.write(sse_chunk("first"))
            if self.stream_mode == "die":
                # The engine process dies: its socket closes in the middle of the chunked body.
                request.transport.abort()
                return response
            if self.stream_mode == "endless":
                while True:
                    await asyncio.sleep(0.02)
                    await response.write(sse_chunk("more"))
            await asyncio.wait_for(self.release_second_chunk.wait(), HANG_GUARD)
            self.second_chunk_sent = True
            await response.write(sse_chunk("last") + b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.stream_stopped.set()


def sse_chunk(text: str) -> bytes:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


# ---------------------------------------------------------------- fake Router

class FakeRouter:
    """Admission by the book: counts who waits, who is in flight, who left."""

    def __init__(self, upstreams: dict[str, Upstream]) -> None:
        self.upstreams = upstreams
        self.errors: dict[str, CapyError] = {}
        self.gate: asyncio.Event | None = None  # when set, admission waits for it (a wake)
        self.acquire_calls = 0
        self.waiting = 0
        self.in_flight = 0
        self.released = 0
        self.at_once = True  # try_acquire answers (as the Controller's does); False: acquire() alone
        self.moves: dict[str, Upstream] = {}  # deployment -> where engine_lost moves it
        self.lost_asked: list[str] = []  # the hosts engine_lost was asked about

    def models(self) -> list[ModelEntry]:
        return [ModelEntry(id=name, deployment=up.deployment, state="ready", engine=up.engine, created=1700000000)
                for name, up in self.upstreams.items()]

    @asynccontextmanager
    async def acquire(self, model: str) -> AsyncIterator[Upstream]:
        self.acquire_calls += 1
        if model in self.errors:
            raise self.errors[model]
        if model not in self.upstreams:
            raise CapyError(f"No deployment serves {model}.", code="model_not_found", status=404)
        if self.gate is not None:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        self.in_flight += 1
        try:
            yield self.upstreams[model]
        finally:
            self.in_flight -= 1
            self.released += 1

    def try_acquire(self, model: str) -> tuple[Upstream, Callable[[], None]] | None:
        # As the Controller's: at once when ready with nothing in the way (no wake, no error), else
        # None and the proxy goes through acquire(). Off (at_once False): acquire() only.
        if not self.at_once or self.gate is not None or model in self.errors or model not in self.upstreams:
            return None
        self.acquire_calls += 1
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            assert not released, "released twice"
            released = True
            self.in_flight -= 1
            self.released += 1
        return self.upstreams[model], release

    async def engine_lost(self, upstream: Upstream) -> bool:
        # As the Controller's: True when the deployment moves (its host lost), its new placement
        # then given by acquire(); False for an engine that broke the connection by itself.
        self.lost_asked.append(upstream.host)
        moved = self.moves.pop(upstream.deployment, None)
        if moved is None:
            return False
        for model, up in list(self.upstreams.items()):
            if up.deployment == upstream.deployment:
                self.upstreams[model] = moved
        return True

    def stats(self) -> dict[str, dict[str, float]]:
        return {up.deployment: {"queue_depth": self.waiting, "in_flight": self.in_flight, "wakes": 2, "parks": 1}
                for up in self.upstreams.values()}


# ---------------------------------------------------------------- fixtures

@dataclass
class Setup:
    url: str
    fake: FakeOpenAI
    router: FakeRouter
    upstream_url: str


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = await serve(app, host_port="127.0.0.1:0")
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


# Clients are served by aiohttp's server; engines are reached through the proxy's own client
# (httptools) or aiohttp's (where httptools is missing): every test here runs with each.
@pytest.fixture(params=["engine-pool", "aiohttp-client"])
async def setup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Setup]:
    if request.param == "aiohttp-client":
        monkeypatch.setattr(proxy_app, "make_engine_pool", lambda **_: None)
    fake = FakeOpenAI()
    upstream_app = web.Application()
    upstream_app.router.add_route("*", "/{tail:.*}", fake.handle)  # records anything, control routes too
    upstream_runner, upstream_url = await _start(upstream_app)
    router = FakeRouter({
        "model-a": Upstream("dep-a", upstream_url, UPSTREAM_KEY, "llama.cpp",
                            frozenset({"chat", "completions", "logprobs"}), served_model="engine-name-a"),
        "model-b": Upstream("dep-b", upstream_url, UPSTREAM_KEY, "vllm", frozenset({"chat", "completions", "embeddings"})),
        "model-native": Upstream("dep-n", upstream_url, UPSTREAM_KEY, "tensorfold", frozenset({"systemone"})),
    })
    keys = StaticKeys({ADMIN_KEY: KeyGrant("admin"), SCOPED_KEY: KeyGrant("scoped", frozenset({"model-b"}))})
    proxy_runner, proxy_url = await _start(build_app(router, keys, max_body=4096))
    try:
        yield Setup(proxy_url, fake, router, upstream_url)
    finally:
        await proxy_runner.cleanup()
        await upstream_runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as session:
        yield session


def auth(key: str = ADMIN_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def error_of(response: aiohttp.ClientResponse) -> dict:
    body = await response.json()
    assert set(body["error"]) == {"message", "type", "code", "param"}
    return body["error"]


# ---------------------------------------------------------------- auth and listing

async def test_health_answers_without_a_key(setup: Setup, http: aiohttp.ClientSession) -> None:
    async with http.get(setup.url + "/health") as response:
        assert response.status == 200
        assert (await response.json())["status"] == "ok"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + ADMIN_KEY},
                                     {"Authorization": "Bearer "}])
async def test_missing_or_invalid_key_is_401(setup: Setup, http: aiohttp.ClientSession, headers: dict) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/systemone")):
        async with http.request(method, setup.url + path, headers=headers, json={"model": "model-a"}) as response:
            assert response.status == 401
            error = await error_of(response)
            assert error["code"] == "invalid_api_key"
            assert error["type"] == "authentication_error"
    assert setup.router.acquire_calls == 0


async def test_models_lists_without_acquiring_and_scoped_key_sees_only_its_models(
        setup: Setup, http: aiohttp.ClientSession) -> None:
    async with http.get(setup.url + "/v1/models", headers=auth()) as response:
        listing = await response.json()
    assert listing["object"] == "list"
    assert sorted(m["id"] for m in listing["data"]) == ["model-a", "model-b", "model-native"]
    assert listing["data"][0]["object"] == "model"
    async with http.get(setup.url + "/v1/models", headers=auth(SCOPED_KEY)) as response:
        assert [m["id"] for m in (await response.json())["data"]] == ["model-b"]
    assert setup.router.acquire_calls == 0


async def test_scoped_key_gets_the_same_404_as_an_unknown_model(setup: Setup, http: aiohttp.ClientSession) -> None:
    async with http.post(setup.url + "/v1/chat/completions", headers=auth(SCOPED_KEY),
                         json={"model": "model-a", "messages": []}) as response:
        assert response.status == 404
        hidden = await error_of(response)
    assert setup.router.acquire_calls == 0  # refused before admission: nothing woke
    async with http.post(setup.url + "/v1/chat/completions", headers=auth(),
                         json={"model": "model-zzz", "messages": []}) as response:
        assert response.status == 404
        unknown = await error_of(response)
    assert hidden["code"] == unknown["code"] == "model_not_found"
    assert hidden["message"].replace("model-a", "X") == unknown["message"].replace("model-zzz", "X")
    assert setup.fake.requests == []


async def test_auth_off_when_keys_is_none(http: aiohttp.ClientSession) -> None:
    router = FakeRouter({})
    runner, url = await _start(build_app(router, None))
    try:
        async with http.get(url + "/v1/models") as response:
            assert response.status == 200
            assert (await response.json())["data"] == []
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------- request errors

async def test_router_errors_map_to_openai_errors_with_retry_after(setup: Setup, http: aiohttp.ClientSession) -> None:
    setup.router.errors["model-a"] = QueueFull("The queue of dep-a is full.", retry_after=2.2)
    setup.router.errors["model-b"] = Unavailable("dep-b did not wake in time.", code="wake_timeout")
    async with http.post(setup.url + "/v1/chat/completions", headers=auth(), json={"model": "model-a"}) as response:
        assert response.status == 429
        assert response.headers["Retry-After"] == "3"  # rounded up
        error = await error_of(response)
        assert (error["code"], error["type"]) == ("queue_full", "rate_limit_error")
        assert error["message"] == "The queue of dep-a is full."
    async with http.post(setup.url + "/v1/completions", headers=auth(), json={"model": "model-b"}) as response:
        assert response.status == 503
        assert "Retry-After" not in response.headers
        assert (await error_of(response))["code"] == "wake_timeout"


DEEP = b'{"model": "model-a", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}"


def _refused_by_json(body: bytes) -> bool:
    try:
        json.loads(body)
    except RecursionError:
        return True
    return False


async def test_body_errors(setup: Setup, http: aiohttp.ClientSession) -> None:
    url = setup.url + "/v1/chat/completions"
    cases = [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (json.dumps({"messages": []}).encode(), 400, "missing_model"),
        (json.dumps({"model": 7}).encode(), 400, "missing_model"),
        (json.dumps({"model": "model-a", "pad": "x" * 5000}).encode(), 413, "request_too_large"),
        # Nested past the standard library's recursion limit: its RecursionError was answered 500.
        # That limit is the interpreter's (3.11 refuses this depth, 3.13's scanner reads it), so
        # the expected answer is what json.loads itself does with the body: a 400, or passed on.
        (DEEP, 400 if _refused_by_json(DEEP) else 200, "invalid_json" if _refused_by_json(DEEP) else None),
        # What follows the object: json.loads refuses all but whitespace, and so must _loads' own
        # reading of a UTF-8 object (its scanner stops at the object's end).
        (b'{"model": "model-a"} {"model": "model-b"}', 400, "invalid_json"),
        (b'{"model": "model-a"}\x00', 400, "invalid_json"),
        (b'{"model": "model-a"', 400, "invalid_json"),
        (b'{"model": "model-a", "x": "\xff"}', 400, "invalid_json"),  # not UTF-8
    ]
    for body, status, code in cases:
        async with http.post(url, headers={**auth(), "Content-Type": "application/json"}, data=body) as response:
            assert response.status == status, body[:40]
            if code is not None:
                assert (await error_of(response))["code"] == code

    async def chunked_body() -> AsyncIterator[bytes]:  # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b"x" * 1000
    async with http.post(url, headers=auth(), data=chunked_body()) as response:
        assert response.status == 413
        assert (await error_of(response))["code"] == "request_too_large"
    # Only a body that was read reached the router (the deep one, where the interpreter reads it).
    assert setup.router.acquire_calls == sum(status == 200 for _, status, _ in cases)


@pytest.mark.parametrize("path", ["/sleep", "/wake_up", "/collective_rpc", "/release_memory_occupation",
                                  "/resume_memory_occupation", "/props", "/slots", "/is_sleeping",
                                  "/v1/sleep", "/v1/../sleep", "/models/unload", "/v1/chat/completions/../../sleep"])
async def test_engine_control_routes_are_not_reachable(setup: Setup, http: aiohttp.ClientSession, path: str) -> None:
    for method in ("GET", "POST"):
        async with http.request(method, setup.url + path, headers=auth(), json={"model": "model-a"}) as response:
            assert response.status == 404
            assert (await error_of(response))["code"] == "unknown_route"
    assert setup.fake.requests == []
    assert setup.router.acquire_calls == 0


# ---------------------------------------------------------------- pass-through

async def test_non_streaming_body_passes_through_with_tool_calls(setup: Setup, http: aiohttp.ClientSession) -> None:
    setup.fake.body = json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "engine-name-a",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": "{\"city\": \"Lima\"}"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}).encode()
    request = {"model": "model-a", "messages": [{"role": "user", "content": "weather?"}],
               "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]}
    async with http.post(setup.url + "/v1/chat/completions?level=1", headers=auth(), json=request) as response:
        assert response.status == 200
        assert await response.read() == setup.fake.body  # byte for byte
    path, headers, sent = setup.fake.requests[-1]
    assert path == "/v1/chat/completions"  # the query string is not the client's to pass on
    assert headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"  # the launch key, never the client's
    assert json.loads(sent) == {**request, "model": "engine-name-a"}  # only "model" rewritten
    assert setup.router.in_flight == 0 and setup.router.released == 1


async def test_an_engine_with_a_connection_bound_never_sees_more_connections(
        setup: Setup, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    # llama-server reads a connection only on a free thread of its pool (the adapter's
    # connections_max says why): a burst past the bound waits in the proxy, and every one is answered.
    setup.router.upstreams["model-bounded"] = Upstream("dep-bounded", setup.upstream_url, UPSTREAM_KEY, "llama.cpp",
                                                       frozenset({"chat"}), connections_max=2)
    setup.fake.body = b'{"ok": true}'
    # The engine holds each request until a third is inside (only if the proxy lets one in), or
    # until all eight have asked the proxy for an engine connection and every one that got one is
    # inside the engine: the rest wait in the proxy, and none comes unless one ends.
    setup.fake.hold_until_inside = 3
    asked = got = 0
    acquire = EngineConnectionLimits.acquire

    async def counted(limits: EngineConnectionLimits, upstream: Upstream) -> Callable[[], None]:
        nonlocal asked, got
        asked += 1
        release = await acquire(limits, upstream)
        got += 1
        return release

    monkeypatch.setattr(EngineConnectionLimits, "acquire", counted)

    async def all_in_or_in_line() -> None:
        await eventually(lambda: asked == 8 and setup.fake.inside == got, "all eight at the engine or in line")
        setup.fake.crowded.set()

    async def ask() -> int:
        request = {"model": "model-bounded", "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(setup.url + "/v1/chat/completions", headers=auth(), json=request) as response:
            await response.read()
            return response.status

    watch = asyncio.create_task(all_in_or_in_line())
    try:
        assert await asyncio.gather(*(ask() for _ in range(8))) == [200] * 8
    finally:
        watch.cancel()
    assert setup.fake.most_inside == 2 and len(setup.fake.connections) <= 2
    assert setup.router.in_flight == 0


async def test_bodies_the_standard_library_reads_are_read_and_rewritten_exactly(
        setup: Setup, http: aiohttp.ClientSession) -> None:
    # What json.loads reads (NaN, lone surrogates, UTF-16, integers past 64 bits, which a faster
    # parser such as orjson refuses or reads as floats) is read, and a rewritten body keeps its numbers.
    raw = b'{"model": "model-a", "seed": 123456789012345678901234567890, "t": NaN, "u": "\\ud800"}'
    async with http.post(setup.url + "/v1/chat/completions", headers={**auth(), "Content-Type": "application/json"},
                         data=raw) as response:
        assert response.status == 200
    sent = json.loads(setup.fake.requests[-1][2])
    assert sent["model"] == "engine-name-a" and sent["seed"] == 123456789012345678901234567890
    assert sent["u"] == "\ud800" and sent["t"] != sent["t"]  # NaN
    async with http.post(setup.url + "/v1/chat/completions", headers={**auth(), "Content-Type": "application/json"},
                         data=b'{"model": "model-a"} \r\n\t') as response:  # whitespace after the object
        assert response.status == 200
    for utf16 in (json.dumps({"model": "model-b", "input": "hi"}).encode("utf-16"),  # with a BOM
                  json.dumps({"model": "model-b", "input": "hi"}).encode("utf-16-le")):  # without: "{" then 0
        async with http.post(setup.url + "/v1/embeddings", headers={**auth(), "Content-Type": "application/json"},
                             data=utf16) as response:
            assert response.status == 200
    utf16 = json.dumps({"model": "model-b", "input": "hi"}).encode("utf-16")
    async with http.post(setup.url + "/v1/embeddings", headers={**auth(), "Content-Type": "application/json"},
                         data=utf16) as response:
        assert response.status == 200
    assert setup.fake.requests[-1][2] == utf16  # not rewritten: the bytes as sent


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings"])
async def test_other_routes_pass_through_to_the_same_path_with_engine_status(
        setup: Setup, http: aiohttp.ClientSession, path: str) -> None:
    setup.fake.status = 400
    setup.fake.body = b'{"error": {"message": "prompt too long", "type": "invalid_request_error", "code": null}}'
    raw = b'{"model": "model-b",  "input": "hi"}'  # served_model unset: bytes go on untouched
    async with http.post(setup.url + path, headers={**auth(), "Content-Type": "application/json"},
                         data=raw) as response:
        assert response.status == 400
        assert await response.read() == setup.fake.body
    assert setup.fake.requests[-1][0] == path
    assert setup.fake.requests[-1][2] == raw


async def test_engine_refusing_the_launch_key_is_a_502(setup: Setup, http: aiohttp.ClientSession) -> None:
    setup.fake.status = 401
    async with http.post(setup.url + "/v1/completions", headers=auth(), json={"model": "model-b"}) as response:
        assert response.status == 502
        assert (await error_of(response))["code"] == "engine_auth_failed"


async def test_unreachable_engine_is_502_before_headers(setup: Setup, http: aiohttp.ClientSession) -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    setup.router.upstreams["model-dead"] = Upstream("dep-dead", f"http://127.0.0.1:{dead_port}", None, "custom",
                                                    frozenset({"chat"}))
    async with http.post(setup.url + "/v1/chat/completions", headers=auth(),
                         json={"model": "model-dead", "stream": True}) as response:
        assert response.status == 502
        error = await error_of(response)
        assert (error["code"], error["type"]) == ("engine_unreachable", "server_error")
    assert setup.router.in_flight == 0


@asynccontextmanager
async def engine_lost_with_its_host() -> AsyncIterator[int]:
    """A port whose engine reads a request and hangs up without a word, as an SSH forward does
    when the master carrying it dies with the host's link; the port."""
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.transport.abort()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("at_once", [True, False], ids=["admitted-at-once", "admitted-by-acquire"])
async def test_a_request_whose_engine_was_lost_with_its_host_is_sent_again_to_its_new_placement(
        setup: Setup, http: aiohttp.ClientSession, stream: bool, at_once: bool) -> None:
    setup.router.at_once = at_once
    setup.fake.release_second_chunk.set()
    new_placement = setup.router.upstreams["model-a"]
    async with engine_lost_with_its_host() as port:
        setup.router.upstreams["model-a"] = dataclasses.replace(new_placement, base_url=f"http://127.0.0.1:{port}",
                                                                host="b")
        setup.router.moves["dep-a"] = new_placement
        async with http.post(setup.url + "/v1/chat/completions", headers=auth(),
                             json={"model": "model-a", "stream": stream}) as response:
            assert response.status == 200, await response.text()
            body = await response.read()
    assert (b"data: [DONE]" in body) if stream else body == setup.fake.body
    assert setup.router.lost_asked == ["b"]
    assert len(setup.fake.requests) == 1  # answered by the new placement, once
    assert setup.router.in_flight == 0 and setup.router.released == 2


async def test_a_broken_engine_on_a_connected_host_is_not_sent_again(setup: Setup, http: aiohttp.ClientSession) -> None:
    # Router.engine_lost says no (the host's connection lives: the engine broke it) or the new
    # placement broke as well: the 502 stands, after one resend at most.
    async with engine_lost_with_its_host() as port:
        lost = dataclasses.replace(setup.router.upstreams["model-a"], base_url=f"http://127.0.0.1:{port}", host="b")
        for moves, asked in (({}, ["b"]), ({"dep-a": lost}, ["b"])):
            setup.router.upstreams["model-a"], setup.router.moves, setup.router.lost_asked = lost, moves, []
            async with http.post(setup.url + "/v1/chat/completions", headers=auth(),
                                 json={"model": "model-a"}) as response:
                assert response.status == 502
                assert (await error_of(response))["code"] == "engine_unreachable"
            assert setup.router.lost_asked == asked
    assert setup.fake.requests == [] and setup.router.in_flight == 0


# ---------------------------------------------------------------- streaming

async def test_stream_arrives_chunk_by_chunk(setup: Setup, http: aiohttp.ClientSession) -> None:
    async with http.post(setup.url + "/v1/chat/completions", headers=auth(),
                         json={"model": "model-a", "stream": True}) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["Cache-Control"] == "no-cache"
        assert response.headers["X-Accel-Buffering"] == "no"
        # The fake engine holds its second chunk until we have seen the first: a proxy that
        # buffered would never deliver it and this read would hit the hang guard.
        first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), HANG_GUARD)
        assert b'"first"' in first
        assert not setup.fake.second_chunk_sent
        setup.fake.release_second_chunk.set()
        rest = await response.read()
    assert b'"last"' in rest and rest.endswith(b"data: [DONE]\n\n")
    assert setup.router.in_flight == 0 and setup.router.released == 1


async def test_client_disconnect_mid_stream_stops_upstream_and_releases(
        setup: Setup, http: aiohttp.ClientSession) -> None:
    setup.fake.stream_mode = "endless"
    response = await http.post(setup.url + "/v1/chat/completions", headers=auth(),
                               json={"model": "model-a", "stream": True})
    await asyncio.wait_for(response.content.readuntil(b"\n\n"), HANG_GUARD)
    assert setup.router.in_flight == 1
    response.close()  # the client goes away
    await eventually(setup.fake.stream_stopped.is_set, "the engine's stream stopped")
    await eventually(lambda: setup.router.in_flight == 0 and setup.router.released == 1, "admission released")


@pytest.mark.parametrize("at_once", [True, False], ids=["admitted-at-once", "admitted-by-acquire"])
async def test_admission_is_released_once_whichever_way_it_was_given(
        setup: Setup, http: aiohttp.ClientSession, at_once: bool) -> None:
    # Router.try_acquire (ready, nothing queued) and acquire() (a wake, a queue) lead to the same answers.
    setup.router.at_once = at_once
    setup.fake.release_second_chunk.set()  # the stream ends at once
    async with http.post(setup.url + "/v1/chat/completions", headers=auth(), json={"model": "model-a"}) as response:
        assert response.status == 200
    async with http.post(setup.url + "/v1/chat/completions", headers=auth(),
                         json={"model": "model-a", "stream": True}) as response:
        assert response.status == 200 and b"[DONE]" in await response.read()
    # An engine that lacks the route, learned only once admitted (its entry said nothing yet).
    async with http.post(setup.url + "/v1/chat/completions", headers=auth(), json={"model": "model-native"}) as response:
        assert response.status == 404
        assert (await error_of(response))["code"] == "route_not_served"
    # Every admission given was released once.
    assert setup.router.in_flight == 0 and setup.router.released == setup.router.acquire_calls >= 3


async def test_client_disconnect_while_queued_leaves_the_queue(setup: Setup, http: aiohttp.ClientSession) -> None:
    setup.router.gate = asyncio.Event()  # a wake that never finishes
    client = asyncio.create_task(http.post(setup.url + "/v1/chat/completions", headers=auth(),
                                           json={"model": "model-a"}))
    await eventually(lambda: setup.router.waiting == 1, "the request queued")
    client.cancel()  # the client gives up: its connection closes
    await eventually(lambda: setup.router.waiting == 0, "the queue slot was given back")
    assert setup.router.in_flight == 0 and setup.fake.requests == []


async def test_engine_death_mid_stream_raises_in_the_openai_client(setup: Setup) -> None:
    setup.fake.stream_mode = "die"
    client = openai.AsyncOpenAI(base_url=setup.url + "/v1", api_key=ADMIN_KEY, max_retries=0)

    async def consume() -> list[str]:
        seen = []
        stream = await client.chat.completions.create(model="model-a", stream=True,
                                                      messages=[{"role": "user", "content": "hi"}])
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content)
        return seen

    try:
        with pytest.raises(openai.APIError) as caught:
            await asyncio.wait_for(consume(), HANG_GUARD)
    finally:
        await client.close()
    assert caught.value.code == "engine_unreachable"
    await eventually(lambda: setup.router.in_flight == 0, "admission released")


# ---------------------------------------------------------------- metrics

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    samples: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, f"not Prometheus text: {line!r}"
        name, labels, value = match.groups()
        pairs = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels or ""))
        samples[(name, pairs)] = math.inf if value == "+Inf" else float(value)
    return samples


async def test_metrics_count_requests(setup: Setup, http: aiohttp.ClientSession) -> None:
    setup.fake.body = b'{"ok": true}'
    for _ in range(3):
        async with http.post(setup.url + "/v1/chat/completions", headers=auth(), json={"model": "model-b"}) as r:
            assert r.status == 200
    async with http.post(setup.url + "/v1/chat/completions", headers=auth(), json={"model": "nope"}) as r:
        assert r.status == 404
    async with http.get(setup.url + "/metrics", headers=auth(SCOPED_KEY)) as r:
        assert r.status == 403
    async with http.get(setup.url + "/metrics", headers=auth()) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        samples = parse_metrics(await r.text())

    route = ("route", "/v1/chat/completions")
    assert samples[("capyctl_requests_total", frozenset({("deployment", "dep-b"), route, ("status", "200")}))] == 3
    assert samples[("capyctl_requests_total", frozenset({("deployment", ""), route, ("status", "404")}))] == 1
    dep_b = frozenset({("deployment", "dep-b"), route})
    assert samples[("capyctl_request_duration_seconds_count", dep_b)] == 3
    assert samples[("capyctl_request_duration_seconds_bucket", dep_b | {("le", "+Inf")})] == 3
    assert samples[("capyctl_wakes_total", frozenset({("deployment", "dep-b")}))] == 2
    assert samples[("capyctl_parks_total", frozenset({("deployment", "dep-a")}))] == 1
    assert samples[("capyctl_queue_depth", frozenset({("deployment", "dep-a")}))] == 0
    assert samples[("capyctl_in_flight", frozenset({("deployment", "dep-a")}))] == 0


def test_requests_are_counted_when_a_batch_is_full_or_at_a_scrape() -> None:
    metrics = ProxyMetrics()
    labels = {"deployment": "dep-a", "route": "/v1/chat/completions", "status": "200"}

    def record() -> None:
        metrics.record(deployment="dep-a", route="/v1/chat/completions", status=200, seconds=0.01)

    def counted() -> float:
        return metrics.registry.get_sample_value("capyctl_requests_total", labels) or 0.0

    for _ in range(PENDING_MAX - 1):
        record()
    assert counted() == 0  # recorded, not yet counted
    record()  # the batch is full
    assert counted() == PENDING_MAX
    record()
    samples = parse_metrics(metrics.render({}).decode())  # a scrape counts what is pending
    assert samples[("capyctl_requests_total", frozenset(labels.items()))] == PENDING_MAX + 1
    histogram = frozenset({("deployment", "dep-a"), ("route", "/v1/chat/completions")})
    assert samples[("capyctl_request_duration_seconds_count", histogram)] == PENDING_MAX + 1
    assert samples[("capyctl_request_duration_seconds_bucket", histogram | {("le", "0.01")})] == PENDING_MAX + 1


# ---------------------------------------------------------------- /v1/systemone

SYSTEMONE_QUESTIONS = {
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "route": {"type": "choice", "instructions": "Which team?",
              "criteria": {"billing": "money matters", "shipping": None, "technical": None}},
    "urgency": {"type": "score", "instructions": "How urgent?",
                "criteria": ["can wait", "this week", "today", "right now"]},
}


@pytest.mark.parametrize("questions, path", [
    ({}, "questions"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": {"only": None}}}, "questions.q.criteria"),
    ({"q": {"type": "score", "instructions": "x", "criteria": ["one"]}}, "questions.q.criteria"),
    ({"q": {"type": "maybe", "instructions": "x"}}, "questions.q.type"),
    ({"q": {"type": "noul"}}, "questions.q.instructions"),
    ({"q": {"type": "noul", "instructions": "x", "criteria": {"perhaps": "y"}}}, "questions.q.criteria.perhaps"),
])
async def test_systemone_validation_is_422_with_the_field_path(
        setup: Setup, http: aiohttp.ClientSession, questions: dict, path: str) -> None:
    request = {"model": "model-a", "state": "text", "questions": questions}
    async with http.post(setup.url + "/v1/systemone", headers=auth(), json=request) as response:
        assert response.status == 422
        error = await error_of(response)
    assert error["code"] == "invalid_systemone_request"
    assert error["param"] == path
    assert error["message"].startswith(path + ":")
    assert setup.router.acquire_calls == 0  # a bad request wakes nothing


async def test_systemone_from_logprobs(setup: Setup, http: aiohttp.ClientSession) -> None:
    ln = math.log
    setup.fake.top_logprobs = {
        # yes-like 0.6 + 0.1, no-like 0.2; "Maybe" stands for no option
        "noul": [{"token": "Yes", "logprob": ln(0.6)}, {"token": " yes", "logprob": ln(0.1)},
                 {"token": "No", "logprob": ln(0.2)}, {"token": "Maybe", "logprob": ln(0.05)}],
        # A 0.5, B 0.3 (as a letter and as the label's start), C absent: floor = 0.02 / 10
        "choice": [{"token": "A", "logprob": ln(0.5)}, {"token": "B", "logprob": ln(0.2)},
                   {"token": "ship", "logprob": ln(0.1)}, {"token": "x", "logprob": ln(0.02)}],
        # levels 0..3: "2" 0.6, "3" 0.3, "1" 0.05, "0" absent: floor = 0.05 / 10; "7" is no level
        "score": [{"token": "2", "logprob": ln(0.6)}, {"token": "3", "logprob": ln(0.3)},
                  {"token": "1", "logprob": ln(0.05)}, {"token": "7", "logprob": ln(0.05)}],
    }
    request = {"model": "model-a", "state": {"message": "I was charged twice!"}, "questions": SYSTEMONE_QUESTIONS}
    async with http.post(setup.url + "/v1/systemone", headers=auth(), json=request) as response:
        assert response.status == 200, await response.text()
        result = await response.json()

    assert result["model"] == "model-a"
    assert result["usage"] == {"input_tokens": 30, "output_tokens": 3}
    answers = result["answers"]
    assert answers["angry"] == {"type": "noul", "noul": pytest.approx(0.7 / 0.9)}

    choice = answers["route"]
    masses = {"billing": 0.5, "shipping": 0.3, "technical": 0.002}
    expected = {k: v / sum(masses.values()) for k, v in masses.items()}
    assert choice["type"] == "choice" and choice["choice"] == "billing"
    assert choice["probabilities"] == pytest.approx(expected)
    assert choice["confidence"] == pytest.approx((expected["billing"] - 1 / 3) / (1 - 1 / 3))

    score = answers["urgency"]
    masses_s = [0.005, 0.05, 0.6, 0.3]
    probs = [m / sum(masses_s) for m in masses_s]
    assert score["type"] == "score"
    assert score["legend"] == {"0": "can wait", "1": "this week", "2": "today", "3": "right now"}
    assert score["probabilities"] == pytest.approx({str(i): p for i, p in enumerate(probs)})
    assert score["score"] == pytest.approx(sum(i * p for i, p in enumerate(probs)))
    dist = sum(p * abs(i - 2) for i, p in enumerate(probs))
    assert score["confidence"] == pytest.approx(1 - dist / sum(abs(i - 1.5) / 4 for i in range(4)))

    asked = [json.loads(body) for path, _, body in setup.fake.requests]
    assert len(asked) == 3
    for payload in asked:
        assert payload["model"] == "engine-name-a"
        assert (payload["max_tokens"], payload["temperature"], payload["logprobs"], payload["top_logprobs"]) == \
            (1, 0, True, 20)
        assert "I was charged twice!" in payload["messages"][-1]["content"]
    assert setup.router.in_flight == 0 and setup.router.released == 1


async def test_systemone_passes_through_to_a_native_engine(setup: Setup, http: aiohttp.ClientSession) -> None:
    setup.fake.body = b'{"model": "clef", "answers": {"angry": {"type": "noul", "noul": 0.25}}, "usage": ' \
                      b'{"input_tokens": 9, "output_tokens": 0}}'
    request = {"model": "model-native", "state": "s", "questions": {"angry": SYSTEMONE_QUESTIONS["angry"]}}
    async with http.post(setup.url + "/v1/systemone", headers=auth(), json=request) as response:
        assert response.status == 200
        assert await response.read() == setup.fake.body
    assert setup.fake.requests[-1][0] == "/v1/systemone"


async def test_systemone_unsupported_without_logprobs_or_native_route(
        setup: Setup, http: aiohttp.ClientSession) -> None:
    request = {"model": "model-b", "state": "s", "questions": {"angry": SYSTEMONE_QUESTIONS["angry"]}}
    async with http.post(setup.url + "/v1/systemone", headers=auth(SCOPED_KEY), json=request) as response:
        assert response.status == 400
        assert (await error_of(response))["code"] == "systemone_unsupported"
    assert setup.fake.requests == []


async def test_systemone_engine_error_is_reported(setup: Setup, http: aiohttp.ClientSession) -> None:
    setup.fake.top_logprobs = {}  # the fake engine fails on every question (KeyError -> 500)
    request = {"model": "model-a", "state": "s", "questions": SYSTEMONE_QUESTIONS}
    async with http.post(setup.url + "/v1/systemone", headers=auth(), json=request) as response:
        assert response.status == 502
        assert (await error_of(response))["code"] == "engine_error"
    assert setup.router.in_flight == 0


async def test_request_timeout_bounds_the_upstream_exchange(setup: Setup, http: aiohttp.ClientSession) -> None:
    # The fake engine never sends its second chunk (nobody sets the event) and a
    # non-streaming request to /v1/completions waits on the same event.
    async def never(request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")
    slow_app = web.Application()
    slow_app.router.add_post("/v1/completions", never)
    slow_runner, slow_url = await _start(slow_app)
    router = FakeRouter({"slow": Upstream("dep-slow", slow_url, None, "custom", frozenset({"completions"})),
                         "model-a": setup.router.upstreams["model-a"]})
    runner, url = await _start(build_app(router, None, request_timeout=0.5))
    try:
        async with http.post(url + "/v1/completions", json={"model": "slow"}) as response:
            assert response.status == 504
            assert (await error_of(response))["code"] == "engine_timeout"
        async with http.post(url + "/v1/chat/completions", json={"model": "model-a", "stream": True}) as response:
            assert response.status == 200  # headers went out before the bound was reached
            text = await response.text()
        assert text.startswith(sse_chunk("first").decode())
        assert json.loads(text.rstrip().rsplit("data: ", 1)[1])["error"]["code"] == "engine_timeout"
        assert router.in_flight == 0
    finally:
        await runner.cleanup()
        await slow_runner.cleanup()


async def test_a_request_looks_up_its_one_model_where_the_router_can(setup: Setup,
                                                                      http: aiohttp.ClientSession) -> None:
    """A Router with model_entry is asked for the request's model only: models() (every deployment
    and alias) is not built per request."""
    asked: list[str] = []

    def model_entry(model: str) -> ModelEntry | None:
        asked.append(model)
        return next((e for e in FakeRouter.models(setup.router) if e.id == model), None)

    setup.router.model_entry = model_entry  # type: ignore[attr-defined]
    setup.router.models = lambda: pytest.fail("models() was built for one request")  # type: ignore[method-assign]
    body = {"model": "model-b", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(setup.url + "/v1/chat/completions", json=body, headers=auth()) as response:
        assert response.status == 200
    assert asked == ["model-b"]


async def test_a_request_to_an_engine_stopped_hung_is_sent_again_where_the_router_says(
        setup: Setup, http: aiohttp.ClientSession) -> None:
    # A replica's engine hung and CapyCTL's watchdog stopped it: the broken connection carries the
    # watchdog's verdict (engine_unresponsive), and Router.engine_lost sends the request to a sibling.
    sibling = setup.router.upstreams["model-a"]
    hung = CapyError("the engine of 'dep-a' did not answer its health check; CapyCTL stopped it",
                     code="engine_unresponsive", status=502)
    async with engine_lost_with_its_host() as port:
        setup.router.upstreams["model-a"] = dataclasses.replace(sibling, base_url=f"http://127.0.0.1:{port}",
                                                                host="b", verdict=lambda: hung)
        setup.router.moves["dep-a"] = sibling
        async with http.post(setup.url + "/v1/chat/completions", headers=auth(), json={"model": "model-a"}) as response:
            assert response.status == 200, await response.text()
            assert await response.read() == setup.fake.body
    assert setup.router.lost_asked == ["b"] and len(setup.fake.requests) == 1
    # No sibling to send it to: the verdict is what the client reads.
    async with engine_lost_with_its_host() as port:
        setup.router.upstreams["model-a"] = dataclasses.replace(sibling, base_url=f"http://127.0.0.1:{port}",
                                                                host="b", verdict=lambda: hung)
        async with http.post(setup.url + "/v1/chat/completions", headers=auth(), json={"model": "model-a"}) as response:
            assert response.status == 502 and (await error_of(response))["code"] == "engine_unresponsive"
