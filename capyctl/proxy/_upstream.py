"""A request sent on to an engine, through one of the proxy's two clients, and what breaks it.

JSON bodies go through the proxy's own engine client (``_engine_side``, the POOL app key) where
httptools is installed; multipart forms, whose spooled files aiohttp writes, and everything where
httptools is missing go through aiohttp's ClientSession (SESSION). Either answer is read through
the same calls (:data:`EngineAnswer`).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Union

import aiohttp

from .. import descriptors
from ..errors import CapyError
from ._engine_side import EngineConnectionError, EngineResponse
from ._exchange import Exchange
from .router import Upstream

# Loopback engines accept at once or not at all; a long connect wait only hides a dead engine.
CONNECT_TIMEOUT = 10.0
# An engine answering these refused the per-launch key: our fault, not the client's key.
LAUNCH_KEY_REFUSED = (401, 403)


class AiohttpAnswer:
    """An engine's answer through aiohttp's client (a multipart form, which aiohttp writes with its
    spooled files; or any request where httptools is missing), read as an :class:`EngineResponse`."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.content_type
        self._on_close: Callable[[], None] | None = None

    def header(self, name: str, default: str | None = None) -> str | None:
        return self._response.headers.get(name, default)

    async def readany(self) -> bytes:
        return await self._response.content.readany()

    async def read(self) -> bytes:
        return await self._response.read()

    async def json(self) -> Any:
        return json.loads(await self._response.read())

    def close(self) -> None:
        self._response.close()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def on_close(self, callback: Callable[[], None]) -> None:
        self._on_close = callback


EngineAnswer = Union[EngineResponse, AiohttpAnswer]
# What breaks an exchange with an engine, from either client.
UPSTREAM_ERRORS = (aiohttp.ClientError, EngineConnectionError, TimeoutError)


def upstream_headers(upstream: Upstream, content_type: str = "application/json") -> dict[str, str]:
    # identity: the engine's bytes are passed on as they are, never re-encoded here.
    headers = {"Content-Type": content_type, "Accept-Encoding": "identity"}
    if upstream.api_key:
        headers["Authorization"] = f"Bearer {upstream.api_key}"
    return headers


def _content_type_of(payload: bytes | aiohttp.MultipartWriter) -> str:
    # A form's Content-Type carries its boundary. (bytes first: isinstance against MultipartWriter
    # goes through ABCMeta, measurable on every request in proxy_hop's native profile.)
    if isinstance(payload, bytes):
        return "application/json"
    return payload.content_type


def verdict(upstream: Upstream) -> CapyError | None:
    """Why CapyCTL cut this engine (a hung engine its watchdog stopped), if it did."""
    return upstream.verdict() if upstream.verdict is not None else None


def unreachable(upstream: Upstream, exc: BaseException) -> CapyError:
    cut = verdict(upstream)
    if cut is not None:  # the connection broke because CapyCTL stopped the engine: say why
        return cut
    if descriptors.is_shortage(exc):  # the daemon's own shortage: not the engine's fault
        return descriptors.shortage_error(f"connect to the engine of '{upstream.deployment}'")
    if isinstance(exc, TimeoutError):
        return CapyError(f"The engine of '{upstream.deployment}' did not answer in time.",
                         code="engine_timeout", status=504)
    return CapyError(f"The engine of '{upstream.deployment}' could not be reached or closed the "
                     f"connection ({type(exc).__name__}).", code="engine_unreachable", status=502)


def launch_key_refused(upstream: Upstream) -> CapyError:
    return CapyError(f"The engine of '{upstream.deployment}' refused CapyCTL's launch key.",
                     code="engine_auth_failed", status=502)


async def open_upstream(exchange: Exchange, upstream: Upstream, path: str,
                        payload: bytes | aiohttp.MultipartWriter, *, method: str = "POST") -> EngineAnswer:
    """Send the request to the engine and wait for its answer's head (a refused launch key raised)."""
    state = exchange.state
    headers = upstream_headers(upstream, _content_type_of(payload))
    pool = exchange.pool
    # At most the engine's bound of exchanges at once, so at most that many connections (_engine_limits).
    release = await state.engine_limits.acquire(upstream)
    try:
        if isinstance(payload, bytes) and pool is not None:
            response: EngineAnswer = await pool.request(
                method, upstream.base_url, path, payload, headers, unix_socket=upstream.unix_socket,
                timeout=state.request_timeout)
        else:
            session = exchange.session
            assert session is not None
            if upstream.unix_socket is not None:
                session.connector.route(upstream.base_url, upstream.unix_socket)  # type: ignore[union-attr]
            timeout = aiohttp.ClientTimeout(total=state.request_timeout, sock_connect=CONNECT_TIMEOUT)
            response = AiohttpAnswer(await session.request(
                method, upstream.base_url.rstrip("/") + path, data=payload if method == "POST" else None,
                headers=headers, timeout=timeout))
    except UPSTREAM_ERRORS as exc:
        release()
        raise unreachable(upstream, exc) from exc
    except BaseException:
        release()
        raise
    response.on_close(release)
    if response.status in LAUNCH_KEY_REFUSED:
        response.close()
        raise launch_key_refused(upstream)
    return response


async def read_whole(upstream: Upstream, answer: EngineAnswer) -> bytes:
    """The rest of the engine's answer; a break in it is the engine's (CapyError)."""
    try:
        return await answer.read()
    except UPSTREAM_ERRORS as exc:
        raise unreachable(upstream, exc) from exc


async def json_of(upstream: Upstream, answer: EngineAnswer) -> Any:
    """The engine's answer as JSON (None when it is not JSON); the answer is closed either way."""
    try:
        return await answer.json()
    except UPSTREAM_ERRORS as exc:
        raise unreachable(upstream, exc) from exc
    except ValueError:
        return None
    finally:
        answer.close()
