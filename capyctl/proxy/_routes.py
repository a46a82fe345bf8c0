"""Which client-facing route needs which engine capability.

Engine adapters say what each engine serves as capability names (``Upstream.capabilities``,
from ``EngineAdapter.capabilities``); this table turns a route into the capability it needs,
so the proxy never imports an engine module. A route is forwarded to the same path on the
engine; nothing outside this table (and the three original OpenAI routes, /v1/systemone)
is ever forwarded, so engine control routes stay unreachable.
"""

from __future__ import annotations

from typing import Iterable

# route -> capability. Routes checked against the model's engine before forwarding; an engine
# without the capability answers ``route_not_served`` (404) instead of its own 404.
CAPABILITY_ROUTES: dict[str, str] = {
    "/v1/responses": "responses",
    "/v1/responses/input_tokens": "response_input_tokens",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "messages",
    "/tokenize": "tokenize",
    "/detokenize": "tokenize",
    "/v1/rerank": "rerank",
}

# The routes CapyCTL forwarded before the table existed: still sent to every engine, which
# answers its own error when it lacks them (a registration written before the table keeps working).
OPEN_ROUTES: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}

# Routes answered in Anthropic's shape (errors included): the Anthropic Messages API.
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def routes_served(capabilities: Iterable[str]) -> list[str]:
    """Every forwarded route an engine with ``capabilities`` serves, sorted."""
    caps = set(capabilities)
    table = {**OPEN_ROUTES, **CAPABILITY_ROUTES}
    served = {route for route, cap in table.items() if cap in caps}
    if caps & {"systemone", "decisions", "logprobs"}:
        served.add("/v1/systemone")
    return sorted(served)
