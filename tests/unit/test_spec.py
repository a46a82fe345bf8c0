"""Manifests: the good ones load, each malformed one fails with the field, the line and a sentence."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from capyctl.spec import DeploymentSpec, EngineSpec, ManifestError, parse_manifest, parse_duration, parse_size

GOOD_MINIMAL = """\
name: smollm2
engine: llama.cpp
model:
  path: /opt/models/smollm2.gguf
"""


def test_three_fields_are_enough():
    spec = parse_manifest(GOOD_MINIMAL, "m.yaml")
    assert isinstance(spec, DeploymentSpec)
    assert (spec.name, spec.engine, spec.model.path) == ("smollm2", "llama.cpp", "/opt/models/smollm2.gguf")
    assert spec.park == "auto" and spec.queue == 64 and spec.tensor_parallel == 1


def test_full_manifest():
    spec = parse_manifest(textwrap.dedent("""\
        name: qwen3-4b
        engine: vllm
        model: {hf: Qwen/Qwen3-4B@main}
        aliases: [qwen]
        resources: {gpus: 2, gpu_memory: 20GiB, ram: 32G, cpus: 4}
        tensor_parallel: 2
        hosts: [gpu1]
        engine_args: [--max-model-len, "8192"]
        env: {HF_HUB_ENABLE_HF_TRANSFER: "0"}
        park: auto
        park_level: 2
        idle_park_after: 10m
        timeouts: {start: 15m, wake: 90s}
        """))
    assert spec.model.repo == "Qwen/Qwen3-4B" and spec.model.revision == "main"
    assert spec.resources.gpu_memory == 20 * 1024**3 and spec.resources.ram == 32 * 1024**3
    assert spec.idle_park_after == 600 and spec.timeouts.start == 900 and spec.timeouts.wake == 90
    assert spec.gpus_needed == 2


def test_engine_aliases_normalise():
    assert parse_manifest(GOOD_MINIMAL.replace("llama.cpp", "llama-server")).engine == "llama.cpp"


def test_engine_manifest():
    spec = parse_manifest(textwrap.dedent("""\
        kind: engine
        name: echo
        type: custom
        cmd: [/usr/bin/python3, -m, http.server, "{port}"]
        health: /
        """))
    assert isinstance(spec, EngineSpec) and spec.type == "custom"


@pytest.mark.parametrize("text, expected", [
    # 1. missing required field
    ("name: a\nengine: llama.cpp\n", "<m>:1: model: is required"),
    # 2. unknown field, with its own line
    (GOOD_MINIMAL + "replica: 3\n", "<m>:5: replica: is not a known field"),
    # 2b. replicas: max below min, a fixed 0, and a group's replicas, each on its own line
    (GOOD_MINIMAL + "replicas:\n  min: 3\n  max: 2\n",
     "<m>:5: replicas: replicas.max is 2 but replicas.min is 3: max must be at least min"),
    (GOOD_MINIMAL + "replicas: 0\n", "<m>:5: replicas: replicas is 0: a fixed number of replicas is 1 to 64"),
    ("name: g\nengine: vllm\nmodel: {path: /m}\nnodes: 2\ntensor_parallel: 2\nhosts: [a, b]\nreplicas: 2\n",
     "<m>:7: replicas: replicas.max is 2 but nodes is 2: a multi-node deployment is one engine spanning"),
    # 3. bad name (unit-name safe)
    (GOOD_MINIMAL.replace("smollm2", "Smol LM"), "<m>:1: name: String should match pattern"),
    # 4. relative model path
    (GOOD_MINIMAL.replace("/opt/models/smollm2.gguf", "models/x.gguf"),
     "<m>:4: model.path: the model path must be absolute, got 'models/x.gguf'"),
    # 5. model neither hf nor path
    ("name: a\nengine: vllm\nmodel: {url: http://x}\n",
     "<m>:3: model: must be {hf: org/name[@revision]} or {path: /absolute/path}"),
    # 6. bad hub repo
    ("name: a\nengine: vllm\nmodel:\n  hf: 'not a repo'\n", "<m>:4: model.hf: 'not a repo' is not a Hub repository"),
    # 7. bad size, nested line
    (GOOD_MINIMAL + "resources:\n  gpus: 1\n  gpu_memory: lots\n",
     "<m>:7: resources.gpu_memory: expected a size such as 8GiB"),
    # 8. bad duration
    (GOOD_MINIMAL + "idle_park_after: soon\n", "<m>:5: idle_park_after: expected a duration such as 30s"),
    # 9. enum
    (GOOD_MINIMAL + "park: sometimes\n", "<m>:5: park: Input should be 'auto', 'stop' or 'never'"),
    # 10. tensor parallel larger than gpus
    (GOOD_MINIMAL + "tensor_parallel: 4\nresources: {gpus: 2}\n",
     "tensor_parallel is 4 but resources.gpus is 2"),
    # 11. reserved env name
    (GOOD_MINIMAL + "env:\n  CAPYCTL_X: '1'\n", "<m>:5: env: 'CAPYCTL_X': names starting with CAPYCTL_ are reserved"),
    # 12. YAML syntax error names the line
    ("name: a\nengine: [llama.cpp\nmodel: {path: /x}\n", "<m>:3: YAML syntax error"),
    # 13. duplicate key
    ("name: a\nname: b\nengine: vllm\nmodel: {path: /x}\n", "<m>:2: YAML syntax error: duplicate key 'name' (first at line 1)"),
    # 14. not a mapping
    ("- name: a\n", "<m>:1: must be a mapping of fields, got a list"),
    # 15. empty document
    ("", "<m>: is empty"),
    # 16. wrong type in list
    (GOOD_MINIMAL + "hosts: gpu1\n", "<m>:5: hosts: Input should be a valid list"),
    # 17. negative queue
    (GOOD_MINIMAL + "queue: 0\n", "<m>:5: queue: Input should be greater than or equal to 1"),
    # 18. gpu memory without gpus
    (GOOD_MINIMAL + "resources: {gpu_memory: 8GiB}\n", "resources.gpu_memory is set but resources.gpus is 0"),
    # 19. custom engine without {port}
    ("kind: engine\nname: e\ntype: custom\ncmd: [/bin/srv]\n", "`cmd` must contain {port}"),
    # 20. nested unknown field in timeouts
    (GOOD_MINIMAL + "timeouts:\n  boot: 10s\n", "<m>:6: timeouts.boot: is not a known field"),
])
def test_malformed_manifest_message(text, expected):
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, "<m>")
    assert expected in str(info.value), str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ManifestError) as info:
        parse_manifest("name: Bad Name\nengine: vllm\nmodel: {path: rel}\npark: x\n", "m.yaml")
    assert [p.field for p in info.value.problems] == ["name", "model.path", "park"]
    assert [p.line for p in info.value.problems] == [1, 3, 4]


@pytest.mark.parametrize("value, expected", [("8GiB", 8 << 30), ("512M", 512 << 20), ("2GB", 2_000_000_000),
                                             (1024, 1024), ("1.5G", int(1.5 * (1 << 30)))])
def test_sizes(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value, expected", [("90s", 90), ("10m", 600), ("1h30m", 5400), ("250ms", 0.25), (5, 5)])
def test_durations(value, expected):
    assert parse_duration(value) == expected


def test_validate_command_exit_2_names_file_field_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD_MINIMAL + "park: sometimes\n")
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_MINIMAL)
    run = lambda f: subprocess.run([sys.executable, "-m", "capyctl", "validate", "--file", str(f)],
                                   capture_output=True, text=True)
    out = run(bad)
    assert out.returncode == 2
    assert f"{bad}:5: park:" in out.stderr
    ok = run(good)
    assert ok.returncode == 0, ok.stderr
    assert "smollm2" in ok.stdout
