"""A descriptor shortage is the daemon's own (capyctl/descriptors.py, issue 45): told apart from an
engine's fault wherever the daemon reaches engines, never counted against the engine, and the
descriptor limit checked against the connection cap at start.

The proxy test runs out of descriptors for real: the test process's own soft RLIMIT_NOFILE is
lowered (and restored) while a client's connection is already open, so the proxy can read the
request but not open a connection to the engine.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.client_exceptions import UnixClientConnectorError
from aiohttp.client_reqrep import ConnectionKey

from capyctl import descriptors
from capyctl.controller._launch import wait_healthy
from capyctl.controller._liveness import Watchdog
from capyctl.descriptors import (CONNECTIONS_MIN, SHORTAGE_CODE, ConnectionPlan, descriptors_needed, is_shortage,
                                 plan_connections, shortage_error)
from capyctl.engines._base import EngineAdapter
from capyctl.errors import CapyError
from capyctl.proxy import KeyGrant, StaticKeys, Upstream, build_app, serve
from capyctl.proxy._engine_side import EngineConnectionError
from tests.unit.test_proxy import HANG_GUARD, FakeRouter

KEY = "sk-test"


def _raised_from(outer: type[BaseException], inner: BaseException, *args) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer(*args) from exc
    except BaseException as wrapped:
        return wrapped


# What aiohttp's connector names the connection by (aiohttp/client_reqrep.py).
KEY_OF = ConnectionKey("127.0.0.1", 1, False, True, None, None, None)
EMFILE = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
ENFILE = OSError(errno.ENFILE, os.strerror(errno.ENFILE))


@pytest.mark.parametrize("exc", [
    EMFILE,
    ENFILE,
    # aiohttp's connector wraps the OSError, copying its errno (aiohttp/client_exceptions.py).
    aiohttp.ClientConnectorError(KEY_OF, EMFILE),
    UnixClientConnectorError("/run/x.sock", KEY_OF, ENFILE),
    # the proxy's engine client raises its own error from the OSError (_engine_pool.EnginePool._connect)
    _raised_from(EngineConnectionError, EMFILE, "cannot connect to /run/x.sock: Too many open files"),
    shortage_error("do a thing"),
], ids=["EMFILE", "ENFILE", "aiohttp-tcp", "aiohttp-unix", "engine-client", "already-ours"])
def test_a_shortage_is_recognised_however_it_is_wrapped(exc: BaseException) -> None:
    assert is_shortage(exc)


@pytest.mark.parametrize("exc", [
    OSError(errno.ECONNREFUSED, "refused"),
    aiohttp.ClientConnectorError(KEY_OF, OSError(errno.ENOENT, "no socket")),
    _raised_from(EngineConnectionError, OSError(errno.ECONNRESET, "reset"), "the engine closed the connection"),
    TimeoutError(),
    CapyError("no", code="engine_unreachable", status=502),
    None,
], ids=["refused", "no-socket", "reset", "timeout", "engine-unreachable", "none"])
def test_an_engines_own_failure_is_not_a_shortage(exc: BaseException | None) -> None:
    assert not is_shortage(exc)


def test_the_shortage_error_is_a_503_with_retry_after_and_is_logged_once_in_a_while(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(descriptors, "_throttle", descriptors._Throttle())
    with caplog.at_level(logging.WARNING, logger="capyctl"):
        errors = [shortage_error("connect to the engine of 'x'") for _ in range(3)]
    assert {(e.code, e.status, e.retry_after) for e in errors} == {(SHORTAGE_CODE, 503, 1.0)}
    assert "engine is not at fault" in errors[0].message
    warnings = [r.getMessage() for r in caplog.records if "ran out of file descriptors" in r.getMessage()]
    assert len(warnings) == 1 and "LimitNOFILE" in warnings[0]


# ---------------------------------------------------------------- the proxy, out of descriptors for real

@contextmanager
def no_descriptor_left() -> Iterator[None]:
    """This process cannot open one more descriptor until the block ends: its soft limit is
    lowered to its lowest free descriptor number (open ones above stay usable)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)  # a new descriptor takes the lowest free number
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("front", ["front", "aiohttp-server"])
async def test_a_proxy_out_of_descriptors_answers_its_own_503_and_does_not_blame_the_engine(
        front: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if front != "front":
        monkeypatch.setenv("CAPYCTL_PROXY_FRONT", "aiohttp")

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"object": "chat.completion", "choices": []})

    engine_app = web.Application()
    engine_app.router.add_post("/v1/chat/completions", answer)
    engine_app.router.add_post("/v1/audio/transcriptions", answer)
    engine_runner = await serve(engine_app, host_port="127.0.0.1:0")
    engine_port = engine_runner.addresses[0][1]
    router = FakeRouter({"m": Upstream("dep", f"http://127.0.0.1:{engine_port}", None, "custom",
                                       frozenset({"chat", "transcriptions"}))})
    proxy_runner = await serve(build_app(router, StaticKeys({KEY: KeyGrant("k")})), host_port="127.0.0.1:0")
    proxy_url = "http://127.0.0.1:%d" % proxy_runner.addresses[0][1]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        # One connection, kept alive: open before the shortage, so the request still reaches the proxy.
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as http:
            async with http.get(proxy_url + "/health") as response:
                assert response.status == 200
                await response.read()
            with no_descriptor_left():
                async with http.post(proxy_url + "/v1/chat/completions", json=chat, headers=headers) as response:
                    status, retry_after, body = response.status, response.headers.get("Retry-After"), \
                        await response.json()
            assert (status, body["error"]["code"], retry_after) == (503, SHORTAGE_CODE, "1"), body
            assert router.lost_asked == []  # no host-loss check for the daemon's own shortage
            assert router.in_flight == 0
            async with http.post(proxy_url + "/v1/chat/completions", json=chat, headers=headers) as response:
                assert response.status == 200, await response.text()  # served again once descriptors are back
            # An upload past what is kept in memory needs a spool file: none to be had is the same 503.
            form = aiohttp.FormData()
            form.add_field("model", "m")
            form.add_field("file", b"\0" * (2 << 20), filename="a.wav", content_type="audio/wav")
            with no_descriptor_left():
                async with http.post(proxy_url + "/v1/audio/transcriptions", data=form, headers=headers) as response:
                    status, body = response.status, await response.json()
            assert (status, body["error"]["code"]) == (503, SHORTAGE_CODE), body
    finally:
        await proxy_runner.cleanup()
        await engine_runner.cleanup()


# ---------------------------------------------------------------- the controller's probes

class Session:
    """An aiohttp session whose every request fails to connect with ``error``."""

    def __init__(self, error: OSError) -> None:
        self.error = error

    def get(self, *args, **kwargs):
        raise aiohttp.ClientConnectorError(KEY_OF, self.error)

    request = get


class Adapter(EngineAdapter):
    """EngineAdapter's own health probe, which every adapter uses."""

    kind = "test"

    def build_launch(self, ctx):  # (abstract; never launched here)
        raise NotImplementedError


async def test_a_health_probe_the_daemon_could_not_make_is_not_an_unhealthy_engine() -> None:
    adapter = Adapter()
    with pytest.raises(CapyError) as raised:
        await adapter.health(Session(EMFILE), "http://127.0.0.1:1", None)  # type: ignore[arg-type]
    assert (raised.value.code, raised.value.status) == (SHORTAGE_CODE, 503)
    assert await adapter.health(Session(OSError(errno.ECONNREFUSED, "refused")),  # type: ignore[arg-type]
                                "http://127.0.0.1:1", None) is False


async def test_an_engine_control_call_the_daemon_could_not_make_is_not_engine_unreachable() -> None:
    from capyctl.engines._base import call
    from capyctl.errors import EngineError
    with pytest.raises(EngineError) as raised:  # (callers that tolerate an engine call's failure still do)
        await call(Session(ENFILE), "POST", "http://127.0.0.1:1", "/sleep", None,  # type: ignore[arg-type]
                   code="park_failed", what="parking")
    assert (raised.value.code, raised.value.status) == (SHORTAGE_CODE, 503)
    with pytest.raises(EngineError) as raised:
        await call(Session(OSError(errno.ECONNREFUSED, "refused")), "POST", "http://127.0.0.1:1",  # type: ignore[arg-type]
                   "/sleep", None, code="park_failed", what="parking")
    assert raised.value.code == "engine_unreachable"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


async def test_the_watchdog_does_not_count_a_shortage_as_the_engines_silence() -> None:
    """A shortage far longer than the deadline, then a real hang: only the hang is counted."""
    clock, deadline = FakeClock(), 3.0
    shortage_ends = clock.now + 60 * deadline

    async def probe() -> bool:
        if clock.now < shortage_ends:
            raise shortage_error("probe the engine's health")
        return False  # then the engine is silent for real

    watchdog = Watchdog(probe, deadline, clock=clock, sleep=clock.sleep)
    silent = await asyncio.wait_for(watchdog.watch(), HANG_GUARD)
    # Declared only after the engine's own silence (its first round may begin in the shortage's last pause).
    assert clock.now - shortage_ends >= deadline - watchdog.interval
    assert deadline <= silent < 2 * deadline  # the shortage's minutes are not in it
    assert watchdog.discounted >= 60


async def test_a_start_waits_on_through_a_shortage_instead_of_failing() -> None:
    answers = iter([shortage_error("probe the engine's health"), shortage_error("probe the engine's health"), True])

    class Probe:
        calls = 0

        async def health(self, http, base_url, key) -> bool:
            self.calls += 1
            answer = next(answers)
            if isinstance(answer, BaseException):
                raise answer
            return answer

    probe = Probe()
    await asyncio.wait_for(wait_healthy(probe, None, "http://x", None, exited=asyncio.Event(),
                                        exit_error=lambda: CapyError("exited"), timeout=HANG_GUARD,
                                        progress=lambda line: None), HANG_GUARD)
    assert probe.calls == 3


# ---------------------------------------------------------------- the limit against the caps

def test_a_cap_that_fits_the_limit_is_kept() -> None:
    plan = plan_connections(1024, limit=16384)
    assert plan == ConnectionPlan(limit=16384, asked=1024, connections_max=1024) and not plan.lowered
    assert descriptors_needed(1024) <= 16384


def test_a_cap_too_large_for_the_limit_is_lowered_with_a_warning_naming_the_setting(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="capyctl"):
        plan = plan_connections(1024, limit=1024)
    assert plan.lowered and descriptors_needed(plan.connections_max) <= 1024 < descriptors_needed(plan.connections_max + 1)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "door.connections_max=1024" in warning and "LimitNOFILE=" in warning
    assert f"at most {plan.connections_max} client connections" in warning


def test_a_limit_too_low_for_even_a_few_connections_refuses_the_start() -> None:
    with pytest.raises(CapyError) as raised:
        plan_connections(1024, limit=descriptors_needed(CONNECTIONS_MIN) - 1)
    assert raised.value.code == "descriptor_limit_too_low" and "LimitNOFILE=" in raised.value.message
    assert plan_connections(1024, limit=descriptors_needed(CONNECTIONS_MIN)).connections_max == CONNECTIONS_MIN


def _python(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (its rlimits are its own); the JSON it prints last."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_daemon_raises_its_soft_limit_to_the_hard_one() -> None:
    result = _python(
        "import json, resource\n"
        "from capyctl.descriptors import raise_soft_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "print(json.dumps({'raised': raise_soft_limit(), 'now': resource.getrlimit(resource.RLIMIT_NOFILE)}))\n")
    assert result["raised"] == result["now"] and result["now"][0] == result["now"][1]


def test_the_daemon_refuses_to_start_under_a_limit_too_low(tmp_path) -> None:
    result = _python(
        "import asyncio, json, resource\n"
        "from capyctl.config import DaemonConfig\n"
        "from capyctl.daemon import Daemon\n"
        "from capyctl.errors import CapyError\n"
        "from capyctl.descriptors import CONNECTIONS_MIN, descriptors_needed\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors_needed(CONNECTIONS_MIN) - 1, hard))\n"
        "try:\n"
        "    asyncio.run(Daemon(DaemonConfig(bus_address='unix:path=/nonexistent')).start())\n"
        "    print(json.dumps({'code': None}))\n"
        "except CapyError as exc:\n"
        "    print(json.dumps({'code': exc.code}))\n",
        # (Were the check missing, the start would go on: somewhere harmless, and to no bus.)
        env={"CAPYCTL_STATE_DIR": str(tmp_path / "state"), "CAPYCTL_RUNTIME_DIR": str(tmp_path / "run")})
    assert result == {"code": "descriptor_limit_too_low"}
