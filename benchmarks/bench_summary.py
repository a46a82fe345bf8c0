"""The table of issue 14 from one run of scripts/bench: every ratio, its goal, PASS or MISS.

Reads the JSON results the benchmarks wrote into one folder (``--json`` of each), prints the
table, the scale and LiteLLM figures, and writes ``summary.json`` and ``latency.png`` (latency
distributions direct vs nginx vs CapyCTL, and LiteLLM when it was measured) into that folder.

    .venv/bin/python benchmarks/bench_summary.py benchmarks/results/<timestamp>

With ``--docs docs/benchmarks.md`` it writes nothing into the folder: it replaces the text between
each ``<!-- bench_summary: begin NAME -->`` and ``<!-- bench_summary: end NAME -->`` in that file
with NAME's table from the run (``groups``: proxy, door, contention, kv_park, outside_client, hop,
replicas; a group the run did not measure too, each row "n/a" with its reason, never the block's
older figures) or of the goals (``goals``, ``goals-N`` for issue N), and leaves the text around
them alone.

The helpers above ``main`` are pure (no I/O) and covered by tests/unit/test_bench_summary.py.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

MiB = 1 << 20
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_goals as G  # noqa: E402  (every goal: benchmarks/bench_goals.py)
from bench_goals import judge  # noqa: E402,F401  (hosts_scale.py and the tests judge through here)

# proxy_hop.py's name for that proxy whose engine exchanges go through aiohttp's client.
AIOHTTP_CLIENT = "capyctl-aiohttp-client"
# proxy_vs_nginx.py's path through benchmarks/_aiohttp_relay.py: aiohttp's server with none of CapyCTL's work
AIOHTTP_SERVER = "aiohttp-server"
CONTENTION_COUNTS = ((2, "two"), (3, "three"))
STREAM_COUNTS = (1, 8, 64)
# The Pythons whose door figures the summary shows side by side (issue 57): the added latency, the
# hop and the chunk rates, each judged by the same goal on each. aiohttp starts a connection's task
# and each request's handler task eagerly from Python 3.12 on, on the next turn of the loop before
# (aiohttp/web_protocol.py, RequestHandler.connection_made and .start: asyncio.Task(...,
# eager_start=True) under ``sys.version_info >= (3, 12)``, loop.create_task on 3.11). proxy_hop.py
# and proxy_vs_nginx.py run the CapyCTL proxy and aiohttp's bare relay under each ``--other-python``
# too, its paths named by on_python; scripts/bench passes the one of these its .venv is not.
SIDE_BY_SIDE = ("3.11", "3.13")


def on_python(name: str, version: str) -> str:
    """The name of path ``name`` run under another Python than the benchmark's own, ``version`` its
    major.minor, in the benchmarks' JSON: "capyctl (3.13)". The benchmark's own paths keep their names."""
    return f"{name} ({version})"


def minor(version: str | None) -> str | None:
    """major.minor of a Python version ("3.11.7" -> "3.11"); None for None."""
    return ".".join(version.split(".")[:2]) if version else None


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def pythons(result: Mapping[str, Any] | None) -> tuple[str | None, list[str]]:
    """The Python a proxy benchmark ran on (its full version; None where its JSON, from before issue
    57, does not say) and the major.minor of each other Python it measured (``other_pythons``)."""
    result = result or {}
    return result.get("python"), sorted(result.get("other_pythons") or {}, key=_version_key)


def other_pythons_shown(result: Mapping[str, Any] | None) -> list[str]:
    """The Pythons whose rows the summary shows beside the run's own: every one of SIDE_BY_SIDE and
    every one the run measured, but the run's own. A run that did not record its Python was on
    SIDE_BY_SIDE[0] (scripts/setup made .venv with Debian 12's python3, 3.11, until then)."""
    own, measured = pythons(result)
    return sorted({*SIDE_BY_SIDE, *measured} - {minor(own) or SIDE_BY_SIDE[0]}, key=_version_key)


def _on(version: str | None) -> str:
    """A value's opening words naming the Python it was measured on ("" where the run did not say)."""
    return f"Python {version}: " if version else ""


def _not_on(result: Mapping[str, Any] | None, version: str, script: str) -> str:
    """Why a run has no figures from Python ``version``."""
    if version in ((result or {}).get("other_pythons") or {}):
        return f"not measured: {script} measured no such path on Python {version} in this run"
    return (f"not measured: this run had no Python {version} (scripts/bench passes {script} "
            f"--other-python .venv-py{version}/bin/python where it finds python{version})")


# The samples a percentile needs to say something: one in 100 above a p99 (issue 57). Under that, the
# p99 of a handful of samples is their largest, near enough, and the tables say so.
P99_SAMPLES = 100


def p95(values: Sequence[float]) -> float:
    """The 95th percentile, as every benchmark computes it: statistics.quantiles' inclusive method,
    between the two samples around it, never beyond the largest (the exclusive method, the default,
    extrapolates past the largest sample where there are fewer than 20)."""
    values = list(values)
    return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) >= 2 else values[0]


def p99(values: Sequence[float]) -> float:
    """The 99th percentile, as p95: never beyond the largest sample (the exclusive method read
    10.89 for the p99 of 1 to 10). From fewer than P99_SAMPLES it is near the largest: say so."""
    values = list(values)
    return statistics.quantiles(values, n=100, method="inclusive")[-1] if len(values) >= 2 else values[0]


@dataclass(frozen=True)
class Row:
    measure: str
    value: str  # what was measured, in words and figures
    goal: str
    status: str  # PASS, MISS, "info" (no goal) or "n/a" (not measured in this run, and why in value)
    ratio: float | None = None  # the figure the goal judges, when there is one


def paired_difference(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of ``a[i] - b[i]``: what ``a`` adds over ``b`` turn by turn. proxy_vs_nginx.py
    takes one sample of every path per turn, so a turn's samples saw the same machine; the median
    of the differences is far steadier than the difference of the medians (in two runs of the
    same proxy code: 0.49 and 0.53 ms, against 0.49 and 0.69)."""
    return statistics.median(x - y for x, y in zip(a, b))


def turn_interval(samples: Mapping[str, Sequence[float]], statistic: Callable[[Mapping[str, Sequence[float]]], float],
                  *, resamples: int = 1000, seed: int = 14) -> tuple[float, float] | None:
    """The 95% bootstrap interval of ``statistic`` over the turns: turns are drawn again with
    replacement, each with the samples of every path it took, so the interval says how far the
    figure could move with another draw of the same machine's turns. None under two turns."""
    turns = min((len(v) for v in samples.values()), default=0)
    if turns < 2:
        return None
    rng = random.Random(seed)
    figures = []
    for _ in range(resamples):
        picked = rng.choices(range(turns), k=turns)
        figures.append(statistic({name: [values[i] for i in picked] for name, values in samples.items()}))
    figures.sort()
    return figures[int(0.025 * resamples)], figures[min(resamples - 1, int(0.975 * resamples))]


def _interval(ci: tuple[float, float] | None, goal: float, fmt: Callable[[float], str]) -> str:
    """The interval in a few words, and whether the goal lies inside it (this run cannot tell then)."""
    if ci is None:
        return ""
    inside = ", goal inside: cannot tell" if ci[0] <= goal <= ci[1] else ""
    return f"95% CI {fmt(ci[0])}-{fmt(ci[1])}{inside}"


def _ratio_of_medians(turns: Mapping[str, Sequence[float]]) -> float:
    """CapyCTL's median over nginx's, for turn_interval (samples under "c" and "n")."""
    return statistics.median(turns["c"]) / statistics.median(turns["n"])


def _in_ms(value: float) -> str:
    return f"{value * 1000:.2f}"


def _in_x(value: float) -> str:
    return f"{value:.3f}"


def _median(values: Sequence[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.2f} ms"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MiB:.1f} MiB"


ADDED_MEASURE = "added latency, median, 1-token chat"


def chunks_measure(streams: int) -> str:
    return f"stream chunks/s, {streams} concurrent, vs direct"


def also_on(measure: str, version: str) -> str:
    """The measure of a row beside ``measure``'s, of the same figure on another Python (issue 57)."""
    return f"{measure}, Python {version}"


def _more_or_less(difference: float | None, own: str | None, fmt: Callable[[float | None], str]) -> str:
    """What a path on another Python saves (or costs) against the same path on the run's own
    Python ``own``: ``difference``, the median of the own path's samples less the other's, turn by turn."""
    if difference is None:
        return ""
    than = f"on Python {own}" if own else "on the run's own Python"
    return f"; {fmt(abs(difference))} {'less' if difference >= 0 else 'more'} than {than}, paired by turn"


def proxy_rows(pvn: dict[str, Any] | None) -> list[Row]:
    """The proxy rows from proxy_vs_nginx.py's JSON: latency samples, streams, concurrency. The added
    latency and the chunk rates are shown side by side for each Python of ``other_pythons_shown``
    too, each row right after the run's own, judged by the same goal ("not measured" where the run
    had no such Python)."""
    others = other_pythons_shown(pvn)
    if not pvn:
        why = "proxy_vs_nginx.py wrote no result"
        side_by_side = [ADDED_MEASURE, *(chunks_measure(n) for n in STREAM_COUNTS)]
        return [Row(m, why, g, "n/a") for measure, g in (
            (ADDED_MEASURE, G.ADDED_LATENCY.shown),
            ("latency median, total vs nginx", G.MEDIAN_VS_NGINX.shown),
            ("latency p95 vs nginx", G.P95_VS_NGINX.shown),
            ("time to first chunk, median, vs nginx", G.TTFC_VS_NGINX.shown),
            *((chunks_measure(n), G.STREAM_VS_DIRECT.shown) for n in STREAM_COUNTS))
            for m in [measure, *(also_on(measure, v) for v in others if measure in side_by_side)]]
    lat = pvn["latency_s"]
    med = {name: _median(v) for name, v in lat.items()}
    tail = {name: p95(v) if v else None for name, v in lat.items()}
    own = pvn.get("python")
    on_own = f"on Python {own}" if own else "on the run's own Python"
    versions = {v: (pvn.get("other_pythons") or {}).get(v, {}).get("version") or v for v in others}

    def paired(name: str, to: str = "direct") -> bool:
        # proxy_vs_nginx.py's turns: one sample of every path each, so they pair up by index.
        return bool(lat.get(name)) and bool(lat.get(to)) and len(lat[name]) == len(lat[to])

    def over_direct(name: str) -> float | None:
        if paired(name):
            return paired_difference(lat[name], lat["direct"])
        return med[name] - med["direct"] if med.get(name) is not None and med.get("direct") else None

    def added_ci(name: str) -> str:
        ci = turn_interval({"c": lat[name], "d": lat["direct"]},
                           lambda t: paired_difference(t["c"], t["d"])) if paired(name) else None
        return f" paired by turn ({_interval(ci, G.ADDED_LATENCY.bound, _in_ms)} ms)" if ci else ""

    def aiohttp_alone(name: str) -> str:
        # benchmarks/_aiohttp_relay.py: aiohttp's server as the proxy configures it, none of CapyCTL's work
        added = over_direct(name) if lat.get(name) else None
        return f"; aiohttp's server alone {_ms(added)}" if added is not None else ""

    def added_on(version: str) -> Row:
        name, measure = on_python("capyctl", version), also_on(ADDED_MEASURE, version)
        if not lat.get(name) or not med.get("direct"):
            return Row(measure, _not_on(pvn, version, "proxy_vs_nginx.py"), G.ADDED_LATENCY.shown, "n/a")
        added = over_direct(name)
        saved = paired_difference(lat["capyctl"], lat[name]) if paired(name, "capyctl") else None
        return Row(measure, f"{_on(versions[version])}{_ms(added)} over direct ({_x(_ratio(med[name], med['direct']))})"
                   + added_ci(name) + _more_or_less(saved, own, _ms)
                   + aiohttp_alone(on_python(AIOHTTP_SERVER, version)),
                   G.ADDED_LATENCY.shown, G.ADDED_LATENCY.judge(added), added)

    added, nginx_added, floor_added = over_direct("capyctl"), over_direct("nginx"), over_direct("floor")
    rows = [
        Row(ADDED_MEASURE,
            f"{_on(own)}{_ms(added)} over direct ({_x(_ratio(med['capyctl'], med['direct']))})" + added_ci("capyctl")
            + f"; nginx adds {_ms(nginx_added)}"
            + (f"; the floor relay {_ms(floor_added)}" if floor_added is not None else "")
            + aiohttp_alone(AIOHTTP_SERVER),
            G.ADDED_LATENCY.shown,
            G.ADDED_LATENCY.judge(added), added),
        *(added_on(v) for v in others),
    ]
    r = _ratio(med["capyctl"], med["nginx"])
    ci = turn_interval({"c": lat["capyctl"], "n": lat["nginx"]},
                       _ratio_of_medians) if r is not None else None
    rows.append(Row("latency median, total vs nginx",
                    f"{_x(r)} ({_ms(med['capyctl'])} vs {_ms(med['nginx'])}"
                    + (f"; {_interval(ci, G.MEDIAN_VS_NGINX.bound, _in_x)}" if ci else "") + ")",
                    G.MEDIAN_VS_NGINX.shown, G.MEDIAN_VS_NGINX.judge(r), r))
    r = _ratio(tail["capyctl"], tail["nginx"])
    rows.append(Row("latency p95 vs nginx",
                    f"{_x(r)}; {_x(_ratio(tail['capyctl'], tail['direct']))} direct "
                    f"(nginx {_x(_ratio(tail['nginx'], tail['direct']))} direct)",
                    G.P95_VS_NGINX.shown, G.P95_VS_NGINX.judge(r), r))
    ttfc = {name: _median(v) for name, v in pvn["ttfc_s"].items()}
    r = _ratio(ttfc.get("capyctl"), ttfc.get("nginx"))
    ci = turn_interval({"c": pvn["ttfc_s"]["capyctl"], "n": pvn["ttfc_s"]["nginx"]},
                       _ratio_of_medians) if r is not None else None
    rows.append(Row("time to first chunk, median, vs nginx", f"{_x(r)} ({_ms(ttfc.get('capyctl'))} vs "
                    f"{_ms(ttfc.get('nginx'))}" + (f"; {_interval(ci, G.TTFC_VS_NGINX.bound, _in_x)}" if ci else "") + ")",
                    G.TTFC_VS_NGINX.shown, G.TTFC_VS_NGINX.judge(r), r))
    concurrency = pvn.get("concurrency") or {}
    goal = G.STREAM_VS_DIRECT.shown
    for n in STREAM_COUNTS:
        point = concurrency.get(str(n))
        measure = chunks_measure(n)
        if not point:
            rows += [Row(m, "not measured in this run", goal, "n/a") for m in [measure] + [also_on(measure, v)
                                                                                         for v in others]]
            continue
        rate = {name: _median(p["chunks_per_s"]) for name, p in point.items()}
        r = _ratio(rate.get("capyctl"), rate.get("direct"))
        rows.append(Row(measure, f"{_on(own)}{_x(r)} ({rate['capyctl']:.0f}/s vs {rate['direct']:.0f}/s; nginx "
                        f"{_x(_ratio(rate.get('nginx'), rate.get('direct')))})", goal,
                        G.STREAM_VS_DIRECT.judge(r), r))
        for version in others:
            name = on_python("capyctl", version)
            if rate.get(name) is None:
                rows.append(Row(also_on(measure, version), _not_on(pvn, version, "proxy_vs_nginx.py"), goal, "n/a"))
                continue
            r_on = _ratio(rate[name], rate.get("direct"))
            rows.append(Row(also_on(measure, version),
                            f"{_on(versions[version])}{_x(r_on)} ({rate[name]:.0f}/s vs {rate['direct']:.0f}/s; "
                            f"{_x(r)} {on_own})", goal,
                            G.STREAM_VS_DIRECT.judge(r_on), r_on))
    return rows


def wake_row(wake: dict[str, Any] | None) -> Row:
    measure, goal = "parked -> first token vs llama-server by hand", G.WAKE_VS_MANUAL.shown
    if not wake or not wake.get("parked_s"):
        return Row(measure, (wake or {}).get("error") or "wake_vs_manual.py wrote no result", goal, "n/a")
    manual, parked = _median(wake["manual_s"]), _median(wake["parked_s"])
    r = _ratio(parked, manual)
    return Row(measure, f"{_x(r)} ({_ms(parked)} vs {_ms(manual)}; restart-only wake)", goal,
               G.WAKE_VS_MANUAL.judge(r), r)


def kv_park_rows(kv: dict[str, Any] | None) -> list[Row]:
    """The next turn of a long conversation after a park, with and without restore: the wake
    included, against the warm turn plus the engine's own start by hand (issue 47); after an
    explicit wake, against the warm turn (issue 33)."""
    park_goal, warm_goal = G.KV_VS_WARM_PLUS_START.shown, G.KV_VS_WARM.shown
    restore_goal = G.KV_VS_NO_RESTORE.shown
    whens = (("after_park", "wake included", park_goal), ("after_wake", "after the wake", warm_goal))
    if not kv or not kv.get("median_s"):
        why = (kv or {}).get("error") or "kv_park.py wrote no result"
        return [row for _, label, goal in whens for row in (
            Row(f"next turn after a park vs {'warm + own start' if label == 'wake included' else 'warm'}, {label}",
                why, goal, "n/a"),
            Row(f"next turn after a park: without restore vs with, {label}", why, restore_goal, "n/a"))]
    m = kv["median_s"]
    own = _median(kv.get("own_start_s"))
    rows = []
    for when, label, goal in whens:
        if when == "after_park":
            r = kv.get("after_park_vs_warm_plus_start")
            rows.append(Row(f"next turn ({kv.get('prompt_tokens')} tokens) after a park vs warm + own start, {label}",
                            f"{_x(r)} ({_ms(m['kv_after_park'])} vs {_ms(m['warm'])} + {_ms(own)})"
                            if r is not None else "kv_park.py measured no start by hand",
                            goal, G.KV_VS_WARM_PLUS_START.judge(r), r))
        else:
            r = kv[f"{when}_vs_warm"]
            rows.append(Row(f"next turn ({kv.get('prompt_tokens')} tokens) after a park vs warm, {label}",
                            f"{_x(r)} ({_ms(m[f'kv_{when}'])} vs {_ms(m['warm'])})", goal,
                            G.KV_VS_WARM.judge(r), r))
        r = kv[f"no_restore_vs_restore_{when}"]
        rows.append(Row(f"next turn after a park: without restore vs with, {label}",
                        f"{_x(r)} ({_ms(m[f'nokv_{when}'])} vs {_ms(m[f'kv_{when}'])})", restore_goal,
                        G.KV_VS_NO_RESTORE.judge(r), r))
    return rows


def rss_rows(scale: dict[str, Any] | None) -> list[Row]:
    few_goal = G.IDLE_RSS.shown
    flat_goal = f"{G.IDLE_RSS.shown} and {G.RSS_GROWTH.shown}"
    if not scale or scale.get("rss_few_bytes") is None:
        why = (scale or {}).get("error") or "daemon_scale.py wrote no result"
        return [Row("daemon idle RSS after a few requests", why, few_goal, "n/a"),
                Row("daemon idle RSS after many requests (flat?)", why, flat_goal, "n/a")]
    few, after = scale["rss_few_bytes"], scale.get("rss_after_bytes")
    rows = [Row("daemon idle RSS after a few requests", _mib(few), few_goal,
                G.IDLE_RSS.judge(few), few)]
    count = scale.get("requests", 0)
    measure = f"daemon idle RSS after {count:,} requests (flat?)"
    if after is None:
        return rows + [Row(measure, scale.get("error") or "not measured", flat_goal, "n/a")]
    growth = after - few
    ok = after <= G.IDLE_RSS.bound and growth <= G.RSS_GROWTH.bound
    return rows + [Row(measure, f"{_mib(after)} ({growth / MiB:+.1f} MiB)", flat_goal, "PASS" if ok else "MISS",
                       after)]


def litellm_rows(pvn: dict[str, Any] | None) -> list[Row]:
    """Where CapyCTL stands against LiteLLM's proxy (no goal in the issue: information)."""
    if not pvn:
        return []
    status = pvn.get("litellm") or {}
    lat = pvn["latency_s"]
    if not lat.get("litellm"):
        return [Row("LiteLLM proxy", status.get("error") or "not measured in this run", "(peer)", "n/a")]
    med = {name: _median(v) for name, v in lat.items()}
    tail = {name: p95(v) for name, v in lat.items() if v}
    rows = [Row("LiteLLM: latency median, CapyCTL vs LiteLLM",
                f"{_x(_ratio(med['capyctl'], med['litellm']))} ({_ms(med['capyctl'])} vs {_ms(med['litellm'])}; "
                f"LiteLLM adds {_ms(med['litellm'] - med['direct'])} over direct)", "(peer)", "info"),
            Row("LiteLLM: latency p95, CapyCTL vs LiteLLM",
                f"{_x(_ratio(tail['capyctl'], tail['litellm']))} ({_ms(tail['capyctl'])} vs {_ms(tail['litellm'])})",
                "(peer)", "info")]
    ttfc = {name: _median(v) for name, v in pvn["ttfc_s"].items()}
    if ttfc.get("litellm"):
        rows.append(Row("LiteLLM: time to first chunk, CapyCTL vs LiteLLM",
                        _x(_ratio(ttfc["capyctl"], ttfc["litellm"])), "(peer)", "info"))
    for n, point in sorted((pvn.get("concurrency") or {}).items(), key=lambda kv: int(kv[0])):
        if point.get("litellm"):
            rate = {name: _median(p["chunks_per_s"]) for name, p in point.items()}
            rows.append(Row(f"LiteLLM: stream chunks/s, {n} concurrent, CapyCTL vs LiteLLM",
                            f"{_x(_ratio(rate['capyctl'], rate['litellm']))} (LiteLLM "
                            f"{_x(_ratio(rate['litellm'], rate['direct']))} direct)", "(peer)", "info"))
    return rows


HOP_MEASURE = "one hop over direct, instant engine (median)"


def hop_rows(hop: dict[str, Any] | None) -> list[Row]:
    """One hop against an engine that answers at once (proxy_hop.py): the proxy's own cost, no model
    noise; beside the run's own, the same hop on each Python of ``other_pythons_shown`` (issue 57)."""
    if not hop or not hop.get("hop_s"):
        return []
    hops, cpus, samples = hop["hop_s"], hop.get("cpu_per_request_s") or {}, hop.get("samples") or {}
    capy, nginx = hops["capyctl"], hops["nginx"]
    cpu = hop.get("capyctl_per_request_s")
    own = hop.get("python")

    def aiohttp_alone(name: str) -> str:
        # benchmarks/_aiohttp_relay.py: aiohttp's server as the proxy configures it, none of CapyCTL's work
        if hops.get(name) is None:
            return ""
        return f"; aiohttp's server alone {_us(hops[name])}" + (f" (CPU {_us(cpus[name])}/request)"
                                                                 if cpus.get(name) else "")

    def on(version: str) -> Row:
        name, measure = on_python("capyctl", version), also_on(HOP_MEASURE, version)
        if hops.get(name) is None:
            return Row(measure, _not_on(hop, version, "proxy_hop.py"), "(profile)", "n/a")
        full = (hop.get("other_pythons") or {}).get(version, {}).get("version") or version
        pair = samples.get("capyctl"), samples.get(name)  # proxy_hop.py's turns: one request on every path
        saved = paired_difference(*pair) if pair[0] and pair[1] and len(pair[0]) == len(pair[1]) else None
        return Row(measure, f"{_on(full)}{_us(hops[name])} vs nginx's {_us(nginx)} ({_x(_ratio(hops[name], nginx))})"
                   + (f"; proxy CPU {_us(cpus[name])}/request" if cpus.get(name) else "")
                   + _more_or_less(saved, own, _us) + aiohttp_alone(on_python(AIOHTTP_SERVER, version)),
                   "(profile)", "info", hops[name])

    rows = [Row(HOP_MEASURE,
                f"{_on(own)}{capy * 1e6:.0f} us vs nginx's {nginx * 1e6:.0f} us ({_x(_ratio(capy, nginx))})"
                + (f"; proxy CPU {cpu * 1e6:.0f} us/request" if cpu else "") + aiohttp_alone(AIOHTTP_SERVER),
                "(profile)", "info"),
            *(on(v) for v in other_pythons_shown(hop))]
    plain = hop["hop_s"].get(AIOHTTP_CLIENT)
    if plain is not None:  # the same proxy reaching its engine through aiohttp's client, in the same run
        plain_cpu = hop.get("cpu_per_request_s", {}).get(AIOHTTP_CLIENT)
        rows.append(Row("one hop, the engine reached through aiohttp's client",
                        f"{plain * 1e6:.0f} us" + (f"; proxy CPU {plain_cpu * 1e6:.0f} us/request" if plain_cpu else ""),
                        "(baseline)", "info"))
    floor = hop["hop_s"].get("floor")
    if floor is not None:  # benchmarks/_minimal_relay.py in the same run: Python without CapyCTL's work
        floor_cpu = hop.get("cpu_per_request_s", {}).get("floor")
        rows.append(Row("one hop, a minimal Python relay (no key, model, admission, metrics)",
                        f"{floor * 1e6:.0f} us" + (f"; CPU {floor_cpu * 1e6:.0f} us/request" if floor_cpu else ""),
                        "(floor)", "info"))
    return rows


def engine_client_row(hop: dict[str, Any] | None) -> Row:
    """Issue 45: whether the proxy's hand-made engine client pays for itself, from proxy_hop.py's
    two proxies in the same run (latency paired by turn, and the proxy's CPU per request): KEEP or
    DELETE, from this run's figure alone (no rerun decides it: bench_goals.ENGINE_CLIENT_PAYS)."""
    goal = G.ENGINE_CLIENT_PAYS.shown
    saved = (hop or {}).get("engine_client_saves")
    if not saved:
        why = (hop or {}).get("error") or ("proxy_hop.py wrote no result" if not hop else
                                           "proxy_hop.py measured no aiohttp engine client in this run")
        return Row("engine client: what the hand-made one saves a request", why, goal, "n/a")
    latency, cpu = saved["latency_s"], saved.get("cpu_s")
    med = hop.get("median_s") or {}
    return Row(f"engine client: hand-made saves {latency * 1e6:.0f} us a request",
               f"median {_us(med.get('capyctl'))} against {_us(med.get(AIOHTTP_CLIENT))} through aiohttp's client"
               + (f"; proxy CPU {cpu * 1e6:.0f} us a request less" if cpu is not None else "")
               + "; this run's figure decides, not a rerun",
               goal, G.ENGINE_CLIENT_PAYS.judge(latency), latency)


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e6:.0f} us"


def scale_row(scale: dict[str, Any] | None) -> Row:
    """Issue 45: the daemon's throughput with 8 deployments (daemon_scale.py) at least half of what
    issue 32's front reached."""
    count = len((scale or {}).get("deployments") or {}) or 8
    measure, goal = f"{count} deployments behind one daemon: requests/s", G.SCALE_RPS.shown
    if not scale or scale.get("total_rps") is None:
        return Row(measure, (scale or {}).get("error") or "daemon_scale.py wrote no result", goal, "n/a")
    rps = scale["total_rps"]
    return Row(measure, f"{rps:,.0f}/s ({scale.get('requests', 0):,} requests at {scale.get('concurrency')} at once)",
               goal, G.SCALE_RPS.judge(rps), rps)


def streams_row(streams: dict[str, Any] | None) -> Row:
    """Issue 45: streamed requests at once across the deployments (streams_scale.py), every one
    ending with [DONE], and the daemon's RSS before, at its peak and after, reported."""
    goal = f"{G.STREAMS_LOST.shown} of {G.STREAMS.shown}; RSS reported"
    if not streams or streams.get("streams") is None or streams.get("done") is None:
        return Row(f"{G.STREAMS.bound:,} streams across 8 deployments: dropped or cut",
                   (streams or {}).get("error") or "streams_scale.py wrote no result", goal, "n/a")
    n, lost = streams["streams"], streams["streams"] - streams["done"]
    rss = streams.get("rss_bytes") or {}
    reported = all(rss.get(k) is not None for k in ("before", "peak", "after"))
    ok = lost <= G.STREAMS_LOST.bound and n >= G.STREAMS.bound and reported
    by = streams.get("lost_by") or {}
    return Row(f"{n:,} streams across {streams.get('deployments', 8)} deployments: dropped or cut",
               f"{lost} of {n:,} ({_codes(by)}); daemon RSS {_mib(rss.get('before'))} before, "
               f"{_mib(rss.get('peak'))} peak, {_mib(rss.get('after'))} after"
               + (f"; a stream {_s(streams.get('median_stream_s'))} median" if streams.get("median_stream_s") else "")
               + ("" if n >= G.STREAMS.bound else f" (fewer streams than the goal's {G.STREAMS.bound:,})"),
               goal, "PASS" if ok else "MISS", lost)


def hostile_rows(hostile: dict[str, Any] | None) -> list[Row]:
    """Issue 45: 8 keyed clients while one client holds thousands of half-sent heads
    (hostile_heads.py): all answered, their p99 against the same clients without the attack, and
    the half heads closed by the head deadline; then what the attacker's connections met."""
    answered_m, p99_m = "hostile load: keyed requests failed during the attack", "hostile load: keyed p99 vs no attack"
    closed_m = "hostile load: half heads outliving the head deadline"
    answered_g, p99_g = G.HOSTILE_FAILED.shown, G.HOSTILE_P99.shown
    closed_g = G.HOSTILE_OUTLIVED.shown
    keyed = (hostile or {}).get("keyed") or {}
    base, attack = keyed.get("baseline"), keyed.get("attack")
    if not base or not attack:
        why = (hostile or {}).get("error") or "hostile_heads.py wrote no result"
        return [Row(answered_m, why, answered_g, "n/a"), Row(p99_m, why, p99_g, "n/a"), Row(closed_m, why, closed_g, "n/a")]
    failed = attack["failed"]
    rows = [Row(answered_m, f"{failed} of {attack['requests']} ({_codes(attack.get('failed_by') or {})}); "
                            f"without the attack {base['failed']} of {base['requests']}",
                answered_g, G.HOSTILE_FAILED.judge(failed if attack["requests"] else None), failed)]
    r = _ratio(attack.get("p99_s"), base.get("p99_s"))
    rows.append(Row(p99_m, f"{_x(r)} ({_ms(attack.get('p99_s'))} vs {_ms(base.get('p99_s'))}; p50 "
                           f"{_ms(attack.get('p50_s'))} vs {_ms(base.get('p50_s'))})",
                    p99_g, G.HOSTILE_P99.judge(r), r))
    heads = hostile.get("attacker") or {}
    deadline = hostile.get("head_deadline_s")
    outlived = heads.get("outlived_deadline")
    rows.append(Row(closed_m, f"{outlived} of {heads.get('connected', 0)} accepted (deadline {_s(deadline)}); "
                              f"closed by the server after {_spread(heads.get('closed_after_s'))}",
                    closed_g, G.HOSTILE_OUTLIVED.judge(outlived if heads.get("connected") else None), outlived))
    rows.append(Row("hostile load: the attacker's connections",
                    f"{heads.get('attempts', 0)} tried from {heads.get('address', '?')}, {heads.get('connected', 0)} "
                    f"accepted, {sum((heads.get('connect_failed') or {}).values())} not "
                    f"({_codes(heads.get('connect_failed') or {})}); answered "
                    f"{_codes(heads.get('answered') or {})}; closed without an answer {heads.get('closed_silently', 0)}; "
                    f"open at the end {heads.get('open_at_end', 0)}", "(attack)", "info"))
    return rows


def _spread(values: Sequence[float] | None) -> str:
    """Seconds as min / median / max, for when the server closed the attacker's connections."""
    if not values:
        return "none closed"
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f} s (min / median / max)"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def _codes(by_code: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {code}" for code, n in sorted(by_code.items(), key=lambda kv: -kv[1])) or "none"


def contention_rows(contention: dict[str, Any] | None) -> list[Row]:
    """Issue 31's rows from contention.py's JSON: two and three big models on room for one, taking
    turns in batches, against the same clients on one resident model (the upper bound) and against
    arrival order (the baseline, shown beside each row and in an info row of its own, no goal)."""
    def measures(n: int) -> list[tuple[str, str]]:
        return [(f"{n} models on room for one: failed requests", G.CONTENTION_FAILED.shown),
                (f"{n} models on room for one: smallest share of answers", G.CONTENTION_SHARE.shown),
                (f"{n} models on room for one: p99 latency", G.CONTENTION_P99.shown),
                (f"{n} models on room for one: answers vs one model",
                 f"{G.CONTENTION_ANSWERS.shown}, or {G.ANSWERS_VS_CEILING.shown} a start longer than a batch sets"),
                (f"{n} models on room for one: median swap vs the engine's own start by hand",
                 G.SWAP_VS_OWN_START.shown)]

    scenarios = (contention or {}).get("scenarios") or {}
    if not scenarios:
        why = (contention or {}).get("error") or "contention.py wrote no result"
        return [Row(m, why, g, "n/a") for n, _ in CONTENTION_COUNTS for m, g in measures(n)] + mixed_rows(None, why)
    ok = {name: s for name, s in scenarios.items() if not s.get("error")}
    one = ok.get("one")
    quantum = contention.get("quantum_s")
    # A scenario without a swap of its own (one whose swaps all failed) is held to the run's median swap.
    all_swaps = [s["swap_phases_s"]["swap"] for s in ok.values() if (s.get("swap_phases_s") or {}).get("swap")]
    run_swap = statistics.median(all_swaps) if all_swaps else None
    rows: list[Row] = []
    if one:
        rows.append(Row("one resident model, same clients (the upper bound)",
                        f"{one['answered']} answers ({one['answers_per_s']:.1f}/s), p50 {_s(one['p50_s'])}, "
                        f"p99 {_s(one['p99_s'])}, {one['failed']} failed", "(bound)", "info"))
    for n, label in CONTENTION_COUNTS:
        batches, arrival = scenarios.get(f"{label}-batches"), ok.get(f"{label}-arrival")
        if not batches or batches.get("error"):
            why = (batches or {}).get("error") or "not measured in this run"
            rows += [Row(m, why, g, "n/a") for m, g in measures(n)]
        else:
            rows += _contention_goal_rows(n, measures(n), batches, arrival, one, quantum, run_swap)
        if arrival:
            a = arrival
            rows.append(Row(f"{n} models on room for one, arrival order (baseline)",
                            f"{a['answered']} answers, {a['failed']} failed ({_codes(a['failed_by_code'])}), "
                            f"{a['wakes']} swaps, smallest share {a['min_share']:.2f}, "
                            f"p50 {_s(a['p50_s'])}, p99 {_s(a['p99_s'])}"
                            + (f", {_x(_ratio(a['answered'], one['answered']))} one model" if one else ""),
                            "(baseline)", "info"))
    return rows + mixed_rows(scenarios.get("two-mixed"), (contention or {}).get("error"))


def mixed_rows(mixed: dict[str, Any] | None, error: str | None = None) -> list[Row]:
    """Issue 47's mixed load: the resident small model's client beside two big models taking turns."""
    p99_measure = "2 models taking turns: the resident model's p99, asked once a second, vs alone"
    failed_measure = "2 models taking turns, a resident one asked: failed requests"
    p99_goal, failed_goal = G.MIXED_LIGHT_P99.shown, G.CONTENTION_FAILED.shown
    if not mixed or mixed.get("error"):
        why = (mixed or {}).get("error") or error or "not measured in this run"
        return [Row(p99_measure, why, p99_goal, "n/a"), Row(failed_measure, why, failed_goal, "n/a")]
    light = mixed.get("light") or {}
    alone_s = mixed.get("light_alone_s") or []
    under, alone_n = light.get("answered", 0), len(alone_s)
    if under >= P99_SAMPLES and alone_n >= P99_SAMPLES:
        loaded, alone, how = light.get("p99_s"), p99(alone_s), "p99"
    else:
        # A p99 of 10 samples alone (contention.LIGHT_ALONE_REQUESTS) and some 30 under load says
        # nothing a slowest sample does not: the slowest against the slowest, and that said.
        loaded, alone = light.get("max_s"), max(alone_s) if alone_s else None
        how = (f"too few samples for a p99 ({under} under load, {alone_n} alone; it needs {P99_SAMPLES}): "
               "the slowest against the slowest")
    r = _ratio(loaded, alone)
    total = mixed["requests"] + light.get("requests", 0)
    return [Row(p99_measure, f"{_x(r)} ({_ms(loaded)} vs {_ms(alone)} alone, {how}; "
                             f"{light.get('answered', 0)} of {light.get('requests', 0)} answered)",
                p99_goal, G.MIXED_LIGHT_P99.judge(r), r),
            Row(failed_measure, f"{mixed['failed']} of {total} ({_codes(mixed['failed_by_code'])}); "
                                f"{mixed['answered']} big-model answers, {mixed['wakes']} swaps",
                failed_goal, G.CONTENTION_FAILED.judge(mixed["failed"]), mixed["failed"])]


def _contention_goal_rows(n: int, measures: list[tuple[str, str]], b: dict[str, Any], a: dict[str, Any] | None,
                          one: dict[str, Any] | None, quantum: float | None, run_swap: float | None) -> list[Row]:
    (m_failed, g_failed), (m_share, g_share), (m_p99, g_p99), (m_answers, g_answers), (m_swap, g_swap) = measures
    beside = (lambda text: f"; arrival order {text}") if a else (lambda text: "")
    failed_states = sorted(name for name, st in (b.get("states") or {}).items() if st and st[0] == "failed")
    rows = [Row(m_failed, f"{b['failed']} of {b['requests'] + b['light']['requests']} ({_codes(b['failed_by_code'])})"
                + (f"; left failed: {', '.join(failed_states)}" if failed_states else "")
                + (f"; the resident one evicted {b['small_evictions']}x" if b.get("small_evictions") else "")
                + beside(f"{a['failed']} failed" if a else ""), g_failed,
                G.CONTENTION_FAILED.judge(b["failed"]), b["failed"])]
    shares = ", ".join(f"{m} {v:.2f}" for m, v in b["shares"].items())
    rows.append(Row(m_share, f"{b['min_share']:.2f} ({shares}; {b['wakes']} swaps)"
                    + beside(f"{a['min_share']:.2f}, {a['wakes']} swaps" if a else ""), g_share,
                    G.CONTENTION_SHARE.judge(b["min_share"] if b["answered"] else None),
                    b["min_share"]))
    swap = (b.get("swap_phases_s") or {}).get("swap") or run_swap
    one_p99 = one.get("p99_s") if one else None
    bound = G.contention_p99_bound(n, quantum, one_p99, swap)
    few = (f"; of {b['answered']} answers, too few for a p99 ({P99_SAMPLES}): near the slowest"
           if b["answered"] < P99_SAMPLES else "")
    rows.append(Row(m_p99, f"{_s(b['p99_s'])} (p50 {_s(b['p50_s'])}, max {_s(b['max_s'])}{few}; bound: quantum "
                    f"{_s(quantum)} + {n - 1} x (one-model p99 {_s(one_p99)} + swap {_s(swap)})"
                    + ("" if bound is not None else ", not all measured") + ")"
                    + beside(f"p99 {_s(a['p99_s'])}" if a else ""),
                    g_p99 + (f" ({_s(bound)})" if bound is not None else ""),
                    G.CONTENTION_P99.judge(b["p99_s"], bound), b["p99_s"]))
    r = _ratio(b["answered"], one["answered"]) if one else None
    own = _median(b.get("own_start_s"))
    ceiling = answer_ceiling(b, own)
    verdict = G.CONTENTION_ANSWERS.judge(r)
    if verdict == "MISS" and ceiling is not None:
        verdict = G.ANSWERS_VS_CEILING.judge(r, G.ANSWERS_VS_CEILING.bound * ceiling)
    rows.append(Row(m_answers, (f"{_x(r)} ({b['answered']} vs {one['answered']})" if one
                                else "the one-model run was not measured")
                    + (f"; ceiling {_x(ceiling)} (a batch {_s(b.get('batch_s'))}, the engine's own start "
                       f"{_s(own)})" if ceiling is not None else "")
                    + beside(_x(_ratio(a["answered"], one["answered"])) if a and one else ""), g_answers,
                    verdict, r))
    phases = b.get("swap_phases_s") or {}
    swap, at_once = phases.get("swap"), _median(b.get("own_start_batch_s"))
    r = _ratio(swap, own)
    rows.append(Row(m_swap, (f"{_x(r)} ({_ms(swap)} vs {_ms(own)}; of the swap, the engine's load "
                             f"{_ms(phases.get('health'))} and its first answer to the turn's requests "
                             f"{_ms(phases.get('first answer'))}; started by hand with those requests at once "
                             f"{_ms(at_once)}; {b.get('swaps', 0)} swaps)") if swap is not None and own is not None
                    else "no swap or no start by hand in this run", g_swap,
                    G.SWAP_VS_OWN_START.judge(r), r))
    return rows


def outside_client_rows(outside: dict[str, Any] | None) -> list[Row]:
    """capyctl bench and vLLM's client on CapyCTL and on the same engine launched by hand (issue 47):
    how far the two clients' figures are apart (the worst of decode and first token, on either side),
    and the lowest reading of CapyCTL against direct (either client, decode or first token)."""
    m_agree, g_agree = "vLLM's client vs capyctl bench, decode and first token", G.CLIENTS_AGREE.shown
    m_direct, g_direct = "CapyCTL vs direct, decode and first token, both clients", G.CAPYCTL_VS_DIRECT.shown
    summary = (outside or {}).get("summary")
    if not summary:
        why = (outside or {}).get("error") or "outside_client.py wrote no result"
        return [Row(m_agree, why, g_agree, "n/a"), Row(m_direct, why, g_direct, "n/a")]
    ours, theirs = summary["capyctl bench"], summary["vllm"]
    apart = {f"{side} {what}": abs(theirs[side][key] / ours[side][key] - 1)
             for side in ("capyctl", "direct") for what, key in (("decode", "decode_tokens_per_s"),
                                                                 ("first token", "ttft_s"))}
    worst_apart = max(apart, key=apart.__getitem__)
    # Above 1, CapyCTL is the faster: decode CapyCTL / direct, first token direct / CapyCTL.
    versus = {f"{client} {what}": (s["capyctl"]["decode_tokens_per_s"] / s["direct"]["decode_tokens_per_s"]
                                   if what == "decode" else s["direct"]["ttft_s"] / s["capyctl"]["ttft_s"])
              for client, s in (("capyctl bench", ours), ("vLLM's client", theirs)) for what in ("decode", "first token")}
    worst_versus = min(versus, key=versus.__getitem__)
    d = ours["capyctl"]
    return [Row(m_agree, f"{apart[worst_apart]:.1%} apart at most ({worst_apart}); capyctl bench on CapyCTL "
                         f"{d['decode_tokens_per_s']:.1f} tokens/s, first token {_ms(d['ttft_s'])}", g_agree,
                G.CLIENTS_AGREE.judge(apart[worst_apart]), apart[worst_apart]),
            Row(m_direct, f"{_x(versus[worst_versus])} at least ({worst_versus}); "
                          + ", ".join(f"{k} {_x(v)}" for k, v in versus.items()), g_direct,
                G.CAPYCTL_VS_DIRECT.judge(versus[worst_versus]), versus[worst_versus])]


def replicas_rows(rep: dict[str, Any] | None) -> list[Row]:
    """Issue 46's rows from replicas.py's JSON: prefix affinity against client round robin (median
    first token), a replica killed under load (failed requests, streams cut silently), a revision
    rolled out under load (failed requests), and scaling's seconds up and down (reported, no goal).
    A part not run, or failed, is n/a with its reason (the run's own error first: a daemon without
    replicas says so there)."""
    m_aff = "replicas: prefix affinity vs client round robin, median first token"
    m_failed, m_cut = "replicas: one killed under load: non-streamed requests failed", \
        "replicas: one killed under load: streams cut without an error event"
    m_roll = "replicas: a new revision rolled out under load: requests failed"
    m_up, m_down = "replicas: load past scale_up_load -> second replica ready", \
        "replicas: load ended -> second replica parked"
    parts = (rep or {}).get("parts") or {}

    def why(name: str) -> str | None:
        """Why a part has no figures; None where it has them."""
        part = parts.get(name)
        if part and not part.get("error"):
            return None
        if part and name == "rollout" and "plain" in part:
            return None  # (its deploy failed: said in its row)
        return (part or {}).get("error") or (rep or {}).get("error") or (
            "replicas.py wrote no result" if rep is None else "not measured in this run")

    rows: list[Row] = []
    aff = parts.get("affinity")
    if why("affinity"):
        rows.append(Row(m_aff, why("affinity"), G.REPLICA_AFFINITY_TTFT.shown, "n/a"))
    else:
        a, b = aff["affinity"], aff["round_robin"]
        r = aff.get("median_ratio")

        def cache(side: dict[str, Any]) -> str:
            return str((side.get("cache_n") or {}).get("median", "n/a"))
        rows.append(Row(m_aff, f"{_x(r)} ({_ms(a['ttft_s']['median'])} vs {_ms(b['ttft_s']['median'])}; p90 "
                               f"{_x(aff.get('p90_ratio'))}, {_ms(a['ttft_s']['p90'])} vs {_ms(b['ttft_s']['p90'])}; "
                               f"cache_n median {cache(a)} vs {cache(b)}; {aff['conversations']} conversations of "
                               f"{aff['turns']} turns, {aff['concurrency']} at a time"
                               + (f"; failed turns {a['failed']} vs {b['failed']}" if a["failed"] or b["failed"] else "")
                               + ")", G.REPLICA_AFFINITY_TTFT.shown, G.REPLICA_AFFINITY_TTFT.judge(r), r))
        rows.append(Row("replicas: client round robin over two deployments (baseline)",
                        f"first token median {_ms(b['ttft_s']['median'])}, p90 {_ms(b['ttft_s']['p90'])}, follow-up "
                        f"turns {_ms(b['follow_up_ttft_s']['median'])} (affinity "
                        f"{_ms(a['follow_up_ttft_s']['median'])}); {b['answered']} of {b['turns']} turns answered",
                        "(baseline)", "info"))
    kill = parts.get("kill")
    if why("kill"):
        rows += [Row(m_failed, why("kill"), G.REPLICA_KILL_FAILED.shown, "n/a"),
                 Row(m_cut, why("kill"), G.REPLICA_KILL_CUT.shown, "n/a")]
    else:
        plain, streams = kill["plain"], kill["streams"]
        rows.append(Row(m_failed, f"{plain['failed']} of {plain['requests']} ({_codes(plain['failed_by'])}); "
                                  f"{kill['unit']} killed at {_s(kill['killed_at_s'])}, ready again after "
                                  f"{_s(kill.get('back_ready_after_s'))}", G.REPLICA_KILL_FAILED.shown,
                        G.REPLICA_KILL_FAILED.judge(plain["failed"] if plain["requests"] else None), plain["failed"]))
        at = streams.get("in_flight_at") or {}
        value = (f"{streams['cut']} of {streams['requests']} streams; in flight at the kill {at.get('requests', 0)}: "
                 f"{at.get('done', 0)} done, {at.get('error_event', 0)} ended by an error event, {at.get('cut', 0)} cut; "
                 f"refused {streams['refused']}")
        if not at.get("requests"):
            rows.append(Row(m_cut, value + " (no stream was in flight at the kill: not checked)",
                            G.REPLICA_KILL_CUT.shown, "n/a"))
        else:
            rows.append(Row(m_cut, value, G.REPLICA_KILL_CUT.shown, G.REPLICA_KILL_CUT.judge(streams["cut"]),
                            streams["cut"]))
    roll = parts.get("rollout")
    if why("rollout"):
        rows.append(Row(m_roll, why("rollout"), G.REPLICA_ROLLOUT_FAILED.shown, "n/a"))
    else:
        total = roll["plain"]["requests"] + roll["streams"]["requests"]
        by = {**roll["plain"]["failed_by"], **roll["streams"]["not_done_by"]}
        value = (f"{roll['failed']} of {total} ({_codes(by)}); the deploy took {_s(roll.get('deploy_s'))}, "
                 f"engines replaced: {'yes' if roll.get('replaced') else 'no'}")
        if roll.get("deploy_error") or not roll.get("replaced"):
            rows.append(Row(m_roll, value + "; " + (roll.get("deploy_error") or "no engine was replaced: no rollout"),
                            G.REPLICA_ROLLOUT_FAILED.shown, "n/a"))
        else:
            rows.append(Row(m_roll, value, G.REPLICA_ROLLOUT_FAILED.shown,
                            G.REPLICA_ROLLOUT_FAILED.judge(roll["failed"] if total else None), roll["failed"]))
    scale = parts.get("scale")
    up = (scale or {}).get("up_s")
    if up is None:
        rows.append(Row(m_up, why("scale") or (scale or {}).get("error") or "not seen", "", "n/a"))
    else:
        rows.append(Row(m_up, f"{_s(up)} after the load began ({scale['clients']} clients; past scale_up_load seen "
                              f"at {_s(scale.get('over_load_at_s'))}; scale_up_after "
                              f"{scale['replicas'].get('scale_up_after')})", "", "info", up))
    down = (scale or {}).get("down_s")
    if down is None:
        rows.append(Row(m_down, (scale or {}).get("error") or why("scale") or "not seen", "", "n/a"))
    else:
        rows.append(Row(m_down, f"{_s(down)} after the load ended (scale_down_after "
                                f"{scale['replicas'].get('scale_down_after')})", "", "info", down))
    return rows


def answer_ceiling(scenario: dict[str, Any], own_start: float | None) -> float | None:
    """Where the engine's own start is longer than a batch takes to serve, the share of the
    one-model answers a restart swap can reach at most: batch / (batch + own start). None where
    a batch is the longer (0.5x is then the goal) or either is unknown."""
    batch = scenario.get("batch_s")
    if batch is None or batch <= 0 or own_start is None or own_start <= batch:  # (swaps that overlap: arrival)
        return None
    return batch / (batch + own_start)


def groups(results: dict[str, Any], *, every: bool = False) -> dict[str, list[Row]]:
    """The rows by the generated table of docs/benchmarks.md they make (``--docs``), in the order
    the summary prints them; with ``every``, issue 46's too from a run without replicas.py's JSON
    (not measured)."""
    pvn = results.get("proxy_vs_nginx")
    return {
        "proxy": [*proxy_rows(pvn), wake_row(results.get("wake_vs_manual")), *rss_rows(results.get("daemon_scale"))],
        "door": [scale_row(results.get("daemon_scale")), streams_row(results.get("streams_scale")),
                 *hostile_rows(results.get("hostile_heads")), engine_client_row(results.get("proxy_hop"))],
        "contention": contention_rows(results.get("contention")),
        "kv_park": kv_park_rows(results.get("kv_park")),
        "outside_client": outside_client_rows(results.get("outside_client")),
        "hop": [*hop_rows(results.get("proxy_hop")), *litellm_rows(pvn)],
        # Issue 46's, only from a run that has replicas.py's JSON (scripts/bench writes one, an error
        # at least, whatever becomes of it); a run from before it has no such rows.
        **({"replicas": replicas_rows(results.get("replicas"))} if every or "replicas" in results else {}),
    }


def evaluate(results: dict[str, Any]) -> list[Row]:
    """Every row of issue 14's table (then one hop's and LiteLLM's), from the benchmarks' JSON results by name."""
    return [row for rows in groups(results).values() for row in rows]


# ---------------------------------------------------------------- docs/benchmarks.md's generated tables

# The text between these markers in docs/benchmarks.md is bench_summary.py's (``--docs``): a table
# of the goals (``goals``, or ``goals-N`` for issue N's), or one group of a run's rows (``groups``).
MARKER = re.compile(r"<!-- bench_summary: begin (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- bench_summary: end (?P=name) -->",
                    re.DOTALL)


def _cell(text: str) -> str:
    return one_line(str(text), 400).replace("|", "\\|")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_table(body: str) -> list[list[str]]:
    """The rows of the first Markdown table in ``body`` (its header first, the rule left out),
    cells unescaped: what a generated block says, for the tests."""
    rows = []
    for line in body.splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        if not all(set(c) <= {"-", ":"} and c for c in cells):
            rows.append(cells)
    return rows


def render_goals(issue: int | None = None) -> str:
    """The goals of bench_goals.py (of one issue), as a Markdown table."""
    return markdown_table(("measure", "goal", "issue"), [(g.measure, g.shown, str(g.issue)) for g in G.GOALS.values()
                                                         if issue is None or g.issue == issue])


def render_markdown(rows: Sequence[Row], source: str) -> str:
    """One group of a run's rows as a Markdown table, the run's folder named above it (a group
    without a row: that the run measured none of it)."""
    if not rows:
        return f"The run in `{source}` measured none of this (`benchmarks/bench_summary.py RUN --docs`)."
    return (f"From the run in `{source}` (`benchmarks/bench_summary.py RUN --docs docs/benchmarks.md`):\n\n"
            + markdown_table(("measure", "CapyCTL", "goal", "result"), [(r.measure, r.value, r.goal, r.status)
                                                                         for r in rows])
            + f"\n\n{tally(rows)}")


def update_docs(text: str, results: dict[str, Any] | None, source: str) -> tuple[str, dict[str, str]]:
    """``text`` with every generated block written anew: the goals' from bench_goals.py, a group's from
    ``results`` (None: the goals only). A group the run did not measure is written too, its rows
    not measured with the reason: a block never keeps an older run's verdicts beside this run's
    (issue 57). Returns the new text and, by block, what became of it."""
    tables = groups(results, every=True) if results is not None else {}
    done: dict[str, str] = {}

    def block(m: re.Match) -> str:
        name = m.group("name")
        if name == "goals" or name.startswith("goals-"):
            body = render_goals(int(name[6:]) if name != "goals" else None)
            done[name] = "generated"
        elif results is None:
            done[name] = "kept: no run given"
            return m.group(0)
        elif name not in tables:
            done[name] = "kept: no such group of rows"
            return m.group(0)
        else:
            body = render_markdown(tables[name], source)
            measured = [r for r in tables[name] if r.status != "n/a"]
            done[name] = "generated" if measured else "generated, not measured: " + (
                one_line(tables[name][0].value, 200) if tables[name] else "no rows in this run")
        return f"<!-- bench_summary: begin {name} -->\n{body}\n<!-- bench_summary: end {name} -->"

    return MARKER.sub(block, text), done


def one_line(text: str, limit: int = 110) -> str:
    """A table cell: the first line of ``text``, cut to ``limit`` characters (summary.json keeps it whole)."""
    first = (text.strip().splitlines() or [""])[0]
    return first if len(first) <= limit else first[:limit - 3] + "..."


def render_table(rows: Sequence[Row]) -> str:
    rows = [Row(r.measure, one_line(r.value), r.goal, r.status, r.ratio) for r in rows]
    widths = [max(len(getattr(r, f)) for r in rows) if rows else 0 for f in ("measure", "value", "goal")]
    w0, w1, w2 = (max(w, len(h)) for w, h in zip(widths, ("measure", "CapyCTL", "goal")))
    lines = [f"{'measure':{w0}}  {'CapyCTL':{w1}}  {'goal':{w2}}  result", "-" * (w0 + w1 + w2 + 14)]
    lines += [f"{r.measure:{w0}}  {r.value:{w1}}  {r.goal:{w2}}  {r.status}" for r in rows]
    lines.append(tally(rows))
    return "\n".join(lines)


def tally(rows: Sequence[Row]) -> str:
    """Every verdict of ``rows``, counted: PASS and MISS, a goal's own words (KEEP and DELETE) where a
    row gives one, any other verdict by its word, then n/a as not measured. Only "info" rows, which judge nothing, are left out:
    the counts add up to the rows that carry a goal."""
    counts: dict[str, int] = {"PASS": 0, "MISS": 0}
    said = {r.status for r in rows}
    for goal in G.GOALS.values():  # a goal's own words, both of them where a row says either (0 KEEP, 1 DELETE)
        if said & set(goal.verdicts):
            counts.update({word: 0 for word in goal.verdicts if word not in counts})
    for row in rows:
        if row.status not in ("info", "n/a"):
            counts[row.status] = counts.get(row.status, 0) + 1
    counts["not measured"] = sum(1 for r in rows if r.status == "n/a")
    return ", ".join(f"{n} {word}" for word, n in counts.items())


def render_scale(scale: dict[str, Any] | None) -> str:
    """Throughput and p99 per deployment behind one daemon, from daemon_scale.py's JSON."""
    if not scale or not scale.get("deployments"):
        return "8 deployments behind one proxy: " + one_line((scale or {}).get("error") or "not measured", 200)
    lines = [f"{len(scale['deployments'])} deployments behind one daemon (instant engines), {scale['requests']:,} "
             f"requests at {scale['concurrency']} concurrent: {scale['total_rps']:.0f} requests/s in all",
             f"{'deployment':16}{'requests':>10}{'req/s':>10}{'median':>12}{'p99':>12}"]
    for name, d in sorted(scale["deployments"].items()):
        lines.append(f"{name:16}{d['n']:>10}{d['throughput_rps']:>10.0f}{_ms(d['median_s']):>12}{_ms(d['p99_s']):>12}")
    return "\n".join(lines)


def latency_series(results: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """The latency samples to chart, by panel and path: seconds."""
    panels: dict[str, dict[str, list[float]]] = {}
    pvn = results.get("proxy_vs_nginx")
    if pvn:
        panels["1-token chat through llama-server"] = {k: v for k, v in pvn["latency_s"].items() if v}
    hop = results.get("proxy_hop")
    if hop and hop.get("samples"):
        panels["one hop, engine answering at once"] = {k: v for k, v in hop["samples"].items() if v}
    return panels


# ---------------------------------------------------------------- I/O

def write_latency_chart(panels: dict[str, dict[str, list[float]]], path: Path) -> Path | None:
    """Empirical CDFs of latency, one panel per measurement; None without matplotlib or data."""
    if not panels:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return None
    colors = {"direct": "tab:gray", "nginx": "tab:green", "capyctl": "tab:blue", "litellm": "tab:red",
              AIOHTTP_CLIENT: "tab:purple", "floor": "tab:olive", AIOHTTP_SERVER: "tab:brown"}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels.items()):
        for name, values in series.items():
            xs = sorted(v * 1000 for v in values)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=f"{name} (median {statistics.median(xs):.2f} ms)",
                    color=colors.get(name))
        ax.set(xscale="log", xlabel="latency (ms, log)", ylabel="fraction of requests", title=title)
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.axhline(0.95, color="black", linewidth=0.5, linestyle=":")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    names = sorted({n for series in panels.values() for n in series} - {"direct", "nginx", "capyctl"})
    fig.suptitle("Latency distributions: direct vs nginx vs CapyCTL" + "".join(f" vs {n}" for n in names))
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def load_results(folder: Path) -> dict[str, Any]:
    results = {}
    for path in sorted(folder.glob("*.json")):
        if path.name != "summary.json":
            try:
                results[path.stem] = json.loads(path.read_text())
            except ValueError as exc:
                results[path.stem] = {"error": f"unreadable JSON: {exc}"}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the run's output folder")
    parser.add_argument("--docs", type=Path, help="write the generated tables of this Markdown file (docs/benchmarks.md) "
                        "from the run, and nothing into the run's folder")
    args = parser.parse_args(argv)
    results = load_results(args.folder)
    if args.docs:
        text, done = update_docs(args.docs.read_text(), results, args.folder.resolve().name)
        args.docs.write_text(text)
        for name, what in done.items():
            print(f"{args.docs}: {name}: {what}")
        return 0
    rows = evaluate(results)
    print(render_table(rows))
    print()
    print(render_scale(results.get("daemon_scale")))
    chart = write_latency_chart(latency_series(results), args.folder / "latency.png")
    summary = {"rows": [asdict(r) for r in rows], "results": sorted(results), "chart": chart.name if chart else None,
               "scale": (results.get("daemon_scale") or {}).get("deployments")}
    (args.folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwrote {args.folder / 'summary.json'}" + (f" and {chart}" if chart else " (no chart: matplotlib missing)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
