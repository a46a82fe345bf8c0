"""Python handle on one systemd sandbox booted by ``capy-sandbox``.

    with Sandbox("demo") as sb:
        sb.run(["systemctl", "is-system-running"])
        client = await SystemdClient.connect(sb.bus_address)

The sandbox's systemd is PID 1 of private pid/mount/cgroup namespaces; the host
filesystem stays visible inside except /run and /tmp, which are its own.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any, Sequence

SCRIPT = Path(__file__).resolve().parent / "capy-sandbox"


class SandboxError(RuntimeError):
    pass


def can_boot() -> bool:
    """Booting needs root (unshare of pid/mount/cgroup namespaces, cgroup dirs).

    Anything else missing (say a cgroup v2-only host) is a failure with the script's
    own message, not a skip.
    """
    return os.geteuid() == 0


class Sandbox:
    def __init__(self, name: str | None = None, *, netns: str | None = None, ssh: bool = False,
                 boot_timeout: float = 60.0) -> None:
        # A unique default name lets two test runs (or two engineers) boot side by side.
        self.name = name or f"capy-{uuid.uuid4().hex[:8]}"
        self.netns = netns
        self.ssh = ssh
        self.boot_timeout = boot_timeout
        self._pid: int | None = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> "Sandbox":
        argv = [str(SCRIPT), "start", self.name, "--timeout", str(int(self.boot_timeout))]
        if self.netns:
            argv += ["--netns", self.netns]
        if self.ssh:
            argv.append("--ssh")
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise SandboxError(f"sandbox {self.name} did not boot: {done.stderr.strip()}")
        self._pid = int(done.stdout.strip().splitlines()[-1])
        return self

    def stop(self) -> None:
        if self._pid is None:
            return
        done = subprocess.run([str(SCRIPT), "stop", self.name], capture_output=True, text=True)
        self._pid = None
        if done.returncode != 0:
            raise SandboxError(f"sandbox {self.name} did not stop cleanly: {done.stderr.strip()}")

    def __enter__(self) -> "Sandbox":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- facts -----------------------------------------------------------------

    @property
    def pid(self) -> int:
        """Host PID of the sandbox's systemd (its PID 1)."""
        if self._pid is None:
            raise SandboxError(f"sandbox {self.name} is not running")
        return self._pid

    @property
    def root(self) -> Path:
        """The sandbox's filesystem as seen from the host (its /run and /tmp included)."""
        return Path(f"/proc/{self.pid}/root")

    @property
    def bus_address(self) -> str:
        """D-Bus address of the sandbox's system bus, usable from a host process."""
        return f"unix:path=/proc/{self.pid}/root/run/dbus/system_bus_socket"

    # -- commands inside ---------------------------------------------------------

    def command(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """argv wrapped in nsenter, so it runs against the sandbox's systemd and D-Bus."""
        wd = cwd or os.getcwd()
        if wd == "/tmp" or wd.startswith(("/tmp/", "/run/")) or wd == "/run":
            wd = "/"  # the host's /tmp and /run are not visible inside
        return ["nsenter", "-t", str(self.pid), "-m", "-p", "-C", "-n", f"--wd={wd}", "--", *argv]

    def run(self, argv: Sequence[str], *, check: bool = False, cwd: str | None = None,
            **kw: Any) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        return subprocess.run(self.command(argv, cwd), check=check, **kw)

    def popen(self, argv: Sequence[str], *, cwd: str | None = None, **kw: Any) -> subprocess.Popen:
        """Start argv inside. The Popen's pid is nsenter's; nsenter forks to enter the pid
        namespace, so argv itself is its child: see ``command_pid``."""
        return subprocess.Popen(self.command(argv, cwd), **kw)

    @staticmethod
    def command_pid(proc: subprocess.Popen, timeout: float = 10.0) -> int:
        """Host PID of the command a ``popen`` started (nsenter's only child)."""
        import time
        deadline = time.monotonic() + timeout
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        while time.monotonic() < deadline:
            try:
                pids = children.read_text().split()
            except FileNotFoundError:
                raise SandboxError("nsenter exited before its child could be found") from None
            if pids and Path(f"/proc/{pids[0]}/exe").resolve().name != "nsenter":
                return int(pids[0])
            time.sleep(0.02)
        raise SandboxError("no child of nsenter appeared")

    def systemctl(self, *args: str) -> subprocess.CompletedProcess:
        return self.run(["systemctl", "--no-pager", *args])
