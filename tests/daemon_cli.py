"""The ``capyctl`` CLI as the tests drive a daemon under test: through the daemon's API socket,
with the daemon's journal in the failure a test shows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CAPYCTL = Path(sys.executable).parent / "capyctl"  # the test venv's, as scripts/test installs it
SERVICE_UNIT = Path(__file__).resolve().parents[1] / "units" / "capyctl.service"


def limit_nofile_property() -> str:
    """``--property=LimitNOFILE=N`` with units/capyctl.service's N, for a daemon a test starts with
    systemd-run: without it the daemon has the soft default and raises it to the sandbox's hard limit
    (capyctl/descriptors.py), not the descriptor limit the installed daemon runs with."""
    line = next(line for line in SERVICE_UNIT.read_text().splitlines() if line.startswith("LimitNOFILE="))
    return f"--property={line.strip()}"


class DaemonCli:
    """``cli`` and ``cli_json`` for a class that has the daemon's ``api_socket`` and a
    ``daemon_journal()``."""

    api_socket: Path

    def daemon_journal(self) -> str:
        raise NotImplementedError

    def cli(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        out = subprocess.run([str(CAPYCTL), "--api-socket", str(self.api_socket), *args], capture_output=True,
                             text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"capyctl {' '.join(args)} exited {out.returncode}:\n{out.stderr}\n"
                                 f"--- daemon journal ---\n{self.daemon_journal()}")
        return out

    def cli_json(self, *args: str):
        return json.loads(self.cli(*args, "--json").stdout)
