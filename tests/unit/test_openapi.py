"""The OpenAPI 3.1 descriptions (GET /openapi.json on the management API and on the proxy), and
schemathesis against the management API's: every answer's status must be one the description
lists for that operation, with the content type and body schema it lists.

The API runs as the daemon builds it (``build_api`` over a real Controller and Store, with
credentials, so every request carries the admin token as ``Authorization: Bearer``), on a real
TCP port in a thread of its own, because schemathesis sends real HTTP requests. Its systemd is a
stub that answers nothing: no engine is registered, so nothing can be launched.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import HealthCheck, Phase, assume, given, settings

from capyctl.api import Credentials, build_api
from capyctl.api._openapi import management_openapi
from capyctl.config import DaemonConfig, Paths
from capyctl.controller import Controller
from capyctl.store import Store
from tests.components import require_module


def _schemathesis():
    """schemathesis, which only the tests that fuzz or load a description with it need; else skip
    (fail under CI=true: scripts/setup installs the test extra, schemathesis with it)."""
    return require_module("schemathesis", "it is in the test extra: pip install -e '.[test]' (scripts/setup does)")

# Operations schemathesis does not call, and why.
NOT_FUZZED = {
    # The event stream never ends: a client reads it until it goes away (test_dashboard.py reads it).
    ("GET", "/v1/events"),
    # Engine detection runs the binary at the path it is given, and a registered engine would let
    # a later generated deployment launch; the hypothesis fuzz (test_fuzz_api.py) covers its refusals.
    ("POST", "/v1/engines"),
    # Adding a host opens an SSH connection to the address it is given.
    ("POST", "/v1/hosts"),
}
# aiohttp adds HEAD to every GET; /ui and /ui/{file} are the dashboard's redirect and static files.
NOT_DESCRIBED = {("GET", "/ui"), ("GET", "/ui/{file}")}


class NoSystemd:
    """Where the D-Bus client goes: nothing may reach it (no engine is registered)."""

    def __getattr__(self, name: str):
        raise AssertionError(f"systemd.{name} was used")


class LiveApi:
    """The management API on 127.0.0.1:<port>, served by an event loop in a thread."""

    def __init__(self, root: Path) -> None:
        state = root / "state"
        state.mkdir()
        self.store = Store(state / "state.db")
        self.credentials = Credentials(state / "credentials")
        self.admin_token = self.credentials.admin_token_path.read_text().strip()
        self.config = DaemonConfig(paths=Paths(state_dir=state, runtime_dir=root / "run"))
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "the API did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.controller = Controller(self.config, self.store, NoSystemd())
            self.runner = web.AppRunner(build_api(self.controller, self.store, self.credentials))
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
            self.ready.set()
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            await self.runner.cleanup()
            await self.controller.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.store.close()


@pytest.fixture
def live_api(tmp_path, monkeypatch):
    # No llama-server on PATH: a deployment of engine kind llama.cpp fails validation, not launches.
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    api = LiveApi(tmp_path)
    yield api
    api.close()


def test_the_description_is_openapi_3_1_and_describes_every_route(live_api):
    with urllib.request.urlopen(f"{live_api.url}/openapi.json") as response:  # no credential needed
        served = json.load(response)
    assert served == json.loads(json.dumps(management_openapi()))
    assert served["openapi"] == "3.1.0"
    described = {(method.upper(), path) for path, ops in served["paths"].items() for method in ops}
    app = build_api(live_api.controller, live_api.store, live_api.credentials)
    registered = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    missing = registered - described - NOT_DESCRIBED
    assert not missing, f"routes without a description in capyctl/api/_openapi.py: {sorted(missing)}"
    assert not described - registered, "described routes that are not served"
    # The manifests' own models describe the bodies.
    assert "DeploymentSpec" in served["components"]["schemas"]
    for path, ops in served["paths"].items():
        for method, op in ops.items():
            if op.get("security") != [{}]:
                assert "401" in op["responses"], f"{method} {path} does not document 401"


FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "host", "connection", "expect"})


def test_schemathesis_finds_no_undocumented_status(live_api):
    schemathesis = _schemathesis()
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        ignored_auth,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_dict(management_openapi())
    auth = {"Authorization": f"Bearer {live_api.admin_token}"}
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              ignored_auth]
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) in NOT_FUZZED:
            continue
        fuzzed.append(f"{operation.method.upper()} {operation.path}")
        strategy = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(GenerationMode.NEGATIVE)

        @settings(max_examples=30, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def call(case) -> None:
            # Headers that frame the HTTP message are aiohttp's parser's to refuse (400) before any
            # route runs; a negative case that makes one up ("content-length: :{") tests aiohttp.
            assume(not {name.lower() for name in (case.headers or {})} & FRAMING_HEADERS)
            case.call_and_validate(base_url=live_api.url, headers=auth, checks=checks, timeout=30)

        call()
    assert len(fuzzed) >= 20, fuzzed


async def test_the_proxy_serves_its_own_description_without_a_key():
    from aiohttp.test_utils import TestClient, TestServer

    from capyctl.proxy import KeyGrant, StaticKeys, build_app
    from capyctl.proxy._openapi import proxy_openapi

    app = build_app(router=object(), keys=StaticKeys({"capy-test": KeyGrant("test", None)}))  # type: ignore[arg-type]
    described = {(method.upper(), path.replace("{id}", "{response_id}"))
                 for path, ops in proxy_openapi()["paths"].items() for method in ops}
    registered = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert registered == described, f"undescribed: {registered - described}, not served: {described - registered}"
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/openapi.json")
        assert response.status == 200
        served = await response.json()
        assert served == json.loads(json.dumps(proxy_openapi()))
        assert served["openapi"] == "3.1.0" and "/v1/chat/completions" in served["paths"]
        assert (await client.get("/v1/models")).status == 401  # the rest still needs a key


def test_schemathesis_loads_every_operation_of_the_proxys_description():
    from capyctl.proxy._openapi import proxy_openapi

    served = json.loads(json.dumps(proxy_openapi()))  # what GET /openapi.json serves (the test above)
    schema = _schemathesis().openapi.from_dict(served)
    # .ok() raises where an operation cannot be loaded (a broken $ref, an invalid parameter).
    loaded = {(result.ok().method.upper(), result.ok().path) for result in schema.get_all_operations()}
    assert loaded == {(method.upper(), path) for path, ops in served["paths"].items() for method in ops}
