"""The dashboard: static files under ``/ui/`` and the one event stream the page listens to.

The page (``capyctl/api/ui/``: plain HTML, CSS and JavaScript, no build step, nothing from a
CDN) is served without a credential, because a browser's navigation cannot carry a bearer
header and the files hold no data. Everything it shows comes from the API with the admin token
(or the operator key, or the session secret of ``capyctl ui``) as ``Authorization: Bearer``,
which a cross-site page cannot attach: there is no cookie, so no ambient authority to forge.

``GET /v1/events`` is a Server-Sent Events stream: ``deployments`` whenever a deployment's state
changes (the controller's listeners, coalesced over EVENT_COALESCE_S) and every
TICK_S seconds if something else in it changed (requests in flight); ``usage`` (GET /v1/usage)
and ``requests`` (request rate and mean latency per deployment, from the proxy's Prometheus
counters) every TICK_S. One stream per page replaces every poll.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from importlib import resources
from typing import Any, Callable

from aiohttp import web

from ..errors import NotFound

log = logging.getLogger("capyctl.api")

# Seconds between usage and request-rate events (the usage view reuses measurements for 2 s).
TICK_S = 5.0
# State changes arriving within this many seconds of each other are sent as one event.
EVENT_COALESCE_S = 0.1
UI_FILES = {"index.html": "text/html", "dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# The page loads only its own files and talks only to its own origin; no frame may embed it
# (its buttons act), and no URL of it leaks in a Referer.
UI_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def is_public(path: str) -> bool:
    """Routes answered without a credential: the dashboard's static files and the API description."""
    return path == "/ui" or path.startswith("/ui/") or path == "/openapi.json"


async def ui_redirect(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


async def ui_file(request: web.Request) -> web.Response:
    name = request.match_info.get("file") or "index.html"
    if name not in UI_FILES:
        raise NotFound(f"the dashboard has no file {name!r}", code="ui_file_not_found")
    body = (resources.files(__package__) / "ui" / name).read_bytes()
    return web.Response(body=body, content_type=UI_FILES[name], charset="utf-8", headers=UI_HEADERS)


# -- request rate and latency, from the proxy's Prometheus text ---------------------------------------------

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_COUNTERS = {"capyctl_requests_total": 0, "capyctl_request_duration_seconds_sum": 1,
             "capyctl_request_duration_seconds_count": 2}


def request_totals(exposition: str | bytes) -> dict[str, list[float]]:
    """Per deployment: [requests answered, seconds spent answering, requests timed], summed over
    routes and statuses, from the text format (whichever library wrote it)."""
    if isinstance(exposition, bytes):
        exposition = exposition.decode("utf-8", "replace")
    totals: dict[str, list[float]] = {}
    for line in exposition.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] not in _COUNTERS:
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        deployment = labels.get("deployment")
        if not deployment:
            continue  # requests no deployment was chosen for (unknown model, bad key)
        try:
            value = float(match["value"])
        except ValueError:
            continue
        totals.setdefault(deployment, [0.0, 0.0, 0.0])[_COUNTERS[match["name"]]] += value
    return totals


class RequestRates:
    """Rate and mean latency per deployment between two readings of the proxy's counters."""

    def __init__(self, exposition: Callable[[], str | bytes] | None) -> None:
        self._exposition = exposition
        self._previous: tuple[float, dict[str, list[float]]] | None = None

    def sample(self) -> dict[str, Any]:
        if self._exposition is None:
            return {"available": False, "reason": "this management API was built without the proxy's metrics",
                    "deployments": {}}
        now, totals = time.monotonic(), request_totals(self._exposition())
        previous, self._previous = self._previous, (now, totals)
        rows = {}
        for name, (requests, seconds, timed) in totals.items():
            row: dict[str, Any] = {"requests": requests, "rate_per_s": None, "mean_latency_s": None}
            if previous is not None:
                before = previous[1].get(name, [0.0, 0.0, 0.0])
                elapsed = now - previous[0]
                if elapsed > 0:
                    row["rate_per_s"] = max(0.0, requests - before[0]) / elapsed
                if timed > before[2]:
                    row["mean_latency_s"] = (seconds - before[1]) / (timed - before[2])
            rows[name] = row
        return {"available": True, "window_s": None if previous is None else now - previous[0], "deployments": rows}


# -- the event stream ------------------------------------------------------------------------------------

def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def event_stream(request: web.Request, *, controller: Any, usage: Any,
                       exposition: Callable[[], str | bytes] | None) -> web.StreamResponse:
    changed = asyncio.Event()
    unsubscribe = controller.subscribe(lambda actor: changed.set())
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no"})
    try:
        await response.prepare(request)
        # A browser's EventSource reconnects after this; the page's fetch reader does the same.
        await response.write(b"retry: 3000\n\n")
        rates = RequestRates(exposition)
        sent: list | None = None
        next_tick = 0.0
        while True:
            changed.clear()
            deployments = [a.describe() for a in sorted(controller.actors.values(), key=lambda a: a.name)]
            if deployments != sent:
                await response.write(_sse("deployments", deployments))
                sent = deployments
            if time.monotonic() >= next_tick:
                try:
                    await response.write(_sse("usage", await usage.view()))
                except (ConnectionError, asyncio.CancelledError):
                    raise
                except Exception as exc:  # a failed measurement must not end the stream
                    log.warning("dashboard: the usage view failed: %r", exc)
                    await response.write(_sse("usage_error", {"message": f"the usage view failed: {exc}"}))
                try:
                    sample = rates.sample()
                except Exception as exc:  # nor may unreadable metrics
                    log.warning("dashboard: the proxy's metrics could not be read: %r", exc)
                    sample = {"available": False, "reason": f"the proxy's metrics could not be read: {exc}",
                              "deployments": {}}
                await response.write(_sse("requests", sample))
                next_tick = time.monotonic() + TICK_S
            try:
                await asyncio.wait_for(changed.wait(), timeout=max(0.0, next_tick - time.monotonic()))
                await asyncio.sleep(EVENT_COALESCE_S)
            except asyncio.TimeoutError:
                pass
    except ConnectionError:
        pass  # the page went away
    finally:
        unsubscribe()
    return response
