"""Every benchmark goal, in one place (issue 48): the bound, which way it holds, its unit, the issue
that set it, and how the goal column of a table says it.

benchmarks/bench_summary.py judges scripts/bench's rows by these, benchmarks/hosts_scale.py its
own, benchmarks/kv_park.py and proxy_hop.py print them, and docs/benchmarks.md shows them only in
the tables bench_summary.py generates (``--docs``); tests/unit/test_bench_docs.py fails when a
goal written in the docs differs from the one here. No goal constant is defined anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

MiB = 1 << 20


# How a goal's figure must stand to its bound (the bound itself holds either way).
AT_MOST, AT_LEAST, EXACTLY = "at most", "at least", "exactly"
PASS_MISS = ("PASS", "MISS")


@dataclass(frozen=True)
class Goal:
    name: str  # the key, in GOALS
    bound: float | None  # in ``unit``; None where the run sets it (the contention p99: contention_p99_bound)
    holds: str  # AT_MOST, AT_LEAST or EXACTLY: the figure against the bound
    unit: str  # of the bound and the figure judged: "s", "bytes", "x", "share", "count", "requests/s", "% core"
    issue: int  # the issue that set it
    measure: str  # what it judges, in words (the goals table)
    text: str  # the goal column: a format string of the bound times ``scale``
    scale: float = 1.0
    verdicts: tuple[str, str] = PASS_MISS  # what a table says where the goal holds, and where it does not

    @property
    def shown(self) -> str:
        """The goal as a table's goal column says it."""
        return self.text if self.bound is None else self.text.format(self.bound * self.scale)

    def judge(self, figure: float | None, bound: float | None = None) -> str:
        """The goal's verdict at the bound (PASS or MISS, or its own words; the bound itself holds);
        n/a without a figure or a bound."""
        return judge(figure, self.bound if bound is None else bound, self.holds, self.verdicts)

    def worst(self, figures: Iterable[float], bound: float | None = None) -> float | None:
        """Of several figures that must each hold (one a host, say), the one furthest on the wrong
        side of the bound: the largest of an at-most goal, the smallest of an at-least one, the
        furthest from the bound of an exactly one. None without figures."""
        figures = list(figures)
        if not figures:
            return None
        if self.holds == AT_MOST:
            return max(figures)
        if self.holds == AT_LEAST:
            return min(figures)
        bound = self.bound if bound is None else bound
        return max(figures, key=lambda f: abs(f - bound))


def judge(figure: float | None, bound: float | None, holds: str, verdicts: tuple[str, str] = PASS_MISS) -> str:
    if figure is None or bound is None:
        return "n/a"
    if holds not in (AT_MOST, AT_LEAST, EXACTLY):
        raise ValueError(f"a goal holds {AT_MOST!r}, {AT_LEAST!r} or {EXACTLY!r}, not {holds!r}")
    held = figure <= bound if holds == AT_MOST else figure >= bound if holds == AT_LEAST else figure == bound
    return verdicts[0] if held else verdicts[1]


# Issue 14's proxy and wake goals (the added latency since issue 45: aiohttp's server facing every client).
ADDED_LATENCY = Goal("added_latency", 0.70e-3, AT_MOST, "s", 45,
                     "added latency over direct, 1-token chat, median of the differences turn by turn",
                     "<= {:.2f} ms over direct", 1000)
MEDIAN_VS_NGINX = Goal("median_vs_nginx", 1.02, AT_MOST, "x", 14, "latency median, total, against nginx",
                       "<= {:.2f}x nginx")
P95_VS_NGINX = Goal("p95_vs_nginx", 1.05, AT_MOST, "x", 14, "latency p95 against nginx", "<= {:.2f}x nginx")
TTFC_VS_NGINX = Goal("ttfc_vs_nginx", 1.03, AT_MOST, "x", 14, "time to first chunk, median, against nginx",
                     "<= {:.2f}x nginx")
STREAM_VS_DIRECT = Goal("stream_vs_direct", 0.99, AT_LEAST, "x", 14,
                        "stream chunks/s at 1, 8 and 64 concurrent streams, against direct", ">= {:.2f}x direct")
WAKE_VS_MANUAL = Goal("wake_vs_manual", 1.10, AT_MOST, "x", 14,
                      "parked -> first token, against llama-server started by hand", "<= {:.2f}x")
IDLE_RSS = Goal("idle_rss", 64 * MiB, AT_MOST, "bytes", 14, "the daemon's idle RSS (8 deployments)",
                "<= {:.0f} MiB", 1 / MiB)
RSS_GROWTH = Goal("rss_growth", 2 * MiB, AT_MOST, "bytes", 14,
                  "\"flat\": idle RSS after 100,000 requests over the figure after a few",
                  "<= {:.0f} MiB growth", 1 / MiB)
# Issue 45: the door.
SCALE_RPS = Goal("scale_rps", 2848, AT_LEAST, "requests/s", 45,
                 "8 deployments behind one daemon (daemon_scale.py): half of what issue 32's front reached",
                 ">= {:,.0f}/s")
STREAMS = Goal("streams", 1000, AT_LEAST, "count", 45,
               "streamed requests at once across 8 deployments (streams_scale.py)",
               "{:,.0f} streams")
STREAMS_LOST = Goal("streams_lost", 0, AT_MOST, "count", 45, "of those streams, dropped or cut",
                    "{:.0f} dropped or cut")
HOSTILE_FAILED = Goal("hostile_failed", 0, AT_MOST, "count", 45,
                      "keyed requests failed while one client holds 5,000 half heads (hostile_heads.py)", "<= {:.0f}")
HOSTILE_P99 = Goal("hostile_p99", 2.0, AT_MOST, "x", 45, "those keyed clients' p99 against the same clients unattacked",
                   "<= {:.1f}x")
HOSTILE_OUTLIVED = Goal("hostile_outlived", 0, AT_MOST, "count", 45, "half heads outliving the head deadline",
                        "<= {:.0f}")
# A verdict on code, from one run: the figure of proxy_hop.py in that scripts/bench run decides, KEEP or
# DELETE; a rerun of proxy_hop.py alone is no verdict (issue 57: a run read 90 us, reruns kept it).
ENGINE_CLIENT_PAYS = Goal("engine_client_pays", 100e-6, AT_LEAST, "s", 45,
                          "the proxy's own engine client: kept if it saves this a request over aiohttp's client "
                          "in a scripts/bench run's proxy_hop.py, deleted if not; that run's figure is the verdict, "
                          "reruns are not",
                          "keep if >= {:.0f} us this run, else delete", 1e6, ("KEEP", "DELETE"))
# Issue 31: models taking turns on room for one (contention.py), judged on the batches scenarios.
CONTENTION_FAILED = Goal("contention_failed", 0, AT_MOST, "count", 31, "models taking turns: failed requests",
                         "<= {:.0f}")
CONTENTION_SHARE = Goal("contention_share", 0.2, AT_LEAST, "share", 31,
                        "models taking turns: each model's share of the answers", ">= {:.2f}")
# The p99's bound is the run's own (contention_p99_bound): what the turns promise a request whose model
# is parked. It waits at most one quantum (the resident keeps taking new requests that long), then,
# for each model ahead of it, that model's last answer of its batch and one swap. It was wait_max plus
# one wake, 30.7 s against some 3 s measured: it could not fail (issue 57).
CONTENTION_P99 = Goal("contention_p99", None, AT_MOST, "s", 31,
                      "models taking turns: p99 latency of answered requests, against the turns' promise: one "
                      "quantum, then for each other model one answer (the one-model run's p99) and one swap "
                      "(the scenario's median, last answer to first answer)",
                      "<= quantum + (one-model p99 + one swap) per other model")


def contention_p99_bound(models: int, quantum_s: float | None, one_p99_s: float | None,
                         swap_s: float | None) -> float | None:
    """CONTENTION_P99's bound in a run of ``models`` models taking turns: its ``swap.quantum``, the
    one-model run's p99 and the median swap, in seconds; None without one of them."""
    if models < 2 or quantum_s is None or one_p99_s is None or swap_s is None:
        return None
    return quantum_s + (models - 1) * (one_p99_s + swap_s)


CONTENTION_ANSWERS = Goal("contention_answers", 0.5, AT_LEAST, "x", 31,
                          "models taking turns: answers against the same clients on one resident model", ">= {:.2f}x")
# Issue 47.
ANSWERS_VS_CEILING = Goal("answers_vs_ceiling", 0.9, AT_LEAST, "x", 47,
                          "models taking turns, where the engine's start is longer than a batch: answers against "
                          "the ceiling batch / (batch + own start)", ">= {:.1f}x the ceiling")
SWAP_VS_OWN_START = Goal("swap_vs_own_start", 1.25, AT_MOST, "x", 47,
                         "median swap (last answer to first answer) against the engine's own start by hand",
                         "<= {:.2f}x")
MIXED_LIGHT_P99 = Goal("mixed_light_p99", 2.0, AT_MOST, "x", 47,
                       "the resident model's p99, asked once a second while two big ones take turns, against alone "
                       "(the slowest against the slowest where either has under 100 samples, too few for a p99)",
                       "<= {:.1f}x")
KV_VS_WARM_PLUS_START = Goal("kv_vs_warm_plus_start", 1.0, AT_MOST, "x", 47,
                             "the next turn sent to a parked deployment, its wake included, against the warm turn "
                             "plus the engine's own start", "<= {:.1f}x warm + own start")
CLIENTS_AGREE = Goal("clients_agree", 0.05, AT_MOST, "share", 47,
                     "vLLM's benchmark client and capyctl bench apart, decode tokens/s and first token",
                     "within {:.0%}")
CAPYCTL_VS_DIRECT = Goal("capyctl_vs_direct", 0.95, AT_LEAST, "x", 47,
                         "CapyCTL against the engine launched by hand, decode and first token, both clients",
                         ">= {:.2f}x")
# Issue 33: the prompt cache across a park (kv_park.py).
KV_VS_WARM = Goal("kv_vs_warm", 1.3, AT_MOST, "x", 33, "a new turn after an explicit wake against the turn warm",
                  "<= {:.1f}x warm")
KV_VS_NO_RESTORE = Goal("kv_vs_no_restore", 3.0, AT_LEAST, "x", 33,
                        "the next turn after a park: without restore against with", ">= {:.0f}x faster")
# Issue 36: one daemon driving many hosts over SSH (hosts_scale.py), at its largest size.
RSS_PER_HOST = Goal("rss_per_host", 2 * MiB, AT_MOST, "bytes", 36, "the daemon's RSS per idle host, over 1 host",
                    "<= {:.0f} MiB a host", 1 / MiB)
CPU_PER_HOST = Goal("cpu_per_host", 0.2, AT_MOST, "% core", 36,
                    "the daemon's unit CPU per idle host (with its ssh processes), over 1 host", "<= {:g}% of a core a host")
# One SSH connection to each host, exactly: none is a host not driven, two a master not shared.
SSH_PER_HOST = Goal("ssh_per_host", 1, EXACTLY, "count", 36, "SSH connections per host, every host connected",
                    "{:.0f} per host")
LIST_S = Goal("list_s", 1.0, AT_MOST, "s", 36, "`capyctl list hosts` and `list deployments --json`", "<= {:.0f} s")
RESTART_S = Goal("restart_s", 10.0, AT_MOST, "s", 36, "`systemctl restart` of the daemon to every deployment adopted",
                 "<= {:.0f} s, none relaunched")
# Issue 46: a deployment's replicas (replicas.py).
REPLICA_AFFINITY_TTFT = Goal("replica_affinity_ttft", 0.5, AT_MOST, "x", 46,
                             "prefix affinity over 2 replicas: median first token of multi-turn conversations "
                             "sharing a long system prompt, against client round robin over 2 deployments",
                             "<= {:.2f}x round robin")
REPLICA_KILL_FAILED = Goal("replica_kill_failed", 0, AT_MOST, "count", 46,
                           "a replica killed under load: non-streamed requests failed", "{:.0f} failed")
REPLICA_KILL_CUT = Goal("replica_kill_cut", 0, AT_MOST, "count", 46,
                        "a replica killed under load: streams cut without an error event", "{:.0f} cut silently")
REPLICA_ROLLOUT_FAILED = Goal("replica_rollout_failed", 0, AT_MOST, "count", 46,
                              "a new revision rolled out over 2 replicas under load: requests failed",
                              "{:.0f} failed")

GOALS: dict[str, Goal] = {g.name: g for g in (
    ADDED_LATENCY, MEDIAN_VS_NGINX, P95_VS_NGINX, TTFC_VS_NGINX, STREAM_VS_DIRECT, WAKE_VS_MANUAL, IDLE_RSS,
    RSS_GROWTH, SCALE_RPS, STREAMS, STREAMS_LOST, HOSTILE_FAILED, HOSTILE_P99, HOSTILE_OUTLIVED, ENGINE_CLIENT_PAYS,
    CONTENTION_FAILED, CONTENTION_SHARE, CONTENTION_P99, CONTENTION_ANSWERS, ANSWERS_VS_CEILING, SWAP_VS_OWN_START,
    MIXED_LIGHT_P99, KV_VS_WARM_PLUS_START, CLIENTS_AGREE, CAPYCTL_VS_DIRECT, KV_VS_WARM, KV_VS_NO_RESTORE,
    RSS_PER_HOST, CPU_PER_HOST, SSH_PER_HOST, LIST_S, RESTART_S, REPLICA_AFFINITY_TTFT, REPLICA_KILL_FAILED,
    REPLICA_KILL_CUT, REPLICA_ROLLOUT_FAILED)}
