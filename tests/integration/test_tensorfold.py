"""TensorFold through the daemon: the fake TensorFold (tests/fakes/fake_tensorfold.py, TensorFold
needs a CUDA GPU) launched as a real systemd unit from the adapter's own command line, chat and
/v1/systemone (answered by TensorFold's /v1/decisions) through the proxy, and parking: by stopping on
a host without a GPU, in place through its level-2 sleep on a host with one (a fake NVML card, since
this machine has none)."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.fakes import make_fake_tensorfold_venv

from .capyhost import REPO, CapyHost, running_host

pytestmark = [pytest.mark.sandbox]

# A `pynvml` the daemon imports instead of nvidia-ml-py: one 80 GiB card.
FAKE_PYNVML = f"""import sys
sys.path.insert(0, {str(REPO)!r})
from tests.fakes.fake_nvml import FakeDevice, FakeNvml
sys.modules[__name__] = FakeNvml([FakeDevice(name="NVIDIA H100 80GB HBM3", uuid="GPU-fake-0", minor=0,
                                             total=80 << 30)])
"""


@pytest.fixture(params=["cpu", "gpu"])
def host(request):
    with running_host(fake_nvml=FAKE_PYNVML if request.param == "gpu" else None) as h:
        h.gpu = request.param == "gpu"
        yield h


def fake_stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/fake/stats", timeout=10) as resp:
        return json.loads(resp.read())


def systemone(host: CapyHost, key: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(host.base_url + "/v1/systemone", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tensorfold_serves_decides_and_parks(host):
    venv = make_fake_tensorfold_venv(host.root / "tf-venv")
    host.cli("engine", "add", str(venv), "--name", "tf")
    model_dir = host.root / "qwen"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "qwen3_5"}')  # a family with a sleep adapter
    resources = "resources: {gpus: 1}\n" if host.gpu else ""
    manifest = host.write_manifest("d", f"name: decider\nengine: tf\nmodel: {{path: {model_dir}}}\n{resources}")
    host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    status = host.cli_json("status", "deployment", "decider")
    port = status["port"]
    key = host.create_key()
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=key, max_retries=0, timeout=60)

    # The launch line TensorFold parses: the model positional, the key in its environment only.
    cmdline = host.sh("systemctl", "show", "-P", "ExecStart", "capyctl-decider.service").stdout
    assert f"serve {model_dir}" in cmdline and "--model" not in cmdline and "--name decider" in cmdline
    assert ("--enable-sleep-mode" in cmdline) == host.gpu

    answer = client.chat.completions.create(model="decider", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content

    code, decided = systemone(host, key, {"model": "decider", "state": "Ticket: my invoice shows a billing error.",
                                          "questions": {"team": {"type": "choice", "instructions": "Which team?",
                                                                 "criteria": {"shipping": None, "billing": None}},
                                                        "urgent": {"type": "score", "instructions": "Urgency?",
                                                                   "criteria": ["low", "high"]}}})
    assert code == 200, decided
    assert decided["answers"]["team"]["choice"] == "billing"  # the fake favours the option its input names
    assert set(decided["answers"]["urgent"]) == {"type", "score", "legend", "probabilities", "confidence"}
    assert fake_stats(port)["decisions"] == 1

    parked = host.cli_json("park", "deployment", "decider")
    assert parked["state"] == "parked"
    if host.gpu:
        # Level-2 sleep in place: the unit keeps running, the fake says it sleeps.
        assert parked["parked_in_place"]
        assert host.unit_property("capyctl-decider.service", "ActiveState") == "active"
        assert fake_stats(port)["state"] == "sleeping"
    else:
        # Parked by stopping its engine; the next launch's unit waits at its gate, no engine in it.
        assert not parked["parked_in_place"] and parked["armed"]
        assert host.armed_at_gate("capyctl-decider.service"), host.unit_processes("capyctl-decider.service")

    answer = client.chat.completions.create(model="decider", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    status = host.cli_json("status", "deployment", "decider")
    assert status["state"] == "ready"
    if host.gpu:
        stats = fake_stats(status["port"])
        assert status["port"] == port and (stats["sleep_calls"], stats["wake_calls"]) == (1, 1)
