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
    # Engines serving it (manifest `replicas`): with more than one, the proxy hands the Router the
    # request's prompt (acquire's ``prompt``) so it can send it where its prefix was served.
    replicas: int = 1


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
    host: str = "local"  # the host its engine runs on (Router.engine_lost)
    # The most connections the proxy may hold open to this engine at once, idle ones included
    # (an engine that serves each connection on a thread of a fixed pool: llama-server); None: any.
    connections_max: int | None = None


# Seconds a wake (or cold start) took, from the request that asked for it to ready. Wide on the
# right: a cold start of a large model from disk takes minutes.
WAKE_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# A wake's or park's phases: from a unit's few milliseconds to a wait for room.
PHASE_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class DurationCounts:
    """A histogram kept by whoever measures (the controller for wakes), read at scrape time:
    per bucket of ``bounds`` how many observations fell at or below it (not cumulative)."""

    bounds: tuple[float, ...] = WAKE_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1
                break
        self.total += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """[(bound, observations at or below it)], +Inf last, as Prometheus exposes buckets."""
        out, running = [], 0
        counts = self.counts or [0] * len(self.bounds)
        for bound, n in zip(self.bounds, counts):
            running += n
            out.append((bound, running))
        out.append((float("inf"), self.count))
        return out


@dataclass(frozen=True)
class MemoryGauge:
    """One memory domain (a GPU card or a host's RAM) as /metrics shows it; a figure that could
    not be measured is None and is left out of the exposition, never shown as 0."""

    domain: str  # gpu:<host>:<index> | ram:<host>
    kind: str  # gpu | ram
    host: str
    index: int | None  # the card's index on its host; None for RAM
    capacity: int | None  # what CapyCTL may use there
    available: int | None  # measured free now
    reserved: int | None  # charged to deployments by the scheduler's ledger
    held: dict[str, int] = field(default_factory=dict)  # deployment -> bytes measured there


class Router(Protocol):
    def models(self) -> list[ModelEntry]:
        """Every deployment and alias, with its state. Must not wake anything."""

    def acquire(self, model: str, progress: Callable[[str], None] | None = None) -> AsyncContextManager[Upstream]:
        """Admission for one request to ``model``.

        A Router whose models may have replicas (ModelEntry.replicas > 1) also takes ``prompt``
        (the request's prompt text, to send it where its prefix was served) and ``replica`` (the
        replica it must reach: the engine that keeps its stored response); the proxy passes them
        only for such models, and ``try_acquire`` takes the same two.

        Entering waits until the deployment is ready (joining a wake already under way,
        or starting one, making room first, waiting its turn while busy deployments hold
        the room) and marks one request in flight; leaving releases it. Raises
        ``capyctl.errors.CapyError`` subclasses: ``model_not_found`` (404), ``queue_full``
        (429, ``retry_after`` set), ``wake_failed`` / ``wake_timeout`` / ``deployment_failed``
        / ``room_wait_timeout`` (503, ``retry_after`` set where a retry may succeed).
        Cancelling the waiting task (client gone) removes it from the queue.

        ``progress``, when given, is called (on the event loop, never awaited) with a short
        line each time the wait moves on, such as ``"waiting for smollm2: 2 requests ahead"``
        or ``"waking smollm2: unit started"``; never once the request is admitted, and not at
        all when it is admitted without waiting. The proxy turns them into SSE comments.
        """

    def stats(self) -> dict[str, dict[str, float]]:
        """Per deployment counters for /metrics: queue_depth, in_flight, wakes, parks, evictions
        (parks to make room for another deployment) and ready (1 or 0). Must be cheap: no I/O."""

    # Optional: a router without these (a test's fake) exposes no wake durations or memory, has
    # its one model looked up in models(), and admits every request through acquire().
    def model_entry(self, model: str) -> ModelEntry | None:
        """The entry of one deployment or alias (None: no such model), without building every
        entry: the proxy looks up one per request."""

    def try_acquire(self, model: str) -> tuple[Upstream, Callable[[], None]] | None:
        """Admission without waiting, for the common case: when ``model``'s deployment is ready
        and nothing is queued before this request, mark one request in flight and answer its
        Upstream and the call that releases it; else None (and nothing marked), and the proxy
        goes through ``acquire``, which waits, wakes or refuses. Saves the proxy two async
        context managers per request (benchmarks/proxy_hop.py's profile)."""

    async def engine_lost(self, upstream: Upstream) -> bool:
        """The connection to ``upstream``'s engine broke before any of its answer reached the
        client (it died, or CapyCTL stopped it hung). True when the request may go elsewhere:
        that engine was lost with its host and its deployment is moving to another (on_host_loss:
        move), or it is one replica of a deployment whose others serve; the proxy then sends the
        request once more through ``acquire``, which waits for the move or picks a sibling. False
        (the request's 502 stands) otherwise, a lone engine that died on a host still connected
        included. May wait a moment to tell which."""

    def wake_durations(self) -> dict[str, DurationCounts]:
        """Per deployment, how long its wakes and cold starts took (to ready)."""

    def phase_durations(self) -> dict[tuple[str, str, str], DurationCounts]:
        """Per (deployment, "wake" | "park" | "swap", phase), how long that phase of its wakes and
        parks took (the controller's timelines)."""

    async def memory_gauges(self) -> list[MemoryGauge]:
        """Every memory domain with what each deployment holds there; measurements may be a
        couple of seconds old (they are shared with GET /v1/usage)."""
