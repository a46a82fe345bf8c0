"""The gate of an armed unit: a launch started ahead of need, held just before its command.

An *armed* unit is an engine's next launch that systemd has already started and that waits at
its gate: systemd has built the whole sandbox (namespaces, mounts, credentials, seccomp: most of
a start's time, see benchmarks/wake_vs_manual.py and docs/benchmarks.md) and exec'd the gate
shell, which stopped itself before it execs the engine. Why: an engine that parks by stopping
gets the next launch's unit started at once at the park, held at its gate, so the wake that
follows only continues that shell (open_gate) instead of starting a unit on the request's path.

The shell (GATE_SCRIPT, with $0 GATE_NAME) is the unit's ExecStart when TransientUnit.gated is
set (capyctl/systemd/_units.py); SystemdClient.open_gate finds the unit's main pid over D-Bus and
continues it here. Pure /proc and pidfd work, no bus.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

# ``kill`` is the shell's builtin and $$ its own pid, the unit's main pid, which the command
# keeps (exec), so Type=exec, signals and the unit's stop reach the engine as they would
# without the gate. A stop while it waits: systemd sends SIGTERM, then SIGCONT (systemd.kill(5)),
# so the pending SIGTERM ends the shell before it execs anything.
GATE_SCRIPT = 'kill -STOP $$ && exec "$@"'
GATE_NAME = "capyctl-gate"  # the shell's $0: what open_gate checks the stopped process is


async def open_gate(main_pid: int, control_group: str, settle: float) -> bool:
    """Send SIGCONT to ``main_pid`` when it is the gate shell of the unit whose cgroup is
    ``control_group``, stopped at its gate; True once sent, False when it is not waiting there
    (no such process, not a gate shell of that unit, or its command already running).

    The process is pinned with a pidfd and checked to be the unit's own gate shell (its cgroup
    and its $0) before the signal, so a reused pid is never signalled. A shell exec'd a moment
    ago may not have stopped itself yet: it gets ``settle`` seconds to. The pid is one of this
    machine's pid namespace: the caller makes sure the unit's systemd is this one.
    """
    if not main_pid or not control_group:
        return False
    try:
        pidfd = os.pidfd_open(main_pid)
    except OSError:
        return False
    try:
        proc = Path(f"/proc/{main_pid}")
        try:
            cgroup = (proc / "cgroup").read_text()
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        at_gate = len(argv) > 3 and argv[3] == GATE_NAME.encode() and argv[2] == GATE_SCRIPT.encode()
        if not at_gate or not any(line.endswith(":" + control_group) for line in cgroup.splitlines()):
            return False
        deadline = time.monotonic() + settle
        while True:  # the gate shell from its exec (systemd's) until its kill -STOP
            try:
                run_state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return False
            if run_state == "T":
                break
            if run_state not in ("R", "S", "D") or time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.002)
        signal.pidfd_send_signal(pidfd, signal.SIGCONT)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)
