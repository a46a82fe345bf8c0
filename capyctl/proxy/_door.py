"""The proxy's door: its listening socket's client connections, bounded under hostile load.

aiohttp's web server reads and answers every request: one ``RequestHandler`` a connection
(aiohttp/web_protocol.py), made by the AppRunner's ``web.Server`` (aiohttp/web_server.py,
``Server.__call__``). :class:`DoorSite` serves that server as aiohttp's own SockSite and TCPSite
do (aiohttp/web_runner.py: ``loop.create_server(runner.server, ...)``), with one
:class:`DoorConnection` between each connection's transport and its RequestHandler: it passes
every event on, and holds the connection to :class:`DoorSettings` (docs/security.md lists what a
client sees past each limit):

- **the head deadline**: a request head must be whole within ``head_timeout`` of the
  connection's start, or, on a kept-alive connection, of the first byte that follows the previous
  answer (before that byte the connection is idle, and aiohttp's ``keepalive_timeout`` governs
  it). Past it the connection is answered 408 ``request_head_timeout`` with ``Connection: close``
  and closed (without the 408 where the previous answer is still unsent). Only head reading is
  bounded: from the moment aiohttp hands a whole head to the application until the application
  has answered it (a request waiting for its engine included), no deadline runs; a head begun while
  the previous request was being answered (pipelined) is timed from its next byte after that
  answer, or, if none comes, left to the keep-alive timeout like an idle connection;
- **the connection cap**: at most ``connections_max`` client connections are open; past it a new
  one is answered 503 ``too_many_connections``;
- **the per-address cap**: at most ``per_address_max`` of them from one client address; past it
  that address's new connections alone are answered 503 ``too_many_connections_from_address``;
- **the keyed reserve**, the rule that keeps a flood of connections without a key (half-sent heads,
  or idle ones) from starving the clients that have one. A connection is *keyed* once a request
  on it carried a valid API key (:func:`key_accepted`, called where the proxy authorizes a key);
  every connection starts unkeyed, since its first head has not been read yet. Unkeyed
  connections may hold at most ``connections_max - keyed_reserve`` of the slots, so
  ``keyed_reserve`` of them are only ever held by keyed connections. A new connection that would
  pass that share, or the cap, takes the slot of the oldest unkeyed connection that is not being
  answered (one waiting for, or part-way through, a head; or idle between requests): that one is
  answered 503 ``too_many_connections`` if it is part-way through a head, or closed silently if it
  is idle, as a server may close any idle kept-alive connection (aiohttp's keep-alive timeout does
  the same). Only when no
  unkeyed connection can give way is the new one refused. So keyed connections are never closed
  for room, a keyed client's new connection gets in while the unkeyed ones are an attacker's half
  heads, and each half head lives at most until ``head_timeout``, or until newer connections push
  it out.

A refused connection is kept only until its head is read (or ``REFUSED_LINGER_S``) so that its 503
is read by the client rather than lost to a reset, and at most ``REFUSED_WAITING_MAX`` of them at
once: past that, a refused connection is closed at once without an answer, so that refusals never
hold more descriptors than that.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import http
import socket
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, Awaitable, Callable

from aiohttp import web

from ..errors import CapyError
from ._errors import error_parts

# A refused connection waits this long at most for its head, then is closed without an answer.
REFUSED_LINGER_S = 2.0
# Refused connections waiting for their heads at once; past it one is closed at once, unanswered.
REFUSED_WAITING_MAX = 128
# Bytes of a refused connection's head read at most: its 503 goes out at its blank line or here.
REFUSED_HEAD_MAX = 16 * 1024

# The connection whose request is being handled. Set while aiohttp's RequestHandler is made and
# connected: its connection_made starts the connection's task (web_protocol.py, ``self.start()``),
# which copies the context as every asyncio task does, and each request's task is started from
# that one (``_handle_request``), so the application's code of every request on the connection
# sees it. That is how :func:`key_accepted` finds its connection from ``authorize``, which sees
# only the request's headers.
_CONNECTION: contextvars.ContextVar[DoorConnection] = contextvars.ContextVar("capyctl_door_connection")

# A connection's phase: waiting for a head (or reading one), a request being answered, or idle
# between an answer and the next request's first byte.
_HEAD, _ANSWERING, _IDLE = "head", "answering", "idle"


@dataclass(frozen=True, slots=True)
class DoorSettings:
    """The door's limits (config_file.DoorConfig, the configuration file's ``door:``)."""

    head_timeout: float = 10.0
    connections_max: int = 1024
    per_address_max: int = 256
    keyed_reserve: int = 256
    keepalive_timeout: float = 75.0

    def __post_init__(self) -> None:
        if not self.head_timeout > 0 or not self.keepalive_timeout > 0:
            raise CapyError("The door's head_timeout and keepalive_timeout must be more than 0.",
                            code="invalid_door_settings", status=400)
        if self.per_address_max < 1 or not 0 <= self.keyed_reserve < self.connections_max:
            raise CapyError("The door needs per_address_max of 1 or more and a keyed_reserve from 0 to less "
                            "than connections_max.", code="invalid_door_settings", status=400)

    @property
    def unkeyed_max(self) -> int:
        """The slots connections without a valid key may hold."""
        return self.connections_max - self.keyed_reserve


def key_accepted() -> None:
    """The request being handled carried a valid API key: its connection is keyed from now on
    (the module's docstring). Does nothing outside a request of a :class:`DoorSite`."""
    connection = _CONNECTION.get(None)
    if connection is not None:
        connection.mark_keyed()


def _answer(error: CapyError) -> bytes:
    """A whole error answer that closes the connection, in the OpenAI error shape."""
    headers, body = error_parts(error)
    lines = [f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}",
             *(f"{name}: {value}" for name, value in headers.items()),
             f"Content-Length: {len(body)}", f"Date: {formatdate(usegmt=True)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def _address_of(transport: asyncio.BaseTransport) -> str | None:
    """The client's address; None on a unix socket, whose clients have none to tell apart."""
    peer = transport.get_extra_info("peername")
    if not isinstance(peer, tuple) or not peer:
        return None
    host = str(peer[0])
    # An IPv4 client of a dual-stack socket is the same client as over IPv4.
    return host[7:] if host.startswith("::ffff:") and "." in host else host


class _Door:
    """What every connection of one DoorSite shares: the counts its limits are kept by."""

    def __init__(self, settings: DoorSettings, server: web.Server, loop: asyncio.AbstractEventLoop) -> None:
        self.settings = settings
        self.server = server  # makes each connection's RequestHandler
        self.loop = loop
        self._open: set[DoorConnection] = set()  # admitted and not yet counted out
        self._unkeyed = 0
        self._per_address: collections.Counter[str] = collections.Counter()
        # Unkeyed connections not being answered, the one that gives way first, first (an OrderedDict:
        # its first key is found in constant time however many were taken from its front).
        self._yielding: collections.OrderedDict[DoorConnection, None] = collections.OrderedDict()
        self._refused_waiting: set[DoorConnection] = set()

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def keyed_connections(self) -> int:
        return len(self._open) - self._unkeyed

    def admit(self, connection: DoorConnection) -> CapyError | None:
        """Count ``connection`` in, or the error it is refused with."""
        settings = self.settings
        address = connection.address
        if address is not None and self._per_address[address] >= settings.per_address_max:
            return CapyError(f"This address has {settings.per_address_max} connections open to the proxy, its "
                             "limit; reuse a kept-alive connection, or close one.",
                             code="too_many_connections_from_address", status=503)
        if len(self._open) >= settings.connections_max or self._unkeyed >= settings.unkeyed_max:
            if not self._yielding:
                return CapyError("The proxy has its limit of client connections open; try again shortly, or "
                                 "reuse a kept-alive connection.", code="too_many_connections", status=503)
            next(iter(self._yielding)).give_way()  # (counted out: room for this one)
        self._open.add(connection)
        self._unkeyed += 1
        if address is not None:
            self._per_address[address] += 1
        self._yielding[connection] = None
        return None

    def count_out(self, connection: DoorConnection) -> None:
        """``connection`` is closed or closing: its slot is free. Once only; later calls do nothing."""
        if connection not in self._open:
            return
        self._open.discard(connection)
        self._yielding.pop(connection, None)
        if not connection.keyed:
            self._unkeyed -= 1
        address = connection.address
        if address is not None:
            self._per_address[address] -= 1
            if not self._per_address[address]:
                del self._per_address[address]

    def keyed(self, connection: DoorConnection) -> None:
        """``connection`` (unkeyed until now) carried a valid key."""
        if connection in self._open:
            self._unkeyed -= 1
            self._yielding.pop(connection, None)

    def answering(self, connection: DoorConnection) -> None:
        self._yielding.pop(connection, None)

    def waiting(self, connection: DoorConnection) -> None:
        """``connection``'s answer is over: unkeyed, it may give way again, last in line."""
        if connection in self._open and not connection.keyed:
            self._yielding[connection] = None
            self._yielding.move_to_end(connection)

    def refused_room(self, connection: DoorConnection) -> bool:
        """Whether a refused connection may wait for its head (REFUSED_WAITING_MAX)."""
        if len(self._refused_waiting) >= REFUSED_WAITING_MAX:
            return False
        self._refused_waiting.add(connection)
        return True

    def refused_done(self, connection: DoorConnection) -> None:
        self._refused_waiting.discard(connection)

    def close_refused(self) -> None:
        for connection in list(self._refused_waiting):
            connection.abort()


class _Answering:
    """The application's request handler, telling each request's connection when its answer starts
    and ends: the head deadline runs only outside them."""

    __slots__ = ("handler",)

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]) -> None:
        self.handler = handler

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        connection = _CONNECTION.get(None)
        if connection is None:  # (a connection of another site of the same server)
            return await self.handler(request)
        connection.answer_started()
        try:
            return await self.handler(request)
        finally:
            connection.answer_ended()


class DoorConnection(asyncio.Protocol):
    """One client connection: its events passed on to aiohttp's RequestHandler, its head deadline
    kept, its slot counted (the module's docstring); or, refused, its head read and a 503 sent."""

    __slots__ = ("_door", "_transport", "_handler", "_phase", "_timer", "_refusal", "_refused_head", "keyed",
                 "address")

    def __init__(self, door: _Door) -> None:
        self._door = door
        self._transport: asyncio.Transport | None = None
        self._handler: Any = None  # aiohttp's RequestHandler, once admitted
        self._phase = _HEAD
        self._timer: asyncio.TimerHandle | None = None
        self._refusal: CapyError | None = None  # refused: answered once its head is here
        self._refused_head = bytearray()
        self.keyed = False
        self.address: str | None = None

    def __repr__(self) -> str:
        state = "refused" if self._handler is None else f"{'keyed' if self.keyed else 'unkeyed'} {self._phase}"
        return f"<DoorConnection {self.address} {state}>"

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a stream transport: asyncio's, or uvloop's, which subclasses none of asyncio's classes)
        self._transport = transport  # type: ignore[assignment]
        self.address = _address_of(transport)
        door = self._door
        refusal = door.admit(self)
        if refusal is not None:
            self._refuse(refusal)
            return
        token = _CONNECTION.set(self)
        try:
            handler = door.server()  # a RequestHandler (web_server.py, Server.__call__)
            handler.connection_made(transport)  # (starts its task, which copies the context: _CONNECTION)
        finally:
            _CONNECTION.reset(token)
        self._handler = handler
        self._arm()

    def data_received(self, data: bytes) -> None:
        handler = self._handler
        if handler is None:
            self._refused_data(data)
            return
        if self._phase == _IDLE:  # the first byte of the next request: its head's deadline starts
            self._phase = _HEAD
            self._arm()
        handler.data_received(data)

    def eof_received(self) -> bool | None:
        handler = self._handler
        return handler.eof_received() if handler is not None else None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._door.count_out(self)
        self._door.refused_done(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        handler, self._handler = self._handler, None
        if handler is not None:
            handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()

    # ------------------------------------------------------------ what the door and requests call

    def answer_started(self) -> None:
        """aiohttp handed a whole head to the application: no deadline until it has answered."""
        self._phase = _ANSWERING
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._door.answering(self)

    def answer_ended(self) -> None:
        """The application answered (aiohttp may still be sending a whole answer): the connection is
        idle until the next request's first byte."""
        if self._handler is None:  # (the connection was lost meanwhile)
            return
        self._phase = _IDLE
        self._door.waiting(self)

    def mark_keyed(self) -> None:
        if not self.keyed:
            self._door.keyed(self)
            self.keyed = True

    def give_way(self) -> None:
        """Closed to make room for a newer connection (the keyed reserve): a 503 where a head was
        awaited, nothing on an idle kept-alive connection."""
        error = None
        if self._phase == _HEAD:
            error = CapyError("The proxy closed this connection to make room: it has its limit of client "
                              "connections open without a valid API key. Send the whole request at once, "
                              "with your key.", code="too_many_connections", status=503)
        self._close(error)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # ------------------------------------------------------------ the head deadline

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._door.loop.call_later(self._door.settings.head_timeout, self._head_late)

    def _head_late(self) -> None:
        self._timer = None
        if self._phase != _HEAD:
            return
        transport = self._transport
        if transport is not None and transport.get_write_buffer_size():
            # The previous answer is still going out (the client does not read it): no status can
            # follow it as the answer to this head, so the connection closes without one.
            self._close(None)
            return
        timeout = self._door.settings.head_timeout
        self._close(CapyError(f"The request head did not arrive whole within {timeout:g} s.",
                              code="request_head_timeout", status=408))

    def _close(self, error: CapyError | None) -> None:
        """Count the connection out and close it, with ``error``'s answer first where one is given
        (only while no answer is in progress on it)."""
        self._door.count_out(self)
        transport, handler = self._transport, self._handler
        if transport is None or handler is None or transport.is_closing():
            return
        if error is not None:
            transport.write(_answer(error))
        # As aiohttp closes a connection whose keep-alive time ran out (web_protocol.py,
        # _process_keepalive): its task ends, and the transport closes once what was written is sent.
        handler.force_close()

    # ------------------------------------------------------------ refused

    def _refuse(self, error: CapyError) -> None:
        transport = self._transport
        assert transport is not None
        if not self._door.refused_room(self):
            transport.abort()
            return
        self._refusal = error
        self._timer = self._door.loop.call_later(REFUSED_LINGER_S, transport.abort)

    def _refused_data(self, data: bytes) -> None:
        transport = self._transport
        error = self._refusal
        if error is None or transport is None or transport.is_closing():
            return
        head = self._refused_head
        start = max(0, len(head) - 3)
        head += data
        if head.find(b"\r\n\r\n", start) < 0 and len(head) < REFUSED_HEAD_MAX:
            return
        self._refusal = None
        self._refused_head = bytearray()
        transport.write(_answer(error))
        transport.close()


class DoorSite(web.BaseSite):
    """A listening socket (passed, or bound on HOST:PORT) whose connections aiohttp's server of
    ``runner`` answers, through the door's limits (:class:`DoorSettings`)."""

    __slots__ = ("_settings", "_sock", "_host", "_port", "_door")

    def __init__(self, runner: web.BaseRunner, settings: DoorSettings, *, sock: socket.socket | None = None,
                 host: str = "127.0.0.1", port: int = 0, backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._settings = settings
        self._sock, self._host, self._port = sock, host, port
        self._door: _Door | None = None

    @property
    def name(self) -> str:
        if self._sock is not None and self._sock.family == socket.AF_UNIX:
            return f"http://unix:{self._sock.getsockname()}:"
        host, port = self._sock.getsockname()[:2] if self._sock is not None else (self._host, self._port)
        return f"http://{host}:{port}"

    @property
    def open_connections(self) -> int:
        """Client connections counted in now."""
        return self._door.open_connections if self._door is not None else 0

    @property
    def keyed_connections(self) -> int:
        """Those of them that carried a valid key."""
        return self._door.keyed_connections if self._door is not None else 0

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        door = self._door = _Door(self._settings, server, loop)
        # Each RequestHandler takes the server's request_handler when it is made (web_protocol.py,
        # RequestHandler.__init__), so the wrapped one serves every connection of this site.
        if not isinstance(server.request_handler, _Answering):  # (once, however often the site starts)
            server.request_handler = _Answering(server.request_handler)

        def connection() -> DoorConnection:
            return DoorConnection(door)
        if self._sock is not None:
            self._server = await loop.create_server(connection, sock=self._sock, backlog=self._backlog)
        else:
            self._server = await loop.create_server(connection, self._host, self._port, backlog=self._backlog)

    async def stop(self) -> None:
        await super().stop()  # no new connections; the runner's cleanup closes aiohttp's
        if self._door is not None:
            self._door.close_refused()
