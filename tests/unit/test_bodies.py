"""Request bodies held in memory, bounded across the daemon (capyctl/bodies.py, issue 45): one
budget for the proxy's JSON bodies and forms and the management API's bodies; a request that finds
no room is refused at once, never made to wait, and every share comes back however its request
ends.

The proxy runs behind aiohttp's server (CAPYCTL_PROXY_FRONT=aiohttp), the one server that faces
clients once issue 45's first part lands; clients are raw sockets where a body must stop halfway.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from capyctl.api import build_api
from capyctl.bodies import BUSY_CODE, BodyBudget
from capyctl.errors import CapyError
from capyctl.proxy import KeyGrant, StaticKeys, Upstream, build_app, serve
from tests.unit.test_proxy import HANG_GUARD, FakeRouter, eventually

KEY = "sk-test"
BUDGET = 100_000
CHAT = "/v1/chat/completions"


# ---------------------------------------------------------------- the budget itself

def test_a_lease_takes_within_the_budget_and_is_refused_at_once_past_it() -> None:
    budget = BodyBudget(100)
    first, second = budget.lease(), budget.lease()
    first.take(60)
    with pytest.raises(CapyError) as refused:
        second.take(41)
    assert (refused.value.code, refused.value.status, refused.value.retry_after) == (BUSY_CODE, 503, 1.0)
    assert (budget.used, second.held, budget.refused) == (60, 0, 1)  # a refusal takes nothing
    second.take(40)
    assert budget.used == 100


def test_hold_takes_only_the_growth_and_close_gives_everything_back() -> None:
    budget = BodyBudget(100)
    with budget.lease() as lease:
        lease.hold(30)  # a Content-Length
        lease.hold(20)  # fewer bytes read so far: nothing more
        lease.hold(45)  # more than announced (a compressed body): the difference
        assert (lease.held, budget.used) == (45, 45)
        lease.give_back(15)  # spooled to disk
        assert budget.used == 30
    assert budget.used == 0 and lease.held == 0


# ---------------------------------------------------------------- the proxy

@dataclass
class Proxy:
    host: str
    port: int
    budget: BodyBudget

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@pytest.fixture
async def proxy(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Proxy]:
    monkeypatch.setenv("CAPYCTL_PROXY_FRONT", "aiohttp")

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"object": "chat.completion", "choices": []})

    engine_app = web.Application(client_max_size=64 << 20)
    engine_app.router.add_post(CHAT, answer)
    engine_app.router.add_post("/v1/audio/transcriptions", answer)
    engine = await serve(engine_app, host_port="127.0.0.1:0")
    upstream = Upstream("dep", f"http://127.0.0.1:{engine.addresses[0][1]}", None, "custom",
                        frozenset({"chat", "transcriptions"}))
    budget = BodyBudget(BUDGET)
    runner = await serve(build_app(FakeRouter({"m": upstream}), StaticKeys({KEY: KeyGrant("k")}), max_body=1 << 20,
                                   bodies=budget), host_port="127.0.0.1:0")
    try:
        yield Proxy("127.0.0.1", runner.addresses[0][1], budget)
    finally:
        await runner.cleanup()
        await engine.cleanup()


def _head(*, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{framing}\r\n\r\n").encode()


def _body(size: int) -> bytes:
    """A JSON chat body of exactly ``size`` bytes."""
    start, end = b'{"model": "m", "pad": "', b'"}'
    return start + b"x" * (size - len(start) - len(end)) + end


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def _status(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of one answer (Content-Length framed, as the proxy's errors are)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_GUARD)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), HANG_GUARD)
    return int(lines[0].split()[1]), headers, body


async def test_a_request_whose_content_length_finds_no_room_is_refused_at_once(proxy: Proxy) -> None:
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        body = _body(80_000)
        writer.write(_head(length=len(body)) + body[:1000])  # the rest never comes: its share is held
        await eventually(lambda: proxy.budget.used == len(body), "the first body's Content-Length held")

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as http:
            async with http.post(proxy.url + CHAT, data=_body(40_000), headers={
                    "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}) as response:
                assert response.status == 503
                assert response.headers["Retry-After"] == "1"
                assert (await response.json())["error"]["code"] == BUSY_CODE
            # A small one still fits beside it.
            async with http.post(proxy.url + CHAT, data=_body(10_000), headers={
                    "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}) as response:
                assert response.status == 200, await response.text()
    finally:
        writer.close()  # the client goes away halfway through its body
    await eventually(lambda: proxy.budget.used == 0, "the abandoned body's share given back")


async def test_bodies_growing_without_a_length_never_wait_on_each_other(proxy: Proxy) -> None:
    first_reader, first = await asyncio.open_connection(proxy.host, proxy.port)
    second_reader, second = await asyncio.open_connection(proxy.host, proxy.port)
    body = _body(60_000)
    try:
        first.write(_head(length=None) + _chunk(body[:50_000]))
        await eventually(lambda: proxy.budget.used >= 50_000, "the first body's bytes held as they came")
        second.write(_head(length=None) + _chunk(b'{"model": "m", "pad": "' + b"y" * 30_000))
        await eventually(lambda: proxy.budget.used >= 80_000, "the second body's bytes held as they came")
        second.write(_chunk(b"y" * 30_000))  # past the budget: refused now, not made to wait
        status, headers, answer = await _status(second_reader)
        assert (status, headers["retry-after"]) == (503, "1") and BUSY_CODE.encode() in answer
        # The refused body's share is back, so the first one can finish.
        first.write(_chunk(body[50_000:]) + b"0\r\n\r\n")
        status, _, answer = await _status(first_reader)
        assert status == 200, answer
    finally:
        first.close()
        second.close()
    await eventually(lambda: proxy.budget.used == 0, "every share given back")


async def test_a_cancelled_request_gives_its_share_back(proxy: Proxy) -> None:
    _, writer = await asyncio.open_connection(proxy.host, proxy.port)
    writer.write(_head(length=None) + _chunk(b'{"model": "m", "pad": "' + b"z" * 20_000))
    await eventually(lambda: proxy.budget.used > 20_000, "the body's bytes held")
    writer.transport.abort()  # the handler is cancelled (serve: handler_cancellation) mid-read
    await eventually(lambda: proxy.budget.used == 0, "the cancelled request's share given back")


def _form(file_size: int) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("model", "m")
    form.add_field("file", b"\0" * file_size, filename="a.wav", content_type="audio/wav")
    return form


async def test_an_upload_holds_only_what_it_keeps_in_memory(proxy: Proxy) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as http:
        # Larger than the whole budget, yet it passes: past its first MiB the file is spooled to
        # disk and that MiB given back.
        proxy.budget.limit = 2 << 20
        async with http.post(proxy.url + "/v1/audio/transcriptions", data=_form(3 << 20),
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 200, await response.text()
        assert proxy.budget.used == 0
        # A budget with less room than that first MiB: refused while it is still in memory.
        proxy.budget.limit = BUDGET
        async with http.post(proxy.url + "/v1/audio/transcriptions", data=_form(3 << 20),
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == BUSY_CODE
    assert proxy.budget.used == 0


# ---------------------------------------------------------------- the management API shares it

async def test_the_management_api_draws_on_the_same_budget() -> None:
    budget = BodyBudget(BUDGET)
    runner = await serve(build_api(None, None, bodies=budget), host_port="127.0.0.1:0")  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/deployments"
    held = budget.lease()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as http:
            held.take(BUDGET - 1000)  # as a proxy request in flight would
            async with http.post(url, data=b'{"spec": {"pad": "' + b"x" * 5000 + b'"}}',
                                 headers={"Content-Type": "application/json"}) as response:
                assert response.status == 503 and response.headers["Retry-After"] == "1"
                assert (await response.json())["error"]["code"] == BUSY_CODE
            held.close()
            async with http.post(url, data=b'{"spec": {"pad": "' + b"x" * 5000 + b'"}}',
                                 headers={"Content-Type": "application/json"}) as response:
                assert response.status == 422  # read, and refused for what it says
                assert (await response.json())["error"]["code"] == "invalid_manifest"
    finally:
        held.close()
        await runner.cleanup()
    assert budget.used == 0


# ---------------------------------------------------------------- the setting

def test_the_budget_is_a_setting_with_a_default_applied_live(tmp_path) -> None:
    from capyctl import config_file
    from capyctl.config import BODIES_MEMORY_MAX_DEFAULT
    from capyctl.daemon import Daemon

    assert config_file.parse_config("", "x").bodies.memory_max == BODIES_MEMORY_MAX_DEFAULT == 256 << 20
    path = tmp_path / "config.yaml"
    path.write_text("bodies:\n  memory_max: 64MiB\n")
    config = config_file.build_config(path=path, required=True, overrides=config_file.Overrides())
    daemon = Daemon(config)
    assert daemon.bodies.limit == 64 << 20
    path.write_text("bodies:\n  memory_max: 32MiB\n")
    assert daemon.reload()["applied"] == ["bodies"]
    assert daemon.bodies.limit == 32 << 20
    path.write_text("bodies:\n  memory_max: 1KiB\n")  # under its floor: refused whole, as any bad file
    assert daemon.reload()["reloaded"] is False and daemon.bodies.limit == 32 << 20
