"""Prometheus text exposition (format 0.0.4) for the proxy, without a client library.

The proxy owns request counters and durations; queue depth, in-flight requests,
wakes and parks belong to the controller and are read from ``Router.stats()`` at
scrape time so the two never disagree.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Mapping

# Seconds. Wide on the right: a request that waits for a wake can take minutes.
DURATION_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                                       30.0, 60.0, 120.0, 300.0, 600.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class _Histogram:
    __slots__ = ("counts", "total", "count")

    def __init__(self) -> None:
        self.counts = [0] * len(DURATION_BUCKETS)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(DURATION_BUCKETS, seconds)
        if index < len(self.counts):
            self.counts[index] += 1
        self.total += seconds
        self.count += 1


class ProxyMetrics:
    def __init__(self) -> None:
        self._requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self._durations: dict[tuple[str, str], _Histogram] = defaultdict(_Histogram)

    def record(self, *, deployment: str, route: str, status: int, seconds: float) -> None:
        self._requests[(deployment, route, str(status))] += 1
        self._durations[(deployment, route)].observe(seconds)

    def render(self, router_stats: Mapping[str, Mapping[str, float]]) -> str:
        lines: list[str] = []
        lines += ["# HELP capyctl_requests_total Requests answered by the proxy.",
                  "# TYPE capyctl_requests_total counter"]
        for (deployment, route, status), count in sorted(self._requests.items()):
            lines.append(f"capyctl_requests_total{_labels(deployment=deployment, route=route, status=status)} "
                         f"{count}")

        lines += ["# HELP capyctl_request_duration_seconds Time from request to the end of the response.",
                  "# TYPE capyctl_request_duration_seconds histogram"]
        for (deployment, route), hist in sorted(self._durations.items()):
            cumulative = 0
            for bound, count in zip(DURATION_BUCKETS, hist.counts):
                cumulative += count
                labels = _labels(deployment=deployment, route=route, le=_number(bound))
                lines.append(f"capyctl_request_duration_seconds_bucket{labels} {cumulative}")
            labels = _labels(deployment=deployment, route=route, le="+Inf")
            lines.append(f"capyctl_request_duration_seconds_bucket{labels} {hist.count}")
            base = _labels(deployment=deployment, route=route)
            lines.append(f"capyctl_request_duration_seconds_sum{base} {_number(hist.total)}")
            lines.append(f"capyctl_request_duration_seconds_count{base} {hist.count}")

        for name, key, kind, help_text in (
            ("capyctl_queue_depth", "queue_depth", "gauge", "Requests waiting for admission."),
            ("capyctl_in_flight", "in_flight", "gauge", "Requests admitted and not finished."),
            ("capyctl_wakes_total", "wakes", "counter", "Wakes and cold starts of a deployment."),
            ("capyctl_parks_total", "parks", "counter", "Parks of a deployment."),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for deployment in sorted(router_stats):
                value = router_stats[deployment].get(key, 0)
                lines.append(f"{name}{_labels(deployment=deployment)} {_number(value)}")
        return "\n".join(lines) + "\n"
