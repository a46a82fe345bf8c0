"""What the door reads and writes on the wire itself (capyctl/proxy/_door.py): a client's address,
and the whole answer it sends a connection it closes past a limit."""

from __future__ import annotations

import asyncio
import http
from email.utils import formatdate

from ..errors import CapyError
from ._errors import error_parts


def closing_answer(error: CapyError) -> bytes:
    """A whole error answer that closes the connection, in the OpenAI error shape."""
    headers, body = error_parts(error)
    lines = [f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}",
             *(f"{name}: {value}" for name, value in headers.items()),
             f"Content-Length: {len(body)}", f"Date: {formatdate(usegmt=True)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def client_address(transport: asyncio.BaseTransport) -> str | None:
    """The client's address; None on a unix socket, whose clients have none to tell apart."""
    peer = transport.get_extra_info("peername")
    if not isinstance(peer, tuple) or not peer:
        return None
    host = str(peer[0])
    # An IPv4 client of a dual-stack socket is the same client as over IPv4.
    return host[7:] if host.startswith("::ffff:") and "." in host else host
