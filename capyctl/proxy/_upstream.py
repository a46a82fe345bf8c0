"""The proxy's HTTP/1.1 client to engines: one request's bytes out, the answer's bytes back.

Why not aiohttp's ClientSession (which the controller and the form route still use): on the
proxy's path it was most of CapyCTL's own CPU per request (benchmarks/proxy_hop.py, its
py-spy profile): a ClientRequest, URL and header objects, timers, a task and a StreamReader
per request, for an exchange that here is "write these bytes, hand back what comes". This
client writes the request head and body in one ``transport.write`` and parses the answer
with ``httptools`` (llhttp, the parser Node.js uses; a well-kept C library), which also
undoes chunked transfer coding.

What it keeps from the session it replaces:

- a pool of idle keep-alive connections per engine base URL (a unix-socket engine's URL is a
  per-launch label, so a restarted engine's connections are never reused), each kept at most
  ``ENGINE_KEEPALIVE_S`` (connector.py says why that must be under the engine's own);
- a request sent on a pooled connection that the engine closed before answering a single byte
  is sent once more on a new connection (the engine closed an idle connection as we wrote:
  it never read the request);
- an answer not read to its end is never pooled: ``close()`` drops its connection, so the
  engine sees the disconnect and stops generating;
- reading pauses while more than ``BUFFER_HIGH`` bytes wait for the client, so a slow client
  slows the engine's socket rather than filling the proxy's memory.

Errors are :class:`EngineConnectionError` (the engine could not be reached, or the connection
broke) and ``TimeoutError`` (connect timeout, or the exchange's deadline).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import re
import time
import urllib.parse
from typing import Any, Callable

try:
    import httptools
except ImportError:  # a platform without its wheel: the proxy uses aiohttp's client (make_engine_pool)
    httptools = None  # type: ignore[assignment]

from .connector import ENGINE_KEEPALIVE_S

# Bytes of an answer buffered for the client before the engine's socket is read no further.
BUFFER_HIGH = 256 * 1024
# Idle connections kept per engine: enough for a burst of concurrent requests to find one.
IDLE_PER_ENGINE_MAX = 256


class EngineConnectionError(ConnectionError):
    """The engine could not be reached, or its connection broke before the answer was whole."""


# A Content-Length field whose value is digits alone: where a head's length sits, for the memos
# of heads that repeat but for their lengths (_AnswerHeadMemo; the front's _HeadMemo).
_LENGTH_FIELD = re.compile(rb"\r\ncontent-length:[ \t]*+([0-9]++)\r\n", re.IGNORECASE)


def split_at_length(head: bytes, length: bytes) -> tuple[bytes, bytes] | None:
    """``head``'s bytes before and after its Content-Length's digits, when the field in the plain
    form is the one a parser read as ``length``; else None (no such field, or another form)."""
    found = _LENGTH_FIELD.search(head)
    if found is None or found[1] != length:
        return None
    return head[:found.start(1)], head[found.end(1):]


def length_between(data: bytes, prefix: bytes, suffix: bytes) -> tuple[int, bytes] | None:
    """(where the head ends, its length's digits) when ``data`` starts with a head that is
    ``prefix``, digits (at most 18: llhttp takes leading zeros, int() no end of them) and ``suffix``
    (a remembered head's parts around its length: split_at_length); else None."""
    if not data.startswith(prefix):
        return None
    start = len(prefix)
    end = data.find(b"\r\n", start)
    digits = data[start:end]
    if end < 0 or not data.startswith(suffix, end) or not (digits.isdigit() and len(digits) <= 18):
        return None  # (bytes.isdigit: ASCII digits alone)
    return end + len(suffix), digits


class _AnswerHeadMemo:
    """The last answer head a connection got, as llhttp read it, so that the next answer whose head
    is the same bytes but for its Content-Length's digits is read without the parser: an engine
    answers one route alike (llama-server: "Server", "Access-Control-Allow-Origin", "Content-Type",
    "Content-Length", "Keep-Alive: timeout=5, max=100"), and llhttp's callbacks into Python, one a
    header and three more an answer, cost more cold than this check: 15 µs of CPU less per request
    (474-495 against 458-480) under benchmarks/proxy_vs_nginx.py's load, the engine's work leaving
    the caches cold. Only a head with a length, no transfer coding and a kept-alive connection is
    remembered; its body is then counted out here."""

    __slots__ = ("prefix", "suffix", "status", "headers")

    def __init__(self, prefix: bytes, suffix: bytes, status: int, headers: dict[bytes, bytes]) -> None:
        self.prefix, self.suffix, self.status, self.headers = prefix, suffix, status, headers

    @classmethod
    def of(cls, head: bytes, response: EngineResponse) -> _AnswerHeadMemo | None:
        """The memo of ``head`` (status line to blank line) as the parser read it into ``response``;
        None for a head whose like cannot be read without the parser."""
        headers = response._headers
        if (not response._keep_alive or b"transfer-encoding" in headers or b"content-length" not in headers
                or response.status < 200 or response.status in (204, 304)):
            return None
        parts = split_at_length(head, headers[b"content-length"])
        return cls(*parts, response.status, headers) if parts is not None else None

    def read(self, data: bytes) -> tuple[int, bytes] | None:
        """(where the head ends in ``data``, the length's digits) when ``data`` starts with the
        remembered head but for its length; else None."""
        return length_between(data, self.prefix, self.suffix)


class _Connection(asyncio.Protocol):
    """One connection to an engine, carrying one exchange at a time."""

    def __init__(self, pool_key: str) -> None:
        self.pool_key = pool_key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.released_at = 0.0
        self._response: EngineResponse | None = None
        self._parser: httptools.HttpResponseParser | None = None  # while an exchange is under way
        self._reusable_parser: httptools.HttpResponseParser | None = None
        self._head_memo: _AnswerHeadMemo | None = None  # the last answer head the parser read
        self._answer_started = False  # bytes of the exchange's answer have arrived
        self._first_bytes = b""  # ... the first of them, while the parser reads the head
        self._body_left = -1  # bytes of a body counted out here (_AnswerHeadMemo); -1: the parser reads

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None or self._parser is None:  # bytes nobody asked for: not a usable connection
            self._abort()
            return
        if self._body_left >= 0:
            self._count_body(response, data)
            return
        if not self._answer_started:
            self._answer_started = True
            memo = self._head_memo
            found = memo.read(data) if memo is not None else None
            if found is not None:
                assert memo is not None
                self._read_remembered(response, memo, data, *found)
                return
            self._first_bytes = data
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            response._fail(EngineConnectionError("the engine switched protocols"))
            self._abort()
        except httptools.HttpParserError as exc:
            response._fail(EngineConnectionError(f"the engine's answer is not valid HTTP ({exc})"))
            self._abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if response is not None and not response._complete:
            if response._headers_done and response._until_close:
                response._finish()  # an answer delimited by the end of the connection
            else:
                response._fail(EngineConnectionError("the engine closed the connection"
                                                     + (f" ({exc})" if exc else "")))

    # ------------------------------------------------------------ httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        assert response is not None
        response._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        response = self._response
        assert response is not None and self._parser is not None
        response.status = self._parser.get_status_code()
        response._keep_alive = self._parser.should_keep_alive()
        response._headers_done = True
        headers = response._headers
        response._until_close = b"content-length" not in headers and b"transfer-encoding" not in headers
        first, self._first_bytes = self._first_bytes, b""
        end = first.find(b"\r\n\r\n")  # (a head that came in pieces is not remembered)
        self._head_memo = _AnswerHeadMemo.of(first[:end + 4], response) if end >= 0 else None
        response._wake_headers()

    def on_body(self, body: bytes) -> None:
        response = self._response
        assert response is not None
        response._body(body)

    def on_message_complete(self) -> None:
        response = self._response
        assert response is not None
        response._finish()

    # ------------------------------------------------------------ an answer read without the parser

    def _read_remembered(self, response: EngineResponse, memo: _AnswerHeadMemo, data: bytes, end: int,
                         digits: bytes) -> None:
        """What on_headers_complete and on_body do, for a head that is the remembered one."""
        headers = dict(memo.headers)
        headers[b"content-length"] = digits
        response._headers = headers
        response.status = memo.status
        response._keep_alive = True
        response._headers_done = True
        response._until_close = False
        self._body_left = int(digits)
        response._wake_headers()
        if self._response is response:  # (the head alone may end it: the lane refusing a launch key)
            self._count_body(response, data[end:])

    def _count_body(self, response: EngineResponse, data: bytes) -> None:
        left = self._body_left
        if len(data) > left:  # more than the answer: llhttp would read a next answer nobody asked for
            response._fail(EngineConnectionError("the engine sent more bytes than its answer's length"))
            self._abort()
            return
        self._body_left = left - len(data)
        if data:
            response._body(data)
        if self._body_left == 0:
            self._body_left = -1
            response._finish()

    # ------------------------------------------------------------ use

    def start(self, response: EngineResponse) -> None:
        self._response = response
        self._answer_started = False
        self._body_left = -1
        # One parser for the connection's life: a connection goes back to the pool only after a
        # whole answer, and llhttp is then ready for the next one (a parser made per exchange cost
        # 10 µs of CPU on the request's path with the caches cold, against 2 warm).
        if self._reusable_parser is None:
            self._reusable_parser = httptools.HttpResponseParser(self)
        self._parser = self._reusable_parser

    def finish_exchange(self) -> None:
        self._response = None
        self._parser = None
        self._first_bytes = b""

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class EngineResponse:
    """An engine's answer: status and headers first, then its body whole or chunk by chunk."""

    status: int = 0

    def __init__(self, pool: EnginePool, connection: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._connection = connection
        self._loop = loop
        self._headers: dict[bytes, bytes] = {}  # by lower-case name
        # Plain futures, not asyncio.Event: one per wait, set from the protocol's callbacks.
        # request() waits on it; an answer sent by send_now is told of its events by its subclass.
        self._headers_ready: asyncio.Future[None] | None = None
        self._headers_done = False
        self._until_close = False
        self._keep_alive = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._reader: asyncio.Future[None] | None = None  # readany waiting for data
        self._complete = False
        self._error: BaseException | None = None
        self._released = False
        self._deadline: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ what the proxy reads

    def header(self, name: str, default: str | None = None) -> str | None:
        value = self._headers.get(name.lower().encode("latin-1"))
        return value.decode("latin-1") if value is not None else default

    @property
    def content_type(self) -> str:
        """The media type alone, lower case ("" when there is none), as aiohttp's ``content_type``."""
        value = self.header("Content-Type") or ""
        return value.partition(";")[0].strip().lower()

    async def readany(self) -> bytes:
        """What has arrived since the last call; ``b""`` once the answer is whole."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                self._release()
                return b""
            self._reader = self._loop.create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered -= len(data)
        if self._paused and self._buffered < BUFFER_HIGH // 2:
            self._paused = False
            transport = self._connection.transport
            if transport is not None and not self._connection.closed:
                transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    async def json(self) -> Any:
        return json.loads(await self.read())

    def close(self) -> None:
        """Done with this answer: a whole one frees its connection for reuse, an unfinished one drops it."""
        self._release()

    # ------------------------------------------------------------ fed by the connection

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake_reader()
        if self._buffered > BUFFER_HIGH and not self._paused:
            self._paused = True
            transport = self._connection.transport
            if transport is not None:
                transport.pause_reading()

    def _finish(self) -> None:
        self._complete = True
        self._cancel_deadline()
        self._wake_headers()
        self._wake_reader()

    def _fail(self, error: BaseException) -> None:
        if self._complete or self._error is not None:
            return
        self._error = error
        self._cancel_deadline()
        self._wake_headers()
        self._wake_reader()

    def _wake_headers(self) -> None:
        waiter = self._headers_ready
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_reader(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    def _set_deadline(self, timeout: float) -> None:
        def expire() -> None:
            self._fail(TimeoutError("the engine did not answer within the request timeout"))
            self._connection._abort()
        self._deadline = self._loop.call_later(timeout, expire)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self._cancel_deadline()
        connection = self._connection
        connection.finish_exchange()
        if self._complete and self._error is None and self._keep_alive and not self._paused \
                and not connection.closed:
            self._pool._put_back(connection)
        else:
            connection._abort()


class EnginePool:
    """Keep-alive connections to engines, by base URL (see the module's docstring)."""

    def __init__(self, *, connect_timeout: float) -> None:
        self._connect_timeout = connect_timeout
        self._idle: dict[str, collections.deque[_Connection]] = {}
        self._closed = False

    async def request(self, method: str, base_url: str, path: str, body: bytes, headers: dict[str, str], *,
                      unix_socket: str | None = None, timeout: float | None = None) -> EngineResponse:
        """Send one request and wait for the answer's status and headers."""
        authority, base_path, host, port = _split(base_url)
        message = _message(method, authority, base_path + path, body, headers)
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            connection, reused = self._idle_connection(base_url)
            if connection is None:
                connection = await self._connect(loop, base_url, host, port, unix_socket)
            response = EngineResponse(self, connection, loop)
            response._headers_ready = loop.create_future()
            connection.start(response)
            if timeout is not None:
                response._set_deadline(timeout)
            assert connection.transport is not None
            connection.transport.write(message)
            try:
                await response._headers_ready
            except BaseException:
                response.close()  # cancelled while waiting: the connection is dropped
                raise
            if response._error is None or response._headers_done:
                return response
            response.close()
            if not (reused and isinstance(response._error, EngineConnectionError)) or attempt:
                raise response._error
            # A pooled connection the engine had closed: it never read the request. Once more, afresh.
        raise AssertionError("unreachable")

    def send_now(self, method: str, base_url: str, path: str, body: bytes, headers: dict[str, str],
                 answer: Callable[[EnginePool, _Connection, asyncio.AbstractEventLoop], EngineResponse], *,
                 timeout: float | None = None) -> EngineResponse | None:
        """Send one request on an idle kept-alive connection, without waiting: the answer made by
        ``answer`` (an EngineResponse, or a subclass that acts on its events as they come); None,
        with nothing sent, when no idle connection to ``base_url`` is at hand. The caller then
        uses :meth:`request`, and does the same when the answer fails before its status line on
        this reused connection (the engine closed it as we wrote: :meth:`request` sends once more)."""
        connection, _ = self._idle_connection(base_url)
        if connection is None:
            return None
        authority, base_path, _, _ = _split(base_url)
        response = answer(self, connection, asyncio.get_running_loop())
        connection.start(response)
        if timeout is not None:
            response._set_deadline(timeout)
        try:
            assert connection.transport is not None
            connection.transport.write(_message(method, authority, base_path + path, body, headers))
        except Exception:  # (a transport closed under us) not sent: the caller's request() sends it
            response._release()
            return None
        return response

    def close(self) -> None:
        self._closed = True
        for connections in self._idle.values():
            for connection in connections:
                connection._abort()
        self._idle.clear()

    def _idle_connection(self, base_url: str) -> tuple[_Connection | None, bool]:
        connections = self._idle.get(base_url)
        if not connections:
            return None, False
        oldest_usable = time.monotonic() - ENGINE_KEEPALIVE_S
        while connections:
            connection = connections.pop()  # the most recently used is the likeliest still open
            if not connection.closed and connection.released_at > oldest_usable:
                return connection, True
            connection._abort()
        return None, False

    async def _connect(self, loop: asyncio.AbstractEventLoop, base_url: str, host: str, port: int,
                       unix_socket: str | None) -> _Connection:
        try:
            async with asyncio.timeout(self._connect_timeout):
                if unix_socket is not None:
                    _, connection = await loop.create_unix_connection(lambda: _Connection(base_url), unix_socket)
                else:
                    _, connection = await loop.create_connection(lambda: _Connection(base_url), host, port)
        except TimeoutError:
            raise
        except OSError as exc:
            raise EngineConnectionError(f"cannot connect to {unix_socket or f'{host}:{port}'}: {exc}") from exc
        return connection

    def _put_back(self, connection: _Connection) -> None:
        if self._closed:
            connection._abort()
            return
        connections = self._idle.setdefault(connection.pool_key, collections.deque())
        connection.released_at = time.monotonic()
        connections.append(connection)
        # Drop the connections idle too long (the engine closes them soon) and any past the cap.
        oldest_usable = connection.released_at - ENGINE_KEEPALIVE_S
        while connections and (connections[0].released_at <= oldest_usable or connections[0].closed
                               or len(connections) > IDLE_PER_ENGINE_MAX):
            connections.popleft()._abort()


def make_engine_pool(*, connect_timeout: float) -> EnginePool | None:
    """The proxy's client to engines; None where httptools is not installed."""
    return EnginePool(connect_timeout=connect_timeout) if httptools is not None else None


def _message(method: str, authority: str, target: str, body: bytes, headers: dict[str, str]) -> bytes:
    """One request's bytes: head and body, written in one go."""
    return _head_of(method, authority, target, tuple(headers.items())) + b"Content-Length: %d\r\n\r\n" % len(body) + body


@functools.lru_cache(maxsize=256)
def _head_of(method: str, authority: str, target: str, headers: tuple[tuple[str, str], ...]) -> bytes:
    """A request head but its length: the same few per engine and route (a form's boundary aside),
    formatted once (10 µs of CPU each time where the engine's work had left the caches cold)."""
    head = [f"{method} {target} HTTP/1.1\r\nHost: {authority}\r\n"]
    head += [f"{name}: {value}\r\n" for name, value in headers]
    return "".join(head).encode("latin-1")


@functools.lru_cache(maxsize=4096)
def _split(base_url: str) -> tuple[str, str, str, int]:
    """``http://host:port/prefix`` -> ("host:port", "/prefix", "host", port)."""
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise EngineConnectionError(f"engines are reached over plain HTTP at a host, not {base_url!r}")
    try:
        port = parts.port or 80
    except ValueError:
        raise EngineConnectionError(f"the engine's URL has no valid port: {base_url!r}") from None
    return parts.netloc, parts.path.rstrip("/"), parts.hostname, port
