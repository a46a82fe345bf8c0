"""The proxy's door (capyctl/proxy/_door.py): its limits on client connections, spoken to over raw
loopback sockets against the proxy app served as the daemon serves it (``serve(..., door=...)``).

The head deadline is awaited as the event it is (the 408 and the close), never timed; that it did
not come early is read on the loop's own clock, the one the door's timer runs on; where a test
must show that something was *not* cut at the deadline, another connection's 408, opened later,
shows that the deadline has passed. Client addresses are told apart by binding the clients'
sockets to other loopback addresses (127.0.0.2, 127.0.0.3...). Each test runs on asyncio's loop
and on uvloop's (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import pytest
from aiohttp import web

from capyctl import config_file
from capyctl.config import DaemonConfig
from capyctl.daemon import Daemon
from capyctl.errors import CapyError
from capyctl.proxy import DoorSettings, KeyGrant, StaticKeys, Upstream, build_app, serve
from capyctl.proxy import _door
from capyctl.proxy._door import DoorSite, key_accepted
from tests.unit.test_proxy import HANG_GUARD, FakeRouter, eventually

KEY = "sk-door"
HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\n"  # no blank line: never whole
HEALTH = b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n"
BIG_ANSWER = 16 * 1024 * 1024
MODELS = f"GET /v1/models HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()


def chat_request(said: str, *, key: str = KEY) -> bytes:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": said}]}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


async def read_answer(reader: asyncio.StreamReader, status_line: bytes = b"") -> Answer:
    """One whole HTTP/1.1 answer (every answer here has a Content-Length); ``status_line``: its first
    line, where it was read already."""
    async def read() -> Answer:
        nonlocal status_line
        status_line = status_line or await reader.readline()
        assert status_line.startswith(b"HTTP/1.1 "), status_line
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return Answer(int(status_line.split()[1]), headers,
                      await reader.readexactly(int(headers.get("content-length", "0"))))
    return await asyncio.wait_for(read(), HANG_GUARD)


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the door closed the connection with nothing more sent."""
    return await asyncio.wait_for(reader.read(1), HANG_GUARD) == b""


@dataclass
class Door:
    host: str
    port: int
    runner: web.AppRunner
    router: FakeRouter
    site: DoorSite

    async def connect(self, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port, local_addr=(source, 0))

    async def ask(self, request: bytes, source: str = "127.0.0.1"
                  ) -> tuple[Answer, tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        """``request`` on a new connection, its answer, and the connection (left open)."""
        reader, writer = await self.connect(source)
        writer.write(request)
        return await read_answer(reader), (reader, writer)


@contextlib.asynccontextmanager
async def door(*, keys: bool = True, **settings: float) -> AsyncIterator[Door]:
    """The proxy with ``settings``, its one model's engine answering at once; ``keys`` False: no
    authentication (no connection is ever keyed)."""
    async def chat(request: web.Request) -> web.Response:
        messages = (await request.json())["messages"]
        if messages[0]["content"] == "big":  # more than the kernel's buffers hold for a client that does not read
            return web.Response(body=b"[" + b"0," * (BIG_ANSWER // 2) + b"0]", content_type="application/json")
        return web.json_response({"object": "chat.completion", "echo": messages})

    engine_app = web.Application()
    engine_app.router.add_post("/v1/chat/completions", chat)
    engine = await serve(engine_app, host_port="127.0.0.1:0")
    engine_host, engine_port = engine.addresses[0][:2]
    upstream = Upstream("dep", f"http://{engine_host}:{engine_port}", "launch", "llama.cpp", frozenset({"chat"}))
    router = FakeRouter({"m": upstream})
    app = build_app(router, StaticKeys({KEY: KeyGrant("t")}) if keys else None)
    runner = await serve(app, host_port="127.0.0.1:0", door=DoorSettings(**settings))  # type: ignore[arg-type]
    host, port = runner.addresses[0][:2]
    site = next(site for site in runner.sites if isinstance(site, DoorSite))
    try:
        yield Door(host, port, runner, router, site)
    finally:
        await runner.cleanup()
        await engine.cleanup()


def code_of(answer: Answer) -> tuple[int, str]:
    return answer.status, json.loads(answer.body)["error"]["code"]


async def closed_by_the_door(reader: asyncio.StreamReader, status: int, code: str) -> None:
    """The door's answer (``status``, ``code``, Connection: close) arrives, then the close."""
    answer = await read_answer(reader)
    assert code_of(answer) == (status, code), answer
    assert answer.headers["connection"] == "close" and answer.headers["date"].endswith("GMT")
    assert await closed(reader)


# ---------------------------------------------------------------- the head deadline

async def closed_at_the_deadline(proxy: Door, head: bytes, head_timeout: float) -> None:
    """A connection that sends ``head`` (never a whole one) gets the door's 408 and is closed, not
    before ``head_timeout`` from its start on the loop's clock (the door's deadline is a timer of
    that loop, armed as the connection is accepted: after the test reads the clock)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    reader, writer = await proxy.connect()
    writer.write(head)
    await closed_by_the_door(reader, 408, "request_head_timeout")
    # (A 1 ms margin: uvloop's clock counts whole milliseconds, read as floats.)
    assert loop.time() - started >= head_timeout - 0.001, "answered before the deadline"
    writer.close()


async def test_a_half_head_is_answered_408_and_closed_at_the_deadline() -> None:
    async with door(head_timeout=0.3) as proxy:
        await closed_at_the_deadline(proxy, HALF_HEAD, 0.3)
        await eventually(lambda: proxy.site.open_connections == 0, "the closed connection counted out")


async def test_a_connection_that_sends_nothing_is_closed_at_the_deadline() -> None:
    async with door(head_timeout=0.3) as proxy:
        await closed_at_the_deadline(proxy, b"", 0.3)


async def test_the_next_heads_deadline_runs_from_its_first_byte_and_an_idle_connection_is_left_to_keepalive() -> None:
    async with door(head_timeout=0.3) as proxy:
        answer, (idle_reader, idle_writer) = await proxy.ask(HEALTH)
        assert answer.status == 200
        answer, (reader, writer) = await proxy.ask(HEALTH)
        assert answer.status == 200
        writer.write(HALF_HEAD)  # after an answer: the deadline runs from this byte
        await closed_by_the_door(reader, 408, "request_head_timeout")
        # The idle connection answered before that half head was sent outlived its deadline, and serves.
        idle_writer.write(HEALTH)
        assert (await read_answer(idle_reader)).status == 200
        idle_writer.close()
        writer.close()


async def test_a_head_late_behind_an_answer_still_unsent_closes_without_a_408() -> None:
    # A client that does not read a big answer, then sends half a head: at the deadline no status
    # can follow the answer as the answer to that head, so the connection just closes after it.
    async with door(head_timeout=0.3) as proxy:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: the window)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (proxy.host, proxy.port))
        reader, writer = await asyncio.open_connection(sock=sock)  # (its buffer stops reading at 128 KiB)
        writer.write(chat_request("big"))
        status_line = await asyncio.wait_for(reader.readline(), HANG_GUARD)  # the answer is going out
        writer.write(HALF_HEAD)
        late = await proxy.connect()  # its 408 says the half head's deadline has passed too
        await closed_by_the_door(late[0], 408, "request_head_timeout")
        answer = await read_answer(reader, status_line)
        assert answer.status == 200 and len(answer.body) > BIG_ANSWER
        assert await closed(reader)  # nothing after the answer
        for other in (writer, late[1]):
            other.close()


async def test_a_request_waiting_for_its_engine_is_not_cut_by_the_head_deadline() -> None:
    async with door(head_timeout=0.3) as proxy:
        proxy.router.gate = asyncio.Event()  # admission waits, as for a wake
        reader, writer = await proxy.connect()
        writer.write(chat_request("waits", key=KEY))
        await eventually(lambda: proxy.router.waiting == 1, "the request waits for admission")
        late_reader, late_writer = await proxy.connect()  # its deadline ends after the waiting one's would
        await closed_by_the_door(late_reader, 408, "request_head_timeout")
        proxy.router.gate.set()
        answer = await read_answer(reader)
        assert answer.status == 200 and json.loads(answer.body)["echo"][0]["content"] == "waits"
        writer.close()
        late_writer.close()


# ---------------------------------------------------------------- the caps

async def test_past_the_cap_a_new_connection_is_answered_503_and_closed() -> None:
    async with door(connections_max=3, keyed_reserve=0) as proxy:
        kept = []
        for _ in range(3):  # keyed: never pushed out
            answer, connection = await proxy.ask(MODELS)
            assert answer.status == 200
            kept.append(connection)
        assert proxy.site.keyed_connections == 3
        reader, writer = await proxy.connect()
        writer.write(HEALTH)
        await closed_by_the_door(reader, 503, "too_many_connections")
        writer.close()
        kept.pop()[1].close()
        await eventually(lambda: proxy.site.open_connections == 2, "the closed connection counted out")
        answer, connection = await proxy.ask(HEALTH)  # room again
        assert answer.status == 200
        for _, other in [*kept, connection]:
            other.close()


async def test_past_the_per_address_cap_only_that_address_is_refused() -> None:
    async with door(per_address_max=2) as proxy:
        kept = []
        for _ in range(2):
            answer, connection = await proxy.ask(HEALTH, source="127.0.0.2")
            assert answer.status == 200
            kept.append(connection)
        reader, writer = await proxy.connect("127.0.0.2")
        writer.write(HEALTH)
        await closed_by_the_door(reader, 503, "too_many_connections_from_address")
        writer.close()
        answer, connection = await proxy.ask(HEALTH, source="127.0.0.3")
        assert answer.status == 200
        for _, other in [*kept, connection]:
            other.close()


async def test_keyed_clients_are_served_while_unkeyed_half_heads_hold_their_whole_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_door, "YIELD_AFTER_S", 0.0)  # (gives way at once: no grace to wait out)
    # 8 slots, 3 kept for keyed connections: 5 for the rest, which a flood of half heads fills.
    async with door(connections_max=8, keyed_reserve=3) as proxy:
        answer, (reader, writer) = await proxy.ask(chat_request("x", key="sk-wrong"))
        assert code_of(answer) == (401, "invalid_api_key")
        writer.close()
        await eventually(lambda: proxy.site.open_connections == 0, "the refused client counted out")
        half_heads = []
        for n in range(5):
            reader, writer = await proxy.connect(f"127.0.0.{10 + n}")
            writer.write(HALF_HEAD)
            half_heads.append((reader, writer))
        await eventually(lambda: proxy.site.open_connections == 5, "the half heads counted in")
        assert proxy.site.keyed_connections == 0  # (an invalid key made no connection keyed)
        keyed = []
        for _ in range(3):  # the first takes the place of the oldest half head; once keyed, it leaves room
            answer, connection = await proxy.ask(MODELS)
            assert answer.status == 200 and json.loads(answer.body)["data"][0]["id"] == "m"
            keyed.append(connection)
        await closed_by_the_door(half_heads[0][0], 503, "too_many_connections")
        assert (proxy.site.open_connections, proxy.site.keyed_connections) == (7, 3)
        # Ten more half heads: the first takes the free slot, each next one pushes out the oldest
        # unkeyed connection, never a keyed one.
        for n in range(10):
            reader, writer = await proxy.connect(f"127.0.0.{20 + n}")
            writer.write(HALF_HEAD)
            half_heads.append((reader, writer))
        for reader, _ in half_heads[1:10]:
            await closed_by_the_door(reader, 503, "too_many_connections")
        assert (proxy.site.open_connections, proxy.site.keyed_connections) == (8, 3)
        for reader, writer in keyed:
            writer.write(MODELS)
            assert (await read_answer(reader)).status == 200
        for _, writer in [*half_heads, *keyed]:
            writer.close()


async def test_an_idle_unkeyed_connection_gives_way_without_an_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_door, "YIELD_AFTER_S", 0.0)  # (gives way at once: no grace to wait out)
    async with door(connections_max=2, keyed_reserve=1) as proxy:
        answer, (idle_reader, idle_writer) = await proxy.ask(HEALTH)  # the one unkeyed slot, now idle
        assert answer.status == 200
        answer, (reader, writer) = await proxy.ask(HEALTH)
        assert answer.status == 200
        assert await closed(idle_reader)  # closed, with no answer nobody asked for
        for other in (idle_writer, writer):
            other.close()


async def test_an_unkeyed_request_being_answered_does_not_give_way_and_the_reserve_stays_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Without keys nothing is ever keyed: the one unkeyed slot is held by a request waiting for
    # admission, which cannot be pushed out, and the slot kept for keyed connections stays free:
    # the next connection waits, unread, for room that does not come, and is refused.
    monkeypatch.setattr(_door, "WAIT_FOR_ROOM_S", 0.05)
    async with door(keys=False, connections_max=2, keyed_reserve=1) as proxy:
        proxy.router.gate = asyncio.Event()
        reader, writer = await proxy.connect()
        writer.write(chat_request("waits"))
        await eventually(lambda: proxy.router.waiting == 1, "the request waits")
        refused_reader, refused_writer = await proxy.connect()
        refused_writer.write(HEALTH)
        await closed_by_the_door(refused_reader, 503, "too_many_connections")
        assert proxy.site.open_connections == 1
        proxy.router.gate.set()
        assert (await read_answer(reader)).status == 200
        for other in (writer, refused_writer):
            other.close()


async def test_a_burst_past_the_unkeyed_share_gets_in_as_the_first_connections_turn_keyed() -> None:
    # Clients that connect at once are all unkeyed until their heads are read: those past the share
    # wait, unread, and get in as the first ones show their keys (streams_scale.py's 1,000 at once).
    async with door(connections_max=8, keyed_reserve=4) as proxy:
        connections = [await proxy.connect() for _ in range(8)]  # 4 in, 4 waiting for room
        await eventually(lambda: proxy.site.open_connections == 4, "the share filled")
        for _, writer in connections:
            writer.write(MODELS)
        for reader, _ in connections:
            assert (await read_answer(reader)).status == 200
        assert (proxy.site.open_connections, proxy.site.keyed_connections) == (8, 8)
        for _, writer in connections:
            writer.close()


async def test_refused_connections_wait_for_their_heads_boundedly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_door, "REFUSED_WAITING_MAX", 1)
    monkeypatch.setattr(_door, "REFUSED_LINGER_S", 0.3)
    async with door(connections_max=2, keyed_reserve=0) as proxy:
        kept = []
        for _ in range(2):
            answer, connection = await proxy.ask(MODELS)
            assert answer.status == 200
            kept.append(connection)
        waiting_reader, waiting_writer = await proxy.connect()  # refused: waits for its head...
        at_once_reader, at_once_writer = await proxy.connect()  # ... and, one past the most that wait:
        assert await closed(at_once_reader)  # closed at once, without an answer
        assert await closed(waiting_reader)  # the head never came: closed after REFUSED_LINGER_S
        waiting_writer.write(HEALTH)  # (too late: nothing answers it)
        for _, writer in [*kept, (waiting_reader, waiting_writer), (at_once_reader, at_once_writer)]:
            writer.close()


async def test_an_idle_kept_alive_connection_closes_after_the_keepalive_timeout() -> None:
    async with door(keepalive_timeout=0.3) as proxy:
        answer, (reader, writer) = await proxy.ask(HEALTH)
        assert answer.status == 200
        assert await closed(reader)  # closed without an answer (aiohttp's keep-alive timeout)
        writer.close()


# ---------------------------------------------------------------- settings

def test_key_accepted_outside_a_door_request_does_nothing() -> None:
    key_accepted()  # (authorize also runs for the front's requests, and in tests without a site)


def test_door_settings_are_checked() -> None:
    with pytest.raises(CapyError) as caught:
        DoorSettings(connections_max=4, keyed_reserve=4)
    assert caught.value.code == "invalid_door_settings" and caught.value.status == 400
    with pytest.raises(CapyError) as caught:
        DoorSettings(head_timeout=0)
    assert caught.value.code == "invalid_door_settings"


def test_the_config_files_door_section_reaches_the_daemons_door(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("door:\n  head_timeout: 2s\n  connections_max: 100\n  per_address_max: 10\n"
                    "  keyed_reserve: 20\n  keepalive_timeout: 30s\n")
    config = config_file.build_config(path=path, required=True, overrides=config_file.Overrides())
    assert Daemon(config).door_settings() == DoorSettings(head_timeout=2.0, connections_max=100, per_address_max=10,
                                                          keyed_reserve=20, keepalive_timeout=30.0)
    # Without keys no connection is ever keyed: nothing is kept for keyed ones.
    assert Daemon(config, no_auth=True).door_settings().keyed_reserve == 0
    assert Daemon(DaemonConfig()).door_settings() == DoorSettings()
    path.write_text("door:\n  connections_max: 10\n  keyed_reserve: 10\n")
    with pytest.raises(config_file.ConfigError, match="keyed_reserve \\(10\\) must be less than connections_max"):
        config_file.load_config(path, required=True)
    old, new = config_file.parse_config("", "a"), config_file.parse_config("door:\n  head_timeout: 3s\n", "b")
    assert config_file.changes(old, new) == ([], ["door"])  # the listener's site is made at start


def test_a_descriptor_limit_too_low_for_the_cap_lowers_it_and_the_keyed_share_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import resource
    from capyctl import descriptors
    fits = 300  # client connections that a limit of this many descriptors holds (descriptors.py)
    limit = descriptors.descriptors_needed(fits)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit, limit))
    daemon = Daemon(DaemonConfig())
    door = daemon.door_settings()
    assert daemon.connections.lowered and door.connections_max == fits
    assert door.keyed_reserve == 256 * fits // 1024 and door.per_address_max == 256
