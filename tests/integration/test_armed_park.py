"""A park by stopping arms the next launch: its unit is started at once, sandboxed and held at its
gate (capyctl/systemd/_gate.py GATE_SCRIPT), and the wake only opens the gate. What must hold:
the engine is really gone while parked; a gate that is gone, a stop, or a daemon restart never
leaves a wake stuck or an engine running; CAPYCTL_ARM_PARKED=0 parks as before. Real systemd,
real llama-server, the official openai client."""

from __future__ import annotations

import time

import openai
import pytest

from tests.integration.capyhost import CapyHost, llama_server_path

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

UNIT = "capyctl-smollm2.service"


def deploy(host: CapyHost, model: str) -> openai.OpenAI:
    manifest = host.write_manifest("smollm2", f"name: smollm2\nengine: llama\nmodel: {{path: {model}}}\n")
    host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    return openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.create_key(), max_retries=0, timeout=120)


def ask(client: openai.OpenAI) -> str:
    answer = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=4, temperature=0)
    return answer.choices[0].message.content or ""


def status(host: CapyHost) -> dict:
    return host.cli_json("status", "deployment", "smollm2")


def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.1)


def test_an_armed_unit_holds_no_engine_and_a_lost_gate_starts_afresh(capyhost, smollm2):
    client = deploy(capyhost, smollm2)
    assert ask(client)
    capyhost.cli("park", "deployment", "smollm2")
    assert capyhost.armed_at_gate(UNIT), capyhost.unit_processes(UNIT)
    # The gate shell is all the unit holds: no model weights (llama-server held some 200 MB).
    assert int(capyhost.unit_property(UNIT, "MemoryCurrent")) < 16 << 20
    assert status(capyhost)["armed"] is True

    # Someone kills the waiting unit: the deployment stays parked, no longer armed, and the
    # next request starts the unit afresh instead of waiting on a gate that is gone.
    capyhost.sh("systemctl", "kill", "--signal=KILL", UNIT)
    wait_for(lambda: status(capyhost)["armed"] is False, "the deployment notices its armed unit is gone")
    assert status(capyhost)["state"] == "parked"
    assert ask(client)
    assert status(capyhost)["state"] == "ready"
    assert "starting afresh" not in capyhost.daemon_journal(400)  # nothing was armed: a plain start
    assert "unit start" in capyhost.daemon_journal(400).rsplit("woken from its park", 1)[-1]

    # Stopping a parked, armed deployment stops its unit too.
    capyhost.cli("park", "deployment", "smollm2")
    assert capyhost.armed_at_gate(UNIT)
    capyhost.cli("stop", "deployment", "smollm2")
    assert status(capyhost)["state"] == "stopped"
    assert capyhost.unit_property(UNIT, "ActiveState") in ("inactive", "")
    assert ask(client)


# What systemctl shows of the unit (its Description), by what `capyctl list` shows of the deployment.
SAYS = {"ready": ": serving", "parked": ": parked; its next launch is held at its gate until a wake"}


def test_systemctl_and_capyctl_list_agree_across_park_wake_and_park_again(capyhost, smollm2):
    # An armed unit runs (its gate shell), so `systemctl is-active` answers "active" for it, as it
    # does for any unit with a process: is-active reports the unit's ActiveState alone. The
    # description is what says parked or serving, in `systemctl status` and `list-units` alike.
    client = deploy(capyhost, smollm2)

    def agree(state: str) -> None:
        listed = {d["name"]: d["state"] for d in capyhost.cli_json("list", "deployments")}
        assert listed == {"smollm2": state}
        description = capyhost.unit_property(UNIT, "Description")
        assert description == f"CapyCTL deployment smollm2 (rev 1, llama.cpp){SAYS[state]}", description
        shown = capyhost.sh("systemctl", "status", "--no-pager", "--lines=0", UNIT, check=False).stdout
        assert f"{UNIT} - {description}" in shown, shown
        units = capyhost.sh("systemctl", "list-units", "--no-legend", "--plain", "--all", "capyctl-*.service").stdout
        assert [line.split(None, 4)[4] for line in units.splitlines() if line.startswith(UNIT)] == [description]

    agree("ready")
    capyhost.cli("park", "deployment", "smollm2")
    assert capyhost.armed_at_gate(UNIT)
    agree("parked")
    assert ask(client)
    agree("ready")
    capyhost.cli("park", "deployment", "smollm2")
    agree("parked")
    capyhost.cli("wake", "deployment", "smollm2")
    agree("ready")


def test_a_restarted_daemon_stops_an_armed_unit_and_wakes_by_starting(capyhost, smollm2):
    client = deploy(capyhost, smollm2)
    capyhost.cli("park", "deployment", "smollm2")
    assert capyhost.armed_at_gate(UNIT)
    # What the unit was planned with was known only to the daemon that armed it.
    capyhost.kill_daemon()
    capyhost.start_daemon()
    assert status(capyhost)["state"] == "parked" and status(capyhost)["armed"] is False
    assert capyhost.unit_property(UNIT, "ActiveState") in ("inactive", "")
    assert ask(client)
    assert status(capyhost)["state"] == "ready"


def test_arming_can_be_turned_off(smollm2):
    from tests.integration.capyhost import running_host
    with running_host(env={"CAPYCTL_ARM_PARKED": "0"}) as host:
        host.cli("engine", "add", llama_server_path(), "--name", "llama")
        client = deploy(host, smollm2)
        host.cli("park", "deployment", "smollm2")
        assert host.unit_property(UNIT, "ActiveState") in ("inactive", "")
        assert status(host)["armed"] is False
        assert ask(client)
        assert "open gate" not in host.daemon_journal(400)
