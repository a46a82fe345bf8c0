"""The committed lock files (lock/, written by scripts/lock), as the tests read them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = Path(__file__).resolve().parents[1] / "lock"


@dataclass
class Pin:
    version: Version
    hashes: int = 0
    via: list[str] = field(default_factory=list)


def read_lock(path: Path) -> dict[str, Pin]:
    """uv's requirements format: `name==version \\`, `--hash=sha256:...` lines, `# via` lines."""
    pins: dict[str, Pin] = {}
    current: Pin | None = None
    in_via = False
    for line in path.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
            current = pins[canonicalize_name(m[1])] = Pin(Version(m[2]))
            in_via = False
        elif current is None:
            continue
        elif line.strip().startswith("--hash=sha256:"):
            current.hashes += 1
        elif m := re.match(r"^\s+# via(?: (.+))?$", line):
            in_via = m[1] is None
            if m[1]:
                current.via.append(m[1])
        elif in_via and (m := re.match(r"^\s+#\s{3}(.+)$", line)):
            current.via.append(m[1])
        else:
            in_via = False
    return pins


def locked_versions(*paths: Path) -> dict[str, Version]:
    """Name to version over several lock files (a later file's pin wins)."""
    return {name: pin.version for path in paths for name, pin in read_lock(path).items()}
