"""SystemdClient against a real systemd 252 booted as PID 1 in a sandbox, over D-Bus."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from capyctl.errors import SystemdError
from capyctl.systemd import (SystemdClient, TransientUnit, UnitState, failure_reason, journal_follow,
                             journal_tail, security_exposure)
from tests.sandbox.sandbox import Sandbox

pytestmark = pytest.mark.sandbox

PYTHON = sys.executable  # the project venv: visible inside the sandbox, like all of /work
MiB = 1 << 20


async def connect(sb: Sandbox) -> SystemdClient:
    return await SystemdClient.connect(sb.bus_address, fs_root=sb.root)


def python_unit(name: str, code: str, **kw: object) -> TransientUnit:
    return TransientUnit(
        name=name, description=f"CapyCTL test unit {name}",
        argv=[PYTHON, "-u", "-c", textwrap.dedent(code)], **kw)  # type: ignore[arg-type]


async def wait_for_line(unit: str, sb: Sandbox, text: str, timeout: float = 20) -> list[str]:
    """Follow the unit's journal until a line containing ``text`` appears."""
    seen: list[str] = []

    async def follow() -> None:
        async with contextlib.aclosing(journal_follow(unit, lines=100, command_prefix=sb.command([]))) as lines:
            async for line in lines:
                seen.append(line)
                if text in line:
                    return

    await asyncio.wait_for(follow(), timeout)
    return seen


async def wait_for_state(client: SystemdClient, name: str, active_state: str,
                         timeout: float = 30) -> UnitState:
    async def watch() -> UnitState:
        async with contextlib.aclosing(client.watch(name)) as states:
            async for state in states:
                if state.active_state == active_state:
                    return state
        raise AssertionError(f"{name} was unloaded before it was {active_state}")

    return await asyncio.wait_for(watch(), timeout)


async def test_memory_max_reads_back_from_dbus_and_cgroup(sandbox: Sandbox) -> None:
    client = await connect(sandbox)
    try:
        unit = TransientUnit(name="capyctl-memmax.service", description="CapyCTL deployment memmax (rev 1, custom)",
                             argv=["/bin/sleep", "300"], memory_max=100 * MiB, tasks_max=64,
                             markers={"deployment": "memmax"})
        state = await client.start_transient(unit)
        assert state.active_state == "active"
        assert state.memory_max == 100 * MiB
        limit = client.cgroup_file(state, "memory", "memory.limit_in_bytes").read_text()
        assert int(limit) == 100 * MiB
        assert (await client.memory_current(unit.name) or 0) > 0
        show = sandbox.systemctl("show", unit.name, "-p", "MemoryMax,Slice,Restart").stdout
        assert "MemoryMax=104857600" in show and "Slice=capyctl.slice" in show and "Restart=no" in show

        final = await client.stop_unit(unit.name, timeout=10)
        assert final is None or final.active_state == "inactive"
        assert await client.unit_state(unit.name) is None  # a cleanly stopped transient unit is gone
        assert await client.stop_unit(unit.name, timeout=10) is None  # stopping it again is a no-op
        with pytest.raises(SystemdError) as gone:
            await client.memory_current(unit.name)
        assert gone.value.code == "unit_not_found"
    finally:
        await client.close()


async def test_oom_kill_is_out_of_memory_and_watch_sees_active_then_failed(sandbox: Sandbox) -> None:
    client = await connect(sandbox)
    name = "capyctl-hog.service"
    try:
        seen: list[UnitState] = []

        async def watch_until_failed() -> None:
            async with contextlib.aclosing(client.watch(name)) as states:
                async for state in states:
                    seen.append(state)
                    if state.active_state == "failed":
                        return

        watcher = asyncio.create_task(watch_until_failed())
        await asyncio.sleep(0.2)  # the watch registers its match before the unit exists
        hog = python_unit(name, """
            import time
            blocks = []
            while True:
                blocks.append(bytearray(8 << 20))
                print(f"allocated {len(blocks) * 8} MiB", flush=True)
                time.sleep(0.01)
            """, memory_max=64 * MiB)
        await client.start_transient(hog)
        await asyncio.wait_for(watcher, 60)

        states = [s.active_state for s in seen]
        assert "active" in states and states[-1] == "failed"
        assert states.index("active") < states.index("failed")
        # One entry per change: the watch yields on signals, it does not repeat a state.
        assert all(a != b for a, b in zip(seen, seen[1:]))

        failed = seen[-1]
        print(f"\nOOM on cgroup v1: Result={failed.result} ExecMainCode={failed.exec_main_code} "
              f"ExecMainStatus={failed.exec_main_status}")
        assert failure_reason(failed) == "out_of_memory"
        lines = await journal_tail(name, 20, command_prefix=sandbox.command([]))
        assert any(line.startswith("allocated ") for line in lines), lines
    finally:
        await client.close()


async def test_plain_exit_code_and_sigkill_without_limit_are_not_oom(sandbox: Sandbox) -> None:
    client = await connect(sandbox)
    try:
        await client.start_transient(python_unit("capyctl-exit3.service", "import sys; sys.exit(3)"))
        killed = python_unit("capyctl-killed.service", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
        await client.start_transient(killed)
        states = {}
        for name in ("capyctl-exit3.service", "capyctl-killed.service"):
            states[name] = await wait_for_state(client, name, "failed")
        assert failure_reason(states["capyctl-exit3.service"]) == "exit_code"
        assert states["capyctl-exit3.service"].exec_main_status == 3
        assert failure_reason(states["capyctl-killed.service"]) == "signal"
    finally:
        await client.close()


async def test_secret_from_environment_file_reaches_process_not_systemctl_show(sandbox: Sandbox) -> None:
    secret = "sk-capy-" + os.urandom(12).hex()
    # The sandbox's own /run (a tmpfs) as the host sees it: the unit reads the same file.
    secrets_dir = sandbox.root / "run" / "capyctl-secrets"
    secrets_dir.mkdir(mode=0o700)
    env_file = secrets_dir / "secret.env"
    env_file.write_text(f"CAPYCTL_ENGINE_KEY={secret}\n")
    env_file.chmod(0o600)
    name = "capyctl-secret.service"
    unit = TransientUnit(
        name=name, description="CapyCTL deployment secret (rev 1, custom)",
        argv=["/bin/sh", "-c", 'echo "argv=$1"; echo "env=$CAPYCTL_ENGINE_KEY"; exec sleep 300',
              "sh", "${CAPYCTL_ENGINE_KEY}"],
        environment={"CAPYCTL_PUBLIC": "visible"},
        environment_file="/run/capyctl-secrets/secret.env")
    client = await connect(sandbox)
    try:
        await client.start_transient(unit)
        lines = await wait_for_line(name, sandbox, "env=")
        assert f"argv={secret}" in lines and f"env={secret}" in lines
        shown = sandbox.systemctl("show", name).stdout
        assert "CAPYCTL_PUBLIC=visible" in shown  # the check below would catch a leak
        assert secret not in shown
        # --lines=0: status would otherwise quote the journal, where this test echoed the key.
        assert secret not in sandbox.systemctl("status", "--lines=0", name).stdout
        await client.stop_unit(name, timeout=10)
    finally:
        await client.close()


async def test_list_units_finds_units_with_markers(sandbox: Sandbox) -> None:
    client = await connect(sandbox)
    try:
        for deployment, revision in (("alpha", "1"), ("beta", "7")):
            await client.start_transient(TransientUnit(
                name=f"capyctl-{deployment}.service",
                description=f"CapyCTL deployment {deployment} (rev {revision}, custom)",
                argv=["/bin/sleep", "300"],
                markers={"deployment": deployment, "revision": revision, "launch_id": f"L-{deployment}"}))
        # A unit of someone else that the pattern must leave out.
        sandbox.run(["systemd-run", "--unit=other-thing.service", "/bin/sleep", "300"], check=True)

        units = await client.list_units()
        assert [u.name for u in units] == ["capyctl-alpha.service", "capyctl-beta.service"]
        beta = units[1]
        assert beta.markers == {"deployment": "beta", "revision": "7", "launch_id": "L-beta"}
        assert beta.description == "CapyCTL deployment beta (rev 7, custom)"
        assert beta.control_group == "/capyctl.slice/capyctl-beta.service"
        assert beta.main_pid > 0
        # systemd names the unit of any process (GetUnitByPID), and of none for one that is gone.
        assert await client.unit_of_pid(beta.main_pid) == "capyctl-beta.service"
        assert await client.unit_of_pid(1) == "init.scope"
        assert await client.unit_of_pid(2**22 + 1) is None  # above the kernel's pid_max
    finally:
        await client.close()


async def test_set_description_changes_a_running_units_description(sandbox: Sandbox) -> None:
    """SetUnitProperties(Description) on a live transient unit: systemctl show and list-units read
    the new text, the unit keeps running; the setting leaves with the unit; no unit, unit_not_found."""
    client = await connect(sandbox)
    name = "capyctl-described.service"
    try:
        started = await client.start_transient(TransientUnit(
            name=name, description="CapyCTL deployment described (rev 1, custom)", argv=["/bin/sleep", "300"]))
        text = "CapyCTL deployment described (rev 1, custom): parked, 100% armed"  # % is no specifier here
        await client.set_description(name, text)

        assert sandbox.systemctl("show", name, "-p", "Description").stdout.strip() == f"Description={text}"
        listed = sandbox.systemctl("list-units", "--all", "--plain", "--no-legend", "--full", name).stdout
        assert text in listed and name in listed, listed
        state = await client.unit_state(name)
        assert state is not None and state.description == text
        assert state.active_state == "active" and state.main_pid == started.main_pid  # not restarted

        # Of a transient unit the drop-in goes with it: the next unit of that name has its own text.
        await client.stop_unit(name, timeout=10)
        await client.start_transient(TransientUnit(
            name=name, description="CapyCTL deployment described (rev 2, custom)", argv=["/bin/sleep", "300"]))
        assert sandbox.systemctl("show", name, "-p", "Description").stdout.strip() == \
            "Description=CapyCTL deployment described (rev 2, custom)"

        with pytest.raises(SystemdError) as missing:
            await client.set_description("capyctl-nosuchunit.service", "nothing")
        assert missing.value.code == "unit_not_found", missing.value.detail
        await client.stop_unit(name, timeout=10)
    finally:
        await client.close()


async def test_start_refuses_running_unit_and_resets_failed_leftover(sandbox: Sandbox) -> None:
    client = await connect(sandbox)
    name = "capyctl-again.service"
    try:
        await client.start_transient(TransientUnit(name=name, description="d", argv=["/bin/sleep", "300"]))
        with pytest.raises(SystemdError) as refused:
            await client.start_transient(TransientUnit(name=name, description="d", argv=["/bin/sleep", "300"]))
        assert refused.value.code == "unit_exists"

        sandbox.systemctl("kill", "--signal=SIGKILL", name)
        await wait_for_state(client, name, "failed")
        again = await client.start_transient(TransientUnit(name=name, description="d", argv=["/bin/sleep", "300"]))
        assert again.active_state == "active"

        with pytest.raises(SystemdError) as missing:
            await client.start_transient(TransientUnit(name="capyctl-nobinary.service", description="d",
                                                       argv=["/nonexistent/engine"]))
        assert missing.value.code == "start_failed"
    finally:
        await client.close()


async def test_stop_unit_escalates_to_sigkill(sandbox: Sandbox) -> None:
    client = await connect(sandbox)
    name = "capyctl-stubborn.service"
    try:
        await client.start_transient(TransientUnit(
            name=name, description="ignores SIGTERM", stop_timeout=120,
            argv=["/bin/sh", "-c", "trap 'echo ignoring TERM' TERM; echo ready; while :; do sleep 0.1; done"]))
        await wait_for_line(name, sandbox, "ready")
        loop = asyncio.get_running_loop()
        began = loop.time()
        await client.stop_unit(name, timeout=1.0)
        # Not a speed check: without the SIGKILL, systemd would wait TimeoutStopSec=120.
        assert loop.time() - began < 60
        state = await client.unit_state(name)
        assert state is None or not state.is_running
    finally:
        await client.close()


CREATOR = """
import asyncio, sys
from capyctl.systemd import SystemdClient, TransientUnit

async def main():
    client = await SystemdClient.connect()  # the sandbox's own system bus
    await client.start_transient(TransientUnit(
        name="capyctl-survivor.service", description="CapyCTL deployment survivor (rev 2, custom)",
        argv=["/bin/sleep", "300"], markers={"deployment": "survivor", "revision": "2"}))
    print("started", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_unit_survives_sigkill_of_its_creator(sandbox: Sandbox) -> None:
    creator = sandbox.popen([PYTHON, "-c", CREATOR], cwd=str(Path(__file__).resolve().parents[2]),
                            stdout=__import__("subprocess").PIPE, text=True)
    try:
        assert creator.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(creator.stdout.readline), 30)
        assert line.strip() == "started"
        creator_pid = Sandbox.command_pid(creator)
        os.kill(creator_pid, signal.SIGKILL)  # the daemon dies hard
        await asyncio.wait_for(asyncio.to_thread(creator.wait), 10)
        assert not Path(f"/proc/{creator_pid}").exists()

        client = await connect(sandbox)  # a new daemon adopts what it finds
        try:
            [unit] = await client.list_units()
            assert unit.name == "capyctl-survivor.service"
            assert unit.active_state == "active"
            assert unit.markers == {"deployment": "survivor", "revision": "2"}
            await client.stop_unit(unit.name, timeout=10)
        finally:
            await client.close()
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait()


async def test_two_sandboxes_have_separate_managers(sandbox_factory) -> None:
    first, second = sandbox_factory(), sandbox_factory()
    assert first.pid != second.pid
    one, two = await connect(first), await connect(second)
    try:
        name = "capyctl-twin.service"
        await one.start_transient(TransientUnit(name=name, description="d", argv=["/bin/sleep", "300"],
                                                markers={"deployment": "one"}))
        await two.start_transient(TransientUnit(name=name, description="d", argv=["/bin/sleep", "300"],
                                                markers={"deployment": "two"}))
        assert (await one.unit_state(name)).markers == {"deployment": "one"}  # type: ignore[union-attr]
        assert (await two.unit_state(name)).markers == {"deployment": "two"}  # type: ignore[union-attr]
        await one.stop_unit(name, timeout=10)
        assert await one.unit_state(name) is None
        assert (await two.unit_state(name)).active_state == "active"  # type: ignore[union-attr]
    finally:
        await one.close()
        await two.close()


async def test_engine_unit_hardening_exposure(sandbox: Sandbox) -> None:
    client = await connect(sandbox)
    name = "capyctl-hardened.service"
    try:
        await client.start_transient(TransientUnit(
            name=name, description="CapyCTL deployment hardened (rev 1, custom)",
            argv=[PYTHON, "-c", "import time; print('up', flush=True); time.sleep(300)"],
            memory_max=256 * MiB, cpu_quota=1.0, tasks_max=256))
        # The hardening must not stop a real Python process from running.
        await wait_for_line(name, sandbox, "up")
        exposure, verdict = await security_exposure(name, command_prefix=sandbox.command([]))
        print(f"\nsystemd-analyze security {name}: {exposure} {verdict}")
        assert exposure < 3.0, verdict
    finally:
        await client.close()


GATE_CHECK = r'''
import asyncio, json, sys, time
from pathlib import Path
from capyctl.systemd import SystemdClient, TransientUnit

def proc(pid):
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return stat, Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()

async def main():
    client = await SystemdClient.connect()  # as the daemon does: this systemd's own pid namespace
    seen = {}
    gated = TransientUnit(name="capyctl-gated.service", description="gated", argv=["/bin/sleep", "300"], gated=True)
    state = await client.start_transient(gated)
    seen["opened"] = await client.open_gate(gated.name)  # may settle: the shell stops itself after exec
    for _ in range(1000):  # until its command sleeps (a hang guard of 10 s, not a bound)
        after = await client.unit_state(gated.name)
        if proc(after.main_pid) == ("S", "/bin/sleep"):
            break
        await asyncio.sleep(0.01)
    seen["after"] = [after.main_pid == state.main_pid, *proc(after.main_pid)]
    seen["again"] = await client.open_gate(gated.name)  # its command runs now: no gate to open
    plain = TransientUnit(name="capyctl-plain.service", description="plain", argv=["/bin/sleep", "300"])
    await client.start_transient(plain)
    seen["plain"] = await client.open_gate(plain.name)
    # A stop timeout of an hour: a stop that waited for it would not end within the hang guard.
    waiting = TransientUnit(name="capyctl-waiting.service", description="waiting", argv=["/bin/sleep", "300"],
                            gated=True, stop_timeout=3600)
    state = await client.start_transient(waiting)
    for _ in range(1000):  # a hang guard of 10 s, not a bound
        if proc(state.main_pid)[0] == "T":
            break
        await asyncio.sleep(0.01)
    seen["waiting"] = list(proc(state.main_pid))
    began = time.monotonic()
    try:
        final = await asyncio.wait_for(client.stop_unit(waiting.name, timeout=3600), 60)
    except asyncio.TimeoutError:
        seen["stopped"] = "still stopping after the 60 s hang guard"
    else:
        seen["stopped"] = final.active_state if final else "gone"
    seen["stop_s"] = time.monotonic() - began  # (printed: the assert is on how it ended)
    for unit in (gated, plain):
        await client.stop_unit(unit.name, timeout=10)
    print(json.dumps(seen))

asyncio.run(main())
'''


async def test_a_gated_unit_waits_stopped_until_its_gate_is_opened(sandbox: Sandbox) -> None:
    """TransientUnit(gated=True): the sandboxed shell stops itself before its command; open_gate
    continues it (the same pid becomes the command); a unit not at a gate is left alone; a stop
    while it waits ends it at once, not after the stop timeout (SIGTERM, then SIGCONT)."""
    import json
    out = sandbox.run([PYTHON, "-c", GATE_CHECK], check=True, cwd=str(Path(__file__).resolve().parents[2]))
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["opened"] is True
    assert seen["after"] == [True, "S", "/bin/sleep"]
    assert seen["again"] is False and seen["plain"] is False
    assert seen["waiting"] == ["T", "/bin/sh"]
    assert seen["stopped"] in ("inactive", "gone"), seen


async def test_open_gate_refuses_where_the_units_pids_are_not_ours(sandbox: Sandbox) -> None:
    """A client outside that systemd's pid namespace (fs_root elsewhere) must not signal a pid it
    would read in its own namespace: it answers False and the unit keeps waiting."""
    client = await connect(sandbox)
    try:
        unit = TransientUnit(name="capyctl-far.service", description="far", argv=["/bin/sleep", "300"], gated=True)
        await client.start_transient(unit)
        assert await client.open_gate(unit.name) is False
        state = await client.unit_state(unit.name)
        assert state is not None and state.active_state == "active"
        await client.stop_unit(unit.name, timeout=10)
    finally:
        await client.close()
