"""Intake and admission: a client request's key, body and form read and checked, then admitted
to a deployment through the Router.

Everything here raises CapyError for the client (the middleware in ``_app`` shapes it) and reads
only what the request says; nothing is sent to an engine.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass, field
from typing import IO, Any, AsyncIterator, Callable

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from ..bodies import lease_of, read_within
from ..errors import CapyError
from ._door import key_accepted
from ._exchange import MiB, Exchange
from ._keys import KeyGrant
from ._routes import routes_served
from .router import ModelEntry, Upstream

# Default cap on a multipart upload (an audio file to transcribe): OpenAI's own limit for audio.
DEFAULT_MAX_UPLOAD = 25 * MiB
# A text field of a multipart form (model, language, prompt...) larger than this is refused.
FORM_FIELD_MAX = 64 * 1024
# An uploaded file is kept in memory up to this size while it is received, on disk beyond.
UPLOAD_SPOOL_IN_MEMORY = 1 * MiB


# ---------------------------------------------------------------- errors a client gets here

def model_not_found(model: str) -> CapyError:
    # One sentence for "no such model" and "not your model", so a scoped key learns nothing.
    return CapyError(f"The model '{model}' does not exist or you do not have access to it.",
                     code="model_not_found", status=404)


def too_large() -> CapyError:
    return CapyError("The request body is larger than this proxy accepts.", code="request_too_large",
                     status=413)


def route_not_served(target: Upstream | ModelEntry, model: str, route: str) -> CapyError:
    served = routes_served(target.capabilities)
    return CapyError(f"The engine of '{model}' ({target.engine}) does not serve {route}; it serves "
                     f"{', '.join(served) or 'no route CapyCTL forwards'}.", code="route_not_served", status=404,
                     detail={"routes": served})


# ---------------------------------------------------------------- the key

def authorize(exchange: Exchange) -> KeyGrant | None:
    """The key's grant; None when authentication is off."""
    keys = exchange.state.keys
    if keys is None:
        return None
    headers = exchange.request.headers  # (aiohttp's: names in any case)
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
    key_accepted()  # its connection may now use the share of the door kept for keyed clients
    return grant


# ---------------------------------------------------------------- a JSON body

async def read_body(request: web.Request, max_body: int) -> bytes:
    """The body's bytes, within ``max_body`` (413 beyond) and the daemon's budget of bodies held
    (503 request_bodies_busy: capyctl/bodies.py)."""
    try:
        raw = await read_within(request.content, lease_of(request), length=request.content_length,
                                max_size=max_body, too_large=too_large)
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


def loads(raw: bytes) -> Any:
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


def parse_body(raw: bytes) -> tuple[dict[str, Any], str]:
    """The parsed JSON object and its model name."""
    body = loads(raw)
    if not isinstance(body, dict):
        raise CapyError("The request body must be a JSON object.", code="invalid_json", status=400)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise CapyError("The request body has no 'model'.", code="missing_model", status=400)
    return body, model


def payload_for(upstream: Upstream, raw: bytes, body: dict[str, Any], model: str) -> bytes:
    """The client's bytes untouched, unless the engine knows the model by another name."""
    if upstream.served_model is None or upstream.served_model == model:
        return raw
    return json.dumps({**body, "model": upstream.served_model}).encode()


# ---------------------------------------------------------------- a multipart form

@dataclass
class FormPart:
    """One part of a received multipart form: a text field, or an uploaded file."""

    name: str
    text: str | None = None
    filename: str | None = None
    content_type: str | None = None
    data: bytearray = field(default_factory=bytearray)  # a file's bytes while it is small
    spool: IO[bytes] | None = None  # ... and on disk once it is not


@dataclass
class ReceivedForm:
    parts: list[FormPart] = field(default_factory=list)
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
async def received_form(request: web.Request, cap: int) -> AsyncIterator[ReceivedForm]:
    """Read a multipart/form-data body part by part, never whole in memory: text fields up to
    FORM_FIELD_MAX, files in memory up to UPLOAD_SPOOL_IN_MEMORY and in a temporary file beyond,
    everything together up to ``cap`` (413). Temporary files go on leaving."""
    if request.content_length is not None and request.content_length > cap:
        raise too_large()
    if request.content_type != "multipart/form-data":
        raise CapyError("This route takes multipart/form-data (a file and form fields), as OpenAI's does.",
                        code="invalid_form", status=400)
    form = ReceivedForm()
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
                item = FormPart(name=part.name, filename=part.filename,
                                content_type=part.headers.get(aiohttp.hdrs.CONTENT_TYPE))
                form.parts.append(item)
                while chunk := await part.read_chunk():
                    received += len(chunk)
                    if received > cap:
                        raise too_large()
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


# ---------------------------------------------------------------- admission

def model_entry(exchange: Exchange, grant: KeyGrant | None, model: str) -> ModelEntry | None:
    """The Router's entry for ``model`` (None when it knows none by that name: its acquire says
    why), after the key's grant allowed it."""
    if grant is not None and not grant.allows(model):
        raise model_not_found(model)
    router = exchange.state.router
    lookup = getattr(router, "model_entry", None)  # optional (Router): one entry, not all of them
    if lookup is not None:
        entry = lookup(model)
    else:
        entry = next((e for e in router.models() if e.id == model), None)
    if entry is not None:
        exchange.deployment = entry.deployment
    return entry


def admitted_now(exchange: Exchange, model: str, needed: str, route: str,
                 entry: ModelEntry | None, prompt: str | None = None,
                 replica: str | None = None) -> tuple[Upstream, Callable[[], None]] | None:
    """What :func:`admitted` does when the Router can admit without waiting (Router.try_acquire):
    the Upstream and the call that releases it, once, when the answer is over; None when the
    request must wait (or be refused) in :func:`admitted`. ``prompt`` and ``replica``: the
    request's prompt text and the replica it must reach, for a model with replicas (Router.acquire)."""
    if entry is not None and entry.capabilities and needed not in entry.capabilities:
        raise route_not_served(entry, model, route)
    try_acquire = getattr(exchange.state.router, "try_acquire", None)  # optional (Router)
    if try_acquire is None:
        lease = None
    elif prompt is None and replica is None:
        lease = try_acquire(model)
    else:
        lease = try_acquire(model, prompt=prompt, replica=replica)
    if lease is None:
        return None
    upstream, release = lease
    exchange.deployment = upstream.deployment
    if needed not in upstream.capabilities:
        release()
        raise route_not_served(upstream, model, route)
    return lease


@contextlib.asynccontextmanager
async def admitted(exchange: Exchange, model: str, needed: str, route: str, entry: ModelEntry | None,
                   progress: Callable[[str], None] | None = None,
                   prompt: str | None = None, replica: str | None = None) -> AsyncIterator[Upstream]:
    """Admission for one request to ``model`` on a route that needs capability ``needed``.

    An engine known (from its adapter, before any launch) to lack the route is refused
    without waking it; the capabilities of the launch that answers are checked again.
    ``progress`` is told how the wait goes on (Router.acquire; ``_relay.WaitProgress``).
    """
    if entry is not None and entry.capabilities and needed not in entry.capabilities:
        raise route_not_served(entry, model, route)
    router = exchange.state.router
    given: dict[str, Any] = {}
    if progress is not None:
        given["progress"] = progress
    if prompt is not None:
        given["prompt"] = prompt
    if replica is not None:
        given["replica"] = replica
    try:
        async with router.acquire(model, **given) as upstream:
            exchange.deployment = upstream.deployment
            if needed not in upstream.capabilities:
                raise route_not_served(upstream, model, route)
            yield upstream
    except CapyError as err:
        if err.code == "model_not_found":
            raise model_not_found(model) from None
        raise
