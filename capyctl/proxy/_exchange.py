"""What every part of the proxy shares: its state, and one client request as it goes through.

:class:`ProxyState` is the proxy's (one per app); :class:`Exchange` is one request's, made by the
route handler (``_app``) from aiohttp's request, filled in by admission (``_intake``: the
deployment) and by the relay (``_relay``: its answer, and a status that overrides the answer's).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
from aiohttp import web

from ._engine_limits import EngineConnectionLimits
from ._keys import KeyVerifier
from ._metrics import ProxyMetrics
from .router import Router

MiB = 1 << 20
CLIENT_CLOSED = 499  # nginx's status for "client closed the request", used in metrics only
# Response ids remembered for GET/DELETE /v1/responses/{id}: the oldest are forgotten past this.
RESPONSE_OWNERS_MAX = 100_000
# What a response id may look like before it is looked up (engines answer "resp_" + hex or similar).
RESPONSE_ID = re.compile(r"^[A-Za-z0-9_\-.:]{1,200}$")


class ResponseOwners:
    """Which model name (deployment or alias) created each OpenAI Responses id seen through the proxy,
and which of its engines (its replica's name, Upstream.deployment): the engine keeps the response,
so reading it or continuing it (previous_response_id) must reach that engine.

    Bounded: a proxy serving for months must not grow without end; a forgotten id answers 404
    like an unknown one. Kept in memory only: after a restart earlier ids are unknown.
    """

    def __init__(self, limit: int = RESPONSE_OWNERS_MAX) -> None:
        self._owners: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._limit = limit

    def remember(self, response_id: object, model: str, engine: str | None = None) -> None:
        if not isinstance(response_id, str) or not RESPONSE_ID.match(response_id):
            return
        self._owners[response_id] = (model, engine)
        self._owners.move_to_end(response_id)
        while len(self._owners) > self._limit:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> str | None:
        known = self._owners.get(response_id)
        return known[0] if known is not None else None

    def engine(self, response_id: object) -> str | None:
        """The replica whose engine created ``response_id`` (None: unknown)."""
        known = self._owners.get(response_id) if isinstance(response_id, str) else None
        return known[1] if known is not None else None

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)


@dataclass
class ProxyState:
    router: Router
    keys: KeyVerifier | None
    max_body: int
    request_timeout: float | None
    max_upload: int
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)
    responses: ResponseOwners = field(default_factory=ResponseOwners)
    # Whether a streamed request that waits gets SSE comments (DaemonConfig.wait_progress), asked
    # per request so that a reload applies it; and whether the Router's acquire takes them at all.
    wait_progress: Callable[[], bool] = field(default=lambda: True)
    router_reports_progress: bool = False
    engine_limits: EngineConnectionLimits = field(default_factory=EngineConnectionLimits)


@dataclass(slots=True, eq=False)
class Exchange:
    """One client request as the forwarding code needs it: the proxy's state and engine clients,
    aiohttp's request, and what is learned on the way (the deployment for metrics, a status that
    overrides the answer's when a stream broke after its 200 or the client went away, the model a
    /v1/responses asked for so the id in its answer can be remembered, and the answer itself,
    which the route handler returns to aiohttp's server)."""

    state: ProxyState
    pool: Any  # _engine_pool.EnginePool, or None where httptools is missing
    session: aiohttp.ClientSession | None
    request: web.Request
    deployment: str = ""
    outcome: int | None = None
    responses_model: str | None = None
    response: web.StreamResponse | None = None

    @property
    def path(self) -> str:
        return self.request.path

    # The answer, into aiohttp's response objects: a whole one is returned by the handler, a stream
    # is prepared and written at once. A client gone shows as a ConnectionError from the writes.

    def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        """The whole answer at once (aiohttp adds its Content-Length)."""
        self.response = web.Response(status=status, body=body, headers=headers)

    async def start_stream(self, status: int, headers: dict[str, str]) -> None:
        """The status and head of an answer whose body follows in pieces."""
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self.request)

    async def write(self, data: bytes) -> None:
        """One piece of a streamed body."""
        assert self.response is not None
        await self.response.write(data)

    async def end(self, last: bytes) -> None:
        """The last piece (maybe empty) and the end of a streamed body."""
        assert self.response is not None
        if last:
            await self.response.write(last)
        await self.response.write_eof()

    def answer(self) -> web.StreamResponse:
        """What the route handler returns: the response the relay made."""
        assert self.response is not None, "the request was not answered"
        return self.response
