"""``capyctl mcp`` against a real llama-server deployment, driven by the official ``mcp`` client
SDK: it lists the tools, reads usage (the same figures as ``capyctl usage --json``), parks and
wakes the deployment; anything but the operator key is refused; no key shows up anywhere."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import httpx2
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.types import INTERNAL_ERROR

from tests.unit.test_mcp import leaf_errors

from .capyhost import CAPYCTL, free_port

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]


def _client(url: str, bearer: str | None) -> Client:
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    return Client(streamable_http_client(url, http_client=create_mcp_http_client(headers=headers)))


def _wait_listening(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "capyctl mcp exited"
        try:
            httpx2.post(url, json={}, timeout=1)
            return
        except httpx2.TransportError:
            time.sleep(0.2)
    raise AssertionError("capyctl mcp did not listen")


def test_mcp_operates_a_real_deployment(capyhost, smollm2, tmp_path):
    path = capyhost.write_manifest("smollm2", f"name: smollm2\nengine: llama\nmodel:\n  path: {smollm2}\n")
    capyhost.cli("deploy", "model", "--file", str(path), "--activate", "--wait")
    inference_key = capyhost.create_key("--name", "agent-laptop")
    credentials = capyhost.state_dir / "credentials"
    operator_key = (credentials / "operator.key").read_text().strip()
    admin_token = (credentials / "admin.token").read_text().strip()
    assert len({operator_key, admin_token, inference_key}) == 3

    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    log_path = tmp_path / "mcp.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([str(CAPYCTL), "--api-socket", str(capyhost.api_socket), "mcp", "serve",
                                 "--listen", f"127.0.0.1:{port}",
                                 "--operator-key-file", str(credentials / "operator.key")],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_listening(url, proc)
        results = asyncio.run(_drive(url, operator_key, capyhost))
        for bearer in (None, inference_key, admin_token):
            r = httpx2.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
                            headers={"Accept": "application/json, text/event-stream",
                                     **({"Authorization": f"Bearer {bearer}"} if bearer else {})})
            assert r.status_code == 401 and r.json()["error"]["code"] == "operator_key_required"
            # The SDK's stand-in for that 401, in anyio's groups (tests/unit/test_mcp.py says where).
            with pytest.raises(ExceptionGroup) as refused:
                asyncio.run(_list_tools(url, bearer))
            [error] = leaf_errors(refused.value)
            assert type(error) is MCPError
            assert (error.code, error.message) == (INTERNAL_ERROR, "Server returned an error response")
    finally:
        proc.terminate()  # our own child, by its handle
        proc.wait(timeout=20)
    logs = log_path.read_text() + capyhost.daemon_journal(400)
    for secret in (operator_key, admin_token, inference_key):
        assert secret not in results
        assert secret not in logs


async def _list_tools(url: str, bearer: str | None):
    async with _client(url, bearer) as client:
        return await client.list_tools()


async def _drive(url: str, operator_key: str, capyhost) -> str:
    seen = []
    async with _client(url, operator_key) as client:
        tools = {t.name for t in (await client.list_tools()).tools}
        assert tools == {"list", "usage", "status", "deploy", "park", "wake", "stop", "delete", "drain", "logs"}

        # capyctl usage --json and the usage tool read one view: within one measurement window
        # (measured_at equal) every figure is equal.
        for _ in range(5):
            cli_view = json.loads(await asyncio.to_thread(lambda: capyhost.cli("usage", "--json").stdout))
            tool_view = (await client.call_tool("usage", {})).structured_content
            if cli_view["measured_at"] == tool_view["measured_at"]:
                break
        assert tool_view == cli_view
        dep = next(d for d in tool_view["deployments"] if d["name"] == "smollm2")
        assert dep["state"] == "ready" and dep["in_flight"] == 0
        ram = next(d for d in dep["domains"] if d["id"] == "ram:local")
        assert ram["held"] and ram["held"] > 0  # the unit's cgroup, measured
        seen.append(json.dumps(tool_view))

        parked = await client.call_tool("park", {"deployment": "smollm2", "idempotency_key": "park-1",
                                                 "wait_seconds": 120})
        assert parked.is_error is False, parked.content
        assert parked.structured_content["done"] is True and parked.structured_content["state"] == "parked"
        wakes_before = (await client.call_tool("status", {"deployment": "smollm2"})).structured_content["wakes"]
        woke = await client.call_tool("wake", {"deployment": "smollm2", "idempotency_key": "wake-1",
                                               "wait_seconds": 120})
        assert woke.structured_content["done"] is True and woke.structured_content["state"] == "ready"
        # The same park again with its key does not park again: the first outcome comes back.
        again = await client.call_tool("park", {"deployment": "smollm2", "idempotency_key": "park-1"})
        assert again.structured_content["result"] == parked.structured_content["result"]
        status = (await client.call_tool("status", {"deployment": "smollm2"})).structured_content
        assert status["state"] == "ready" and status["wakes"] == wakes_before + 1
        logs = (await client.call_tool("logs", {"deployment": "smollm2", "lines": 20})).structured_content
        assert logs["lines"]
        for result in (parked, woke, again):
            seen.append(result.model_dump_json())
        seen.append(json.dumps(status))
        seen.append(json.dumps(logs))
    return "\n".join(seen)
