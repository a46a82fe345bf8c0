"""What the benchmarks of the real daemon share: deployments of a registered custom engine in a
sandboxed host (tests/integration/capyhost.py), and the daemon process read from this side of
the sandbox (its RSS, peak RSS, open descriptors and descriptor limit) without a process start
per reading.

Used by daemon_scale.py, streams_scale.py and hostile_heads.py; they raise their own limit on open
files with raise_open_files.
"""

from __future__ import annotations

import glob
import json
import os
import resource
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from tests.integration.capyhost import CapyHost, smollm2_path

DEPLOYMENT = """\
name: {name}
engine: {engine}
model: {{path: {model}}}
resources: {{ram: 256MiB}}
"""


class Report:
    """A benchmark's figures, written as JSON to ``path`` (its ``--json``) when it ends; one that
    cannot measure ends with the reason in that JSON and on stderr, and exit status 1, so that
    scripts/bench notes it and goes on, and the table says why."""

    def __init__(self, name: str, path: Path | None, result: dict[str, Any]) -> None:
        self.name, self.path, self.result = name, path, result

    def finish(self, error: str | None = None) -> None:
        if error:
            self.result["error"] = error
            print(f"{self.name}: {error}", file=sys.stderr)
        if self.path:
            self.path.write_text(json.dumps(self.result))
        if error:
            sys.exit(1)

    def model_or_end(self) -> str:
        """The SmolLM2 package's file as a model path (the stand-in engines never read it), where
        the sandbox can run (root); else the run ends here, saying why."""
        if os.geteuid() != 0:
            self.finish("needs root: CapyCTL runs in a sandbox with systemd as PID 1")
        model = smollm2_path()
        if model is None:
            self.finish("needs the SmolLM2 package (scripts/setup) as a model file")
        return model

    def failed(self, host: CapyHost, exc: Exception) -> NoReturn:
        """End with what broke the run, and the daemon's last journal lines."""
        journal = host.daemon_journal(20) if host.booted else ""
        self.finish(f"{type(exc).__name__}: {str(exc)[:400]}" + (f"\n{journal[-1500:]}" if journal else ""))
        raise AssertionError("unreachable: finish() with an error exits")


def deploy_all(host: CapyHost, registration: str, engine: str, names: list[str], model: str) -> None:
    """Register ``registration`` (an engine manifest named ``engine``) and deploy ``names`` of it,
    each activated and waited for."""
    path = host.write_manifest(f"{engine}-engine", registration)
    host.cli("engine", "add", "--file", str(path))
    for name in names:
        manifest = host.write_manifest(name, DEPLOYMENT.format(name=name, engine=engine, model=model))
        host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")


def deployment_states(host: CapyHost) -> dict[str, str]:
    return {d["name"]: d["state"] for d in host.cli_json("list", "deployments")}


def host_pid(host: CapyHost, unit: str = "capytest-daemon.service") -> int | None:
    """The PID, as this side sees it, of the unit's main process inside the sandbox: the process of
    the unit's cgroup (read from the host, so host PIDs) whose innermost namespaced PID (NSpid) is
    the unit's MainPID. None where it cannot be found (then read it with ``host.sh``)."""
    inner = host.daemon_pid() if unit == "capytest-daemon.service" else int(host.unit_property(unit, "MainPID"))
    for procs in glob.glob(f"/sys/fs/cgroup/*/capysb-{host.name}/**/{unit}/cgroup.procs", recursive=True):
        for line in Path(procs).read_text().split():
            try:
                status = Path(f"/proc/{line}/status").read_text()
            except OSError:
                continue
            nspid = next((row.split()[1:] for row in status.splitlines() if row.startswith("NSpid:")), [])
            if nspid and int(nspid[-1]) == inner:
                return int(line)
    return None


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes (/proc/PID/status)."""
    fields = {row.split(":")[0]: row.split()[1] for row in Path(f"/proc/{pid}/status").read_text().splitlines()
              if row.startswith(("VmRSS", "VmHWM"))}
    return {"rss": int(fields["VmRSS"]) * 1024, "hwm": int(fields["VmHWM"]) * 1024}


def open_files_limit(pid: int) -> int | None:
    """The soft limit on open files of a process (/proc/PID/limits), None if unreadable."""
    try:
        for row in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if row.startswith("Max open files"):
                return int(row.split()[3])
    except (OSError, ValueError, IndexError):
        return None
    return None


def raise_open_files() -> int:
    """This process's soft limit on open files raised to its hard one (a load of a thousand
    connections and more needs more than the usual soft 1,024); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass
class Watch:
    """Samples a process's RSS and open descriptors every ``every`` seconds in a thread, from
    start() to stop(): the peak of each, and how many samples were taken."""

    pid: int
    every: float = 0.1
    count_fds: bool = True
    rss_peak: int = 0
    fds_peak: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "Watch":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.rss_peak = max(self.rss_peak, proc_status(self.pid)["rss"])
                if self.count_fds:
                    self.fds_peak = max(self.fds_peak, sum(1 for _ in Path(f"/proc/{self.pid}/fd").iterdir()))
                self.samples += 1
            except (OSError, KeyError):
                pass  # (the process is gone: the peaks so far stand)
            self._stop.wait(self.every)

    def stop(self) -> "Watch":
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return self
