"""benchmarks/replicas.py (issue 46): its pure helpers (the conversations, client round robin, the
figures of a load and of scaling, what a daemon without replicas is told), and bench_summary.py's
rows from its JSON, judged against bench_goals.py's goals."""

from __future__ import annotations

import pytest

from tests.benchmarks import load_benchmark

bs = load_benchmark("bench_summary")
rep = load_benchmark("replicas")
G = bs.G


# ---------------------------------------------------------------- the benchmark's helpers

def test_each_client_alternates_its_conversations_turns_between_the_two_deployments():
    for c in range(4):
        picks = [rep.round_robin(c, t) for t in range(1, 7)]
        assert all(a != b for a, b in zip(picks, picks[1:]))
        assert set(picks) == {"rr-a", "rr-b"}
    assert rep.round_robin(0, 1) != rep.round_robin(1, 1)  # first turns spread too


def test_the_conversations_share_a_long_system_prompt_and_no_user_turn():
    system = rep.system_prompt("n1")
    assert system.startswith("Session n1.") and len(system) > 3500  # over 1,000 tokens (some 3.3 characters each)
    turns = {rep.user_turn(c, t) for c in range(16) for t in range(1, 7)}
    assert len(turns) == 96
    assert min(len(t) for t in turns) > 256  # more than one prefix block of the proxy's


def test_turns_summary_counts_first_tokens_follow_ups_cache_and_failures():
    turns = [[c, t, "chat", 0.1 * t, 1000 + t, 1100, None] for c in range(2) for t in range(1, 4)]
    turns.append([2, 1, "chat", None, None, None, "503 no_ready_replica"])
    s = rep.turns_summary(turns)
    assert (s["turns"], s["answered"], s["failed"]) == (7, 6, 1)
    assert s["failed_by"] == {"503 no_ready_replica": 1}
    assert s["ttft_s"]["median"] == pytest.approx(0.2) and s["ttft_s"]["n"] == 6
    assert s["follow_up_ttft_s"]["median"] == pytest.approx(0.25)
    assert s["cache_n"]["median"] == 1002
    assert rep.turns_summary([[0, 1, "chat", 0.1, None, 0, None]])["cache_n"] is None


def test_affinity_is_judged_by_the_ratio_of_the_medians():
    a = {"ttft_s": {"median": 0.3, "p90": 0.9}}
    b = {"ttft_s": {"median": 0.75, "p90": 1.5}}
    assert rep.affinity_figures(a, b) == {"median_ratio": pytest.approx(0.4), "p90_ratio": pytest.approx(0.6)}
    assert rep.affinity_figures(a, {"ttft_s": {"median": None, "p90": None}})["median_ratio"] is None


def test_load_summary_counts_outcomes_and_the_streams_in_flight_at_the_kill():
    records = [["plain", 0.0, 1.0, "ok", ""], ["plain", 4.0, 6.0, "failed", "502 engine_unreachable"],
               ["stream", 4.0, 7.0, "error_event", "engine_lost"], ["stream", 4.5, 5.5, "done", ""],
               ["stream", 1.0, 2.0, "done", ""], ["stream", 5.0, 9.0, "cut", "ended without finish_reason"],
               ["stream", 6.0, 6.1, "refused", "503"]]
    s = rep.load_summary(records, at=5.2)
    assert s["plain"] == {"requests": 2, "answered": 1, "failed": 1, "failed_by": {"502 engine_unreachable": 1}}
    st = s["streams"]
    assert (st["requests"], st["done"], st["error_event"], st["cut"], st["refused"]) == (5, 2, 1, 1, 1)
    assert st["in_flight_at"] == {"requests": 3, "done": 1, "error_event": 1, "cut": 1, "refused": 0}
    assert s["failed"] == 4  # the plain one and every stream not done
    assert "in_flight_at" not in rep.load_summary(records)["streams"]


def test_a_daemon_without_replicas_is_told_what_it_lacks():
    old = [{"name": "chat", "state": "ready", "in_flight": 0, "waiting": 0}]
    with pytest.raises(rep.FeatureMissing, match="no 'replica' field"):
        rep.require_replicas(old, "chat", 2)
    with pytest.raises(rep.FeatureMissing, match="lists no 'chat'"):
        rep.require_replicas([], "chat", 1)
    one = [{"name": "chat", "state": "ready", "replica": {"deployment": "chat", "index": 1, "of": 1}}]
    with pytest.raises(rep.FeatureMissing, match="asked for 2 replicas, GET /v1/deployments lists 1"):
        rep.require_replicas(one, "chat", 2)
    two = one + [{"name": "chat@2", "state": "parked", "replica": {"deployment": "chat", "index": 2, "of": 2}},
                 {"name": "other", "state": "ready", "replica": {"deployment": "other", "index": 1, "of": 1}}]
    assert sorted(rep.require_replicas(two, "chat", 2)) == [1, 2]
    assert rep.replica_entries(old + [{"name": "chat@2"}], "chat").keys() == {1, 2}


def test_scaling_times_run_from_the_loads_start_to_ready_and_from_its_end_to_parked():
    samples = [(0.0, {1: "ready"}), (2.5, {1: "ready", 2: "starting"}), (3.0, {1: "ready", 2: "ready"}),
               (12.0, {1: "ready", 2: "ready"}), (19.0, {1: "ready", 2: "parking"}), (19.5, {1: "ready", 2: "parked"})]
    assert rep.scale_times(samples, 0.0, 8.0) == {"up_s": 3.0, "down_s": 11.5}
    assert rep.scale_times(samples[:2], 0.0, 8.0) == {"up_s": None, "down_s": None}
    assert rep.scale_times(samples[:4], 0.0, 8.0) == {"up_s": 3.0, "down_s": None}
    # A park that evicted it from the plan leaves it stopped: parked all the same.
    stopped = samples[:5] + [(20.0, {1: "ready", 2: "stopped"})]
    assert rep.scale_times(stopped, 0.0, 8.0) == {"up_s": 3.0, "down_s": 12.0}


def test_a_killed_replica_is_back_at_its_first_ready_after_it_was_seen_down():
    samples = [(5.0, {2: "ready"}), (5.3, {2: "ready"}), (5.6, {2: "failed"}), (7.0, {2: "starting"}),
               (8.2, {2: "ready"})]
    assert rep.back_ready(samples, 2, 5.1) == 8.2
    assert rep.back_ready(samples[:2], 2, 5.1) is None


def test_the_manifests_are_valid_deployments_with_their_replicas():
    from capyctl.spec import parse_manifest
    spec = parse_manifest(rep.manifest("scaled", "/m.gguf", rep.SCALE, 1))
    assert (spec.replicas.min, spec.replicas.max, spec.replicas.scale_up_after, spec.replicas.scale_down_after) == \
        (1, 2, 2.0, 10.0)
    assert spec.resources.cpus == 1
    spec = parse_manifest(rep.manifest("rolled", "/m.gguf", 2, None, {"BENCH_REVISION": "2"}))
    assert (spec.replicas.min, spec.replicas.max, spec.env) == (2, 2, {"BENCH_REVISION": "2"})
    assert parse_manifest(rep.manifest("rr-a", "/m.gguf", None, 1)).replicas.max == 1
    # Each engine's context holds the affinity part's conversations at once (the default 4,096 does not).
    assert spec.engine_args == ["-c", str(rep.CONTEXT)] and rep.CONTEXT >= 8192
    assert parse_manifest(rep.manifest("rr-a", "/m.gguf", None, 1, context=None)).engine_args == []
    assert rep.cpus_per_engine(2) == 1 and rep.cpus_per_engine(16) == 8 and rep.cpus_per_engine(1) is None
    assert rep.replica_unit("chat", 1) == "capyctl-chat.service"
    assert rep.replica_unit("chat", 2) == "capyctl-chat@2.service"


# ---------------------------------------------------------------- bench_summary.py's rows

def _side(median: float, p90: float, cache: int, failed: int = 0) -> dict:
    return {"turns": 96, "answered": 96 - failed, "failed": failed, "failed_by": {},
            "ttft_s": {"n": 96, "median": median, "p90": p90}, "follow_up_ttft_s": {"n": 80, "median": median},
            "cache_n": {"n": 96, "median": cache, "p90": cache}, "prompt_tokens": None}


def _replicas(ratio: float = 0.4, kill_failed: int = 0, cut: int = 0, roll_failed: int = 0, **parts) -> dict:
    def load(failed: int, cut: int, at: int = 3) -> dict:
        return {"plain": {"requests": 40, "answered": 40 - failed, "failed": failed,
                          "failed_by": {"502 engine_unreachable": failed} if failed else {}},
                "streams": {"requests": 20, "done": 18 - cut, "error_event": 2, "cut": cut, "refused": 0,
                            "not_done_by": {"error_event: engine_lost": 2},
                            "in_flight_at": {"requests": at, "done": 1, "error_event": 2, "cut": 0, "refused": 0}},
                "failed": failed + 2 + cut}
    rr = _side(1.0, 2.0, 1050)
    result = {"parts": {
        "affinity": {"conversations": 16, "turns": 6, "concurrency": 4, "affinity": _side(ratio, 0.9, 1300),
                     "round_robin": rr, "median_ratio": ratio, "p90_ratio": 0.45},
        "kill": {"unit": "capyctl-killed@2.service", "killed_at_s": 6.7, "back_ready_after_s": 2.1,
                 **load(kill_failed, cut)},
        "rollout": {"deploy_s": 9.0, "replaced": True, "deploy_error": None, **load(0, 0)},
        "scale": {"clients": 8, "replicas": rep.SCALE, "up_s": 4.2, "over_load_at_s": 0.5, "down_s": 11.0}}}
    result["parts"]["rollout"]["failed"] = roll_failed
    result["parts"].update(parts)
    return result


def _rows(result: dict) -> dict:
    return {r.measure: r for r in bs.replicas_rows(result)}


def test_replicas_rows_pass_within_their_goals():
    rows = _rows(_replicas())
    judged = [r for r in rows.values() if r.status not in ("info", "n/a")]
    assert [r.measure for r in judged] == [
        "replicas: prefix affinity vs client round robin, median first token",
        "replicas: one killed under load: non-streamed requests failed",
        "replicas: one killed under load: streams cut without an error event",
        "replicas: a new revision rolled out under load: requests failed"]
    assert {r.status for r in judged} == {"PASS"}
    aff = rows["replicas: prefix affinity vs client round robin, median first token"]
    assert aff.ratio == pytest.approx(0.4) and aff.goal == G.REPLICA_AFFINITY_TTFT.shown == "<= 0.50x round robin"
    assert "400.00 ms vs 1000.00 ms" in aff.value and "cache_n median 1300 vs 1050" in aff.value
    up = rows["replicas: load past scale_up_load -> second replica ready"]
    assert up.status == "info" and up.ratio == pytest.approx(4.2) and "scale_up_after 2s" in up.value
    assert rows["replicas: load ended -> second replica parked"].ratio == pytest.approx(11.0)


def test_replicas_rows_miss_at_their_bounds():
    assert _rows(_replicas(ratio=0.5))[
        "replicas: prefix affinity vs client round robin, median first token"].status == "PASS"  # the bound passes
    rows = _rows(_replicas(ratio=0.51, kill_failed=1, cut=1, roll_failed=2))
    assert {r.status for m, r in rows.items() if r.status not in ("info", "n/a")} == {"MISS"}
    failed = rows["replicas: one killed under load: non-streamed requests failed"]
    assert "1 of 40 (1 502 engine_unreachable)" in failed.value


def test_replicas_rows_not_measured_say_why():
    missing = "the daemon has no replicas (issue 46): GET /v1/deployments' entry 'chat' has no 'replica' field"
    rows = bs.replicas_rows({"error": missing, "parts": {"affinity": {"error": missing}}})
    assert {r.status for r in rows} == {"n/a"} and {r.value for r in rows} == {missing}
    assert {r.value for r in bs.replicas_rows(None)} == {"replicas.py wrote no result"}
    # A kill with no stream in flight checks nothing; a rollout that replaced no engine is none.
    result = _replicas()
    result["parts"]["kill"]["streams"]["in_flight_at"]["requests"] = 0
    result["parts"]["rollout"]["replaced"] = False
    rows = _rows(result)
    assert rows["replicas: one killed under load: streams cut without an error event"].status == "n/a"
    assert rows["replicas: a new revision rolled out under load: requests failed"].status == "n/a"
    rows = _rows(_replicas(scale={"clients": 8, "replicas": rep.SCALE, "up_s": None, "down_s": None,
                                  "error": "scaled@2 was not ready within 45 s"}))
    up = rows["replicas: load past scale_up_load -> second replica ready"]
    assert up.status == "n/a" and up.value == "scaled@2 was not ready within 45 s"


def test_the_summary_shows_replicas_only_from_a_run_that_has_its_json():
    assert "replicas" not in bs.groups({})
    assert [r.status for r in bs.groups({"replicas": _replicas()})["replicas"]].count("PASS") == 4
    assert all(g.issue == 46 for g in (G.REPLICA_AFFINITY_TTFT, G.REPLICA_KILL_FAILED, G.REPLICA_KILL_CUT,
                                       G.REPLICA_ROLLOUT_FAILED))
    assert {"replica_affinity_ttft", "replica_kill_failed", "replica_kill_cut",
            "replica_rollout_failed"} <= set(G.GOALS)


def test_the_printout_renders_every_part():
    result = _replicas()
    result["cpus"] = 2
    result["parts"]["kill"]["records"] = []
    text = rep.render(result)
    assert "0.40x round robin" in text and "replica 2 killed at 6.7 s" in text and "parked 11.0 s" in text
    assert "error: boom" in rep.render({"parts": {"rollout": {"error": "boom"}}})
