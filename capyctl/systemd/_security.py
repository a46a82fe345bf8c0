"""systemd-analyze security: how exposed a unit is, as one number (0 safe .. 10 exposed)."""

from __future__ import annotations

import asyncio
import re
from typing import Sequence

from capyctl.errors import SystemdError

_OVERALL = re.compile(r"Overall exposure level for (\S+):\s*([0-9.]+)\s+(\S+)")


def parse_exposure(output: str) -> tuple[float, str]:
    """'→ Overall exposure level for x.service: 4.2 OK 🙂' -> (4.2, 'OK')."""
    match = _OVERALL.search(output)
    if match is None:
        raise SystemdError("systemd-analyze printed no overall exposure level.", code="analyze_failed")
    return float(match.group(2)), match.group(3)


async def security_exposure(unit: str, *, command_prefix: Sequence[str] = ()) -> tuple[float, str]:
    """Run ``systemd-analyze security UNIT`` (optionally through ``command_prefix``)."""
    argv = [*command_prefix, "systemd-analyze", "security", "--no-pager", unit]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise SystemdError(f"systemd-analyze security {unit} failed: "
                           f"{err.decode(errors='replace').strip()}", code="analyze_failed")
    return parse_exposure(out.decode(errors="replace"))
