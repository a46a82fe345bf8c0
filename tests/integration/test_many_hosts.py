"""Three machines behind one daemon: the many-host rig (tests/netns/many.py) end to end.

Three sandboxed hosts, each its own systemd and a real sshd, on one bridge with the server; the
daemon runs as a service of the server's systemd and reaches every host through one SSH
connection. Each host gets one deployment of an engine that answers at once (a python3 script,
the rig's instant engine), and each answers a request through the daemon's proxy, which listens
in the server's network namespace.
"""

from __future__ import annotations

import time
from typing import Iterator

import openai
import pytest

from tests.components import missing
from tests.netns.many import PROXY_PORT, ManyHostRig, RigDaemon, missing_requirements, rig_with_daemon, \
    write_instant_engine

pytestmark = [pytest.mark.sandbox]

HOSTS = 3


@pytest.fixture(scope="module")
def three_hosts() -> Iterator[tuple[ManyHostRig, RigDaemon]]:
    reason = missing_requirements()
    if reason:
        missing(reason)
    with rig_with_daemon(HOSTS, log_level="DEBUG") as (rig, daemon):
        try:
            yield rig, daemon
        finally:
            print(daemon.daemon_journal(300))


def unit_state(rig: ManyHostRig, label: str, unit: str) -> str:
    sandbox = rig.server if label == "server" else rig.host(label)
    return sandbox.exec("systemctl", "show", "-P", "ActiveState", unit, check=False).stdout.strip()


def test_one_deployment_on_each_of_three_hosts_answers_through_the_server(three_hosts) -> None:
    rig, daemon = three_hosts
    labels = [h.label for h in rig.hosts]

    hosts = {h["name"]: h for h in daemon.cli_json("list", "hosts")}
    assert set(hosts) == {"local", *labels}
    assert all(hosts[label]["state"] == "online" for label in labels), hosts
    # One SSH connection per host carries the bus, the forwards and the commands.
    assert rig.ssh_connections() == {h.address: 1 for h in rig.hosts}

    write_instant_engine(daemon)
    model = daemon.root / "instant.model"  # the instant engine never reads it
    model.write_text("no weights\n")
    model.chmod(0o644)
    for label in labels:
        manifest = daemon.write_manifest(
            f"instant-{label}", f"name: instant-{label}\nengine: instant\nmodel: {{path: {model}}}\n"
                                f"resources: {{ram: 64MiB}}\nhosts: [{label}]\n")
        daemon.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")

    listed = {d["name"]: d for d in daemon.cli_json("list", "deployments")}
    for label in labels:
        unit = f"capyctl-instant-{label}.service"
        assert listed[f"instant-{label}"]["state"] == "ready"
        assert listed[f"instant-{label}"]["hosts"] == [label]
        # The unit runs in its host's systemd, nowhere else.
        assert unit_state(rig, label, unit) == "active"
        assert all(unit_state(rig, other, unit) in ("inactive", "") for other in ["server", *labels]
                   if other != label)

    key = daemon.cli("key", "create", "--name", "many").stdout.strip()
    # The proxy listens on the server's loopback: the client's sockets are made in its namespace.
    with daemon.entered():
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PROXY_PORT}/v1", api_key=key, max_retries=0,
                               timeout=60)
        for label in labels:
            answer = client.chat.completions.create(model=f"instant-{label}", max_tokens=1,
                                                    messages=[{"role": "user", "content": "Hi"}])
            assert answer.choices[0].message.content == "Hi"

    # A restart: every host is connected and its unit adopted by the time the daemon serves again,
    # not later by the host poller one host after another (issue 36's restart measure).
    invocations = {label: rig.host(label).exec("systemctl", "show", "-P", "InvocationID",
                                                f"capyctl-instant-{label}.service").stdout.strip()
                   for label in labels}
    restarted = time.time()
    daemon.restart()
    assert all(h["state"] == "online" for h in daemon.cli_json("list", "hosts"))
    listed = {d["name"]: d for d in daemon.cli_json("list", "deployments")}
    assert all(listed[f"instant-{label}"]["state"] == "ready" for label in labels), listed
    assert invocations == {label: rig.host(label).exec("systemctl", "show", "-P", "InvocationID",
                                                        f"capyctl-instant-{label}.service").stdout.strip()
                           for label in labels}  # adopted, not started again
    assert "is reachable again" not in daemon.daemon_journal(400)
    # The old daemon's stop, with the SSH masters it ends, logged no error.
    stopping = daemon.daemon_journal(400, f"--since=@{int(restarted)}")
    assert "ERROR" not in stopping, stopping
    # Adopting waited for no inventory: each host's is the one the last daemon read, read again in
    # the background only after its unit was adopted.
    for _ in range(100):
        lines = daemon.daemon_journal(400, f"--since=@{int(restarted)}").splitlines()
        if all(any(f"host {label}: inventory read again" in line for line in lines) for label in labels):
            break
        time.sleep(0.1)
    for label in labels:
        def at(text: str) -> int:
            return next((i for i, line in enumerate(lines) if text in line), -1)
        assert 0 <= at(f"deployment instant-{label}: ") < at(f"host {label}: inventory read again"), lines
    assert all(h["inventory_read_at"] > restarted for h in daemon.cli_json("list", "hosts")
               if h["name"] != "local")

    for label in labels:
        daemon.cli("delete", "deployment", f"instant-{label}")
        assert unit_state(rig, label, f"capyctl-instant-{label}.service") in ("inactive", "")
    assert rig.ssh_connections() == {h.address: 1 for h in rig.hosts}
