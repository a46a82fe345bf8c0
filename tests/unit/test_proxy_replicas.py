"""The proxy and a model with replicas (issue 46): the Router is handed the request's prompt (to
route by prefix) and the replica a stored response lives on (to read or continue it there); a model
with one engine gets neither, so a Router with the old signatures still works.

The engine is test_proxy_routes' FakeEngine, reached through one Upstream per replica that differ
by their launch key: the key the engine saw tells which replica a request reached. The Router is
test_proxy's FakeRouter with replicas and admission calls that record their keyword arguments.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web

from capyctl.proxy import KeyGrant, ModelEntry, StaticKeys, Upstream, build_app
from capyctl.proxy._prompt_prefix import routing_prompt
from tests.unit.test_proxy import HANG_GUARD, FakeRouter, _start
from tests.unit.test_proxy_routes import FakeEngine

KEY = "sk-admin"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAPABILITIES = frozenset({"chat", "completions", "responses", "responses_get", "responses_delete", "messages",
                          "embeddings"})
SEP = "\x1e"  # _prompt_prefix's separator between messages


def launch_key(replica: str) -> str:
    return f"key-{replica}"


class ReplicaRouter(FakeRouter):
    """Model "chat" has two replicas, "chat" and "chat@2"; model "solo" has one. A request pinned to a
    replica goes there; one not pinned goes to ``unpinned`` (as the Controller's choice by prefix and
    load would, here the test's). Every admission call is recorded with its keyword arguments."""

    def __init__(self, engine_url: str) -> None:
        self.replicas = {name: Upstream(name, engine_url, launch_key(name), "llama.cpp", CAPABILITIES)
                         for name in ("chat", "chat@2", "solo")}
        super().__init__({"chat": self.replicas["chat"], "solo": self.replicas["solo"]})
        self.counts = {"chat": 2, "solo": 1}
        self.unpinned = "chat"
        self.calls: list[tuple[str, str, dict[str, Any]]] = []  # (try_acquire | acquire, model, keywords)

    def models(self) -> list[ModelEntry]:
        return [entry for model in self.counts if (entry := self.model_entry(model)) is not None]

    def model_entry(self, model: str) -> ModelEntry | None:
        if model not in self.counts:
            return None
        return ModelEntry(id=model, deployment=model, state="ready", engine="llama.cpp", created=1700000000,
                          capabilities=CAPABILITIES, replicas=self.counts[model])

    def _pick(self, model: str, given: dict[str, Any]) -> Upstream:
        assert set(given) <= {"prompt", "replica"}, given
        replica = given.get("replica")
        if model == "solo":
            return self.replicas["solo"]
        return self.replicas[replica if replica is not None else self.unpinned]

    def try_acquire(self, model: str, **given: Any) -> tuple[Upstream, Callable[[], None]] | None:
        self.calls.append(("try_acquire", model, given))
        if not self.at_once:
            return None
        upstream = self._pick(model, given)
        self.acquire_calls += 1
        self.in_flight += 1

        def release() -> None:
            self.in_flight -= 1
            self.released += 1
        return upstream, release

    @asynccontextmanager
    async def acquire(self, model: str, progress: Callable[[str], None] | None = None,
                      **given: Any) -> AsyncIterator[Upstream]:
        self.calls.append(("acquire", model, given))
        upstream = self._pick(model, given)
        self.acquire_calls += 1
        self.in_flight += 1
        try:
            yield upstream
        finally:
            self.in_flight -= 1
            self.released += 1

    def admission(self) -> tuple[str, dict[str, Any]]:
        """The keywords of the last call that admitted (try_acquire when at once, else acquire),
        as given: try_acquire may be handed ``replica=None`` with a prompt."""
        kind, _, given = self.calls[-1]
        assert kind == ("try_acquire" if self.at_once else "acquire"), self.calls
        return kind, given

    def pins(self) -> dict[str, Any]:
        """The last admission's keywords that say something (None dropped)."""
        return {name: value for name, value in self.admission()[1].items() if value is not None}


async def _serve(router_for: Callable[[str], FakeRouter]) -> AsyncIterator[tuple[str, FakeEngine, Any]]:
    engine = FakeEngine()
    engine_app = web.Application()
    engine_app.router.add_route("*", "/{tail:.*}", engine.handle)
    engine_runner, engine_url = await _start(engine_app)
    router = router_for(engine_url)
    proxy_runner, proxy_url = await _start(build_app(router, StaticKeys({KEY: KeyGrant("admin")})))
    try:
        yield proxy_url, engine, router
    finally:
        await proxy_runner.cleanup()
        await engine_runner.cleanup()


# at_once: admitted at once (Router.try_acquire, _intake.admitted_now), or through acquire (admitted).
@pytest.fixture(params=[True, False], ids=["try_acquire", "acquire"])
async def replicated(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, FakeEngine, ReplicaRouter]]:
    def make(url: str) -> ReplicaRouter:
        router = ReplicaRouter(url)
        router.at_once = request.param
        return router
    async for served in _serve(make):
        yield served


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as session:
        yield session


def reached(engine: FakeEngine) -> str:
    """The replica whose Upstream the engine's last request came through (by its launch key)."""
    key = engine.requests[-1][1]["Authorization"].removeprefix("Bearer ")
    return {launch_key(name): name for name in ("chat", "chat@2", "solo")}[key]


# Each request on a route read for its prompt, and the prompt the Router must get for it: system text
# first, then each message's role and text.
PROMPTED = [
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hi"}]},
     f"system:Be brief.{SEP}user:Hi"),
    ("/v1/completions", {"prompt": "Once upon a time"}, "Once upon a time"),
    ("/v1/responses", {"instructions": "Be brief.", "input": "Hi"}, f"system:Be brief.{SEP}user:Hi"),
    ("/v1/messages", {"max_tokens": 8, "system": "Be brief.",
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
     f"system:Be brief.{SEP}user:Hi"),
]


# ---------------------------------------------------------------- the prompt

@pytest.mark.parametrize("path,body,prompt", PROMPTED, ids=[p for p, _, _ in PROMPTED])
async def test_a_model_with_replicas_hands_the_router_the_prompt(replicated, http, path, body, prompt) -> None:
    url, engine, router = replicated
    async with http.post(url + path, headers=AUTH, json={"model": "chat", **body}) as response:
        assert response.status == 200, await response.text()
    assert routing_prompt(path, body) == prompt  # the expectation is _prompt_prefix's own
    assert router.pins() == {"prompt": prompt}  # no replica: nothing to continue
    assert engine.requests[-1][0] == path
    assert router.in_flight == 0


async def test_embeddings_of_a_model_with_replicas_are_routed_by_load_alone(replicated, http) -> None:
    url, engine, router = replicated
    async with http.post(url + "/v1/embeddings", headers=AUTH, json={"model": "chat", "input": "Hi"}) as response:
        assert response.status == 200
    _, given = router.admission()
    assert given == {}
    assert engine.requests[-1][0] == "/v1/embeddings"


@pytest.mark.parametrize("path,body,prompt", PROMPTED, ids=[p for p, _, _ in PROMPTED])
async def test_a_model_with_one_engine_gets_no_prompt_or_replica(replicated, http, path, body, prompt) -> None:
    url, engine, router = replicated
    async with http.post(url + path, headers=AUTH, json={"model": "solo", **body}) as response:
        assert response.status == 200
    _, given = router.admission()
    assert given == {}
    assert reached(engine) == "solo"


@pytest.mark.parametrize("at_once", [True, False], ids=["try_acquire", "acquire"])
async def test_a_router_with_the_old_signatures_still_works(http, at_once) -> None:
    """test_proxy's FakeRouter: acquire(model) and try_acquire(model), one engine per model. Any
    keyword passed to it would be a TypeError, and a 500."""
    def make(url: str) -> FakeRouter:
        router = FakeRouter({"solo": Upstream("solo", url, launch_key("solo"), "llama.cpp", CAPABILITIES)})
        router.at_once = at_once
        return router
    async for url, engine, router in _serve(make):
        for path, body, _ in PROMPTED + [("/v1/embeddings", {"input": "Hi"}, None)]:
            async with http.post(url + path, headers=AUTH, json={"model": "solo", **body}) as response:
                assert response.status == 200, (path, await response.text())
        for stream in (False, True):  # a stored response, read back and continued
            async with http.post(url + "/v1/responses", headers=AUTH,
                                 json={"model": "solo", "input": "Hi", "stream": stream}) as response:
                assert response.status == 200
                await response.read()
        for response_id in ("resp_1", "resp_s"):
            async with http.get(url + f"/v1/responses/{response_id}", headers=AUTH) as response:
                assert response.status == 200, await response.text()
            async with http.post(url + "/v1/responses", headers=AUTH,
                                 json={"model": "solo", "input": "more", "previous_response_id": response_id}) as response:
                assert response.status == 200
        assert router.acquire_calls == len(PROMPTED) + 1 + 2 + 4 and router.in_flight == 0
        assert len(engine.requests) == router.acquire_calls


# ---------------------------------------------------------------- the replica that keeps a response

@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_stored_response_is_read_and_continued_on_its_replica(replicated, http, stream) -> None:
    url, engine, router = replicated
    router.unpinned = "chat@2"  # the Router sends the first request to the second replica
    async with http.post(url + "/v1/responses", headers=AUTH,
                         json={"model": "chat", "input": "Hi", "stream": stream}) as response:
        assert response.status == 200
        if stream:  # the id comes from the response.created event
            assert b"response.created" in await response.read()
            response_id = "resp_s"
        else:
            response_id = (await response.json())["id"]
            assert response_id == "resp_1"
    assert reached(engine) == "chat@2"
    assert router.pins() == {"prompt": "user:Hi"}
    router.unpinned = "chat"  # from now on, a request not pinned would reach the other replica

    async with http.get(url + f"/v1/responses/{response_id}", headers=AUTH) as response:
        assert response.status == 200
        assert (await response.json())["id"] == response_id
    # GET /v1/responses/{id} waits in acquire (it has no way at once), pinned to its engine.
    assert router.calls[-1] == ("acquire", "chat", {"replica": "chat@2"})
    assert engine.requests[-1][0] == f"/v1/responses/{response_id}" and reached(engine) == "chat@2"

    async with http.post(url + "/v1/responses", headers=AUTH,
                         json={"model": "chat", "input": "More", "previous_response_id": response_id,
                               "stream": stream}) as response:
        assert response.status == 200
        await response.read()
    assert router.pins() == {"prompt": "user:More", "replica": "chat@2"}
    assert engine.requests[-1][0] == "/v1/responses" and reached(engine) == "chat@2"

    async with http.delete(url + f"/v1/responses/{response_id}", headers=AUTH) as response:
        assert response.status == 200
    assert router.calls[-1] == ("acquire", "chat", {"replica": "chat@2"})
    assert engine.methods[-1] == "DELETE" and reached(engine) == "chat@2"

    # A previous_response_id the proxy never saw pins nothing.
    async with http.post(url + "/v1/responses", headers=AUTH,
                         json={"model": "chat", "input": "More", "previous_response_id": "resp_unknown"}) as response:
        assert response.status == 200
    assert router.pins() == {"prompt": "user:More"}
    assert reached(engine) == "chat"
    assert router.in_flight == 0
