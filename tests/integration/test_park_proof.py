"""The proof after every wake (capyctl/controller/_parking.py), through the daemon and real systemd
units: the fake vLLM whose weights come back wrong after a wake (--fake-corrupt-on-wake) fails it,
the engine is restarted cleanly, and after three failures its in-place park is turned off; the real
llama-server, parked by stopping and started again, passes it, after the request that woke it; a
restart wake whose proof fails restarts the engine after that request. ``capyctl status`` shows the
record."""

from __future__ import annotations

import time

import openai
import pytest

from tests.components import missing
from tests.fakes import make_fake_vllm_venv

from .capyhost import llama_server_path, running_host, smollm2_path
from .test_park_in_place import FAKE_PYNVML

pytestmark = [pytest.mark.sandbox]


@pytest.fixture
def host():
    with running_host(fake_nvml=FAKE_PYNVML) as h:  # one fake card: the fake vLLM parks in place only on a GPU
        yield h


def _ask(client: openai.OpenAI) -> str:
    answer = client.chat.completions.create(model="fake", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    return answer.choices[0].message.content


def _deploy_fake_vllm(host, manifest_tail: str) -> None:
    """The fake vLLM deployed as "fake", with ``manifest_tail`` (YAML lines) added to its manifest."""
    venv = make_fake_vllm_venv(host.root / "vllm-venv")
    host.cli("engine", "add", str(venv), "--name", "fake-vllm")
    model_dir = host.root / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    manifest = host.write_manifest("m", f"name: fake\nengine: fake-vllm\nmodel: {{path: {model_dir}}}\n"
                                        + manifest_tail)
    host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")


def test_a_wake_that_serves_garbage_fails_its_proof_and_restarts_the_engine(host):
    _deploy_fake_vllm(host, "resources: {gpus: 1}\npark_tier: host_backed\nengine_args: [--fake-corrupt-on-wake]\n")
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.create_key(), max_retries=0, timeout=60)
    assert "garbage" not in _ask(client)
    for attempt in range(1, 4):
        pid = host.unit_property("capyctl-fake.service", "MainPID")
        parked = host.cli_json("park", "deployment", "fake")
        assert parked["parked_in_place"] and parked["park_record"]["tier"] == "host_backed"
        assert "garbage" not in _ask(client)  # served by the engine restarted after the failed proof
        status = host.cli_json("status", "deployment", "fake")
        record = status["park_record"]
        assert record["proof"]["result"] == "failed" and "garbage" in record["proof"]["reason"], record
        assert record["proof_failures"] == attempt and record["wake_seconds"] is not None
        assert host.unit_property("capyctl-fake.service", "MainPID") != pid  # restarted cleanly
    assert status["park_tier"] == "restart" and "3 wakes in a row failed" in record["in_place_disabled"]
    parked = host.cli_json("park", "deployment", "fake")
    assert not parked["parked_in_place"]  # the in-place park is off: parked by stopping
    text = host.cli("status", "deployment", "fake").stdout
    assert "Park: tier restart; in-place park off" in text and "proof failed" in text


def test_the_real_llama_server_passes_its_proof_after_a_wake(host):
    if llama_server_path() is None or smollm2_path() is None:
        missing("llama-server or the SmolLM2 model is missing; run scripts/test")
    host.cli("engine", "add", llama_server_path(), "--name", "llama")
    manifest = host.write_manifest("s", f"name: fake\nengine: llama\nmodel: {{path: {smollm2_path()}}}\n"
                                        "engine_args: [-c, '1024', -t, '2']\n")
    host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.create_key(), max_retries=0, timeout=120)
    host.cli_json("park", "deployment", "fake")
    assert _ask(client)
    # The wake restored the prompt cache llama-server saved at the park (the proof's reference
    # filled a slot): its proof does not hold the request, it runs at the next park, after the
    # save (controller/_proof.py, before_next_park).
    woken = host.cli_json("status", "deployment", "fake")["park_record"]
    assert woken["prompt_cache"]["state"] == "restored", woken
    record = host.cli_json("park", "deployment", "fake")["park_record"]  # answered once parked
    assert record["tier"] == "restart" and record["proof"]["result"] == "passed", record
    assert record["proof"]["at"] > woken["prompt_cache"]["at"], record
    assert "proof" in [p["phase"] for p in record["last_park"]["phases"]], record["last_park"]
    assert 0 < record["wake_seconds"] < 60
    text = host.cli("status", "deployment", "fake").stdout
    assert "last park reached restart" in text and "proof passed" in text


def _proved_record(host, name: str, timeout: float = 60) -> dict:
    """The park record once the last wake's proof has a result (a restart wake proves itself after
    the requests it woke for)."""
    deadline = time.monotonic() + timeout
    while True:
        record = host.cli_json("status", "deployment", name)["park_record"]
        if record.get("proof") and (record.get("woken_at") or 0) >= (record.get("parked_at") or 0):
            return record
        assert time.monotonic() < deadline, f"no proof after the wake within {timeout:.0f}s: {record}"
        time.sleep(0.2)


def test_a_restart_wake_answers_first_and_a_failed_proof_after_it_restarts_the_engine(host):
    """The fake vLLM on no GPU parks by stopping its unit; with --fake-differs-per-launch every launch
    answers differently, so the proof after a restart wake fails. The request that woke it is
    answered by the woken engine, before the proof; the engine is then restarted cleanly (a new
    main process), its generation becomes the reference, and it serves on."""
    _deploy_fake_vllm(host, "engine_args: [--fake-differs-per-launch]\n")
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.create_key(), max_retries=0, timeout=60)
    first = int(_ask(client).split()[0].removeprefix("launch"))  # the count lives in the unit's cache directory
    parked = host.cli_json("park", "deployment", "fake")
    assert not parked["parked_in_place"] and parked["park_record"]["tier"] == "restart"
    assert _ask(client).startswith(f"launch{first + 1} ")  # the woken engine answered, before any proof
    woken_pid = host.unit_property("capyctl-fake.service", "MainPID")
    record = _proved_record(host, "fake")
    assert record["proof"]["result"] == "failed" and f"launch{first + 1} " in record["proof"]["reason"], record
    assert record["proof_failures"] == 1 and record["in_place_disabled"] is None
    deadline = time.monotonic() + 60
    while (host.unit_property("capyctl-fake.service", "MainPID") in (woken_pid, "0")
           or host.cli_json("status", "deployment", "fake")["state"] != "ready"):
        assert time.monotonic() < deadline, "the engine was not restarted after the failed proof"
        time.sleep(0.2)
    assert _ask(client).startswith(f"launch{first + 2} ")  # the restarted engine serves


def test_a_park_right_after_a_restart_wake_waits_for_its_proof(host):
    """The proof after a restart wake counts as a request in flight: a park that comes while it
    generates drains it rather than stopping the engine mid-generation (llama-server, stopped so,
    did not exit until systemd killed it). The fake vLLM takes 1 s a token: the proof 8 s, longer
    than the park command takes to arrive."""
    _deploy_fake_vllm(host, "engine_args: [--token-delay, '1']\n")
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.create_key(), max_retries=0, timeout=60)
    host.cli_json("park", "deployment", "fake")
    assert _ask(client)  # wakes it; the proof starts once this answer is done
    deadline = time.monotonic() + 8
    while host.cli_json("status", "deployment", "fake")["in_flight"] != 1:  # the proof, generating
        assert time.monotonic() < deadline, "the proof after the wake never counted as in flight"
        time.sleep(0.1)
    parked = host.cli_json("park", "deployment", "fake")
    assert parked["state"] == "parked"
    record = parked["park_record"]
    assert record["proof"]["result"] == "passed", record  # finished before the park stopped the engine


def test_an_engine_killed_at_the_end_of_its_stop_starts_again(host):
    """An engine that ignores SIGTERM is killed after timeouts.stop (systemd's SIGKILL); its unit
    ends failed (result "timeout"). The next start of the same unit must not inherit that: neither
    a stop then a request, nor a park (by stopping, then armed) then a request."""
    _deploy_fake_vllm(host, "timeouts: {stop: 2s}\nengine_args: [--fake-ignore-sigterm]\n")
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.create_key(), max_retries=0, timeout=60)
    assert _ask(client)
    began = time.monotonic()
    host.cli("stop", "deployment", "fake")
    assert time.monotonic() - began >= 2  # it took the kill
    assert host.cli_json("status", "deployment", "fake")["state"] == "stopped"
    assert _ask(client)
    assert host.cli_json("status", "deployment", "fake")["state"] == "ready"
    parked = host.cli_json("park", "deployment", "fake")
    assert parked["state"] == "parked" and parked["armed"], parked
    assert _ask(client)
    assert host.cli_json("status", "deployment", "fake")["state"] == "ready"
    # A new revision while it serves: the old unit is stopped (killed again), the new one started.
    manifest = host.root / "m.yaml"
    manifest.write_text(manifest.read_text().replace("--fake-ignore-sigterm]", "--fake-ignore-sigterm, --token-delay, '0']"))
    host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    status = host.cli_json("status", "deployment", "fake")
    assert status["state"] == "ready" and status["revision"] == 2, status
    assert _ask(client)
