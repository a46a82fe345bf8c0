"""CapyError to the OpenAI error body: {"error": {"message", "type", "code", "param"}}."""

from __future__ import annotations

import json
import math

from aiohttp import web

from ..errors import CapyError


def error_type(status: int) -> str:
    """The OpenAI ``type`` for a status: clients switch on it, so keep to OpenAI's words."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(error: CapyError, *, param: str | None = None) -> dict:
    return {"error": {"message": error.message, "type": error_type(error.status),
                      "code": error.code, "param": param}}


def error_response(error: CapyError, *, param: str | None = None) -> web.Response:
    headers = {}
    if error.retry_after is not None:
        # Retry-After takes whole seconds; round up so a client never comes back too early.
        headers["Retry-After"] = str(max(0, math.ceil(error.retry_after)))
    return web.Response(status=error.status, headers=headers, content_type="application/json",
                        text=json.dumps(error_body(error, param=param)))


def sse_error_event(error: CapyError) -> bytes:
    """A final SSE event the official OpenAI clients turn into an APIError."""
    return b"data: " + json.dumps(error_body(error)).encode() + b"\n\n"
