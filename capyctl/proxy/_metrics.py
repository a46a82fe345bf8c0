"""Prometheus metrics for the proxy, through ``prometheus_client``.

The proxy owns request counters and durations. Queue depth, in-flight requests, wakes, parks,
evictions, wake durations and memory belong to the controller and are read through the
``Router`` at scrape time (a custom collector), so the two never disagree.

Each application has its own ``CollectorRegistry``: several proxies in one process (tests)
do not share series. A request costs one list append; requests are counted in batches (one
counter increment and one histogram observation each, on label children cached per
(deployment, route, status)), at the latest when Prometheus scrapes.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .router import DurationCounts, MemoryGauge

# Seconds. Wide on the right: a request that waits for a wake can take minutes.
DURATION_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                                       30.0, 60.0, 120.0, 300.0, 600.0)
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
# Requests recorded before they are counted in one go (ProxyMetrics.record); a scrape counts them all.
PENDING_MAX = 256

# Without this, every counter and histogram child also exposes a *_created series: twice the
# scrape for a timestamp nobody graphs.
prometheus_client.disable_created_metrics()


def _buckets(counts: DurationCounts) -> list[tuple[str, int]]:
    return [("+Inf" if bound == float("inf") else prometheus_client.utils.floatToGoString(bound), n)
            for bound, n in counts.cumulative()]


class _RouterCollector(Collector):
    """What the controller knows, read when Prometheus scrapes."""

    def __init__(self) -> None:
        self.stats: Mapping[str, Mapping[str, float]] = {}
        self.wakes: Mapping[str, DurationCounts] = {}
        self.phases: Mapping[tuple[str, str, str], DurationCounts] = {}
        self.memory: list[MemoryGauge] = []

    def collect(self) -> Iterable[Metric]:
        stats = self.stats
        for name, key, family, help_text in (
            ("capyctl_queue_depth", "queue_depth", GaugeMetricFamily, "Requests waiting for admission."),
            ("capyctl_in_flight", "in_flight", GaugeMetricFamily, "Requests admitted and not finished."),
            ("capyctl_ready", "ready", GaugeMetricFamily, "1 when the deployment serves now, else 0."),
            ("capyctl_wakes", "wakes", CounterMetricFamily, "Wakes and cold starts of a deployment."),
            ("capyctl_parks", "parks", CounterMetricFamily, "Parks of a deployment (idle, asked, or evicted)."),
            ("capyctl_evictions", "evictions", CounterMetricFamily,
             "Parks or stops of a deployment to make room for another one."),
            # Replica scaling (manifest `replicas`); each decision's reason is in the daemon's journal.
            ("capyctl_replica_scaled_up", "scaled_up", CounterMetricFamily,
             "Times this replica was woken because the load per ready replica passed scale_up_load."),
            ("capyctl_replica_scaled_min", "scaled_min", CounterMetricFamily,
             "Times this replica was woken to keep its deployment's replicas.min serving."),
            ("capyctl_replica_scaled_down", "scaled_down", CounterMetricFamily,
             "Times this replica was parked after scale_down_after with no request, beyond replicas.min."),
            # The park record (capyctl/controller/_parking.py park_stats).
            ("capyctl_park_last_wake_seconds", "park_wake_seconds", GaugeMetricFamily,
             "Seconds the deployment's latest wake from a park took (0: none measured)."),
            ("capyctl_park_proof_ok", "park_proof_ok", GaugeMetricFamily,
             "1 when the latest wake's proof (a greedy generation compared with the one before the park) "
             "passed or recorded the reference, 0 when it failed or none ran."),
            ("capyctl_park_proof_failures", "park_proof_failures", GaugeMetricFamily,
             "Wakes in a row whose proof failed."),
            ("capyctl_park_retained_bytes", "park_retained_bytes", GaugeMetricFamily,
             "Memory the latest in-place park was measured still holding (kept charged)."),
            ("capyctl_park_prompt_cache_restored_tokens", "park_prompt_cache_restored_tokens", GaugeMetricFamily,
             "Prompt tokens whose KV cache the latest wake restored from its park (0: none)."),
            ("capyctl_park_prompt_cache_seconds_saved", "park_prompt_cache_seconds_saved", GaugeMetricFamily,
             "Prefill seconds the latest wake's restored prompt cache saved, at the engine's own measured "
             "prompt rate, less the restore's time."),
        ):
            metric = family(name, help_text, labels=["deployment"])
            for deployment in sorted(stats):
                metric.add_metric([deployment], float(stats[deployment].get(key, 0)))
            yield metric

        wakes = HistogramMetricFamily("capyctl_wake_duration_seconds",
                                      "Time from a wake's (or cold start's) beginning to ready.",
                                      labels=["deployment"])
        for deployment in sorted(self.wakes):
            counts = self.wakes[deployment]
            wakes.add_metric([deployment], _buckets(counts), counts.total)
        yield wakes

        phases = HistogramMetricFamily("capyctl_phase_duration_seconds",
                                       "Time each phase of a deployment's wakes and parks took (kind wake or "
                                       "park), and its swaps from the evicted model's last answer to its first "
                                       "(kind swap).", labels=["deployment", "kind", "phase"])
        for key in sorted(self.phases):
            phases.add_metric(list(key), _buckets(self.phases[key]), self.phases[key].total)
        yield phases

        gpu_labels = ["host", "gpu"]
        total = GaugeMetricFamily("capyctl_gpu_memory_capacity_bytes", "A card's memory CapyCTL may use.",
                                  labels=gpu_labels)
        free = GaugeMetricFamily("capyctl_gpu_memory_available_bytes", "A card's free memory, measured (NVML).",
                                 labels=gpu_labels)
        reserved = GaugeMetricFamily("capyctl_gpu_memory_reserved_bytes",
                                     "A card's memory the scheduler has charged to deployments.", labels=gpu_labels)
        held = GaugeMetricFamily("capyctl_deployment_gpu_memory_bytes",
                                 "GPU memory a deployment's processes hold on a card, measured (NVML).",
                                 labels=["deployment", "host", "gpu"])
        ram_total = GaugeMetricFamily("capyctl_ram_capacity_bytes", "Host RAM CapyCTL may use (less its reserve).",
                                      labels=["host"])
        ram_free = GaugeMetricFamily("capyctl_ram_available_bytes", "Host RAM available, measured (MemAvailable).",
                                     labels=["host"])
        ram_held = GaugeMetricFamily("capyctl_deployment_ram_bytes",
                                     "Host RAM a deployment's unit holds, measured (its cgroup).",
                                     labels=["deployment", "host"])
        for gauge in self.memory:
            if gauge.kind == "gpu":
                labels = [gauge.host, str(gauge.index)]
                for family, value in ((total, gauge.capacity), (free, gauge.available), (reserved, gauge.reserved)):
                    if value is not None:
                        family.add_metric(labels, float(value))
                for deployment, value in sorted(gauge.held.items()):
                    held.add_metric([deployment, *labels], float(value))
            else:
                for family, value in ((ram_total, gauge.capacity), (ram_free, gauge.available)):
                    if value is not None:
                        family.add_metric([gauge.host], float(value))
                for deployment, value in sorted(gauge.held.items()):
                    ram_held.add_metric([deployment, gauge.host], float(value))
        yield from (total, free, reserved, held, ram_total, ram_free, ram_held)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter("capyctl_requests", "Requests answered by the proxy.",
                                 ["deployment", "route", "status"], registry=self.registry)
        self._durations = Histogram("capyctl_request_duration_seconds",
                                    "Time from request to the end of the response.", ["deployment", "route"],
                                    buckets=DURATION_BUCKETS, registry=self.registry)
        self._router = _RouterCollector()
        self.registry.register(self._router)
        # (deployment, route, status) -> (counter child, histogram child). Bounded: deployments
        # are the daemon's, routes its own patterns, statuses the few HTTP ones; an unknown
        # model counts under deployment "".
        self._children: dict[tuple[str, str, int], tuple] = {}
        self._pending: list[tuple[str, str, int, float]] = []  # recorded, not yet counted

    def record(self, *, deployment: str, route: str, status: int, seconds: float) -> None:
        # Kept in a list and counted in batches (at a scrape, or every PENDING_MAX requests):
        # counting one request through prometheus_client's locks and layers was a large part of
        # the request's own CPU where the engine's work had left the caches cold; a batch runs
        # that code warm, once (docs/benchmarks.md, "Figures behind design choices").
        pending = self._pending
        pending.append((deployment, route, status, seconds))
        if len(pending) >= PENDING_MAX:
            self._count_pending()

    def _count_pending(self) -> None:
        pending, self._pending = self._pending, []
        children_of = self._children
        for deployment, route, status, seconds in pending:
            children = children_of.get((deployment, route, status))
            if children is None:
                children = children_of[(deployment, route, status)] = (
                    self._requests.labels(deployment, route, str(status)), self._durations.labels(deployment, route))
            children[0].inc()
            children[1].observe(seconds)

    def render(self, router_stats: Mapping[str, Mapping[str, float]],
               wake_durations: Mapping[str, DurationCounts] | None = None,
               memory: list[MemoryGauge] | None = None,
               phase_durations: Mapping[tuple[str, str, str], DurationCounts] | None = None) -> bytes:
        """The text exposition (format 0.0.4) of the proxy's series and the router's figures."""
        self._router.stats = router_stats
        self._router.wakes = wake_durations or {}
        self._router.phases = phase_durations or {}
        self._router.memory = memory or []
        self._count_pending()
        return prometheus_client.generate_latest(self.registry)
