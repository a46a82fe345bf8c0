"""The engine connector: labels ending in .engine reach their unix sockets; other hosts go by TCP."""

from __future__ import annotations

import time

import aiohttp
import aiohttp.connector
import pytest
from aiohttp import web

from capyctl.proxy.connector import EngineConnector, label_of, socket_base_url
from capyctl.systemd import TransientUnit


async def _unix_server(path: str, answer: str) -> web.AppRunner:
    app = web.Application()

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"who": answer, "host": request.host})

    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    return runner


async def test_labels_reach_their_sockets_and_each_launch_has_its_own(tmp_path):
    first, second = str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    runners = [await _unix_server(first, "first"), await _unix_server(second, "second")]
    sockets = {label_of(socket_base_url("smol", "aaaa")): first}
    connector = EngineConnector(resolve=sockets.get)
    connector.route(socket_base_url("smol", "bbbb"), second)  # registered wins over resolve
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.get(socket_base_url("smol", "aaaa") + "/health") as resp:
                assert (await resp.json())["who"] == "first"
            async with session.get(socket_base_url("smol", "bbbb") + "/health") as resp:
                body = await resp.json()
                assert body["who"] == "second" and body["host"] == "bbbb.smol.engine"
    finally:
        for r in runners:
            await r.cleanup()


async def test_an_unknown_label_fails_like_an_unreachable_engine(tmp_path):
    async with aiohttp.ClientSession(connector=EngineConnector(resolve=lambda _h: None)) as session:
        with pytest.raises(aiohttp.ClientConnectorError, match="no engine socket is known"):
            await session.get(socket_base_url("smol", "cccc") + "/health")


async def test_a_socket_that_is_gone_is_a_connector_error(tmp_path):
    connector = EngineConnector()
    connector.route(socket_base_url("smol", "dddd"), str(tmp_path / "missing.sock"))
    async with aiohttp.ClientSession(connector=connector) as session:
        with pytest.raises(aiohttp.ClientConnectorError):
            await session.get(socket_base_url("smol", "dddd") + "/health")


def test_socket_units_get_a_private_runtime_directory_and_network():
    unit = TransientUnit(name="capyctl-smol.service", description="d", argv=["/bin/true"],
                         runtime_directory="capyctl-engine/smol", private_network=True)
    props = dict(unit.properties())
    assert props["RuntimeDirectory"].value == ["capyctl-engine/smol"]
    assert props["RuntimeDirectoryMode"].value == 0o700
    assert props["PrivateNetwork"].value is True
    plain = dict(TransientUnit(name="capyctl-x.service", description="d", argv=["/bin/true"]).properties())
    assert "RuntimeDirectory" not in plain and "PrivateNetwork" not in plain


def test_runtime_directory_must_stay_below_run():
    from capyctl.errors import SystemdError
    for bad in ("/run/x", "capyctl-engine/../../etc"):
        with pytest.raises(SystemdError):
            TransientUnit(name="capyctl-x.service", description="d", argv=["/bin/true"],
                          runtime_directory=bad).properties()


# llama-server closes a keep-alive connection idle this long: cpp-httplib's default, which its
# server does not change (llama.cpp vendor/cpp-httplib/httplib.h: CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND 5;
# tools/server sets no keep-alive timeout of its own).
LLAMA_SERVER_KEEPALIVE_S = 5.0


async def test_idle_engine_connections_are_dropped_before_the_engine_drops_them(tmp_path, monkeypatch):
    # Reusing a connection llama-server had just closed failed a request with
    # ServerDisconnectedError (seen in CI with the anthropic client). aiohttp reuses a pooled
    # connection only while it has been idle no longer than the connector's keepalive_timeout, by
    # its module's monotonic() (aiohttp/connector.py, BaseConnector._get): that clock is moved
    # here, so no test waits seconds. This server keeps every connection (aiohttp/web_protocol.py:
    # an hour).
    path = str(tmp_path / "e.sock")
    connections: list[object] = []  # the transport each request came on (held: ids stay unique)
    app = web.Application()

    async def health(request: web.Request) -> web.Response:
        connections.append(request.transport)
        return web.json_response({})

    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    idle = 0.0
    monkeypatch.setattr(aiohttp.connector, "monotonic", lambda: time.monotonic() + idle)
    connector = EngineConnector()
    connector.route(socket_base_url("smol", "eeee"), path)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            async def request_after(seconds: float) -> None:
                nonlocal idle
                idle += seconds
                async with session.get(socket_base_url("smol", "eeee") + "/health") as resp:
                    assert await resp.json() == {}  # read to its end: the connection goes back to the pool

            await request_after(0)
            await request_after(1.0)  # keep-alive still saves a connect
            assert len({id(t) for t in connections}) == 1
            # Idle nearly as long as llama-server keeps it: it may be closing it now, so a new one.
            await request_after(LLAMA_SERVER_KEEPALIVE_S - 0.5)
            assert len({id(t) for t in connections}) == 2 and connections[2] is not connections[1]
    finally:
        await runner.cleanup()
