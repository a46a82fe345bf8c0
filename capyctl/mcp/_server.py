"""``capyctl mcp``: a Model Context Protocol server (streamable HTTP, the official ``mcp`` SDK)
through which AI agents on the owner's network operate CapyCTL.

It is its own process and reaches CapyCTL only through the management API, with the operator
key: the daemon, not this process, decides what the operator role may do. Its tools mirror the
API one to one (list, usage, status, deploy, park, wake, stop, delete, drain, logs); there are
none for hosts, engines or keys, which the operator role may not manage anyway.

Every HTTP request must carry the operator key as a bearer token, compared in constant time
before the SDK sees a byte of it (``_Guard``); bodies and concurrent requests are capped and an
``Origin`` header, which only browsers send, must be one the owner allowed. Action tools wait
for the operation up to a deadline, then answer its state; they always send an idempotency key
(the caller's, or a new one they return) so calling again with it waits for the same operation
instead of acting twice.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import sys
import uuid
from typing import Any

import yaml
from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import ToolAnnotations

from .. import __version__
from ..errors import CapyError
from ._api import ManagementApi, OperatorKey

log = logging.getLogger("capyctl.mcp")

DEFAULT_LISTEN = "127.0.0.1:7444"
MCP_PATH = "/mcp"
MAX_BODY = 1 << 20
MAX_CONCURRENT = 16
DEFAULT_WAIT_S = 60.0
MAX_WAIT_S = 600.0
MAX_LOG_LINES = 1000

READ = ToolAnnotations(read_only_hint=True, open_world_hint=False)
ACT = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
DESTROY = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)


def _tool_error(exc: CapyError) -> ToolError:
    # The API's code and sentence, unchanged, for the agent to read.
    return ToolError(f"{exc.code}: {exc.message}")


def _wait(seconds: float | None) -> float:
    if seconds is None:
        return DEFAULT_WAIT_S
    if not 0 < seconds <= MAX_WAIT_S:
        raise ToolError(f"invalid_wait: wait_seconds must be more than 0 and at most {MAX_WAIT_S:.0f}")
    return float(seconds)


def build_server(api: ManagementApi) -> MCPServer:
    server = MCPServer("capyctl", version=__version__, instructions=(
        "CapyCTL runs LLM engine servers on this machine behind one OpenAI-compatible endpoint. "
        "Read `usage` to see how full each GPU and the host RAM are and what each deployment holds; "
        "park idle deployments to free memory (the next request wakes them). Action tools return "
        "done=false with an idempotency_key when their wait ends first: call again with that key to "
        "keep waiting; it never repeats the action."), log_level="WARNING")

    async def read(path: str) -> Any:
        try:
            return await api.request("GET", path)
        except CapyError as exc:
            raise _tool_error(exc) from None

    async def act(method: str, path: str, deployment: str | None, wait_seconds: float | None,
                  idempotency_key: str | None) -> dict:
        key = idempotency_key or str(uuid.uuid4())
        wait = _wait(wait_seconds)
        try:
            result = await api.request(method, path, timeout=wait, idempotency_key=key)
        except asyncio.TimeoutError:
            state = None
            if deployment is not None:
                state = (await read(f"/v1/deployments/{deployment}")).get("state")
            return {"done": False, "idempotency_key": key, "state": state,
                    "message": f"still running after {wait:.0f}s; call again with this idempotency_key to keep waiting"}
        except CapyError as exc:
            raise _tool_error(exc) from None
        return {"done": True, "idempotency_key": key, "state": result.get("state"), "result": result}

    @server.tool(annotations=READ, structured_output=True)
    async def list(resource: str = "deployments") -> dict[str, Any]:
        """List deployments (state, revision, hosts, engine), hosts, engines or API keys (never their
        secrets), as `capyctl list`. resource: deployments, hosts, engines or keys."""
        if resource not in ("deployments", "hosts", "engines", "keys"):
            raise ToolError("invalid_resource: resource must be deployments, hosts, engines or keys")
        return {resource: await read(f"/v1/{resource}")}

    @server.tool(annotations=READ, structured_output=True)
    async def usage() -> dict[str, Any]:
        """Memory per host domain (each GPU and the host RAM: capacity, observed available,
        reserved, unreserved) and per deployment (bytes held in each domain, state, requests in
        flight, seconds since its last request). A figure that could not be measured is null with
        its reason under `unknown`; it is never zero. The same view as `capyctl usage --json`."""
        return await read("/v1/usage")

    @server.tool(annotations=READ, structured_output=True)
    async def status(deployment: str) -> dict[str, Any]:
        """One deployment: state and reason, revision, unit, model, memory, requests in flight."""
        return await read(f"/v1/deployments/{deployment}")

    @server.tool(annotations=READ, structured_output=True)
    async def logs(deployment: str, lines: int = 100) -> dict[str, Any]:
        """The last lines of a deployment's journal (journalctl -u capyctl-<deployment>)."""
        if not 1 <= lines <= MAX_LOG_LINES:
            raise ToolError(f"invalid_lines: lines must be from 1 to {MAX_LOG_LINES}")
        try:
            events = await api.events("GET", f"/v1/deployments/{deployment}/logs?lines={lines}", timeout=60)
        except (CapyError, asyncio.TimeoutError) as exc:
            raise _tool_error(exc if isinstance(exc, CapyError) else
                              CapyError("the journal took too long", code="timeout")) from None
        return {"deployment": deployment, "lines": [e["line"] for e in events if "line" in e]}

    @server.tool(annotations=ACT, structured_output=True)
    async def deploy(manifest: str, activate: bool = True, wait_seconds: float | None = None,
                     idempotency_key: str | None = None) -> dict[str, Any]:
        """Record a deployment from its manifest (YAML text: name, engine, model.path or model.hf, ...)
        and, with activate, start it and wait until it serves or wait_seconds pass. A changed
        manifest becomes a new revision. Returns the deployment's state."""
        try:
            spec = yaml.safe_load(manifest)
        except yaml.YAMLError as exc:
            raise ToolError(f"invalid_manifest: the manifest is not YAML: {exc}") from None
        if not isinstance(spec, dict):
            raise ToolError("invalid_manifest: the manifest must be a YAML mapping")
        key = idempotency_key or str(uuid.uuid4())
        wait = _wait(wait_seconds)
        body = {"spec": spec, "activate": activate, "wait": activate}
        try:
            events = await api.events("POST", "/v1/deployments", body, timeout=wait, idempotency_key=key)
        except asyncio.TimeoutError:
            name = spec.get("name")
            state = None
            if isinstance(name, str):
                try:
                    state = (await api.request("GET", f"/v1/deployments/{name}")).get("state")
                except CapyError:
                    pass
            return {"done": False, "idempotency_key": key, "state": state,
                    "message": f"still running after {wait:.0f}s; call again with this idempotency_key to keep waiting"}
        except CapyError as exc:
            raise _tool_error(exc) from None
        final = events[-1] if events else {}
        if final.get("event") == "error":
            err = final["error"]
            raise ToolError(f"{err.get('code')}: {err.get('message')}")
        if final.get("event") != "done":
            raise ToolError("deploy_interrupted: the management API closed the answer before the deploy ended")
        deployment = final["deployment"]
        return {"done": True, "idempotency_key": key, "state": deployment.get("state"), "result": deployment}

    @server.tool(annotations=ACT, structured_output=True)
    async def park(deployment: str, wait_seconds: float | None = None, idempotency_key: str | None = None) -> dict[str, Any]:
        """Park a deployment: wait for its requests in flight, then release its memory. The next
        request for it wakes it."""
        return await act("POST", f"/v1/deployments/{deployment}/park", deployment, wait_seconds, idempotency_key)

    @server.tool(annotations=ACT, structured_output=True)
    async def wake(deployment: str, wait_seconds: float | None = None, idempotency_key: str | None = None) -> dict[str, Any]:
        """Wake a parked or stopped deployment now, making room by parking idle ones if needed."""
        return await act("POST", f"/v1/deployments/{deployment}/wake", deployment, wait_seconds, idempotency_key)

    @server.tool(annotations=DESTROY, structured_output=True)
    async def stop(deployment: str, wait_seconds: float | None = None, idempotency_key: str | None = None) -> dict[str, Any]:
        """Stop a deployment's unit. It stays recorded and starts again on a request or a wake."""
        return await act("POST", f"/v1/deployments/{deployment}/stop", deployment, wait_seconds, idempotency_key)

    @server.tool(annotations=DESTROY, structured_output=True)
    async def delete(deployment: str, wait_seconds: float | None = None, idempotency_key: str | None = None) -> dict[str, Any]:
        """Stop a deployment and forget it and its revisions. Refused while it has requests in flight."""
        return await act("DELETE", f"/v1/deployments/{deployment}", None, wait_seconds, idempotency_key)

    @server.tool(annotations=ACT, structured_output=True)
    async def drain(host: str = "local", wait_seconds: float | None = None,
                    idempotency_key: str | None = None) -> dict[str, Any]:
        """Close a host to new placements (`local` is this machine) and park every deployment on
        it, or move one that may run elsewhere. Deployments that may only run there answer
        host_cordoned until an admin runs `capyctl uncordon host NAME`."""
        return await act("POST", f"/v1/hosts/{host}/drain", None, wait_seconds, idempotency_key)

    return server


# -- the HTTP listener ----------------------------------------------------------------------------


def _reply(status: int, code: str, message: str, extra_headers: list[tuple[bytes, bytes]] = ()):
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    return body, headers


class _Guard:
    """ASGI middleware in front of the SDK's app: key, Origin, body size and concurrency."""

    def __init__(self, app, key: OperatorKey, allowed_origins: set[str], *, max_body: int = MAX_BODY,
                 max_concurrent: int = MAX_CONCURRENT) -> None:
        self.app = app
        self.key = key
        self.allowed_origins = allowed_origins
        self.max_body = max_body
        self.max_concurrent = max_concurrent
        self.active = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # lifespan: the SDK's session manager starts here
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        scheme, _, presented = headers.get("authorization", "").partition(" ")
        # The key first, before anything else is looked at or any MCP processing happens.
        if scheme.lower() != "bearer" or not self.key.matches(presented.strip()):
            await self._send(send, 401, "operator_key_required",
                             "every request needs the operator key: Authorization: Bearer <operator key>",
                             [(b"www-authenticate", b'Bearer realm="capyctl-mcp"')])
            return
        origin = headers.get("origin")
        if origin is not None and origin not in self.allowed_origins:
            await self._send(send, 403, "origin_not_allowed",
                             f"requests from origin {origin!r} are not allowed; start capyctl mcp with "
                             "--allow-origin to allow it")
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await self._send(send, 413, "request_too_large", f"the body is larger than {self.max_body} bytes")
            return
        if self.active >= self.max_concurrent:
            await self._send(send, 429, "too_many_requests",
                             f"{self.max_concurrent} requests are already being served; retry shortly",
                             [(b"retry-after", b"1")])
            return
        self.active += 1
        try:
            body = await self._read_body(receive)
            if body is None:
                await self._send(send, 413, "request_too_large", f"the body is larger than {self.max_body} bytes")
                return
            await self.app(scope, self._replay(body, receive), send)
        finally:
            self.active -= 1

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, or None past the cap (a chunked body has no Content-Length to check)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        return b"".join(chunks)

    @staticmethod
    def _replay(body: bytes, receive):
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then whatever comes next (a disconnect)
        return replay

    @staticmethod
    async def _send(send, status: int, code: str, message: str, extra=()) -> None:
        body, headers = _reply(status, code, message, list(extra))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise CapyError(f"--listen must be HOST:PORT, not {listen!r}", code="invalid_listen", status=400)
    return host.strip("[]") or "0.0.0.0", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_app(api: ManagementApi, key: OperatorKey, *, port: int, allowed_origins: list[str] = (),
              max_body: int = MAX_BODY, max_concurrent: int = MAX_CONCURRENT):
    server = build_server(api)
    # Stateless JSON answers: every POST stands alone, so no session or open stream outlives a request.
    # Host/Origin checking is _Guard's (Origin) and the key's: the SDK's DNS-rebinding check
    # would refuse the names a LAN client uses for this machine.
    app = server.streamable_http_app(streamable_http_path=MCP_PATH, json_response=True, stateless_http=True,
                                     max_request_body_size=max_body,
                                     transport_security=TransportSecuritySettings(
                                         enable_dns_rebinding_protection=False))
    origins = {f"http://{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]")} | set(allowed_origins)
    return _Guard(app, key, origins, max_body=max_body, max_concurrent=max_concurrent)


def serve(*, listen: str, api_socket: str, key_path, allowed_origins: list[str], max_concurrent: int) -> int:
    import uvicorn
    host, port = split_listen(listen)
    key = OperatorKey(key_path)
    api = ManagementApi(api_socket, key)
    app = build_app(api, key, port=port, allowed_origins=allowed_origins, max_concurrent=max_concurrent)
    print(f"capyctl mcp: serving MCP on http://{listen}{MCP_PATH} (streamable HTTP); reaching CapyCTL through "
          f"{api_socket} as operator", file=sys.stderr, flush=True)
    if not is_loopback(host):
        print(f"capyctl mcp: {listen} is not a loopback address and this endpoint is plain HTTP: the operator "
              "key crosses the network unencrypted. Beyond a trusted LAN, put a TLS reverse proxy or a "
              "tailnet in front.", file=sys.stderr, flush=True)
    # No access log: it would only repeat paths, and nothing about a request is worth keeping there.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            limit_concurrency=max_concurrent * 4, timeout_keep_alive=5, server_header=False)
    try:
        uvicorn.Server(config).run()
    finally:
        asyncio.run(api.close())
    return 0
