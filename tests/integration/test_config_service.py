"""The packaged service driven by a configuration file, in a booted systemd sandbox.

units/capyctl.service runs the real daemon (this checkout's venv in place of /opt/capyctl, as
install.sh substitutes its prefix), socket-activated, reading its settings from the file
CAPYCTL_CONFIG names. ``systemctl reload`` applies a changed file live and logs what needs a
restart; a broken file fails the reload, naming file, field and line, and the daemon keeps
running with its old settings, also when SIGHUP reaches it directly.
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.sandbox.sandbox import Sandbox

pytestmark = pytest.mark.sandbox

UNITS = Path(__file__).resolve().parents[2] / "units"
CAPYCTL = Path(sys.executable).parent / "capyctl"
API_SOCKET = "/run/capyctl/api.sock"


def install_service(sb: Sandbox, root: Path, config: Path) -> None:
    """The packaged units with two changes only: the venv's capyctl for /opt/capyctl's, and a
    drop-in for what the sandbox shares with the host (its /etc/group and /var: no capyctl
    group, no /var/lib/capyctl) plus where the configuration file is."""
    target = sb.root / "run/systemd/system"
    for unit in ("capyctl.service", "capyctl.socket", "capyctl-api.socket", "capyctl.slice"):
        text = (UNITS / unit).read_text().replace("/opt/capyctl/bin/capyctl", str(CAPYCTL))
        (target / unit).write_text(text)
    (target / "capyctl.service.d").mkdir()
    (target / "capyctl.service.d" / "test.conf").write_text(
        "[Service]\nGroup=root\nStateDirectory=\n"
        f"ReadWritePaths={root}\n"
        f"Environment=CAPYCTL_STATE_DIR={root / 'state'} CAPYCTL_CONFIG={config}\n")
    (target / "capyctl-api.socket.d").mkdir()
    (target / "capyctl-api.socket.d" / "test.conf").write_text("[Socket]\nSocketGroup=root\n")
    sb.run(["systemctl", "daemon-reload"], check=True)


def cli(sb: Sandbox, *argv: str):
    return sb.run([str(CAPYCTL), "--api-socket", API_SOCKET, *argv])


def local_host(sb: Sandbox) -> dict:
    out = cli(sb, "inspect", "host", "local", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def journal(sb: Sandbox) -> str:
    return sb.run(["journalctl", "-u", "capyctl.service", "--no-pager", "-n", "200"]).stdout


def wait_for(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_config_file_drives_the_packaged_service_and_reload(sandbox_factory, netns: str) -> None:
    root = Path(f"/var/lib/capyctl-tests/config-{secrets.token_hex(3)}")
    root.mkdir(parents=True)
    try:
        config = root / "config.yaml"
        config.write_text("log_level: info\nqueue:\n  total: 11\nhosts:\n  local:\n    dev_controls: false\n")
        sb = sandbox_factory(netns=netns)
        install_service(sb, root, config)
        sb.run(["systemctl", "start", "capyctl.socket", "capyctl-api.socket"], check=True)
        started = sb.run(["systemctl", "start", "capyctl.service"])
        assert started.returncode == 0, f"{started.stderr}\n{journal(sb)}"
        pid = sb.systemctl("show", "-P", "MainPID", "capyctl.service").stdout.strip()
        assert local_host(sb)["dev_controls"] is False, journal(sb)

        # A valid change: applied live, and the journal says what needs a restart.
        config.write_text("listen: 127.0.0.1:8123\nlog_level: debug\nqueue:\n  total: 5\n"
                          "hosts:\n  local:\n    dev_controls: true\n")
        reload = sb.run(["systemctl", "reload", "capyctl.service"])
        assert reload.returncode == 0, f"{reload.stderr}\n{journal(sb)}"
        wait_for(lambda: local_host(sb)["dev_controls"] is True, "the reload to apply dev_controls")
        wait_for(lambda: "listen changed" in journal(sb), "the journal to name what needs a restart")

        # A broken file: the reload fails naming file, field and line; nothing stops.
        config.write_text("queue:\n  total: 5\nhosts:\n  local:\n    dev_control: false\n")
        reload = sb.run(["systemctl", "reload", "capyctl.service"])
        assert reload.returncode != 0
        problem = f"{config}:5: hosts.local.dev_control: is not a known field"
        wait_for(lambda: problem in journal(sb), "the reload's error in the journal")
        # SIGHUP straight to the daemon (kill -HUP, no ExecReload check): refused by the daemon itself.
        sb.run(["systemctl", "kill", "--signal=HUP", "--kill-who=main", "capyctl.service"], check=True)
        wait_for(lambda: "reload refused, keeping the running configuration" in journal(sb),
                 "the daemon to refuse the broken file")
        assert sb.systemctl("is-active", "capyctl.service").stdout.strip() == "active"
        assert sb.systemctl("show", "-P", "MainPID", "capyctl.service").stdout.strip() == pid
        assert local_host(sb)["dev_controls"] is True  # the settings from before the broken file

        validate = sb.run([str(CAPYCTL), "validate", "config", str(config)])
        assert validate.returncode == 2 and problem in validate.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)
