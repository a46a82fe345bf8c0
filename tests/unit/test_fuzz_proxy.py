"""Fuzzing the proxy (hypothesis): random methods, paths, headers and bodies.

The proxy runs as the daemon serves it (``serve``: aiohttp's server, its limits as the daemon
sets them), with a fake Router (the controller is not under test). Its one model cannot be
woken: admission answers the documented 503 ``wake_failed``, so every request that passes
validation ends there, and no engine is needed. Asserted: no
5xx other than that 503, every error in the OpenAI shape with a stable code, and admission
never asked for a request the proxy should have refused first.
"""

from __future__ import annotations

import asyncio
import json
import string
from contextlib import asynccontextmanager
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capyctl.errors import Unavailable
from capyctl.proxy import DoorSettings, KeyGrant, ModelEntry, StaticKeys, Upstream, build_app, serve
from capyctl.proxy._routes import FORM_ROUTES, JSON_ROUTES, SYSTEMONE_ROUTE

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
KEY, SCOPED_KEY = "sk-fuzz", "sk-only-other"
MODEL = "m"
MAX_BODY = 64 * 1024
MAX_UPLOAD = 128 * 1024
# Every POST route that reads a model from its body (JSON or form) and then asks for admission.
ADMITTING_ROUTES = (*JSON_ROUTES, *FORM_ROUTES, SYSTEMONE_ROUTE)


class UnwakeableRouter:
    """One model, parked, whose wake fails: the documented 503 for anything admitted."""

    def __init__(self) -> None:
        self.admitted: list[str] = []

    def models(self) -> list[ModelEntry]:
        return [ModelEntry(id=MODEL, deployment=MODEL, state="parked", engine="llama.cpp", created=0)]

    @asynccontextmanager
    async def acquire(self, model: str) -> AsyncIterator[Upstream]:
        self.admitted.append(model)
        raise Unavailable(f"deployment {model!r} could not be woken: fuzzing", code="wake_failed")
        yield  # pragma: no cover - never reached; makes this an async generator

    def stats(self) -> dict[str, dict[str, float]]:
        return {MODEL: {"queue_depth": 0, "in_flight": 0}}


class Proxy:
    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.router = UnwakeableRouter()
        keys = StaticKeys({KEY: KeyGrant("fuzz"), SCOPED_KEY: KeyGrant("scoped", models=frozenset({"other"}))})

        async def start() -> tuple[web.AppRunner, aiohttp.ClientSession]:
            runner = await serve(build_app(self.router, keys, max_body=MAX_BODY, max_upload=MAX_UPLOAD),
                                 host_port="127.0.0.1:0", door=DoorSettings())  # as the daemon serves it
            host, port = runner.addresses[0][:2]
            return runner, aiohttp.ClientSession(base_url=f"http://{host}:{port}")

        self.server, self.client = self.runner.run(start())

    def request(self, method: str, path: str, *, body: bytes | None, headers: dict[str, str]):
        async def go():
            try:
                async with self.client.request(method, path, data=body, headers=headers) as r:
                    return r.status, r.content_type, await r.read()
            except aiohttp.ClientResponseError as exc:
                # aiohttp's client refuses a HEAD answer that carries a body (the parser's 400
                # below); the status is what the server said.
                return exc.status, "unreadable", b""
        return self.runner.run(go())

    def close(self) -> None:
        self.runner.run(self.client.close())
        self.runner.run(self.server.cleanup())
        self.runner.close()


@pytest.fixture
def proxy():
    instance = Proxy()
    yield instance
    instance.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12)
question = st.fixed_dictionaries({"type": st.sampled_from(["noul", "choice", "score", "bogus"]) | json_values},
                                 optional={"instructions": json_values, "criteria": json_values})
openai_like = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([MODEL, "other", ""]) | json_values,
    "messages": json_values, "stream": json_values, "max_tokens": json_values,
    "state": json_values, "questions": st.dictionaries(st.text(max_size=8), question, max_size=3) | json_values,
})
bodies = st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode()),
                   openai_like.map(lambda v: json.dumps(v).encode()))
routes = st.sampled_from(["/health", "/metrics", "/v1/models", *ADMITTING_ROUTES, "/v1/responses/resp_1",
                          "/sleep", "/wake_up", "/props", "/slots", "/v1/../sleep", "/release_memory_occupation",
                          "/collective_rpc", "/v1/messages/render", "/v1/decisions", "/tokenizer_info"])
random_paths = st.text(alphabet=string.ascii_letters + string.digits + "-._~/", max_size=40).map(
    lambda p: "/" + p.lstrip("/"))  # "//host" would read as a URL with a host, not a path
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
header_text = st.text(alphabet=string.ascii_letters + string.digits + " -_=;,./:", max_size=40)
authorization = st.one_of(st.just(f"Bearer {KEY}"), st.just(f"Bearer {SCOPED_KEY}"), st.just(f"bearer  {KEY} "),
                          header_text, st.just("Bearer "), st.just(KEY))
headers = st.fixed_dictionaries({}, optional={
    "Authorization": authorization,
    "Content-Type": st.sampled_from(["application/json", "text/plain", "multipart/form-data"]) | header_text,
    "Accept": header_text, "X-Forwarded-For": header_text, "Content-Encoding": st.sampled_from(["gzip", "br", "x"]),
})


def _check(status: int, content_type: str, raw: bytes, what: str, *,
           parser_may_refuse: bool = False) -> dict | None:
    assert status < 500 or status == 503, f"{what} -> {status}: {raw[:300]!r}"
    if parser_may_refuse and status == 400 and content_type != "application/json":
        # aiohttp's HTTP parser answers a Content-Encoding it cannot decode before any handler
        # or middleware runs, in text/plain; the proxy never sees that request.
        return None
    if status >= 400 and raw:
        assert content_type == "application/json", f"{what} -> {status} as {content_type}: {raw[:200]!r}"
        error = json.loads(raw)["error"]
        assert error["code"] and error["code"] == error["code"].lower() and " " not in error["code"]
        assert error["message"]
        return error
    return None


@FUZZ
@given(method=methods, path=st.one_of(routes, random_paths), body=st.none() | bodies, extra=headers)
def test_no_request_gets_a_server_error_other_than_the_documented_503(proxy, method, path, body, extra):
    before = len(proxy.router.admitted)
    status, content_type, raw = proxy.request(method, path, body=body, headers=extra)
    error = _check(status, content_type, raw, f"{method} {path} {extra} {body!r:.80}",
                   parser_may_refuse="Content-Encoding" in extra)
    admitted = proxy.router.admitted[before:]
    if status == 503:
        # this router admits whatever model name a keyed, well-formed request asks for
        assert error["code"] == "wake_failed" and len(admitted) == 1
    if admitted:
        # Only a keyed, well-formed request for the one model it may use gets as far as admission.
        assert extra.get("Authorization", "").split() == ["Bearer", KEY] or \
            extra.get("Authorization", "").lower().split() == ["bearer", KEY.lower()]
        assert method == "POST" and path in ADMITTING_ROUTES


@FUZZ
@given(route=st.sampled_from([*JSON_ROUTES, SYSTEMONE_ROUTE]), body=bodies)
def test_keyed_random_bodies_are_refused_or_admitted_never_a_server_error(proxy, route, body):
    before = len(proxy.router.admitted)
    status, content_type, raw = proxy.request("POST", route, body=body, headers={"Authorization": f"Bearer {KEY}"})
    error = _check(status, content_type, raw, f"POST {route} {body!r:.80}")
    admitted = proxy.router.admitted[before:]
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("model"), str) or not parsed["model"]:
        assert admitted == [] and status == 400 and error["code"] in ("invalid_json", "missing_model")
    if status == 404:  # a route is refused only for a model the key may not use or that does not exist
        assert admitted in ([], [parsed["model"]]) and error["code"] == "model_not_found"
    if admitted:
        assert status == 503
    if route == "/v1/systemone" and status in (400, 422) and error["code"] not in ("invalid_json", "missing_model"):
        assert admitted == []  # a bad decision request wakes nothing


def test_oversized_body_is_413_and_admits_nothing(proxy):
    status, content_type, raw = proxy.request("POST", "/v1/chat/completions", body=b"{" + b" " * MAX_BODY + b"}",
                                              headers={"Authorization": f"Bearer {KEY}"})
    assert (status, _check(status, content_type, raw, "oversized")["code"]) == (413, "request_too_large")
    assert proxy.router.admitted == []


def test_chunked_oversized_body_is_413(proxy):
    async def chunks():
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024

    async def go():
        async with proxy.client.post("/v1/chat/completions", data=chunks(),
                                     headers={"Authorization": f"Bearer {KEY}"}) as r:
            return r.status, r.content_type, await r.read()
    status, content_type, raw = proxy.runner.run(go())
    assert (status, _check(status, content_type, raw, "chunked oversized")["code"]) == (413, "request_too_large")


def test_a_body_that_is_not_utf8_is_invalid_json(proxy):
    status, content_type, raw = proxy.request("POST", "/v1/chat/completions", body=b"\xff\xfe{}",
                                              headers={"Authorization": f"Bearer {KEY}"})
    assert (status, _check(status, content_type, raw, "not utf-8")["code"]) == (400, "invalid_json")


# ---------------------------------------------------------------- multipart forms (/v1/audio/transcriptions)

form_fields = st.lists(st.tuples(st.sampled_from(["model", "file", "language", "prompt", "x", ""]),
                                 st.one_of(st.text(max_size=30), st.sampled_from([MODEL, "other"])),
                                 st.booleans()),  # sent as a file part?
                       max_size=5)


def _form(fields) -> aiohttp.FormData:
    form = aiohttp.FormData()
    for name, value, as_file in fields:
        if as_file:
            form.add_field(name, value.encode(), filename="a.wav", content_type="audio/wav")
        else:
            form.add_field(name, value)
    return form


@FUZZ
@given(fields=form_fields, raw=st.none() | st.binary(max_size=300),
       boundary=st.sampled_from(["", "; boundary=xyz", "; boundary=", '; boundary="a b"']))
def test_random_forms_are_refused_or_admitted_never_a_server_error(proxy, fields, raw, boundary):
    before = len(proxy.router.admitted)

    async def go():
        if raw is None:
            data, headers = _form(fields), {"Authorization": f"Bearer {KEY}"}
        else:  # bytes that claim to be a form
            data, headers = raw, {"Authorization": f"Bearer {KEY}", "Content-Type": "multipart/form-data" + boundary}
        async with proxy.client.post("/v1/audio/transcriptions", data=data, headers=headers) as r:
            return r.status, r.content_type, await r.read()
    status, content_type, body = proxy.runner.run(go())
    error = _check(status, content_type, body, f"form {fields!r:.100} {raw!r:.60}")
    admitted = proxy.router.admitted[before:]
    text_models = [value for name, value, as_file in fields if name == "model" and not as_file]
    multipart = raw is None and any(as_file for _, _, as_file in fields)  # else aiohttp sends it urlencoded
    if multipart and any(name == "" for name, _, _ in fields):
        assert (status, error["code"], admitted) == (400, "invalid_form", [])  # a part without a name
        return
    if multipart and text_models and text_models[0].strip():
        # The first text field named model selects the deployment (this router admits any name).
        assert (status, admitted) == (503, [text_models[0].strip()]), error
    else:
        assert admitted == [] and status in (400, 413), error


def test_an_oversized_upload_is_413_before_admission(proxy):
    form = aiohttp.FormData()
    form.add_field("model", MODEL)
    form.add_field("file", b"\0" * (MAX_UPLOAD + 1), filename="a.wav", content_type="audio/wav")

    async def go(data):
        async with proxy.client.post("/v1/audio/transcriptions", data=data,
                                     headers={"Authorization": f"Bearer {KEY}"}) as r:
            return r.status, r.content_type, await r.read()
    status, content_type, raw = proxy.runner.run(go(form))
    assert (status, _check(status, content_type, raw, "oversized form")["code"]) == (413, "request_too_large")
    assert proxy.router.admitted == []
