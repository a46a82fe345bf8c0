"""The controller's figures for /metrics: evictions and wake durations per deployment, each
deployment's counters, and each memory domain's gauges (read through the usage view)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from ..proxy.router import PHASE_BUCKETS, DurationCounts, MemoryGauge
from ._lifecycle import DeploymentState
from ._parking import park_stats
from ._timeline import phase_seconds

# The swap's own histogram: an evicting wake's first answer less the evicted one's last answer.
SWAP, SWAP_PHASE = "swap", "last answer to first answer"

log = logging.getLogger("capyctl.controller")


class DeploymentMetrics:
    """Counts what the controller does to deployments and reports it as the proxy's Router does."""

    def __init__(self, actors: Callable[[], Mapping[str, Any]], usage_view: Callable[[], Any]) -> None:
        self._actors = actors  # the deployments' actors by name, as they are now
        self._usage_view = usage_view  # makes the UsageView (_usage.py), at the first scrape
        self._usage: Any = None
        self._evictions: dict[str, int] = {}  # parks (or stops) to make room, per victim
        # Replicas woken or parked by scaling (_replicas.py), per replica and direction (up, min, down).
        self._scaled: dict[tuple[str, str], int] = {}
        self._wake_started: dict[str, float] = {}
        self._wake_durations: dict[str, DurationCounts] = {}
        # (deployment, "wake" | "park" | "swap", phase) -> its durations (controller/_timeline.py)
        self._phase_durations: dict[tuple[str, str, str], DurationCounts] = {}

    def evicted(self, name: str) -> None:
        """Deployment ``name`` was parked (or stopped) to make room for another."""
        self._evictions[name] = self._evictions.get(name, 0) + 1

    def scaled(self, name: str, direction: str) -> None:
        """Replica ``name`` was added under load ("up"), to keep min ("min"), or parked ("down")."""
        self._scaled[(name, direction)] = self._scaled.get((name, direction), 0) + 1

    def state_changed(self, actor: Any) -> None:
        """Times each wake, from its start to READY."""
        if actor.state in (DeploymentState.STARTING, DeploymentState.WAKING):
            self._wake_started.setdefault(actor.name, time.monotonic())
        elif actor.name in self._wake_started:
            started = self._wake_started.pop(actor.name)
            if actor.state == DeploymentState.READY:  # a failed wake is not a duration of a wake
                self._wake_durations.setdefault(actor.name, DurationCounts()).observe(time.monotonic() - started)

    def timeline(self, name: str, record: dict) -> None:
        """A wake's or park's phases ended (controller/_timeline.py): each observed by phase."""
        kind = record.get("kind", "wake")
        observed = list(phase_seconds(record).items())
        for phase, seconds in observed:
            self._observe_phase((name, kind, phase), seconds)
        if record.get("swap_seconds") is not None:
            self._observe_phase((name, SWAP, SWAP_PHASE), float(record["swap_seconds"]))

    def _observe_phase(self, key: tuple[str, str, str], seconds: float) -> None:
        self._phase_durations.setdefault(key, DurationCounts(bounds=PHASE_BUCKETS)).observe(seconds)

    def phase_durations(self) -> dict[tuple[str, str, str], DurationCounts]:
        actors = self._actors()
        return {key: counts for key, counts in self._phase_durations.items() if key[0] in actors}

    def stats(self) -> dict[str, dict[str, float]]:
        return {a.name: {"queue_depth": a.waiting, "in_flight": a.in_flight, "wakes": a.wakes, "parks": a.parks,
                         "evictions": self._evictions.get(a.name, 0),
                         "ready": 1.0 if a.state == DeploymentState.READY else 0.0,
                         "scaled_up": self._scaled.get((a.name, "up"), 0),
                         "scaled_min": self._scaled.get((a.name, "min"), 0),
                         "scaled_down": self._scaled.get((a.name, "down"), 0), **park_stats(a.park_record)}
                for a in self._actors().values()}

    def wake_durations(self) -> dict[str, DurationCounts]:
        actors = self._actors()
        return {name: counts for name, counts in self._wake_durations.items() if name in actors}

    async def memory_gauges(self) -> list[MemoryGauge]:
        if self._usage is None:
            self._usage = self._usage_view()
        try:
            view = await self._usage.view()
        except Exception:  # a scrape must not fail because one host could not be measured
            log.warning("metrics: measuring memory failed", exc_info=True)
            return []
        held: dict[str, dict[str, int]] = {}
        for dep in view["deployments"]:
            for d in dep["domains"]:
                if d["held"] is not None:
                    held.setdefault(d["id"], {})[dep["name"]] = d["held"]
        return [MemoryGauge(domain=d["id"], kind=d["kind"], host=host["host"], index=d["index"],
                            capacity=d["capacity"], available=d["available"], reserved=d["reserved"],
                            held=held.get(d["id"], {}))
                for host in view["hosts"] for d in host["domains"]]
