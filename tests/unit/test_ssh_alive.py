"""SshHost.alive(): after one ``ssh -O check`` it watches the master through a pidfd, so the host
poller's look every few seconds starts no process (an idle host's cost, benchmarks/hosts_scale.py).

The master here is a stand-in: a sleeping process, and an ``ssh`` script that answers ``-O check``
as OpenSSH's mux.c does ("Master running (pid=%u)" on stderr) and counts its runs. The real ssh
is tests/integration/test_ssh.py's (a cut link goes offline)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from capyctl.hosts.ssh import SshHost

HANG_GUARD = 20.0  # seconds: a test that waits this long has failed, it is not a bound under test


def _stand_in(tmp_path: Path, master_pid: int) -> tuple[Path, Path]:
    runs = tmp_path / "runs"
    ssh = tmp_path / "ssh"
    ssh.write_text(f"#!/bin/sh\necho run >> {runs}\n"
                   f'case " $* " in *" -O check "*) printf "Master running (pid={master_pid})\\r\\n" >&2; exit 0;; esac\n'
                   "exit 255\n")
    ssh.chmod(0o755)
    return ssh, runs


@dataclass
class Master:
    host: SshHost
    process: subprocess.Popen
    ssh: Path  # the stand-in ssh
    runs: Path  # a line each time it ran

    def ends(self) -> None:
        """The master exits, and ssh -O check no longer finds it."""
        self.process.kill()
        self.process.wait()
        self.ssh.write_text("#!/bin/sh\nexit 255\n")


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ssh, runs = _stand_in(tmp_path, process.pid)
        host = SshHost("b", "root@10.0.0.2", runtime_dir=tmp_path / "run", ssh_binary=str(ssh))
        host.runtime_dir.mkdir()
        host.control_path.touch()  # the master's control socket, as far as alive() looks
        yield Master(host, process, ssh, runs)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_alive_asks_ssh_once_then_watches_the_master_until_it_exits(master: Master) -> None:
    host = master.host
    assert await host.alive()
    for _ in range(20):
        assert await host.alive()
    assert master.runs.read_text().count("run") == 1  # one ssh -O check, then the pidfd alone
    master.ends()
    assert not await host.alive()
    host.control_path.unlink()
    assert not await host.alive()


async def test_first_looks_at_once_leave_one_pidfd_open(master: Master) -> None:
    def pidfds() -> int:
        return sum(1 for fd in Path("/proc/self/fd").iterdir()
                   if Path("/proc/self/fd", fd.name).is_symlink() and "pidfd" in _link(fd))

    before = pidfds()
    assert await asyncio.gather(*(master.host.alive() for _ in range(3))) == [True] * 3
    assert master.runs.read_text().count("run") == 3  # three first looks, each its own -O check
    assert pidfds() == before + 1  # one watch kept, none leaked
    await master.host.close()
    assert pidfds() == before


def _link(fd: Path) -> str:
    with contextlib.suppress(OSError):
        return str(fd.readlink())
    return ""


async def test_without_a_pid_in_its_answer_each_look_asks_ssh(tmp_path: Path) -> None:
    ssh = tmp_path / "ssh"
    runs = tmp_path / "runs"
    ssh.write_text(f"#!/bin/sh\necho run >> {runs}\nexit 0\n")
    ssh.chmod(0o755)
    host = SshHost("b", "root@10.0.0.2", runtime_dir=tmp_path / "run", ssh_binary=str(ssh))
    host.runtime_dir.mkdir()
    host.control_path.touch()
    assert await host.alive() and await host.alive()
    assert runs.read_text().count("run") == 2


async def test_ends_within_tells_a_master_that_is_ending_from_one_that_runs(master: Master, monkeypatch) -> None:
    # Asked by every request whose engine connection broke at once: one watch answers them all.
    host = master.host
    loop = asyncio.get_running_loop()
    watched: list[int] = []  # the fds the loop was asked to watch
    add_reader = loop.add_reader
    monkeypatch.setattr(loop, "add_reader", lambda fd, *args: (watched.append(fd), add_reader(fd, *args))[1])
    assert await asyncio.wait_for(asyncio.gather(*(host.ends_within(0.2) for _ in range(3))),
                                  HANG_GUARD) == [False] * 3
    assert len(watched) == 1  # the three waited on one watch of the master's pidfd
    # A wait far past the hang guard: True can only come from the exit, not the end of the wait.
    asking = asyncio.gather(*(host.ends_within(3600) for _ in range(3)))
    await asyncio.sleep(0.1)
    master.ends()
    assert await asyncio.wait_for(asking, HANG_GUARD) == [True] * 3
    assert len(watched) == 1
    assert await host.ends_within(0.1)  # ended: at once
