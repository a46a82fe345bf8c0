"""The proxy's front (capyctl/proxy/_front.py), spoken to byte by byte over raw loopback sockets.

Which server answered shows in the answer: aiohttp's server names itself in a ``Server``
header, the front sends none. The engine is a small aiohttp app in this file; the Router is
test_proxy's fake, with one model. tests/unit/test_proxy.py runs the proxy's whole behaviour through the front
and through aiohttp's server alike; this file is about what only the front does: framing,
keep-alive, pipelining, handing a connection to aiohttp, idle closing, shutdown.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from dataclasses import dataclass
from typing import AsyncIterator

import pytest
from aiohttp import web
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from capyctl.proxy import KeyGrant, StaticKeys, Upstream, build_app, serve
from capyctl.proxy import _front
from tests.unit.test_proxy import FakeRouter, eventually

KEY = "sk-front"
HANG_GUARD = 10.0  # seconds; only reached when the behaviour under test is broken
MAX_BODY = 4096
FLOOD_EVENTS = 8192  # 8 MiB of events: twice what Linux lets a socket's send buffer grow to (tcp_wmem)


@dataclass
class Proxy:
    host: str
    port: int
    runner: web.AppRunner
    release: asyncio.Event  # lets a "slow" stream finish
    engine_saw: list[dict]
    flood_written: asyncio.Event  # the engine wrote the last event of a "flood"

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port)


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    release = asyncio.Event()
    engine_saw: list[dict] = []
    flood_written = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        engine_saw.append(body)
        said = body["messages"][0]["content"]
        if said == "wait":
            await asyncio.wait_for(release.wait(), HANG_GUARD)
        if said == "refuse":  # the launch key refused
            return web.json_response({"error": "bad key"}, status=401)
        if said == "vanish":  # the engine closes the connection without a byte of answer
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if said == "die":  # ... or halfway through its answer's body
            response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
            await response.prepare(request)
            await response.write(b'{"object": ')
            assert request.transport is not None
            request.transport.abort()
            return response
        if not body.get("stream") and said != "sse":  # "sse": a stream though none was asked for
            return web.json_response({"object": "chat.completion", "echo": said})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps({"echo": said}).encode() + b"\n\n")
        if said == "slow":
            await asyncio.wait_for(release.wait(), HANG_GUARD)
        if said == "flood":  # FLOOD_EVENTS events of 1 KiB, each write waiting for the socket
            for n in range(FLOOD_EVENTS):
                await response.write(b"data: %05d " % n + b"x" * 1012 + b"\n\n")
            flood_written.set()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    engine_app = web.Application()
    engine_app.router.add_post("/v1/chat/completions", chat)
    engine = await serve(engine_app, host_port="127.0.0.1:0")
    engine_host, engine_port = engine.addresses[0][:2]
    upstream = Upstream("dep", f"http://{engine_host}:{engine_port}", "launch", "llama.cpp", frozenset({"chat"}))
    app = build_app(FakeRouter({"m": upstream}), StaticKeys({KEY: KeyGrant("t")}), max_body=MAX_BODY)
    runner = await serve(app, host_port="127.0.0.1:0")
    host, port = runner.addresses[0][:2]
    try:
        yield Proxy(host, port, runner, release, engine_saw, flood_written)
    finally:
        release.set()
        await runner.cleanup()
        await engine.cleanup()


def chat_request(said: str, *, stream: bool = False, extra: str = "", key: str = KEY) -> bytes:
    body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": said}]}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def by_aiohttp(self) -> bool:
        return "server" in self.headers


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """One HTTP/1.1 answer: status, headers, and its body by Content-Length or chunks."""
    async def go() -> Answer:
        status_line = await reader.readline()
        assert status_line.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")), status_line  # aiohttp's 400s are 1.0
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(status_line.split()[1])
        if status == 100:
            return await go()
        if headers.get("transfer-encoding") == "chunked":
            chunks = bytearray()
            while size := int((await reader.readline()).strip(), 16):
                chunks += await reader.readexactly(size)
                assert await reader.readexactly(2) == b"\r\n"
            assert await reader.readexactly(2) == b"\r\n"
            body = bytes(chunks)
        else:
            body = await reader.readexactly(int(headers.get("content-length", "0")))
        return Answer(status, headers, body)
    return await asyncio.wait_for(go(), HANG_GUARD)


async def closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(1), HANG_GUARD) == b""


async def test_json_and_get_routes_are_answered_by_the_front_on_one_kept_alive_connection(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    for request, check in (
        (b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n", lambda a: json.loads(a.body) == {"status": "ok"}),
        (chat_request("one"), lambda a: json.loads(a.body)["echo"] == "one"),
        (f"GET /v1/models HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode(),
         lambda a: json.loads(a.body)["data"][0]["id"] == "m"),
        (chat_request("two", stream=True), lambda a: a.body.endswith(b"data: [DONE]\n\n") and b'"two"' in a.body),
        (chat_request("three"), lambda a: json.loads(a.body)["echo"] == "three"),
    ):
        writer.write(request)
        answer = await read_answer(reader)
        assert answer.status == 200 and check(answer), answer
        assert not answer.by_aiohttp and answer.headers["date"].endswith("GMT")
    writer.close()


async def test_errors_from_the_front_have_the_openai_shape(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("x", key="sk-wrong"))
    answer = await read_answer(reader)
    assert (answer.status, json.loads(answer.body)["error"]["code"]) == (401, "invalid_api_key")
    assert answer.headers["content-type"] == "application/json; charset=utf-8" and not answer.by_aiohttp
    body = b'{"model": "nope"}'
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    answer = await read_answer(reader)
    assert (answer.status, json.loads(answer.body)["error"]["code"]) == (404, "model_not_found")
    writer.close()


async def test_pipelined_requests_are_answered_in_order(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("first", stream=True) + chat_request("second") + chat_request("third", stream=True))
    echoes = [(await read_answer(reader)).body for _ in range(3)]
    assert b'"first"' in echoes[0] and json.loads(echoes[1])["echo"] == "second" and b'"third"' in echoes[2]
    writer.close()


async def test_a_request_that_arrives_byte_by_byte_is_answered(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    for byte in chat_request("slowly"):
        writer.write(bytes([byte]))
        await writer.drain()
    answer = await read_answer(reader)
    assert json.loads(answer.body)["echo"] == "slowly" and not answer.by_aiohttp
    writer.close()


@pytest.mark.parametrize(("odd_request", "keeps_connection"), [
    pytest.param(b"GET /nope HTTP/1.1\r\nHost: p\r\n\r\n", True, id="unknown-route"),
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n0\r\n\r\n", True, id="chunked-body"),
    pytest.param(b"DELETE /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Length: 0\r\n\r\n", True,
                 id="other-method"),
    # Heads aiohttp's parser refuses: it answers 400 and closes the connection.
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
                 False, id="two-lengths"),
    pytest.param(b"GET /health HTTP/1.1\r\n\r\n", False, id="no-host"),
    pytest.param(b"GET /nope HTTP/1.1\r\nHost: p\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", True,
                 id="upgrade"),
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Length: " + b"0" * 5000 + b"2\r\n\r\n{}", True, id="5000-digit-length"),
])
async def test_any_other_request_hands_the_connection_to_aiohttp_with_nothing_lost(
        proxy: Proxy, odd_request: bytes, keeps_connection: bool) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("before"))
    before = await read_answer(reader)
    assert json.loads(before.body)["echo"] == "before" and not before.by_aiohttp
    # The odd request and an ordinary one behind it in the same write: both reach aiohttp's server.
    writer.write(odd_request + chat_request("after"))
    odd = await read_answer(reader)
    assert odd.by_aiohttp and odd.status >= 400
    if odd.headers.get("content-type", "").startswith("application/json"):
        assert json.loads(odd.body)["error"]["code"]
    if keeps_connection:
        after = await read_answer(reader)
        assert after.by_aiohttp and json.loads(after.body)["echo"] == "after"
    else:
        assert odd.status == 400 and await closed(reader)
    writer.close()


async def test_expect_100_continue_and_http_1_0_are_left_to_aiohttp(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("x", extra="Expect: 100-continue\r\n"))
    answer = await read_answer(reader)
    assert answer.by_aiohttp and json.loads(answer.body)["echo"] == "x"
    writer.close()
    reader, writer = await proxy.connect()
    writer.write(chat_request("old").replace(b"HTTP/1.1", b"HTTP/1.0", 1))
    status_line = await asyncio.wait_for(reader.readline(), HANG_GUARD)
    assert status_line.split()[1] == b"200"
    writer.close()


async def test_a_body_over_max_body_is_refused_413_without_waiting_for_it(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1))
    answer = await read_answer(reader)
    assert (answer.status, json.loads(answer.body)["error"]["code"]) == (413, "request_too_large")
    writer.close()


async def test_connection_close_is_honoured(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("bye", extra="Connection: close\r\n"))
    answer = await read_answer(reader)
    assert json.loads(answer.body)["echo"] == "bye" and answer.headers["connection"] == "close"
    assert not answer.by_aiohttp and await closed(reader)
    writer.close()


async def test_an_idle_connection_is_closed_after_the_keepalive_time(proxy: Proxy,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_front, "KEEPALIVE_S", 0.2)
    reader, writer = await proxy.connect()
    writer.write(chat_request("once"))
    assert json.loads((await read_answer(reader)).body)["echo"] == "once"
    assert await closed(reader)
    writer.close()


async def test_shutdown_lets_a_stream_in_flight_finish_and_closes_idle_connections(proxy: Proxy) -> None:
    idle_reader, idle_writer = await proxy.connect()
    idle_writer.write(b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n")
    await read_answer(idle_reader)
    reader, writer = await proxy.connect()
    writer.write(chat_request("slow", stream=True))
    first = await asyncio.wait_for(reader.readuntil(b"\n\n"), HANG_GUARD)  # headers and the first event
    assert b'"slow"' in first
    cleanup = asyncio.create_task(proxy.runner.cleanup())
    assert await closed(idle_reader)
    assert not cleanup.done()
    proxy.release.set()
    rest = await asyncio.wait_for(reader.read(), HANG_GUARD)  # to the end: the connection is closed after it
    assert b"data: [DONE]" in rest and rest.endswith(b"0\r\n\r\n")
    await asyncio.wait_for(cleanup, HANG_GUARD)
    writer.close()
    idle_writer.close()


@pytest.mark.parametrize("warm", [False, True], ids=["engine-connection-new", "engine-connection-kept-alive"])
async def test_a_client_that_leaves_mid_stream_cancels_the_engine_request(proxy: Proxy, warm: bool) -> None:
    # (kept alive: the request is sent without a task, the stream relayed by one from its head on)
    reader, writer = await (_warm(proxy) if warm else proxy.connect())
    writer.write(chat_request("slow", stream=True))
    await asyncio.wait_for(reader.readuntil(b"\n\n"), HANG_GUARD)
    router = proxy.runner.app[_front.STATE].router
    assert router.in_flight == 1
    writer.close()
    # The admission slot is given back without the engine finishing.
    await eventually(lambda: router.in_flight == 0, "the admission given back")
    assert not proxy.release.is_set()


async def test_metrics_count_requests_the_front_answered(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("counted"))
    await read_answer(reader)
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    metrics = (await read_answer(reader)).body.decode()
    assert any(line.startswith("capyctl_requests_total{") and 'route="/v1/chat/completions"' in line
               and 'deployment="dep"' in line and 'status="200"' in line and line.endswith(" 1.0")
               for line in metrics.splitlines()), metrics
    writer.close()


class _ClosingTransport:
    """The client's transport as it is between a failed write and connection_lost: closing."""

    def __init__(self, real: asyncio.Transport) -> None:
        self._real = real

    def is_closing(self) -> bool:
        return True

    def __getattr__(self, name: str):
        return getattr(self._real, name)


async def test_an_answer_for_a_connection_already_closing_counts_as_client_closed(
        proxy: Proxy, caplog: pytest.LogCaptureFixture) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("wait"))
    front = next(site for site in proxy.runner.sites if isinstance(site, _front.FrontSite))._front
    assert front is not None

    async def in_flight() -> _front.FrontConnection:
        while not (busy := [c for c in front.connections if c._task is not None]):
            await asyncio.sleep(0.01)
        return busy[0]
    connection = await asyncio.wait_for(in_flight(), HANG_GUARD)
    connection._transport = _ClosingTransport(connection._transport)  # type: ignore[assignment]
    task = connection._task
    proxy.release.set()  # the engine answers; writing it finds the connection closing
    await asyncio.wait_for(task, HANG_GUARD)  # ends without an exception
    assert not [r for r in caplog.records if "unexpected error" in r.getMessage()]
    metrics = proxy.runner.app[_front.STATE].metrics.render({}).decode()
    assert 'status="499"' in metrics and 'route="/v1/chat/completions"' in metrics, metrics
    writer.close()  # (the real transport stays open here: only the wrapper says it is closing)


# ---------------------------------------------------------------- answered without a task (the lane)

async def _warm(proxy: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose first request left an idle kept-alive connection to the engine."""
    reader, writer = await proxy.connect()
    writer.write(chat_request("warm"))
    assert (await read_answer(reader)).status == 200
    return reader, writer


def _front_of(proxy: Proxy) -> _front._Front:
    front = next(site for site in proxy.runner.sites if isinstance(site, _front.FrontSite))._front
    assert front is not None
    return front


async def test_a_request_to_a_ready_engine_is_answered_without_a_task(
        proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    reader, writer = await _warm(proxy)

    async def no_task(*_: object) -> None:
        raise AssertionError("answered in a task")
    monkeypatch.setattr(_front.FrontConnection, "_answer", no_task)
    writer.write(chat_request("one") + chat_request("two"))  # pipelined: in order, each without a task
    for said in ("one", "two"):
        answer = await read_answer(reader)
        assert answer.status == 200 and json.loads(answer.body)["echo"] == said and not answer.by_aiohttp
    assert proxy.runner.app[_front.STATE].router.in_flight == 0
    writer.close()


@pytest.mark.parametrize(("said", "status", "code"), [
    ("refuse", 502, "engine_auth_failed"),
    ("die", 502, "engine_unreachable"),
])
async def test_an_engine_failing_a_request_sent_without_a_task_is_answered_as_in_one(
        proxy: Proxy, said: str, status: int, code: str) -> None:
    reader, writer = await _warm(proxy)
    writer.write(chat_request(said))
    answer = await read_answer(reader)
    assert (answer.status, json.loads(answer.body)["error"]["code"]) == (status, code)
    writer.write(chat_request("after"))  # the connection goes on
    assert json.loads((await read_answer(reader)).body)["echo"] == "after"
    assert proxy.runner.app[_front.STATE].router.in_flight == 0
    writer.close()


async def test_a_kept_alive_engine_connection_closed_before_answering_is_sent_once_more(proxy: Proxy) -> None:
    # As EnginePool.request does: on a reused connection closed without a byte of answer the request
    # was never read; it is sent once more on a new connection (here the engine closes that one too).
    reader, writer = await _warm(proxy)
    writer.write(chat_request("vanish"))
    answer = await read_answer(reader)
    assert (answer.status, json.loads(answer.body)["error"]["code"]) == (502, "engine_unreachable")
    assert [body["messages"][0]["content"] for body in proxy.engine_saw].count("vanish") == 2
    assert proxy.runner.app[_front.STATE].router.in_flight == 0
    writer.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream-asked", "stream-not-asked"])
async def test_an_event_stream_sent_without_a_task_is_relayed_as_a_stream(proxy: Proxy, stream: bool) -> None:
    reader, writer = await _warm(proxy)
    writer.write(chat_request("sse", stream=stream))
    answer = await read_answer(reader)
    assert answer.status == 200 and answer.headers["content-type"] == "text/event-stream"
    assert answer.body.endswith(b"data: [DONE]\n\n")
    writer.write(chat_request("after"))
    assert json.loads((await read_answer(reader)).body)["echo"] == "after"
    writer.close()


async def test_a_stream_sent_without_a_task_is_relayed_event_by_event_from_the_engines_callbacks(
        proxy: Proxy) -> None:
    reader, writer = await _warm(proxy)
    writer.write(chat_request("slow", stream=True))
    status_line = await asyncio.wait_for(reader.readline(), HANG_GUARD)
    assert status_line.split()[1] == b"200"
    while (await asyncio.wait_for(reader.readline(), HANG_GUARD)) != b"\r\n":
        pass
    size = int(await asyncio.wait_for(reader.readline(), HANG_GUARD), 16)
    first = await asyncio.wait_for(reader.readexactly(size), HANG_GUARD)
    assert first == b'data: {"echo": "slow"}\n\n'  # before the engine's stream ends
    [connection] = [c for c in _front_of(proxy).connections if c.busy]
    assert connection._task is None and connection._lane is not None and connection._lane.relay is not None
    proxy.release.set()
    assert await asyncio.wait_for(reader.readexactly(2), HANG_GUARD) == b"\r\n"
    rest = b""
    while size := int(await asyncio.wait_for(reader.readline(), HANG_GUARD), 16):
        rest += await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readexactly(2)
    assert rest == b"data: [DONE]\n\n"
    writer.write(chat_request("after"))  # the connections, the client's and the engine's, go on
    assert json.loads((await read_answer(reader)).body)["echo"] == "after"
    writer.close()


async def test_a_client_slower_than_its_stream_pauses_the_engine_instead_of_filling_memory(proxy: Proxy) -> None:
    reader, writer = await _warm(proxy)
    # The client reads nothing for a while. Small socket buffers on the proxy's side and the
    # client's, so that the kernel holds little of the stream there.
    def buffer_size(sock: socket.socket, option: int, size: int) -> None:
        sock.setsockopt(socket.SOL_SOCKET, option, size)
    front = _front_of(proxy)
    [connection] = list(front.connections)
    assert connection._transport is not None
    [engine_connection] = [c for idle in front.pool._idle.values() for c in idle]
    sockets = [(writer.transport.get_extra_info("socket"), socket.SO_RCVBUF),
               (connection._transport.get_extra_info("socket"), socket.SO_SNDBUF),
               (engine_connection.transport.get_extra_info("socket"), socket.SO_RCVBUF)]
    for sock, option in sockets:
        buffer_size(sock, option, 64 * 1024)
    writer.write(chat_request("flood", stream=True))
    await eventually(lambda: connection._lane is not None and connection._lane.engine_paused,
                     "the engine connection paused")
    await asyncio.sleep(0.3)
    assert not proxy.flood_written.is_set()  # the engine waits for the client ...
    assert connection._transport.get_write_buffer_size() < 1 << 20  # ... rather than the proxy buffering 8 MiB
    # Now the client reads, through buffers of a usual size.
    for sock, option in sockets:
        buffer_size(sock, option, 1 << 20)
    answer = await read_answer(reader)
    events = answer.body.split(b"\n\n")
    assert events[0] == b'data: {"echo": "flood"}'
    assert [e[6:11] for e in events[1:-2]] == [b"%05d" % n for n in range(FLOOD_EVENTS)]
    assert events[-2:] == [b"data: [DONE]", b""]
    assert proxy.flood_written.is_set() and connection._lane is None
    writer.write(chat_request("after"))  # the engine connection went back to the pool reading
    assert json.loads((await read_answer(reader)).body)["echo"] == "after"
    writer.close()


async def test_a_client_that_leaves_before_its_answer_without_a_task_releases_and_counts_499(proxy: Proxy) -> None:
    reader, writer = await _warm(proxy)
    front = _front_of(proxy)
    writer.write(chat_request("wait"))
    await eventually(lambda: any(c._lane is not None and c._task is None for c in front.connections),
                     "the request sent without a task")
    router = proxy.runner.app[_front.STATE].router
    assert router.in_flight == 1
    writer.close()
    await eventually(lambda: router.in_flight == 0, "the admission given back")  # without the engine answering
    assert not proxy.release.is_set()
    metrics = proxy.runner.app[_front.STATE].metrics.render({}).decode()
    assert 'status="499"' in metrics, metrics


async def test_shutdown_waits_for_an_answer_under_way_without_a_task(proxy: Proxy) -> None:
    reader, writer = await _warm(proxy)
    writer.write(chat_request("wait"))
    front = _front_of(proxy)
    await eventually(lambda: any(c._lane is not None for c in front.connections), "the request under way")
    cleanup = asyncio.create_task(proxy.runner.cleanup())
    await asyncio.sleep(0.1)
    assert not cleanup.done()
    proxy.release.set()
    answer = await read_answer(reader)
    assert answer.status == 200 and answer.headers.get("connection") == "close"
    assert json.loads(answer.body)["echo"] == "wait"
    await asyncio.wait_for(cleanup, HANG_GUARD)
    assert await closed(reader)
    writer.close()


async def test_a_client_gone_before_its_engine_connection_opens_gives_its_admission_back(
        proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    # Admitted at once, but no idle engine connection yet: a task connects, with the admission kept.
    # When the client's close comes with its request, that task is cancelled before its first step
    # (none of its code runs): the admission is still given back, and the engine is never asked.
    taken = []
    lane = _front.FrontConnection._try_lane

    def lane_then_gone(self: _front.FrontConnection, head: object, body: bytes) -> bool:
        answered = lane(self, head, body)  # type: ignore[arg-type]
        if answered and self._task is not None:
            taken.append(self._task)
            self.connection_lost(None)  # as uvloop calls it when the close is read in the same batch
        return answered
    monkeypatch.setattr(_front.FrontConnection, "_try_lane", lane_then_gone)
    reader, writer = await proxy.connect()
    writer.write(chat_request("never"))
    router = proxy.runner.app[_front.STATE].router
    await eventually(lambda: taken and not router.in_flight and router.released == router.acquire_calls,
                     "the admission given back")
    assert taken[0].cancelled() and router.acquire_calls == 1
    assert proxy.engine_saw == []
    writer.close()


# ---------------------------------------------------------------- reading heads

_HEAD_NAMES = ["Authorization", "x-api-key", "Connection", "Content-Type", "Content-Encoding", "X-Stainless-Os",
               "Host", "Content-Length"]
_VALUE_CHARS = st.sampled_from(list("aZ09 ,;:=/?#%\"()\t") + ["\x80", "\xe9", "\xff"])
# One change that takes a usual head off the usual form, at a place of hypothesis' choice.
_ODD_PIECES = {
    "value": ["\x00", "\x01", "\x7f", "\r", "\n", "\x1b"],
    "name": [" ", "(", "\xe9", "\x01", "@", ""],
    "separator": [" :", "\t", "", " "],
    "request": ["POST  /", "PUT /", "post /", "GET http://p/", "GET * HTTP/1.1\r\n", "POST /\x01", "POST /a b",
                "POST /v1/chat/completions HTTP/1.0", "POST /v1/chat/completions HTTP/1.1 ", "GET /x#f", "GET /\"q\""],
    "line": [" folded", "\tfolded", "no-colon", ":empty-name"],
}


@st.composite
def _request_heads(draw: st.DrawFn, odd_ones: bool = True) -> bytes:
    """A usual head, or (``odd_ones``) one with a change a client (or an attacker) might make in it."""
    method = draw(st.sampled_from(["POST", "GET"]))
    target = draw(st.sampled_from(["/v1/chat/completions", "/health", "/v1/models?x=1&y=%20", "/v1/embeddings"]))
    # What the front needs (a Host, a length), then other headers, a repeated one now and then.
    # (Without odd ones, heads the front takes: a length within max_body, no second length, no encoding.)
    longest = 2 * MAX_BODY if odd_ones else MAX_BODY
    names = _HEAD_NAMES if odd_ones else [name for name in _HEAD_NAMES if not name.startswith("Content-")]
    fields = [["Host", ": ", "p"]] + ([["Content-Length", ": ", str(draw(st.integers(0, longest)))]]
                                     if method == "POST" else [])
    fields += [[name, draw(st.sampled_from([":", ": ", ":\t "])), draw(st.text(_VALUE_CHARS, max_size=8))]
               for name in draw(st.lists(st.sampled_from(names), max_size=5))]
    draw(st.randoms()).shuffle(fields)
    request_line = f"{method} {target} HTTP/1.1"
    kind = draw(st.sampled_from(["none", *_ODD_PIECES])) if odd_ones else "none"
    odd = draw(st.sampled_from(_ODD_PIECES[kind])) if kind != "none" else ""
    if kind == "request":
        request_line = odd if " HTTP/" in odd else odd + "x HTTP/1.1"
    elif kind == "line":
        fields.insert(draw(st.integers(0, len(fields))), [odd, "", ""])
    elif fields and kind != "none":
        field = draw(st.sampled_from(fields))
        where = {"name": 0, "separator": 1, "value": 2}[kind]
        text = field[where]
        at = draw(st.integers(0, len(text)))
        field[where] = odd if kind == "separator" else text[:at] + odd + text[at:]
    head = "\r\n".join([request_line] + ["".join(field) for field in fields]) + "\r\n\r\n"
    data = head.encode("latin-1")
    return data[:data.find(b"\r\n\r\n") + 4]  # as the front cuts it: at the first blank line


@settings(max_examples=500, deadline=None)
@given(_request_heads())
def test_a_head_read_the_quick_way_is_answered_exactly_as_when_httptools_reads_it(head: bytes) -> None:
    # The regular expressions take a subset of what llhttp takes (anything else goes to httptools);
    # what they take becomes the same request for the front (or is left to aiohttp alike): the same
    # route, headers and length. (They leave some values to the front's own checks, which llhttp
    # refuses itself: "Content-Length: x".)
    quick = _front._read_usual_head(head)
    if quick is not None:
        assert _front._front_head(head, quick, MAX_BODY) == _front._front_head(head, _front._read_any_head(head), MAX_BODY)


def test_the_usual_heads_are_read_the_quick_way_and_repeated_headers_by_httptools() -> None:
    usual = chat_request("x").split(b"\r\n\r\n")[0] + b"\r\n\r\n"
    assert _front._read_usual_head(usual) is not None
    health = b"GET /health?full=1 HTTP/1.1\r\nHost: p\r\nX-Empty:\r\nX-Spaces: a b \t\r\n\r\n"
    assert _front._read_usual_head(health) == (b"GET", "/health", {"host": "p", "x-empty": "", "x-spaces": "a b \t"})
    repeated = b"GET /health HTTP/1.1\r\nHost: p\r\nAccept: a\r\naccept: b\r\n\r\n"
    assert _front._read_usual_head(repeated) is None
    head = _front.read_head(repeated, MAX_BODY)
    assert head is not None and head.headers["accept"] == "a, b"  # joined, as before
    two_keys = b"GET /health HTTP/1.1\r\nHost: p\r\nX-Api-Key: a\r\nx-api-key: b\r\n\r\n"
    assert _front.read_head(two_keys, MAX_BODY) is None  # left to aiohttp


@settings(max_examples=500, deadline=None)
@given(_request_heads(odd_ones=False), st.data())
def test_a_head_read_from_the_connections_memo_is_the_head_read_afresh(first: bytes, data: st.DataObject) -> None:
    # What a client's SDK sends next on its connection: the same head with another length (say
    # one with leading zeros, one past max_body, or one that is no number), the same bytes, or
    # any other head. Whatever the memo answers is what reading the head afresh answers.
    head = _front.read_head(first, MAX_BODY)
    assume(head is not None)
    memo = _front._HeadMemo(first, head)
    kind = data.draw(st.sampled_from(["length", "same", "other"]))
    if kind == "same":
        second = first
    elif kind == "length":
        digits = data.draw(st.sampled_from(["0", "7", "0012", str(MAX_BODY), str(MAX_BODY + 1), "9" * 19, "1 ",
                                            "x", "", "١"]))
        second = re.sub(rb"(?i)(\r\ncontent-length:[ \t]*)[^\r]*", lambda m: m[1] + digits.encode(), first, count=1)
    else:
        second = data.draw(_request_heads())
    remembered = memo.read(second, MAX_BODY)
    if remembered is not None:
        assert remembered == _front.read_head(second, MAX_BODY)
    if kind == "same":
        assert remembered is head


async def test_each_request_on_a_connection_is_checked_though_its_head_is_remembered(proxy: Proxy) -> None:
    # The memo spares reading a head again, not checking it: a key changed between two requests of
    # one connection is refused, a body over max_body refused, and the lengths kept apart.
    reader, writer = await proxy.connect()
    for said, key, status in (("one", KEY, 200), ("two", "sk-wrong", 401), ("three!", KEY, 200), ("4", KEY, 200)):
        writer.write(chat_request(said, key=key))
        answer = await read_answer(reader)
        assert answer.status == status and not answer.by_aiohttp, answer
        if status == 200:
            assert json.loads(answer.body)["echo"] == said
    writer.write(chat_request("x" * MAX_BODY))
    assert (await read_answer(reader)).status == 413
    writer.close()


def test_a_long_head_off_the_usual_form_is_refused_without_backtracking() -> None:
    # Possessive quantifiers: 60 KB of whitespace before a character no value may hold is one pass,
    # not a search over every way to split the whitespace.
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nX: a" + b" \t" * 30_000 + b"\x01\r\n\r\n"
    assert _front._read_usual_head(head) is None
