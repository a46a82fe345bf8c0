"""Issue 45's benchmarks of the door, in their parts that need no sandbox: the proxy measured with
aiohttp's engine client (_one_engine_proxy.py), the stand-in engine that streams and the streams'
count (_sse_engine.py, streams_scale.py), the attacker that holds half-sent heads and what its
connections met (hostile_heads.py), and what the hand-made engine client saves (proxy_hop.py)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from tests.benchmarks import load_benchmark

one_engine_proxy = load_benchmark("_one_engine_proxy")
sse_engine = load_benchmark("_sse_engine")
streams_scale = load_benchmark("streams_scale")
hostile_heads = load_benchmark("hostile_heads")
proxy_hop = load_benchmark("proxy_hop")

from capyctl.proxy import KeyGrant, StaticKeys, Upstream, build_app, serve  # noqa: E402
from proxy_overhead import OneEngineRouter  # noqa: E402  (benchmarks/, on the path once loaded above)

ANSWER = {"id": "c", "object": "chat.completion", "created": 0, "model": "smol",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length"}]}


async def _user_agents_the_engine_saw(engine_client: str) -> tuple[list[str | None], object]:
    """One chat request through the proxy built as _one_engine_proxy.py builds it; the User-Agent
    of each request the engine received, and the proxy's engine pool once started."""
    seen: list[str | None] = []

    async def engine(request: web.Request) -> web.Response:
        seen.append(request.headers.get("User-Agent"))
        return web.json_response(ANSWER)

    engine_app = web.Application()
    engine_app.router.add_post("/v1/chat/completions", engine)
    engine_runner = web.AppRunner(engine_app)
    await engine_runner.setup()
    await web.TCPSite(engine_runner, "127.0.0.1", 0).start()
    port = engine_runner.addresses[0][1]
    upstream = Upstream("smol", f"http://127.0.0.1:{port}", "launch", "llama.cpp", frozenset({"chat", "completions"}))
    app = build_app(OneEngineRouter(upstream), StaticKeys({"k": KeyGrant("bench")}))
    if engine_client == "aiohttp":
        one_engine_proxy.use_aiohttp_engine_client(app)
    else:
        one_engine_proxy.own_engine_client_missing(app)
    runner = await serve(app, host_port="127.0.0.1:0")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions",
                                 json={"model": "smol", "messages": [{"role": "user", "content": "Hi"}]},
                                 headers={"Authorization": "Bearer k"}) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["choices"][0]["message"]["content"] == "Hi"
        return seen, app[one_engine_proxy.POOL]
    finally:
        await runner.cleanup()
        await engine_runner.cleanup()


async def test_the_proxy_measured_with_aiohttps_engine_client_reaches_its_engine_through_it():
    # aiohttp's client adds its own User-Agent to a request that has none
    # (aiohttp/client_reqrep.py, ClientRequest.update_auto_headers: SERVER_SOFTWARE); the proxy's
    # own engine client writes only the headers it is given (capyctl/proxy/_engine_side.py _message).
    seen, pool = await _user_agents_the_engine_saw("aiohttp")
    assert pool is None and len(seen) == 1 and "aiohttp" in seen[0]
    seen, pool = await _user_agents_the_engine_saw("own")
    assert pool is not None and seen == [None]


def test_what_the_hand_made_engine_client_saves_is_paired_by_turn():
    latency = {"capyctl": [1.0e-3, 5.0e-3, 1.2e-3], proxy_hop.AIOHTTP_CLIENT: [1.1e-3, 5.3e-3, 1.25e-3]}
    saved = proxy_hop.engine_client_saves(latency, {"capyctl": 80e-6, proxy_hop.AIOHTTP_CLIENT: 150e-6})
    assert saved["latency_s"] == pytest.approx(0.1e-3)  # the median of 0.1, 0.3 and 0.05 ms
    assert saved["cpu_s"] == pytest.approx(70e-6)


def _event(raw: bytes) -> dict:
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    return json.loads(raw[6:-2])


def test_the_stand_in_streams_llama_servers_chunks_and_ends_with_done():
    events = sse_engine.stream_events("chat", "chatcmpl-1", "m", 3)
    assert len(events) == 6 and events[-1] == b"data: [DONE]\n\n"
    first, last = _event(events[0]), _event(events[-2])
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-1"
    assert first["choices"] == [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}]
    assert [_event(e)["choices"][0]["delta"] for e in events[1:4]] == [{"content": f" w{i}"} for i in range(3)]
    assert last["choices"] == [{"finish_reason": "length", "index": 0, "delta": {}}]
    text = [_event(e)["choices"][0] for e in sse_engine.stream_events("text", "c", "m", 2)[:-1]]
    assert [c["text"] for c in text] == [" w0", " w1", ""] and text[-1]["finish_reason"] == "length"


async def test_a_stream_from_the_stand_in_is_counted_done_and_its_whole_answer_carries_text():
    engine = sse_engine.Engine(interval=0.0, chunks=20)
    server = await asyncio.start_server(engine.connection, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as http:
            streams = [streams_scale.Stream("a") for _ in range(3)]
            for stream in streams:  # one after another: the connection kept alive between them
                await streams_scale.one_stream(http, url, "key", stream, 4, timeout=10)
            assert [streams_scale.outcome(s, 4) for s in streams] == ["done"] * 3
            assert streams[0].first_s is not None and streams[0].chunks == 4
            async with http.post(url + "/v1/completions", json={"prompt": "Hi"}) as r:
                whole = await r.json()
            assert whole["choices"][0]["text"] == "Hi" and whole["choices"][0]["message"]["content"] == "Hi"
            async with http.get(url + "/health") as r:
                assert r.status == 200
    finally:
        server.close()
        await server.wait_closed()


def test_a_stream_that_ends_early_or_is_refused_is_counted_by_why():
    Stream = streams_scale.Stream
    streams = [Stream("a", status=200, chunks=4, done=True), Stream("a", status=200, chunks=4, done=False),
               Stream("a", status=200, chunks=3, done=True), Stream("a", status=200, chunks=2, error="ClientPayloadError"),
               Stream("a", status=503, code="too_many_connections"), Stream("a", error="ServerDisconnectedError")]
    assert [streams_scale.outcome(s, 4) for s in streams] == [
        "done", "cut (no [DONE])", "cut (3 of 4 chunks)", "cut (ClientPayloadError)",
        "refused 503 too_many_connections", "failed (ServerDisconnectedError)"]
    figures = streams_scale.summarize(streams, 4)
    assert figures["streams"] == 6 and figures["done"] == 1 and sum(figures["lost_by"].values()) == 5
    stream = Stream("a")
    streams_scale.read_events(stream, [b": waiting for a\n", b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n",
                                       b"\n", b"data: [DONE]\n"])
    assert (stream.chunks, stream.done) == (1, True)


def test_what_the_server_answered_a_half_head_is_labelled_by_status_and_code():
    body = json.dumps({"error": {"message": "m", "type": "t", "code": "too_many_connections"}}).encode()
    assert hostile_heads.answer_label(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 9\r\n\r\n" + body) == \
        "503 too_many_connections"
    assert hostile_heads.answer_label(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n\r\n") == "408"
    assert hostile_heads.answer_label(b"garbage") == "unparsed"


def test_the_trickled_head_never_ends():
    sent = b"".join(hostile_heads.next_byte(i) for i in range(200))
    assert sent.startswith(hostile_heads.TRICKLE) and b"\r\n\r\n" not in hostile_heads.REQUEST_LINE + sent


def test_a_half_head_outlives_the_deadline_when_it_lived_past_it_and_its_slack():
    attacker = {"lived_s": [0.01, 10.5, 12.1, 13.0], "still_open": [False, False, False, True]}
    assert hostile_heads.held_figures(attacker, 10.0, 2.0) == {
        "outlived_deadline": 2, "closed_within_deadline": 2, "longest_lived_s": 13.0}


async def _attack(answer: bytes | None, seconds: float) -> tuple[dict, list[bytes]]:
    """The attacker, 3 connections from 127.0.0.2, against a server that answers ``answer`` to a
    connection's first bytes and closes it, or (None) reads and never answers."""
    received: list[bytes] = []

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read(100)
        if answer is not None:
            writer.write(answer)
            writer.close()
            return
        while data:
            received.append(data)
            data = await reader.read(100)
        writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    try:
        attacker = hostile_heads.Attacker(("127.0.0.1", server.sockets[0].getsockname()[1]), "127.0.0.2", 3, 50.0)
        return await attacker.run(seconds), received
    finally:
        server.close()


async def test_the_attacker_holds_its_heads_trickling_and_counts_the_server_answering_them():
    report, received = await _attack(None, 2.5)
    assert report["connected"] == report["attempts"] == report["open_at_end"] == 3
    assert report["answered"] == {} and report["closed_after_s"] == [] and all(report["still_open"])
    head = b"".join(received)
    assert head.count(hostile_heads.REQUEST_LINE) == 3 and b"\r\n\r\n" not in head
    assert len(head) > 3 * len(hostile_heads.REQUEST_LINE)  # bytes trickled after the request line
    assert hostile_heads.held_figures(report, 1.0, 0.5)["outlived_deadline"] == 3

    report, _ = await _attack(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n\r\n", 1.0)
    assert report["connect_failed"] == {} and report["connected"] > 3  # each closed slot opened again
    assert set(report["answered"]) == {"408"} and report["closed_silently"] == 0
    # Every connection closed was answered first (one still open at the end may be answered or not yet).
    assert report["connected"] - report["open_at_end"] <= report["answered"]["408"] <= report["connected"]


def test_a_benchmark_that_cannot_measure_writes_why_and_exits_1(tmp_path, capsys):
    from _sandbox_daemon import Report
    out = tmp_path / "bench.json"
    report = Report("streams_scale", out, {"streams": 10})
    with pytest.raises(SystemExit) as ended:
        report.finish("needs root")
    assert ended.value.code == 1 and json.loads(out.read_text()) == {"streams": 10, "error": "needs root"}
    assert capsys.readouterr().err == "streams_scale: needs root\n"
    Report("streams_scale", out, {"streams": 10, "done": 10}).finish()  # measured: written, no exit
    assert json.loads(out.read_text()) == {"streams": 10, "done": 10}
