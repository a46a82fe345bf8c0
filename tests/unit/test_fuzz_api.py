"""Fuzzing the management API's request validation (hypothesis).

The API runs as the daemon builds it: ``build_api`` over a real Controller and a real Store
in a temporary directory. The Controller's systemd client is a stub that fails the test if
anything touches it: invalid input must be refused before the controller reaches systemd.
The fuzz stays on paths that fail before that (no registered engine, so no deployment can be
launched). Random methods, paths, headers and bodies must never get a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import string
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capyctl.api import build_api
from capyctl.config import DaemonConfig, Paths
from capyctl.controller import Controller
from capyctl.store import Store

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class SystemdMustNotBeCalled:
    """Stands where the D-Bus systemd client goes; any use is a test failure, recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        self.calls.append(name)
        raise AssertionError(f"systemd.{name} was used while handling invalid input")


class Api:
    """The management API on a test server, driven from one event loop across examples."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        # No llama-server on PATH: a deploy of engine llama.cpp must fail validation, not launch.
        monkeypatch.setenv("PATH", str(root / "empty-path"))
        self.runner = asyncio.Runner()
        self.systemd = SystemdMustNotBeCalled()
        state = root / "state"
        state.mkdir()
        self.store = Store(state / "state.db")
        config = DaemonConfig(paths=Paths(state_dir=state, runtime_dir=root / "run"))

        async def start() -> TestClient:
            self.controller = Controller(config, self.store, self.systemd)
            client = TestClient(TestServer(build_api(self.controller, self.store)))
            await client.start_server()
            return client

        self.client = self.runner.run(start())

    def request(self, method: str, path: str, *, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
        async def go() -> tuple[int, str, bytes]:
            async with self.client.request(method, path, data=body, headers=headers or {}) as r:
                return r.status, r.content_type, await r.read()
        return self.runner.run(go())

    def close(self) -> None:
        async def stop() -> None:
            await self.client.close()
            await self.controller.close()
        self.runner.run(stop())
        self.runner.close()
        self.store.close()


@pytest.fixture
def api(tmp_path, monkeypatch):
    instance = Api(tmp_path, monkeypatch)
    yield instance
    instance.close()
    assert instance.systemd.calls == []


# ---------------------------------------------------------------- strategies

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12)
# Manifests that look like deployments: the right keys with wrong or random values.
spec_like = st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.text(max_size=30), json_values),
    "engine": st.one_of(st.sampled_from(["llama.cpp", "vllm", "sglang", "tensorfold", "nope"]), json_values),
    "model": st.one_of(st.fixed_dictionaries({"path": st.text(max_size=30)}),
                       st.fixed_dictionaries({"hf": st.text(max_size=30)}), json_values),
    "queue": json_values, "timeouts": json_values, "resources": json_values, "aliases": json_values,
    "engine_args": json_values, "park": json_values, "kind": json_values,
})
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"spec": spec_like}, optional={"activate": json_values, "wait": json_values})
    .map(lambda v: json.dumps(v).encode()),
)
names = st.text(alphabet=string.ascii_letters + string.digits + "-_.", min_size=1, max_size=20)
known_paths = st.one_of(
    st.sampled_from(["/v1/health", "/v1/deployments", "/v1/engines", "/v1/keys"]),
    names.map(lambda n: f"/v1/deployments/{n}"),
    st.tuples(names, st.sampled_from(["park", "wake", "stop", "logs"])).map(lambda t: f"/v1/deployments/{t[0]}/{t[1]}"),
    names.map(lambda n: f"/v1/engines/{n}"),
    names.map(lambda n: f"/v1/keys/{n}"),
)
random_paths = st.text(alphabet=string.ascii_letters + string.digits + "-._~/", max_size=40).map(
    lambda p: "/" + p.lstrip("/"))  # "//host" would read as a URL with a host, not a path
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
header_text = st.text(alphabet=string.ascii_letters + string.digits + " -_=;,./:", max_size=40)
headers = st.dictionaries(st.sampled_from(["Content-Type", "Accept", "Idempotency-Key", "X-Anything",
                                           "Content-Encoding"]), header_text, max_size=3)


def _no_server_error(status: int, content_type: str, raw: bytes, what: str) -> None:
    assert status < 500, f"{what} -> {status}: {raw[:300]!r}"
    if content_type == "application/json" and status >= 400:
        error = json.loads(raw)["error"]
        assert error["code"] and error["code"] == error["code"].lower() and " " not in error["code"]
        assert error["message"]


# ---------------------------------------------------------------- fuzz

@FUZZ
@given(method=methods, path=st.one_of(known_paths, random_paths), body=st.none() | bodies, extra=headers)
def test_no_request_gets_a_server_error_or_reaches_systemd(api, method, path, body, extra):
    if path.startswith("/v1/engines") and method == "POST":
        return  # engine detection may run a found binary; its own tests cover it
    status, content_type, raw = api.request(method, path, body=body, headers=extra)
    _no_server_error(status, content_type, raw, f"{method} {path} {body!r:.80}")
    assert api.systemd.calls == []


@FUZZ
@given(body=bodies)
def test_random_deployment_bodies_are_refused_before_anything_is_recorded(api, body):
    status, content_type, raw = api.request("POST", "/v1/deployments", body=body)
    _no_server_error(status, content_type, raw, f"POST /v1/deployments {body!r:.80}")
    if status == 200:
        # The answer streams NDJSON; with no engine registered the last event is an error.
        last = json.loads(raw.decode().splitlines()[-1])
        assert last["event"] == "error" and last["error"]["code"] == "engine_not_found", last
    assert api.store.list_deployments() == []
    assert api.controller.actors == {}
    assert api.systemd.calls == []


@FUZZ
@given(body=st.one_of(st.binary(max_size=100), json_values.map(lambda v: json.dumps(v).encode())),
       detect_path=st.text(max_size=30))
def test_random_engine_and_key_bodies_are_refused_or_stored_sanely(api, body, detect_path):
    # Engines: random specs, and detection of paths that are relative or do not exist.
    for payload in (body, json.dumps({"path": detect_path}).encode(),
                    json.dumps({"path": f"/nonexistent/{detect_path}"}).encode()):
        status, content_type, raw = api.request("POST", "/v1/engines", body=payload)
        _no_server_error(status, content_type, raw, f"POST /v1/engines {payload!r:.80}")
    status, content_type, raw = api.request("POST", "/v1/keys", body=body)
    _no_server_error(status, content_type, raw, f"POST /v1/keys {body!r:.80}")
    if status == 201:
        assert json.loads(raw)["key"]  # a key made from a random body is still a key


# ---------------------------------------------------------------- the examples the fuzz is about

def test_a_manifest_that_fails_validation_names_its_fields(api):
    status, _, raw = api.request("POST", "/v1/deployments", body=json.dumps(
        {"spec": {"name": "ok", "engine": "llama.cpp", "model": {"path": "/m.gguf"}, "queue": -1}}).encode())
    error = json.loads(raw)["error"]
    assert status == 422 and error["code"] == "invalid_manifest"
    assert [p["field"] for p in error["detail"]["problems"]] == ["queue"]


def test_invalid_json_is_invalid_json(api):
    status, _, raw = api.request("POST", "/v1/deployments", body=b"{not json")
    assert (status, json.loads(raw)["error"]["code"]) == (400, "invalid_json")


def test_a_body_that_is_not_utf8_is_invalid_json(api):
    status, _, raw = api.request("POST", "/v1/deployments", body=b"\xff\xfe{}")
    assert (status, json.loads(raw)["error"]["code"]) == (400, "invalid_json")


def test_an_oversized_body_is_413_with_a_code(api):
    status, content_type, raw = api.request("POST", "/v1/deployments", body=b"{" + b" " * (5 << 20) + b"}")
    assert status == 413
    assert content_type == "application/json", f"413 answered as {content_type}: {raw[:200]!r}"
    assert json.loads(raw)["error"]["code"] == "request_too_large"
