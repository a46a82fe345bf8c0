"""install.sh --uninstall on a tree where no systemd runs (its --root, as a rescue shell or a
container sees a machine): it removes the links `systemctl enable` made too."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_uninstall_without_a_running_systemd_removes_the_socket_links(tmp_path: Path) -> None:
    wants = tmp_path / "etc/systemd/system/sockets.target.wants"
    wants.mkdir(parents=True)
    for socket in ("capyctl.socket", "capyctl-api.socket"):
        (tmp_path / "etc/systemd/system" / socket).write_text("[Socket]\n")
        os.symlink(f"/etc/systemd/system/{socket}", wants / socket)
    (wants / "other.socket").symlink_to("/etc/systemd/system/other.socket")  # not ours: stays
    out = subprocess.run([str(REPO / "install.sh"), "--uninstall", "--root", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in wants.iterdir()) == ["other.socket"]
    assert not (tmp_path / "etc/systemd/system/capyctl.socket").exists()
