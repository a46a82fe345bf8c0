"""What the proxy needs from the controller, and nothing more.

The proxy never imports an engine module or the controller's internals: the
daemon hands it an object that satisfies ``Router``. Tests hand it a fake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncContextManager, Callable, Protocol

if TYPE_CHECKING:
    from ..errors import CapyError


@dataclass(frozen=True)
class ModelEntry:
    """One name clients may ask for, as ``GET /v1/models`` lists it (never wakes anything)."""

    id: str  # deployment name or alias
    deployment: str
    state: str  # stopped|starting|ready|parking|parked|waking|stopping|failed
    engine: str
    created: int  # unix time of the deployment's current revision
    # What its engine serves, as Upstream.capabilities, once known (from its last launch); empty
    # when not known yet. Lets the proxy refuse a route the engine lacks without waking it.
    capabilities: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Upstream:
    """A ready engine the proxy may send one request to, on loopback, with its per-launch key."""

    deployment: str
    base_url: str  # e.g. "http://127.0.0.1:41234"; the engine's OpenAI routes live under /v1
    api_key: str | None
    engine: str  # engine kind: llama.cpp, vllm, sglang, tensorfold, custom
    # chat, completions, embeddings, systemone (served natively), logprobs, tools
    capabilities: frozenset[str] = field(default_factory=frozenset)
    served_model: str | None = None  # the model name the engine itself expects in the body, if it differs
    # When set, the engine serves on this unix socket (base_url's host is then only a label):
    # connect there instead of TCP.
    unix_socket: str | None = None
    # Why CapyCTL cut this launch's engine, if it did (its liveness watchdog stopped a hung
    # engine): asked when the connection to the engine breaks, so the client gets that error
    # instead of a bare disconnect. None, or a callable answering None, when CapyCTL cut nothing.
    verdict: Callable[[], CapyError | None] | None = field(default=None, compare=False, repr=False)


class Router(Protocol):
    def models(self) -> list[ModelEntry]:
        """Every deployment and alias, with its state. Must not wake anything."""

    def acquire(self, model: str) -> AsyncContextManager[Upstream]:
        """Admission for one request to ``model``.

        Entering waits until the deployment is ready (joining a wake already under way,
        or starting one, making room first) and marks one request in flight; leaving
        releases it. Raises ``capyctl.errors.CapyError`` subclasses:
        ``model_not_found`` (404), ``queue_full`` (429, ``retry_after`` set),
        ``wake_failed`` / ``wake_timeout`` / ``deployment_failed`` (503).
        Cancelling the waiting task (client gone) removes it from the queue.
        """

    def stats(self) -> dict[str, dict[str, float]]:
        """Per deployment counters for /metrics: queue_depth, in_flight, wakes, parks."""
