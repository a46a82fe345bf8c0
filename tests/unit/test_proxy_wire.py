"""The proxy's door as a client sees it on the wire, spoken to byte by byte over raw loopback sockets.

The proxy is served as the daemon serves it (``serve``: aiohttp's web server reads every request).
The engine is a small aiohttp app in this file, or a raw one that misbehaves; the Router is
test_proxy's fake, with one model. tests/unit/test_proxy.py runs the proxy's behaviour through an
HTTP client; this file is about framing, keep-alive, pipelining, idle closing, shutdown, and
bounds whatever the client or the engine does. Each test runs on asyncio's loop and on uvloop's,
the daemon's (tests/conftest.py, pytest_asyncio_loop_factories).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import json
import socket
import struct
import termios
import tracemalloc
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import pytest
from aiohttp import web

from capyctl.proxy import DoorSettings, KeyGrant, StaticKeys, Upstream, build_app, serve
from capyctl.proxy._app import POOL, STATE
from tests.unit.test_proxy import FakeRouter, eventually

KEY = "sk-wire"
HANG_GUARD = 10.0  # seconds; only reached when the behaviour under test is broken
MAX_BODY = 4096
FLOOD_EVENTS = 8192  # 8 MiB of events: twice what Linux lets a socket's send buffer grow to (tcp_wmem)


@dataclass
class Flood:
    """How far the engine got with a "flood" answer: the events it wrote, and its socket."""
    sent: int = 0
    sock: socket.socket | None = None


@dataclass
class Proxy:
    host: str
    port: int
    runner: web.AppRunner
    release: asyncio.Event  # lets a "slow" stream finish
    engine_saw: list[dict]
    flood_written: asyncio.Event  # the engine wrote the last event of a "flood"
    flood: Flood = field(default_factory=Flood)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port)


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    release = asyncio.Event()
    engine_saw: list[dict] = []
    flood_written = asyncio.Event()
    flood = Flood()

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
            assert request.transport is not None
            flood.sock = request.transport.get_extra_info("socket")
            for n in range(FLOOD_EVENTS):
                await response.write(b"data: %05d " % n + b"x" * 1012 + b"\n\n")
                flood.sent = n + 1
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
    runner = await serve(app, host_port="127.0.0.1:0", door=DoorSettings())  # as the daemon serves it
    host, port = runner.addresses[0][:2]
    try:
        yield Proxy(host, port, runner, release, engine_saw, flood_written, flood)
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


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """One HTTP/1.1 answer: status, headers, and its body by Content-Length or chunks."""
    return await asyncio.wait_for(_read_answer(reader), HANG_GUARD)


async def _read_answer(reader: asyncio.StreamReader) -> Answer:
    status = 100
    while status == 100:  # (an interim answer: the final one follows)
        status_line = await reader.readline()
        assert status_line.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")), status_line  # aiohttp's 400s are 1.0
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(status_line.split()[1])
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


async def closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(1), HANG_GUARD) == b""


def unread(sock: socket.socket) -> int:
    """Bytes the kernel holds for ``sock`` that its owner has not read (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def unsent(sock: socket.socket) -> int:
    """Bytes written to ``sock`` that the kernel has not sent yet: the peer has no room (TIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


async def health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """/health asked and answered on another client's connection: the proxy's loop has taken its
    turns meanwhile, reading every socket it still reads."""
    writer.write(b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n")
    assert (await read_answer(reader)).status == 200


async def test_json_and_get_routes_are_answered_on_one_kept_alive_connection(proxy: Proxy) -> None:
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
        assert answer.headers["date"].endswith("GMT")
    writer.close()


async def test_errors_have_the_openai_shape(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("x", key="sk-wrong"))
    answer = await read_answer(reader)
    assert (answer.status, json.loads(answer.body)["error"]["code"]) == (401, "invalid_api_key")
    assert answer.headers["content-type"] == "application/json; charset=utf-8"
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
    assert json.loads(answer.body)["echo"] == "slowly"
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
async def test_an_odd_request_is_answered_and_the_request_behind_it_read_as_its_own(
        proxy: Proxy, odd_request: bytes, keeps_connection: bool) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("before"))
    before = await read_answer(reader)
    assert json.loads(before.body)["echo"] == "before"
    # The odd request and an ordinary one behind it in the same write.
    writer.write(odd_request + chat_request("after"))
    odd = await read_answer(reader)
    assert odd.status >= 400
    if odd.headers.get("content-type", "").startswith("application/json"):
        assert json.loads(odd.body)["error"]["code"]
    if keeps_connection:
        after = await read_answer(reader)
        assert json.loads(after.body)["echo"] == "after"
    else:
        assert odd.status == 400 and await closed(reader)
    writer.close()


async def test_expect_100_continue_and_http_1_0_are_answered(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("x", extra="Expect: 100-continue\r\n"))
    answer = await read_answer(reader)
    assert json.loads(answer.body)["echo"] == "x"
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
    router = proxy.runner.app[STATE].router
    assert router.in_flight == 1
    writer.close()
    # The admission slot is given back without the engine finishing.
    await eventually(lambda: router.in_flight == 0, "the admission given back")
    assert not proxy.release.is_set()


async def test_metrics_count_each_request(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    writer.write(chat_request("counted"))
    await read_answer(reader)
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    metrics = (await read_answer(reader)).body.decode()
    assert any(line.startswith("capyctl_requests_total{") and 'route="/v1/chat/completions"' in line
               and 'deployment="dep"' in line and 'status="200"' in line and line.endswith(" 1.0")
               for line in metrics.splitlines()), metrics
    writer.close()


# ---------------------------------------------------------------- on a kept-alive engine connection

async def _warm(proxy: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose first request left an idle kept-alive connection to the engine."""
    reader, writer = await proxy.connect()
    writer.write(chat_request("warm"))
    assert (await read_answer(reader)).status == 200
    return reader, writer


def _client_connections(proxy: Proxy) -> list[asyncio.Transport]:
    """The transports of the client connections aiohttp's server holds now."""
    server = proxy.runner.server
    assert server is not None
    return [handler.transport for handler in server.connections if handler.transport is not None]


@pytest.mark.parametrize(("said", "status", "code"), [
    ("refuse", 502, "engine_auth_failed"),
    ("die", 502, "engine_unreachable"),
])
async def test_an_engine_failing_a_request_is_answered_and_the_connection_goes_on(
        proxy: Proxy, said: str, status: int, code: str) -> None:
    reader, writer = await _warm(proxy)
    writer.write(chat_request(said))
    answer = await read_answer(reader)
    assert (answer.status, json.loads(answer.body)["error"]["code"]) == (status, code)
    writer.write(chat_request("after"))  # the connection goes on
    assert json.loads((await read_answer(reader)).body)["echo"] == "after"
    assert proxy.runner.app[STATE].router.in_flight == 0
    writer.close()


async def test_a_kept_alive_engine_connection_closed_before_answering_is_sent_once_more(proxy: Proxy) -> None:
    # As EnginePool.request does: on a reused connection closed without a byte of answer the request
    # was never read; it is sent once more on a new connection (here the engine closes that one too).
    reader, writer = await _warm(proxy)
    writer.write(chat_request("vanish"))
    answer = await read_answer(reader)
    assert (answer.status, json.loads(answer.body)["error"]["code"]) == (502, "engine_unreachable")
    assert [body["messages"][0]["content"] for body in proxy.engine_saw].count("vanish") == 2
    assert proxy.runner.app[STATE].router.in_flight == 0
    writer.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream-asked", "stream-not-asked"])
async def test_an_event_stream_is_relayed_as_a_stream(proxy: Proxy, stream: bool) -> None:
    reader, writer = await _warm(proxy)
    writer.write(chat_request("sse", stream=stream))
    answer = await read_answer(reader)
    assert answer.status == 200 and answer.headers["content-type"] == "text/event-stream"
    assert answer.body.endswith(b"data: [DONE]\n\n")
    writer.write(chat_request("after"))
    assert json.loads((await read_answer(reader)).body)["echo"] == "after"
    writer.close()


async def test_a_stream_is_relayed_event_by_event(proxy: Proxy) -> None:
    reader, writer = await _warm(proxy)
    writer.write(chat_request("slow", stream=True))
    status_line = await asyncio.wait_for(reader.readline(), HANG_GUARD)
    assert status_line.split()[1] == b"200"
    while (await asyncio.wait_for(reader.readline(), HANG_GUARD)) != b"\r\n":
        pass
    size = int(await asyncio.wait_for(reader.readline(), HANG_GUARD), 16)
    first = await asyncio.wait_for(reader.readexactly(size), HANG_GUARD)
    assert first == b'data: {"echo": "slow"}\n\n'  # before the engine's stream ends
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


async def test_a_client_slower_than_its_stream_holds_the_engine_back_instead_of_filling_memory(
        proxy: Proxy) -> None:
    reader, writer = await _warm(proxy)
    # The client reads nothing for a while. Small socket buffers on the proxy's side and the
    # client's, so that the kernel holds little of the stream there.
    def buffer_size(sock: socket.socket, option: int, size: int) -> None:
        sock.setsockopt(socket.SOL_SOCKET, option, size)
    [connection] = _client_connections(proxy)
    [engine_connection] = proxy.runner.app[POOL].idle()
    sockets = [(writer.transport.get_extra_info("socket"), socket.SO_RCVBUF),
               (connection.get_extra_info("socket"), socket.SO_SNDBUF),
               (engine_connection.get_extra_info("socket"), socket.SO_RCVBUF)]
    for sock, option in sockets:
        buffer_size(sock, option, 64 * 1024)
    other = await proxy.connect()
    writer.write(chat_request("flood", stream=True))
    # Until the proxy holds the engine back for good, or the engine has written it all (what a
    # proxy that buffers lets it do): the client's socket full, the engine's answer left unread on
    # the proxy's engine socket, and nothing of it moving while another client is answered: not
    # what the proxy leaves unread, not what the engine's socket has yet to send, not the events
    # the engine has written.
    engine_socket = engine_connection.get_extra_info("socket")

    def engine_side() -> tuple[int, int, int]:
        assert proxy.flood.sock is not None
        return unread(engine_socket), unsent(proxy.flood.sock), proxy.flood.sent

    while not proxy.flood_written.is_set():
        await eventually(lambda: proxy.flood_written.is_set()
                         or (connection.get_write_buffer_size() > 0 and unread(engine_socket) > 0),
                         "the client's socket full, the engine's answer left unread")
        before = engine_side()
        await health(*other)
        if engine_side() == before and before[0] > 0 and not proxy.flood_written.is_set():
            break
    assert not proxy.flood_written.is_set()  # the engine waits for the client ...
    assert connection.get_write_buffer_size() < 1 << 20  # ... rather than the proxy buffering 8 MiB
    # Now the client reads, through buffers of a usual size.
    for sock, option in sockets:
        buffer_size(sock, option, 1 << 20)
    answer = await read_answer(reader)
    events = answer.body.split(b"\n\n")
    assert events[0] == b'data: {"echo": "flood"}'
    assert [e[6:11] for e in events[1:-2]] == [b"%05d" % n for n in range(FLOOD_EVENTS)]
    assert events[-2:] == [b"data: [DONE]", b""]
    assert proxy.flood_written.is_set()
    writer.write(chat_request("after"))  # the engine connection went back to the pool reading
    assert json.loads((await read_answer(reader)).body)["echo"] == "after"
    writer.close()
    other[1].close()


@pytest.mark.parametrize("warm", [False, True], ids=["engine-connection-new", "engine-connection-kept-alive"])
async def test_a_client_that_leaves_before_its_answer_releases_and_counts_499(proxy: Proxy, warm: bool) -> None:
    reader, writer = await (_warm(proxy) if warm else proxy.connect())
    writer.write(chat_request("wait"))
    router = proxy.runner.app[STATE].router
    await eventually(lambda: router.in_flight == 1 and proxy.engine_saw[-1]["messages"][0]["content"] == "wait",
                     "the request at the engine")
    writer.close()
    await eventually(lambda: router.in_flight == 0, "the admission given back")  # without the engine answering
    assert not proxy.release.is_set()
    metrics = proxy.runner.app[STATE].metrics.render({}).decode()
    assert 'status="499"' in metrics, metrics


async def test_shutdown_waits_for_an_answer_under_way(proxy: Proxy) -> None:
    reader, writer = await _warm(proxy)
    writer.write(chat_request("wait"))
    router = proxy.runner.app[STATE].router
    await eventually(lambda: router.in_flight == 1, "the request under way")
    [handler] = proxy.runner.server.connections  # (aiohttp's RequestHandler of the client's connection)
    cleanup = asyncio.create_task(proxy.runner.cleanup())
    # The shutdown comes to wait for the request's handler to end, with shutdown_timeout
    # (aiohttp 3.14, web_protocol.py, RequestHandler.shutdown: the future only the handler's end
    # resolves), or ends first if it does not wait.
    await eventually(lambda: cleanup.done() or handler._handler_waiter is not None,
                     "the shutdown waiting for the answer under way")
    assert not cleanup.done() and not reader.at_eof()
    proxy.release.set()
    answer = await read_answer(reader)
    assert answer.status == 200 and json.loads(answer.body)["echo"] == "wait"
    await asyncio.wait_for(cleanup, HANG_GUARD)
    assert await closed(reader)
    writer.close()


# ---------------------------------------------------------------- heads aiohttp's parser refuses

async def test_a_malformed_head_not_yet_whole_is_answered_at_once(proxy: Proxy) -> None:
    reader, writer = await proxy.connect()
    writer.write(b"GET /health HTTP/1.1\nHost: p\n\n")  # bare LF: never the blank line of a whole head
    answer = await read_answer(reader)
    assert answer.status == 400 and await closed(reader)
    writer.close()


async def test_a_head_ending_in_crlf_lf_never_makes_two_requests_one(proxy: Proxy) -> None:
    # httptools 0.6.0 to 0.6.2 (llhttp 8) took "\r\n\n" for the blank line: the body and a second
    # request line then read as one head, and the front of the time forwarded the JSON to the route
    # of the first. aiohttp's parser refuses the head.
    reader, writer = await proxy.connect()
    body = chat_request("x").partition(b"\r\n\r\n")[2]
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Length: %d\r\n\n" % len(body) + body + b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n")
    answer = await read_answer(reader)
    assert answer.status == 400 and await closed(reader)
    assert proxy.engine_saw == []
    writer.close()


async def test_each_request_on_a_connection_is_checked(proxy: Proxy) -> None:
    # A key changed between two requests of one connection is refused, a body over max_body
    # refused, and the lengths kept apart.
    reader, writer = await proxy.connect()
    for said, key, status in (("one", KEY, 200), ("two", "sk-wrong", 401), ("three!", KEY, 200), ("4", KEY, 200)):
        writer.write(chat_request(said, key=key))
        answer = await read_answer(reader)
        assert answer.status == status, answer
        if status == 200:
            assert json.loads(answer.body)["echo"] == said
    writer.write(chat_request("x" * MAX_BODY))
    assert (await read_answer(reader)).status == 413
    writer.close()


# ---------------------------------------------------------------- bounded, whatever the client or engine does

async def test_a_client_that_pipelines_and_never_reads_is_held_back_not_buffered(proxy: Proxy) -> None:
    # /openapi.json needs no key and its answer is some 770 times its request: a client with a small
    # receive buffer that pipelines it and never reads must fill its own buffers, not the proxy's memory.
    request = b"GET /openapi.json HTTP/1.1\r\nHost: p\r\n\r\n"
    other = await proxy.connect()  # another client, answered all along
    await health(*other)
    flood = socket.socket()
    flood.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    flood.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(flood, (proxy.host, proxy.port))
    await eventually(lambda: len(_client_connections(proxy)) == 2, "the flood's connection accepted")
    [connection] = [c for c in _client_connections(proxy) if c.get_extra_info("peername") == flood.getsockname()]
    proxy_side = connection.get_extra_info("socket")
    proxy_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the kernel holds few answers there either
    # What the proxy holds is what was allocated from here on and is still alive (tracemalloc:
    # Python's allocations, the transports' buffers and aiohttp's included; not the kernel's).
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        # As much as the sockets take, up to 4 MiB of requests; then until nothing moves while the
        # other client is answered: the proxy reads no more of it (or has read it all).
        sent, batch = 0, request * 1024
        while True:
            if sent < 4 << 20:
                try:
                    sent += flood.send(batch)
                    await asyncio.sleep(0)
                    continue
                except BlockingIOError:
                    pass
            before = unread(proxy_side), unsent(flood)
            await health(*other)
            if (unread(proxy_side), unsent(flood)) == before:
                break
        held = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert held < 1 << 20, f"{held / (1 << 20):.1f} MiB held after {sent} bytes of requests"
    assert unread(proxy_side) > 0  # the proxy left the rest to the kernel: it reads the client no further
    assert connection.get_write_buffer_size() < 1 << 20
    await health(*other)  # and the other client is still answered
    other[1].close()
    flood.close()


@contextlib.asynccontextmanager
async def _proxy_to_raw_engine(answer: Callable[[int], list[bytes]]) -> AsyncIterator[Proxy]:
    """The proxy before an engine that reads each request and writes ``answer(n)`` (the n-th
    request it read, from 0), piece by piece 50 ms apart: the ways an engine misbehaves."""
    count = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                pieces, count = answer(count), count + 1
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.05)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    engine = await asyncio.start_server(handle, "127.0.0.1", 0)
    engine_port = engine.sockets[0].getsockname()[1]
    upstream = Upstream("dep", f"http://127.0.0.1:{engine_port}", "launch", "llama.cpp", frozenset({"chat"}))
    app = build_app(FakeRouter({"m": upstream}), StaticKeys({KEY: KeyGrant("t")}), max_body=MAX_BODY)
    runner = await serve(app, host_port="127.0.0.1:0", door=DoorSettings())  # as the daemon serves it
    host, port = runner.addresses[0][:2]
    try:
        yield Proxy(host, port, runner, asyncio.Event(), [], asyncio.Event())
    finally:
        await runner.cleanup()
        engine.close()


def _json_answer(body: bytes, status: str = "200 OK") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body)


_TEAPOT = b"HTTP/1.1 418 I'm a teapot\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{\"tea\": \"pot\"}"


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-at-a-time", "pipelined"])
async def test_an_answer_nobody_asked_for_behind_the_engines_answer_never_reaches_a_client(pipelined: bool) -> None:
    # Each answer of the engine carries a teapot behind it in the same write (RFC 9112 6.3: the body
    # is exactly Content-Length octets). On a fresh engine connection (the first request), on a kept-
    # alive one (the next), and with the client's requests pipelined: each client gets its own answer.
    async with _proxy_to_raw_engine(lambda n: [_json_answer(b'{"n": %d}' % n) + _TEAPOT]) as proxy:
        reader, writer = await proxy.connect()
        answers = []
        if pipelined:
            writer.write(chat_request("a") + chat_request("b") + chat_request("c"))
            answers = [await read_answer(reader) for _ in range(3)]
        else:
            for said in "abc":
                writer.write(chat_request(said))
                answers.append(await read_answer(reader))
        assert [(a.status, json.loads(a.body)) for a in answers] == [(200, {"n": n}) for n in range(3)]
        writer.close()


@pytest.mark.parametrize("interim", [b"HTTP/1.1 100 Continue\r\n\r\n",
                                     b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"],
                         ids=["100-continue", "103-early-hints"])
async def test_an_engines_interim_answer_is_not_relayed_as_the_final_one(interim: bytes) -> None:
    # RFC 9110 15.2: a 1xx is interim; the final answer follows, here 50 ms later.
    async with _proxy_to_raw_engine(lambda n: [interim, _json_answer(b'{"n": %d}' % n)]) as proxy:
        reader, writer = await proxy.connect()
        for n in range(2):  # a fresh engine connection, then a kept-alive one
            writer.write(chat_request("x"))
            answer = await read_answer(reader)
            assert (answer.status, json.loads(answer.body)) == (200, {"n": n})
        writer.close()


async def test_an_answer_without_a_body_goes_without_content_length() -> None:
    # RFC 9110 8.6: no Content-Length in a 204 (nor a 1xx).
    async with _proxy_to_raw_engine(lambda n: [b"HTTP/1.1 204 No Content\r\n\r\n"]) as proxy:
        reader, writer = await proxy.connect()
        for _ in range(2):
            writer.write(chat_request("x"))
            status_line = await asyncio.wait_for(reader.readline(), HANG_GUARD)
            head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_GUARD)).lower()
            assert status_line.startswith(b"HTTP/1.1 204 ") and b"content-length" not in head
        writer.write(b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n")  # nothing stray was left on the connection
        assert (await read_answer(reader)).status == 200
        writer.close()


@pytest.mark.parametrize("request_bytes", [
    pytest.param(chat_request("x"), id="whole-answer"),
    pytest.param(chat_request("x", stream=True), id="stream"),
    pytest.param(b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n", id="get"),
])
async def test_a_request_leaves_no_garbage_cycles_behind(proxy: Proxy, request_bytes: bytes) -> None:
    # A request's objects freed by reference counting as its answer ends, not by the cycle collector
    # some generations later: under load, that is what kept a daemon's memory from staying flat.
    reader, writer = await _warm(proxy)
    gc.collect()
    gc.disable()
    try:
        for _ in range(200):
            writer.write(request_bytes)
            assert (await read_answer(reader)).status == 200
        left = gc.collect()
    finally:
        gc.enable()
    assert left < 20, f"{left} objects in reference cycles after 200 requests"
    writer.close()
