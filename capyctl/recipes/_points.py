"""Every measured point of a recipe report as a row of one results table (CSV).

One row is one point: a metric of a section at one prompt length, stream count, batch size or
park tier, as one statistic (the median, the p95, or a single value). The columns are fixed
(COLUMNS, documented in docs/recipes.md) so that runs of many recipes, engines, versions and
machines append to one file and load into any table tool.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any, Iterator

COLUMNS = ("run_id", "recipe", "via", "quick", "engine", "engine_version", "model", "model_pin", "cpu_model",
           "cpu_cores", "ram_bytes", "gpus", "section", "metric", "prompt_tokens", "streams", "batch_size",
           "tier", "statistic", "value", "unit", "measured_at")
# A point's identity across reports: what `recipe compare` lines up.
POINT_KEY = ("section", "metric", "prompt_tokens", "streams", "batch_size", "tier", "statistic")


def _stats(summary: Any) -> Iterator[tuple[str, float]]:
    """(statistic, value) of a bench summary (median and p95), or of a plain number."""
    if isinstance(summary, dict):
        for stat in ("median", "p95"):
            if summary.get(stat) is not None:
                yield stat, float(summary[stat])
    elif isinstance(summary, (int, float)) and not isinstance(summary, bool):
        yield "value", float(summary)


def points(report: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The report's measured points, each a dict with POINT_KEY's fields, value and unit."""
    def point(section: str, metric: str, summary: Any, unit: str, **at: Any) -> Iterator[dict[str, Any]]:
        for stat, value in _stats(summary):
            yield {"section": section, "metric": metric, "prompt_tokens": at.get("prompt_tokens"),
                   "streams": at.get("streams"), "batch_size": at.get("batch_size"), "tier": at.get("tier"),
                   "statistic": stat, "value": value, "unit": unit}

    timings = report.get("timings") or {}
    for metric in ("cold_ready_s", "first_answer_s", "first_token_s"):
        yield from point("startup", metric.removesuffix("_s"), timings.get(metric), "s")
    memory = report.get("memory") or {}
    for when, facts in memory.items():
        for metric in ("cgroup_current_bytes", "cgroup_peak_bytes", "process_tree_rss_peak_bytes"):
            yield from point("memory", f"{when}_{metric.removesuffix('_bytes')}", facts.get(metric), "bytes")
        for domain in facts.get("domains") or []:
            name = _domain_name(str(domain["id"]))
            yield from point("memory", f"{when}_ledger_reserved_{name}", domain.get("reserved_bytes"), "bytes")
            yield from point("memory", f"{when}_held_{name}", domain.get("held_bytes"), "bytes")
    for tier in report.get("park_wake") or []:
        for metric in ("park_s", "wake_s", "first_answer_after_wake_s", "first_answer_waking_s"):
            yield from point("park_wake", metric.removesuffix("_s"), tier.get(metric), "s", tier=tier["tier"])
        yield from point("park_wake", "memory_parked", tier.get("memory_parked_bytes"), "bytes", tier=tier["tier"])
    bench = report.get("bench") or {}
    if "latency" in bench:
        lat = bench["latency"]
        yield from point("latency", "ttft", lat.get("ttft_s"), "s")
        yield from point("latency", "decode_tokens_per_s", lat.get("decode_tokens_per_s"), "tokens/s")
    for p in bench.get("prompt_sweep") or []:
        # The length asked for: the engine's own count of it varies by a token or two from run to
        # run (each prompt is new), and a point must line up with the same point of another run.
        tokens = p.get("target_tokens")
        yield from point("prompt_sweep", "ttft", p.get("ttft_s"), "s", prompt_tokens=tokens)
        yield from point("prompt_sweep", "prompt_tokens_per_s", p.get("prompt_tokens_per_s"), "tokens/s",
                         prompt_tokens=tokens)
    for p in bench.get("concurrency") or []:
        yield from point("concurrency", "aggregate_tokens_per_s", p.get("aggregate_tokens_per_s"), "tokens/s",
                         streams=p["streams"])
        yield from point("concurrency", "ttft", p.get("ttft_s"), "s", streams=p["streams"])
        yield from point("concurrency", "decode_tokens_per_s", p.get("per_stream_decode_tokens_per_s"), "tokens/s",
                         streams=p["streams"])
        yield from point("concurrency", "failed", p.get("failed"), "requests", streams=p["streams"])
    if "wake" in bench:
        w = bench["wake"]
        for metric in ("warm_ttft_s", "parked_ttft_s", "cold_ttft_s"):
            yield from point("wake", metric.removesuffix("_s"), w.get(metric), "s")
    if bench.get("systemone", {}).get("supported"):
        s = bench["systemone"]
        yield from point("systemone", "latency", s.get("latency_s"), "s")
        yield from point("systemone", "accuracy", s.get("accuracy"), "fraction")
    emb = bench.get("embeddings") or {}
    for p in emb.get("points") or []:
        at = {"batch_size": p.get("batch_size"), "prompt_tokens": p.get("target_tokens")}
        yield from point("embeddings", "latency", p.get("latency_s"), "s", **at)
        yield from point("embeddings", "inputs_per_s", p.get("inputs_per_s"), "inputs/s", **at)
        yield from point("embeddings", "prompt_tokens_per_s", p.get("prompt_tokens_per_s"), "tokens/s", **at)


def _domain_name(domain_id: str) -> str:
    """A memory domain without its host ("ram", "gpu0"): ids are "ram:<host>" and "gpu:<host>:<index>",
    and the host's name would keep two machines' points from lining up."""
    kind, _, rest = domain_id.partition(":")
    index = rest.rpartition(":")[2] if kind == "gpu" else ""
    return kind + index


def rows(report: dict[str, Any]) -> Iterator[dict[str, Any]]:
    machine, engine, model = report.get("machine") or {}, report.get("engine") or {}, report.get("model") or {}
    fixed = {"run_id": report.get("run_id"), "recipe": (report.get("recipe") or {}).get("name"),
             "via": report.get("via"), "quick": report.get("quick"), "engine": engine.get("kind"),
             "engine_version": engine.get("version"), "model": model.get("label"), "model_pin": model.get("pin"),
             "cpu_model": machine.get("cpu_model"), "cpu_cores": machine.get("cpu_cores"),
             "ram_bytes": machine.get("ram_bytes"),
             "gpus": "; ".join(g["name"] for g in machine.get("gpus") or []) or 0,
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(report.get("finished_at") or 0))}
    for p in points(report):
        yield {**fixed, **p}


def check_table(table: Path) -> bool:
    """Whether ``table`` is new (absent or empty); ValueError if it is a CSV with other columns."""
    if not table.exists() or table.stat().st_size == 0:
        return True
    with table.open(newline="") as f:
        header = next(csv.reader(f), [])
    if tuple(header) != COLUMNS:
        raise ValueError(f"{table} has other columns than a recipe results table: {header[:6]}...")
    return False


def append_rows(report: dict[str, Any], table: Path) -> int:
    """Append the report's points to the CSV ``table`` (with its header when new); how many."""
    table.parent.mkdir(parents=True, exist_ok=True)
    new = check_table(table)
    count = 0
    with table.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        for row in rows(report):
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})
            count += 1
    return count
