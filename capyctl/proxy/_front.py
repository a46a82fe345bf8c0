"""The proxy's front door: the requests that make its latency, served without aiohttp's server.

aiohttp's web server costs about 110 µs of CPU per request above a bare asyncio protocol on
the 2-core machines CapyCTL is measured on (one small JSON POST, a trivial handler: 170-183 vs
63 µs), more than the whole hop nginx adds (benchmarks/proxy_hop.py). So the proxy's listening
socket is served by :class:`FrontConnection`:

- a request whose head is ordinary — HTTP/1.1, a POST to a JSON route of the table with a
  body of one Content-Length within max_body, or a GET of /health, /metrics, /openapi.json
  or /v1/models without a body; a Host; no Transfer-Encoding, Expect, Content-Encoding or Upgrade —
  is parsed with httptools (llhttp, the parser aiohttp's C extension also uses) and answered
  by the same code as aiohttp's handlers (``_app.answer_json``, ``_app.GET_ROUTES``);
- the first request that is anything else (a form upload, /v1/systemone, a stored response,
  an unknown route, a chunked or compressed body, a head httptools refuses...) hands the
  connection, with every byte not yet answered, to aiohttp's RequestHandler, which keeps it
  from then on.

An ordinary POST whose deployment the Router admits at once (Router.try_acquire) and whose
engine has an idle kept-alive connection is sent on at once, without a task (:class:`_Lane`),
and a whole answer is written back from the engine connection's callbacks as it completes
(``_LaneAnswer``): a tenth less CPU per request than in a task (benchmarks/proxy_hop.py, 205
against 186 µs). An event stream is relayed from the same callbacks, event by event as each
arrives, by ``EventRelay``'s rules (those of ``_stream`` in a task), the engine's socket paused
while the client's is full: no task wakes per event (an event cost 250 against 258 µs of CPU
in a task, measured against llama-server on 2 cores, where nginx spends 104). No idle connection,
or one the engine had closed, goes on in a task, by the same code as aiohttp's handlers.

Both servers answer alike: the same error bodies, metrics, key check, cancellation of the
engine request when the client goes away, keep-alive closing after 75 s idle (aiohttp's
default), and graceful shutdown. ``CAPYCTL_PROXY_FRONT=aiohttp`` serves everything through
aiohttp's server (to compare, or where the front misbehaves); so does ``CAPYCTL_ACCESS_LOG=1``
(aiohttp writes that log), and so it is without httptools.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Coroutine

from aiohttp import web

from ..errors import CapyError
from ._app import (
    CLIENT_CLOSED,
    GET_ROUTES,
    LAUNCH_KEY_REFUSED,
    POOL,
    SESSION,
    STATE,
    STREAM_HEADERS,
    AdmittedAtOnce,
    EventRelay,
    Exchange,
    ProxyState,
    admit_at_once,
    answer_json,
    authorize,
    forward,
    launch_key_refused,
    reply_whole,
    unreachable,
)
from ._errors import error_parts
from ._routes import JSON_ROUTES, is_anthropic
from ._upstream import (EngineConnectionError, EnginePool, EngineResponse, _Connection, length_between,
                        split_at_length)

try:
    import httptools
except ImportError:  # pragma: no cover - a platform without its wheel: aiohttp's server alone
    httptools = None

log = logging.getLogger("capyctl.proxy")

# A request head longer than this is left to aiohttp (which answers 400 past its own limits).
HEAD_MAX = 64 * 1024
# Idle keep-alive connections are closed after this long, as aiohttp's server does by default.
KEEPALIVE_S = 75.0
# Bytes a client may send ahead (pipelined) while its request is answered before reading pauses.
AHEAD_MAX = 1 << 20
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}


def front_enabled(app: web.Application) -> bool:
    """Whether serve() puts the front before ``app``: a proxy app, httptools, not turned off, and
    no access log asked for (CAPYCTL_ACCESS_LOG=1 is for debugging: every request through aiohttp's
    server, which writes the log)."""
    return (httptools is not None and STATE in app
            and os.environ.get("CAPYCTL_PROXY_FRONT", "auto") != "aiohttp"
            and os.environ.get("CAPYCTL_ACCESS_LOG") != "1")


@dataclass(slots=True)
class _Head:
    """What one ordinary request head says, as the forwarding code needs it."""

    size: int  # bytes of the head, blank line included
    method: str  # POST (a JSON route) or GET (a GET route)
    path: str
    headers: dict[str, str]  # lower-case names
    content_length: int
    close: bool  # Connection: close


class _HeadReader:
    """httptools callbacks for one head. Header names are lowered; a repeated header is joined
    with ", " (RFC 9110 5.3), except those whose repetition smells (two keys, two lengths):
    ``odd`` then sends the request to aiohttp."""

    __slots__ = ("url", "headers", "complete", "odd")

    _SINGLE = frozenset({"content-length", "authorization", "x-api-key", "transfer-encoding", "host"})

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.complete = False
        self.odd = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key in self.headers:
            if key in self._SINGLE:
                self.odd = True
            self.headers[key] += ", " + text
        else:
            self.headers[key] = text

    def on_headers_complete(self) -> None:
        self.complete = True


# The usual head, read by two regular expressions in C rather than by httptools' callbacks into
# Python, one a header: against llama-server on 2 cores the engine's work leaves the caches cold
# for the proxy, and there the callbacks' way cost 74 µs of CPU per head (benchmarks/proxy_vs_nginx.py's
# load, measured in the process). Only a subset of what llhttp accepts matches (RFC 9110/9112:
# an origin-form target of RFC 3986's characters, token names, no control characters in values),
# read as llhttp reads it (leading whitespace of a value dropped, trailing kept); anything else,
# a repeated header included, is read by httptools as before. Possessive quantifiers: each line
# matches one way only, so a long head cannot make the match backtrack.
_TARGET_CHARS = r"A-Za-z0-9\-._~!$&'()*+,;=:@/%"
_REQUEST_LINE = rf"(POST|GET) (/[{_TARGET_CHARS}]*+)(?:\?[{_TARGET_CHARS}?]*+)? HTTP/1\.1\r\n"
_NAME = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]++"
_VALUE = r"[^\x00-\x08\x0a-\x1f\x7f]*+"
_USUAL_HEAD = re.compile(rf"{_REQUEST_LINE}((?:{_NAME}:[ \t]*+{_VALUE}\r\n)*+)\r\n")
_FIELDS = re.compile(rf"({_NAME}):[ \t]*+({_VALUE})\r\n")


def _read_usual_head(data: bytes) -> tuple[bytes, str, dict[str, str]] | None:
    """(method, path, headers) of a head in the usual form; None for any other, or a repeated header."""
    text = data.decode("latin-1")
    match = _USUAL_HEAD.fullmatch(text)
    if match is None:
        return None
    fields = _FIELDS.findall(text, match.start(3))
    headers = {name.lower(): value for name, value in fields}
    if len(headers) != len(fields):
        return None
    return match[1].encode(), match[2], headers


def _read_any_head(data: bytes) -> tuple[bytes, str, dict[str, str]] | None:
    """(method, path, headers) as httptools reads the head; None when it refuses it, or a repeated
    header smells (_HeadReader.odd), or it is not HTTP/1.1 or asks for an upgrade."""
    reader = _HeadReader()
    parser = httptools.HttpRequestParser(reader)
    try:
        parser.feed_data(data)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):  # (the latter is no HttpParserError)
        return None
    if not reader.complete or reader.odd or parser.get_http_version() != "1.1" or parser.should_upgrade():
        return None
    # The query is dropped, as for aiohttp's routes.
    return parser.get_method(), reader.url.partition(b"?")[0].decode("latin-1"), reader.headers


def read_head(data: bytes, max_body: int) -> _Head | None:
    """The head (ending with its blank line) of a request the front answers; None for any other."""
    return _front_head(data, _read_usual_head(data) or _read_any_head(data), max_body)


class _HeadMemo:
    """The last head a connection sent, read, so that the next one is not read again when it is the
    same bytes but for its Content-Length's digits: a client's SDK sends one head per route and key,
    and reading a head (two regular expressions, a dict, the checks of _front_head) was the largest
    part of the proxy's CPU per request where the engine's work had left the caches cold (57 µs of
    260 over the floor relay's, benchmarks/proxy_vs_nginx.py's load). Two heads that are the same
    bytes read the same; only the length, and so max_body, is checked again."""

    __slots__ = ("prefix", "suffix", "head")

    def __init__(self, data: bytes, head: _Head) -> None:
        self.head = head
        length = head.headers.get("content-length")
        parts = split_at_length(data, length.encode("latin-1")) if length is not None else None
        # No length field (a GET), or one not in the plain form: only the very same bytes match.
        self.prefix, self.suffix = parts if parts is not None else (data, b"")

    def read(self, data: bytes, max_body: int) -> _Head | None:
        """``data``'s head if it is the remembered one but for its length's digits; else None."""
        head = self.head
        if not self.suffix:
            return head if data == self.prefix else None
        found = length_between(data, self.prefix, self.suffix)
        if found is None or found[0] != len(data):
            return None
        digits = found[1]
        length = int(digits)
        if length == head.content_length and len(data) == head.size:
            return head
        if head.method != "POST" or length > max_body:
            return None
        headers = dict(head.headers)
        headers["content-length"] = digits.decode()
        return _Head(len(data), head.method, head.path, headers, length, head.close)


def _front_head(data: bytes, parsed: tuple[bytes, str, dict[str, str]] | None, max_body: int) -> _Head | None:
    """The head as the front needs it, from what a reader found in ``data``: None when the front
    leaves the request to aiohttp."""
    if parsed is None:
        return None
    method, path, headers = parsed
    length = headers.get("content-length", "0" if method == b"GET" else "")
    # No Host: RFC 9112 3.2 wants a 400, which aiohttp's server answers.
    if ("host" not in headers or "transfer-encoding" in headers or "expect" in headers
            or headers.get("content-encoding", "identity").strip().lower() != "identity"
            # (llhttp takes any number of leading zeros; int() refuses past 4300 digits)
            or not (length.isascii() and length.isdigit() and len(length) <= 18)):
        return None
    if method == b"POST" and path in JSON_ROUTES and int(length) <= max_body:
        pass
    elif method == b"GET" and path in GET_ROUTES and int(length) == 0:
        pass
    else:
        return None
    connection = {token.strip() for token in headers.get("connection", "").lower().split(",")}
    if "upgrade" in connection:
        return None
    return _Head(len(data), method.decode(), path, headers, int(length), "close" in connection)


@dataclass(slots=True, eq=False)
class _Front:
    """What every connection of one listening socket shares."""

    state: ProxyState
    pool: Any
    session: Any
    aiohttp_server: web.Server  # makes the RequestHandler a connection is handed to
    loop: asyncio.AbstractEventLoop
    connections: set[FrontConnection] = field(default_factory=set)
    closing: bool = False


_date_cache: list[Any] = [0, b""]


def _date_line() -> bytes:
    """The Date header (RFC 9110 6.6.1: an origin with a clock sends it), formatted once a second."""
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = time.strftime("Date: %a, %d %b %Y %H:%M:%S GMT\r\n", time.gmtime(now)).encode()
    return _date_cache[1]


# An answer head's status line and headers, by (status, headers): a few kinds of answer make every
# head, and formatting one cost 20 µs of CPU where the engine's work had left the caches cold.
_head_starts: dict[tuple[int, tuple[tuple[str, str], ...]], bytes] = {}
_HEAD_STARTS_MAX = 256


def _head_start(key: tuple[int, tuple[tuple[str, str], ...]]) -> bytes:
    status, headers = key
    start = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")) + b"".join(
        f"{name}: {value}\r\n".encode("latin-1") for name, value in headers)
    if len(_head_starts) >= _HEAD_STARTS_MAX:  # (headers that vary, say an engine's Retry-After)
        _head_starts.clear()
    _head_starts[key] = start
    return start


@dataclass(slots=True, eq=False)
class _Lane:
    """A request answered without a task (FrontConnection._try_lane), while its answer is under way."""

    exchange: Exchange
    admitted: AdmittedAtOnce
    head: _Head
    started: float
    response: EngineResponse | None = None
    head_checked: bool = False  # the answer's status and type were looked at
    relay: EventRelay | None = None  # an event stream, relayed as it comes
    engine_paused: bool = False  # the engine connection's reading, while the client's buffer is full
    done: asyncio.Future[None] | None = None  # made when a shutdown waits for it


class _LaneAnswer(EngineResponse):
    """The engine's answer to a lane's request: each event it gets (head, body, end, failure) is
    passed to the front connection, which answers from its callbacks (a whole answer at its end,
    an event stream event by event) until the answer is closed."""

    def __init__(self, pool: EnginePool, connection: _Connection, loop: asyncio.AbstractEventLoop,
                 lane_of: FrontConnection) -> None:
        super().__init__(pool, connection, loop)
        self.lane_of = lane_of

    def _body(self, data: bytes) -> None:
        self.lane_of._lane_body(self, data)

    def _wake_headers(self) -> None:
        super()._wake_headers()
        self.lane_of._lane_event(self)

    def _wake_reader(self) -> None:
        super()._wake_reader()
        self.lane_of._lane_event(self)


class FrontConnection(asyncio.Protocol):
    """One client connection: its ordinary requests answered here, one at a time, in order; the
    connection given to aiohttp at the first other one. Also the Reply of the request it answers."""

    def __init__(self, front: _Front) -> None:
        self._front = front
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._head: _Head | None = None  # read, its body not all here yet
        self._head_memo: _HeadMemo | None = None  # the last head read
        self._task: asyncio.Task[None] | None = None  # the request being answered (in a task)
        self._lane: _Lane | None = None  # ... or without one (and then maybe in a task too)
        self._lost = False
        self._handed_off = False
        self._reading_paused = False
        self._writable: asyncio.Future[None] | None = None  # while the transport's buffer is full
        self._last_active = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        # The request being answered.
        self._status = 500
        self._head_sent = False
        self._close_after = False
        self._stream_head = b""  # a stream's head, sent with its first chunk (one send, as aiohttp does)

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  (TCP_NODELAY: asyncio's and uvloop's default)
        self._front.connections.add(self)
        self._last_active = self._front.loop.time()
        self._idle_timer = self._front.loop.call_at(self._last_active + KEEPALIVE_S, self._check_idle)

    @property
    def busy(self) -> bool:
        """A request is being answered."""
        return self._task is not None or self._lane is not None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self.busy:
            self._advance()
        elif len(self._buffer) > AHEAD_MAX and not self._reading_paused:
            assert self._transport is not None
            self._transport.pause_reading()
            self._reading_paused = True

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self._front.connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._task is not None:
            self._task.cancel()  # as aiohttp's handler_cancellation: the engine request is closed
        elif self._lane is not None:
            self._lane_abort()
        self._wake_writer()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self._front.loop.create_future()

    def resume_writing(self) -> None:
        self._wake_writer()
        lane = self._lane
        if lane is not None and lane.engine_paused:
            self._resume_engine(lane)

    # ------------------------------------------------------------ requests

    def _advance(self) -> None:
        """Start answering the next request if all of it is here, or hand the connection off."""
        if self._front.closing:
            return
        buffer = self._buffer
        if self._head is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > HEAD_MAX:
                    self._hand_off()
                return
            data = bytes(buffer[:end + 4])
            memo = self._head_memo
            head = memo.read(data, self._front.state.max_body) if memo is not None else None
            if head is None:
                head = read_head(data, self._front.state.max_body)
                if head is None:
                    self._hand_off()
                    return
                self._head_memo = _HeadMemo(data, head)
            self._head = head
        head = self._head
        total = head.size + head.content_length
        if len(buffer) < total:
            return
        body = bytes(buffer[head.size:total])
        del buffer[:total]
        self._head = None
        if head.method == "POST" and self._front.pool is not None and self._try_lane(head, body):
            return
        self._task = self._front.loop.create_task(self._answer(head, body))

    def _begin(self, head: _Head) -> None:
        self._status, self._head_sent, self._close_after, self._stream_head = 500, False, head.close, b""

    def _record(self, exchange: Exchange, head: _Head, started: float) -> None:
        self._front.state.metrics.record(deployment=exchange.deployment, route=head.path,
                                         status=self._status if exchange.outcome is None else exchange.outcome,
                                         seconds=time.monotonic() - started)

    async def _answer(self, head: _Head, body: bytes) -> None:
        front = self._front
        started = time.monotonic()
        self._begin(head)
        exchange = Exchange(front.state, front.pool, front.session, head.path, head.headers, self)
        try:
            await self._answering(exchange, head, self._route(exchange, head, body))
        finally:
            self._record(exchange, head, started)
            self._task = None
        self._next_request()

    @staticmethod
    async def _route(exchange: Exchange, head: _Head, body: bytes) -> None:
        if head.method == "POST":
            await answer_json(exchange, authorize(exchange), body)
        else:
            await GET_ROUTES[head.path](exchange)

    async def _answering(self, exchange: Exchange, head: _Head, work: Any) -> None:
        """Await ``work``, the writing of an answer; what it raises is answered as the client should see it."""
        try:
            await work
        except CapyError as err:
            self._answer_error(exchange, err)
        except (asyncio.CancelledError, ConnectionError):
            # The client went away: connection_lost cancelled the task, or the connection was already
            # closing when the answer was written (its connection_lost not yet called).
            self._status = CLIENT_CLOSED
        except Exception:
            log.exception("proxy: unexpected error on %s %s", head.method, head.path)
            self._answer_error(exchange, CapyError("The proxy failed to handle this request.", status=500))

    # ------------------------------------------------------------ requests without a task

    def _try_lane(self, head: _Head, body: bytes) -> bool:
        """Answer ``head``'s request without a task if the Router admits it at once: sent now on
        an idle connection to its engine, the answer to come in callbacks (or, with no idle
        connection, connected and sent by a task, the admission kept). False, with nothing
        admitted, when it needs answer_json."""
        front = self._front
        started = time.monotonic()
        exchange = Exchange(front.state, front.pool, front.session, head.path, head.headers, self)
        admitted = admit_at_once(exchange, body)
        if admitted is None:
            return False
        self._begin(head)
        lane = self._lane = _Lane(exchange, admitted, head, started)
        upstream = admitted.upstream
        try:
            lane.response = front.pool.send_now("POST", upstream.base_url, head.path, admitted.payload,
                                                admitted.headers, self._lane_answer,
                                                timeout=front.state.request_timeout)
        except Exception:  # (not expected: a pooled connection's URL was good before) the task's way says why
            log.debug("proxy: sending without a task failed", exc_info=True)
        if lane.response is None:
            self._lane_in_task(forward(exchange, upstream, head.path, admitted.payload))
        return True

    def _lane_answer(self, pool: EnginePool, connection: _Connection, loop: asyncio.AbstractEventLoop) -> _LaneAnswer:
        return _LaneAnswer(pool, connection, loop, self)

    def _lane_event(self, response: EngineResponse) -> None:
        """The lane's answer got its head, its end, or failed."""
        lane = self._lane
        if lane is None or lane.response is not response or self._task is not None:
            return
        error = response._error
        if error is not None:
            if lane.relay is not None:  # a stream under way: it ends with an error event
                self._lane_stream_end(lane.relay.broken(error))
            elif not response._headers_done and isinstance(error, EngineConnectionError):
                # The engine had closed the kept-alive connection as we wrote: never read. The
                # task's way sends it once more, on a new connection (EnginePool.request).
                self._lane_again()
            else:
                self._lane_fails(unreachable(lane.admitted.upstream, error))
            return
        if not response._headers_done:
            return
        if not lane.head_checked:
            lane.head_checked = True
            if response.status in LAUNCH_KEY_REFUSED:
                self._lane_fails(launch_key_refused(lane.admitted.upstream))
                return
            if response.content_type == "text/event-stream":  # relayed event by event, as it comes
                lane.relay = EventRelay(lane.exchange, lane.admitted.upstream)
                # Its head goes with the first events (one send, as aiohttp's server does).
                self._stream_head = self._head_bytes(response.status, STREAM_HEADERS,
                                                     b"Transfer-Encoding: chunked\r\n")
        if response._complete and lane.relay is not None:
            self._lane_stream_end(lane.relay.last())
        elif response._complete:
            body = b"".join(response._chunks)
            response._chunks.clear()
            try:
                reply_whole(lane.exchange, response, body)
            except ConnectionError:
                self._status = CLIENT_CLOSED
            self._lane_done()

    def _lane_fails(self, error: CapyError) -> None:
        lane = self._lane
        assert lane is not None
        self._answer_error(lane.exchange, error)
        self._lane_done()

    def _lane_again(self) -> None:
        lane = self._lane
        assert lane is not None and lane.response is not None
        lane.response.close()
        lane.response = None
        self._lane_in_task(forward(lane.exchange, lane.admitted.upstream, lane.head.path, lane.admitted.payload))

    def _lane_body(self, response: EngineResponse, data: bytes) -> None:
        """A piece of the lane's answer's body: an event stream's whole events are written on at
        once (by EventRelay's rules, as _stream writes them); a whole answer's is kept for its end
        (read whole, as a task's read() does: the socket is not paused for a reader that never comes)."""
        lane = self._lane
        if lane is None or lane.relay is None:
            response._chunks.append(data)
            response._buffered += len(data)
            return
        events = lane.relay.events(data)
        if not events or lane.exchange.outcome == CLIENT_CLOSED:
            return
        try:
            self._send_chunk(events)
        except ConnectionError:  # the client is going: connection_lost ends the lane (_lane_abort)
            lane.exchange.outcome = CLIENT_CLOSED
            return
        if self._writable is not None and not lane.engine_paused:
            # The client reads slower than the engine writes: the engine waits (TCP), as _stream's
            # awaited write makes it wait; resume_writing reads on.
            transport = response._connection.transport
            if transport is not None and not response._connection.closed:
                transport.pause_reading()
                lane.engine_paused = True

    def _resume_engine(self, lane: _Lane) -> None:
        lane.engine_paused = False
        connection = lane.response._connection if lane.response is not None else None
        if connection is not None and connection.transport is not None and not connection.closed:
            connection.transport.resume_reading()

    def _lane_stream_end(self, last: bytes) -> None:
        lane = self._lane
        assert lane is not None
        if lane.exchange.outcome != CLIENT_CLOSED:
            try:
                self._send_end(last)
            except ConnectionError:
                lane.exchange.outcome = CLIENT_CLOSED
        self._lane_done()

    def _lane_in_task(self, work: Coroutine[Any, Any, Any]) -> None:
        """The lane's request goes on in a task (``work``: the rest of its answer), admission kept."""
        lane = self._lane
        assert lane is not None
        task = self._task = self._front.loop.create_task(self._answering(lane.exchange, lane.head, work))
        # A callback, not a finally: a task cancelled before its first step (the client gone at once)
        # runs no code of its coroutine, and the admission must still be given back.
        task.add_done_callback(functools.partial(self._lane_task_done, work))

    def _lane_task_done(self, work: Coroutine[Any, Any, Any], task: asyncio.Task[None]) -> None:
        work.close()  # (never started when the task was cancelled first: no "never awaited" warning)
        if self._task is task:
            self._task = None
        self._lane_done()

    def _lane_abort(self) -> None:
        """The client went away: the engine's request is closed (it stops generating)."""
        self._status = CLIENT_CLOSED
        self._lane_done()

    def _lane_done(self) -> None:
        lane, self._lane = self._lane, None
        if lane is None:
            return
        if lane.engine_paused:  # (a whole answer's connection goes back to the pool reading)
            self._resume_engine(lane)
        if lane.response is not None:
            # A whole answer's connection goes back to the pool; an unfinished one's is dropped, so
            # the engine stops generating. (Closed already by a task's forward: nothing happens.)
            lane.response.close()
        lane.admitted.release()
        self._record(lane.exchange, lane.head, lane.started)
        self._release_waiter(lane)
        self._next_request()

    @staticmethod
    def _release_waiter(lane: _Lane) -> None:
        if lane.done is not None and not lane.done.done():
            lane.done.set_result(None)

    def _lane_waiter(self) -> asyncio.Future[None]:
        """A future done when the lane's request is answered (for a shutdown to wait on)."""
        lane = self._lane
        assert lane is not None
        if lane.done is None:
            lane.done = self._front.loop.create_future()
        return lane.done

    def _next_request(self) -> None:
        if self._lost:
            return
        assert self._transport is not None
        if self._close_after or self._front.closing:
            self._transport.close()
            return
        self._last_active = self._front.loop.time()
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        if self._buffer:
            self._advance()

    def _answer_error(self, exchange: Exchange, error: CapyError) -> None:
        if self._lost or self._transport is None or self._transport.is_closing():
            self._status = CLIENT_CLOSED
            return
        if self._head_sent:  # a stream already under way: only closing says something broke
            assert self._transport is not None
            self._status = error.status
            self._transport.close()
            return
        headers, body = error_parts(error, anthropic=is_anthropic(exchange.path), param=error.detail.get("param"))
        self.whole(error.status, headers, body)

    def _hand_off(self) -> None:
        """Give the connection, and what it sent that was not answered, to aiohttp's server."""
        transport = self._transport
        assert transport is not None and not self.busy
        self._handed_off = True
        self._front.connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        handler = self._front.aiohttp_server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._reading_paused:
            transport.resume_reading()
        data = bytes(self._buffer)
        self._buffer.clear()
        if data:
            handler.data_received(data)

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._lost or self._handed_off:
            return
        now = self._front.loop.time()
        deadline = self._last_active + KEEPALIVE_S
        if not self.busy and now >= deadline:
            assert self._transport is not None
            self._transport.close()
            return
        self._idle_timer = self._front.loop.call_at(max(deadline, now + 1.0), self._check_idle)

    def close_when_idle(self) -> None:
        """Shutting down: close now if no request is being answered, else after its answer."""
        if not self.busy and self._transport is not None:
            self._transport.close()
        self._close_after = True

    # ------------------------------------------------------------ Reply (_app.Reply)

    def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self._transport_for_writing().write(
            self._head_bytes(status, headers, b"Content-Length: %d\r\n" % len(body)) + body)

    async def start_stream(self, status: int, headers: dict[str, str]) -> None:
        self._transport_for_writing()
        self._stream_head = self._head_bytes(status, headers, b"Transfer-Encoding: chunked\r\n")

    async def write(self, data: bytes) -> None:
        self._send_chunk(data)
        if self._writable is not None:
            await self._drain()

    async def end(self, last: bytes) -> None:
        self._send_end(last)
        if self._writable is not None:
            await self._drain()

    def _send_chunk(self, data: bytes) -> None:
        if not data:  # an empty chunk would end the body
            return
        head, self._stream_head = self._stream_head, b""
        self._transport_for_writing().writelines((head + b"%x\r\n" % len(data), data, b"\r\n"))

    def _send_end(self, last: bytes) -> None:
        transport = self._transport_for_writing()
        head, self._stream_head = self._stream_head, b""
        if last:
            transport.writelines((head + b"%x\r\n" % len(last), last, b"\r\n0\r\n\r\n"))
        else:
            transport.write(head + b"0\r\n\r\n")

    def _head_bytes(self, status: int, headers: dict[str, str], framing: bytes) -> bytes:
        self._status = status
        self._head_sent = True  # (or held for the first chunk: the status can no longer change)
        key = (status, tuple(headers.items()))
        start = _head_starts.get(key)
        if start is None:
            start = _head_start(key)
        parts = [start, framing, _date_line()]
        if self._close_after:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _transport_for_writing(self) -> asyncio.Transport:
        transport = self._transport
        if self._lost or transport is None or transport.is_closing():
            raise ConnectionResetError("The client closed the connection.")
        return transport

    async def _drain(self) -> None:
        waiter = self._writable
        if waiter is not None:
            await waiter
        if self._lost:
            raise ConnectionResetError("The client closed the connection.")

    def _wake_writer(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class FrontSite(web.BaseSite):
    """A listening socket (passed, or bound on HOST:PORT) served by the front, for an AppRunner
    whose app is the proxy; stopping it closes the front's connections gracefully."""

    __slots__ = ("_sock", "_host", "_port", "_shutdown_timeout", "_front")

    def __init__(self, runner: web.AppRunner, *, sock: socket.socket | None = None, host: str = "127.0.0.1",
                 port: int = 0, shutdown_timeout: float = 10.0) -> None:
        super().__init__(runner)
        self._sock, self._host, self._port = sock, host, port
        self._shutdown_timeout = shutdown_timeout
        self._front: _Front | None = None

    @property
    def name(self) -> str:
        if self._sock is not None and self._sock.family == socket.AF_UNIX:
            return f"http://unix:{self._sock.getsockname()}:"
        host, port = self._sock.getsockname()[:2] if self._sock is not None else (self._host, self._port)
        return f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        runner = self._runner
        assert isinstance(runner, web.AppRunner) and runner.server is not None
        app = runner.app
        loop = asyncio.get_running_loop()
        front = self._front = _Front(app[STATE], app[POOL], app[SESSION], runner.server, loop)
        if self._sock is not None:
            self._server = await loop.create_server(lambda: FrontConnection(front), sock=self._sock,
                                                    backlog=self._backlog)
        else:
            self._server = await loop.create_server(lambda: FrontConnection(front), self._host, self._port,
                                                    backlog=self._backlog)

    async def stop(self) -> None:
        await super().stop()  # no new connections
        front = self._front
        if front is None:
            return
        front.closing = True
        for connection in list(front.connections):
            connection.close_when_idle()
        busy = {c._task if c._task is not None else c._lane_waiter(): c for c in front.connections if c.busy}
        if busy:
            _, pending = await asyncio.wait(busy, timeout=self._shutdown_timeout)
            for waiter in pending:
                connection = busy[waiter]
                if connection._task is not None:
                    connection._task.cancel()
                elif connection._lane is not None:
                    connection._lane_abort()
            if pending:
                await asyncio.wait(pending)
