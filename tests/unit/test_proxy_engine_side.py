"""The proxy's own HTTP/1.1 client to engines (capyctl/proxy/_engine_side.py), against real servers:
aiohttp's server for well-behaved engines, raw asyncio servers for the ways an engine misbehaves."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

import pytest
from aiohttp import web

from capyctl.proxy import _engine_pool
from capyctl.proxy._engine_pool import EnginePool
from capyctl.proxy._engine_side import BUFFER_HIGH, AnswerState, EngineConnectionError


class _Engine:
    """An aiohttp engine on loopback that counts the connections it accepted."""

    def __init__(self) -> None:
        self.peers: set[object] = set()
        self.stream_ended_by_disconnect = asyncio.Event()
        self.app = web.Application(middlewares=[self.note_peer])
        self.app.router.add_post("/v1/echo", self.echo)
        self.app.router.add_get("/v1/stream", self.stream)
        self.app.router.add_get("/v1/big", self.big)
        self.runner = web.AppRunner(self.app)
        self.big_written = 0

    @web.middleware
    async def note_peer(self, request: web.Request, handler):
        assert request.transport is not None
        self.peers.add(request.transport.get_extra_info("peername"))
        return await handler(request)

    async def echo(self, request: web.Request) -> web.Response:
        return web.json_response({"body": (await request.read()).decode(), "path": request.path,
                                  "authorization": request.headers.get("Authorization"),
                                  "host": request.host})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)  # no Content-Length: chunked transfer coding
        try:
            for i in range(int(request.query.get("n", "3"))):
                await response.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(float(request.query.get("gap", "0")))
        except (asyncio.CancelledError, ConnectionError):
            self.stream_ended_by_disconnect.set()
            raise
        await response.write_eof()
        return response

    async def big(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        block = b"x" * 65536
        for _ in range(160):  # 10 MiB, far past what the client buffers
            await response.write(block)
            self.big_written += len(block)
        await response.write_eof()
        return response

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        assert site._server is not None
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    @property
    def connections(self) -> int:
        """How many connections carried requests (the client's ports, one a connection)."""
        return len(self.peers)

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest.fixture
async def engine():
    """The engine, its URL, and a pool to reach it."""
    e = _Engine()
    url = await e.start()
    pool = EnginePool(connect_timeout=5)
    yield e, url, pool
    pool.close()
    await e.stop()


async def test_a_request_and_its_answer_and_the_connection_is_reused(engine):
    e, url, pool = engine
    for n in range(3):
        answer = await pool.request("POST", url, "/v1/echo", f"hello {n}".encode(),
                                    {"Authorization": "Bearer k", "Content-Type": "application/json"})
        assert answer.status == 200 and answer.content_type == "application/json"
        body = await answer.json()
        assert body["body"] == f"hello {n}" and body["authorization"] == "Bearer k"
        assert body["host"] == url.removeprefix("http://")
        answer.close()
    assert e.connections == 1


async def test_a_base_url_with_a_path_prefix_keeps_it(engine):
    e, url, pool = engine
    # The engine serves /v1/echo; a base URL ending in /v1 and the path /echo reach it.
    answer = await pool.request("POST", url + "/v1/", "/echo", b"{}", {})
    assert (await answer.json())["path"] == "/v1/echo"


async def test_a_chunked_stream_arrives_event_by_event_and_its_connection_is_reused(engine):
    e, url, pool = engine
    answer = await pool.request("GET", url, "/v1/stream?n=3&gap=0.05", b"", {})
    assert answer.content_type == "text/event-stream"
    seen = []
    while chunk := await answer.readany():
        seen.append(chunk)
    assert b"".join(seen) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(seen) == 3  # each event as it was written, not the whole at the end
    answer.close()
    again = await pool.request("POST", url, "/v1/echo", b"x", {})
    assert (await again.json())["body"] == "x"
    assert e.connections == 1


async def test_an_answer_left_unfinished_drops_its_connection_so_the_engine_stops(engine):
    e, url, pool = engine
    answer = await pool.request("GET", url, "/v1/stream?n=1000&gap=0.01", b"", {})
    assert (await answer.readany()).startswith(b"data: 0")
    answer.close()
    await asyncio.wait_for(e.stream_ended_by_disconnect.wait(), 5)
    again = await pool.request("POST", url, "/v1/echo", b"y", {})
    assert (await again.json())["body"] == "y"
    assert e.connections == 2  # the unfinished one was not reused


async def test_a_slow_reader_pauses_the_engine_socket(engine):
    e, url, pool = engine
    answer = await pool.request("GET", url, "/v1/big", b"", {})
    await asyncio.sleep(0.5)  # nothing read: the engine must be held back, not the body buffered
    assert answer.buffered <= BUFFER_HIGH + 256 * 1024
    assert e.big_written < 10 * 1024 * 1024
    body = await answer.read()
    assert len(body) == 160 * 65536 and e.big_written == len(body)


@contextlib.asynccontextmanager
async def _raw_engine(handle) -> AsyncIterator[tuple[str, EnginePool]]:
    """An engine that is ``handle`` (asyncio streams) on loopback: its URL and a pool to reach it."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    pool = EnginePool(connect_timeout=5)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", pool
    finally:
        pool.close()
        server.close()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


async def test_a_pooled_connection_the_engine_closed_is_retried_once_on_a_new_one():
    accepted = []

    async def handle(reader, writer):
        accepted.append(writer)
        n = len(accepted)
        await _read_request(reader)
        body = b'{"connection": %d}' % n
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        if n == 1:
            # The next request on this kept-alive connection finds it closing, unanswered: the
            # race of an engine closing an idle connection as the proxy writes on it.
            await _read_request(reader)
            writer.close()
            return
        await reader.read()

    async with _raw_engine(handle) as (url, pool):
        first = await pool.request("POST", url, "/x", b"{}", {})
        assert await first.json() == {"connection": 1}
        second = await pool.request("POST", url, "/x", b"{}", {})
        assert await second.json() == {"connection": 2}
        assert len(accepted) == 2


async def test_the_retry_goes_out_on_a_new_connection_not_another_pooled_one():
    # llama-server closes a connection after a streamed answer, though its head said keep-alive
    # (cpp-httplib's chunked content provider): every pooled connection may be one it is closing.
    accepted = []
    both_answered = asyncio.Event()

    async def handle(reader, writer):
        accepted.append(writer)
        n = len(accepted)
        await _read_request(reader)
        if n <= 2:
            if n == 2:
                both_answered.set()
            await both_answered.wait()  # two requests at once: two connections in the pool
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            await _read_request(reader)  # the next request on it: read, never answered
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{\"fresh\": 1}  ")
        await writer.drain()
        await reader.read()

    async with _raw_engine(handle) as (url, pool):
        for answer in await asyncio.gather(*(pool.request("POST", url, "/x", b"{}", {}) for _ in range(2))):
            await answer.read()
            answer.close()
        assert len(pool.idle()) == 2
        answer = await pool.request("POST", url, "/x", b"{}", {})
        assert await answer.json() == {"fresh": 1} and len(accepted) == 3


async def test_a_fresh_connection_that_breaks_before_an_answer_is_an_error_not_a_retry():
    requests = []

    async def handle(reader, writer):
        requests.append(await _read_request(reader))
        writer.close()

    async with _raw_engine(handle) as (url, pool):
        with pytest.raises(EngineConnectionError, match="closed the connection"):
            await pool.request("POST", url, "/x", b"{}", {})
        assert len(requests) == 1  # never sent twice


async def test_an_answer_delimited_by_the_end_of_the_connection():
    async def handle(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async with _raw_engine(handle) as (url, pool):
        answer = await pool.request("POST", url, "/x", b"", {})
        assert await answer.read() == b"all of it"


async def test_a_stream_cut_midway_is_an_error_for_the_reader():
    async def handle(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        writer.close()  # no last chunk

    async with _raw_engine(handle) as (url, pool):
        answer = await pool.request("POST", url, "/x", b"", {})
        assert await answer.readany() == b"data: 1\n\n"
        with pytest.raises(EngineConnectionError):
            await answer.readany()


async def test_garbage_from_the_engine_is_an_error():
    async def handle(reader, writer):
        await _read_request(reader)
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()

    async with _raw_engine(handle) as (url, pool):
        with pytest.raises(EngineConnectionError, match="not valid HTTP"):
            await pool.request("POST", url, "/x", b"", {})


async def test_the_request_timeout_bounds_the_whole_exchange():
    accepted = []

    async def handle(reader, writer):
        accepted.append(writer)
        await _read_request(reader)
        if len(accepted) == 1:  # the first answers a little, the second nothing at all
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
            await writer.drain()
        await reader.read()  # until the client goes

    async with _raw_engine(handle) as (url, pool):
        answer = await pool.request("POST", url, "/x", b"", {}, timeout=0.3)
        assert await answer.readany() == b"a"
        with pytest.raises(TimeoutError):
            await answer.readany()
        with pytest.raises(TimeoutError):  # and an engine that never answers at all
            await pool.request("POST", url, "/x", b"", {}, timeout=0.3)


async def test_cancelled_while_waiting_drops_the_connection():
    closed = asyncio.Event()

    async def handle(reader, writer):
        await _read_request(reader)
        await reader.read()  # until the client goes
        closed.set()

    async with _raw_engine(handle) as (url, pool):
        waiting = asyncio.ensure_future(pool.request("POST", url, "/x", b"", {}))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(closed.wait(), 5)


async def test_an_engine_that_is_not_there(unused_tcp_port):
    pool = EnginePool(connect_timeout=5)
    with pytest.raises(EngineConnectionError, match="cannot connect"):
        await pool.request("POST", f"http://127.0.0.1:{unused_tcp_port}", "/x", b"", {})
    with pytest.raises(EngineConnectionError, match="cannot connect"):
        await pool.request("POST", "http://a.b.engine", "/x", b"", {}, unix_socket="/nonexistent/engine.sock")


async def test_an_idle_connection_older_than_the_keepalive_is_not_reused(engine, monkeypatch):
    e, url, pool = engine
    monkeypatch.setattr(_engine_pool, "ENGINE_KEEPALIVE_S", 0.2)
    (await pool.request("POST", url, "/v1/echo", b"1", {})).close()
    (await pool.request("POST", url, "/v1/echo", b"2", {})).close()
    assert e.connections == 1
    await asyncio.sleep(0.3)
    (await pool.request("POST", url, "/v1/echo", b"3", {})).close()
    assert e.connections == 2


async def test_a_unix_socket_engine(tmp_path):
    app = web.Application()

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"host": request.host, "body": (await request.read()).decode()})

    app.router.add_post("/v1/echo", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    path = str(tmp_path / "engine.sock")
    await web.UnixSite(runner, path).start()
    pool = EnginePool(connect_timeout=5)
    try:
        answer = await pool.request("POST", "http://l1.smol.engine", "/v1/echo", b"hi", {}, unix_socket=path)
        assert json.loads(await answer.read()) == {"host": "l1.smol.engine", "body": "hi"}
    finally:
        pool.close()
        await runner.cleanup()


async def test_a_base_url_that_cannot_be_reached_over_http_is_an_engine_error():
    pool = EnginePool(connect_timeout=5)
    for url in ("https://127.0.0.1:8000", "http://127.0.0.1:notaport", "http://"):
        with pytest.raises(EngineConnectionError):
            await pool.request("POST", url, "/x", b"", {})


# ---------------------------------------------------------------- answers read without the parser

# llama-server's head for a chat answer (its real bytes, read off a kept-alive connection).
_LLAMA_HEAD = (b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nAccess-Control-Allow-Origin: \r\n"
               b"Content-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n"
               b"Keep-Alive: timeout=5, max=100\r\n\r\n")
_TEAPOT = b"HTTP/1.1 418 I'm a teapot\r\nContent-Length: 7\r\n\r\nteapot!"


async def _answers_on_one_engine(answers: list[list[bytes]], *, between: float = 0.0,
                                 ) -> tuple[list[tuple[int, dict, bytes] | str], int]:
    """Each of ``answers`` (the pieces an engine writes, with a pause between them) for one request
    in turn, ``between`` seconds apart, on a kept-alive connection while the pool keeps one:
    (status, headers, body) as the pool reads them, or the error's class name; and how many
    connections the engine accepted."""
    accepted = 0
    queue = list(answers)

    async def handle(reader, writer):
        nonlocal accepted
        accepted += 1
        while queue:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            for piece in queue.pop(0):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.05)
        await reader.read()

    got: list[tuple[int, dict, bytes] | str] = []
    async with _raw_engine(handle) as (url, pool):
        for _ in answers:
            try:
                async with asyncio.timeout(10):  # (only reached when what is under test is broken)
                    answer = await pool.request("POST", url, "/x", b"{}", {})
                    body = await answer.read()
                got.append((answer.status, {name: answer.header(name) for name in ("content-type", "x-hint")},
                            body))
            except EngineConnectionError as exc:
                got.append(type(exc).__name__)
            await asyncio.sleep(between)
    return got, accepted


async def test_an_answer_with_another_behind_it_in_the_same_write_stands_and_its_connection_is_dropped():
    # RFC 9112 6.3: the body is exactly Content-Length octets; an answer nobody asked for behind it
    # makes the connection unusable. The first answer is read as sent (not the teapot's status with
    # both bodies joined), and the next request goes on a new connection, so the teapot never
    # passes for its answer.
    got, accepted = await _answers_on_one_engine([[_LLAMA_HEAD % 2 + b"{}" + _TEAPOT], [_LLAMA_HEAD % 2 + b"[]"]])
    assert [answer[0::2] for answer in got] == [(200, b"{}"), (200, b"[]")]  # type: ignore[index]
    assert accepted == 2


async def test_bytes_an_engine_sends_while_no_request_is_outstanding_drop_the_connection():
    got, accepted = await _answers_on_one_engine([[_LLAMA_HEAD % 2 + b"{}", _TEAPOT], [_LLAMA_HEAD % 2 + b"[]"]],
                                                 between=0.3)
    assert [answer[0::2] for answer in got] == [(200, b"{}"), (200, b"[]")]  # type: ignore[index]
    assert accepted == 2


async def test_a_connection_whose_answer_was_exact_is_reused():
    got, accepted = await _answers_on_one_engine([[_LLAMA_HEAD % 2 + b"{}"], [_LLAMA_HEAD % 2 + b"[]"]])
    assert [answer[0::2] for answer in got] == [(200, b"{}"), (200, b"[]")]  # type: ignore[index]
    assert accepted == 1


async def test_a_stray_crlf_after_an_answer_leaves_the_answer_as_it_was():
    # (llhttp skips empty lines before a status line, as RFC 9112 2.2 asks of a reader of requests;
    # either way the answer is the one the engine sent.)
    got, _ = await _answers_on_one_engine([[_LLAMA_HEAD % 2 + b"{}\r\n"], [_LLAMA_HEAD % 2 + b"[]"]])
    assert [answer[0::2] for answer in got] == [(200, b"{}"), (200, b"[]")]  # type: ignore[index]


@pytest.mark.parametrize("interim", [
    pytest.param(b"HTTP/1.1 100 Continue\r\n\r\n", id="100-continue"),
    pytest.param(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\nX-Hint: early\r\n\r\n",
                 id="103-early-hints"),
    pytest.param(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n", id="two-interims"),
])
async def test_an_interim_answer_is_dropped_and_the_final_one_read(interim: bytes):
    # RFC 9110 15.2: a 1xx is interim; the final answer follows (here 50 ms later, and with it at once).
    for pieces in ([interim, _LLAMA_HEAD % 2 + b"{}"], [interim + _LLAMA_HEAD % 2 + b"{}"]):
        got, accepted = await _answers_on_one_engine([pieces, [_LLAMA_HEAD % 2 + b"[]"]])
        assert got == [(200, {"content-type": "application/json; charset=utf-8", "x-hint": None}, b"{}"),
                       (200, {"content-type": "application/json; charset=utf-8", "x-hint": None}, b"[]")]
        assert accepted == 1


async def test_switching_protocols_is_an_error():
    got, _ = await _answers_on_one_engine([[b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n"
                                            b"Connection: Upgrade\r\n\r\n"]])
    assert got == ["EngineConnectionError"]


async def test_a_body_cut_short_is_an_error():
    async def handle(reader, writer):
        for cut in (False, True):
            await _read_request(reader)
            writer.write(_LLAMA_HEAD % 10 + (b"{}" if cut else b'{"a": 123}'))
            await writer.drain()
        writer.close()

    async with _raw_engine(handle) as (url, pool):
        assert await (await pool.request("POST", url, "/x", b"", {})).read() == b'{"a": 123}'
        answer = await pool.request("POST", url, "/x", b"", {})
        with pytest.raises(EngineConnectionError, match="closed the connection"):
            await answer.read()
        assert answer.state is AnswerState.FAILED and isinstance(answer.error, EngineConnectionError)


async def test_an_answer_followed_by_more_bytes_is_read_whole_and_its_connection_dropped():
    # The engine sends its answer and a teapot in one write: the answer is read once, whole, and
    # the connection, which would hand the teapot to the next request, is not kept.
    async def handle(reader, writer):
        await _read_request(reader)
        writer.write(_LLAMA_HEAD % 2 + b"{}")
        await writer.drain()
        await _read_request(reader)
        writer.write(_LLAMA_HEAD % 2 + b"[]" + _TEAPOT)
        await writer.drain()
        await reader.read()

    async with _raw_engine(handle) as (url, pool):
        (await pool.request("POST", url, "/x", b"", {})).close()
        [kept] = pool.idle()
        answer = await pool.request("POST", url, "/x", b"", {})
        assert answer.status == 200 and await answer.read() == b"[]"
        answer.close()
        assert pool.idle() == [] and not kept.reusable
