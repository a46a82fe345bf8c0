"""Which client-facing route needs which engine capability.

Engine adapters say what each engine serves as capability names (``Upstream.capabilities``,
from ``EngineAdapter.capabilities``); this table turns a route into the capability it needs,
so the proxy never imports an engine module. A route is forwarded to the same path on the
engine, and only when the model's engine declares the route's capability; nothing outside
this table (and /v1/systemone, answered by the proxy) is ever forwarded, so engine control
routes (/sleep, /wake_up, /collective_rpc, /slots, ...) stay unreachable.
"""

from __future__ import annotations

from typing import Iterable

# JSON POST routes: route -> capability. An engine without the capability answers
# ``route_not_served`` (404) naming what it does serve, instead of its own 404.
JSON_ROUTES: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    "/v1/responses/input_tokens": "response_input_tokens",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "messages",
    "/tokenize": "tokenize",
    "/detokenize": "tokenize",
    "/v1/tokenize": "tokenize_v1",  # TensorFold's path (docs/api.md)
    "/v1/rerank": "rerank",
    "/v1/score": "score",
}

# The JSON routes whose answer is an event stream when the body asks "stream": true; while such a
# request waits for admission it is sent SSE comments (_relay.WaitProgress).
STREAMING_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})

# multipart/form-data POST routes: the ``model`` form field selects the deployment.
FORM_ROUTES: dict[str, str] = {
    "/v1/audio/transcriptions": "transcriptions",
}

# GET and DELETE of a stored OpenAI response, sent to the deployment that created it.
STORED_RESPONSE_ROUTE = "/v1/responses/{id}"
STORED_RESPONSE_CAPABILITIES = {"GET": "responses_get", "DELETE": "responses_delete"}

# Answered by the proxy itself from whichever of these the engine has (see _systemone).
SYSTEMONE_ROUTE = "/v1/systemone"
SYSTEMONE_CAPABILITIES = frozenset({"systemone", "decisions", "logprobs"})

# Routes answered in Anthropic's shape (errors included): the Anthropic Messages API.
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def routes_served(capabilities: Iterable[str]) -> list[str]:
    """Every route an engine with ``capabilities`` is sent, sorted by path ("GET /v1/responses/{id}"
    for the stored-response methods, the bare path for POST routes)."""
    caps = set(capabilities)
    served = {route for route, cap in {**JSON_ROUTES, **FORM_ROUTES}.items() if cap in caps}
    served |= {f"{method} {STORED_RESPONSE_ROUTE}" for method, cap in STORED_RESPONSE_CAPABILITIES.items()
               if cap in caps}
    if caps & SYSTEMONE_CAPABILITIES:
        served.add(SYSTEMONE_ROUTE)
    return sorted(served, key=lambda route: (route.rpartition(" ")[2], route))
