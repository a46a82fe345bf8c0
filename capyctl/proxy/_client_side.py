"""The client side of the proxy's door: the listening socket's connections.

aiohttp's web server costs more CPU per request above a bare asyncio protocol, on the small
machines CapyCTL is measured on, than the whole hop nginx adds (benchmarks/proxy_hop.py with the
front off; docs/benchmarks.md, "Figures behind design choices"). So the proxy's listening socket
is served by :class:`ClientConnection`, which answers the requests ``_client_heads.read_head``
accepts itself, by the same code as aiohttp's handlers (``_app.answer_json``, ``_app.GET_ROUTES``),
and hands the connection, with every byte not yet answered, to aiohttp's RequestHandler at the
first request it does not accept. ``_client_heads`` is the one place that decides which.

The split follows uvicorn's httptools protocol (uvicorn/protocols/http/httptools_impl.py):

- :class:`ClientConnection`, one per connection: reads heads and bodies, starts one
  :class:`RequestCycle` at a time, in order, hands off, closes idle connections after
  ``KEEPALIVE_S`` (aiohttp's default), and shuts down gracefully (:meth:`ClientConnection.shutdown`);
- :class:`RequestCycle`, one per request: the ``Reply`` its answer is written to, and, for a request
  sent to its engine without a task, the engine answer's listener (``_engine_side.AnswerListener``);
- :class:`FlowControl`, one per connection: its reading and writing paused and resumed.

Bounded by construction (docs/security.md lists the limits):

- reading pauses while a request is being answered and more bytes wait, and while more than
  ``UNSENT_MAX`` bytes of answers are unsent; the next request starts only once they drained. So
  a client that pipelines requests and never reads holds at most one read of its bytes and one
  answer here, and its kernel buffers fill instead;
- a head the front reads is at most ``HEAD_MAX`` bytes and a body ``max_body``;
- at most ``CLIENT_CONNECTIONS_MAX`` client connections are open, here and in aiohttp's server
  together; the next is answered 503 ``too_many_connections`` and closed.

A request the Router admits at once (Router.try_acquire) whose engine has an idle kept-alive
connection is sent on without a task, and its answer written back from the engine connection's
events as they come: a whole answer at its end, an event stream event by event (``EventRelay``'s
rules, those of ``_stream`` in a task), the engine's socket paused while the client's is full. With
no idle connection, or one the engine had closed, it goes on in a task by aiohttp's handlers' code.

``CAPYCTL_PROXY_FRONT=aiohttp`` (or ``CAPYCTL_ACCESS_LOG=1``, or no httptools) hands every connection
to aiohttp's server as it opens; the connection cap still applies.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
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
    EngineMoved,
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
from ._client_heads import HEAD_MAX, RequestHead, front_answers_any, may_begin_head, read_head
from ._engine_side import EngineConnectionError, EnginePool, EngineResponse
from ._errors import error_parts
from ._routes import is_anthropic

log = logging.getLogger("capyctl.proxy")

# Idle keep-alive client connections are closed after this long, here and in aiohttp's server
# (serve() passes it on: aiohttp's own default, RequestHandler's keepalive_timeout, is an hour).
KEEPALIVE_S = 75.0
# Answer bytes unsent to a client (the transport's buffer) past which its next request waits and
# its reading pauses: asyncio's own default high-water mark, set here so that it is a stated limit.
UNSENT_MAX = 64 * 1024
# Open client connections, the front's and aiohttp's together. Each holds at most one head, one
# body (max_body), one read and UNSENT_MAX, so this bounds the proxy's memory for clients; the
# unit's LimitNOFILE= leaves room for as many engine connections besides.
CLIENT_CONNECTIONS_MAX = 1024
# How long a connection refused for the cap is kept to read its head and send the 503.
REFUSED_LINGER_S = 5.0


class FlowControl:
    """One client connection's reading and writing, paused and resumed (uvicorn's
    protocols/http/flow_control.py): ``drain`` waits while the transport's buffer is over its limit."""

    __slots__ = ("_transport", "read_paused", "write_paused", "_writable")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable: asyncio.Future[None] | None = None  # made while writing is paused and awaited

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        if self.write_paused:
            if self._writable is None:
                self._writable = asyncio.get_running_loop().create_future()
            await self._writable


@dataclass(slots=True, eq=False)
class _Front:
    """What every connection of one listening socket shares."""

    state: ProxyState
    pool: EnginePool | None
    session: Any
    aiohttp_server: web.Server  # makes the RequestHandler a connection is handed to
    loop: asyncio.AbstractEventLoop
    answers_any: bool  # front_answers_any: else every connection goes to aiohttp as it opens
    connections_max: int
    connections: set[ClientConnection] = field(default_factory=set)
    closing: bool = False

    def open_connections(self) -> int:
        return len(self.connections) + len(self.aiohttp_server.connections)


_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
_date_cache: list[Any] = [0, b""]


def _date_line() -> bytes:
    """The Date header (RFC 9110 6.6.1: an origin with a clock sends it), formatted once a second."""
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = time.strftime("Date: %a, %d %b %Y %H:%M:%S GMT\r\n", time.gmtime(now)).encode()
    return _date_cache[1]


@functools.lru_cache(maxsize=256)
def _status_and_headers(status: int, headers: tuple[tuple[str, str], ...]) -> bytes:
    """An answer head's status line and headers: a few kinds of answer make every head."""
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")) + b"".join(
        f"{name}: {value}\r\n".encode("latin-1") for name, value in headers)


def _has_body(status: int) -> bool:
    """RFC 9110 6.4.1 and 8.6: a 1xx, 204 or 304 answer has no body and no Content-Length here."""
    return status >= 200 and status not in (204, 304)


class ClientConnection(asyncio.Protocol):
    """One client connection: its requests answered one at a time, in order, or the connection
    given to aiohttp at the first one the front does not answer (the module's docstring)."""

    def __init__(self, front: _Front) -> None:
        self._front = front
        self._transport: asyncio.Transport | None = None
        self._flow: FlowControl | None = None
        self._buffer = bytearray()
        self._head: RequestHead | None = None  # read, its body not all here yet
        self.cycle: RequestCycle | None = None  # the request being answered
        self._lost = False
        self._handed_off = False
        self._refused = False  # over the connection cap: answered 503 once its head is here
        self._close_after_answer = False  # shutting down
        self._last_active = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        state = ("lost" if self._lost else "handed off" if self._handed_off else "refused" if self._refused
                 else "active" if self.cycle is not None else "idle")
        return f"<ClientConnection {state}>"

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a stream transport: asyncio's, or uvloop's, which subclasses none of asyncio's classes)
        self._transport = transport  # type: ignore[assignment]  (TCP_NODELAY: asyncio's and uvloop's default)
        self._transport.set_write_buffer_limits(high=UNSENT_MAX)
        self._flow = FlowControl(self._transport)
        front = self._front
        if front.open_connections() >= front.connections_max:
            self._refused = True
            self._idle_timer = front.loop.call_later(REFUSED_LINGER_S, transport.abort)
            return
        if not front.answers_any:
            self._hand_off()
            return
        front.connections.add(self)
        self._last_active = front.loop.time()
        self._idle_timer = front.loop.call_at(self._last_active + KEEPALIVE_S, self._check_idle)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._refuse(data)
            return
        self._buffer += data
        flow = self._flow
        assert flow is not None
        if self.cycle is None and not flow.write_paused:
            self._advance()
        self._pause_while_ahead()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self._front.connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._flow is not None:
            self._flow.resume_writing()  # (a drain waiting wakes, and finds the client gone)
        if self.cycle is not None:
            self.cycle.client_gone()

    def pause_writing(self) -> None:
        assert self._flow is not None
        self._flow.pause_writing()

    def resume_writing(self) -> None:
        assert self._flow is not None
        self._flow.resume_writing()
        if self.cycle is not None:
            self.cycle.client_writable()
        else:
            self._next_request()

    # ------------------------------------------------------------ what a cycle uses

    @property
    def gone(self) -> bool:
        """The client closed, or the connection is closing: nothing more can be sent."""
        return self._lost or self._transport is None or self._transport.is_closing()

    @property
    def writable(self) -> bool:
        """The answer bytes not yet sent are under ``UNSENT_MAX``."""
        return self._flow is not None and not self._flow.write_paused

    @property
    def closes_after_answer(self) -> bool:
        return self._close_after_answer or self._front.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The transport's (``"socket"``, ``"peername"``...)."""
        return self._transport.get_extra_info(name, default) if self._transport is not None else default

    def unsent_bytes(self) -> int:
        """Answer bytes written but not yet taken by the client's socket."""
        return self._transport.get_write_buffer_size() if self._transport is not None else 0

    def send(self, *parts: bytes) -> None:
        """Write bytes of the answer; ConnectionResetError when the client has gone."""
        if self.gone:
            raise ConnectionResetError("The client closed the connection.")
        assert self._transport is not None
        self._transport.writelines(parts)  # (one send: uvloop buffers the parts then writes; asyncio joins them)

    async def drain(self) -> None:
        """Until the client took enough of what was sent; ConnectionResetError when it has gone."""
        assert self._flow is not None
        await self._flow.drain()
        if self._lost:
            raise ConnectionResetError("The client closed the connection.")

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def cycle_done(self, cycle: RequestCycle) -> None:
        """``cycle``'s answer is sent (or abandoned): on to the next request."""
        if self.cycle is cycle:
            self.cycle = None
        if cycle.close_after:
            self._close_after_answer = True
        self._next_request()

    def shutdown(self) -> None:
        """Close now if no request is being answered, else once its answer is sent."""
        self._close_after_answer = True
        if self.cycle is None and self._transport is not None:
            self._transport.close()

    # ------------------------------------------------------------ requests

    def _advance(self) -> None:
        """Start answering the next request if all of it is here, or hand the connection off."""
        if self._front.closing:
            return
        buffer = self._buffer
        head = self._head
        if head is None:
            end = buffer.find(b"\r\n\r\n", 0, HEAD_MAX)
            if end < 0:
                if not may_begin_head(bytes(buffer)):
                    self._hand_off()
                return
            head = read_head(bytes(buffer[:end + 4]), self._front.state.max_body)
            if head is None:
                self._hand_off()
                return
            self._head = head
        total = head.size + head.content_length
        if len(buffer) < total:
            return
        body = bytes(buffer[head.size:total])
        del buffer[:total]
        self._head = None
        self._last_active = self._front.loop.time()
        cycle = self.cycle = RequestCycle(self._front, self, head, body)
        cycle.start()

    def _next_request(self) -> None:
        if self._lost or self._handed_off or self.cycle is not None:
            return
        assert self._transport is not None and self._flow is not None
        self._last_active = self._front.loop.time()
        if self.closes_after_answer:
            self._transport.close()
            return
        if self._flow.write_paused:
            return  # resume_writing goes on
        self._flow.resume_reading()
        if self._buffer:
            self._advance()
            self._pause_while_ahead()

    def _pause_while_ahead(self) -> None:
        """Read no more while bytes of a next request wait behind one being answered, or behind
        unsent answers: the client waits (TCP) until they are done."""
        assert self._flow is not None
        if self._buffer and not self._handed_off and (self.cycle is not None or self._flow.write_paused):
            self._flow.pause_reading()

    def _hand_off(self) -> None:
        """Give the connection, and what it sent that was not answered, to aiohttp's server."""
        transport = self._transport
        assert transport is not None and self._flow is not None and self.cycle is None
        self._handed_off = True
        self._front.connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        handler = self._front.aiohttp_server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        self._flow.resume_reading()
        data = bytes(self._buffer)
        self._buffer.clear()
        if data:
            handler.data_received(data)

    def _refuse(self, data: bytes) -> None:
        """Over the connection cap: once the head is here (or HEAD_MAX bytes), a 503 and the end."""
        self._buffer += data
        transport = self._transport
        assert transport is not None
        if transport.is_closing() or (b"\r\n\r\n" not in self._buffer and len(self._buffer) < HEAD_MAX):
            return
        error = CapyError(f"The proxy has {self._front.connections_max} client connections open, its limit; "
                          "try again shortly, or reuse a kept-alive connection.",
                          code="too_many_connections", status=503)
        headers, body = error_parts(error, anthropic=False)
        head = _status_and_headers(503, tuple(headers.items()))
        transport.write(head + b"Content-Length: %d\r\n%sConnection: close\r\n\r\n" % (len(body), _date_line()) + body)
        self._buffer.clear()
        transport.close()

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._lost or self._handed_off:
            return
        now = self._front.loop.time()
        deadline = self._last_active + KEEPALIVE_S
        if self.cycle is None and now >= deadline:
            assert self._transport is not None
            self._transport.close()
            return
        self._idle_timer = self._front.loop.call_at(max(deadline, now + 1.0), self._check_idle)


class RequestCycle:
    """One request and its answer (uvicorn's RequestResponseCycle): the ``Reply`` its answer is
    written to, and, for a request sent on without a task, the listener of the engine's answer."""

    def __init__(self, front: _Front, connection: ClientConnection, head: RequestHead, body: bytes) -> None:
        self._front = front
        self._connection = connection
        self._head = head
        self._body = body
        self._started = time.monotonic()
        self.exchange = Exchange(front.state, front.pool, front.session, head.path, head.headers, self)
        self.close_after = head.close  # Connection: close
        self.status = 500  # of the answer, for the metrics
        self._head_sent = False  # (or held for the first chunk: the status can no longer change)
        self._stream_head = b""  # a stream's head, sent with its first chunk (one send, as aiohttp does)
        self._task: asyncio.Task[None] | None = None
        # A request sent on without a task: its admission, the engine's answer, what of it is read.
        self._admitted: AdmittedAtOnce | None = None
        self._response: EngineResponse | None = None
        self._relay: EventRelay | None = None  # an event stream, relayed as it comes
        self._whole: list[bytes] = []  # a whole answer's body, written at its end
        self._engine_paused = False  # the engine's socket, while the client's buffer is full
        self._done = False
        self._finished: asyncio.Future[None] | None = None  # made when a shutdown waits for it

    def __repr__(self) -> str:
        return f"<RequestCycle {self._head.method} {self._head.path} {self.way}>"

    @property
    def way(self) -> str:
        """How the answer goes: "task", "engine events" (sent on without a task), "stream events"
        (an event stream relayed from them), or "done"."""
        if self._done:
            return "done"
        if self._task is not None:
            return "task"
        return "stream events" if self._relay is not None else "engine events"

    @property
    def engine_paused(self) -> bool:
        """The engine's socket is not read while the client takes what was sent."""
        return self._engine_paused

    def start(self) -> None:
        head = self._head
        if head.method == "POST" and self._front.pool is not None and self._send_without_task():
            return
        self._run_in_task(self._route())

    def client_gone(self) -> None:
        """The client went away: the engine's request is closed (it stops generating)."""
        self.status = CLIENT_CLOSED
        if self._task is not None:
            self._task.cancel()  # as aiohttp's handler_cancellation; its end finishes the cycle
        else:
            self._finish()

    def client_writable(self) -> None:
        """The client took what waited: the engine's socket is read again."""
        if self._engine_paused and self._response is not None:
            self._engine_paused = False
            self._response.resume_reading()

    def wait(self) -> asyncio.Future[None]:
        """A future done when the answer is over (for a shutdown to wait on)."""
        if self._finished is None:
            self._finished = self._front.loop.create_future()
            if self._done:
                self._finished.set_result(None)
        return self._finished

    def cancel(self) -> None:
        """A shutdown that waited long enough: the answer is abandoned."""
        self.client_gone()

    # ------------------------------------------------------------ in a task

    async def _route(self) -> None:
        head = self._head
        if head.method == "POST":
            await answer_json(self.exchange, authorize(self.exchange), self._body)
        else:
            await GET_ROUTES[head.path](self.exchange)

    def _run_in_task(self, work: Coroutine[Any, Any, Any]) -> None:
        task = self._task = self._front.loop.create_task(self._answering(work))
        # A callback, not a finally: a task cancelled before its first step (the client gone at once)
        # runs no code of its coroutine, and the cycle must still end.
        task.add_done_callback(functools.partial(self._task_done, work))

    def _task_done(self, work: Coroutine[Any, Any, Any], task: asyncio.Task[None]) -> None:
        work.close()  # (never started when the task was cancelled first: no "never awaited" warning)
        if self._task is task:
            self._task = None
        self._finish()

    async def _answering(self, work: Coroutine[Any, Any, Any]) -> None:
        """Await ``work``, the writing of an answer; what it raises is answered as the client should see it."""
        try:
            await work
        except CapyError as err:
            self._answer_error(err)
        except (asyncio.CancelledError, ConnectionError):
            # The client went away: connection_lost cancelled the task, or the connection was already
            # closing when the answer was written (its connection_lost not yet called).
            self.status = CLIENT_CLOSED
        except Exception:
            log.exception("proxy: unexpected error on %s %s", self._head.method, self._head.path)
            self._answer_error(CapyError("The proxy failed to handle this request.", status=500))

    # ------------------------------------------------------------ without a task

    def _send_without_task(self) -> bool:
        """Send the request on now if the Router admits it at once, on an idle connection to its
        engine, its answer to come as events (or, with no idle connection, in a task, the admission
        kept). False, with nothing admitted, when it needs answer_json."""
        admitted = admit_at_once(self.exchange, self._body)
        if admitted is None:
            return False
        self._admitted = admitted
        pool = self._front.pool
        assert pool is not None
        upstream = admitted.upstream
        try:
            self._response = pool.send_now("POST", upstream.base_url, self._head.path, admitted.payload,
                                           admitted.headers, self, timeout=self._front.state.request_timeout)
        except Exception:  # (not expected: a pooled connection's URL was good before) the task's way says why
            log.debug("proxy: sending without a task failed", exc_info=True)
        if self._response is None:
            self._run_in_task(self._forward_admitted())
        return True

    async def _forward_admitted(self) -> None:
        """The request admitted at once, sent in a task (answer_json's way): once more to its
        deployment's new placement if its engine was lost with its host (EngineMoved)."""
        admitted = self._admitted
        assert admitted is not None
        try:
            await forward(self.exchange, admitted.upstream, self._head.path, admitted.payload, resend=True)
        except EngineMoved as moved:
            log.warning("proxy: %s", moved)
            self._admitted = None
            admitted.release()  # (before waiting for the move: it is in flight nowhere)
            await answer_json(self.exchange, authorize(self.exchange), self._body, resend=False)

    def on_head(self, response: EngineResponse) -> None:
        assert self._admitted is not None
        if response.status in LAUNCH_KEY_REFUSED:
            self._fail(launch_key_refused(self._admitted.upstream))
        elif response.content_type == "text/event-stream":  # relayed event by event, as it comes
            self._relay = EventRelay(self.exchange, self._admitted.upstream)
            # Its head goes with the first events (one send, as aiohttp's server does).
            self._stream_head = self._head_bytes(response.status, STREAM_HEADERS, b"Transfer-Encoding: chunked\r\n")

    def on_body(self, response: EngineResponse, data: bytes) -> None:
        relay = self._relay
        if relay is None:  # a whole answer: written at its end (as a task's read() reads it whole)
            self._whole.append(data)
            return
        events = relay.events(data)
        if not events or self.exchange.outcome == CLIENT_CLOSED:
            return
        try:
            self._send_chunk(events)
        except ConnectionError:  # the client is going: connection_lost ends the cycle
            self.exchange.outcome = CLIENT_CLOSED
            return
        if not self._connection.writable and not self._engine_paused:
            # The client reads slower than the engine writes: the engine waits (TCP), as _stream's
            # awaited write makes it wait; client_writable reads on.
            self._engine_paused = True
            response.pause_reading()

    def on_end(self, response: EngineResponse) -> None:
        if self._relay is not None:
            self._stream_end(self._relay.last())
            return
        body, self._whole = b"".join(self._whole), []
        try:
            reply_whole(self.exchange, response, body)
        except ConnectionError:
            self.status = CLIENT_CLOSED
        self._finish()

    def on_error(self, response: EngineResponse, error: BaseException) -> None:
        assert self._admitted is not None
        if self._relay is not None:  # a stream under way: it ends with an error event
            self._stream_end(self._relay.broken(error))
        elif not response.has_head and isinstance(error, EngineConnectionError):
            # The engine had closed the kept-alive connection as we wrote: never read. The task's
            # way sends it once more, on a new connection (EnginePool.request).
            response.close()
            self._response = None
            self._run_in_task(self._forward_admitted())
        else:
            self._fail(unreachable(self._admitted.upstream, error))

    def _fail(self, error: CapyError) -> None:
        self._answer_error(error)
        self._finish()

    def _stream_end(self, last: bytes) -> None:
        if self.exchange.outcome != CLIENT_CLOSED:
            try:
                self._send_end(last)
            except ConnectionError:
                self.exchange.outcome = CLIENT_CLOSED
        self._finish()

    def _finish(self) -> None:
        """The answer is over, sent or abandoned: everything the cycle held is given back."""
        if self._done or self._task is not None:
            return
        self._done = True
        if self._response is not None:
            # A whole answer's connection goes back to the pool; an unfinished one's is dropped, so
            # the engine stops generating.
            self._response.close()
        if self._admitted is not None:
            self._admitted.release()
        exchange = self.exchange
        self._front.state.metrics.record(deployment=exchange.deployment, route=self._head.path,
                                         status=self.status if exchange.outcome is None else exchange.outcome,
                                         seconds=time.monotonic() - self._started)
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(None)
        # The request's objects point at each other (its exchange at this cycle, its engine answer at
        # this listener): let go of them, so that reference counting frees them now, not the cycle
        # collector some generations later (which let a busy daemon's memory creep up).
        self.exchange = self._response = self._admitted = self._relay = None  # type: ignore[assignment]
        self._connection.cycle_done(self)

    # ------------------------------------------------------------ Reply (_app.Reply)

    def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        if _has_body(status):
            self._connection.send(self._head_bytes(status, headers, b"Content-Length: %d\r\n" % len(body)), body)
        else:
            self._connection.send(self._head_bytes(status, headers, b""))

    async def start_stream(self, status: int, headers: dict[str, str]) -> None:
        if self._connection.gone:
            raise ConnectionResetError("The client closed the connection.")
        self._stream_head = self._head_bytes(status, headers, b"Transfer-Encoding: chunked\r\n")

    async def write(self, data: bytes) -> None:
        self._send_chunk(data)
        await self._connection.drain()

    async def end(self, last: bytes) -> None:
        self._send_end(last)
        await self._connection.drain()

    def _send_chunk(self, data: bytes) -> None:
        if not data:  # an empty chunk would end the body
            return
        head, self._stream_head = self._stream_head, b""
        self._connection.send(head + b"%x\r\n" % len(data), data, b"\r\n")

    def _send_end(self, last: bytes) -> None:
        head, self._stream_head = self._stream_head, b""
        if last:
            self._connection.send(head + b"%x\r\n" % len(last), last, b"\r\n0\r\n\r\n")
        else:
            self._connection.send(head + b"0\r\n\r\n")

    def _head_bytes(self, status: int, headers: dict[str, str], framing: bytes) -> bytes:
        self.status = status
        self._head_sent = True
        parts = [_status_and_headers(status, tuple(headers.items())), framing, _date_line()]
        if self.close_after or self._connection.closes_after_answer:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _answer_error(self, error: CapyError) -> None:
        if self._connection.gone:
            self.status = CLIENT_CLOSED
            return
        if self._head_sent:  # a stream already under way: only closing says something broke
            self.status = error.status
            self._connection.close()
            return
        headers, body = error_parts(error, anthropic=is_anthropic(self._head.path), param=error.detail.get("param"))
        self.whole(error.status, headers, body)


class FrontSite(web.BaseSite):
    """A listening socket (passed, or bound on HOST:PORT) served by :class:`ClientConnection`, for
    an AppRunner whose app is the proxy; stopping it closes the connections gracefully."""

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

    @property
    def connections(self) -> list[ClientConnection]:
        """The client connections the front serves now (not those handed to aiohttp)."""
        return list(self._front.connections) if self._front is not None else []

    @property
    def open_connections(self) -> int:
        """Client connections open now, the front's and aiohttp's."""
        return self._front.open_connections() if self._front is not None else 0

    async def start(self) -> None:
        await super().start()
        runner = self._runner
        assert isinstance(runner, web.AppRunner) and runner.server is not None
        app = runner.app
        loop = asyncio.get_running_loop()
        front = self._front = _Front(app[STATE], app[POOL], app[SESSION], runner.server, loop,
                                     answers_any=front_answers_any(app), connections_max=CLIENT_CONNECTIONS_MAX)
        if self._sock is not None:
            self._server = await loop.create_server(lambda: ClientConnection(front), sock=self._sock,
                                                    backlog=self._backlog)
        else:
            self._server = await loop.create_server(lambda: ClientConnection(front), self._host, self._port,
                                                    backlog=self._backlog)

    async def stop(self) -> None:
        await super().stop()  # no new connections
        front = self._front
        if front is None:
            return
        front.closing = True
        cycles = [connection.cycle for connection in front.connections if connection.cycle is not None]
        for connection in list(front.connections):
            connection.shutdown()
        if not cycles:
            return
        waiters = {cycle.wait(): cycle for cycle in cycles}
        _, pending = await asyncio.wait(waiters, timeout=self._shutdown_timeout)
        for waiter in pending:
            waiters[waiter].cancel()
        if pending:
            await asyncio.wait(pending)
