"""A stand-in engine that streams: OpenAI chat chunks at a steady pace, no model.

nginx (daemon_scale.py's instant engine) answers at once and cannot pace a stream, so
streams_scale.py registers this one: standard library only (it runs with the system's python3
inside an engine unit, which cannot see the project's virtual environment).

- ``GET /health``: 200.
- ``POST /v1/chat/completions`` or ``/v1/completions`` with ``"stream": true``: an event stream
  (``Transfer-Encoding: chunked``, one HTTP chunk an event, as llama-server sends it) of a first
  chunk with the assistant's role, ``max_tokens`` content chunks (``--chunks`` without it) one
  every ``--interval`` seconds, a last chunk with ``finish_reason``, then ``data: [DONE]``.
- the same without ``"stream"``: one whole completion (the daemon's post-start proof reads text
  from either route, so it carries both ``message`` and ``text``).

The chunks' shape follows llama.cpp's server (ggml-org/llama.cpp, tools/server/server-task.cpp:
``server_task_result_cmpl_partial::to_json_oaicompat_chat`` for the role chunk and the content
deltas, ``server_task_result_cmpl_final::to_json_oaicompat_chat_stream`` for the last one with
``finish_reason`` and an empty delta; tools/server/server-common.cpp ``format_oai_sse`` for
``data: <json>`` and the blank line after; tools/server/server-context.cpp for the closing
``data: [DONE]``).

Run: python3 benchmarks/_sse_engine.py --port P [--interval 0.1] [--chunks 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

HEAD_MAX = 64 * 1024


def chunk(kind: str, cmpl_id: str, created: int, model: str, *, delta: dict | None = None, text: str | None = None,
          finish: str | None = None) -> bytes:
    """One SSE event: a chat completion chunk (``delta``) or a text completion one (``text``)."""
    if kind == "chat":
        choice = {"finish_reason": finish, "index": 0, "delta": delta if delta is not None else {}}
        body = {"choices": [choice], "created": created, "id": cmpl_id, "model": model,
                "system_fingerprint": "stand-in", "object": "chat.completion.chunk"}
    else:
        body = {"choices": [{"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}],
                "created": created, "id": cmpl_id, "model": model, "system_fingerprint": "stand-in",
                "object": "text_completion"}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def stream_events(kind: str, cmpl_id: str, model: str, tokens: int) -> list[bytes]:
    """Every event of one streamed answer, in order: the role chunk (chat), ``tokens`` content
    chunks, the last chunk with its finish reason, and ``[DONE]``. (The pacing is the server's.)"""
    created = int(time.time())
    events = [chunk(kind, cmpl_id, created, model, delta={"role": "assistant", "content": None})] \
        if kind == "chat" else []
    for i in range(tokens):
        word = f" w{i}"
        events.append(chunk(kind, cmpl_id, created, model, delta={"content": word}, text=word))
    events.append(chunk(kind, cmpl_id, created, model, delta={}, text="", finish="length"))
    events.append(b"data: [DONE]\n\n")
    return events


def whole_answer(model: str) -> bytes:
    return json.dumps({"id": "cmpl-1", "object": "chat.completion", "created": int(time.time()), "model": model,
                       "choices": [{"index": 0, "text": "Hi", "message": {"role": "assistant", "content": "Hi"},
                                    "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """Method, path and headers (names lower-cased) of a request head without its blank line."""
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return method, path, headers


class Engine:
    def __init__(self, interval: float, chunks: int) -> None:
        self.interval, self.chunks = interval, chunks
        self.served = 0

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return
                method, path, headers = parse_head(head[:-4])
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                if not await self.answer(writer, method, path, body):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def answer(self, writer: asyncio.StreamWriter, method: str, path: str, body: bytes) -> bool:
        """Answer one request; False when the connection is to be closed."""
        if method == "GET":
            payload = b'{"status":"ok"}' if path == "/health" else b'{"object":"list","data":[]}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(payload), payload))
            await writer.drain()
            return True
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            request = {}
        model = str(request.get("model") or "stand-in")
        if not request.get("stream"):
            payload = whole_answer(model)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(payload), payload))
            await writer.drain()
            return True
        self.served += 1
        kind = "chat" if path.endswith("/chat/completions") else "text"
        tokens = int(request.get("max_tokens") or self.chunks)
        events = stream_events(kind, f"chatcmpl-{self.served}", model, tokens)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for i, event in enumerate(events):
            if 0 < i < len(events) - 1:  # the content chunks and the last one at the engine's pace
                await asyncio.sleep(self.interval)
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


async def serve(host: str, port: int, interval: float, chunks: int) -> None:
    engine = Engine(interval, chunks)
    server = await asyncio.start_server(engine.connection, host, port, limit=HEAD_MAX, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between two chunks of a stream")
    parser.add_argument("--chunks", type=int, default=20, help="content chunks of a stream without max_tokens")
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.interval, args.chunks))


if __name__ == "__main__":
    main()
