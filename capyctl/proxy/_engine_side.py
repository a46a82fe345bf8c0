"""The engine side of the proxy's door: its HTTP/1.1 client to engines.

Why not aiohttp's ClientSession (which the controller and the form route still use): on the
proxy's path it was most of CapyCTL's own CPU per request (benchmarks/proxy_hop.py, its py-spy
profile): a ClientRequest, URL and header objects, timers, a task and a StreamReader per request,
for an exchange that here is "write these bytes, hand back what comes". This client writes the
request head and body in one ``transport.write`` and reads the answer with ``httptools`` (llhttp,
the parser Node.js and aiohttp's C extension use), which also undoes chunked transfer coding.

The lifecycles, as httpcore's pool keeps them::

    EngineConnection:   IDLE (in the pool) --start()--> ACTIVE --release, whole--> IDLE
                                                          \\--anything else--> CLOSED
    EngineResponse:     AWAITING_HEAD --> BODY --> COMPLETE
                               \\------------\\----> FAILED (``error`` says why)

- A pool of idle keep-alive connections per engine base URL (a unix-socket engine's URL is a
  per-launch label, so a restarted engine's connections are never reused), each kept at most
  ``ENGINE_KEEPALIVE_S`` (connector.py says why that must be under the engine's own).
- A connection goes back to the pool only after a whole answer, with nothing read past it: an
  engine that sends bytes beyond its answer (RFC 9112 6.3: the body is exactly Content-Length
  octets), or any byte while no request is outstanding, has made the connection unusable, and it
  is closed. An answer not read to its end is never pooled either: the engine sees the disconnect
  and stops generating.
- Interim answers (1xx but 101, RFC 9110 15.2) are read and dropped; the final answer follows.
- A request sent on a pooled connection that the engine closed before answering a byte is sent
  once more on a new connection (the engine closed an idle connection as we wrote: it never
  read the request).
- Reading pauses while more than ``BUFFER_HIGH`` bytes wait for the client, so a slow client
  slows the engine's socket rather than filling the proxy's memory.
- Events reach the answer only after llhttp has read all the bytes at hand, so no one acting on
  an answer's end (handing its connection to the next request) can do so while the parser is
  still reading that connection.

An answer is read by awaiting it (:meth:`_engine_pool.EnginePool.request`, then ``readany``/``read``).
Errors are :class:`EngineConnectionError` (the engine could not be reached, the connection broke,
or the answer is not HTTP) and ``TimeoutError`` (connect timeout, or the exchange's deadline).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import json
from typing import Any, Callable, Protocol

try:
    import httptools
except ImportError:  # a platform without its wheel: the proxy uses aiohttp's client (make_engine_pool)
    httptools = None  # type: ignore[assignment]


# Bytes of an answer buffered for the client before the engine's socket is read no further.
BUFFER_HIGH = 256 * 1024


class ConnectionPool(Protocol):
    """Where a whole answer's connection goes back to (_engine_pool.EnginePool)."""

    def put_back(self, connection: EngineConnection) -> None: ...


class EngineConnectionError(ConnectionError):
    """The engine could not be reached, its connection broke before the answer was whole, or
    what it sent is not an HTTP answer."""


class AnswerState(enum.Enum):
    AWAITING_HEAD = "awaiting_head"
    BODY = "body"
    COMPLETE = "complete"
    FAILED = "failed"


class ConnectionState(enum.Enum):
    IDLE = "idle"  # no exchange: in the pool, or just connected
    ACTIVE = "active"  # carrying one exchange
    CLOSED = "closed"


class _AnswerReader:
    """llhttp's callbacks for one connection, collecting what one feed of bytes said; the
    connection hands it to its answer once the feed is read (the module's docstring)."""

    __slots__ = ("headers", "interim", "status", "keep_alive", "head_done", "pieces", "complete",
                 "overrun", "parser")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: dict[bytes, bytes] = {}
        self.status = 0
        self.keep_alive = False
        self.interim = False  # reading a 1xx answer, to be dropped
        self.head_done = False  # the final answer's head was read (this exchange)
        self.pieces: list[bytes] = []
        self.complete = False  # the final answer was read to its end (this exchange)
        self.overrun = False  # a byte came past it

    def new_exchange(self) -> None:
        self.headers = {}
        self.status = 0
        self.interim = self.head_done = self.complete = self.overrun = False

    def on_message_begin(self) -> None:
        if self.complete:
            self.overrun = True  # a second answer nobody asked for
        elif not self.head_done:
            self.headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:
            self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        if self.complete or self.head_done:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # interim (101 raises HttpParserUpgrade before this ends)
            self.interim = True
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        if self.head_done and not self.complete:
            self.pieces.append(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
        elif self.head_done:
            self.complete = True


class EngineConnection(asyncio.Protocol):
    """One connection to an engine, carrying one exchange at a time."""

    def __init__(self, pool_key: str) -> None:
        self.pool_key = pool_key
        self.state = ConnectionState.IDLE
        self.released_at = 0.0
        self._transport: asyncio.Transport | None = None
        self._response: EngineResponse | None = None
        # One parser for the connection's life: after a whole answer llhttp is ready for the next.
        self._reader: _AnswerReader | None = None

    def __repr__(self) -> str:
        return f"<EngineConnection {self.pool_key} {self.state.value}>"

    @property
    def reusable(self) -> bool:
        """Whether it may go back to the pool: open, and nothing read past its last answer."""
        return self.state is not ConnectionState.CLOSED and not (self._reader is not None and self._reader.overrun)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The transport's (``"socket"``, ``"peername"``...)."""
        return self._transport.get_extra_info(name, default) if self._transport is not None else default

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response, reader = self._response, self._reader
        if response is None or reader is None or reader.complete:
            self.close()  # bytes nobody asked for: the connection cannot be trusted again
            return
        head_before = reader.head_done
        error: BaseException | None = None
        try:
            reader.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            error = EngineConnectionError("the engine switched protocols")
        except httptools.HttpParserError as exc:
            error = EngineConnectionError(f"the engine's answer is not valid HTTP ({exc})")
        if error is not None and reader.complete:
            reader.overrun, error = True, None  # bytes past a whole answer: it stands, the connection does not
        # Now that llhttp has read everything, the answer hears what it said.
        if reader.head_done and not head_before:
            response.head_arrived(reader.status, reader.headers, keep_alive=reader.keep_alive,
                                  until_close=b"content-length" not in reader.headers
                                  and b"transfer-encoding" not in reader.headers)
        if reader.pieces:
            data, reader.pieces = b"".join(reader.pieces), []
            response.body_arrived(data)
        if error is not None:
            response.failed(error)
            self.close()
        elif reader.complete:
            response.ended()
        if reader.overrun:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = ConnectionState.CLOSED
        response = self._response
        if response is not None:
            if response.state is AnswerState.BODY and response.until_close:
                response.ended()  # an answer delimited by the end of the connection
            else:
                response.failed(EngineConnectionError("the engine closed the connection"
                                                      + (f" ({exc})" if exc else "")))

    # ------------------------------------------------------------ use

    def start(self, response: EngineResponse, message: bytes) -> None:
        """Carry ``response``'s exchange: its request ``message`` is written now."""
        assert self.state is ConnectionState.IDLE and self._transport is not None
        self.state = ConnectionState.ACTIVE
        self._response = response
        if self._reader is None:
            self._reader = _AnswerReader()
        else:
            self._reader.new_exchange()
        self._transport.write(message)

    def finish(self) -> None:
        """The exchange is over (its answer released)."""
        self._response = None
        if self.state is ConnectionState.ACTIVE:
            self.state = ConnectionState.IDLE

    def pause_reading(self) -> None:
        if self.state is not ConnectionState.CLOSED and self._transport is not None:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.state is not ConnectionState.CLOSED and self._transport is not None:
            self._transport.resume_reading()

    def close(self) -> None:
        """Drop the connection at once (abort: the engine sees it go and stops generating)."""
        self.state = ConnectionState.CLOSED
        if self._transport is not None:
            self._transport.abort()


class EngineResponse:
    """An engine's answer: status and headers first, then its body whole or piece by piece."""

    def __init__(self, pool: ConnectionPool, connection: EngineConnection, loop: asyncio.AbstractEventLoop,
                 ) -> None:
        self.state = AnswerState.AWAITING_HEAD
        self.status = 0
        self.error: BaseException | None = None
        self.until_close = False  # the body ends with the connection
        self._pool = pool
        self._connection = connection
        self._loop = loop
        self._headers: dict[bytes, bytes] = {}  # by lower-case name
        self._keep_alive = False
        # Plain futures, not asyncio.Event: one per wait, set from the connection's callbacks.
        self._head_waiter: asyncio.Future[None] | None = None
        self._reader: asyncio.Future[None] | None = None  # readany waiting for data
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False  # reading paused: more than BUFFER_HIGH waits for the client
        self._released = False
        self._deadline: asyncio.TimerHandle | None = None
        self._on_close: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"<EngineResponse {self.state.value} {self.status or ''}>"

    # ------------------------------------------------------------ what the proxy reads

    def header(self, name: str, default: str | None = None) -> str | None:
        value = self._headers.get(name.lower().encode("latin-1"))
        return value.decode("latin-1") if value is not None else default

    @property
    def content_type(self) -> str:
        """The media type alone, lower case ("" when there is none), as aiohttp's ``content_type``."""
        value = self.header("Content-Type") or ""
        return value.partition(";")[0].strip().lower()

    @property
    def has_head(self) -> bool:
        """The final answer's status and headers arrived (it may have failed since)."""
        return self.status != 0

    @property
    def buffered(self) -> int:
        """Body bytes that arrived and were not read yet."""
        return self._buffered

    async def readany(self) -> bytes:
        """What has arrived since the last call; ``b""`` once the answer is whole."""
        while not self._chunks:
            if self.state is AnswerState.FAILED:
                assert self.error is not None
                raise self.error
            if self.state is AnswerState.COMPLETE:
                self.close()
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
            self.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    async def json(self) -> Any:
        return json.loads(await self.read())

    def pause_reading(self) -> None:
        """Read the engine's socket no further (the client is slower than the engine)."""
        if not self._paused and not self._released:
            self._paused = True
            self._connection.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and not self._released:
            self._paused = False
            self._connection.resume_reading()

    def close(self) -> None:
        """Done with this answer: a whole one frees its connection for reuse, any other drops it."""
        if self._released:
            return
        self._released = True
        self._cancel_deadline()
        connection = self._connection
        connection.finish()
        if self.state is AnswerState.COMPLETE and self._keep_alive and connection.reusable:
            if self._paused:
                connection.resume_reading()
            self._pool.put_back(connection)
        else:
            connection.close()
        if self._on_close is not None:
            self._on_close()

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once this answer is closed and its connection back in the pool or closed."""
        self._on_close = callback

    # ------------------------------------------------------------ told by its connection

    def head_arrived(self, status: int, headers: dict[bytes, bytes], *, keep_alive: bool, until_close: bool) -> None:
        if self.state is not AnswerState.AWAITING_HEAD:
            return
        self.state = AnswerState.BODY
        self.status, self._headers, self._keep_alive, self.until_close = status, headers, keep_alive, until_close
        self._wake_head()

    def body_arrived(self, data: bytes) -> None:
        if self.state is not AnswerState.BODY or self._released:
            return
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake_reader()
        if self._buffered > BUFFER_HIGH:
            self.pause_reading()

    def ended(self) -> None:
        if self.state is not AnswerState.BODY:
            return
        self.state = AnswerState.COMPLETE
        self._cancel_deadline()
        self._wake_head()
        self._wake_reader()

    def failed(self, error: BaseException) -> None:
        if self.state in (AnswerState.COMPLETE, AnswerState.FAILED):
            return
        self.state = AnswerState.FAILED
        self.error = error
        self._cancel_deadline()
        self._wake_head()
        self._wake_reader()

    # ------------------------------------------------------------ waiting

    async def wait_head(self) -> None:
        """Until the head arrived or the answer failed (or ended, which needs a head)."""
        if self.state is AnswerState.AWAITING_HEAD:
            self._head_waiter = self._loop.create_future()
            await self._head_waiter

    def set_deadline(self, timeout: float) -> None:
        def expire() -> None:
            self.failed(TimeoutError("the engine did not answer within the request timeout"))
            self._connection.close()
        self._deadline = self._loop.call_later(timeout, expire)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _wake_head(self) -> None:
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_reader(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)
