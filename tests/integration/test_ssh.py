"""SshHost against a real sshd on a second sandboxed host, reached over a veth link.

The test process joins host a's network namespace for each test (rig.a.entered()), so
ssh, its ControlMaster and the forwards' local listeners all live on host a, and host b
is only reachable across the link at 10.213.7.2.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import AsyncIterator, Iterator

import aiohttp
import pytest

from capyctl.hosts.ssh import SshError, SshHost
from tests.netns.rig import TwoHostRig, missing_requirements
from tests.components import missing

pytestmark = pytest.mark.sandbox

# Keep-alives every second, three missed: the master gives up about 4 s after a cut.
# The bound below is generous for a loaded 2-core machine; it is about detection, not speed.
OFFLINE_DETECTION_BOUND_S = 30.0


@pytest.fixture(scope="module")
def rig() -> Iterator[TwoHostRig]:
    reason = missing_requirements()
    if reason:
        missing(reason)
    with TwoHostRig() as built:
        yield built


@pytest.fixture
def runtime_dir(rig: TwoHostRig) -> Iterator[Path]:
    path = rig.dir / f"rt-{secrets.token_hex(2)}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def host_b(rig: TwoHostRig, runtime_dir: Path, **overrides: object) -> SshHost:
    options: dict = dict(name="b", target=f"root@{rig.b.address}", runtime_dir=runtime_dir,
                         identity_file=str(rig.client_key), known_hosts=str(rig.known_hosts),
                         connect_timeout=5, keepalive_interval=1, keepalive_count_max=3)
    options.update(overrides)
    return SshHost(**options)


@pytest.fixture
async def on_a(rig: TwoHostRig) -> AsyncIterator[None]:
    with rig.a.entered():
        yield


@pytest.fixture
async def connected(rig: TwoHostRig, runtime_dir: Path, on_a: None) -> AsyncIterator[SshHost]:
    host = host_b(rig, runtime_dir)
    await host.start()
    try:
        yield host
    finally:
        await host.close()


async def test_runs_commands_on_b_with_its_host_key_verified(rig: TwoHostRig, connected: SshHost) -> None:
    assert await connected.alive()
    rc, out, err = await connected.run(["sh", "-c", 'ip -o -4 addr show && printf "%s" "$1"', "sh", "it's b"])
    assert rc == 0, err
    assert rig.b.address in out.decode()
    assert out.decode().endswith("it's b")  # argv survives the remote shell unchanged
    rc, _, _ = await connected.run(["sh", "-c", "exit 7"])
    assert rc == 7

    # A remote capyctl that is not there: the machine's own PATH may hold one meanwhile, as
    # test_packaging.py installs CapyCTL into the /usr and /opt the sandboxes share while this
    # test runs beside it on another worker.
    report = await connected.check(["capyctl-not-installed-on-b"])
    assert report["reachable"] is True
    assert report["systemd_version"] == int(
        subprocess.run(["systemctl", "--version"], capture_output=True, text=True).stdout.split()[1])
    assert report["host_info"] is None
    assert report["latency_ms"] > 0


def test_each_host_reaches_the_other_from_its_own_sandbox(rig: TwoHostRig) -> None:
    # Plain ssh from inside each sandbox (its systemd, its /run), keys verified both ways.
    for here, there in ((rig.a, rig.b), (rig.b, rig.a)):
        proc = here.exec("ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                         "-o", f"UserKnownHostsFile={rig.known_hosts}", "-i", str(rig.client_key),
                         f"root@{there.address}", "systemctl", "is-active", "capyfed-sshd.service",
                         "&&", "ip", "-o", "-4", "addr", "show", "dev", there.veth, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("active") and f"{there.address}/30" in proc.stdout


async def test_remote_command_timeout(connected: SshHost) -> None:
    with pytest.raises(SshError) as err:
        await connected.run(["sleep", "30"], timeout=1)
    assert err.value.code == "remote_timeout"
    assert await connected.alive()  # the master outlives a killed session


async def test_unknown_host_key_is_refused(rig: TwoHostRig, runtime_dir: Path, on_a: None) -> None:
    empty = rig.dir / "known_hosts.empty"
    empty.write_text("")
    host = host_b(rig, runtime_dir, known_hosts=str(empty))
    with pytest.raises(SshError) as err:
        await host.start()
    assert err.value.code == "host_key_unknown"
    assert not await host.alive()


async def test_changed_host_key_is_refused(rig: TwoHostRig, runtime_dir: Path, on_a: None) -> None:
    # b's address with some other host's key: what a man-in-the-middle or a reinstall looks like.
    other = rig.dir / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = rig.dir / "known_hosts.wrong"
    wrong.write_text(f"{rig.b.address} {Path(str(other) + '.pub').read_text().split(' ', 2)[0]} "
                     f"{Path(str(other) + '.pub').read_text().split(' ', 2)[1]}\n")
    host = host_b(rig, runtime_dir, known_hosts=str(wrong))
    with pytest.raises(SshError) as err:
        await host.start()
    assert err.value.code == "host_key_mismatch"


async def test_wrong_key_is_auth_failed(rig: TwoHostRig, runtime_dir: Path, on_a: None) -> None:
    stranger = rig.dir / "stranger_key"
    if not stranger.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    host = host_b(rig, runtime_dir, identity_file=str(stranger))
    with pytest.raises(SshError) as err:
        await host.start()
    assert err.value.code == "auth_failed"


async def test_closed_port_is_unreachable(rig: TwoHostRig, runtime_dir: Path, on_a: None) -> None:
    host = host_b(rig, runtime_dir, port=2)
    with pytest.raises(SshError) as err:
        await host.start()
    assert err.value.code == "host_unreachable"


async def test_drives_b_systemd_over_the_forwarded_bus(rig: TwoHostRig, connected: SshHost) -> None:
    from capyctl.systemd import SystemdClient, TransientUnit

    local = await connected.forward_unix()
    client = await SystemdClient.connect("unix:path=" + local)
    unit = f"capyfed-probe-{secrets.token_hex(3)}.service"
    try:
        names = {u.name for u in await client.list_units("*.service")}
        assert "capyfed-sshd.service" in names  # b's sshd: this is b's systemd, not ours
        await client.start_transient(TransientUnit(name=unit, description="ssh federation probe",
                                                   argv=["/bin/sleep", "300"], markers={"probe": "ssh"}))
        state = await client.unit_state(unit)
        assert state is not None and state.active_state == "active"
        assert state.markers == {"probe": "ssh"}
        # Seen from b itself, not only through our connection.
        shown = rig.b.exec("systemctl", "is-active", unit, check=False).stdout.strip()
        assert shown == "active"
        await client.stop_unit(unit, 10)
    finally:
        await client.close()
        rig.b.exec("systemctl", "stop", unit, check=False)
    await connected.cancel_forward(local)
    assert not Path(local).exists()


def _start_http_on_b(rig: TwoHostRig, port: int, token: str) -> str:
    root = rig.dir / f"www-{token}"
    root.mkdir()
    (root / "hello.txt").write_text(f"hello from b {token}\n")
    unit = f"capyfed-http-{token}"
    rig.b.exec("systemd-run", f"--unit={unit}", "/usr/bin/python3", "-m", "http.server", str(port),
               "--bind", "127.0.0.1", "--directory", str(root))
    return unit


async def _get(port: int, path: str) -> str:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"http://127.0.0.1:{port}{path}") as resp:
            assert resp.status == 200
            return await resp.text()


async def _wait_get(port: int, path: str, attempts: int = 100) -> str:
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return await _get(port, path)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            last = exc
            await asyncio.sleep(0.1)
    raise AssertionError(f"no answer through the forward: {last!r}")


async def test_tcp_forward_reaches_a_server_on_b_loopback(rig: TwoHostRig, connected: SshHost) -> None:
    token = secrets.token_hex(3)
    unit = _start_http_on_b(rig, 18731, token)
    try:
        # Nothing on a listens there: only b's loopback has the server.
        with pytest.raises(aiohttp.ClientError):
            await _get(18731, "/hello.txt")
        local_port = await connected.forward_tcp(18731)
        assert (await _wait_get(local_port, "/hello.txt")).strip() == f"hello from b {token}"
        await connected.cancel_forward(local_port)
        with pytest.raises(aiohttp.ClientError):
            await _get(local_port, "/hello.txt")
    finally:
        rig.b.exec("systemctl", "stop", unit, check=False)


async def test_cut_link_goes_offline_and_restore_reconnects(rig: TwoHostRig, connected: SshHost) -> None:
    token = secrets.token_hex(3)
    unit = _start_http_on_b(rig, 18732, token)
    try:
        local_port = await connected.forward_tcp(18732)
        assert token in await _wait_get(local_port, "/hello.txt")
        rig.a.cut_link()
        try:
            deadline = time.monotonic() + OFFLINE_DETECTION_BOUND_S
            while await connected.alive():
                assert time.monotonic() < deadline, "alive() stayed true with the link cut"
                await asyncio.sleep(0.5)
            with pytest.raises(SshError) as err:
                await connected.run(["true"])
            assert err.value.code == "host_offline"
            with pytest.raises(SshError) as err:
                await connected.reconnect()
            assert err.value.code == "host_unreachable"
        finally:
            rig.a.restore_link()
        await connected.reconnect()  # a new master connection, the forward re-created on the same port
        assert await connected.alive()
        rc, _, _ = await connected.run(["true"])
        assert rc == 0
        assert token in await _wait_get(local_port, "/hello.txt")
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            rig.b.exec("systemctl", "stop", unit, check=False)
