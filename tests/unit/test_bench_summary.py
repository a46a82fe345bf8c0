"""benchmarks/bench_summary.py: issue 14's table from the benchmarks' JSON results, each row's
goal judged PASS or MISS, rows not measured said so; the chart and summary.json of a run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_summary", REPO / "benchmarks" / "bench_summary.py")
bs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_summary", bs)  # dataclasses look their module up
_spec.loader.exec_module(bs)

MiB = 1 << 20


def _pvn(capy_ms: float = 10.1, nginx_ms: float = 10.05, direct_ms: float = 10.0, rate: float = 100.0,
         litellm: bool = False) -> dict:
    paths = ["direct", "nginx", "capyctl"] + (["litellm"] if litellm else [])
    base = {"direct": direct_ms, "nginx": nginx_ms, "capyctl": capy_ms, "litellm": 15.0}
    return {
        "latency_s": {p: [base[p] / 1000] * 20 for p in paths},
        "ttfc_s": {p: [base[p] / 1000] * 3 for p in paths},
        "concurrency": {str(n): {p: {"chunks_per_s": [rate if p != "capyctl" else rate * 0.995]} for p in paths}
                        for n in (1, 8, 64)},
        "litellm": {"measured": litellm} if litellm else {"measured": False, "error": "not asked for (--litellm)"},
    }


def _results(**overrides) -> dict:
    results = {"proxy_vs_nginx": _pvn(),
               "wake_vs_manual": {"manual_s": [1.0, 1.1, 0.9], "parked_s": [1.05, 1.05, 1.05]},
               "daemon_scale": {"rss_few_bytes": 50 * MiB, "rss_after_bytes": 51 * MiB, "requests": 100_000,
                                "concurrency": 32, "total_rps": 1000.0,
                                "deployments": {f"d{i}": {"n": 10, "throughput_rps": 125.0, "median_s": 0.01,
                                                          "p99_s": 0.02} for i in range(8)}}}
    results.update(overrides)
    return results


def _by_measure(rows):
    return {r.measure: r for r in rows}


def test_every_row_of_the_issue_is_there_and_passes_within_its_goals():
    rows = _by_measure(bs.evaluate(_results()))
    expected = ["added latency, median, 1-token chat", "latency median, total vs nginx", "latency p95 vs nginx",
                "time to first chunk, median, vs nginx", "stream chunks/s, 1 concurrent, vs direct",
                "stream chunks/s, 8 concurrent, vs direct", "stream chunks/s, 64 concurrent, vs direct",
                "parked -> first token vs llama-server by hand", "daemon idle RSS after a few requests",
                "daemon idle RSS after 100,000 requests (flat?)"]
    assert [m for m in rows if not m.startswith(("LiteLLM", "one hop"))] == expected
    assert {r.status for m, r in rows.items() if m in expected} == {"PASS"}
    assert rows["added latency, median, 1-token chat"].ratio == pytest.approx(0.1e-3)
    assert rows["latency median, total vs nginx"].ratio == pytest.approx(10.1 / 10.05)
    assert rows["stream chunks/s, 64 concurrent, vs direct"].ratio == pytest.approx(0.995)


def test_the_floor_relay_is_named_beside_the_added_latency_when_it_was_measured():
    pvn = _pvn()
    assert "floor" not in bs.proxy_rows(pvn)[0].value
    pvn["latency_s"]["floor"] = [10.02 / 1000] * 20
    row = bs.proxy_rows(pvn)[0]
    assert row.value.endswith("; the floor relay 0.02 ms") and row.ratio == pytest.approx(0.1e-3)


def test_goals_are_judged_at_their_bounds():
    assert bs.judge(1.02, 1.02, at_most=True) == "PASS"
    assert bs.judge(1.0201, 1.02, at_most=True) == "MISS"
    assert bs.judge(0.99, 0.99, at_most=False) == "PASS"
    assert bs.judge(0.9899, 0.99, at_most=False) == "MISS"
    assert bs.judge(None, 1.0, at_most=True) == "n/a"


def test_a_slow_proxy_misses_its_latency_goals():
    rows = _by_measure(bs.evaluate(_results(proxy_vs_nginx=_pvn(capy_ms=11.5))))
    assert rows["added latency, median, 1-token chat"].status == "MISS"  # 1.5 ms > 0.25 ms
    assert rows["latency median, total vs nginx"].status == "MISS"
    assert rows["latency p95 vs nginx"].status == "MISS"
    assert rows["time to first chunk, median, vs nginx"].status == "MISS"


def test_slow_wake_and_growing_rss_miss():
    rows = _by_measure(bs.evaluate(_results(
        wake_vs_manual={"manual_s": [1.0], "parked_s": [1.2]},
        daemon_scale={"rss_few_bytes": 67 * MiB, "rss_after_bytes": 80 * MiB, "requests": 100_000})))
    assert rows["parked -> first token vs llama-server by hand"].status == "MISS"
    assert rows["daemon idle RSS after a few requests"].status == "MISS"
    after = rows["daemon idle RSS after 100,000 requests (flat?)"]
    assert after.status == "MISS" and "+13.0 MiB" in after.value


def test_rss_under_the_cap_that_still_grows_is_not_flat():
    rows = _by_measure(bs.evaluate(_results(
        daemon_scale={"rss_few_bytes": 40 * MiB, "rss_after_bytes": 45 * MiB, "requests": 5000})))
    assert rows["daemon idle RSS after 5,000 requests (flat?)"].status == "MISS"


def test_what_was_not_measured_is_n_a_with_the_reason():
    rows = bs.evaluate({"wake_vs_manual": {"error": "needs root"}})
    by = _by_measure(rows)
    assert by["parked -> first token vs llama-server by hand"].status == "n/a"
    assert by["parked -> first token vs llama-server by hand"].value == "needs root"
    assert all(r.status == "n/a" for r in rows)
    assert "0 PASS, 0 MISS, 10 not measured" in bs.render_table(rows)


def test_litellm_rows_say_where_capyctl_stands_or_why_not():
    rows = _by_measure(bs.evaluate(_results(proxy_vs_nginx=_pvn(litellm=True))))
    row = rows["LiteLLM: latency median, CapyCTL vs LiteLLM"]
    assert row.status == "info" and row.value.startswith(f"{10.1 / 15:.3f}x")
    assert "LiteLLM: stream chunks/s, 64 concurrent, CapyCTL vs LiteLLM" in rows
    missing = _by_measure(bs.evaluate(_results()))["LiteLLM proxy"]
    assert missing.status == "n/a" and "--litellm" in missing.value


def test_the_table_prints_every_row_with_goal_and_verdict():
    text = bs.render_table(bs.evaluate(_results()))
    assert "<= 0.25 ms over direct" in text and ">= 0.99x direct" in text and "<= 1.10x" in text
    assert text.splitlines()[-1] == "10 PASS, 0 MISS, 1 not measured"  # LiteLLM not measured


def test_scale_lists_every_deployment():
    text = bs.render_scale(_results()["daemon_scale"])
    assert "8 deployments behind one daemon" in text and all(f"d{i} " in text for i in range(8))
    assert bs.render_scale({"error": "needs root"}).endswith("needs root")


def test_percentiles():
    values = [float(i) for i in range(1, 101)]
    assert bs.p95(values) == pytest.approx(95.95)
    assert bs.p99(values) == pytest.approx(99.99)
    assert bs.p95([3.0]) == bs.p99([3.0]) == 3.0


def test_main_writes_summary_and_chart(tmp_path, capsys):
    results = _results(proxy_hop={"samples": {"direct": [1e-4, 2e-4], "nginx": [2e-4, 3e-4],
                                              "capyctl": [3e-4, 4e-4]},
                                  "hop_s": {"nginx": 1e-4, "capyctl": 2e-4}, "capyctl_per_request_s": 3e-4})
    for name, data in results.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    assert bs.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["rows"]) == 12 and summary["rows"][0]["status"] == "PASS"
    hop = next(r for r in summary["rows"] if r["measure"].startswith("one hop"))
    assert hop["value"] == "200 us vs nginx's 100 us (2.000x); proxy CPU 300 us/request"
    assert "| " not in capsys.readouterr().out.splitlines()[0]
    panels = bs.latency_series(results)
    assert list(panels) == ["1-token chat through llama-server", "one hop, engine answering at once"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert summary["chart"] is None
    else:
        assert summary["chart"] == "latency.png" and (tmp_path / "latency.png").stat().st_size > 1000


def test_a_long_error_stays_one_line_in_the_table():
    error = "AssertionError: deploy failed:\n" + "journal line\n" * 20
    text = bs.render_table(bs.evaluate({"daemon_scale": {"error": error}}))
    assert "journal line" not in text and "AssertionError: deploy failed:" in text
    assert bs.one_line("x" * 200, 20) == "x" * 17 + "..."


def test_the_benchmarks_shuffle_the_order_of_their_paths():
    # Each path follows each other one about as often: in a fixed order, what LiteLLM left
    # running after its answers always landed on direct, which then read 6-8% slower than nginx.
    sys.path.insert(0, str(REPO / "benchmarks"))
    from proxy_overhead import shuffled
    paths = {"direct": 1, "nginx": 2, "capyctl": 3, "litellm": 4}
    sequence = [name for turn in range(200) for name, _ in shuffled(paths, turn)]
    assert sorted(sequence) == sorted(list(paths) * 200)
    after_litellm = [after for before, after in zip(sequence, sequence[1:]) if before == "litellm"]
    shares = {name: after_litellm.count(name) / len(after_litellm) for name in paths}
    # About a quarter each (itself only across turns), never the same one every time.
    assert all(0.1 < share < 0.45 for name, share in shares.items() if name != "litellm"), shares
    assert shuffled(paths, 7) == shuffled(paths, 7)  # a run can be repeated


def test_the_hop_with_the_front_off_is_its_own_baseline_row():
    rows = bs.hop_rows({"hop_s": {"nginx": 1e-4, "capyctl": 2e-4, "capyctl-aiohttp": 3.5e-4},
                        "capyctl_per_request_s": 2e-4,
                        "cpu_per_request_s": {"capyctl": 2e-4, "capyctl-aiohttp": 3e-4}})
    assert [row.value for row in rows] == ["200 us vs nginx's 100 us (2.000x); proxy CPU 200 us/request",
                                           "350 us; proxy CPU 300 us/request"]
    assert rows[1].measure == "one hop, the proxy's front off (aiohttp's server alone)"
    assert len(bs.hop_rows({"hop_s": {"nginx": 1e-4, "capyctl": 2e-4}})) == 1  # an older run: no such row


def test_added_latency_is_the_median_of_the_differences_turn_by_turn_with_its_interval():
    import random
    rng = random.Random(3)
    # The machine's drift moves every path of a turn alike: direct spreads over 10-20 ms, and the
    # proxy adds 0.10 ms to each turn's figure, give or take 0.02 ms.
    direct = [rng.uniform(0.010, 0.020) for _ in range(300)]
    pvn = _pvn()
    pvn["latency_s"].update(direct=direct, nginx=[d + 0.00005 for d in direct],
                            capyctl=[d + 0.0001 + rng.uniform(-2e-5, 2e-5) for d in direct])
    row = _by_measure(bs.evaluate(_results(proxy_vs_nginx=pvn)))["added latency, median, 1-token chat"]
    assert row.ratio == pytest.approx(0.0001, abs=3e-6) and row.status == "PASS"
    low, high = bs.turn_interval({"c": pvn["latency_s"]["capyctl"], "d": direct},
                                 lambda t: bs.paired_difference(t["c"], t["d"]))
    assert 0.00008 < low <= row.ratio <= high < 0.00012
    assert "paired by turn (95% CI 0.10-0.10 ms)" in row.value and "cannot tell" not in row.value
    assert "0.10 ms over direct (1.00" in row.value  # the ratio to direct's median, as the issue's table gives it


def test_a_goal_inside_the_interval_is_said_to_be_undecided_by_the_run():
    import random
    rng = random.Random(4)
    direct = [rng.uniform(0.010, 0.020) for _ in range(200)]
    pvn = _pvn()
    # Each turn's added latency anywhere from 0 to 0.5 ms: the median is near the 0.25 ms goal.
    pvn["latency_s"].update(direct=direct, nginx=list(direct), capyctl=[d + rng.uniform(0, 0.0005) for d in direct])
    rows = _by_measure(bs.evaluate(_results(proxy_vs_nginx=pvn)))
    assert "goal inside: cannot tell" in rows["added latency, median, 1-token chat"].value
    assert bs.turn_interval({"a": [1.0]}, lambda t: 0.0) is None  # one turn: no interval
