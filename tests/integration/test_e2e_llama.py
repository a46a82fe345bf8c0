"""The main job, for real: systemd as PID 1, the daemon as capyctl.service, llama-server as a
transient unit, the SmolLM2 model, and the official openai client."""

from __future__ import annotations


import openai
import pytest

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

UNIT = "capyctl-smollm2.service"


def manifest(model_path: str, extra: str = "") -> str:
    # Three fields are enough.
    return f"name: smollm2\nengine: llama\nmodel:\n  path: {model_path}\n{extra}"


def chat(client: openai.OpenAI, text: str, *, stream: bool = False):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": text}],
                                          max_tokens=16, temperature=0, stream=stream)


def test_deploy_answer_park_wake(capyhost, smollm2):
    path = capyhost.write_manifest("smollm2", manifest(smollm2))
    out = capyhost.cli("deploy", "model", "--file", str(path), "--activate", "--wait")
    assert "ready in" in out.stderr  # progress was shown
    assert capyhost.unit_property(UNIT, "ActiveState") == "active"
    assert capyhost.unit_property(UNIT, "Slice") == "capyctl.slice"
    key = capyhost.create_key("--name", "test")
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=key, max_retries=0, timeout=120)

    answer = chat(client, "Say hello.")
    assert answer.choices[0].message.content.strip()
    assert answer.usage.completion_tokens > 0

    chunks = [c.choices[0].delta.content or "" for c in chat(client, "Count to five.", stream=True) if c.choices]
    assert len(chunks) > 2 and "".join(chunks).strip()

    listed = {d["name"]: d for d in capyhost.cli_json("list", "deployments")}
    assert listed["smollm2"]["state"] == "ready" and listed["smollm2"]["revision"] == 1

    # Park: llama.cpp parks by stopping its engine, which releases its memory; the next launch's
    # unit is started at once, held at its gate (a stopped shell, no engine) until the wake.
    running_key = capyhost.engine_key("smollm2")
    running_invocation = capyhost.unit_property(UNIT, "InvocationID")
    capyhost.cli("park", "deployment", "smollm2")
    assert capyhost.armed_at_gate(UNIT), capyhost.unit_processes(UNIT)
    armed_invocation = capyhost.unit_property(UNIT, "InvocationID")
    assert armed_invocation != running_invocation
    assert capyhost.cli_json("status", "deployment", "smollm2")["armed"] is True
    # The park sealed the next launch's key (a new one), so the wake need not run systemd-creds.
    sealed = capyhost.state_dir / "secrets" / "smollm2.cred"
    next_key, sealed_at = capyhost.engine_key("smollm2"), sealed.stat().st_mtime_ns
    assert next_key != running_key
    assert capyhost.cli_json("status", "deployment", "smollm2")["state"] == "parked"
    assert [m.id for m in client.models.list().data] == ["smollm2"]  # listing does not wake it
    assert capyhost.cli_json("status", "deployment", "smollm2")["state"] == "parked"

    # The next request wakes it and is answered.
    woken = chat(client, "Say hello again.")
    assert woken.choices[0].message.content.strip()
    status = capyhost.cli_json("status", "deployment", "smollm2")
    assert status["state"] == "ready" and status["wakes"] == 2 and status["parks"] == 1
    assert status["armed"] is False
    assert capyhost.unit_property(UNIT, "ActiveState") == "active"
    # The unit armed at the park is the one serving: the wake opened its gate, started nothing.
    assert capyhost.unit_property(UNIT, "InvocationID") == armed_invocation
    assert [argv.split()[0].rsplit("/", 1)[-1] for _, _, argv in capyhost.unit_processes(UNIT)] == ["llama-server"]
    assert "open gate" in capyhost.daemon_journal(400)
    assert sealed.stat().st_mtime_ns == sealed_at and capyhost.engine_key("smollm2") == next_key


def test_bad_key_and_unknown_model(capyhost, smollm2):
    capyhost.cli("deploy", "model", "--file", str(capyhost.write_manifest("smollm2", manifest(smollm2))))
    bad = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key="capy-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        chat(bad, "hi")
    good = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=capyhost.create_key(), max_retries=0)
    with pytest.raises(openai.NotFoundError):
        good.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    # A deployment that was never activated is stopped: no unit until the first request.
    assert capyhost.cli_json("status", "deployment", "smollm2")["state"] == "stopped"


def test_metrics_logs_and_a_new_revision(capyhost, smollm2):
    import urllib.request

    path = capyhost.write_manifest("smollm2", manifest(smollm2))
    capyhost.cli("deploy", "model", "--file", str(path), "--activate", "--wait")
    key = capyhost.create_key()
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=key, max_retries=0, timeout=120)
    assert chat(client, "Say hello.").choices[0].message.content
    capyhost.cli("park", "deployment", "smollm2")
    assert chat(client, "Say hello.").choices[0].message.content

    req = urllib.request.Request(capyhost.base_url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    metrics = urllib.request.urlopen(req, timeout=10).read().decode()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line and not line.startswith("#")}
    assert samples['capyctl_wakes_total{deployment="smollm2"}'] == 2
    assert samples['capyctl_parks_total{deployment="smollm2"}'] == 1
    assert sum(v for k, v in samples.items()
               if k.startswith("capyctl_requests_total") and 'status="200"' in k and "chat" in k) == 2

    # journalctl -u capyctl-smollm2, through the daemon
    logs = capyhost.cli("logs", "deployment", "smollm2", "-n", "200").stdout
    assert "llama_server" in logs or "main: server is listening" in logs or "listening" in logs

    # A changed manifest is a new revision; the running unit is replaced by one of that revision.
    capyhost.cli("deploy", "model", "--file", str(capyhost.write_manifest("smollm2", manifest(smollm2, "queue: 8\n"))))
    status = capyhost.cli_json("status", "deployment", "smollm2")
    assert status["revision"] == 2 and status["state"] == "ready"
    assert capyhost.unit_property(UNIT, "Description") == "CapyCTL deployment smollm2 (rev 2, llama.cpp): serving"
    assert chat(client, "Say hello.").choices[0].message.content
