"""Conformance corpus of the proxy's HTTP/1.1 reading (issue 32, item 4).

Raw request bytes, sent over loopback TCP sockets to the proxy served twice in this process as
the daemon serves it (``serve``): once with its front (capyctl/proxy/_client_side.py, which answers
the requests ``_client_heads.read_head`` accepts and hands the connection to aiohttp's server at
the first it does not), and once by aiohttp's server alone (``CAPYCTL_PROXY_FRONT=aiohttp``, read
when ``serve`` starts). Same app, same keys, same fake Router: its one model cannot be woken, so a
keyed, well-formed chat completion is answered 503 ``wake_failed`` without an engine, a body read
wrong is a 400 ``invalid_json``, a key read wrong a 401, and GET /health and /v1/models are 200s.

What is compared, per connection: the answers in order, each as (status, the JSON error code for
an error that has one), and whether the server closed the connection after them. Reason phrases,
error texts and headers are not: a client cannot tell two servers apart by them. Each case goes out
in one write and request by request; aiohttp's own answer may depend on that (it answers none of
the requests of one read when a later one in it is refused), so the front's answer, either way,
must be one of aiohttp's. aiohttp's server is the reference: where the front answers otherwise,
the case fails, and it is the front to fix.

Smuggling classes (CL.CL, CL.TE, TE.CL, Transfer-Encoding obfuscations), obs-fold, bare LF and CR,
NUL, Host, HTTP/1.0, Expect, Upgrade, pipelining with a changed or dropped key, odd Content-Length
forms and aiohttp's limits follow aiohttp's request parser as installed (aiohttp 3.14):
aiohttp/_http_parser.pyx, the C parser its server uses (llhttp, strict for requests; a target of
at most max_line_size bytes and a header of at most max_field_size, both 8190; at most 128
headers; a NUL in a value, a repeated header of http_parser.py's SINGLETON_HEADERS,
Sec-WebSocket-Key1, or no Host in HTTP/1.1 refused), aiohttp/http_parser.py for those lists and
the pure-Python parser's twin checks, and aiohttp/web_protocol.py for the limits' defaults
(RequestHandler: 8190, 128, 8190).

The second part is a hypothesis differential of ``_client_heads.read_head``: every head the front
reads itself must be read by llhttp's own parser (httptools.HttpRequestParser), and by the parser
of aiohttp's server, with its body, as exactly that one message.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Iterator
from unittest import mock

import httptools
import pytest
from aiohttp import web
from aiohttp.http_parser import HttpRequestParser as AiohttpRequestParser  # its C parser where built
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from capyctl import eventloop
from capyctl.proxy import KeyGrant, StaticKeys, build_app, serve
from capyctl.proxy._client_heads import read_head
from tests.unit.test_fuzz_proxy import UnwakeableRouter  # one model, parked, whose wake fails (503)

KEY, OTHER_KEY = "sk-conformance", "sk-conformance-other"
MAX_BODY = 64 * 1024
BODY = b'{"model":"m","messages":[]}'
# Silence after the last byte read for which a connection still open is taken to have said all it
# will (loopback; the fake router answers at once), and before its first byte: the longer wait, for a
# busy machine. Both servers' connections idle out at 75 s.
QUIET_S = 1.0
FIRST_BYTE_S = 3.0
PAUSE_S = 2.0  # the longest wait for a part's answer before the next part of a case sent part by part
AT_ONCE = 96  # conversations at a time: each server's share is under its listen backlog (128)
HANG_GUARD_S = 120.0  # all of them; only reached when a server misbehaves


# ---------------------------------------------------------------- the requests

def _request(line: bytes, *fields: bytes, body: bytes = b"", eol: bytes = b"\r\n") -> bytes:
    return line + eol + b"".join(field + eol for field in fields) + eol + body


def post(*fields: bytes, body: bytes = BODY, length: bytes | None = None, key: bytes | None = KEY.encode(),
         host: bytes | None = b"Host: proxy", version: bytes = b"HTTP/1.1", eol: bytes = b"\r\n") -> bytes:
    """A chat completion: Host, the key, a Content-Length (``length``, else the body's), ``fields``."""
    head = [host] if host is not None else []
    if key is not None:
        head.append(b"Authorization: Bearer " + key)
    head.append(b"Content-Length: " + (length if length is not None else b"%d" % len(body)))
    return _request(b"POST /v1/chat/completions " + version, *head, *fields, body=body, eol=eol)


def get(path: bytes = b"/health", *fields: bytes, host: bytes | None = b"Host: proxy",
        version: bytes = b"HTTP/1.1", eol: bytes = b"\r\n") -> bytes:
    head = [host] if host is not None else []
    return _request(b"GET " + path + b" " + version, *head, *fields, eol=eol)


def post_bare(*fields: bytes, body: bytes = BODY) -> bytes:
    """A chat completion with Host, the key and ``fields`` only: the framing is the case's."""
    return _request(b"POST /v1/chat/completions HTTP/1.1", b"Host: proxy", b"Authorization: Bearer " + KEY.encode(),
                    *fields, body=body)


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


HEALTH = get()  # the second request of a pipeline: how many requests a server read shows in it
CHUNKED_THEN_HEALTH = chunked(BODY) + HEALTH  # CL covers it all; TE ends the body before HEALTH
KEYED = b"Authorization: Bearer " + KEY.encode()
# aiohttp's max_field_size (8190) counts a header's name and value together for the first header
# only: for the others _process_header has reset the name's size when the value's callback checks
# it (aiohttp/_http_parser.pyx, cb_on_header_field then _on_header_field), so the value alone counts.
VALUE_AT_LIMIT = b"X-Long: " + b"a" * 8190
VALUE_PAST_LIMIT = VALUE_AT_LIMIT + b"a"
FIRST_AT_LIMIT = b"X-Long: " + b"a" * (8190 - len(b"X-Long"))  # name + value = 8190
FIRST_PAST_LIMIT = FIRST_AT_LIMIT + b"a"


def _first_header(request: bytes, field: bytes) -> bytes:
    """``request`` with ``field`` as its first header."""
    line, _, rest = request.partition(b"\r\n")
    return line + b"\r\n" + field + b"\r\n" + rest


def _te_with_length(te_field: bytes, *, te_first: bool = False) -> tuple[bytes, ...]:
    """CL.TE / TE.CL: a Content-Length covering a chunked body and a request after it, and ``te_field``;
    sent in two parts as a server reading by TE would see the requests."""
    length = b"Content-Length: %d" % len(CHUNKED_THEN_HEALTH)
    fields = (te_field, length) if te_first else (length, te_field)
    request = post_bare(*fields, body=CHUNKED_THEN_HEALTH)
    return request[:-len(HEALTH)], HEALTH


# Each case is the parts of what the client sends: its requests, in order (or, where noted, the bytes
# as a server reading by one framing splits them). The parts go out in one write, and one at a time.
CASES: dict[str, tuple[bytes, ...]] = {
    # references: what both must answer alike before anything odd
    "baseline-post-then-get": (post(), HEALTH),
    "baseline-models": (get(b"/v1/models", KEYED),),
    "baseline-post-with-query": (post().replace(b"completions ", b"completions?x=1 ", 1), HEALTH),
    "baseline-connection-close": (post(b"Connection: close"),),
    "baseline-128-headers": (post(*(b"X-H%d: v" % i for i in range(125))), HEALTH),
    "connection-close-then-pipelined": (post(b"Connection: close"), HEALTH),
    "connection-close-get-then-pipelined": (get(b"/health", b"Connection: close"), HEALTH),
    # CL.CL
    "cl-cl-same": (post_bare(b"Content-Length: 27", b"Content-Length: 27"), HEALTH),
    "cl-cl-different": (post_bare(b"Content-Length: 27", b"Content-Length: 5"), HEALTH),
    "cl-cl-comma-list": (post_bare(b"Content-Length: 27, 27"), HEALTH),
    # CL.TE and TE.CL
    "cl-te": _te_with_length(b"Transfer-Encoding: chunked"),
    "te-cl": _te_with_length(b"Transfer-Encoding: chunked", te_first=True),
    "te-chunked-alone": (post_bare(b"Transfer-Encoding: chunked", body=chunked(BODY)), HEALTH),
    "te-te-two-headers": (post_bare(b"Transfer-Encoding: chunked", b"Transfer-Encoding: identity",
                                    body=chunked(BODY)), HEALTH),
    # Transfer-Encoding obfuscations, each beside a Content-Length a server that misses the TE uses
    "te-leading-space": _te_with_length(b"Transfer-Encoding:  chunked"),
    "te-chunked-identity": _te_with_length(b"Transfer-Encoding: chunked, identity"),
    "te-identity-chunked": _te_with_length(b"Transfer-Encoding: identity, chunked"),
    "te-xchunked": _te_with_length(b"Transfer-Encoding: xchunked"),
    "te-capital-chunked": _te_with_length(b"Transfer-Encoding: Chunked"),
    "te-tab-before-value": _te_with_length(b"Transfer-Encoding:\tchunked"),
    "te-space-before-colon": _te_with_length(b"Transfer-Encoding : chunked"),
    "te-obs-folded-value": _te_with_length(b"Transfer-Encoding:\r\n chunked"),
    "te-on-obs-folded-line": _te_with_length(b"X-Pad: a\r\n Transfer-Encoding: chunked"),
    "te-vertical-tab": _te_with_length(b"Transfer-Encoding:\x0bchunked"),
    # obs-fold in other headers
    "obs-fold-plain-header": (post(b"X-Pad: a\r\n b"), HEALTH),
    "obs-fold-authorization": (post(b"Authorization: Bearer\r\n " + KEY.encode(), key=None), HEALTH),
    "obs-fold-content-length": (post_bare(b"Content-Length:\r\n 27"), HEALTH),
    "obs-fold-first-header": (post_bare(b" X-Pad: a", b"Content-Length: 27"), HEALTH),
    "obs-fold-get": (get(b"/health", b"X-Pad: a\r\n\tb"), HEALTH),
    # line endings
    "bare-lf-everywhere": (post(eol=b"\n"), HEALTH),
    "bare-lf-everywhere-get": (get(eol=b"\n"), HEALTH),
    # ... with nothing after them: no CRLF CRLF ever comes
    "bare-lf-alone": (get(eol=b"\n"),),
    "bare-lf-alone-post": (post(eol=b"\n"),),
    "head-ends-crlf-lf-alone": (post().replace(b"\r\n\r\n", b"\r\n\n", 1),),
    "bare-lf-one-header": (post().replace(b"Host: proxy\r\n", b"Host: proxy\n", 1), HEALTH),
    "bare-lf-request-line": (post().replace(b"HTTP/1.1\r\n", b"HTTP/1.1\n", 1), HEALTH),
    "bare-cr-in-header": (post(b"X-Pad: a\rb"), HEALTH),
    "bare-cr-line-end": (post().replace(b"Host: proxy\r\n", b"Host: proxy\r", 1), HEALTH),
    # a head ending in CRLF LF, its body and a second request: never one request of the two heads
    "head-ends-crlf-lf": (post().replace(b"\r\n\r\n", b"\r\n\n", 1), HEALTH),
    "get-head-ends-crlf-lf": (get().replace(b"\r\n\r\n", b"\r\n\n", 1), HEALTH),
    # NUL and other control bytes
    "nul-in-header-value": (post(b"X-Pad: a\x00b"), HEALTH),
    "nul-in-authorization": (post(key=KEY.encode() + b"\x00"), HEALTH),
    "nul-in-target": (get(b"/health\x00"), HEALTH),
    "nul-in-query": (get(b"/health?a=\x00"), HEALTH),
    "nul-in-header-name": (post(b"X-P\x00ad: a"), HEALTH),
    "del-in-header-value": (post(b"X-Pad: a\x7fb"), HEALTH),
    "high-bytes-in-header-value": (post(b"X-Pad: caf\xc3\xa9 \xff"), HEALTH),
    "high-bytes-in-query": (get(b"/health?caf\xc3\xa9"), HEALTH),
    # Host
    "two-hosts-same": (post(b"Host: proxy"), HEALTH),
    "two-hosts-different": (post(b"Host: elsewhere"), HEALTH),
    "no-host": (post(host=None), HEALTH),
    "no-host-get": (get(host=None), HEALTH),
    "empty-host": (post(host=b"Host:"), HEALTH),
    # repeated headers: those aiohttp takes one of (http_parser.py SINGLETON_HEADERS), and others
    "two-content-types": (post(b"Content-Type: application/json", b"Content-Type: application/json"), HEALTH),
    "two-user-agents": (post(b"User-Agent: a", b"User-Agent: b"), HEALTH),
    "two-user-agents-get": (get(b"/health", b"User-Agent: a", b"User-Agent: b"), HEALTH),
    "two-authorizations": (post(KEYED), HEALTH),
    "two-authorizations-other-second": (post(b"Authorization: Bearer " + OTHER_KEY.encode()), HEALTH),
    "two-connection-headers": (post(b"Connection: keep-alive", b"Connection: close"),),
    "sec-websocket-key1": (post(b"Sec-WebSocket-Key1: 1"), HEALTH),
    "129-headers": (post(*(b"X-H%d: v" % i for i in range(126))), HEALTH),
    # HTTP/1.0
    "http10-no-keepalive": (post(version=b"HTTP/1.0"), HEALTH),
    "http10-keepalive": (post(b"Connection: keep-alive", version=b"HTTP/1.0"), HEALTH),
    "http10-get-keepalive": (get(b"/health", b"Connection: keep-alive", version=b"HTTP/1.0"), HEALTH),
    "http10-no-host": (post(host=None, version=b"HTTP/1.0"), HEALTH),
    "http2-version": (post(version=b"HTTP/2.0"), HEALTH),
    # Expect and Upgrade
    "expect-100-continue": (post(b"Expect: 100-continue"), HEALTH),
    "expect-unknown": (post(b"Expect: 200-ok"), HEALTH),
    "upgrade-websocket": (get(b"/health", b"Connection: Upgrade", b"Upgrade: websocket",
                              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", b"Sec-WebSocket-Version: 13"), HEALTH),
    "upgrade-h2c": (get(b"/health", b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c",
                        b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"), HEALTH),
    "upgrade-h2c-post": (post(b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c",
                              b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"), HEALTH),
    "upgrade-without-connection": (post(b"Upgrade: websocket"), HEALTH),
    # pipelining with the key changed or dropped
    "pipeline-key-changed": (post(), post(key=OTHER_KEY.encode()), post()),
    "pipeline-key-unknown": (post(), post(key=b"sk-nobody"), post()),
    "pipeline-key-dropped": (post(), post(key=None), post()),
    "pipeline-three-gets": (HEALTH, get(b"/v1/models", KEYED), HEALTH),
    # Content-Length forms
    "cl-plus": (post(length=b"+27"), HEALTH),
    "cl-minus-one": (post(length=b"-1"), HEALTH),
    "cl-leading-space": (post(length=b" 27"), HEALTH),
    "cl-trailing-space": (post(length=b"27 "), HEALTH),
    "cl-leading-zeros": (post(length=b"0027"), HEALTH),
    "cl-hex": (post(length=b"0x1b"), HEALTH),
    "cl-two-numbers": (post(length=b"27 27"), HEALTH),
    "cl-empty": (post(length=b""), HEALTH),
    "cl-huge": (post(length=b"9" * 30), HEALTH),
    # (split where the Content-Length ends the body: the rest is a second request, not JSON)
    "cl-shorter-than-body": (post(length=b"5")[:-22], BODY[5:] + HEALTH),
    "cl-over-max-body": (post(length=b"%d" % (MAX_BODY + 1)),),
    "get-with-body": (get(b"/health", b"Content-Length: 5") + b"hello", HEALTH),
    # aiohttp's limits (max_field_size, max_line_size: 8190)
    "header-value-at-limit": (post(VALUE_AT_LIMIT), HEALTH),
    "header-value-past-limit": (post(VALUE_PAST_LIMIT), HEALTH),
    "get-header-value-past-limit": (get(b"/health", VALUE_PAST_LIMIT), HEALTH),
    "first-header-at-limit": (_first_header(post(), FIRST_AT_LIMIT), HEALTH),
    "first-header-past-limit": (_first_header(post(), FIRST_PAST_LIMIT), HEALTH),
    "target-at-line-limit": (get(b"/health?" + b"a" * (8190 - len(b"/health?"))), HEALTH),
    "target-past-line-limit": (get(b"/health?" + b"a" * (8191 - len(b"/health?"))), HEALTH),
    "head-over-8190-in-small-headers": (post(*(b"X-H%d: %s" % (i, b"v" * 90) for i in range(90))), HEALTH),
    # the request line
    "lowercase-method": (post().replace(b"POST", b"post", 1), HEALTH),
    "absolute-form-target": (get(b"http://proxy/health"), HEALTH),
    "two-spaces-in-request-line": (post().replace(b"POST /", b"POST  /", 1), HEALTH),
    "leading-empty-line": (b"\r\n" + post(), HEALTH),
    "fragment-in-target": (get(b"/health#x"), HEALTH),
    "garbage-then-request": (b"hello\r\n\r\n", HEALTH),
    "garbage-alone": (b"hello\r\n",),
}


# ---------------------------------------------------------------- talking to the servers

def _answers(raw: bytes) -> list[tuple[int, str | None]]:
    """(status, the JSON error code when it has one) of each answer in ``raw``, in order."""
    answers: list[tuple[int, str | None]] = []
    current: dict = {}

    class Reader:
        def on_message_begin(self) -> None:
            current.clear()
            current.update(headers={}, body=b"")

        def on_header(self, name: bytes, value: bytes) -> None:
            current["headers"][name.decode("latin-1").lower()] = value.decode("latin-1")

        def on_body(self, body: bytes) -> None:
            current["body"] += body

        def on_message_complete(self) -> None:
            status = parser.get_status_code()
            code = None
            if status >= 400 and current["headers"].get("content-type", "").startswith("application/json"):
                code = json.loads(current["body"]).get("error", {}).get("code")
            answers.append((status, code))

    parser = httptools.HttpResponseParser(Reader())
    parser.feed_data(raw)
    return answers


@dataclass(frozen=True)
class Conversation:
    answers: tuple[tuple[int, str | None], ...]  # (status, JSON error code), in order
    closed: bool  # the server closed the connection (or reset it)
    raw: bytes  # what it said, for the failure's message

    def heard(self) -> tuple:
        """What a client can tell apart."""
        return self.answers, self.closed

    def __str__(self) -> str:
        return f"{list(self.answers)} {'closed' if self.closed else 'open'}"


async def _converse(port: int, parts: tuple[bytes, ...]) -> Conversation:
    """Send ``parts``, each once the one before was answered (or after PAUSE_S without an answer),
    so that the server reads each on its own; read until the server closes, or is quiet (QUIET_S,
    FIRST_BYTE_S before it said anything) after the last part."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = bytearray()
    arrived = asyncio.Event()  # bytes came, or the connection ended

    async def read() -> None:
        try:
            while chunk := await reader.read(65536):
                raw.extend(chunk)
                arrived.set()
        finally:
            arrived.set()

    async def more(timeout: float) -> bool:
        """Whether bytes came (or the connection ended) within ``timeout``."""
        arrived.clear()
        if reading.done():
            return True
        try:
            await asyncio.wait_for(arrived.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    reading = asyncio.ensure_future(read())
    try:
        for index, part in enumerate(parts):
            if index:
                answered = len(_answers(bytes(raw)))
                deadline = asyncio.get_running_loop().time() + PAUSE_S
                while not reading.done() and len(_answers(bytes(raw))) == answered:
                    if not await more(deadline - asyncio.get_running_loop().time()):
                        break
            if reading.done():  # closed: what is left cannot be sent
                break
            writer.write(part)
        while not reading.done() and await more(QUIET_S if raw else FIRST_BYTE_S):
            pass
        closed = reading.done()
        if closed and not isinstance(reading.exception() or ConnectionError(), ConnectionError):
            raise reading.exception()  # (a reset is a close; anything else is this test's bug)
    finally:
        reading.cancel()
        writer.close()
    return Conversation(tuple(_answers(bytes(raw))), closed, bytes(raw))


class Servers:
    """The proxy served with its front and by aiohttp's server alone, on one loop (the daemon's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runner = asyncio.Runner(loop_factory=eventloop.loop_factory())
        self.router = UnwakeableRouter()
        keys = StaticKeys({KEY: KeyGrant("conformance"),
                           OTHER_KEY: KeyGrant("other", models=frozenset({"other"}))})

        async def start() -> tuple[web.AppRunner, int]:
            runner = await serve(build_app(self.router, keys, max_body=MAX_BODY), host_port="127.0.0.1:0")
            return runner, runner.addresses[0][1]

        for either_turns_the_front_off in ("CAPYCTL_PROXY_FRONT", "CAPYCTL_ACCESS_LOG"):
            monkeypatch.delenv(either_turns_the_front_off, raising=False)
        self.front, self.front_port = self.runner.run(start())
        monkeypatch.setenv("CAPYCTL_PROXY_FRONT", "aiohttp")
        self.aiohttp, self.aiohttp_port = self.runner.run(start())

    def converse_all(self, cases: dict[str, tuple[bytes, ...]]) -> dict[str, dict[str, Conversation]]:
        """Every case on both servers, its parts in one write and one by one, all at once:
        {case: {"front": ..., "front split": ..., "aiohttp": ..., "aiohttp split": ...}}."""
        ways = {"front": (self.front_port, False), "front split": (self.front_port, True),
                "aiohttp": (self.aiohttp_port, False), "aiohttp split": (self.aiohttp_port, True)}

        async def go():
            at_once = asyncio.Semaphore(AT_ONCE)

            async def converse(port: int, parts: tuple[bytes, ...]) -> Conversation:
                async with at_once:
                    return await _converse(port, parts)
            talks = [converse(port, parts if split else (b"".join(parts),))
                     for parts in cases.values() for port, split in ways.values()]
            return await asyncio.wait_for(asyncio.gather(*talks), HANG_GUARD_S)
        heard = iter(self.runner.run(go()))
        return {case: {way: next(heard) for way in ways} for case in cases}

    def close(self) -> None:
        self.runner.run(self.front.cleanup())
        self.runner.run(self.aiohttp.cleanup())
        self.runner.close()


@pytest.fixture(scope="module")
def conversations() -> Iterator[dict[str, dict[str, Conversation]]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        servers = Servers(monkeypatch)
    try:
        yield servers.converse_all(CASES)
    finally:
        servers.close()


@pytest.mark.parametrize("case", list(CASES))
def test_the_front_answers_as_aiohttps_server(conversations, case):
    """What the front says, its bytes come in one write or request by request, is what aiohttp's
    server says for the one or the other: which of them a client gets from aiohttp depends on how
    its bytes arrive (aiohttp answers none of the requests it read in one read when a later one in
    it is refused), so a client cannot tell the front from aiohttp by it."""
    heard = conversations[case]
    aiohttp_said = {heard["aiohttp"].heard(), heard["aiohttp split"].heard()}
    told = "\n".join(f"{way:>14}: {said}\n{'':>16}{said.raw[:400]!r}" for way, said in heard.items())
    alike = heard["front"].heard() in aiohttp_said and heard["front split"].heard() in aiohttp_said
    assert alike, f"{case}:\n{told}"


def test_the_references_are_what_this_file_says(conversations):
    """The corpus means something only if its plain requests get the answers it is built on."""
    def said(case, way="aiohttp"):
        return conversations[case][way].heard()
    wake_failed, ok = (503, "wake_failed"), (200, None)
    assert said("baseline-post-then-get") == ((wake_failed, ok), False)
    assert said("baseline-models") == ((ok,), False)
    assert said("baseline-connection-close") == ((wake_failed,), True)
    assert said("baseline-128-headers") == ((wake_failed, ok), False)
    assert said("pipeline-key-changed") == ((wake_failed, (404, "model_not_found"), wake_failed), False)
    assert said("pipeline-key-dropped") == ((wake_failed, (401, "invalid_api_key"), wake_failed), False)
    assert said("header-value-at-limit") == ((wake_failed, ok), False)
    assert said("first-header-at-limit") == ((wake_failed, ok), False)
    assert said("target-at-line-limit") == ((ok, ok), False)
    # aiohttp's parser refuses these: a 400 of its own (no JSON), and the connection closed
    for case in ("cl-cl-same", "cl-te", "te-cl", "bare-lf-everywhere", "head-ends-crlf-lf", "nul-in-header-value",
                 "no-host", "two-hosts-same", "129-headers", "header-value-past-limit", "first-header-past-limit",
                 "target-past-line-limit"):
        assert said(case) == (((400, None),), True), case
    # ... and the front hands them to it: a refusal of aiohttp's names aiohttp's server
    assert b"Server: " in conversations["cl-te"]["front"].raw
    assert b"Server: " not in conversations["baseline-post-then-get"]["front"].raw  # the front's own answers


# ---------------------------------------------------------------- read_head against llhttp (hypothesis)

HEADS = settings(max_examples=1000, deadline=None)
ROUTE_LINES = (b"POST /v1/chat/completions", b"POST /v1/embeddings", b"POST /v1/chat/completions?stream=1",
               b"GET /health", b"GET /v1/models", b"GET /health?x=1")
# Headers of the front's requests, and those that send a request to aiohttp whatever else it says.
FIELDS = (b"Authorization: Bearer " + KEY.encode(), b"Content-Type: application/json", b"Connection: keep-alive",
          b"Connection: close", b"User-Agent: a", b"X-Pad: a b", b"Accept: */*", b"Content-Encoding: identity",
          b"X-Api-Key: " + KEY.encode(), b"Host: other", b"Connection: close, te", b"Sec-WebSocket-Key1: 1")
AIOHTTPS = (b"Transfer-Encoding: chunked", b"Expect: 100-continue", b"Upgrade: h2c", b"Content-Encoding: gzip")
ODD_LENGTHS = (b"0", b"027", b"+27", b"-1", b" 27", b"27 ", b"0x1b", b"27 27", b"27,27", b"", b"1e2",
               b"9" * 19, b"9" * 30, b"\t27", b"2\x007")
# What is inserted: the bytes a head's syntax turns on, and a few ordinary ones.
INSERTS = (b"\r", b"\n", b"\r\n", b"\r\n\r\n", b"\r\n ", b"\r\n\t", b"\x00", b" ", b"\t", b":", b",", b"a", b"0",
           b"\x7f", b"\xff", b"\x0b", b"Content-Length: 5\r\n", b"Host: other\r\n", b"Transfer-Encoding: chunked\r\n")


@st.composite
def request_bytes(draw) -> bytes:
    """A head of the front's routes, often mutated, then maybe a body and the bytes of a second request."""
    line = draw(st.sampled_from(ROUTE_LINES))
    line += b" HTTP/1.0" if draw(st.integers(0, 9)) == 0 else b" HTTP/1.1"
    fields = draw(st.lists(st.sampled_from(FIELDS), max_size=5))
    if draw(st.integers(0, 9)):
        fields.append(b"Host: proxy")
    if draw(st.integers(0, 19)) == 0:  # around aiohttp's max_headers (128)
        fields += [b"X-H%d: v" % i for i in range(draw(st.integers(120, 130)))]
    if draw(st.integers(0, 5)) == 0:
        fields.append(draw(st.sampled_from(AIOHTTPS)))
    if line.startswith(b"POST") or draw(st.integers(0, 5)) == 0:
        length = st.integers(0, 40).map(lambda n: b"%d" % n)
        lengths = draw(st.lists(length if draw(st.integers(0, 2)) else st.sampled_from(ODD_LENGTHS) | length,
                                min_size=1, max_size=1 if draw(st.integers(0, 4)) else 2))
        fields += [b"Content-Length: " + value for value in lengths]
    fields = draw(st.permutations(fields))
    if fields and draw(st.integers(0, 4)) == 0:  # a header repeated
        fields.append(draw(st.sampled_from(fields)))
    data = bytearray(line + b"\r\n" + b"".join(field + b"\r\n" for field in fields) + b"\r\n")
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):  # bytes inserted or deleted
        at = draw(st.integers(0, len(data)))
        if draw(st.booleans()):
            data[at:at] = draw(st.sampled_from(INSERTS))
        else:
            del data[at:at + draw(st.integers(1, 3))]
    data += draw(st.sampled_from([b"", BODY, BODY[:5], chunked(BODY)]) | st.binary(max_size=40))
    data += draw(st.sampled_from([b"", HEALTH, b"GET /health HTTP/1.1\r\n", b"\r\n" + HEALTH, b"x"]))
    return bytes(data)


class _Llhttp:
    """httptools' callbacks: what llhttp read."""

    def __init__(self) -> None:
        self.begun = self.heads = self.completed = 0
        self.url = b""
        self.fields: list[tuple[str, str]] = []
        self.body = b""
        self.parser: httptools.HttpRequestParser | None = None
        self.keep_alive: bool | None = None  # (llhttp's flags are reset once the message is complete)

    def on_message_begin(self) -> None:
        self.begun += 1

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.heads += 1
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.completed += 1


def _llhttp(data: bytes) -> tuple[_Llhttp, httptools.HttpRequestParser]:
    reader = _Llhttp()
    parser = reader.parser = httptools.HttpRequestParser(reader)
    parser.feed_data(data)
    return reader, parser


def _joined(fields: list[tuple[str, str]]) -> dict[str, str]:
    """Header values by lower-case name, a repeated header's joined with ", " (RFC 9110 5.3)."""
    joined: dict[str, str] = {}
    for name, value in fields:
        joined[name] = f"{joined[name]}, {value}" if name in joined else value
    return joined


def _accepted(data: bytes):
    """The head ``read_head`` returns for ``data``'s first head, and the message it says that is
    (the head, then its Content-Length's bytes); None when there is no head or the front leaves it."""
    end = data.find(b"\r\n\r\n") + 4
    if end < 4:
        return None
    head = read_head(data[:end], MAX_BODY)
    if head is None:
        return None
    body = (data[end:] + b"x" * head.content_length)[:head.content_length]
    return head, end, data[:end] + body


@HEADS
@given(data=request_bytes())
def test_a_head_the_front_reads_is_one_message_to_llhttp(data):
    accepted = _accepted(data)
    event("read by the front" if accepted else "left to aiohttp")
    if accepted is None:
        return
    head, end, message = accepted
    note(f"sent: {data!r}\nread_head: {head}")
    llhttp, parser = _llhttp(message)  # raises what llhttp refuses
    assert (llhttp.begun, llhttp.heads, llhttp.completed) == (1, 1, 1), "one message, no second one begun"
    assert head.size == end
    assert (head.method, head.path) == (parser.get_method().decode(), llhttp.url.partition(b"?")[0].decode("latin-1"))
    assert parser.get_http_version() == "1.1" and not parser.should_upgrade()
    assert head.headers == _joined(llhttp.fields)
    assert head.content_length == len(llhttp.body)
    assert head.close == (not llhttp.keep_alive)
    # ... and that message ends where the front cuts it: its head at the blank line, its body after
    # content_length bytes.
    assert _llhttp(message[:end - 1])[0].heads == 0
    if head.content_length:
        short = _llhttp(message[:-1])[0]
        assert (short.heads, short.completed) == (1, 0)


@pytest.fixture(scope="module")
def idle_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop that never runs: aiohttp's parser makes its payload readers with one."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@settings(HEADS, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=request_bytes())
def test_a_head_the_front_reads_is_one_message_to_aiohttps_parser(idle_loop, data):
    """The same against the parser of aiohttp's server (its C parser, as web_protocol.RequestHandler
    makes it): the front must answer nothing aiohttp would refuse or read otherwise."""
    accepted = _accepted(data)
    if accepted is None:
        return
    head, end, message = accepted
    note(f"sent: {data!r}\nread_head: {head}")
    parser = AiohttpRequestParser(mock.Mock(), idle_loop, 2**16, max_line_size=8190, max_field_size=8190,
                                  max_headers=128)
    messages, upgraded, _ = parser.feed_data(message)  # raises what aiohttp refuses (a 400)
    assert len(messages) == 1 and not upgraded
    request, payload = messages[0]
    assert (head.method, head.path) == (request.method, request.path.partition("?")[0])
    assert request.version == (1, 1) and not request.upgrade and not request.chunked
    assert request.compression is None and request.should_close == head.close
    # The same bytes in each value: aiohttp decodes them as UTF-8 (surrogateescape), read_head as
    # latin-1; aiohttp drops a value's trailing blanks, llhttp keeps them (they mean nothing).
    assert {name: value.encode("latin-1").rstrip(b" \t") for name, value in head.headers.items()} == \
        {name: value.encode("utf-8", "surrogateescape") for name, value in
         _joined([(name.lower(), value) for name, value in request.headers.items()]).items()}
    assert payload.is_eof() and len(payload.read_nowait(-1)) == head.content_length
