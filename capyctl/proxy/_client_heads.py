"""Which client requests the proxy's front answers itself, and which it hands to aiohttp's server.

This is the one place that decides. The front (``_client_side``) answers a request itself when
:func:`read_head` returns its head, and gives the connection, with every byte not yet answered,
to aiohttp's server at the first request for which it returns None. It returns a head only for:

- HTTP/1.1, a head of at most ``HEAD_MAX`` bytes (aiohttp's own limit on one line: a longer head
  goes to aiohttp, which then answers it exactly as it answers anything long), in ASCII (aiohttp
  reads header values as UTF-8, the front as Latin-1: the same only for ASCII), with at most
  ``HEADERS_MAX`` headers, none of them repeated (aiohttp refuses some repeats and joins others);
- a POST to a JSON route of the table with a body of one Content-Length (digits only) of at most
  ``max_body``, or a GET of one of ``GET_ROUTES`` without a body; the query is dropped, as
  aiohttp's routes drop it;
- a Host; no Transfer-Encoding, Expect, Content-Encoding other than identity, Upgrade, or
  Sec-WebSocket-Key1 (which aiohttp refuses);
- a head llhttp (httptools) reads as exactly one message beginning, whose head ends where the
  blank line does: no body byte and no second message inside it.

A head not yet whole goes to aiohttp as soon as its first bytes cannot begin one the front reads
(:func:`may_begin_head`), so that aiohttp answers a malformed one at once, as it does on its own.

Everything else (a form upload, /v1/systemone, a stored response, an unknown route, a chunked or
compressed body, a head llhttp refuses...) is aiohttp's. ``CAPYCTL_PROXY_FRONT=aiohttp``, an access
log (``CAPYCTL_ACCESS_LOG=1``) or a platform without httptools send every request there
(:func:`front_answers_any`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aiohttp import web

from ._app import GET_ROUTES, STATE
from ._routes import JSON_ROUTES

try:
    import httptools
except ImportError:  # pragma: no cover - a platform without its wheel: aiohttp's server alone
    httptools = None

# aiohttp's limit on a request line and on one header line (max_line_size and max_field_size,
# 8190 by default: aiohttp/web_protocol.py RequestHandler, applied in aiohttp/http_parser.py): a
# head the front reads is never longer, so the front accepts nothing aiohttp refuses for its length.
HEAD_MAX = 8190

# Headers a head the front reads may have: fewer than aiohttp's max_headers (128, RequestHandler),
# so that aiohttp refuses nothing the front takes for their number.
HEADERS_MAX = 100
# Headers that send a request to aiohttp whatever their value: Transfer-Encoding and Content-Encoding
# other than identity (bodies the front does not decode), Expect; Sec-WebSocket-Key1, which aiohttp's
# parser refuses (aiohttp/http_parser.py, HttpRequestParser.feed_data: InvalidHeader).
_LEFT_TO_AIOHTTP = frozenset({"transfer-encoding", "expect", "sec-websocket-key1"})


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What one request head the front answers says, as the forwarding code needs it."""

    size: int  # bytes of the head, its blank line included
    method: str  # "POST" (a JSON route) or "GET" (a GET route)
    path: str  # without the query
    headers: dict[str, str]  # lower-case names
    content_length: int
    close: bool  # Connection: close


def front_answers_any(app: web.Application) -> bool:
    """Whether the front reads requests at all for ``app``: a proxy app, httptools installed, not
    turned off (``CAPYCTL_PROXY_FRONT=aiohttp``) and no access log asked for (aiohttp writes it)."""
    return (httptools is not None and STATE in app
            and os.environ.get("CAPYCTL_PROXY_FRONT", "auto") != "aiohttp"
            and os.environ.get("CAPYCTL_ACCESS_LOG") != "1")


class _HeadReader:
    """httptools' callbacks for one head: what llhttp read, and how many messages it began."""

    __slots__ = ("url", "headers", "repeated", "messages", "heads", "body_seen")

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.repeated = False  # a header came twice
        self.messages = 0
        self.heads = 0
        self.body_seen = False

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("ascii").lower()
        self.repeated = self.repeated or key in self.headers
        self.headers[key] = value.decode("ascii")

    def on_headers_complete(self) -> None:
        self.heads += 1

    def on_body(self, body: bytes) -> None:
        self.body_seen = True


def may_begin_head(data: bytes) -> bool:
    """Whether ``data``, the first bytes of a head not yet whole, may still become one the front
    reads: False once they are too long, not ASCII, or refused by llhttp."""
    if httptools is None or len(data) >= HEAD_MAX or not data.isascii():
        return False
    try:
        httptools.HttpRequestParser(_HeadReader()).feed_data(data)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return False
    return True


def read_head(data: bytes, max_body: int) -> RequestHead | None:
    """The head of a request the front answers, ``data`` being its bytes up to and including its
    blank line; None for any request the front leaves to aiohttp (the module's docstring)."""
    if httptools is None or len(data) > HEAD_MAX or not data.isascii():
        return None
    reader = _HeadReader()
    parser = httptools.HttpRequestParser(reader)
    try:
        parser.feed_data(data)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):  # (the latter is no HttpParserError)
        return None
    # Exactly one message began and its head ended inside ``data`` with no body byte read: a
    # parser that took a bare LF for the blank line would otherwise make two requests one.
    if (reader.messages != 1 or reader.heads != 1 or reader.body_seen or reader.repeated
            or len(reader.headers) > HEADERS_MAX or parser.get_http_version() != "1.1" or parser.should_upgrade()):
        return None
    method = parser.get_method()
    path = reader.url.partition(b"?")[0].decode("latin-1")
    headers = reader.headers
    length = headers.get("content-length", "0" if method == b"GET" else "")
    # No Host: RFC 9112 3.2 wants a 400, which aiohttp's server answers.
    if ("host" not in headers or not _LEFT_TO_AIOHTTP.isdisjoint(headers)
            or headers.get("content-encoding", "identity").strip().lower() != "identity"
            # (llhttp takes any number of leading zeros; int() refuses past 4300 digits)
            or not (length.isascii() and length.isdigit() and len(length) <= 18)):
        return None
    content_length = int(length)
    if method == b"POST" and path in JSON_ROUTES and content_length <= max_body:
        pass
    elif method == b"GET" and path in GET_ROUTES and content_length == 0:
        pass
    else:
        return None
    connection = {token.strip() for token in headers.get("connection", "").lower().split(",")}
    if "upgrade" in connection:
        return None
    return RequestHead(len(data), method.decode(), path, headers, content_length, "close" in connection)
