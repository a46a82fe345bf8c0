"""Reading a unit's journal with journalctl.

``command_prefix`` runs journalctl elsewhere: nsenter into a test sandbox, or ssh to
a remote host. ``journal_dir`` reads journal files directly (e.g. a sandbox's
``/proc/<pid>/root/run/log/journal``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import AsyncIterator, Sequence

from capyctl.errors import SystemdError


def _journalctl(unit: str, extra: list[str], command_prefix: Sequence[str],
                journal_dir: str | None) -> list[str]:
    argv = [*command_prefix, "journalctl", "--no-pager", "--output=cat", f"--unit={unit}"]
    if journal_dir:
        argv.append(f"--directory={journal_dir}")
    return argv + extra


async def journal_tail(unit: str, lines: int = 50, *, command_prefix: Sequence[str] = (),
                       journal_dir: str | None = None) -> list[str]:
    """The last ``lines`` lines the unit logged (its stdout and stderr included)."""
    argv = _journalctl(unit, [f"--lines={lines}"], command_prefix, journal_dir)
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        raise SystemdError(f"Cannot run journalctl: {exc}", code="journal_unavailable") from exc
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise SystemdError(f"journalctl failed: {err.decode(errors='replace').strip()}",
                           code="journal_unavailable")
    return out.decode(errors="replace").splitlines()


async def journal_follow(unit: str, *, lines: int = 0, command_prefix: Sequence[str] = (),
                         journal_dir: str | None = None) -> AsyncIterator[str]:
    """Yield the unit's new journal lines as they are written (after the last ``lines``)."""
    argv = _journalctl(unit, [f"--lines={lines}", "--follow"], command_prefix, journal_dir)
    try:
        # Own process group: a command_prefix such as nsenter or ssh does not pass our
        # SIGTERM on, so the group is signalled to stop journalctl behind it too.
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.DEVNULL,
                                                    start_new_session=True)
    except OSError as exc:
        raise SystemdError(f"Cannot run journalctl: {exc}", code="journal_unavailable") from exc
    assert proc.stdout is not None
    try:
        while True:
            line = await proc.stdout.readline()
            if not line:
                return
            yield line.decode(errors="replace").rstrip("\n")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(Exception):
            # communicate() drains the pipe, so its transport is closed with the process.
            await asyncio.wait_for(proc.communicate(), 5)
