"""SSE comments to a streamed request while it waits for admission (issue 31, point 3).

A fake Router's acquire reports progress a few times, as the controller does during a wait or a
wake, then admits the request to a small fake engine (OpenAI chat chunks, Anthropic events). The
proxy runs on a real loopback socket through ``serve``; the official ``openai`` and ``anthropic``
clients read what it sends.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from capyctl.errors import CapyError, Unavailable
from capyctl.proxy import KeyGrant, StaticKeys, Upstream, build_app
from capyctl.proxy import _relay
from capyctl.proxy._exchange import Exchange
from tests.unit.test_proxy import HANG_GUARD, _start, sse_chunk
from tests.unit.test_proxy_routes import anthropic_events

KEY = "sk-admin"
HEADERS = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


# ---------------------------------------------------------------- fakes

@dataclass
class Engine:
    """A fake engine: chat chunks "Hello", " world" then [DONE]; Anthropic events; or a refusal."""

    mode: str = "ok"  # ok | refuse (400 JSON) | close (the connection closes before any answer)
    requests: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(request.path)
        if self.mode == "refuse":
            return web.json_response({"error": {"code": 400, "type": "invalid_request_error",
                                                "message": "the prompt is longer than the context"}}, status=400)
        if self.mode == "close":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if request.path == "/v1/messages/count_tokens":
            return web.json_response({"input_tokens": 3})
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": "Hello world"}}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if request.path == "/v1/messages":
            events = anthropic_events()
        else:
            events = [sse_chunk("Hello"), sse_chunk(" world"), b"data: [DONE]\n\n"]
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response


class WaitingRouter:
    """Admission after a wait that reports ``lines`` (seconds from the start of the wait, line),
    as the controller's acquire does; then ``failure`` is raised, or the request admitted."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.lines: list[tuple[float, str]] = []
        self.failure: CapyError | None = None
        self.progress_given: list[bool] = []  # per acquire: whether the proxy passed a callback
        self.in_flight = 0

    def models(self):
        return []

    def stats(self):
        return {}

    @asynccontextmanager
    async def acquire(self, model: str, progress: Callable[[str], None] | None = None) -> AsyncIterator[Upstream]:
        self.progress_given.append(progress is not None)
        started = time.monotonic()
        for at, line in self.lines:
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            if progress is not None:
                progress(line)
        if self.lines:
            await asyncio.sleep(0.05)  # (admitted a little after the last line)
        if self.failure is not None:
            raise self.failure
        self.in_flight += 1
        try:
            yield self.upstream
        finally:
            self.in_flight -= 1


class OldRouter(WaitingRouter):
    """A Router whose acquire takes no progress (written before it existed)."""

    @asynccontextmanager
    async def acquire(self, model: str) -> AsyncIterator[Upstream]:  # type: ignore[override]
        async with super().acquire(model) as upstream:
            yield upstream


def waking(seconds: float = 2.5, every: float = 0.25) -> list[tuple[float, str]]:
    """A wake that reports a line every ``every`` seconds for ``seconds``."""
    count = int(seconds / every)
    return [(i * every, f"waking m: step {i}") for i in range(count)]


# ---------------------------------------------------------------- fixtures

@dataclass
class Proxy:
    url: str
    engine: Engine
    router: WaitingRouter
    progress_on: dict[str, bool]


@asynccontextmanager
async def running(router_class: type[WaitingRouter] = WaitingRouter) -> AsyncIterator[Proxy]:
    engine = Engine()
    engine_app = web.Application()
    engine_app.router.add_route("*", "/{tail:.*}", engine.handle)
    engine_runner, engine_url = await _start(engine_app)
    router = router_class(Upstream("dep-m", engine_url, None, "llama.cpp", frozenset({"chat", "completions",
                                                                                       "messages", "responses"})))
    progress_on = {"on": True}
    app = build_app(router, StaticKeys({KEY: KeyGrant("admin")}), wait_progress=lambda: progress_on["on"])
    proxy_runner, proxy_url = await _start(app)
    try:
        yield Proxy(proxy_url, engine, router, progress_on)
    finally:
        await proxy_runner.cleanup()
        await engine_runner.cleanup()


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    async with running() as started:
        yield started


async def raw_stream(url: str, path: str = "/v1/chat/completions", body: dict | None = None
                     ) -> tuple[int, str, list[tuple[float, bytes]]]:
    """Status, Content-Type and the answer's lines, each with the time it arrived."""
    lines = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as http:
        async with http.post(url + path, headers=HEADERS, json=CHAT if body is None else body) as response:
            async for line in response.content:
                lines.append((time.monotonic(), line))
            return response.status, response.content_type, lines


@asynccontextmanager
async def tapped(url: str) -> AsyncIterator[tuple[str, bytearray]]:
    """A URL that reaches ``url`` through a relay recording what the proxy sends back, so that a
    test with an official client also sees that the comments were on the wire."""
    host, port = url.removeprefix("http://").split(":")
    wire = bytearray()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bool) -> None:
        try:
            while data := await reader.read(65536):
                if record:
                    wire.extend(data)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        proxy_reader, proxy_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(client_reader, proxy_writer, False), pipe(proxy_reader, client_writer, True))

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", wire
    finally:
        server.close()


def comments(lines: list[tuple[float, bytes]]) -> list[tuple[float, bytes]]:
    return [(at, line) for at, line in lines if line.startswith(b":")]


# ---------------------------------------------------------------- on the wire

async def test_comments_come_at_most_once_a_second_before_the_first_event(proxy: Proxy) -> None:
    proxy.router.lines = waking(2.5)
    status, content_type, lines = await raw_stream(proxy.url)
    assert status == 200 and content_type == "text/event-stream"
    said = comments(lines)
    # Ten lines over 2.5 s: the first at once, then the latest one each second.
    assert [line for _, line in said[:1]] == [b": waking m: step 0\n"]
    assert 2 <= len(said) <= 3, said
    for (before, _), (after, _) in zip(said, said[1:]):
        assert after - before >= 0.9, said
    assert all(line in {f": waking m: step {i}\n".encode() for i in range(10)} for _, line in said)
    first_event = next(i for i, (_, line) in enumerate(lines) if line.startswith(b"data:"))
    assert all(not line.startswith(b":") for _, line in lines[first_event:])
    assert lines[first_event - 1][1] == b"\n"  # a comment is a whole line and a blank line
    assert [line for _, line in lines if line.startswith(b"data:")][-1] == b"data: [DONE]\n"


async def test_a_line_break_in_a_line_does_not_end_the_comment(proxy: Proxy) -> None:
    proxy.router.lines = [(0.0, "waking m:\nunit started")]
    _, _, lines = await raw_stream(proxy.url)
    assert lines[0][1] == b": waking m: unit started\n" and lines[1][1] == b"\n"


async def test_a_request_not_streamed_gets_no_comments(proxy: Proxy) -> None:
    proxy.router.lines = waking(0.5)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as http:
        async with http.post(proxy.url + "/v1/chat/completions", headers=HEADERS,
                             json={**CHAT, "stream": False}) as response:
            assert response.status == 200 and response.content_type == "application/json"
            answer = json.loads(await response.read())  # (a comment before it would not parse)
    assert answer["choices"][0]["message"]["content"] == "Hello world"
    assert proxy.router.progress_given == [False]


async def test_a_route_that_does_not_stream_gets_no_comments(proxy: Proxy) -> None:
    proxy.router.lines = waking(0.5)
    _, content_type, lines = await raw_stream(proxy.url, "/v1/messages/count_tokens", {**CHAT, "stream": True})
    assert content_type == "application/json" and not comments(lines)
    assert json.loads(b"".join(line for _, line in lines)) == {"input_tokens": 3}
    assert proxy.router.progress_given == [False]


async def test_the_setting_turns_them_off_and_is_read_per_request(proxy: Proxy) -> None:
    proxy.router.lines = waking(0.5)
    proxy.progress_on["on"] = False
    _, _, lines = await raw_stream(proxy.url)
    assert not comments(lines) and lines[0][1].startswith(b"data:")
    assert proxy.router.progress_given == [False]
    proxy.progress_on["on"] = True  # as a reload of the configuration does
    _, _, lines = await raw_stream(proxy.url)
    assert comments(lines)


async def test_a_wait_without_progress_lines_sends_the_answer_as_before(proxy: Proxy) -> None:
    status, _, lines = await raw_stream(proxy.url)  # (no line: admitted without a report)
    assert status == 200 and not comments(lines) and lines[0][1].startswith(b"data:")


async def test_a_router_without_progress_still_admits() -> None:
    async with running(OldRouter) as proxy:
        proxy.router.lines = waking(0.5)
        status, _, lines = await raw_stream(proxy.url)
    assert status == 200 and not comments(lines)
    assert [line for _, line in lines if line.startswith(b"data:")][-1] == b"data: [DONE]\n"


# ---------------------------------------------------------------- the official clients

async def test_the_openai_client_reads_the_whole_stream_through_a_wait(proxy: Proxy) -> None:
    proxy.router.lines = waking(2.5)
    async with tapped(proxy.url) as (url, wire):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=HANG_GUARD)
        try:
            stream = await client.chat.completions.create(model="m", stream=True,
                                                          messages=[{"role": "user", "content": "hi"}])
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
        finally:
            await client.close()
    assert text == "Hello world"
    assert b": waking m: step 0\n\n" in wire
    assert proxy.router.progress_given == [True] and proxy.router.in_flight == 0


async def test_the_anthropic_client_reads_the_whole_stream_through_a_wait(proxy: Proxy) -> None:
    proxy.router.lines = waking(2.5)
    async with tapped(proxy.url) as (url, wire):
        client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0, timeout=HANG_GUARD)
        try:
            async with client.messages.stream(model="m", max_tokens=8,
                                              messages=[{"role": "user", "content": "hi"}]) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_message()
        finally:
            await client.close()
    assert b": waking m: step 0\n\n" in wire
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].type == "text" and final.content[0].text == "Hello"
    assert proxy.router.progress_given == [True]


# ---------------------------------------------------------------- a failure after the comments

WAKE_FAILED = Unavailable("The model 'm' could not wake: its unit failed.", code="wake_failed", retry_after=5)


# Each client raises the error event of a stream whose status was already 200 as its own error.
async def openai_stream_error(proxy: Proxy) -> openai.APIError:
    """The error the openai client raises, after the wait's comment (the router's one line) was sent."""
    async with tapped(proxy.url) as (url, wire):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=HANG_GUARD)
        try:
            stream = await client.chat.completions.create(model="m", stream=True,
                                                          messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(openai.APIError) as caught:
                async for _ in stream:
                    pass
        finally:
            await client.close()
    assert wire.startswith(b"HTTP/1.1 200 OK\r\n")
    assert f": {proxy.router.lines[0][1]}\n\n".encode() in wire and b'data: {"error": ' in wire
    return caught.value


async def anthropic_stream_error(proxy: Proxy) -> anthropic.APIStatusError:
    """The same with the anthropic client."""
    async with tapped(proxy.url) as (url, wire):
        client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0, timeout=HANG_GUARD)
        try:
            with pytest.raises(anthropic.APIStatusError) as caught:
                async with client.messages.stream(model="m", max_tokens=8,
                                                  messages=[{"role": "user", "content": "hi"}]) as stream:
                    await stream.get_final_message()
        finally:
            await client.close()
    assert wire.startswith(b"HTTP/1.1 200 OK\r\n")
    assert f": {proxy.router.lines[0][1]}\n\n".encode() in wire and b"event: error\n" in wire
    return caught.value


async def test_a_wake_that_fails_after_the_comments_ends_the_stream_with_an_error_event(proxy: Proxy) -> None:
    proxy.router.lines = [(0.0, "waking m: unit started")]
    proxy.router.failure = WAKE_FAILED
    status, _, lines = await raw_stream(proxy.url)
    assert status == 200  # committed by the comment
    wire = b"".join(line for _, line in lines)
    assert wire.startswith(b": waking m: unit started\n\n")
    event = json.loads(wire.split(b"\n\n")[1].removeprefix(b"data: "))
    assert event["error"]["code"] == "wake_failed" and event["error"]["type"] == "server_error"
    assert proxy.engine.requests == []

    error = await openai_stream_error(proxy)
    assert error.code == "wake_failed" and "could not wake" in error.message

    caught = await anthropic_stream_error(proxy)
    assert caught.body["error"]["type"] == "overloaded_error" and caught.body["error"]["code"] == "wake_failed"


async def test_an_engine_that_refuses_after_the_comments_is_an_error_event(proxy: Proxy) -> None:
    proxy.router.lines = [(0.0, "waiting for m: 1 request ahead")]
    proxy.engine.mode = "refuse"
    error = await openai_stream_error(proxy)
    assert error.code == "engine_error" and "longer than the context" in error.message
    assert error.type == "invalid_request_error"  # the engine's 400, in OpenAI's words
    caught = await anthropic_stream_error(proxy)
    assert caught.body["error"]["type"] == "invalid_request_error"
    assert "longer than the context" in caught.body["error"]["message"]


async def test_an_engine_that_breaks_off_after_the_comments_is_an_error_event(proxy: Proxy) -> None:
    proxy.router.lines = [(0.0, "waking m: unit started")]
    proxy.engine.mode = "close"
    error = await openai_stream_error(proxy)
    assert error.code == "engine_unreachable"
    caught = await anthropic_stream_error(proxy)
    assert caught.body["error"]["code"] == "engine_unreachable"
    assert proxy.router.in_flight == 0


async def test_an_error_before_any_comment_is_still_an_error_status(proxy: Proxy) -> None:
    proxy.router.failure = WAKE_FAILED  # no progress line before it
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as http:
        async with http.post(proxy.url + "/v1/chat/completions", headers=HEADERS, json=CHAT) as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "wake_failed"


# ---------------------------------------------------------------- a client that does not read

class StuckExchange(Exchange):
    """An Exchange whose client stopped reading: every write waits until ``unstick`` is set."""

    def __init__(self) -> None:
        super().__init__(None, None, None, make_mocked_request("POST", "/v1/chat/completions"))  # type: ignore[arg-type]
        self.started = 0
        self.written: list[bytes] = []
        self.wrote = asyncio.Event()  # set at each write (cleared by the test)
        self.unstick = asyncio.Event()
        self.writing = 0  # writes under way now
        self.most_writing = 0

    async def start_stream(self, status: int, headers: dict[str, str]) -> None:
        self.started += 1

    async def write(self, data: bytes) -> None:
        self.written.append(data)
        self.writing += 1
        self.most_writing = max(self.most_writing, self.writing)
        self.wrote.set()
        try:
            await self.unstick.wait()
        finally:
            self.writing -= 1


async def test_a_client_that_does_not_read_holds_one_line_not_all_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_relay, "PROGRESS_INTERVAL", 0.05)
    reply = StuckExchange()
    progress = _relay.WaitProgress(reply)
    try:
        for i in range(10_000):
            progress(f"waiting for m: {i} requests ahead")
            if i == 0:  # the first is being written: the client reads no more
                await asyncio.wait_for(reply.wrote.wait(), HANG_GUARD)
        assert reply.started == 1 and reply.written == [b": waiting for m: 0 requests ahead\n\n"]
        # And nothing more can be written until the client reads: the one task besides this
        # test's is the writer, and the one write under way is its own, which only unstick ends.
        assert len(asyncio.all_tasks() - {asyncio.current_task()}) == 1 and reply.writing == 1
        reply.wrote.clear()
        reply.unstick.set()  # the client reads again: the latest line follows, the others are gone
        await asyncio.wait_for(reply.wrote.wait(), HANG_GUARD)
        assert reply.written[1:] == [b": waiting for m: 9999 requests ahead\n\n"]
        assert await progress.stop()
        assert reply.most_writing == 1
    finally:
        progress.close()
