"""Request bodies held in memory, bounded across the whole daemon.

Each route caps one body (the proxy's max_body and max_upload, the management API's
client_max_size), but not how many are held at once: many clients each sending a large body
could together take the daemon past its memory (issue 32 left this open, issue 45 closes it). One
:class:`BodyBudget` is shared by the proxy's JSON bodies and multipart forms and the management
API's bodies. A request takes its share through its :class:`BodyLease`: by Content-Length before
reading when the length is known, by growth as the bytes come otherwise (and past a Content-Length,
which a compressed body can outgrow). A request that cannot get its share is refused at once, 503
``request_bodies_busy`` with Retry-After, and never waits: a body half read waiting for another
body's bytes to be released could wait on one that waits for it, and neither would move.

The share is held while the request's handler runs (its bytes are referenced until then) and
given back on every way out, cancellation included, by :func:`lease_middleware`.
"""

from __future__ import annotations

from typing import Callable

from aiohttp import StreamReader, web

from .config import BODIES_MEMORY_MAX_DEFAULT as DEFAULT_MEMORY_MAX
from .errors import CapyError

BUSY_CODE = "request_bodies_busy"
# What a refused client is told to wait: bodies in flight are released as their requests end.
BUSY_RETRY_AFTER_S = 1.0

# web.RequestKey exists from aiohttp 3.12; a plain string works (with a warning) before it.
_RequestKey = getattr(web, "RequestKey", None)
LEASE: object = _RequestKey("capyctl_body_lease", object) if _RequestKey else "capyctl_body_lease"


class BodyBudget:
    """Bytes of request bodies that may be held in memory at once, daemon-wide."""

    __slots__ = ("limit", "used", "refused")

    def __init__(self, limit: int = DEFAULT_MEMORY_MAX) -> None:
        self.limit = limit  # may be changed live (a reload): what is held stays held
        self.used = 0
        self.refused = 0  # requests refused for want of room, since start

    def lease(self) -> BodyLease:
        return BodyLease(self)

    def busy(self) -> CapyError:
        self.refused += 1
        return CapyError(f"The daemon already holds as many request bodies in memory as it may "
                         f"({self.limit} bytes, the setting bodies.memory_max); this request was refused at once "
                         "rather than made to wait. Retry shortly.", code=BUSY_CODE, status=503,
                         retry_after=BUSY_RETRY_AFTER_S)


class BodyLease:
    """One request's share of a :class:`BodyBudget`; :meth:`close` gives all of it back."""

    __slots__ = ("_budget", "held")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.held = 0

    def take(self, size: int) -> None:
        """``size`` more bytes, at once or CapyError ``request_bodies_busy``."""
        budget = self._budget
        if budget.used + size > budget.limit:
            raise budget.busy()
        budget.used += size
        self.held += size

    def hold(self, total: int) -> None:
        """Hold ``total`` bytes in all: take what is missing (growth); nothing when enough is held."""
        if total > self.held:
            self.take(total - self.held)

    def give_back(self, size: int) -> None:
        """Bytes no longer in memory (an upload spooled to disk)."""
        size = min(size, self.held)
        self.held -= size
        self._budget.used -= size

    def close(self) -> None:
        self.give_back(self.held)

    def __enter__(self) -> BodyLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lease_middleware(budget: BodyBudget):
    """An aiohttp middleware that gives each request a lease (:func:`lease_of`) and closes it
    when the handler is done, however it ends."""

    @web.middleware
    async def bodies(request: web.Request, handler):
        lease = BodyLease(budget)
        request[LEASE] = lease  # type: ignore[index]
        try:
            return await handler(request)
        finally:
            lease.close()

    return bodies


def lease_of(request: web.Request) -> BodyLease:
    """The request's lease (its app has :func:`lease_middleware`)."""
    return request[LEASE]  # type: ignore[index]


async def read_within(content: StreamReader, lease: BodyLease, *, length: int | None, max_size: int,
                      too_large: Callable[[], Exception]) -> bytes:
    """A body read whole, its bytes held in ``lease``: Content-Length (``length``) taken before the
    first byte is read, anything beyond it as it comes; ``too_large()`` is raised past ``max_size``.
    Errors of the payload itself (a torn chunk, a broken Content-Encoding) are the stream's
    (aiohttp's RequestPayloadError for a server request), as from ``request.read()``."""
    if length is not None:
        if length > max_size:
            raise too_large()
        lease.hold(length)
    body = bytearray()
    while chunk := await content.readany():
        size = len(body) + len(chunk)
        if size > max_size:
            raise too_large()
        lease.hold(size)
        body += chunk
    return bytes(body)
