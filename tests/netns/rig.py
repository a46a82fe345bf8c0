"""The two-host rig: two network namespaces joined by a veth pair, each a sandboxed host.

    host a: netns capyfa-RUN, veth cfa-RUN, 10.213.7.1/30
    host b: netns capyfb-RUN, veth cfb-RUN, 10.213.7.2/30

Each host boots its own systemd (tests/sandbox/capy-sandbox start --netns) and runs a
real OpenSSH server on its veth address as a transient unit of that systemd. The sshd
configuration, its per-run host key, the client key and authorized_keys live in a per-run
directory under /var/tmp: the sandboxes share the host's filesystem except /run and /tmp,
and the host's /etc/ssh is never touched. ``known_hosts`` is a real known_hosts file made
with ssh-keyscan of the servers, so clients verify host keys the normal way.

Traffic stays between the two namespaces made here; nothing is routed to the host's own
network. Teardown removes exactly what this rig created: its sandboxes by name, its
network namespaces by name (which deletes the veth pair), its directory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]
SANDBOX = REPO / "tests" / "sandbox" / "capy-sandbox"
SUBNET = "10.213.7"
SSHD = "/usr/sbin/sshd"
_CLONE_NEWNET = 0x40000000


def missing_requirements() -> str | None:
    """Why this machine cannot run the rig, in words a user accepts, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and systemd in private namespaces)"
    for tool in ("ip", "ssh", "ssh-keygen", "ssh-keyscan", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool} (scripts/setup installs it)"
    if not os.path.exists(SSHD):
        return "needs Debian's openssh-server (scripts/setup installs it)"
    return None


def _run(*argv: str, check: bool = True, timeout: float = 90) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@contextlib.contextmanager
def entered_netns(netns: str) -> Iterator[None]:
    """Move the calling thread into network namespace ``netns`` for the block.

    Sockets it creates and processes it starts (ssh, its ControlMaster, forwards' listeners)
    live in that namespace; unix sockets are files and stay reachable from everywhere.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{netns}") as target:
        if libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
        try:
            yield
        finally:
            if libc.setns(home.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original network namespace failed")


@dataclass
class NetHost:
    """One host of the rig."""

    label: str  # "a" or "b"
    netns: str
    veth: str
    address: str
    sandbox: str
    sshd_dir: Path
    ssh_port: int = 22

    def exec(self, *argv: str, check: bool = True, timeout: float = 90) -> subprocess.CompletedProcess:
        """Run argv inside this host's sandbox (its systemd, its /run, its network)."""
        return _run(str(SANDBOX), "exec", self.sandbox, "--", *argv, check=check, timeout=timeout)

    def in_netns(self, *argv: str, check: bool = True, timeout: float = 90) -> subprocess.CompletedProcess:
        """Run argv in this host's network namespace only (the machine's filesystem and /run)."""
        return _run("ip", "netns", "exec", self.netns, *argv, check=check, timeout=timeout)

    def entered(self):
        """Context manager: the calling thread's network is this host's (see entered_netns)."""
        return entered_netns(self.netns)

    def cut_link(self) -> None:
        _run("ip", "-n", self.netns, "link", "set", self.veth, "down")

    def restore_link(self) -> None:
        _run("ip", "-n", self.netns, "link", "set", self.veth, "up")


def start_sshd(host: NetHost, client_key: Path, comment: str, unit: str = "capyfed-sshd",
               description: str = "sshd of the two-host test rig") -> None:
    """A real sshd on ``host.address`` as a transient unit (``unit``) of the host's systemd: its
    config, per-run host key and authorized_keys (``client_key``'s public half) in ``host.sshd_dir``.
    Returns once it answers ssh-keyscan in the host's own network namespace."""
    d = host.sshd_dir
    d.mkdir(mode=0o700)
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
         "-f", str(d / "host_ed25519"))
    shutil.copy(f"{client_key}.pub", d / "authorized_keys")
    (d / "authorized_keys").chmod(0o600)
    (d / "sshd_config").write_text(
        f"ListenAddress {host.address}:{host.ssh_port}\n"
        f"HostKey {d / 'host_ed25519'}\n"
        f"PidFile none\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        # No PAM: a PAM session would register with logind, which the sandbox does not run.
        "UsePAM no\n"
        # /var/tmp is world-writable, which StrictModes refuses for key files beneath it.
        "StrictModes no\n"
        "AllowStreamLocalForwarding yes\n"
        "AllowTcpForwarding yes\n"
        "MaxSessions 50\n"
        "MaxStartups 50\n"
        "ClientAliveInterval 0\n"
        "Subsystem sftp internal-sftp\n")
    host.exec("systemd-run", f"--unit={unit}", f"--description={description}",
              "-p", "RuntimeDirectory=sshd", "-p", "RuntimeDirectoryMode=0755",
              SSHD, "-D", "-e", "-f", str(d / "sshd_config"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe = host.in_netns("ssh-keyscan", "-T", "2", "-p", str(host.ssh_port), "-t", "ed25519",
                              host.address, check=False, timeout=10)
        if probe.returncode == 0 and probe.stdout.strip():
            return
        time.sleep(0.2)
    journal = host.exec("journalctl", "-u", unit, "--no-pager", "-n", "40", check=False)
    raise RuntimeError(f"sshd on host {host.label} did not answer: {journal.stdout}")


def stop_sandboxes(names: list[str], workers: int = 8) -> list[str]:
    """Stop the sandboxes ``names``, ``workers`` at a time; the errors."""
    def stop(name: str) -> str | None:
        proc = _run(str(SANDBOX), "stop", name, check=False, timeout=120)
        return proc.stderr.strip() or f"stopping {name} failed" if proc.returncode != 0 else None

    if not names:
        return []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return [e for e in pool.map(stop, names) if e]


def delete_netns(names: list[str]) -> list[str]:
    """``ip netns del`` each of ``names``, in that order; the errors. (After the sandboxes in them
    have stopped: `ip netns del` only unmounts a name, the namespace lives on while a process is
    in it, ip-netns(8).)"""
    errors = []
    for name in names:
        proc = _run("ip", "netns", "del", name, check=False)
        if proc.returncode != 0:
            errors.append(proc.stderr.strip())
    return errors


class Rig:
    """A rig as a context manager: ``up()`` on entry, ``down()`` on exit and after a failed ``up``."""

    def up(self):
        raise NotImplementedError

    def down(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc: object) -> None:
        self.down()


class TwoHostRig(Rig):
    """Build with ``TwoHostRig().up()``, always ``down()`` (also after a failed ``up``)."""

    def __init__(self, run_id: str | None = None, with_sandbox_a: bool = True) -> None:
        self.run_id = run_id or secrets.token_hex(3)
        self.dir = Path(f"/var/tmp/capyfed-{self.run_id}")
        self.client_key = self.dir / "client_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.with_sandbox_a = with_sandbox_a
        self.a = self._host("a", 1)
        self.b = self._host("b", 2)
        self._netns_made: list[str] = []
        self._sandboxes_made: list[str] = []

    def _host(self, label: str, octet: int) -> NetHost:
        return NetHost(label=label, netns=f"capyf{label}-{self.run_id}", veth=f"cf{label}-{self.run_id}",
                       address=f"{SUBNET}.{octet}", sandbox=f"capyf{label}-{self.run_id}",
                       sshd_dir=self.dir / f"sshd-{label}")

    # -- build -----------------------------------------------------------------------------------

    def up(self) -> "TwoHostRig":
        self.dir.mkdir(mode=0o700, parents=True)
        self._network()
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"capyfed-{self.run_id}",
             "-f", str(self.client_key))
        for host in (self.a, self.b):
            if host is self.a and not self.with_sandbox_a:
                continue
            _run(str(SANDBOX), "start", host.sandbox, "--netns", host.netns, timeout=120)
            self._sandboxes_made.append(host.sandbox)
            self._start_sshd(host)
        self.write_known_hosts()
        return self

    def _network(self) -> None:
        for host in (self.a, self.b):
            _run("ip", "netns", "add", host.netns)
            self._netns_made.append(host.netns)
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
        # Created inside a's namespace with its peer placed straight into b's: the veth pair
        # never appears in the machine's own network namespace.
        _run("ip", "-n", self.a.netns, "link", "add", self.a.veth, "type", "veth",
             "peer", "name", self.b.veth, "netns", self.b.netns)
        for host in (self.a, self.b):
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/30", "dev", host.veth)
            _run("ip", "-n", host.netns, "link", "set", host.veth, "up")

    def _start_sshd(self, host: NetHost) -> None:
        start_sshd(host, self.client_key, f"{host.label}-{self.run_id}")

    def write_known_hosts(self) -> None:
        """known_hosts with the real keys of the sshds running, scanned over the veth link."""
        lines = []
        for host in (self.a, self.b):
            if host.sandbox not in self._sandboxes_made:
                continue
            scan = self.a.in_netns("ssh-keyscan", "-T", "5", "-p", str(host.ssh_port), "-t", "ed25519",
                                   host.address)
            lines += [ln for ln in scan.stdout.splitlines() if ln and not ln.startswith("#")]
        self.known_hosts.write_text("\n".join(lines) + "\n")

    def host_public_key(self, host: NetHost) -> str:
        return (host.sshd_dir / "host_ed25519.pub").read_text().strip()

    # -- teardown --------------------------------------------------------------------------------

    def down(self) -> None:
        errors = stop_sandboxes(self._sandboxes_made[::-1], workers=1)
        self._sandboxes_made.clear()
        errors += delete_netns(self._netns_made[::-1])
        self._netns_made.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise RuntimeError("two-host rig teardown: " + "; ".join(errors))
