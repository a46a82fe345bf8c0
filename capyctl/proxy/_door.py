"""The proxy's door: its listening socket's client connections, bounded under hostile load.

aiohttp's web server answers every request, one ``RequestHandler`` a connection made by the
AppRunner's ``web.Server`` (aiohttp/web_protocol.py, web_server.py). :class:`DoorSite` serves it as
aiohttp's SockSite and TCPSite do (web_runner.py), with a :class:`DoorConnection` between each
transport and its RequestHandler that passes every event on and holds the connection to
:class:`DoorSettings` (docs/security.md says what a client sees past each limit):

- **the head deadline**: a head must be whole within ``head_timeout`` of the connection's start,
  or of the first byte after the previous answer (an idle connection is the keep-alive timeout's);
  else 408 ``request_head_timeout`` and closed (closed silently where the previous answer is still
  unsent). No deadline runs while a request is being answered, a wait for its engine included;
- **the connection cap**, ``connections_max``: past it, 503 ``too_many_connections``;
- **the per-address cap**, ``per_address_max``: that address alone, 503 ``..._from_address``;
- **the keyed reserve**: a connection is *keyed* once a request on it carried a valid API key
  (:func:`key_accepted`); unkeyed connections hold at most ``connections_max - keyed_reserve``
  slots. A new connection past that share or the cap takes the slot of the oldest unkeyed one that
  has waited YIELD_AFTER_S for a head, or been idle as long (503 or closed silently); with none, it
  waits unread up to WAIT_FOR_ROOM_S (a burst connecting at once is unkeyed until its heads are
  read), then is refused; past the cap it is refused at once. Keyed ones never give way.

A refused connection is kept until its head is read (at most ``REFUSED_LINGER_S``, and at most
``REFUSED_WAITING_MAX`` at once), so that its 503 is read rather than lost to a reset.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import socket
from typing import Any, Awaitable, Callable

from aiohttp import web

from ..errors import CapyError
from ._door_settings import DoorSettings
from ._door_wire import client_address, closing_answer

# A refused connection waits this long at most for its head, then is closed without an answer.
REFUSED_LINGER_S = 2.0
# Refused connections waiting for their heads at once; past it one is closed at once, unanswered.
REFUSED_WAITING_MAX = 128
# Bytes of a refused connection's head read at most: its 503 goes out at its blank line or here.
REFUSED_HEAD_MAX = 16 * 1024
# A new connection past the unkeyed share with none to give way waits (unread) this long at most for
# room, then is refused; at most WAITING_FOR_ROOM_MAX wait at once (refused at once past that).
WAIT_FOR_ROOM_S = 2.0
WAITING_FOR_ROOM_MAX = 1024
# An unkeyed connection gives way only once it has waited this long for a head (or been idle): a
# client that just connected has had no time to show its key.
YIELD_AFTER_S = 1.0

# The connection whose request is being handled, for :func:`key_accepted` (``authorize`` sees only
# headers): set while aiohttp's RequestHandler is connected, whose task (web_protocol.py,
# ``self.start()``), and each request's task started from it, copy the context.
_CONNECTION: contextvars.ContextVar[DoorConnection] = contextvars.ContextVar("capyctl_door_connection")

# A connection's phase: waiting for a head (or reading one), a request being answered, or idle
# between an answer and the next request's first byte.
_HEAD, _ANSWERING, _IDLE = "head", "answering", "idle"


def key_accepted() -> None:
    """The request being handled carried a valid API key: its connection is keyed from now on
    (the module's docstring). Does nothing outside a request of a :class:`DoorSite`."""
    connection = _CONNECTION.get(None)
    if connection is not None:
        connection.mark_keyed()


class _Wait:
    """:meth:`_Door.admit`'s answer to a connection that waits for room."""


WAIT = _Wait()


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
        # New connections waiting (unread) for room in the unkeyed share, oldest first.
        self._waiting_for_room: collections.OrderedDict[DoorConnection, None] = collections.OrderedDict()
        self._making_room = False

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def keyed_connections(self) -> int:
        return len(self._open) - self._unkeyed

    def admit(self, connection: DoorConnection, *, may_wait: bool = True) -> CapyError | None | _Wait:
        """Count ``connection`` in; or the error it is refused with; or WAIT, when it may wait for
        room in the unkeyed share (``may_wait``, and the waiting room has a place): the door admits
        it later (:meth:`_admit_waiting`) or refuses it once WAIT_FOR_ROOM_S have passed."""
        settings = self.settings
        address = connection.address
        if address is not None and self._per_address[address] >= settings.per_address_max:
            return CapyError(f"This address has {settings.per_address_max} connections open to the proxy, its "
                             "limit; reuse a kept-alive connection, or close one.",
                             code="too_many_connections_from_address", status=503)
        at_cap = len(self._open) >= settings.connections_max
        if at_cap or self._unkeyed >= settings.unkeyed_max:
            oldest = next(iter(self._yielding), None)
            if oldest is None or self.loop.time() - oldest.yielding_since < YIELD_AFTER_S:
                if not at_cap and may_wait and len(self._waiting_for_room) < WAITING_FOR_ROOM_MAX:
                    self._waiting_for_room[connection] = None
                    return WAIT
                return CapyError("The proxy has its limit of client connections open; try again shortly, or "
                                 "reuse a kept-alive connection.", code="too_many_connections", status=503)
            self._making_room = True  # (the slot it frees is this one's, not a waiting one's)
            try:
                oldest.give_way()  # (counted out: room for this one)
            finally:
                self._making_room = False
        self._count_in(connection)
        return None

    def _count_in(self, connection: DoorConnection) -> None:
        address = connection.address
        self._open.add(connection)
        self._unkeyed += 1
        if address is not None:
            self._per_address[address] += 1
        self._yielding[connection] = None
        connection.yielding_since = self.loop.time()

    def stop_waiting(self, connection: DoorConnection) -> None:
        """``connection`` no longer waits for room (admitted, refused, or gone)."""
        self._waiting_for_room.pop(connection, None)

    def _admit_waiting(self) -> None:
        """Room in the unkeyed share (a connection turned keyed or closed): let the oldest waiting in."""
        while not self._making_room and self._waiting_for_room and self._unkeyed < self.settings.unkeyed_max \
                and len(self._open) < self.settings.connections_max:
            connection = next(iter(self._waiting_for_room))
            del self._waiting_for_room[connection]
            self._count_in(connection)
            connection.admitted()

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
        self._admit_waiting()

    def keyed(self, connection: DoorConnection) -> None:
        """``connection`` (unkeyed until now) carried a valid key."""
        if connection in self._open:
            self._unkeyed -= 1
            self._yielding.pop(connection, None)
            self._admit_waiting()

    def answering(self, connection: DoorConnection) -> None:
        self._yielding.pop(connection, None)

    def waiting(self, connection: DoorConnection) -> None:
        """``connection``'s answer is over: unkeyed, it may give way again, last in line."""
        if connection in self._open and not connection.keyed:
            self._yielding[connection] = None
            self._yielding.move_to_end(connection)
            connection.yielding_since = self.loop.time()

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
                 "address", "yielding_since", "_waiting")

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
        self.yielding_since = 0.0  # (loop time) when it last became one that may give way
        self._waiting = False  # for room (WAIT): what it sends meanwhile is kept in _refused_head

    def __repr__(self) -> str:
        state = "refused" if self._handler is None else f"{'keyed' if self.keyed else 'unkeyed'} {self._phase}"
        return f"<DoorConnection {self.address} {state}>"

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a stream transport: asyncio's, or uvloop's, which subclasses none of asyncio's classes)
        self._transport = transport  # type: ignore[assignment]
        self.address = client_address(transport)
        door = self._door
        refusal = door.admit(self)
        if refusal is WAIT:  # unread until the door has room for it, or refused after a while
            self._waiting = True
            self._transport.pause_reading()  # (uvloop may still hand over what came with the connection)
            self._timer = door.loop.call_later(WAIT_FOR_ROOM_S, self._waited_too_long)
            return
        if refusal is not None:
            self._refuse(refusal)
            return
        self._connect_handler()

    def _connect_handler(self) -> None:
        transport, door = self._transport, self._door
        token = _CONNECTION.set(self)
        try:
            handler = door.server()  # a RequestHandler (web_server.py, Server.__call__)
            handler.connection_made(transport)  # (starts its task, which copies the context: _CONNECTION)
        finally:
            _CONNECTION.reset(token)
        self._handler = handler
        self._arm()

    def admitted(self) -> None:
        """The door had room for this connection, which waited for it (counted in already)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            self._door.count_out(self)
            return
        self._connect_handler()
        self._resume()

    def _waited_too_long(self) -> None:
        self._timer = None
        self._door.stop_waiting(self)
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        refusal = self._door.admit(self, may_wait=False)  # an unkeyed one may give way by now
        if refusal is None:
            self._connect_handler()
        else:
            assert isinstance(refusal, CapyError)
            self._refuse(refusal)
        self._resume()

    def _resume(self) -> None:
        """Out of the wait for room: what came meanwhile first, then reading again."""
        self._waiting = False
        early, self._refused_head = bytes(self._refused_head), bytearray()
        if early:
            self.data_received(early)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        handler = self._handler
        if handler is None:
            if self._waiting:
                self._refused_head += data
                if len(self._refused_head) > REFUSED_HEAD_MAX and self._transport is not None:
                    self._transport.abort()
                return
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
        self._door.stop_waiting(self)
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
            transport.write(closing_answer(error))
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
        transport.write(closing_answer(error))
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
