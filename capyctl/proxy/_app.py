"""The OpenAI-compatible proxy as an aiohttp application: its routes, app keys, engine clients
(cleanup_ctx) and the middleware that shapes errors and counts requests.

Only the routes registered here are reachable. Engine control routes (/sleep,
/wake_up, /collective_rpc, /release_memory_occupation, /props, /slots, ...) are never
forwarded: the proxy builds upstream URLs from its own route table, not from the
client's path, and drops the query string.

A request goes through intake and admission (``_intake``), then the answer relay (``_relay``);
``/v1/systemone`` is answered by ``_systemone``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from typing import Any, AsyncIterator, Callable

import aiohttp
from aiohttp import web

from .. import descriptors
from ..bodies import BodyBudget, lease_middleware
from ..errors import CapyError
from ._engine_pool import make_engine_pool
from ._errors import JSON_CONTENT_TYPE, anthropic_error_response, error_response
from ._exchange import CLIENT_CLOSED, RESPONSE_ID, Exchange, MiB, ProxyState
from ._intake import (
    DEFAULT_MAX_UPLOAD,
    admitted,
    admitted_now,
    authorize,
    model_entry,
    parse_body,
    payload_for,
    read_body,
    received_form,
    too_large,
)
from ._keys import KeyGrant, KeyVerifier
from ._prompt_prefix import routing_prompt
from ._relay import EngineMoved, WaitProgress, forward
from ._routes import (
    FORM_ROUTES,
    JSON_ROUTES,
    STORED_RESPONSE_CAPABILITIES,
    STORED_RESPONSE_ROUTE,
    STREAMING_ROUTES,
    SYSTEMONE_ROUTE,
    is_anthropic,
    routes_served,
)
from ._upstream import CONNECT_TIMEOUT
from .connector import EngineConnector
from .router import ModelEntry, Router

log = logging.getLogger("capyctl.proxy")

STATE = web.AppKey("capyctl_proxy_state", ProxyState)
# Exchanges with engines: multipart forms through aiohttp's client (SESSION), everything else
# through the proxy's own (POOL; None where httptools is not installed, and then aiohttp's too).
SESSION = web.AppKey("capyctl_proxy_session", aiohttp.ClientSession)
POOL: web.AppKey[Any] = web.AppKey("capyctl_proxy_engine_pool")
# Per request: the request's Exchange, read by the metrics middleware.
# web.RequestKey exists from aiohttp 3.12; plain strings work (with a warning) before it.
_RequestKey = getattr(web, "RequestKey", None)
_EXCHANGE: Any = _RequestKey("capyctl_exchange", object) if _RequestKey else "capyctl_exchange"


def build_app(router: Router, keys: KeyVerifier | None, *, max_body: int = 8 * MiB,
              request_timeout: float | None = None, max_upload: int = DEFAULT_MAX_UPLOAD,
              wait_progress: Callable[[], bool] = lambda: True,
              bodies: BodyBudget | None = None) -> web.Application:
    """The proxy application.

    ``keys`` None turns authentication off (standalone development only: anyone who
    reaches the port may use every model). ``max_body`` caps a JSON request body and
    ``max_upload`` a multipart one (an audio file), both answered 413 beyond.
    ``request_timeout`` bounds one upstream exchange, from connecting to the engine to
    the last byte of its answer, not the wait for admission (the Router bounds that);
    None means no bound. ``wait_progress`` answers, per request, whether a streamed request
    that waits for admission gets SSE comments meanwhile (``_relay.WaitProgress``). ``bodies`` is
    the daemon-wide budget of request bodies held in memory (capyctl/bodies.py), shared with the
    management API; a budget of its own when None.

    Serve it with :func:`serve` so that a client that disconnects cancels its handler.
    """
    app = web.Application(client_max_size=max_body, middlewares=[_observe, lease_middleware(bodies or BodyBudget())])
    app[STATE] = ProxyState(router=router, keys=keys, max_body=max_body, request_timeout=request_timeout,
                            max_upload=max_upload, wait_progress=wait_progress,
                            router_reports_progress=_takes_progress(router))
    app.cleanup_ctx.append(_engine_clients)
    for path in GET_ROUTES:
        app.router.add_get(path, _get_route)
    for path in JSON_ROUTES:  # forwarded only to engines whose adapter declares the route's capability
        app.router.add_post(path, _json_route)
    for path in FORM_ROUTES:
        app.router.add_post(path, _form_route)
    app.router.add_post(SYSTEMONE_ROUTE, _systemone_route)
    stored = STORED_RESPONSE_ROUTE.replace("{id}", "{response_id}")
    app.router.add_get(stored, _stored_response_route)
    app.router.add_delete(stored, _stored_response_route)
    return app


def _takes_progress(router: Router) -> bool:
    """Whether ``router.acquire`` takes ``progress`` (Router): a router without it (a test's fake)
    is called as before, and its waits get no comments."""
    acquire = getattr(router, "acquire", None)
    try:
        return acquire is not None and "progress" in inspect.signature(acquire).parameters
    except (TypeError, ValueError):  # (a callable without a signature Python can read)
        return False


async def _engine_clients(app: web.Application) -> AsyncIterator[None]:
    # limit=0: no pool limit, so 200 concurrent streams never queue inside aiohttp
    # (admission is the Router's job, not the connection pool's).
    connector = EngineConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT)
    # No cookie jar (engines set none that matter; filtering cookies costs on every request) and no
    # decompression (Accept-Encoding: identity is asked; bytes are passed on as they come).
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar(),
                                     auto_decompress=False) as session:
        app[SESSION] = session
        app[POOL] = pool = make_engine_pool(connect_timeout=CONNECT_TIMEOUT)
        try:
            yield
        finally:
            if pool is not None:
                pool.close()


def _exchange(request: web.Request) -> Exchange:
    """The Exchange of a request; its handler returns ``exchange.answer()``."""
    app = request.app
    exchange = Exchange(app[STATE], app[POOL], app[SESSION], request)
    request[_EXCHANGE] = exchange
    return exchange


# ---------------------------------------------------------------- middleware

def _from_http_exception(exc: web.HTTPException) -> CapyError:
    if exc.status == 404:
        return CapyError("There is no such route.", code="unknown_route", status=404)
    if exc.status == 405:
        return CapyError("This route does not take that method.", code="method_not_allowed", status=405)
    if exc.status == 413:
        return too_large()
    return CapyError(exc.reason or "HTTP error.", code=f"http_{exc.status}", status=exc.status)


@web.middleware
async def _observe(request: web.Request, handler) -> web.StreamResponse:
    """Errors to the OpenAI shape, and one metrics sample per request."""
    started = time.monotonic()
    status = 500
    try:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            raise _from_http_exception(exc) from None
        status = response.status
        return response
    except CapyError as err:
        status = err.status
        if is_anthropic(request.path):  # Anthropic's clients read their own error shape
            return anthropic_error_response(err)
        return error_response(err, param=err.detail.get("param"))
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    except Exception as exc:
        if descriptors.is_shortage(exc):  # (an upload's spool file): the daemon's own 503
            failure = descriptors.shortage_error(f"handle {request.method} {request.path}")
            status = failure.status
        else:
            log.exception("proxy: unexpected error on %s %s", request.method, request.path)
            failure = CapyError("The proxy failed to handle this request.", status=500)
        return anthropic_error_response(failure) if is_anthropic(request.path) else error_response(failure)
    finally:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        # (Taken out of the request: the request and its Exchange point at each other, and reference
        # counting frees them as the answer ends only once that cycle is broken, not the cycle
        # collector some generations later, which let a busy daemon's memory creep up.)
        exchange: Exchange | None = request.pop(_EXCHANGE, None)
        outcome = exchange.outcome if exchange is not None else None
        request.app[STATE].metrics.record(deployment=exchange.deployment if exchange is not None else "",
                                          route=route, status=status if outcome is None else outcome,
                                          seconds=time.monotonic() - started)


# ---------------------------------------------------------------- GET routes

async def _answer_health(exchange: Exchange) -> None:
    exchange.whole(200, {"Content-Type": JSON_CONTENT_TYPE}, b'{"status": "ok"}')


async def _answer_openapi(exchange: Exchange) -> None:
    from ._openapi import proxy_openapi
    exchange.whole(200, {"Content-Type": JSON_CONTENT_TYPE}, json.dumps(proxy_openapi()).encode())


async def _answer_metrics(exchange: Exchange) -> None:
    grant = authorize(exchange)
    if grant is not None and grant.models is not None:
        # Metrics name every deployment; a key limited to some models must not see the others.
        raise CapyError("This API key may not read metrics.", code="permission_denied", status=403)
    state = exchange.state
    router = state.router
    # Optional parts of the Router (a test's fake may have neither).
    wake_durations = getattr(router, "wake_durations", None)
    # (Not "memory": the Controller's memory planner is an attribute of that name, and the method
    # would have been shadowed by it: /metrics answered 500 in the daemon.)
    memory_gauges = getattr(router, "memory_gauges", None)
    phase_durations = getattr(router, "phase_durations", None)
    body = state.metrics.render(router.stats(), wake_durations() if wake_durations else None,
                                await memory_gauges() if memory_gauges else None,
                                phase_durations() if phase_durations else None)
    exchange.whole(200, {"Content-Type": "text/plain; charset=utf-8", "X-Prometheus-Format": "0.0.4"}, body)


def metrics_text(app: web.Application) -> str:
    """What GET /metrics answers, for a reader in the same process (the dashboard's request rates)."""
    state = app[STATE]
    return state.metrics.render(state.router.stats())


async def _answer_models(exchange: Exchange) -> None:
    grant = authorize(exchange)
    data = [
        {"id": entry.id, "object": "model", "created": entry.created, "owned_by": "capyctl",
         "capyctl": {"deployment": entry.deployment, "state": entry.state, "engine": entry.engine,
                     # the routes its engine serves, once known from a launch (else absent)
                     **({"routes": routes_served(entry.capabilities)} if entry.capabilities else {})}}
        for entry in exchange.state.router.models()
        if grant is None or grant.allows(entry.id)
    ]
    exchange.whole(200, {"Content-Type": JSON_CONTENT_TYPE}, json.dumps({"object": "list", "data": data}).encode())


# /openapi.json describes routes only: no key, like /health.
GET_ROUTES = {"/health": _answer_health, "/metrics": _answer_metrics, "/openapi.json": _answer_openapi,
              "/v1/models": _answer_models}


async def _get_route(request: web.Request) -> web.StreamResponse:
    exchange = _exchange(request)
    await GET_ROUTES[request.path](exchange)
    return exchange.answer()


# ---------------------------------------------------------------- JSON routes

async def _json_route(request: web.Request) -> web.StreamResponse:
    """A JSON POST route of the table: the body's ``model`` selects the deployment. A request
    whose engine was lost with its host before answering is sent once more, to the deployment's
    new placement (Router.engine_lost)."""
    exchange = _exchange(request)
    grant = authorize(exchange)  # before the body is read: no key, no reading
    raw = await read_body(request, exchange.state.max_body)
    body, model = parse_body(raw)
    entry = model_entry(exchange, grant, model)
    if exchange.path == "/v1/responses":
        exchange.responses_model = model  # its id is remembered from the answer (_relay)
    try:
        await _answer_json(exchange, raw, body, model, entry, resend=True)
    except EngineMoved as moved:
        log.warning("proxy: %s", moved)
        await _answer_json(exchange, raw, body, model, entry, resend=False)
    return exchange.answer()


async def _answer_json(exchange: Exchange, raw: bytes, body: dict[str, Any], model: str,
                       entry: ModelEntry | None, *, resend: bool) -> None:
    path = exchange.path
    needed = JSON_ROUTES[path]
    # A model with replicas is routed by the prompt's prefix too (controller/_replicas.py), and a
    # Responses request that continues a stored response goes to the engine that keeps it.
    prompt = replica = None
    if entry is not None and entry.replicas > 1:
        prompt = routing_prompt(path, body)
        if path == "/v1/responses":
            replica = exchange.state.responses.engine(body.get("previous_response_id"))
    lease = admitted_now(exchange, model, needed, path, entry, prompt, replica)
    if lease is not None:  # ready and nothing queued: the common case
        upstream, release = lease
        try:
            await forward(exchange, upstream, path, payload_for(upstream, raw, body, model), resend=resend)
        finally:
            release()
        return
    progress = _wait_progress(exchange, body)
    if progress is None:
        async with admitted(exchange, model, needed, path, entry, prompt=prompt, replica=replica) as upstream:
            await forward(exchange, upstream, path, payload_for(upstream, raw, body, model), resend=resend)
        return
    try:
        async with admitted(exchange, model, needed, path, entry, progress, prompt, replica) as upstream:
            committed = await progress.stop()
            # (Once committed, not sent again: the comments committed this answer, and a resend's
            # wait would need comments of its own.)
            await forward(exchange, upstream, path, payload_for(upstream, raw, body, model),
                          resend=resend and not committed, committed=committed)
    except CapyError as err:
        if not await progress.stop():
            raise
        # The comments sent the answer's status: the error can only be the stream's last event.
        await progress.fail(err)
    finally:
        progress.close()


def _wait_progress(exchange: Exchange, body: dict[str, Any]) -> WaitProgress | None:
    """Comments for this request while it waits, when it asked for a stream and they are on."""
    state = exchange.state
    if (body.get("stream") is not True or exchange.path not in STREAMING_ROUTES
            or not state.router_reports_progress or not state.wait_progress()):
        return None
    return WaitProgress(exchange)


# ---------------------------------------------------------------- other routes

async def _form_route(request: web.Request) -> web.StreamResponse:
    """A multipart/form-data POST route (an audio file to transcribe): the ``model`` form field
    selects the deployment. The upload is received whole before the engine is woken (a slow
    client holds no engine slot), spooled to disk past UPLOAD_SPOOL_IN_MEMORY, capped at
    ``max_upload`` (413), then sent on as a new form with the same fields."""
    exchange = _exchange(request)
    grant = authorize(exchange)
    async with received_form(request, exchange.state.max_upload) as form:
        entry = model_entry(exchange, grant, form.model)
        async with admitted(exchange, form.model, FORM_ROUTES[request.path], request.path, entry) as upstream:
            await forward(exchange, upstream, request.path, form.writer(upstream.served_model))
            return exchange.answer()


async def _stored_response_route(request: web.Request) -> web.StreamResponse:
    """GET/DELETE /v1/responses/{id}: sent to the deployment whose engine created the response."""
    exchange = _exchange(request)
    grant = authorize(exchange)
    response_id = request.match_info["response_id"]
    responses = exchange.state.responses
    model = responses.owner(response_id) if RESPONSE_ID.match(response_id) else None
    if model is None or (grant is not None and not grant.allows(model)):
        # One answer for "unknown" and "not yours", as for models.
        raise CapyError(f"No response '{response_id[:200]}' was created through this proxy, or you may "
                        "not read it.", code="response_not_found", status=404)
    path = f"/v1/responses/{response_id}"
    entry = model_entry(exchange, grant, model)
    replica = responses.engine(response_id) if entry is not None and entry.replicas > 1 else None
    async with admitted(exchange, model, STORED_RESPONSE_CAPABILITIES[request.method],
                        f"{request.method} {STORED_RESPONSE_ROUTE}", entry,
                        replica=replica) as upstream:  # wakes a parked owner
        status = await forward(exchange, upstream, path, b"", method=request.method)
    if request.method == "DELETE" and status < 300:
        responses.forget(response_id)
    return exchange.answer()


async def _systemone_route(request: web.Request) -> web.StreamResponse:
    # Imported on the first such request: its pydantic models add to the daemon's idle RSS, and
    # most daemons never need them (docs/benchmarks.md, "Figures behind design choices").
    from . import _systemone
    exchange = _exchange(request)
    grant: KeyGrant | None = authorize(exchange)
    return await _systemone.answer(exchange, grant, await read_body(request, exchange.state.max_body))
