"""units/: the files a package installs, checked with systemd's own tools."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sandbox.sandbox import Sandbox
from tests.components import require_root

UNITS = Path(__file__).resolve().parents[2] / "units"
STUB = Path(__file__).resolve().parents[2] / "tests" / "sandbox" / "socket_activation_stub.py"


def test_sysusers_and_tmpfiles_create_user_and_directories(tmp_path: Path) -> None:
    require_root("(systemd-tmpfiles sets owners)")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    # --root keeps both tools out of the host's /etc, /var and /run.
    subprocess.run(["systemd-sysusers", f"--root={root}", str(UNITS / "sysusers.d" / "capyctl.conf")],
                   check=True, capture_output=True, text=True)
    group = next(line for line in (root / "etc" / "group").read_text().splitlines()
                 if line.startswith("capyctl:"))
    gid = int(group.split(":")[2])
    assert any(line.startswith("capyctl:") for line in (root / "etc" / "passwd").read_text().splitlines())

    subprocess.run(["systemd-tmpfiles", "--create", f"--root={root}",
                    str(UNITS / "tmpfiles.d" / "capyctl.conf")], check=True, capture_output=True, text=True)
    state = (root / "var/lib/capyctl").stat()
    assert stat.S_IMODE(state.st_mode) == 0o750 and state.st_gid == gid
    assert stat.S_IMODE((root / "var/lib/capyctl/secrets").stat().st_mode) == 0o700
    runtime = (root / "run/capyctl").stat()
    assert stat.S_IMODE(runtime.st_mode) == 0o750 and runtime.st_gid == gid


def install_units(sb: Sandbox) -> None:
    """Put units/ into the sandbox's /run/systemd/system with test drop-ins.

    The drop-ins change only what cannot be real here: the daemon binary (a stub that
    does the socket and notify protocol; no ExecReload=, which runs the binary too), and
    the capyctl group and state directory, because the sandbox shares the host's
    /etc/group and /var and the test must not add a group or a directory to the host.
    """
    target = sb.root / "run/systemd/system"
    for unit in ("capyctl.service", "capyctl.socket", "capyctl-api.socket", "capyctl.slice"):
        shutil.copy(UNITS / unit, target / unit)
    (target / "capyctl.service.d").mkdir()
    (target / "capyctl.service.d" / "test.conf").write_text(
        "[Service]\nExecStart=\n"
        f"ExecStart={sys.executable} {STUB}\n"
        "ExecReload=\n"
        "Group=root\nStateDirectory=\n")
    (target / "capyctl-api.socket.d").mkdir()
    (target / "capyctl-api.socket.d" / "test.conf").write_text("[Socket]\nSocketGroup=root\n")
    sb.run(["systemctl", "daemon-reload"], check=True)


def ask(sb: Sandbox, family: str, address: str) -> str:
    code = ("import socket,sys\n"
            f"s=socket.socket(socket.{family}, socket.SOCK_STREAM)\n"
            "s.settimeout(20)\n"
            f"s.connect({address})\n"
            "print(s.makefile().readline().strip())\n")
    return sb.run([sys.executable, "-c", code], check=True).stdout.strip()


@pytest.mark.sandbox
def test_socket_activation_by_name_and_notify(sandbox_factory, netns: str) -> None:
    # Its own network namespace: 127.0.0.1:8000 there is free whatever the host runs.
    sb = sandbox_factory(netns=netns)
    install_units(sb)
    verify = sb.run(["systemd-analyze", "verify", "capyctl.socket", "capyctl-api.socket", "capyctl.slice"])
    assert verify.returncode == 0, verify.stderr
    sb.run(["systemctl", "start", "capyctl.socket", "capyctl-api.socket"], check=True)
    api = sb.root / "run/capyctl/api.sock"
    assert stat.S_ISSOCK(api.stat().st_mode) and stat.S_IMODE(api.stat().st_mode) == 0o660
    assert sb.systemctl("is-active", "capyctl.service").stdout.strip() == "inactive"

    # The first connection starts the daemon with both sockets, each under its name.
    # (systemd does not promise an order of the fds, only their names.)
    name, all_names = ask(sb, "AF_INET", "('127.0.0.1', 8000)").split()
    assert name == "openai" and sorted(all_names.split(":")) == ["api", "openai"]
    name, all_names = ask(sb, "AF_UNIX", "'/run/capyctl/api.sock'").split()
    assert name == "api" and sorted(all_names.split(":")) == ["api", "openai"]
    # Type=notify: active only because the stub sent READY=1.
    assert sb.systemctl("is-active", "capyctl.service").stdout.strip() == "active"
    shown = sb.systemctl("show", "capyctl.service", "-p", "Type,NotifyAccess").stdout
    assert "Type=notify" in shown

    analyze = sb.run(["systemd-analyze", "security", "--no-pager", "capyctl.service"])
    overall = [line for line in analyze.stdout.splitlines() if "Overall exposure" in line]
    print(f"\n{overall[0] if overall else analyze.stdout[-500:]}")
    assert overall
    exposure = float(overall[0].split(":")[-1].split()[0])
    # Measured 2.1 (docs/security.md, which names what is left and why: root for D-Bus to systemd,
    # the host network, NVML's devices and /proc/driver, DAC for models, engines and their sockets).
    assert exposure <= 2.1, overall


RESOURCE_KEYS = ("MemoryHigh", "MemoryMax", "TasksMax", "LimitNOFILE")


def _unit_settings(unit: Path, keys: tuple[str, ...]) -> dict[str, str]:
    settings = {}
    for line in unit.read_text().splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key in keys:
            settings[key] = value
    return settings


def _bytes(size: str) -> int:
    """A systemd size (1024-based suffixes) in bytes."""
    for power, suffix in enumerate("KMGT", start=1):
        if size.endswith(suffix):
            return int(size[:-1]) * 1024 ** power
    return int(size)


@pytest.mark.sandbox
def test_the_daemons_resource_limits_are_accepted_and_applied(sandbox_factory, netns: str) -> None:
    """MemoryHigh=, MemoryMax=, TasksMax= and LimitNOFILE= of units/capyctl.service: systemd 252
    parses each (a bad value is a warning, not an error, so the verify output and the values it
    shows are both checked), and the running service gets them: its open-files limit, soft and
    hard, and its cgroup's limits (cgroup v1, these machines: no MemoryHigh=; v2: all three)."""
    settings = _unit_settings(UNITS / "capyctl.service", RESOURCE_KEYS)
    assert set(settings) == set(RESOURCE_KEYS), settings
    sb = sandbox_factory(netns=netns)
    install_units(sb)
    verify = sb.run(["systemd-analyze", "verify", "capyctl.service"])
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr

    expected = {"MemoryHigh": _bytes(settings["MemoryHigh"]), "MemoryMax": _bytes(settings["MemoryMax"]),
                "TasksMax": int(settings["TasksMax"]), "LimitNOFILE": int(settings["LimitNOFILE"]),
                "LimitNOFILESoft": int(settings["LimitNOFILE"])}
    shown = sb.systemctl("show", "capyctl.service", "-p", ",".join(expected)).stdout
    assert dict(line.split("=", 1) for line in shown.split()) == {k: str(v) for k, v in expected.items()}

    sb.run(["systemctl", "start", "capyctl.service"], check=True)
    pid = sb.systemctl("show", "-P", "MainPID", "capyctl.service").stdout.strip()
    limits = sb.run(["cat", f"/proc/{pid}/limits"], check=True).stdout
    open_files = next(line for line in limits.splitlines() if line.startswith("Max open files")).split()
    assert open_files[3:5] == [str(expected["LimitNOFILE"])] * 2, open_files

    cgroup = sb.systemctl("show", "-P", "ControlGroup", "capyctl.service").stdout.strip()
    hybrid = (sb.root / "sys/fs/cgroup/unified").is_dir()  # cgroup v1 controllers, v2 mounted beside them
    v2 = f"/sys/fs/cgroup/unified{cgroup}" if hybrid else f"/sys/fs/cgroup{cgroup}"

    def read(path: str) -> str | None:
        out = sb.run(["cat", path])
        return out.stdout.strip() if out.returncode == 0 else None

    if read(f"{v2}/memory.max") is not None:
        applied = {"MemoryHigh": read(f"{v2}/memory.high"), "MemoryMax": read(f"{v2}/memory.max"),
                   "TasksMax": read(f"{v2}/pids.max")}
    else:
        applied = {"MemoryMax": read(f"/sys/fs/cgroup/memory{cgroup}/memory.limit_in_bytes"),
                   "TasksMax": read(f"/sys/fs/cgroup/pids{cgroup}/pids.max")}
    assert applied == {key: str(expected[key]) for key in applied}, applied
