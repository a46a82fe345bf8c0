"""Roles on the management API, the usage view's unknown figures, Idempotency-Key, and
``capyctl mcp`` driven by the official ``mcp`` client SDK.

The management API runs as the daemon builds it (a real Controller and Store, credentials
created in a temporary state directory) on a unix socket; its systemd client is a stub with
no units, so nothing is launched: the integration test (tests/integration/test_mcp.py) parks
and wakes a real llama-server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
from pathlib import Path

import aiohttp
import httpx2
import pytest
import uvicorn
from aiohttp import web
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.types import INTERNAL_ERROR

from capyctl.api import Credentials, build_api
from capyctl.config import DaemonConfig, Paths
from capyctl.controller import Controller
from capyctl.mcp import ManagementApi, OperatorKey, build_app
from capyctl.store import Store

TOOLS = {"list", "usage", "status", "deploy", "park", "wake", "stop", "delete", "drain", "logs"}


def leaf_errors(group: BaseExceptionGroup) -> list[BaseException]:
    """The errors in ``group`` and the groups inside it. The SDK's client raises what failed from
    inside anyio task groups (its session's and its transport's: mcp/client/session.py
    ``__aexit__``), and anyio wraps it in a group each (anyio/_backends/_asyncio.py TaskGroup)."""
    return [leaf for e in group.exceptions
            for leaf in (leaf_errors(e) if isinstance(e, BaseExceptionGroup) else [e])]


class NoUnits:
    """Stands where the D-Bus systemd client goes: a host with no CapyCTL units."""

    async def list_units(self, pattern: str):
        return []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """The management API on a unix socket and ``capyctl mcp`` on loopback, in this event loop."""

    async def start(self, root: Path) -> "Stack":
        self.paths = Paths(state_dir=root / "state", runtime_dir=root / "run")
        self.paths.state_dir.mkdir()
        self.paths.runtime_dir.mkdir()
        self.store = Store(self.paths.database)
        self.controller = Controller(DaemonConfig(paths=self.paths), self.store, NoUnits())
        await self.controller.start()
        self.credentials = Credentials(self.paths.credentials_dir)
        self.api_runner = web.AppRunner(build_api(self.controller, self.store, self.credentials))
        await self.api_runner.setup()
        await web.UnixSite(self.api_runner, str(self.paths.api_socket)).start()
        self.operator_key = self.credentials.operator_key_path.read_text().strip()
        self.admin_token = self.credentials.admin_token_path.read_text().strip()
        _, self.inference_key = self.store.create_key("laptop", None)
        key = OperatorKey(self.credentials.operator_key_path)
        self.mcp_api = ManagementApi(str(self.paths.api_socket), key)
        self.port = _free_port()
        app = build_app(self.mcp_api, key, port=self.port, max_concurrent=4)
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     access_log=False))
        self.uvicorn_task = asyncio.create_task(self.uvicorn.serve())
        while not self.uvicorn.started:
            await asyncio.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        return self

    async def stop(self) -> None:
        self.uvicorn.should_exit = True
        await self.uvicorn_task
        await self.mcp_api.close()
        await self.api_runner.cleanup()
        await self.controller.close()
        self.store.close()

    def client(self, bearer: str | None) -> Client:
        headers = {"Authorization": f"Bearer {bearer}"} if bearer is not None else {}
        return Client(streamable_http_client(self.url, http_client=create_mcp_http_client(headers=headers)))

    async def api(self, method: str, path: str, bearer: str | None = None, **kw) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        headers.update(kw.pop("headers", {}))
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(self.paths.api_socket))) as s:
            async with s.request(method, f"http://capyctl{path}", headers=headers, **kw) as r:
                return r.status, await r.json()


@pytest.fixture
async def stack(tmp_path):
    s = await Stack().start(tmp_path)
    yield s
    await s.stop()


async def test_credentials_are_owner_only_distinct_and_kept(tmp_path):
    first = Credentials(tmp_path / "credentials")
    assert stat.S_IMODE(os.stat(tmp_path / "credentials").st_mode) == 0o700
    for path in (first.admin_token_path, first.operator_key_path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    operator_key = first.operator_key_path.read_text().strip()
    assert operator_key != first.admin_token_path.read_text().strip()
    again = Credentials(tmp_path / "credentials")  # a restart keeps the keys
    assert again.role_of(operator_key) == "operator"


async def test_roles_on_the_management_api(stack):
    # A peer on the socket without a credential is admin, as before roles.
    assert await stack.api("GET", "/v1/whoami") == (200, {"role": "admin"})
    assert await stack.api("GET", "/v1/whoami", stack.admin_token) == (200, {"role": "admin"})
    assert await stack.api("GET", "/v1/whoami", stack.operator_key) == (200, {"role": "operator"})
    # The operator reads everything...
    for path in ("/v1/deployments", "/v1/hosts", "/v1/engines", "/v1/keys", "/v1/usage"):
        status, _ = await stack.api("GET", path, stack.operator_key)
        assert status == 200, path
    # ...but manages no host, engine or key, and cannot rotate its own key.
    for method, path, body in (("POST", "/v1/hosts", {"name": "gpu2", "ssh": "root@gpu2"}),
                               ("DELETE", "/v1/hosts/gpu2", None), ("POST", "/v1/keys", {"name": "x"}),
                               ("DELETE", "/v1/keys/abc", None), ("POST", "/v1/engines", {"path": "/bin/true"}),
                               ("POST", "/v1/operator-key/rotate", None)):
        status, answer = await stack.api(method, path, stack.operator_key, json=body)
        assert (status, answer["error"]["code"]) == (403, "operator_not_permitted"), (method, path)
    # Its writes reach the handler (here: no such deployment).
    status, answer = await stack.api("POST", "/v1/deployments/nope/park", stack.operator_key)
    assert (status, answer["error"]["code"]) == (404, "deployment_not_found")
    # An inference key, or anything else, authorizes nothing, even on the socket.
    status, answer = await stack.api("GET", "/v1/deployments", stack.inference_key)
    assert (status, answer["error"]["code"]) == (401, "inference_key_not_accepted")
    status, answer = await stack.api("GET", "/v1/deployments", "capyop-wrong")
    assert (status, answer["error"]["code"]) == (401, "invalid_credential")


async def test_rotation_refuses_the_old_key_without_a_restart(stack):
    old = stack.operator_key
    status, answer = await stack.api("POST", "/v1/operator-key/rotate", stack.admin_token)
    assert status == 200 and answer["rotated"] and old not in json.dumps(answer)
    new = stack.credentials.operator_key_path.read_text().strip()
    assert new != old
    assert (await stack.api("GET", "/v1/whoami", old))[0] == 401
    assert await stack.api("GET", "/v1/whoami", new) == (200, {"role": "operator"})
    # capyctl mcp picks the new key up from the file by itself.
    async with stack.client(new) as client:
        assert (await client.call_tool("list", {})).is_error is False


async def test_idempotency_key_returns_the_first_outcome(stack):
    headers = {"Idempotency-Key": "drain-1"}
    first = await stack.api("POST", "/v1/hosts/local/drain", stack.operator_key, headers=headers)
    assert first == (200, {"host": "local", "cordoned": True, "deployments": [], "drained": True})
    assert await stack.api("POST", "/v1/hosts/local/drain", stack.operator_key, headers=headers) == first
    status, answer = await stack.api("POST", "/v1/deployments/x/park", stack.operator_key, headers=headers)
    assert (status, answer["error"]["code"]) == (422, "idempotency_key_reused")


async def test_usage_marks_unmeasured_figures_unknown(stack, monkeypatch):
    from capyctl.hosts import inventory
    monkeypatch.setattr(inventory, "gpu_inventory", lambda proc_root=None: (_ for _ in ()).throw(
        inventory.NvmlUnavailable("NVML Shared Library Not Found")))
    from capyctl.scheduler import GpuCard, HostResources
    ledger = stack.controller.memory.ledger
    ram_capacity = ledger.domains["ram:local"].capacity
    # The ledger budgets a card (as from an earlier inventory) that NVML cannot be asked about now.
    ledger.add_host(HostResources("local", ram_capacity, 0, (GpuCard(0, "NVIDIA H200", 140 << 30),)))
    status, view = await stack.api("GET", "/v1/usage")
    assert status == 200
    local = view["hosts"][0]
    assert local["host"] == "local" and local["state"] == "online"
    ram = next(d for d in local["domains"] if d["kind"] == "ram")
    assert ram["capacity"] > 0 and ram["available"] > 0 and ram["reserved"] == 0
    assert ram["unreserved"] == ram["capacity"] and ram["unknown"] == {}
    gpu = next(d for d in local["domains"] if d["kind"] == "gpu")
    assert gpu["capacity"] == 140 << 30 and gpu["available"] is None  # unknown, not 0
    assert "NVML Shared Library Not Found" in gpu["unknown"]["available"]


def test_capyctl_usage_prints_unknown_with_its_reason(monkeypatch, capsys):
    from capyctl import cli
    view = {"measured_at": 1.0, "hosts": [{"host": "local", "state": "online", "unknown": {}, "domains": [
        {"id": "gpu:local:0", "kind": "gpu", "index": 0, "model": "NVIDIA H200", "capacity": 150323855360,
         "available": None, "reserved": 0, "pending_release": 0, "external": 0, "unreserved": 150323855360,
         "unknown": {"available": "NVML could not be read: no driver"}}]}],
        "deployments": [{"name": "smollm2", "state": "parked", "host": "local", "in_flight": 0, "waiting": 0,
                         "last_request_at": None, "idle_seconds": None, "domains": [],
                         "unknown": {"idle_seconds": "no request for it since the daemon started"}}]}
    monkeypatch.setattr(cli.ApiClient, "request", lambda self, method, path, body=None: view)
    assert cli.main(["usage"]) == 0
    out = capsys.readouterr().out
    assert "gpu:local:0" in out and "unknown" in out and "140.0 GiB" in out
    assert "gpu:local:0 available: NVML could not be read: no driver" in out
    assert "deployment smollm2 idle_seconds: no request for it since the daemon started" in out
    assert cli.main(["usage", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == view


def test_listen_addresses():
    from capyctl.mcp import is_loopback, split_listen
    assert split_listen("0.0.0.0:7444") == ("0.0.0.0", 7444)
    assert split_listen("[::1]:7444") == ("::1", 7444)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")


async def test_mcp_tools_through_the_official_client(stack, caplog):
    caplog.set_level(logging.DEBUG)
    async with stack.client(stack.operator_key) as client:
        tools = {t.name for t in (await client.list_tools()).tools}
        assert tools == TOOLS
        usage = await client.call_tool("usage", {})
        assert usage.is_error is False
        status, api_view = await stack.api("GET", "/v1/usage")
        assert usage.structured_content == api_view  # within the measurement window: the same figures
        missing = await client.call_tool("park", {"deployment": "nope"})
        assert missing.is_error and "deployment_not_found" in missing.content[0].text
        drained = await client.call_tool("drain", {"idempotency_key": "k1"})
        assert drained.structured_content["done"] is True
        assert drained.structured_content["result"]["drained"] is True
        dump = json.dumps([usage.model_dump(mode="json"), missing.model_dump(mode="json"),
                           drained.model_dump(mode="json")])
    for secret in (stack.operator_key, stack.admin_token):
        assert secret not in dump
        assert secret not in caplog.text


@pytest.mark.parametrize("who", ["none", "admin", "inference", "wrong"])
async def test_mcp_refuses_anything_but_the_operator_key(stack, who):
    bearer = {"none": None, "admin": stack.admin_token, "inference": stack.inference_key,
              "wrong": "capyop-" + "x" * 43}[who]
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    async with httpx2.AsyncClient() as http:
        r = await http.post(stack.url, json=body, headers=headers | {"Accept": "application/json, text/event-stream"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "operator_key_required"
    assert r.headers["www-authenticate"].startswith("Bearer")
    # The SDK's client gets no further than its handshake: a non-2xx answer whose body is not a
    # JSON-RPC error becomes this stand-in error (mcp 2.3 mcp/client/streamable_http.py,
    # _handle_post_request), raised by the client's connect (mcp/client/_probe.py, negotiate_auto).
    with pytest.raises(ExceptionGroup) as refused:
        async with stack.client(bearer) as client:
            await client.list_tools()
    [error] = leaf_errors(refused.value)
    assert type(error) is MCPError
    assert (error.code, error.message) == (INTERNAL_ERROR, "Server returned an error response")


async def test_mcp_checks_origin_and_caps_bodies(stack):
    headers = {"Authorization": f"Bearer {stack.operator_key}", "Accept": "application/json, text/event-stream"}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    async with httpx2.AsyncClient() as http:
        r = await http.post(stack.url, json=body, headers=headers | {"Origin": "http://evil.example"})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "origin_not_allowed")
        r = await http.post(stack.url, content=b"x" * (2 << 20), headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
        # Without the key, neither the Origin nor the body is looked at: 401 comes first.
        r = await http.post(stack.url, content=b"x" * (2 << 20), headers={"Origin": "http://evil.example"})
        assert r.status_code == 401
