"""The engine connector: labels ending in .engine reach their unix sockets; other hosts go by TCP."""

from __future__ import annotations

import aiohttp
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


async def test_idle_engine_connections_are_dropped_before_the_engine_drops_them():
    # llama-server closes an idle keep-alive connection after 5 s; reusing one it just closed
    # failed a request with ServerDisconnectedError (seen in CI with the anthropic client).
    from capyctl.proxy.connector import ENGINE_KEEPALIVE_S
    assert ENGINE_KEEPALIVE_S < 5
    connector = EngineConnector()
    assert connector._keepalive_timeout == ENGINE_KEEPALIVE_S
    await connector.close()
