"""The test sandbox itself: systemd 252 as PID 1 in private namespaces, and its teardown."""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from pathlib import Path

import pytest

from capyctl.systemd import SystemdClient
from tests.sandbox.sandbox import Sandbox, SandboxError

pytestmark = pytest.mark.sandbox


def leftovers(name: str) -> list[str]:
    found = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/capysb-{name}")]
    if Path(f"/run/capysb/{name}").exists():
        found.append(f"/run/capysb/{name}")
    return found


def test_boot_run_inside_and_clean_teardown(sandbox_factory) -> None:
    sb = sandbox_factory()
    state = sb.run(["systemctl", "is-system-running"]).stdout.strip()
    assert state in ("running", "degraded"), sb.systemctl("--failed").stdout
    # PID 1 inside is systemd, and inside tools talk to it.
    assert sb.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
    assert sb.run(["busctl", "--system", "status"]).returncode == 0

    # Private /run and /tmp; the rest of the host filesystem is shared.
    marker = f"capysb-{uuid.uuid4().hex}"
    sb.run(["touch", f"/tmp/{marker}", f"/run/{marker}"], check=True)
    assert not Path(f"/tmp/{marker}").exists() and not Path(f"/run/{marker}").exists()
    assert (sb.root / "tmp" / marker).exists()
    assert sb.run(["test", "-f", str(Path(__file__).resolve())]).returncode == 0

    # The system bus answers from the host through /proc/<pid>/root.
    async def version() -> str:
        client = await SystemdClient.connect(sb.bus_address)
        try:
            return await client.manager.get("Version")
        finally:
            await client.close()

    assert asyncio.run(version()).startswith("252")

    pid = sb.pid
    assert leftovers(sb.name)  # sanity: the checks below look at the right places
    sb.stop()
    assert not Path(f"/proc/{pid}").exists()
    assert leftovers(sb.name) == []


def test_two_sandboxes_at_once_are_independent(sandbox_factory) -> None:
    first, second = sandbox_factory(), sandbox_factory()
    first.run(["systemd-run", "--unit=only-in-first.service", "/bin/sleep", "300"], check=True)
    assert first.systemctl("is-active", "only-in-first.service").stdout.strip() == "active"
    assert second.systemctl("is-active", "only-in-first.service").stdout.strip() == "inactive"
    second.stop()
    assert first.systemctl("is-active", "only-in-first.service").stdout.strip() == "active"


def test_same_name_twice_is_refused(sandbox_factory) -> None:
    sb = sandbox_factory()
    with pytest.raises(SandboxError, match=re.escape(f"sandbox '{sb.name}' is already running")):
        Sandbox(sb.name).start()
    assert sb.run(["systemctl", "is-system-running"]).stdout.strip() in ("running", "degraded")


def test_sandbox_inside_a_network_namespace(sandbox_factory, netns: str) -> None:
    sb = sandbox_factory(netns=netns)
    inside = sb.run(["ip", "-o", "link"]).stdout
    assert [line.split(":")[1].strip() for line in inside.splitlines()] == ["lo"]
    # systemd itself lives in that namespace, not only the commands we run.
    ns_inode = os.stat(f"/run/netns/{netns}").st_ino
    assert os.stat(f"/proc/{sb.pid}/ns/net").st_ino == ns_inode
    assert sb.run(["systemctl", "is-system-running"]).stdout.strip() in ("running", "degraded")
