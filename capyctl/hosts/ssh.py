"""One remote host reached over SSH: commands, D-Bus and engine traffic through one connection.

CapyCTL uses the system OpenSSH client, not a Python SSH library, so that the user's
``~/.ssh/config``, agents, jump hosts and ``known_hosts`` work exactly as they do for
``ssh`` itself. Host keys are always verified (``StrictHostKeyChecking=yes``): an unknown
or changed key is an error the operator fixes, never something CapyCTL accepts for them.

One ControlMaster connection per host carries everything (``ssh -S`` multiplexing):
``run()`` opens a session on it, ``forward_unix()`` and ``forward_tcp()`` add forwards to
it with ``ssh -O forward``. The remote systemd is driven over its D-Bus system bus
through a forwarded unix socket (``-L local.sock:/run/dbus/system_bus_socket``): OpenSSH's
stream-local forwarding is a plain byte relay, which is all D-Bus needs, and it avoids
keeping one ``systemd-stdio-bridge`` process per connection. The remote bus authenticates
the forwarded connection as the SSH login user (the client's EXTERNAL uid must match it,
so log in as the same uid the controller runs as, normally root).

Offline detection: the master sends SSH keep-alives every ``keepalive_interval`` seconds
and exits after ``keepalive_count_max`` unanswered ones, so a cut link ends the master
within about ``keepalive_interval * (keepalive_count_max + 1)`` seconds; ``alive()``
(a pidfd of the master, learnt from ``ssh -O check``) then answers False. A controller polls
``alive()`` every few seconds per host (a poll(2), no process and no network round trip); on
False it marks the host offline, moves or keeps what runs there, and calls ``reconnect()`` with a backoff
until it succeeds, which opens a new master and re-creates the forwards at the same
local socket paths and ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import select
import shlex
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..errors import CapyError

__all__ = ["SshError", "SshHost", "DBUS_SYSTEM_SOCKET"]

DBUS_SYSTEM_SOCKET = "/run/dbus/system_bus_socket"

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
_UNIX_PATH_MAX = 107


class SshError(CapyError):
    """A remote host could not be reached or used; ``code`` says which way it failed."""

    code = "ssh_error"
    status = 502


@dataclass
class _Forward:
    kind: str  # "unix" or "tcp"
    spec: str  # the -L argument given to ssh
    local: str  # local socket path, or local port as a string
    remote: str


@dataclass
class SshHost:
    """One remote host; all connections go through one ControlMaster under ``runtime_dir``.

    ``target`` is ``[user@]address`` as ``ssh`` takes it (a ``Host`` alias of the ssh config
    works too). ``known_hosts`` replaces the user's known_hosts file when given (the global
    ``/etc/ssh/ssh_known_hosts`` still counts); ``ssh_config`` replaces ``~/.ssh/config``.
    """

    name: str
    target: str
    runtime_dir: Path
    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    ssh_config: str | None = None
    connect_timeout: float = 10.0
    keepalive_interval: int = 2
    keepalive_count_max: int = 3
    ssh_binary: str = "ssh"
    _forwards: list[_Forward] = field(default_factory=list, init=False, repr=False)
    _master_pidfd: int | None = field(default=None, init=False, repr=False)  # see alive()
    _master_exit: asyncio.Future | None = field(default=None, init=False, repr=False)  # see ends_within()

    def __post_init__(self) -> None:
        self.runtime_dir = Path(self.runtime_dir)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", self.name):
            raise SshError(f"host name {self.name!r} must be letters, digits, '_', '.', '-'",
                           code="invalid_host_name", status=400)
        if self.target.startswith("-"):
            raise SshError(f"SSH target {self.target!r} must not start with '-'", code="invalid_host_target",
                           status=400)
        if len(str(self.control_path)) > _UNIX_PATH_MAX - 25:  # ssh appends a random suffix while binding
            raise SshError(f"runtime directory {self.runtime_dir} is too long for an SSH control socket",
                           code="ssh_path_too_long", status=400)

    # -- paths -----------------------------------------------------------------------------------

    @property
    def control_path(self) -> Path:
        return self.runtime_dir / f"{self.name}.ctl"

    @property
    def _log_path(self) -> Path:
        return self.runtime_dir / f"{self.name}.master.log"

    def _base_options(self) -> list[str]:
        opts = [
            "-o", "BatchMode=yes",  # never prompt: a daemon has nobody to answer
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"ControlPath={self.control_path}",
            "-o", f"ConnectTimeout={max(1, int(self.connect_timeout))}",
        ]
        if self.ssh_config:
            opts[0:0] = ["-F", self.ssh_config]
        if self.port is not None:
            opts += ["-p", str(self.port)]
        if self.identity_file:
            opts += ["-i", self.identity_file, "-o", "IdentitiesOnly=yes"]
        if self.known_hosts:
            opts += ["-o", f"UserKnownHostsFile={self.known_hosts}"]
        return opts

    def _master_argv(self) -> list[str]:
        return [self.ssh_binary, *self._base_options(),
                "-o", "ControlMaster=yes",
                "-o", "ControlPersist=yes",
                "-o", f"ServerAliveInterval={self.keepalive_interval}",
                "-o", f"ServerAliveCountMax={self.keepalive_count_max}",
                # Re-created forwards reuse their socket paths after a reconnect.
                "-o", "StreamLocalBindUnlink=yes",
                "-o", "ExitOnForwardFailure=yes",
                "-N", "-f", self.target]

    def _control_argv(self, op: str, *extra: str) -> list[str]:
        return [self.ssh_binary, *self._base_options(), "-O", op, *extra, self.target]

    # -- connection ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the master connection (no-op when one is alive).

        Raises SshError with code host_unreachable, host_key_unknown, host_key_mismatch,
        auth_failed or ssh_failed.
        """
        if await self.alive():
            return
        self.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()  # a stale socket of a dead master
        # The master forks into the background after authenticating and keeps its stderr,
        # so stderr goes to a file: a pipe would never reach EOF while the master lives.
        with open(self._log_path, "wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *self._master_argv(), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=log)
        try:
            rc = await asyncio.wait_for(proc.wait(), self.connect_timeout + 15)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise SshError(f"connecting to host {self.name!r} ({self.target}) took too long",
                           code="host_unreachable", detail={"host": self.name}) from None
        stderr = self._log_path.read_text(errors="replace")
        if rc != 0:
            raise _classify(self.name, self.target, stderr)

    async def reconnect(self) -> None:
        """Open a new master (after the link came back) and re-create the forwards it had."""
        await self.start()
        for fwd in list(self._forwards):
            await self._control("forward", "-L", fwd.spec)

    async def alive(self) -> bool:
        """True while the master connection runs; nothing crosses the network.

        The first look asks ``ssh -O check``, which prints the master's pid ("Master running
        (pid=%u)", OpenSSH mux.c); from then on a pidfd of the master answers, a poll(2) with no
        process started: the host poller asks every host every few seconds, and an ssh client per
        look was most of what an idle host cost the daemon. The pidfd turns readable when the
        master exits (pidfd_open(2)), and cannot be fooled by its pid being reused.
        """
        if not self.control_path.exists():
            self._forget_master()
            return False
        if self._master_pidfd is not None:
            if not _process_exited(self._master_pidfd):
                return True
            self._forget_master()
        rc, _, err = await self._exec(self._control_argv("check"), timeout=10)
        if rc != 0:
            return False
        match = re.search(rb"pid=(\d+)", err)
        # (Several first looks at once each ran -O check: the first to return keeps its pidfd; the
        # others would have replaced it and left theirs open.)
        if match and self._master_pidfd is None:
            with contextlib.suppress(OSError):  # no pidfd (an old kernel): -O check at each look
                self._master_pidfd = os.pidfd_open(int(match.group(1)))
        return True

    async def ends_within(self, seconds: float) -> bool:
        """Whether the master has ended, or ends within ``seconds``. Asked when a connection
        through it broke: a master that dies closes its forwarded sockets a moment before it
        exits, while an engine that died alone leaves the master running."""
        if not await self.alive():
            return True
        if self._master_pidfd is None:  # no pidfd: one more look after the wait
            await asyncio.sleep(seconds)
            return not await self.alive()
        if self._master_exit is None:  # one watch, however many ask at once
            loop = asyncio.get_running_loop()
            exited = self._master_exit = loop.create_future()
            fd = self._master_pidfd

            def ended() -> None:
                loop.remove_reader(fd)
                if not exited.done():
                    exited.set_result(True)
            loop.add_reader(fd, ended)
        try:
            return await asyncio.wait_for(asyncio.shield(self._master_exit), seconds)
        except TimeoutError:
            return False

    def _forget_master(self) -> None:
        fd, self._master_pidfd = self._master_pidfd, None
        exited, self._master_exit = self._master_exit, None
        if exited is not None:
            with contextlib.suppress(Exception):  # (its loop may be closed already)
                asyncio.get_running_loop().remove_reader(fd)
            if not exited.done():
                exited.set_result(True)  # forgotten because it ended, or was closed: gone either way
        if fd is not None:
            os.close(fd)

    async def close(self) -> None:
        """Cancel every forward and end the master (``ssh -O exit``)."""
        self._forwards.clear()
        self._forget_master()
        if self.control_path.exists():
            await self._exec(self._control_argv("exit"), timeout=10)
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()

    # -- commands --------------------------------------------------------------------------------

    async def run(self, argv: Sequence[str], timeout: float = 60.0,
                  input: bytes | None = None) -> tuple[int, bytes, bytes]:
        """Run argv on the host (quoted for the remote shell) through the master; (rc, stdout, stderr).

        rc 255 is ssh's own failure (connection lost). Raises SshError remote_timeout when the
        command outlives ``timeout``: the local ssh client is killed and the session closed, but
        without a terminal the remote command is not signalled; wrap it in ``timeout`` (coreutils)
        or run it as a unit when it must not outlive the call.
        """
        if not argv:
            raise SshError("no command to run", code="invalid_request", status=400)
        await self._require_master()
        cmd = [self.ssh_binary, *self._base_options(), "-o", "ControlMaster=no", "-T", self.target,
               "--", shlex.join(argv)]
        rc, out, err = await self._exec(cmd, timeout=timeout, input=input)
        if rc is None:
            raise SshError(f"command {argv[0]!r} on host {self.name!r} did not finish within {timeout:g}s",
                           code="remote_timeout", status=504, detail={"host": self.name})
        return rc, out, err

    async def check(self, capyctl_command: Sequence[str] | None = None) -> dict:
        """Reachability, round-trip latency, remote systemd version and ``capyctl host-info --json``.

        ``capyctl_command`` is the remote capyctl (default: ``capyctl`` on the remote PATH);
        ``host_info`` is None when it is not installed there.
        """
        report: dict = {"host": self.name, "target": self.target, "reachable": False,
                        "latency_ms": None, "systemd_version": None, "host_info": None}
        try:
            await self.start()
            started = time.monotonic()
            rc, _, err = await self.run(["true"], timeout=30)
            if rc != 0:
                report["error"] = err.decode(errors="replace").strip()
                return report
            report["latency_ms"] = round((time.monotonic() - started) * 1000, 1)
            report["reachable"] = True
            rc, out, _ = await self.run(["systemctl", "--version"], timeout=30)
            match = re.match(rb"systemd (\d+)", out)
            if rc == 0 and match:
                report["systemd_version"] = int(match.group(1))
            cmd = list(capyctl_command or ["capyctl"])
            rc, out, err = await self.run(["sh", "-c", 'command -v "$1" >/dev/null && exec "$@" host-info --json',
                                           "sh", *cmd], timeout=60)
            if rc == 0:
                try:
                    report["host_info"] = json.loads(out)
                except ValueError:
                    report["host_info_error"] = "capyctl host-info --json did not print JSON"
            elif err.strip():
                report["host_info_error"] = err.decode(errors="replace").strip()[-500:]
        except SshError as exc:
            report["error"] = exc.code
            report["message"] = exc.message
        return report

    # -- forwards --------------------------------------------------------------------------------

    async def forward_unix(self, remote_path: str = DBUS_SYSTEM_SOCKET) -> str:
        """Forward a local unix socket to ``remote_path`` on the host; returns the local path.

        For the remote system bus: ``SystemdClient.connect("unix:path=" + local)``.
        """
        await self._require_master()
        local = str(self.runtime_dir / f"{self.name}.{len(self._forwards)}.{os.getpid()}.sock")
        if len(local) > _UNIX_PATH_MAX:
            raise SshError(f"forward socket path {local} is too long", code="ssh_path_too_long", status=400)
        spec = f"{local}:{remote_path}"
        await self._control("forward", "-L", spec)
        self._forwards.append(_Forward("unix", spec, local, remote_path))
        return local

    async def forward_tcp(self, remote_port: int, remote_host: str = "127.0.0.1") -> int:
        """Forward a free loopback port to ``remote_host:remote_port`` as seen from the host."""
        await self._require_master()
        last: SshError | None = None
        for _ in range(3):  # a free port can be taken between picking and binding: try again
            local_port = _free_loopback_port()
            spec = f"127.0.0.1:{local_port}:{_bracket(remote_host)}:{remote_port}"
            try:
                await self._control("forward", "-L", spec)
            except SshError as exc:
                last = exc
                continue
            self._forwards.append(_Forward("tcp", spec, str(local_port), f"{remote_host}:{remote_port}"))
            return local_port
        assert last is not None
        raise last

    async def cancel_forward(self, local: str | int) -> None:
        """Remove a forward by what ``forward_unix``/``forward_tcp`` returned."""
        for fwd in self._forwards:
            if fwd.local == str(local):
                self._forwards.remove(fwd)
                if await self.alive():
                    await self._control("cancel", "-L", fwd.spec)
                if fwd.kind == "unix":
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(fwd.local)
                return
        raise SshError(f"host {self.name!r} has no forward {local!r}", code="not_found", status=404)

    def forwards(self) -> list[dict]:
        return [{"kind": f.kind, "local": f.local, "remote": f.remote} for f in self._forwards]

    # -- plumbing --------------------------------------------------------------------------------

    async def _require_master(self) -> None:
        if not await self.alive():
            raise SshError(f"host {self.name!r} is not connected", code="host_offline", status=503,
                           detail={"host": self.name})

    async def _control(self, op: str, *extra: str) -> None:
        rc, _, err = await self._exec(self._control_argv(op, *extra), timeout=30)
        if rc != 0:
            text = (err or b"").decode(errors="replace").strip()
            raise SshError(f"ssh -O {op} {' '.join(extra)} on host {self.name!r} failed: {text}",
                           code="ssh_forward_failed", detail={"host": self.name})

    @staticmethod
    async def _exec(argv: Sequence[str], timeout: float,
                    input: bytes | None = None) -> tuple[int | None, bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(input), timeout)
        except asyncio.TimeoutError:
            proc.kill()  # the ssh client we started, by its own handle
            # A multiplexed client hands its stdio to the master, which keeps our pipes open
            # while the remote command runs: close our ends rather than wait for their EOF.
            transport = getattr(proc, "_transport", None)
            if transport is not None:
                transport.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
            return None, b"", b""
        return proc.returncode, out, err


def _process_exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited: its pidfd polls readable then (pidfd_open(2))."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _classify(name: str, target: str, stderr: str) -> SshError:
    """Turn OpenSSH's stderr into a stable error code (its messages are stable across versions)."""
    text = stderr.strip()
    detail = {"host": name, "ssh_stderr": text[-2000:]}
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text or "Host key for" in text and "has changed" in text:
        return SshError(f"the host key of {name!r} ({target}) differs from the one in known_hosts; "
                        "if the host was reinstalled, replace its known_hosts entry", code="host_key_mismatch",
                        status=502, detail=detail)
    if "Host key verification failed" in text or "No " in text and "host key is known" in text:
        return SshError(f"the host key of {name!r} ({target}) is not in known_hosts; "
                        "verify it and add it (ssh-keyscan, then compare the fingerprint)",
                        code="host_key_unknown", status=502, detail=detail)
    if "Permission denied" in text or "Too many authentication failures" in text:
        return SshError(f"host {name!r} ({target}) refused the SSH login", code="auth_failed", status=502,
                        detail=detail)
    if re.search(r"Could not resolve hostname|Connection refused|No route to host|Connection timed out|"
                 r"Network is unreachable|Connection closed|Connection reset|timed out", text):
        return SshError(f"host {name!r} ({target}) is unreachable over SSH", code="host_unreachable",
                        status=503, detail=detail)
    last = text.splitlines()[-1] if text else "no message"
    return SshError(f"ssh to host {name!r} ({target}) failed: {last}", code="ssh_failed", detail=detail)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
