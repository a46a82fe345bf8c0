"""In-place parking through the controller, against the fake vLLM and SGLang servers (vLLM and
SGLang need a GPU) launched as real systemd units: the controller drains in-flight requests
before it parks, and wakes the engine in place on the next request.

vLLM parks in place only on a GPU (its sleep mode exists on CUDA, ROCm and XPU alone): its
deployment asks for one, and the daemon sees a fake NVML card (tests/fakes/fake_nvml.py through a
`pynvml` shim on its PYTHONPATH), so the unit gets CUDA_VISIBLE_DEVICES=0, which the fake vLLM
reads as a GPU platform. It serves on a unix socket in the unit's 0700 runtime directory."""

from __future__ import annotations

import json
import threading
import urllib.request

import openai
import pytest

from tests.fakes import make_fake_sglang_venv, make_fake_vllm_venv

from .capyhost import REPO, CapyHost, running_host

pytestmark = [pytest.mark.sandbox]

# A `pynvml` the daemon imports instead of nvidia-ml-py: one 80 GiB card.
FAKE_PYNVML = f"""import sys
sys.path.insert(0, {str(REPO)!r})
from tests.fakes.fake_nvml import FakeDevice, FakeNvml
sys.modules[__name__] = FakeNvml([FakeDevice(name="NVIDIA H100 80GB HBM3", uuid="GPU-fake-0", minor=0,
                                             total=80 << 30)])
"""


@pytest.fixture
def host(request):
    gpu = request.node.callspec.params.get("kind") == "vllm"  # a GPU host (a fake card) for vLLM
    with running_host(fake_nvml=FAKE_PYNVML if gpu else None) as h:
        yield h


def fake_stats(host: CapyHost, status: dict) -> dict:
    if status.get("socket"):  # only root inside the sandbox can open it
        out = host.sh("curl", "-sS", "--max-time", "10", "--unix-socket", status["socket"], "http://engine/fake/stats")
        return json.loads(out.stdout)
    with urllib.request.urlopen(f"http://127.0.0.1:{status['port']}/fake/stats", timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_park_drains_first_then_wakes_in_place(host, kind):
    make = make_fake_vllm_venv if kind == "vllm" else make_fake_sglang_venv
    venv = make(host.root / f"{kind}-venv")
    host.cli("engine", "add", str(venv), "--name", f"fake-{kind}")
    model_dir = host.root / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    gpus = "resources: {gpus: 1}\n" if kind == "vllm" else ""
    manifest = host.write_manifest("m", f"name: fake\nengine: fake-{kind}\nmodel: {{path: {model_dir}}}\n{gpus}"
                                        "engine_args: [--token-delay, '0.15']\n")
    host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    started = host.cli_json("status", "deployment", "fake")
    if kind == "vllm":
        assert started["socket"] == "/run/capyctl-engine/fake/engine.sock"
        exec_start = host.unit_property("capyctl-fake.service", "ExecStart")
        assert "--enable-sleep-mode" in exec_start and "--uds /run/capyctl-engine/fake/engine.sock" in exec_start
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.create_key(), max_retries=0, timeout=60)

    prompt = "one two three four five six seven eight nine ten eleven twelve"
    messages = [{"role": "user", "content": prompt}]
    # The fake answers deterministically: what an undisturbed request gets is the reference.
    reference = client.chat.completions.create(model="fake", max_tokens=32, messages=messages)
    expected = reference.choices[0].message.content
    chunks: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        for chunk in client.chat.completions.create(model="fake", stream=True, max_tokens=32, messages=messages):
            if chunk.choices and chunk.choices[0].delta.content:
                chunks.append(chunk.choices[0].delta.content)
                first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(30)
    parked = host.cli_json("park", "deployment", "fake")  # returns once parked
    reader.join(30)
    assert len(expected.split()) >= 12  # long enough (0.15 s a token) to be in flight during the park
    assert "".join(chunks) == expected, "the request in flight finished before the engine parked"
    assert parked["state"] == "parked" and parked["parked_in_place"]
    pid = host.unit_property("capyctl-fake.service", "MainPID")
    stats = fake_stats(host, started)
    assert stats["aborted"] == 0 and stats.get("release_refused", 0) == 0, stats
    if kind == "vllm":
        assert stats["sleeping"], stats
    assert host.unit_property("capyctl-fake.service", "ActiveState") == "active"  # parked in place
    # systemctl says what `capyctl list` says: the running unit's engine is parked, not serving.
    assert host.unit_property("capyctl-fake.service", "Description").endswith(
        ": parked in place; the engine sleeps until a wake")

    answer = client.chat.completions.create(model="fake", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    status = host.cli_json("status", "deployment", "fake")
    assert status["state"] == "ready" and status["port"] == started["port"]
    assert host.unit_property("capyctl-fake.service", "MainPID") == pid  # the same process, woken in place
    assert host.unit_property("capyctl-fake.service", "Description").endswith(": serving")
    if kind == "vllm":
        stats = fake_stats(host, status)
        assert (stats["sleep_calls"], stats["wake_calls"], stats["last_sleep_mode"]) == (1, 1, "wait"), stats
