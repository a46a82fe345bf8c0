"""How many connections the proxy holds open to one engine at once (``Upstream.connections_max``).

An engine whose server gives each connection a thread of a fixed pool (llama-server: its
adapter says why) can leave a new connection unread for seconds when more are open than it has
threads, kept-alive idle ones included. Both engine clients open a connection only when none of
theirs to that engine is idle, so holding at most ``connections_max`` exchanges at once bounds the
connections too. Requests past the bound wait here, in arrival order, for an exchange to end; the
engine would have queued them behind its busy slots anyway.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from .router import Upstream

# Bounds kept at once, one per engine launch (a base URL): the unused ones are forgotten past this.
KEPT_MAX = 4096


@dataclass
class _Bound:
    limit: int
    semaphore: asyncio.Semaphore
    users: int = 0  # exchanges inside or waiting


def _nothing() -> None:
    pass


class EngineConnectionLimits:
    """One semaphore per engine launch with a bound; engines without one pass at once."""

    def __init__(self) -> None:
        self._bounds: dict[str, _Bound] = {}

    async def acquire(self, upstream: Upstream) -> Callable[[], None]:
        """Wait for one of ``upstream``'s connections; the call that gives it back (once, however
        often it is called). Cancelled while waiting, it holds nothing."""
        limit = upstream.connections_max
        if limit is None:
            return _nothing
        bound = self._bound(upstream.base_url, limit)
        bound.users += 1
        try:
            await bound.semaphore.acquire()
        except BaseException:
            bound.users -= 1
            raise
        given_back = False

        def release() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                bound.users -= 1
                bound.semaphore.release()
        return release

    def _bound(self, base_url: str, limit: int) -> _Bound:
        bound = self._bounds.get(base_url)
        if bound is not None and bound.limit == limit:
            return bound
        if len(self._bounds) >= KEPT_MAX:
            # Mostly launches that are gone (a base URL is per launch): forget those nobody uses.
            self._bounds = {url: kept for url, kept in self._bounds.items() if kept.users}
        bound = self._bounds[base_url] = _Bound(limit, asyncio.Semaphore(limit))
        return bound
