"""The liveness watchdog of a ready engine (capyctl/controller/_liveness.py) and what the proxy
answers a request whose engine CapyCTL cut.

The watchdog's bound is checked on a fake clock, so it is exact; the real llama-server is hung
with SIGSTOP in tests/integration/test_reliability.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import openai
import pytest
from aiohttp import web

from capyctl.controller._lifecycle import Command
from capyctl.controller._liveness import (LAG_TOLERANCE_S, Liveness, Watchdog, detection_bound,
                                          probe_interval, probe_timeout)
from capyctl.errors import CapyError
from capyctl.proxy import KeyGrant, ModelEntry, StaticKeys, Upstream, build_app, serve
from capyctl.spec import parse_manifest

HANG_GUARD = 15.0


class FakeClock:
    """Time moves only when the watchdog sleeps or a probe takes time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.oversleep = 0.0  # extra seconds each pause takes: the daemon's loop was blocked

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds + self.oversleep
        await asyncio.sleep(0)


class Engine:
    """A probe on the fake clock: answers in 1 ms while alive; hung, a probe runs to its timeout."""

    def __init__(self, clock: FakeClock, deadline: float) -> None:
        self.clock = clock
        self.timeout = probe_timeout(deadline)
        self.hung_at: float | None = None
        self.last_answer: float | None = None
        self.probes = 0

    async def probe(self) -> bool:
        self.probes += 1
        if self.hung_at is not None and self.clock.now >= self.hung_at:
            self.clock.now += self.timeout  # what asyncio.wait_for would wait before giving up
            return False
        self.clock.now += 0.001
        self.last_answer = self.clock.now
        return True


async def _watch(watchdog: Watchdog, rounds_guard: int = 10_000) -> float:
    task = asyncio.create_task(watchdog.watch())
    for _ in range(rounds_guard):
        if task.done():
            return task.result()
        await asyncio.sleep(0)
    task.cancel()
    pytest.fail("the watchdog never declared the engine hung")


@pytest.mark.parametrize("deadline", [1.0, 3.0, 30.0, 300.0])
async def test_a_hung_engine_is_declared_within_the_bound(deadline: float) -> None:
    clock = FakeClock()
    engine = Engine(clock, deadline)
    engine.hung_at = clock.now + 47.3  # mid-pause, any phase
    silent = await _watch(Watchdog(engine.probe, deadline, clock=clock, sleep=clock.sleep))
    assert silent >= deadline
    assert engine.last_answer is not None
    waited = clock.now - engine.last_answer
    assert deadline <= waited <= detection_bound(deadline), (waited, detection_bound(deadline))
    # Cheap: one probe per interval while the engine answered.
    assert engine.probes <= (clock.now - 1000.0) / probe_interval(deadline) + 1


def test_defaults_are_cheap_and_bounded() -> None:
    assert probe_interval(30.0) == 5.0 and probe_timeout(30.0) == 5.0
    assert detection_bound(30.0) == 40.0  # what docs/manifest-reference.md promises: about 30s plus 10s
    assert probe_timeout(1.0) == 1.0 and probe_interval(1.0) >= 0.2


async def test_failures_shorter_than_the_deadline_are_forgiven() -> None:
    clock = FakeClock()
    deadline = 10.0
    answers = iter([True, False, False, True, False, False, False, True] * 50)

    async def probe() -> bool:
        clock.now += 0.001
        try:
            return next(answers)
        except StopIteration:
            raise asyncio.CancelledError from None  # end of the script: stop the test's watchdog

    watchdog = Watchdog(probe, deadline, clock=clock, sleep=clock.sleep)
    with pytest.raises(asyncio.CancelledError):
        await watchdog.watch()
    assert watchdog.silent < deadline  # three silent pauses of 1.67 s never reach 10 s


async def test_time_the_daemon_was_not_looking_is_not_counted() -> None:
    clock = FakeClock()
    deadline = 3.0
    engine = Engine(clock, deadline)
    engine.hung_at = clock.now  # every probe fails from the start...
    clock.oversleep = LAG_TOLERANCE_S + 4.0  # ...but the daemon's loop was blocked through each pause
    watchdog = Watchdog(engine.probe, deadline, clock=clock, sleep=clock.sleep)
    task = asyncio.create_task(watchdog.watch())
    for _ in range(200):
        await asyncio.sleep(0)
    assert not task.done(), "the engine was blamed for the daemon's own stall"
    assert watchdog.discounted > 10 and watchdog.silent == 0.0
    clock.oversleep = 0.0  # the daemon looks again: now the silence is the engine's
    started = clock.now
    await asyncio.wait_for(task, HANG_GUARD)
    assert deadline <= clock.now - started <= detection_bound(deadline)


async def test_a_probe_that_never_answers_is_cut_by_its_timeout() -> None:
    # Real clock: a SIGSTOPped engine accepts the connection (the kernel does) and never answers.
    async def hung() -> bool:
        await asyncio.sleep(3600)
        return True

    started = time.monotonic()
    # Cut: a probe left to run would sleep an hour, past HANG_GUARD.
    silent = await asyncio.wait_for(Watchdog(hung, 1.0).watch(), HANG_GUARD)
    assert time.monotonic() - started >= 1.0
    # Within the bound as the watchdog counts it (a round the loaded loop made late is not counted,
    # so this holds however slow the machine is; the bound itself is checked on FakeClock above).
    assert 1.0 <= silent <= detection_bound(1.0) + LAG_TOLERANCE_S, silent


async def test_a_probe_that_raises_counts_as_silence() -> None:
    async def broken() -> bool:
        raise OSError("connection refused")

    clock = FakeClock()
    assert await _watch(Watchdog(broken, 2.0, clock=clock, sleep=clock.sleep)) >= 2.0


# ---------------------------------------------------------------- the deployment's watchdog


class FakeAdapter:
    def __init__(self) -> None:
        self.healthy = True
        self.calls: list[tuple[str, str | None]] = []

    async def health(self, session, base_url: str, key: str | None) -> bool:
        self.calls.append((base_url, key))
        return self.healthy


class FakeController:
    def __init__(self, adapter: FakeAdapter) -> None:
        self._adapter = adapter
        self.http = object()

    def adapter(self, spec):
        return self._adapter


class FakeActor:
    """The fields of DeploymentActor that Liveness reads; submit records the command."""

    def __init__(self, unresponsive: str = "1s") -> None:
        self.spec = parse_manifest("name: smol\nengine: llama\nmodel: {path: /m.gguf}\n"
                                   f"timeouts: {{unresponsive: {unresponsive}}}\n")
        self.name = "smol"
        self.launch_id = "launch-1"
        self.key = "engine-key"
        self.adapter = FakeAdapter()
        self.controller = FakeController(self.adapter)
        self.submitted: list[tuple[str, dict]] = []

    def upstream(self) -> Upstream:
        return Upstream("smol", "http://127.0.0.1:1234", self.key, "llama.cpp", frozenset({"chat", "completions"}))

    def submit(self, op: str, **args) -> None:
        self.submitted.append((op, args))


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        await asyncio.sleep(0.02)


def test_unresponsive_is_a_timeout_of_the_manifest() -> None:
    spec = parse_manifest("name: a\nengine: llama\nmodel: {path: /m.gguf}\n")
    assert spec.timeouts.unresponsive == 30.0
    assert parse_manifest("name: a\nengine: llama\nmodel: {path: /m.gguf}\ntimeouts: {unresponsive: 2m}\n"
                          ).timeouts.unresponsive == 120.0


async def test_a_ready_deployment_whose_engine_goes_silent_is_reported_once() -> None:
    actor = FakeActor("1s")
    liveness = Liveness(actor)
    liveness.follow(True)
    await _until(lambda: len(actor.adapter.calls) >= 2, "probes of the ready engine")
    assert actor.adapter.calls[0] == ("http://127.0.0.1:1234", "engine-key")  # its health route, its key
    assert actor.submitted == []
    actor.adapter.healthy = False
    await _until(lambda: actor.submitted, "the engine reported unresponsive")
    [(op, args)] = actor.submitted
    assert op is Command.ENGINE_UNRESPONSIVE
    # Silent for the manifest's 1s, and reported within its bound as the watchdog counts silence
    # (late rounds of a loaded loop left out): a watchdog on another deadline would not be.
    assert args["launch_id"] == "launch-1" and 1.0 <= args["silent"] <= detection_bound(1.0) + LAG_TOLERANCE_S
    liveness.stop()


async def test_not_ready_is_not_probed() -> None:
    # Starting, waking, parking, parked: each has its own timeout; the watchdog stays out.
    actor = FakeActor("1s")
    actor.adapter.healthy = False
    liveness = Liveness(actor)
    liveness.follow(True)
    liveness.follow(False)  # e.g. READY -> PARKING
    calls = len(actor.adapter.calls)
    await asyncio.sleep(2.5)
    assert len(actor.adapter.calls) == calls and actor.submitted == []


async def test_a_new_launch_gets_a_new_watch_and_verdicts_are_per_launch() -> None:
    actor = FakeActor("1s")
    liveness = Liveness(actor)
    liveness.follow(True)
    first = liveness._task
    liveness.follow(True)  # another READY of the same launch: the same watch goes on
    assert liveness._task is first
    actor.launch_id = "launch-2"
    liveness.follow(True)
    assert liveness._task is not first
    await asyncio.sleep(0)
    assert first.cancelled()
    liveness.stop()

    error = liveness.condemn("launch-1", 31.2)
    assert (error.code, error.status) == ("engine_unresponsive", 502)
    assert "31.2s" in error.message and "'smol'" in error.message
    assert liveness.verdict("launch-1") is error
    assert liveness.verdict("launch-2") is None and liveness.verdict(None) is None


# ---------------------------------------------------------------- what the proxy answers

CLIENT_KEY = "sk-liveness"


class Cut:
    """A fake engine whose stream CapyCTL cuts: mode 'abort' (the process is killed) or 'eof' (it
    ends its chunked answer cleanly but unfinished, as an engine shutting down on SIGTERM may)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.verdict: CapyError | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            self.verdict = VERDICT
            request.transport.abort()  # killed before it answered
            return web.Response()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Once"}}]}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.verdict = VERDICT  # the watchdog recorded its verdict before stopping the unit
        if self.mode == "abort":
            request.transport.abort()
        else:
            await response.write_eof()
        return response


VERDICT = CapyError("the engine of 'smol' did not answer its health check for 3s; CapyCTL stopped it",
                    code="engine_unresponsive", status=502)


class OneRouter:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def models(self) -> list[ModelEntry]:
        return [ModelEntry("smol", "smol", "ready", "llama.cpp", 0)]

    @asynccontextmanager
    async def acquire(self, model: str) -> AsyncIterator[Upstream]:
        yield self.upstream

    def stats(self) -> dict:
        return {}


@asynccontextmanager
async def proxied(engine: Cut, with_verdict: bool = True) -> AsyncIterator[openai.AsyncOpenAI]:
    engine_app = web.Application()
    engine_app.router.add_post("/v1/chat/completions", engine.handle)
    engine_runner = await serve(engine_app, host_port="127.0.0.1:0")
    host, port = engine_runner.addresses[0][:2]
    upstream = Upstream("smol", f"http://{host}:{port}", None, "llama.cpp", frozenset({"chat"}),
                        verdict=(lambda: engine.verdict) if with_verdict else None)
    proxy_runner = await serve(build_app(OneRouter(upstream), StaticKeys({CLIENT_KEY: KeyGrant("t")})),
                               host_port="127.0.0.1:0")
    phost, pport = proxy_runner.addresses[0][:2]
    client = openai.AsyncOpenAI(base_url=f"http://{phost}:{pport}/v1", api_key=CLIENT_KEY, max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await proxy_runner.cleanup()
        await engine_runner.cleanup()


async def _consume(client: openai.AsyncOpenAI) -> list[str]:
    seen = []
    stream = await client.chat.completions.create(model="smol", stream=True,
                                                  messages=[{"role": "user", "content": "hi"}])
    async for chunk in stream:
        seen.append(chunk.choices[0].delta.content)
    return seen


@pytest.mark.parametrize("mode", ["abort", "eof"])
async def test_a_stream_cut_by_the_watchdog_ends_with_its_error(mode: str) -> None:
    async with proxied(Cut(mode)) as client:
        with pytest.raises(openai.APIError) as caught:
            await asyncio.wait_for(_consume(client), HANG_GUARD)
    assert caught.value.code == "engine_unresponsive"
    assert "did not answer its health check" in caught.value.message


async def test_a_request_cut_before_its_answer_gets_a_502_with_the_verdict() -> None:
    async with proxied(Cut("abort")) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await asyncio.wait_for(client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "hi"}]), HANG_GUARD)
    assert caught.value.status_code == 502
    assert caught.value.body["code"] == "engine_unresponsive"


async def test_without_a_verdict_a_clean_end_passes_through_as_before() -> None:
    # An engine that ends its stream without [DONE] and without CapyCTL cutting it is the
    # engine's own answer: the proxy adds nothing.
    async with proxied(Cut("eof"), with_verdict=False) as client:
        assert await asyncio.wait_for(_consume(client), HANG_GUARD) == ["Once"]
