"""Park and wake through the adapters against the fake vLLM and SGLang servers, launched from
build_launch's own argv and environment as subprocesses (stopped by their PID).

These also make the drain-first rule observable: vLLM's default sleep aborts a running request.
SGLang's park and wake (whose release kills the server while a request runs) are in
tests/unit/test_engines_sglang.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest

from capyctl.engines import LaunchContext, adapter_for
from capyctl.errors import EngineError
from capyctl.spec import DeploymentSpec, EngineSpec
from tests.fakes import FAKE_VLLM, free_port, make_fake_sglang_venv, make_fake_vllm_venv, start_plan

KEY = "per-launch-key-7d1c"


def launch(tmp_path: Path, kind: str, *, dev: bool = True, engine: EngineSpec | None = None,
           gpus: list[int] | None = None):
    """Launch the adapter's own plan. vLLM parks in place only on a GPU (its sleep mode exists on
    CUDA, ROCm and XPU alone), so its launches get GPU 0 by default; the fake reads a non-empty
    CUDA_VISIBLE_DEVICES as a GPU platform (tests/fakes/fake_vllm.py)."""
    if engine is None:
        make = make_fake_vllm_venv if kind == "vllm" else make_fake_sglang_venv
        venv = make(tmp_path / f"{kind}-env")
        engine = EngineSpec(kind="engine", name=f"{kind}-fake", type=kind, path=str(venv))
    if gpus is None:
        gpus = [0] if kind == "vllm" else []
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    dep = DeploymentSpec(name="tiny", engine=engine.name, model={"path": str(model_dir)},
                         resources={"gpus": len(gpus)})
    port = free_port()
    ctx = LaunchContext(deployment=dep, engine=engine, model_path=str(model_dir), port=port, dev_controls=dev,
                        gpu_indices=gpus)
    adapter = adapter_for(kind, engine)
    plan = adapter.build_launch(ctx)
    server = start_plan(plan, KEY, port, log_path=tmp_path / f"{kind}.log")
    return adapter, plan, server


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


async def chat(session, base_url, model="tiny", key=KEY, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": "say hi"}], **extra}
    async with session.post(base_url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json()


async def stats(session, base_url):
    async with session.get(base_url + "/fake/stats") as r:
        return await r.json()


async def until_stats(session, base_url, condition, timeout: float = 10.0):
    """The fake's stats once ``condition`` holds for them (a hang guard, not a time bound)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition(s := await stats(session, base_url)):
        assert loop.time() < deadline, f"the fake's stats never got there: {s}"
        await asyncio.sleep(0.01)
    return s


async def wait_health(adapter, session, server):
    for _ in range(300):
        assert server.proc.poll() is None, "the fake engine exited"
        if await adapter.health(session, server.base_url, KEY):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the fake engine never became healthy")


async def test_vllm_level1_park_and_wake(tmp_path, session):
    adapter, plan, server = launch(tmp_path, "vllm")
    try:
        await wait_health(adapter, session, server)
        assert "--enable-sleep-mode" in plan.argv
        status, body = await chat(session, server.base_url, model=plan.served_model)
        assert status == 200 and body["choices"][0]["message"]["content"]
        assert (await chat(session, server.base_url, key="wrong"))[0] == 401
        assert await adapter.is_parked(session, server.base_url, KEY) is False

        await adapter.park(session, server.base_url, KEY, 1)
        assert await adapter.is_parked(session, server.base_url, KEY) is True
        assert await adapter.health(session, server.base_url, KEY)  # /health answers 200 while asleep
        # A request that reaches a sleeping vLLM is queued by its paused scheduler, not refused:
        # it is answered once the engine wakes (vllm/v1/engine/core.py).
        queued = asyncio.create_task(chat(session, server.base_url))
        await until_stats(session, server.base_url, lambda s: s["queued_while_asleep"] == 1)
        assert not queued.done()

        await adapter.wake(session, server.base_url, KEY, 1)
        status, body = await asyncio.wait_for(queued, 10)
        assert status == 200 and "garbage" not in body["choices"][0]["message"]["content"]
        assert await adapter.is_parked(session, server.base_url, KEY) is False
        s = await stats(session, server.base_url)
        assert (s["sleep_calls"], s["wake_calls"], s["last_sleep_level"], s["aborted"]) == (1, 1, 1, 0)
        assert s["last_sleep_mode"] == "wait"  # after the controller's drain, never vLLM's default abort
    finally:
        server.stop()


async def test_vllm_level2_wake_reloads_weights(tmp_path, session):
    adapter, plan, server = launch(tmp_path, "vllm")
    try:
        await wait_health(adapter, session, server)
        reference = (await chat(session, server.base_url))[1]["choices"][0]["message"]["content"]
        await adapter.park(session, server.base_url, KEY, 2)
        await adapter.wake(session, server.base_url, KEY, 2)
        status, body = await chat(session, server.base_url)
        assert status == 200 and body["choices"][0]["message"]["content"] == reference
        s = await stats(session, server.base_url)
        assert s["collective_rpc"] == ["reload_weights"] and s["reset_prefix_cache"] == 1

        # A level-1 wake after a level-2 park leaves the weights uninitialised: vLLM answers, but
        # nonsense. The level matters.
        await adapter.park(session, server.base_url, KEY, 2)
        await adapter.wake(session, server.base_url, KEY, 1)
        status, body = await chat(session, server.base_url)
        assert status == 200 and body["choices"][0]["message"]["content"] != reference
    finally:
        server.stop()


def chunks(events: list[str]) -> list[dict]:
    return [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]


def last_finish(events: list[str]) -> str | None:
    return [c["choices"][0]["finish_reason"] for c in chunks(events) if c.get("choices")][-1]


def content(events: list[str]) -> list[int]:
    """1 for each chunk that carries generated text."""
    return [1 for c in chunks(events) if c.get("choices") and c["choices"][0]["delta"].get("content")]


async def test_vllm_park_lets_a_request_in_flight_finish_where_the_default_sleep_aborts_it(tmp_path, session):
    adapter, plan, server = launch(tmp_path, "vllm")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a long answer please"}], "stream": True,
            "max_tokens": 12, "fake_token_delay": 0.1}
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        await wait_health(adapter, session, server)
        # The adapter's park (mode=wait): a request that slipped past the drain completes.
        async with session.post(server.base_url + "/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.content.readline()  # the first event arrived: the request is running
            await adapter.park(session, server.base_url, KEY, 1)
            events = [line.decode().strip() async for line in resp.content if line.strip()]
        assert events[-1] == "data: [DONE]" and last_finish(events) == "stop"
        full = sum(content(events))  # the whole answer
        await adapter.wake(session, server.base_url, KEY, 1)
        # vLLM's default mode (abort) cuts it short, finish_reason "abort" (v1/engine/core.py
        # pause_scheduler): why the adapter never sends the default.
        async with session.post(server.base_url + "/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.content.readline()
            async with session.post(server.base_url + "/sleep", params={"level": "1"}) as r:
                assert r.status == 200 and await r.json() == {"status": "sleeping", "level": 1}
            events = [line.decode().strip() async for line in resp.content if line.strip()]
        assert events[-1] == "data: [DONE]" and last_finish(events) == "abort"
        assert sum(content(events)) < full
        s = await stats(session, server.base_url)
        assert s["aborted"] == 1 and s["in_flight"] == 0
    finally:
        server.stop()


async def test_vllm_without_development_controls_cannot_park_in_place(tmp_path, session):
    adapter, plan, server = launch(tmp_path, "vllm", dev=False)
    try:
        await wait_health(adapter, session, server)
        with pytest.raises(EngineError) as err:
            await adapter.park(session, server.base_url, KEY, 1)
        assert err.value.code == "park_failed" and err.value.detail["status"] == 404
    finally:
        server.stop()


async def test_custom_engine_park_and_wake_through_its_registration(tmp_path, session):
    engine = EngineSpec.model_validate({
        "kind": "engine", "name": "my-server", "type": "custom",
        "cmd": [sys.executable, str(FAKE_VLLM), "--host", "{host}", "--port", "{port}", "--model", "{name}",
                "--enable-sleep-mode"], "key_env": "VLLM_API_KEY",
        "health": "/health", "park": {"path": "/sleep?level=1"}, "wake": {"path": "/wake_up"},
        "env": {"VLLM_SERVER_DEV_MODE": "1"}})
    # vLLM's sleep mode needs a GPU platform: the registration runs it on GPU 0 (the fake's rule).
    adapter, plan, server = launch(tmp_path, "custom", engine=engine, gpus=[0])
    try:
        await wait_health(adapter, session, server)
        assert (await chat(session, server.base_url))[0] == 200  # the key reached it through key_env
        assert KEY not in " ".join(server.proc.args)
        await adapter.park(session, server.base_url, KEY, 1)
        assert (await stats(session, server.base_url))["sleeping"]
        await adapter.wake(session, server.base_url, KEY, 1)
        assert (await chat(session, server.base_url))[0] == 200
    finally:
        server.stop()


async def test_health_is_false_when_nothing_listens(session):
    assert await adapter_for("vllm").health(session, f"http://127.0.0.1:{free_port()}", KEY) is False
