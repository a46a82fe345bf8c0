"""The management API: JSON over HTTP on a unix socket (root:capyctl 0660).

Each request is authenticated to a role (``_auth.py``): a peer on the socket without a
credential, or the admin token, is ``admin``; the operator key (``capyctl mcp``) is
``operator``, which may read and operate deployments but not manage hosts, engines or keys.
Actions accept ``Idempotency-Key`` (``_idempotency.py``). Long operations answer NDJSON events,
one a line, so the CLI can show progress (deploy --wait, logs -f).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import ValidationError

from ..bodies import BodyBudget, lease_middleware, lease_of, read_within
from ..controller import Controller, UsageView
from ..errors import CapyError, InvalidRequest
from ..spec import DeploymentSpec, EngineSpec, ManifestError
from ..store import Store
from . import _dashboard
from ._auth import ADMIN, ROLE, Credentials, authenticate, authorize
from ._idempotency import HEADER as IDEMPOTENCY_KEY
from ._idempotency import IdempotentOperations

log = logging.getLogger("capyctl.api")

CONTROLLER = web.AppKey("controller", Controller)
STORE = web.AppKey("store", Store)
CREDENTIALS = web.AppKey("credentials", Credentials)
OPERATIONS = web.AppKey("operations", IdempotentOperations)
USAGE = web.AppKey("usage", UsageView)
# The proxy's Prometheus text, for the dashboard's request rates (the daemon wires it).
METRICS_TEXT = web.AppKey("metrics_text", Callable[[], str | bytes])


# The most a request body may be (a manifest, a registration): past it, 413.
BODY_MAX = 4 << 20
# Per request (aiohttp 3.12's web.RequestKey where it exists): its body once read (_raw).
_RequestKey = getattr(web, "RequestKey", None)
_RAW: Any = _RequestKey("capyctl_api_body", bytes) if _RequestKey else "capyctl_api_body"


def _error(exc: CapyError | ManifestError) -> web.Response:
    response = web.json_response({"error": exc.to_dict()}, status=exc.status)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:  # whole seconds, rounded up: never too early
        response.headers["Retry-After"] = str(max(0, math.ceil(retry_after)))
    return response


def _too_large() -> CapyError:
    return CapyError(f"the request body is larger than {BODY_MAX} bytes", code="request_too_large", status=413)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except (CapyError, ManifestError) as exc:
        return _error(exc)
    except web.HTTPRequestEntityTooLarge:
        return _error(_too_large())
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own refusals (no such route, wrong method) in the API's JSON error shape.
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(exc.status, "http_error")
        return _error(CapyError(f"{request.method} {request.path}: {exc.reason}", code=code, status=exc.status))
    except Exception as exc:  # keep the daemon up; the caller sees a stable code
        log.exception("management API: %s %s", request.method, request.path)
        return _error(CapyError(f"internal error: {exc!r}"))


@web.middleware
async def _authenticated(request: web.Request, handler):
    credentials = request.app.get(CREDENTIALS)
    if _dashboard.is_public(request.path):
        return await handler(request)  # static files and the description: no data, no action
    if credentials is None:
        request[ROLE] = ADMIN  # built without credentials (tests): the socket alone guards, as before roles
    else:
        store = request.app[STORE]
        request[ROLE] = authenticate(request, credentials, lambda secret: store.verify_key(secret) is not None)
    authorize(request, request[ROLE])
    return await handler(request)


async def _once(request: web.Request, operation, body: bytes = b"") -> tuple[asyncio.Task, bool]:
    """The operation's task, shared by every request with the same Idempotency-Key (and whether
    this request started it). A client that goes away does not cancel it."""
    fingerprint = IdempotentOperations.fingerprint(request.method, request.path, body)
    return request.app[OPERATIONS].start(request.headers.get(IDEMPOTENCY_KEY), fingerprint, operation)


async def _raw(request: web.Request) -> bytes:
    """The request's body, read once, within BODY_MAX and the daemon's budget of bodies held in
    memory (capyctl/bodies.py: 503 request_bodies_busy when it has no room)."""
    raw = request.get(_RAW)
    if raw is None:
        try:
            raw = await read_within(request.content, lease_of(request), length=request.content_length,
                                    max_size=BODY_MAX, too_large=_too_large)
        except RequestPayloadError as exc:
            raise InvalidRequest(f"the body could not be read: {exc}", code="invalid_body") from None
        request[_RAW] = raw
    return raw


async def _body(request: web.Request) -> dict:
    raw = await _raw(request)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object", code="invalid_json")
    return data


def _validate(model, data: Any, source: str):
    from ..spec.loader import Problem
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(source, [Problem(".".join(str(p) for p in e["loc"]), None, e["msg"])
                                     for e in exc.errors()]) from None


# -- deployments ---------------------------------------------------------------------------------

async def list_deployments(request: web.Request) -> web.Response:
    ctl = request.app[CONTROLLER]
    return web.json_response([a.describe() for a in sorted(ctl.actors.values(), key=lambda a: a.name)])


async def get_deployment(request: web.Request) -> web.Response:
    ctl = request.app[CONTROLLER]
    return web.json_response(await ctl.describe(request.match_info["name"]))


async def inspect_deployment(request: web.Request) -> web.Response:
    return web.json_response(await request.app[CONTROLLER].inspect(request.match_info["name"]))


async def create_deployment(request: web.Request) -> web.StreamResponse:
    ctl = request.app[CONTROLLER]
    raw = await _raw(request)
    body = await _body(request)
    spec = _validate(DeploymentSpec, body.get("spec"), "request body: spec")
    ctl.engine_for(spec)  # an unknown engine is a 400 before anything streams
    ctl.check_cores(spec)  # as is a manifest asking for more cores than its hosts have (a 422)
    activate = bool(body.get("activate"))
    wait = bool(body.get("wait"))
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    events: asyncio.Queue = asyncio.Queue()

    def progress(message: str) -> None:
        events.put_nowait({"event": "progress", "message": message})

    async def run() -> dict:
        actor = await ctl.deploy(spec, activate=False, progress=progress)
        if activate:
            # Every replica the deployment keeps (replicas.min), not only its first.
            waker = asyncio.ensure_future(ctl.wake(actor.name, progress=progress))
            waker.add_done_callback(lambda f: f.cancelled() or f.exception())
            if wait:
                await waker
        return actor.describe()

    task, started = await _once(request, run, raw)
    while started:
        getter = asyncio.create_task(events.get())
        done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            await resp.write((json.dumps(getter.result()) + "\n").encode())
            continue
        getter.cancel()
        while not events.empty():
            await resp.write((json.dumps(events.get_nowait()) + "\n").encode())
        break
    try:
        final = {"event": "done", "deployment": await asyncio.shield(task)}
    except CapyError as exc:
        final = {"event": "error", "error": exc.to_dict()}
    await resp.write((json.dumps(final) + "\n").encode())
    await resp.write_eof()
    return resp


def _action(verb: str):
    async def handler(request: web.Request) -> web.Response:
        ctl = request.app[CONTROLLER]
        name = request.match_info["name"]

        async def act() -> dict:
            return (await getattr(ctl, verb)(name)).describe()
        task, _ = await _once(request, act)
        return web.json_response(await asyncio.shield(task))
    return handler


async def delete_deployment(request: web.Request) -> web.Response:
    name = request.match_info["name"]

    async def act() -> dict:
        await request.app[CONTROLLER].delete(name)
        return {"name": name, "deleted": True}
    task, _ = await _once(request, act)
    return web.json_response(await asyncio.shield(task))


async def deployment_logs(request: web.Request) -> web.StreamResponse:
    from ..systemd import journal_follow
    ctl = request.app[CONTROLLER]
    actor = ctl.get(request.match_info["name"])
    try:
        lines = int(request.query.get("lines", "50"))
    except ValueError:
        raise InvalidRequest("lines must be a whole number", code="invalid_lines") from None
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    for line in await ctl.journal(actor.unit, lines, actor.host):
        await resp.write((json.dumps({"line": line}) + "\n").encode())
    if request.query.get("follow"):
        prefix = ctl.hosts.ssh_prefix(actor.host) if actor.host != "local" else ()
        async for line in journal_follow(actor.unit, command_prefix=prefix):
            await resp.write((json.dumps({"line": line}) + "\n").encode())
    await resp.write_eof()
    return resp


# -- engines ----------------------------------------------------------------------------------------

def _engine_json(e: EngineSpec) -> dict:
    return e.model_dump(mode="json")


async def list_engines(request: web.Request) -> web.Response:
    return web.json_response([_engine_json(e) for e in request.app[STORE].list_engines()])


async def add_engine(request: web.Request) -> web.Response:
    from ..engines import detect_engine
    body = await _body(request)
    if body.get("spec"):
        spec = _validate(EngineSpec, body["spec"], "request body: spec")
        if body.get("name"):
            spec = spec.model_copy(update={"name": body["name"]})
    elif body.get("path"):
        spec = await detect_engine(body["path"], body.get("name"))
    else:
        raise InvalidRequest("give a path to detect or an engine spec", code="missing_path")
    request.app[STORE].put_engine(spec)
    return web.json_response(_engine_json(spec), status=201)


async def get_engine(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    engine = request.app[STORE].get_engine(name)
    if engine is None:
        raise CapyError(f"no engine named {name!r}", code="engine_not_found", status=404)
    ctl = request.app[CONTROLLER]
    users = sorted(a.name for a in ctl.actors.values() if a.spec.engine == name)
    return web.json_response(_engine_json(engine) | {"deployments": users})


async def remove_engine(request: web.Request) -> web.Response:
    request.app[STORE].remove_engine(request.match_info["name"])
    return web.json_response({"name": request.match_info["name"], "removed": True})


# -- keys -------------------------------------------------------------------------------------------

def _key_json(k) -> dict:
    return {"id": k.id, "name": k.name, "models": sorted(k.models) if k.models else None,
            "created_at": k.created_at, "revoked_at": k.revoked_at}


async def list_keys(request: web.Request) -> web.Response:
    return web.json_response([_key_json(k) for k in request.app[STORE].list_keys()])


async def create_key(request: web.Request) -> web.Response:
    body = await _body(request)
    models = body.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
        raise InvalidRequest("models must be a list of model names", code="invalid_models")
    record, secret = request.app[STORE].create_key(str(body.get("name") or "default"), models or None)
    return web.json_response(_key_json(record) | {"key": secret}, status=201)


async def revoke_key(request: web.Request) -> web.Response:
    return web.json_response(_key_json(request.app[STORE].revoke_key(request.match_info["id"])))


# -- hosts ------------------------------------------------------------------------------------------

async def _local_host_row(ctl: Controller) -> dict:
    ctl.hosts.set_local_info(await ctl.hosts.local_inventory())
    return ctl.cordons.describe_host("local")


async def list_hosts(request: web.Request) -> web.Response:
    ctl = request.app[CONTROLLER]
    rows = [await _local_host_row(ctl)]
    rows += [ctl.cordons.describe_host(name) for name in sorted(ctl.hosts.entries) if name != "local"]
    return web.json_response(rows)


async def get_host(request: web.Request) -> web.Response:
    ctl = request.app[CONTROLLER]
    name = request.match_info["name"]
    if name == "local":
        return web.json_response(await _local_host_row(ctl))
    return web.json_response(ctl.cordons.describe_host(name))


async def add_host(request: web.Request) -> web.Response:
    body = await _body(request)
    name, target = body.get("name"), body.get("ssh")
    if not isinstance(name, str) or not isinstance(target, str) or not name or not target:
        raise InvalidRequest("give the host's name and its SSH target ([user@]address)", code="missing_host")
    port = body.get("port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise InvalidRequest(f"port must be a number from 1 to 65535, not {port!r}", code="invalid_port")
    options = {}
    for key in ("identity", "known_hosts"):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidRequest(f"{key} must be a path", code="invalid_path")
        options[key] = value
    unified = body.get("unified_memory")
    if unified is not None and not isinstance(unified, bool):
        raise InvalidRequest(f"unified_memory must be true or false, not {unified!r}", code="invalid_unified_memory")
    options["unified_memory"] = unified
    row = await request.app[CONTROLLER].cordons.add_host(name, target, port=port, **options)
    return web.json_response(row, status=201)


async def remove_host(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    await request.app[CONTROLLER].cordons.remove_host(name)
    return web.json_response({"name": name, "removed": True})


async def check_host(request: web.Request) -> web.Response:
    return web.json_response(await request.app[CONTROLLER].hosts.check(request.match_info["name"]))


async def drain_host(request: web.Request) -> web.Response:
    """Cordon the host (no new placement lands there, kept across restarts), then park each
    deployment placed there out of place, or move it to another host it may run on."""
    ctl = request.app[CONTROLLER]
    name = request.match_info["name"]
    ctl.hosts.get(name)  # an unknown host is a 404

    async def act() -> dict:
        return await ctl.cordons.drain(name)
    task, _ = await _once(request, act)
    return web.json_response(await asyncio.shield(task))


async def uncordon_host(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    opened = request.app[CONTROLLER].cordons.uncordon(name)
    return web.json_response({"host": name, "cordoned": False, "was_cordoned": opened})


async def inspect_host(request: web.Request) -> web.Response:
    ctl = request.app[CONTROLLER]
    name = request.match_info["name"]
    if name == "local":
        await _local_host_row(ctl)  # measures the inventory now
    return web.json_response(ctl.cordons.inspect_host(name))


# -- usage and the operator key -----------------------------------------------------------------------

async def usage(request: web.Request) -> web.Response:
    return web.json_response(await request.app[USAGE].view())


async def whoami(request: web.Request) -> web.Response:
    return web.json_response({"role": request[ROLE]})


async def rotate_operator_key(request: web.Request) -> web.Response:
    credentials = request.app.get(CREDENTIALS)
    if credentials is None:
        raise CapyError("this management API was started without credentials", code="no_credentials", status=409)
    credentials.rotate_operator_key()
    # The key itself is never in an answer: whoever needs it reads the owner-only file.
    return web.json_response({"rotated": True, "path": str(credentials.operator_key_path)})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def events(request: web.Request) -> web.StreamResponse:
    return await _dashboard.event_stream(request, controller=request.app[CONTROLLER], usage=request.app[USAGE],
                                         exposition=request.app.get(METRICS_TEXT))


async def openapi(request: web.Request) -> web.Response:
    from ._openapi import management_openapi
    return web.json_response(management_openapi())


def build_api(controller: Controller, store: Store, credentials: Credentials | None = None, *,
              metrics_text: Callable[[], str | bytes] | None = None,
              bodies: BodyBudget | None = None) -> web.Application:
    """``credentials`` None serves every request as admin (tests over TCP); the daemon passes them.
    ``metrics_text`` renders the proxy's Prometheus text, which the dashboard reads request rates from.
    ``bodies``: the daemon-wide budget of request bodies held in memory, shared with the proxy;
    None gives this app one of its own."""
    app = web.Application(middlewares=[_errors, lease_middleware(bodies or BodyBudget()), _authenticated],
                          client_max_size=BODY_MAX)
    app[CONTROLLER] = controller
    app[STORE] = store
    if credentials is not None:
        app[CREDENTIALS] = credentials
    app[OPERATIONS] = IdempotentOperations()
    app[USAGE] = UsageView(controller)
    if metrics_text is not None:
        app[METRICS_TEXT] = metrics_text
    r = app.router
    r.add_get("/openapi.json", openapi)
    r.add_get("/ui", _dashboard.ui_redirect)
    r.add_get("/ui/", _dashboard.ui_file)
    r.add_get("/ui/{file}", _dashboard.ui_file)
    r.add_get("/v1/events", events)
    r.add_get("/v1/health", health)
    r.add_get("/v1/deployments", list_deployments)
    r.add_post("/v1/deployments", create_deployment)
    r.add_get("/v1/deployments/{name}", get_deployment)
    r.add_delete("/v1/deployments/{name}", delete_deployment)
    for verb in ("park", "wake", "stop", "drain"):
        r.add_post(f"/v1/deployments/{{name}}/{verb}", _action(verb))
    r.add_get("/v1/deployments/{name}/logs", deployment_logs)
    r.add_get("/v1/deployments/{name}/inspect", inspect_deployment)
    r.add_get("/v1/engines", list_engines)
    r.add_post("/v1/engines", add_engine)
    r.add_get("/v1/engines/{name}", get_engine)
    r.add_delete("/v1/engines/{name}", remove_engine)
    r.add_get("/v1/keys", list_keys)
    r.add_post("/v1/keys", create_key)
    r.add_delete("/v1/keys/{id}", revoke_key)
    r.add_get("/v1/hosts", list_hosts)
    r.add_post("/v1/hosts", add_host)
    r.add_get("/v1/hosts/{name}", get_host)
    r.add_delete("/v1/hosts/{name}", remove_host)
    r.add_post("/v1/hosts/{name}/check", check_host)
    r.add_post("/v1/hosts/{name}/drain", drain_host)
    r.add_post("/v1/hosts/{name}/uncordon", uncordon_host)
    r.add_get("/v1/hosts/{name}/inspect", inspect_host)
    r.add_get("/v1/usage", usage)
    r.add_get("/v1/whoami", whoami)
    r.add_post("/v1/operator-key/rotate", rotate_operator_key)
    return app
