"""The engine side's pool: kept-alive connections to engines, by base URL, and the request that
goes out on one (capyctl/proxy/_engine_side.py has the connection and the answer, and says why the
proxy has a client of its own)."""

from __future__ import annotations

import asyncio
import collections
import functools
import time
import urllib.parse

from ..descriptors import IDLE_ENGINE_CONNECTIONS
from ._engine_side import AnswerState, EngineConnection, EngineConnectionError, EngineResponse, httptools
from .connector import ENGINE_KEEPALIVE_S

# Idle connections kept per engine: enough for a burst of concurrent requests to find one (the
# daemon's descriptor limit is checked against it at start: capyctl/descriptors.py).
IDLE_PER_ENGINE_MAX = IDLE_ENGINE_CONNECTIONS


class EnginePool:
    """Keep-alive connections to engines, by base URL (see the module's docstring)."""

    def __init__(self, *, connect_timeout: float) -> None:
        self._connect_timeout = connect_timeout
        self._idle: dict[str, collections.deque[EngineConnection]] = {}
        self._closed = False

    async def request(self, method: str, base_url: str, path: str, body: bytes, headers: dict[str, str], *,
                      unix_socket: str | None = None, timeout: float | None = None) -> EngineResponse:
        """Send one request and wait for the answer's status and headers."""
        authority, base_path, host, port = _split(base_url)
        message = _message(method, authority, base_path + path, body, headers)
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            # Once more on a new connection, never another pooled one: the engine may be closing
            # all of them (llama-server closes one after a streamed answer, its head said
            # keep-alive or not).
            connection = self._idle_connection(base_url) if attempt == 0 else None
            reused = connection is not None
            if connection is None:
                connection = await self._connect(loop, base_url, host, port, unix_socket)
            response = EngineResponse(self, connection, loop)
            if timeout is not None:
                response.set_deadline(timeout)
            connection.start(response, message)
            try:
                await response.wait_head()
            except BaseException:
                response.close()  # cancelled while waiting: the connection is dropped
                raise
            if response.state is not AnswerState.FAILED or response.has_head:
                return response
            response.close()
            error = response.error
            assert error is not None
            if not (reused and isinstance(error, EngineConnectionError)) or attempt:
                raise error
            # A pooled connection the engine had closed: it never read the request. Once more, afresh.
        raise AssertionError("unreachable")

    def idle(self) -> list[EngineConnection]:
        """The idle connections kept now, of every engine."""
        return [connection for connections in self._idle.values() for connection in connections]

    def put_back(self, connection: EngineConnection) -> None:
        """A connection whose answer was whole: idle in the pool until reused or too old."""
        if self._closed:
            connection.close()
            return
        connections = self._idle.setdefault(connection.pool_key, collections.deque())
        connection.released_at = time.monotonic()
        connections.append(connection)
        # Drop the connections idle too long (the engine closes them soon) and any past the cap.
        oldest_usable = connection.released_at - ENGINE_KEEPALIVE_S
        while connections and (connections[0].released_at <= oldest_usable or not connections[0].reusable
                               or len(connections) > IDLE_PER_ENGINE_MAX):
            connections.popleft().close()

    def close(self) -> None:
        self._closed = True
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def _idle_connection(self, base_url: str) -> EngineConnection | None:
        connections = self._idle.get(base_url)
        if not connections:
            return None
        oldest_usable = time.monotonic() - ENGINE_KEEPALIVE_S
        while connections:
            connection = connections.pop()  # the most recently used is the likeliest still open
            if connection.reusable and connection.released_at > oldest_usable:
                return connection
            connection.close()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop, base_url: str, host: str, port: int,
                       unix_socket: str | None) -> EngineConnection:
        try:
            async with asyncio.timeout(self._connect_timeout):
                if unix_socket is not None:
                    _, connection = await loop.create_unix_connection(lambda: EngineConnection(base_url), unix_socket)
                else:
                    _, connection = await loop.create_connection(lambda: EngineConnection(base_url), host, port)
        except TimeoutError:
            raise
        except OSError as exc:
            raise EngineConnectionError(f"cannot connect to {unix_socket or f'{host}:{port}'}: {exc}") from exc
        return connection


def make_engine_pool(*, connect_timeout: float) -> EnginePool | None:
    """The proxy's client to engines; None where httptools is not installed."""
    return EnginePool(connect_timeout=connect_timeout) if httptools is not None else None


def _message(method: str, authority: str, target: str, body: bytes, headers: dict[str, str]) -> bytes:
    """One request's bytes: head and body, written in one go."""
    return _head_of(method, authority, target, tuple(headers.items())) + b"Content-Length: %d\r\n\r\n" % len(body) + body


@functools.lru_cache(maxsize=256)
def _head_of(method: str, authority: str, target: str, headers: tuple[tuple[str, str], ...]) -> bytes:
    """A request head but its length: the same few per engine and route, formatted once."""
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
