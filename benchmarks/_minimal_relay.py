"""The least a Python proxy can do per request, as a floor for benchmarks/proxy_hop.py and
proxy_vs_nginx.py: what CapyCTL's proxy would cost if its own work (key check, the body's
model, admission, metrics, errors, keep-alive and pipelining rules) were free.

It runs on the daemon's event loop (uvloop), with asyncio protocols and httptools' parser (the
one CapyCTL's engine client uses for answers); one engine connection per client connection,
reopened when the engine closes it. It takes only what the benchmarks send: a POST with a
Content-Length body, answered with the engine's status and body; every request goes to
POST /v1/chat/completions with the engine's key. Nothing here is CapyCTL: no key is checked,
no model read, no error shaped. Streams are not relayed (the engine's whole answer is sent at
its end), so use it for latency only. A request the engine closed its connection on before
answering (llama-server closes a kept-alive connection after a number of requests, or idle) is
sent once more on a new one, as nginx's proxy_next_upstream and CapyCTL's pool do.

Run: .venv/bin/python benchmarks/_minimal_relay.py --upstream-port P --launch-key K --port P
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import httptools

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capyctl import eventloop  # noqa: E402


class _Engine(asyncio.Protocol):
    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.engine = None
        if self.client.sent is not None:  # unanswered: once more, on a new connection
            self.client.connect()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        self.client.sent = None
        status = self.parser.get_status_code()
        self.parser = httptools.HttpResponseParser(self)
        if self.client.transport is not None and not self.client.transport.is_closing():
            self.client.transport.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                        % (status, len(body)) + body)


class _Client(asyncio.Protocol):
    def __init__(self, engine_port: int, launch_key: str) -> None:
        self.engine_port, self.launch_key = engine_port, launch_key
        self.transport: asyncio.Transport | None = None
        self.engine: _Engine | None = None
        self.connecting = False
        self.buffer = b""
        self.sent: bytes | None = None  # written to the engine, not yet answered

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.engine is not None and self.engine.transport is not None:
            self.engine.transport.close()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.engine is None:
            self.connect()
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        length = 0
        for line in self.buffer[:end].split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buffer) < end + 4 + length:
            return
        body, self.buffer = self.buffer[end + 4:end + 4 + length], self.buffer[end + 4 + length:]
        assert self.engine.transport is not None
        self.sent = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nAuthorization: Bearer "
                     + self.launch_key.encode() + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.engine.transport.write(self.sent)

    def connect(self) -> None:
        if not self.connecting:
            self.connecting = True
            asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, self.engine = await loop.create_connection(lambda: _Engine(self), "127.0.0.1", self.engine_port)
        self.connecting = False
        if self.sent is not None:
            assert self.engine.transport is not None
            self.engine.transport.write(self.sent)
        elif self.buffer:
            self.data_received(b"")


async def run(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(args.upstream_port, args.launch_key), "127.0.0.1", args.port)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--launch-key", required=True)
    parser.add_argument("--port", type=int, required=True)
    eventloop.run(run(parser.parse_args()))
