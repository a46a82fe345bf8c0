"""The proxy's OpenAPI 3.1 description, served without a key at ``GET /openapi.json``.

Built from the route table (``_routes.py``), so a route added there is described here. It
describes what the proxy itself checks and answers (the key, the ``model`` field, sizes,
admission); the bodies of forwarded routes are the engines' own (OpenAI's, Anthropic's), passed
through, so they are described as open objects and the engine's own error statuses as
``default``. It names no deployment: which models exist is ``GET /v1/models``, with a key.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .. import __version__
from ..openapi import Operation, Response, document
from ._routes import FORM_ROUTES, JSON_ROUTES, STORED_RESPONSE_CAPABILITIES, STORED_RESPONSE_ROUTE, SYSTEMONE_ROUTE


class ModelRequest(BaseModel):
    """Any body the engine's API takes; the proxy reads only ``model``."""
    model_config = ConfigDict(extra="allow")
    model: str = Field(description="A deployment's name or alias; it selects the engine.")
    stream: bool | None = Field(default=None, description="Answer as Server-Sent Events.")


class ProxyError(BaseModel):
    """OpenAI's error shape (Anthropic's under /v1/messages): ``error.code`` is CapyCTL's stable code."""
    model_config = ConfigDict(extra="allow")
    error: dict[str, Any] | None = None


class ModelList(BaseModel):
    model_config = ConfigDict(extra="allow")
    object: str
    data: list[dict[str, Any]]


OPEN: dict[str, Any] = {"type": "object"}
# What admission can answer for a request to a model: no or a bad key, a model that does not exist
# or that the key may not use, a body too large, too many waiting, a wake that failed, the engine
# out of reach or too slow; anything else is the engine's own answer, passed on.
FORWARDED = {400: ProxyError, 401: ProxyError, 404: ProxyError, 413: ProxyError, 429: ProxyError,
             502: ProxyError, 503: ProxyError, 504: ProxyError,
             "default": Response("The engine's own answer, passed on", OPEN)}
ANSWER = {200: Response("The engine's answer: JSON, or text/event-stream when streamed", OPEN)}


def _operations() -> list[Operation]:
    ops = [
        Operation("GET", "/health", "Whether the proxy answers (no key)", "proxy", {200: OPEN}, security=[{}]),
        Operation("GET", "/openapi.json", "This description (no key)", "proxy", {200: OPEN}, security=[{}]),
        Operation("GET", "/metrics", "Prometheus metrics (a key limited to some models is refused)", "proxy",
                  {200: Response("Prometheus text format", {"type": "string"}, "text/plain"),
                   401: ProxyError, 403: ProxyError}),
        Operation("GET", "/v1/models", "The models this key may use, with their state", "models",
                  {200: ModelList, 401: ProxyError}),
        Operation("POST", SYSTEMONE_ROUTE, "Answered by the proxy from the engine's decisions and log-probabilities",
                  "systemone", {**ANSWER, **FORWARDED}, request=ModelRequest),
    ]
    for path, capability in JSON_ROUTES.items():
        ops.append(Operation("POST", path, f"Forwarded to engines that serve '{capability}'", "forwarded",
                             {**ANSWER, **FORWARDED}, request=ModelRequest))
    for path, capability in FORM_ROUTES.items():
        ops.append(Operation("POST", path, f"A multipart form forwarded to engines that serve '{capability}'",
                             "forwarded", {**ANSWER, **FORWARDED},
                             request={"type": "object", "required": ["model", "file"],
                                      "properties": {"model": {"type": "string"},
                                                     "file": {"type": "string", "contentMediaType":
                                                              "application/octet-stream"}}},
                             request_media_type="multipart/form-data"))
    for method, capability in STORED_RESPONSE_CAPABILITIES.items():
        ops.append(Operation(method, STORED_RESPONSE_ROUTE,
                             f"A stored response, from the deployment that made it ('{capability}')", "forwarded",
                             {**ANSWER, **FORWARDED}))
    return ops


def proxy_openapi() -> dict:
    return document(
        title="CapyCTL OpenAI-compatible endpoint", version=__version__,
        description="One endpoint for every deployment; the body's `model` selects it. Every route but /health "
                    "and /openapi.json needs an API key (`capyctl key create`). Only these routes are forwarded.",
        operations=_operations(),
        security_schemes={"bearer": {"type": "http", "scheme": "bearer", "description": "An API key"},
                          "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                        "description": "The same key, as Anthropic's clients send it"}},
        security=[{"bearer": []}, {"x-api-key": []}])
