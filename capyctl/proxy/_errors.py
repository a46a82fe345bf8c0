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


# What aiohttp's json/text responses say.
JSON_CONTENT_TYPE = "application/json; charset=utf-8"


def error_parts(error: CapyError, *, anthropic: bool = False, param: str | None = None) -> tuple[dict[str, str], bytes]:
    """Headers and body of the error answer, in OpenAI's shape or (``anthropic``) Anthropic's."""
    headers = {"Content-Type": JSON_CONTENT_TYPE}
    if error.retry_after is not None:
        # Retry-After takes whole seconds; round up so a client never comes back too early.
        headers["Retry-After"] = str(max(0, math.ceil(error.retry_after)))
    body = anthropic_error_body(error) if anthropic else error_body(error, param=param)
    return headers, json.dumps(body).encode()


def error_response(error: CapyError, *, param: str | None = None) -> web.Response:
    headers, body = error_parts(error, param=param)
    return web.Response(status=error.status, headers=headers, body=body)


def sse_error_event(error: CapyError) -> bytes:
    """A final SSE event the official OpenAI clients turn into an APIError."""
    return b"data: " + json.dumps(error_body(error)).encode() + b"\n\n"


# ---------------------------------------------------------------- Anthropic Messages routes

def anthropic_error_type(status: int) -> str:
    """Anthropic's ``error.type`` for a status (docs.anthropic.com "Errors": the types the official
    ``anthropic`` client maps to its exception classes by status)."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    if status == 429:
        return "rate_limit_error"
    if status in (503, 529):  # a full queue or a model that cannot wake now: try again later
        return "overloaded_error"
    if status >= 500:
        return "api_error"
    return "invalid_request_error"


def anthropic_error_body(error: CapyError) -> dict:
    # "code" is ours (stable, snake_case); Anthropic's clients read only "type" and "message".
    return {"type": "error", "error": {"type": anthropic_error_type(error.status), "message": error.message,
                                       "code": error.code}}


def anthropic_error_response(error: CapyError) -> web.Response:
    headers, body = error_parts(error, anthropic=True)
    return web.Response(status=error.status, headers=headers, body=body)


def anthropic_sse_error_event(error: CapyError) -> bytes:
    """The ``error`` event of an Anthropic stream; the official client raises it as an APIError."""
    return b"event: error\ndata: " + json.dumps(anthropic_error_body(error)).encode() + b"\n\n"
