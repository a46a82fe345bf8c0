"""Least privilege for engine units (issue 18), against a real llama-server in a real systemd:

- the engine runs as a user of its own (DynamicUser=), not root;
- its key is a systemd credential, encrypted at rest with systemd-creds (LoadCredentialEncrypted=):
  in no clear file, environment file, unit property, command line or process environment;
- the threat model: a process with the engine's uid inside the engine's own namespaces (what a
  compromised engine is) cannot read the state database, another engine's key or credential, nor
  connect to the management API socket, and the engine still serves;
- ``systemd-analyze security`` of the engine unit is at most 1.5.
"""

from __future__ import annotations

import contextlib
import json
import os

import openai
import pytest

from .capyhost import CapyHost

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

MAX_ENGINE_EXPOSURE = 1.5


def _deploy(host: CapyHost, name: str, model: str) -> None:
    manifest = host.write_manifest(name, f"name: {name}\nengine: llama\nmodel: {{path: {model}}}\n")
    host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")


def _ids(host: CapyHost, pid: str) -> tuple[int, int]:
    status = host.sh("cat", f"/proc/{pid}/status").stdout
    uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
    gid = int(next(line for line in status.splitlines() if line.startswith("Gid:")).split()[1])
    return uid, gid


def _as_engine(host: CapyHost, pid: str, *argv: str):
    """Run argv as the engine's uid/gid inside all of the engine's namespaces (mount, network, pid,
    ipc, uts, user, cgroup): what code the engine was made to run could do, at most."""
    uid, gid = _ids(host, pid)
    return host.sh("nsenter", "--all", "-t", pid, f"--setuid={uid}", f"--setgid={gid}", *argv, check=False)


def test_an_engine_runs_unprivileged_and_reaches_nothing_of_capyctl(capyhost, smollm2):
    _deploy(capyhost, "smol", smollm2)
    _deploy(capyhost, "other", smollm2)
    unit = "capyctl-smol.service"
    pid = capyhost.unit_property(unit, "MainPID")
    uid, _ = _ids(capyhost, pid)
    assert uid != 0 and capyhost.unit_property(unit, "DynamicUser") == "yes"
    assert capyhost.sh("ps", "-o", "user=", "-p", pid).stdout.strip() == "capyctl-smol"

    # The key: a credential, and nowhere else.
    key, other_key = capyhost.engine_key("smol"), capyhost.engine_key("other")
    shown = capyhost.sh("systemctl", "show", unit).stdout
    assert key not in shown and "EnvironmentFiles=" not in shown.replace("EnvironmentFiles=\n", "")
    unit_file = capyhost.sh("systemctl", "cat", unit).stdout  # the transient unit as systemd wrote it
    # systemd 252 has systemd-creds: the key is encrypted at rest (the host's key), never in the clear.
    sealed = capyhost.state_dir / "secrets" / "smol.cred"
    assert f"LoadCredentialEncrypted=engine-key:{sealed}" in unit_file, unit_file
    assert not (capyhost.state_dir / "secrets" / "smol.key").exists()
    assert key.encode() not in sealed.read_bytes() and oct(sealed.stat().st_mode & 0o777) == "0o600"
    assert key not in unit_file and "EnvironmentFile" not in unit_file
    for what in ("cmdline", "environ"):
        assert key not in capyhost.sh("cat", f"/proc/{pid}/{what}").stdout, what
    assert f"--api-key-file /run/credentials/{unit}/engine-key" in capyhost.unit_property(unit, "ExecStart")
    # ... which the engine itself reads: its own credential is there for it.
    own = _as_engine(capyhost, pid, "cat", f"/run/credentials/{unit}/engine-key")
    assert own.returncode == 0 and own.stdout.strip() == key, own

    # The threat model: from inside the engine, as the engine, nothing of CapyCTL's.
    for path in (capyhost.state_dir / "state.db", capyhost.state_dir / "secrets" / "other.cred",
                 capyhost.state_dir / "secrets" / "smol.cred", "/run/credentials/capyctl-other.service/engine-key",
                 "/var/lib/systemd/credential.secret"):
        attempt = _as_engine(capyhost, pid, "cat", str(path))
        assert attempt.returncode != 0 and other_key not in attempt.stdout, (path, attempt)
    listing = _as_engine(capyhost, pid, "ls", "-A", str(capyhost.state_dir))
    assert listing.stdout.strip() == "", listing  # an empty read-only tmpfs over the state directory
    api = _as_engine(capyhost, pid, "curl", "-sS", "--max-time", "5", "--unix-socket", str(capyhost.api_socket),
                     "http://capyctl/v1/deployments")
    assert api.returncode != 0, api
    # Nor does root's home show (homes are an empty tmpfs), nor another engine's socket directory.
    assert _as_engine(capyhost, pid, "ls", "-A", "/root").stdout.strip() == ""
    assert _as_engine(capyhost, pid, "ls", "/run/capyctl-engine/other").returncode != 0

    # ... and the engine still serves, through the proxy.
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=capyhost.create_key(), max_retries=0,
                           timeout=120)
    answer = client.chat.completions.create(model="smol", max_tokens=4,
                                            messages=[{"role": "user", "content": "Say hi."}])
    assert answer.choices[0].message.content

    assert capyhost.exposure(unit) <= MAX_ENGINE_EXPOSURE

    # Deleting the deployment removes its key file; the other's stays.
    capyhost.cli("delete", "deployment", "smol")
    assert not sealed.exists()
    assert (capyhost.state_dir / "secrets" / "other.cred").exists()


# A `pynvml` for the daemon: one card whose compute processes are those listed in a JSON file
# the test writes (pid, bytes), re-read at every query as NVML reports live processes.
FAKE_PYNVML = """import json, os, sys
sys.path.insert(0, {repo!r})
from tests.fakes.fake_nvml import FakeDevice, FakeNvml
_nvml = FakeNvml([FakeDevice(name="NVIDIA L4", uuid="GPU-fake-0", minor=0, total=24 << 30)])
_query = _nvml.nvmlDeviceGetComputeRunningProcesses
def _live(handle):
    if os.path.exists({listing!r}):
        with open({listing!r}) as f:
            handle.compute[:] = [tuple(p) for p in json.load(f)]
    return _query(handle)
_nvml.nvmlDeviceGetComputeRunningProcesses = _live
sys.modules[__name__] = _nvml
"""


def test_the_sandboxed_daemon_still_attributes_gpu_processes_to_deployments(smollm2):
    """The daemon runs in the packaged unit's sandbox (ProtectProc=invisible, no CAP_SYS_PTRACE) and
    still names each GPU process by its deployment, which is how parked-in-place memory and the
    memory measurements are checked."""
    from .capyhost import REPO, llama_server_path, running_host
    listing = "/var/lib/capyctl-tests/gpu-processes.json"
    with running_host(fake_nvml=FAKE_PYNVML.format(repo=str(REPO), listing=listing)) as host:
        try:
            assert host.unit_property("capytest-daemon.service", "ProtectProc") == "invisible"
            host.cli("engine", "add", llama_server_path(), "--name", "llama")
            _deploy(host, "smol", smollm2)
            pid = host.unit_property("capyctl-smol.service", "MainPID")
            with open(listing, "w") as f:
                json.dump([[int(pid), 1 << 30], [1, 1 << 20]], f)
            card = host.cli_json("host", "check", "local")["host_info"]["gpus"][0]
            by_pid = {p["pid"]: p for p in card["processes"]}
            assert by_pid[int(pid)]["deployment"] == "smol", card
            assert by_pid[int(pid)]["unit"] == "capyctl-smol.service"
            assert by_pid[1]["deployment"] is None  # PID 1 is in no deployment's unit
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(listing)
