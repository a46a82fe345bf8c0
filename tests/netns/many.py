"""The many-host rig: up to a few dozen sandboxed hosts on one bridge, and a server beside them.

    server: netns capyms-RUN, bridge br0 10.214.0.254/24, sandbox capyms-RUN (the daemon runs here)
    host k: netns capymh-RUN-k, veth uplink 10.214.0.k/24, its peer port<k> a port of br0,
            sandbox capymh-RUN-k with a real sshd on 10.214.0.k:22

Every host is what tests/netns/rig.py makes of its hosts: its own systemd as PID 1
(tests/sandbox/capy-sandbox start --netns), an OpenSSH server as a transient unit of it, its
config, host key and authorized_keys in the per-run directory /var/tmp/capymany-RUN (the
sandboxes share the machine's filesystem except /run and /tmp), and a real known_hosts made with
ssh-keyscan from the server's namespace, so host keys are checked the normal way.

The network is made one command at a time (cheap); the sandboxes and sshds, the slow part, start
on a thread pool. Nothing is routed to the machine's own network: every link lives in the
namespaces made here, the veth pairs are created inside the server's namespace with their other
end placed straight into the host's. Teardown removes exactly what this run made, by name: its
sandboxes, its network namespaces (deleting a namespace deletes the veth end in it, and so the
pair), its directories; ``down_run(RUN_ID)`` does the same from the names alone, for a rig left
by another process (``scripts/hosts-rig down RUN_ID``). The one change beyond its names: where
fs.inotify.max_user_instances is too low for N+1 more systemd, ``up`` raises it, and it stays
raised (``_ensure_inotify_instances``).

``RigDaemon`` runs the CapyCTL daemon in the server's sandbox, as tests/integration/
test_federation.py does on its host a, and adds the hosts to it; ``write_instant_engine``
registers an engine that answers every request at once (no model), for many deployments cheaply.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from tests.daemon_cli import CAPYCTL, DaemonCli, limit_nofile_property
from tests.netns.rig import (SANDBOX, NetHost, Rig, _run, delete_netns, entered_netns, missing_requirements,
                             start_sshd, stop_sandboxes)

__all__ = ["ManyHostRig", "RigDaemon", "down_run", "missing_requirements", "write_instant_engine"]

SUBNET = "10.214.0"
SERVER_OCTET = 254
BRIDGE = "br0"
UPLINK = "uplink"  # every host's end of its veth pair, inside its own namespace
MAX_HOSTS = 250
DAEMON_UNIT = "capytest-daemon.service"
PROXY_PORT = 18000  # the server's namespace is new: nothing else listens there
_RUN_ID = re.compile(r"[0-9a-z]{1,12}")


# inotify instances one sandbox holds: its systemd's (four) and its dbus-daemon's, with room to spare.
INOTIFY_PER_SANDBOX = 8
INOTIFY_INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")


def _ensure_inotify_instances(extra: int) -> tuple[int, int] | None:
    """Make room for ``extra`` more inotify instances of root; returns (old, new) when it raised the limit.

    fs.inotify.max_user_instances is "an upper limit on the number of inotify instances that can
    be created per real user ID" (inotify(7)), 128 by default, and every sandbox's systemd and
    dbus-daemon run as root: past the limit a sandbox's systemd cannot watch its unit files and
    its boot stalls. The limit is raised, never lowered (other sandboxes of the machine may need
    it by the time this rig goes), and only as far as this rig needs above what is in use now."""
    in_use = 0
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            in_use += sum(1 for fd in fd_dir.iterdir() if os.readlink(fd) == "anon_inode:inotify")
    limit = int(INOTIFY_INSTANCES.read_text())
    needed = in_use + extra + 64  # and room for what else starts meanwhile
    if limit >= needed:
        return None
    INOTIFY_INSTANCES.write_text(f"{needed}\n")
    return limit, needed


def _names(run_id: str) -> tuple[str, str]:
    """(the server's netns and sandbox name, the prefix of the hosts')."""
    return f"capyms-{run_id}", f"capymh-{run_id}-"


def rig_dir(run_id: str) -> Path:
    return Path(f"/var/tmp/capymany-{run_id}")


def daemon_root(run_id: str) -> Path:
    # Not under /tmp or /var/tmp: engine units run with PrivateTmp=yes and would not see it.
    return Path(f"/var/lib/capyctl-tests/capymany-{run_id}")


def _sandbox_cgroup(sandbox: str, cgroup: str = "/") -> Path:
    """A cgroup of a sandbox's systemd as the machine sees it: the sandbox's cgroup namespace is
    rooted at capysb-NAME in the named systemd hierarchy (tests/sandbox/_pid1.sh)."""
    return Path("/sys/fs/cgroup/systemd") / f"capysb-{sandbox}" / cgroup.lstrip("/")


def cgroup_pids(sandbox: str, cgroup: str = "/") -> list[int]:
    """Machine PIDs of every process in a sandbox's cgroup ``cgroup`` and below."""
    pids: list[int] = []
    root = _sandbox_cgroup(sandbox, cgroup)
    for procs in root.rglob("cgroup.procs") if root.is_dir() else ():
        with contextlib.suppress(OSError):
            pids += [int(p) for p in procs.read_text().split()]
    return pids


def proc_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in bytes; (0, 0) when it is gone. PSS shares each shared page among
    the processes mapping it, so a sum of PSS is what the machine pays, where RSS counts libc
    once per process."""
    rss = pss = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    return rss, pss


def proc_comm(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return "?"


class ManyHostRig(Rig):
    """Build with ``ManyHostRig(n).up()``, always ``down()`` (also after a failed ``up``); or
    ``with ManyHostRig(n) as rig:``."""

    def __init__(self, n: int, run_id: str | None = None, workers: int = 8) -> None:
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"a rig has 1 to {MAX_HOSTS} hosts, not {n}")
        self.run_id = run_id or secrets.token_hex(3)
        if not _RUN_ID.fullmatch(self.run_id):
            raise ValueError(f"run id {self.run_id!r}: lower-case letters and digits, at most 12")
        self.n = n
        self.workers = workers
        self.dir = rig_dir(self.run_id)
        self.client_key = self.dir / "client_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        server_name, host_prefix = _names(self.run_id)
        self.server = NetHost(label="server", netns=server_name, veth=BRIDGE, address=f"{SUBNET}.{SERVER_OCTET}",
                              sandbox=server_name, sshd_dir=self.dir / "sshd-server")
        self.hosts = [NetHost(label=f"h{k}", netns=f"{host_prefix}{k}", veth=UPLINK, address=f"{SUBNET}.{k}",
                              sandbox=f"{host_prefix}{k}", sshd_dir=self.dir / f"sshd-h{k}")
                      for k in range(1, n + 1)]
        self._lock = threading.Lock()
        self._netns_made: list[str] = []
        self._sandboxes_made: list[str] = []
        self.up_seconds: float | None = None
        self.inotify_raised: tuple[int, int] | None = None

    def host(self, label: str) -> NetHost:
        return next(h for h in self.hosts if h.label == label)

    # -- build -----------------------------------------------------------------------------------

    def up(self) -> "ManyHostRig":
        started = time.monotonic()
        self.dir.mkdir(mode=0o700, parents=True)
        # The description first: `down_run` finds a half-built rig by its names anyway.
        self._describe()
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"capymany-{self.run_id}",
             "-f", str(self.client_key))
        self._network()
        self.inotify_raised = _ensure_inotify_instances(INOTIFY_PER_SANDBOX * (self.n + 1))
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            jobs = [pool.submit(self._start_sandbox, self.server)]
            jobs += [pool.submit(self._start_host, host) for host in self.hosts]
            for job in concurrent.futures.as_completed(jobs):
                job.result()  # the first failure raises; __exit__/down() removes what was made
        self.write_known_hosts()
        self.up_seconds = time.monotonic() - started
        return self

    def _network(self) -> None:
        # Serial: `ip netns add` makes /run/netns a shared mount the first time it runs, and two
        # doing that at once could stack mounts. Each command is a few milliseconds.
        self._add_netns(self.server.netns)
        # stp_state 0: without spanning tree a port forwards as soon as it is up; forward_delay is
        # "only relevant if STP is enabled" (ip-link(8), BRIDGE Type Support).
        _run("ip", "-n", self.server.netns, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0")
        _run("ip", "-n", self.server.netns, "addr", "add", f"{self.server.address}/24", "dev", BRIDGE)
        _run("ip", "-n", self.server.netns, "link", "set", BRIDGE, "up")
        for k, host in enumerate(self.hosts, start=1):
            self._add_netns(host.netns)
            port = f"port{k}"
            # Made in the server's namespace with the peer placed straight into the host's
            # (ip-link(8): `type veth peer name NAME`, and `netns` moves a device): the pair never
            # appears in the machine's own network namespace.
            _run("ip", "-n", self.server.netns, "link", "add", port, "type", "veth",
                 "peer", "name", UPLINK, "netns", host.netns)
            _run("ip", "-n", self.server.netns, "link", "set", port, "master", BRIDGE)
            _run("ip", "-n", self.server.netns, "link", "set", port, "up")
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", UPLINK)
            _run("ip", "-n", host.netns, "link", "set", UPLINK, "up")

    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._netns_made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _start_sandbox(self, host: NetHost) -> None:
        # Recorded before the start returns: a start that fails half way is stopped by name too.
        with self._lock:
            self._sandboxes_made.append(host.sandbox)
        _run(str(SANDBOX), "start", host.sandbox, "--netns", host.netns, "--timeout", "120", timeout=180)

    def _start_host(self, host: NetHost) -> None:
        self._start_sandbox(host)
        start_sshd(host, self.client_key, f"{host.label}-{self.run_id}", unit="capymany-sshd",
                   description="sshd of the many-host test rig")

    def write_known_hosts(self) -> None:
        """known_hosts with the real keys of every host's sshd, scanned over the bridge from the
        server's namespace (ssh-keyscan(1) contacts the hosts it is given in parallel)."""
        addresses = [h.address for h in self.hosts]
        scan = self.server.in_netns("ssh-keyscan", "-T", "10", "-t", "ed25519", *addresses, timeout=120)
        lines = [ln for ln in scan.stdout.splitlines() if ln and not ln.startswith("#")]
        found = {ln.split()[0] for ln in lines}
        if found != set(addresses):
            raise RuntimeError(f"ssh-keyscan found no key for {sorted(set(addresses) - found)}: {scan.stderr}")
        self.known_hosts.write_text("\n".join(lines) + "\n")

    def _describe(self) -> None:
        (self.dir / "rig.json").write_text(json.dumps({
            "run_id": self.run_id, "client_key": str(self.client_key), "known_hosts": str(self.known_hosts),
            "server": {"netns": self.server.netns, "sandbox": self.server.sandbox, "address": self.server.address},
            "hosts": [{"name": h.label, "netns": h.netns, "sandbox": h.sandbox, "address": h.address}
                      for h in self.hosts]}, indent=1) + "\n")

    # -- what it costs ---------------------------------------------------------------------------

    def host_memory(self, host: NetHost) -> dict:
        """RSS and PSS of every process of a host's sandbox (systemd, journald, dbus, sshd, and
        whatever runs there), in bytes, and by process name."""
        by_comm: dict[str, list[int]] = {}
        rss = pss = 0
        for pid in cgroup_pids(host.sandbox):
            r, p = proc_memory(pid)
            rss, pss = rss + r, pss + p
            entry = by_comm.setdefault(proc_comm(pid), [0, 0])
            entry[0] += r
            entry[1] += p
        return {"rss": rss, "pss": pss, "by_process": {k: {"rss": v[0], "pss": v[1]} for k, v in by_comm.items()}}

    def memory_per_host(self, sample: int = 4) -> dict:
        """The mean of ``host_memory`` over the first ``sample`` hosts."""
        rows = [self.host_memory(h) for h in self.hosts[:sample]]
        mean: dict = {"hosts_sampled": len(rows), "rss": sum(r["rss"] for r in rows) // len(rows),
                      "pss": sum(r["pss"] for r in rows) // len(rows), "by_process": {}}
        for row in rows:
            for comm, v in row["by_process"].items():
                e = mean["by_process"].setdefault(comm, {"rss": 0, "pss": 0})
                e["rss"] += v["rss"] // len(rows)
                e["pss"] += v["pss"] // len(rows)
        return mean

    def ssh_connections(self) -> dict[str, int]:
        """Established TCP connections to port 22, as seen in the server's namespace, by host address."""
        # ss(8): a state filter and an expression; -H leaves out the header line.
        out = self.server.in_netns("ss", "-Htn", "state", "established", "( dport = :22 )").stdout
        counts: dict[str, int] = {}
        for line in out.splitlines():
            for field in line.split():
                if field.endswith(":22"):
                    addr = field.rsplit(":", 1)[0]
                    counts[addr] = counts.get(addr, 0) + 1
        return counts

    # -- teardown --------------------------------------------------------------------------------

    def down(self) -> None:
        with self._lock:
            sandboxes, self._sandboxes_made = list(self._sandboxes_made), []
        netns, self._netns_made = list(self._netns_made), []
        errors = stop_sandboxes(sandboxes, self.workers) + delete_netns(netns[::-1])
        shutil.rmtree(self.dir, ignore_errors=True)
        # The directory of the daemons run on its server (RigDaemon), if any was.
        shutil.rmtree(daemon_root(self.run_id), ignore_errors=True)
        if errors:
            raise RuntimeError("many-host rig teardown: " + "; ".join(errors))


def runs() -> list[str]:
    """Run ids of the rigs on this machine: their network namespaces, sandboxes or directories."""
    found = set()
    pattern = re.compile(r"capym[sh]-([0-9a-z]{1,12})(?:-\d+)?")
    listed = _run("ip", "netns", "list", check=False).stdout.split()
    listed += _run(str(SANDBOX), "list", check=False).stdout.split()
    for name in listed:
        m = pattern.fullmatch(name)
        if m:
            found.add(m.group(1))
    found |= {p.name.split("-", 1)[1] for p in Path("/var/tmp").glob("capymany-*")}
    return sorted(found)


def down_run(run_id: str) -> list[str]:
    """Remove the rig ``run_id`` from its names alone: the sandboxes capyms-RUN and capymh-RUN-K,
    the network namespaces of the same names, /var/tmp/capymany-RUN and the daemon's directory.
    Returns what it removed; raises when something of it could not be removed."""
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r}: lower-case letters and digits, at most 12")
    server, prefix = _names(run_id)
    ours = re.compile(rf"{re.escape(server)}|{re.escape(prefix)}\d+")
    sandboxes = [s for s in _run(str(SANDBOX), "list", check=False).stdout.split() if ours.fullmatch(s)]
    errors = stop_sandboxes(sandboxes)  # (before their namespaces: delete_netns)
    netns = [n for n in _run("ip", "netns", "list", check=False).stdout.split() if ours.fullmatch(n)]
    errors += delete_netns(netns)
    removed = [f"sandbox {s}" for s in sandboxes] + [f"netns {n}" for n in netns]
    for path in (rig_dir(run_id), daemon_root(run_id)):
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    if errors:
        raise RuntimeError(f"rig {run_id} teardown: " + "; ".join(errors))
    return removed


# -- the daemon on the server ------------------------------------------------------------------------

class RigDaemon(DaemonCli):
    """The CapyCTL daemon as a service of the server's systemd, its state under
    /var/lib/capyctl-tests (``suffix`` gives each daemon of one rig a directory of its own)."""

    def __init__(self, rig: ManyHostRig, suffix: str = "") -> None:
        self.rig = rig
        self.root = daemon_root(rig.run_id) / suffix if suffix else daemon_root(rig.run_id)
        self.api_socket = self.root / "run" / "api.sock"
        self.base_url = f"http://127.0.0.1:{PROXY_PORT}"

    def start(self, log_level: str = "INFO", timeout: float = 120) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        (self.root / "run").mkdir(parents=True)
        # Engine units run as users of their own: they read engine files (the instant engine's
        # script) below this directory.
        for path in (self.root, *self.root.parents):
            if path == Path("/var/lib"):
                break
            path.chmod(0o755)
        env = {"CAPYCTL_STATE_DIR": str(self.root / "state"), "CAPYCTL_RUNTIME_DIR": str(self.root / "run"),
               "CAPYCTL_LOG_LEVEL": log_level}
        self.exec("systemctl", "reset-failed", DAEMON_UNIT, check=False)
        # No --collect: the unit stays loaded after it stops, so `systemctl restart` and its journal
        # work as for an installed daemon.
        argv = ["systemd-run", f"--unit={DAEMON_UNIT}", "--service-type=notify",
                f"--property=TimeoutStartSec={int(timeout)}", limit_nofile_property(),
                *(f"--setenv={k}={v}" for k, v in env.items()),
                str(CAPYCTL), "start", "standalone", "--listen", f"127.0.0.1:{PROXY_PORT}"]
        out = self.exec(*argv, check=False, timeout=timeout + 30)
        if out.returncode != 0:
            raise RuntimeError(f"the daemon did not start on the server: {out.stderr}\n{self.daemon_journal()}")

    def exec(self, *argv: str, check: bool = True, timeout: float = 90) -> subprocess.CompletedProcess:
        return self.rig.server.exec(*argv, check=check, timeout=timeout)

    def daemon_journal(self, lines: int = 150, *extra: str) -> str:
        return self.exec("journalctl", "-u", DAEMON_UNIT, "-n", str(lines), "--no-pager", *extra,
                         check=False).stdout

    def restart(self, timeout: float = 300) -> None:
        """systemctl restart: returns once the new daemon said READY=1 (Type=notify)."""
        self.exec("systemctl", "restart", DAEMON_UNIT, timeout=timeout)

    def stop(self, remove: bool = True) -> None:
        self.exec("systemctl", "stop", DAEMON_UNIT, check=False, timeout=120)
        self.exec("systemctl", "reset-failed", DAEMON_UNIT, check=False)
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    def cgroup(self) -> str:
        return self.exec("systemctl", "show", "-P", "ControlGroup", DAEMON_UNIT).stdout.strip()

    def pids(self) -> list[int]:
        """Machine PIDs of every process in the daemon's unit (it, its ssh masters, helpers)."""
        return cgroup_pids(self.rig.server.sandbox, self.cgroup())

    def main_pid(self) -> int:
        """The daemon's PID as the machine sees it (systemd answers the sandbox's own PID)."""
        inner = int(self.exec("systemctl", "show", "-P", "MainPID", DAEMON_UNIT).stdout.strip())
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("NSpid:") and int(line.split()[-1]) == inner:
                        return pid
        raise RuntimeError(f"no process of {DAEMON_UNIT} has PID {inner} in the server's sandbox")

    def add_hosts(self, hosts: list[NetHost], workers: int = 8) -> None:
        """``capyctl host add`` for each host, ``workers`` at a time, with the rig's key and known_hosts."""
        def add(host: NetHost) -> None:
            self.cli("host", "add", host.label, "--ssh", f"root@{host.address}", "--identity",
                     str(self.rig.client_key), "--known-hosts", str(self.rig.known_hosts))

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(add, hosts))

    def write_manifest(self, name: str, text: str) -> Path:
        path = self.root / f"{name}.yaml"
        path.write_text(text)
        return path

    def entered(self) -> contextlib.AbstractContextManager:
        """The calling thread's network is the server's, where the proxy listens."""
        return entered_netns(self.rig.server.netns)


# -- an engine that answers at once -------------------------------------------------------------------

# One answer to every request: both a chat completion (message) and a text completion (text), so
# the daemon's post-start proof reads text from either route (benchmarks/daemon_scale.py's ANSWER).
INSTANT_ANSWER = json.dumps({"id": "cmpl-1", "object": "chat.completion", "created": 0, "model": "instant",
                             "choices": [{"index": 0, "text": "Hi", "finish_reason": "length",
                                          "message": {"role": "assistant", "content": "Hi"}}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
# Standard library only, run by the system's python3: the engine's unit runs as a user of its own,
# which may not read the project's virtual environment, and needs nothing but this file.
INSTANT_ENGINE_PY = '''\
"""An engine that answers every request at once with one fixed completion (CapyCTL's many-host rig)."""
import http.server
import sys

ANSWER = @ANSWER@.encode()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the daemon's proxy reuses its connections

    def _answer(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def do_GET(self):
        self._answer()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer()

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''
INSTANT_REGISTRATION = """\
kind: engine
name: {name}
type: custom
cmd: {cmd}
health: /health
capabilities: [chat, completions]
"""
# benchmarks/daemon_scale.py's engine: nginx in one process, everything it writes under the
# unit's private /tmp. It is the lighter of the two (one small process); python3 needs nothing
# that scripts/setup does not install.
NGINX_CMD = ('["/bin/sh", "-c", "sed s/@PORT@/$1/ {template} > /tmp/nginx.conf && exec {nginx} -p /tmp/ '
             '-c /tmp/nginx.conf -e stderr", "instant-engine", "{{port}}"]')


def write_instant_engine(daemon: RigDaemon, name: str = "instant", nginx: str | None = None,
                         nginx_conf: str | None = None) -> Path:
    """Register an instant engine with the daemon and return its registration's path: with
    ``nginx`` (its path) and ``nginx_conf`` (benchmarks/daemon_scale.py's ENGINE_CONF, its answer
    filled in) that nginx engine, else a python3 script. Its files live in the daemon's directory:
    the same path on every host (one shared filesystem)."""
    if nginx:
        if not nginx_conf:
            raise ValueError("an nginx engine needs its configuration template")
        template = daemon.root / f"{name}-engine.conf"
        template.write_text(nginx_conf)
        template.chmod(0o644)
        cmd = NGINX_CMD.format(template=template, nginx=nginx)
    else:
        script = daemon.root / f"{name}_engine.py"
        script.write_text(INSTANT_ENGINE_PY.replace("@ANSWER@", repr(INSTANT_ANSWER)))
        script.chmod(0o644)
        cmd = json.dumps(["/usr/bin/python3", str(script), "{port}"])
    registration = daemon.write_manifest(f"engine-{name}", INSTANT_REGISTRATION.format(name=name, cmd=cmd))
    daemon.cli("engine", "add", "--file", str(registration))
    return registration


@contextlib.contextmanager
def rig_with_daemon(n: int, **daemon_start: object) -> Iterator[tuple[ManyHostRig, RigDaemon]]:
    """A rig of ``n`` hosts, the daemon on its server with every host added; all removed after."""
    with ManyHostRig(n) as rig:
        daemon = RigDaemon(rig)
        try:
            daemon.start(**daemon_start)  # type: ignore[arg-type]
            daemon.add_hosts(rig.hosts)
            yield rig, daemon
        finally:
            daemon.stop()


# -- scripts/hosts-rig ----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="scripts/hosts-rig", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Bring up or tear down a rig of N sandboxed hosts (own systemd, real sshd) on one bridge,\n"
                    "with a server sandbox beside them (tests/netns/many.py). Needs root.",
        epilog="examples:\n"
               "  scripts/hosts-rig up 32             # prints the run id, addresses and how to reach the hosts\n"
               "  scripts/hosts-rig up 8 --daemon     # and the CapyCTL daemon on the server, every host added\n"
               "  scripts/hosts-rig list              # run ids of the rigs on this machine\n"
               "  scripts/hosts-rig down RUN_ID       # remove that rig: sandboxes, namespaces, directories")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("up", help="build a rig of N hosts and leave it running")
    p.add_argument("n", type=int, metavar="N", help=f"number of hosts, 1 to {MAX_HOSTS}")
    p.add_argument("--daemon", action="store_true", help="start the CapyCTL daemon on the server and add every host")
    p.add_argument("--workers", type=int, default=8, help="hosts started at once (default 8)")
    p = sub.add_parser("down", help="remove a rig by its run id")
    p.add_argument("run_id", metavar="RUN_ID")
    sub.add_parser("list", help="run ids of the rigs on this machine")
    args = parser.parse_args(argv)

    if args.action == "list":
        print("\n".join(runs()))
        return 0
    reason = missing_requirements()
    if reason:
        print(f"hosts-rig: {reason}", file=sys.stderr)
        return 1
    if args.action == "down":
        try:
            removed = down_run(args.run_id)
        except (RuntimeError, ValueError) as exc:
            print(f"hosts-rig: {exc}", file=sys.stderr)
            return 1
        print("\n".join(removed) if removed else f"hosts-rig: nothing of rig {args.run_id} is left")
        return 0

    rig = ManyHostRig(args.n, workers=args.workers)
    print(f"hosts-rig: building rig {rig.run_id} with {args.n} hosts", file=sys.stderr, flush=True)
    try:
        rig.up()
        if args.daemon:
            daemon = RigDaemon(rig)
            daemon.start()
            daemon.add_hosts(rig.hosts)
    except BaseException as exc:
        print(f"hosts-rig: {exc}; removing what was made", file=sys.stderr)
        down_run(rig.run_id)
        return 1
    mem = rig.memory_per_host()
    first, last = rig.hosts[0], rig.hosts[-1]
    ssh = (f"ip netns exec {rig.server.netns} ssh -i {rig.client_key} -o UserKnownHostsFile={rig.known_hosts} "
           f"root@{first.address}")
    print(f"run id:      {rig.run_id}  (up in {rig.up_seconds:.1f} s)\n"
          f"server:      netns and sandbox {rig.server.sandbox}, {rig.server.address} on {BRIDGE}\n"
          f"hosts:       {first.sandbox} .. {last.sandbox}, {first.address} .. {last.address}, sshd on port 22\n"
          f"per host:    {mem['rss'] / 2**20:.1f} MiB RSS, {mem['pss'] / 2**20:.1f} MiB PSS "
          f"(systemd, journald, dbus, sshd; mean of {mem['hosts_sampled']})\n"
          f"key:         {rig.client_key}\nknown_hosts: {rig.known_hosts}\n"
          f"ssh:         {ssh}\n"
          f"in a host:   {SANDBOX} exec {first.sandbox} -- systemctl status")
    if args.daemon:
        print(f"daemon:      {DAEMON_UNIT} in {rig.server.sandbox}, proxy on {rig.server.netns}'s "
              f"127.0.0.1:{PROXY_PORT}\n"
              f"capyctl:     {CAPYCTL} --api-socket {daemon_root(rig.run_id) / 'run' / 'api.sock'} list hosts")
    if rig.inotify_raised:
        print(f"note:        raised fs.inotify.max_user_instances from {rig.inotify_raised[0]} to "
              f"{rig.inotify_raised[1]} (left so)")
    print(f"down:        scripts/hosts-rig down {rig.run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
