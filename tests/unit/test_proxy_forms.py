"""POST /v1/audio/transcriptions through the proxy: a multipart form whose ``model`` field selects
the deployment, received part by part (files spooled to disk past a size), capped with 413,
and sent on to the engine as the same form.

The fake engine reads the form as llama-server does (tools/server/server-http.cpp: text fields
become a JSON body, file parts go to ``files``; server-chat.cpp convert_transcriptions_to_chatcmpl
wants a ``file`` part) and answers ``{"text": ...}``; the client is the official ``openai`` one.
"""

from __future__ import annotations

import os
from typing import AsyncIterator

import aiohttp
import openai
import pytest
from aiohttp import web

from capyctl.proxy import KeyGrant, MiB, StaticKeys, Upstream, build_app
from capyctl.proxy import _intake
from tests.unit.test_proxy import FakeRouter, _start

KEY, SCOPED = "sk-admin", "sk-only-chat"
LAUNCH_KEY = "launch-key"
MAX_UPLOAD = 3 * MiB


class FormEngine:
    def __init__(self) -> None:
        self.forms: list[tuple[str, dict[str, str], dict[str, tuple[str | None, str | None, bytes]]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        fields: dict[str, str] = {}
        files: dict[str, tuple[str | None, str | None, bytes]] = {}
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if part.filename is None:
                fields[part.name] = await part.text()
            else:
                files[part.name] = (part.filename, part.headers.get("Content-Type"), bytes(await part.read()))
        self.forms.append((request.headers["Authorization"], fields, files))
        if "file" not in files:  # server-chat.cpp convert_transcriptions_to_chatcmpl
            return web.json_response({"error": {"code": 400, "message": "No input file found for transcription",
                                                "type": "invalid_request_error"}}, status=400)
        return web.json_response({"text": f"{len(files['file'][2])} bytes heard"})


@pytest.fixture
async def proxy() -> AsyncIterator[tuple[str, FormEngine, FakeRouter]]:
    engine = FormEngine()
    engine_app = web.Application(client_max_size=64 * MiB)
    engine_app.router.add_post("/v1/audio/transcriptions", engine.handle)
    engine_runner, engine_url = await _start(engine_app)
    router = FakeRouter({
        "asr": Upstream("dep-a", engine_url, LAUNCH_KEY, "vllm", frozenset({"transcriptions"}),
                        served_model="engine-asr"),
        "chat-only": Upstream("dep-c", engine_url, LAUNCH_KEY, "custom", frozenset({"chat"})),
    })
    keys = StaticKeys({KEY: KeyGrant("admin"), SCOPED: KeyGrant("scoped", frozenset({"chat-only"}))})
    proxy_runner, proxy_url = await _start(build_app(router, keys, max_body=4096, max_upload=MAX_UPLOAD))
    try:
        yield proxy_url, engine, router
    finally:
        await proxy_runner.cleanup()
        await engine_runner.cleanup()


def client(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_openai_client_transcription_reaches_the_engine_as_the_same_form(proxy) -> None:
    url, engine, router = proxy
    audio = os.urandom(20_000)
    async with client(url) as oai:
        result = await oai.audio.transcriptions.create(model="asr", file=("hello.wav", audio, "audio/wav"),
                                                       language="en", response_format="json")
    assert result.text == "20000 bytes heard"
    authorization, fields, files = engine.forms[-1]
    assert authorization == f"Bearer {LAUNCH_KEY}"  # the launch key, not the client's
    assert fields["model"] == "engine-asr" and fields["language"] == "en"  # renamed to what the engine serves
    assert files["file"] == ("hello.wav", "audio/wav", audio)
    assert router.in_flight == 0 and router.released == 1


async def test_a_large_upload_is_spooled_to_disk_and_arrives_whole(proxy, monkeypatch) -> None:
    url, engine, _ = proxy
    spooled = []
    real = _intake.tempfile.TemporaryFile

    def recording(*args, **kwargs):
        spooled.append(real(*args, **kwargs))
        return spooled[-1]
    monkeypatch.setattr(_intake.tempfile, "TemporaryFile", recording)
    audio = os.urandom(2 * MiB + 17)  # past UPLOAD_SPOOL_IN_MEMORY, under MAX_UPLOAD
    form = aiohttp.FormData()
    form.add_field("file", audio, filename="long.wav", content_type="audio/wav")  # the file before the model
    form.add_field("model", "asr")
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/audio/transcriptions", data=form,
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 200, await response.text()
    assert engine.forms[-1][2]["file"][2] == audio
    assert len(spooled) == 1 and spooled[0].closed  # on disk while it waited, removed after


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_upload_over_the_cap_is_413_and_wakes_nothing(proxy, chunked: bool) -> None:
    url, engine, router = proxy
    form = aiohttp.FormData()
    form.add_field("model", "asr")
    form.add_field("file", b"\0" * (MAX_UPLOAD + 1), filename="big.wav", content_type="audio/wav")
    payload = form()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": payload.content_type}
    body = b"".join([chunk async for chunk in _chunks(payload)])

    async def stream() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 256 * 1024):
            yield body[start:start + 256 * 1024]
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/audio/transcriptions", data=stream() if chunked else body,
                             headers=headers) as response:
            assert response.status == 413
            assert (await response.json())["error"]["code"] == "request_too_large"
    assert engine.forms == [] and router.acquire_calls == 0


async def _chunks(payload) -> AsyncIterator[bytes]:
    class Sink:
        def __init__(self) -> None:
            self.parts: list[bytes] = []

        async def write(self, data: bytes) -> None:
            self.parts.append(bytes(data))
    sink = Sink()
    await payload.write(sink)
    for part in sink.parts:
        yield part


@pytest.mark.parametrize("data,content_type,status,code", [
    ({"language": "en"}, None, 400, "missing_model"),  # a form without the model field
    (b'{"model": "asr"}', "application/json", 400, "invalid_form"),
    (b"--x\r\nContent-Disposition: form-data; name=model\r\n\r\nasr", "multipart/form-data; boundary=x",
     400, "invalid_form"),  # torn: the closing boundary never comes
])
async def test_bad_forms_are_400_and_wake_nothing(proxy, data, content_type, status, code) -> None:
    url, engine, router = proxy
    if isinstance(data, dict):
        form = aiohttp.FormData()
        for name, value in data.items():
            form.add_field(name, value)
        form.add_field("file", b"RIFF", filename="a.wav")
        data = form
    headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": content_type} if content_type else {})}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/audio/transcriptions", data=data, headers=headers) as response:
            assert response.status == status
            assert (await response.json())["error"]["code"] == code
    assert engine.forms == [] and router.acquire_calls == 0


async def test_a_huge_text_field_is_refused(proxy) -> None:
    url, engine, router = proxy
    form = aiohttp.FormData()
    form.add_field("model", "asr")
    form.add_field("prompt", "x" * (_intake.FORM_FIELD_MAX + 1))
    form.add_field("file", b"RIFF", filename="a.wav")
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/audio/transcriptions", data=form,
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 413
            assert (await response.json())["error"]["code"] == "form_field_too_large"
    assert router.acquire_calls == 0


async def test_scoped_keys_and_engines_without_transcription(proxy) -> None:
    url, engine, router = proxy
    async with client(url, SCOPED) as oai:
        with pytest.raises(openai.NotFoundError) as caught:  # not a model this key may use
            await oai.audio.transcriptions.create(model="asr", file=("a.wav", b"RIFF", "audio/wav"))
        assert caught.value.body["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError) as caught:  # its engine has no such route
            await oai.audio.transcriptions.create(model="chat-only", file=("a.wav", b"RIFF", "audio/wav"))
        assert caught.value.body["code"] == "route_not_served"
        assert "/v1/chat/completions" in caught.value.body["message"]
    assert engine.forms == []


async def test_the_engine_error_is_passed_through(proxy) -> None:
    url, engine, _ = proxy
    form = aiohttp.FormData()
    form.add_field("model", "asr")
    form.add_field("audio", b"RIFF", filename="a.wav")  # not named "file"
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/audio/transcriptions", data=form,
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["message"] == "No input file found for transcription"
