"""Packaging, really run: build the .deb, install it with apt inside a sandbox that boots its own
systemd (in a network namespace of its own, so port 8000 is free), let a request start the daemon
by socket activation, use the CLI and its bash completion, purge the package, and check that
nothing is left. Also install.sh (install, run again, uninstall) and the .rpm build.

The sandbox has private /run and /tmp but shares the host's other files, so what apt and
install.sh install lands on this machine's /opt, /usr and /lib; every test removes it again.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.components import missing, require_root
from tests.locks import LOCK, locked_versions

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]
SANDBOX = REPO / "tests" / "sandbox" / "capy-sandbox"
WHEELHOUSE = Path(os.environ.get("CAPYCTL_WHEELHOUSE", "/var/cache/capyctl-build/wheels"))
# Visible inside the sandbox too (its /tmp is private).
SCRATCH_ROOT = Path("/var/tmp")
CLEAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
             "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
UNIT_FILES = ("capyctl.service", "capyctl.socket", "capyctl-api.socket", "capyctl.slice")
WHAT_PACKAGES_INSTALL = ("/opt/capyctl", "/usr/bin/capyctl", "/usr/share/bash-completion/completions/capyctl",
                         "/usr/share/doc/capyctl", "/usr/lib/sysusers.d/capyctl.conf",
                         "/usr/lib/tmpfiles.d/capyctl.conf", "/etc/sysusers.d/capyctl.conf",
                         "/etc/tmpfiles.d/capyctl.conf",
                         *(f"{d}/{u}" for d in ("/lib/systemd/system", "/usr/lib/systemd/system",
                                                "/etc/systemd/system") for u in UNIT_FILES),
                         "/etc/systemd/system/sockets.target.wants/capyctl.socket",
                         "/etc/systemd/system/sockets.target.wants/capyctl-api.socket")


def _version() -> str:
    return subprocess.run([str(REPO / "packaging" / "version.sh")], check=True, capture_output=True,
                          text=True).stdout.strip()


def _run(argv: list[str], *, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def _leftovers() -> list[str]:
    return [p for p in WHAT_PACKAGES_INSTALL if os.path.lexists(p)]


def _require_debian_tools() -> None:
    require_root("to boot systemd in private namespaces and to install packages")
    if shutil.which("dpkg-deb") is None or shutil.which("apt-get") is None:
        missing("needs Debian's dpkg-deb and apt-get")


def _require_clean_machine() -> None:
    """No CapyCTL installed on this machine. The sandbox shares the host's /opt, /usr, /lib, /etc and
    /var/lib (only /run and /tmp are its own), so a test that installs there would overwrite one
    already installed and its purge would remove it: the test skips (fails under CI=true, whose
    machine must be clean) saying what to remove."""
    # "install ok installed", "deinstall ok config-files" ...; a purged package reads "unknown ok
    # not-installed" or nothing (dpkg-query exits 1): its last word is the state.
    status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", "capyctl"], capture_output=True,
                            text=True).stdout.split()
    package = bool(status) and status[-1] != "not-installed"
    found = _leftovers() + [p for p in ("/var/lib/capyctl",) if os.path.lexists(p)]
    if package or found:
        how = "apt-get remove --purge capyctl" if package else "install.sh --uninstall --purge"
        missing(f"CapyCTL is already installed on this machine ({'package' if package else 'files'}: "
                f"{', '.join(found) or 'capyctl'}); this test installs and purges its own and would remove "
                f"yours: remove it first ({how})")


class Sandbox:
    """A booted sandbox in its own network namespace."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.name = f"capypkg{tag}"
        self.netns = f"capypkg{tag}"
        self.booted = False

    def boot(self) -> "Sandbox":
        _run(["ip", "netns", "add", self.netns])
        _run(["ip", "-n", self.netns, "link", "set", "lo", "up"])
        _run([str(SANDBOX), "start", self.name, "--netns", self.netns], timeout=120)
        self.booted = True
        return self

    def sh(self, *argv: str, check: bool = True, timeout: float = 300, env: dict | None = None,
           **kw) -> subprocess.CompletedProcess:
        return _run([str(SANDBOX), "exec", self.name, "--", *argv], check=check, timeout=timeout,
                    env=env or CLEAN_ENV, **kw)

    def active_state(self, unit: str) -> str:
        return self.sh("systemctl", "show", "-P", "ActiveState", unit, check=False).stdout.strip()

    def journal(self, unit: str, lines: int = 60) -> str:
        return self.sh("journalctl", "-u", unit, "-n", str(lines), "--no-pager", check=False).stdout

    def http_get(self, url: str, timeout: float = 90) -> subprocess.CompletedProcess:
        # From inside the network namespace: the endpoint is the sandbox's 127.0.0.1.
        code = ("import sys, urllib.request\n"
                f"r = urllib.request.urlopen({url!r}, timeout={timeout})\n"
                "sys.stdout.write(str(r.status) + ' ' + r.read().decode())\n")
        return self.sh("/usr/bin/python3", "-c", code, check=False, timeout=timeout + 30)

    def teardown(self) -> None:
        if self.booted:
            subprocess.run([str(SANDBOX), "stop", self.name], capture_output=True, text=True, timeout=120)
            self.booted = False
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True, text=True)


@pytest.fixture
def clean_machine() -> None:
    """For a test that installs CapyCTL on this machine: asked before its sandbox boots."""
    _require_clean_machine()


@pytest.fixture
def sandbox():
    box = Sandbox()
    try:
        yield box.boot()
    finally:
        box.teardown()


@pytest.fixture(scope="module")
def scratch():
    path = Path(os.environ.get("CAPYCTL_TEST_SCRATCH") or SCRATCH_ROOT / f"capyctl-pkgtest-{secrets.token_hex(3)}")
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o755)  # apt reads the .deb as its unprivileged _apt user
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def deb(scratch: Path) -> Path:
    _require_debian_tools()  # building and reading the .deb installs nothing here
    out = _run([str(REPO / "packaging" / "deb" / "build.sh"), "--out", str(scratch / "deb"),
                "--wheelhouse", str(WHEELHOUSE)])
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.name == f"capyctl_{_version()}_amd64.deb" and path.is_file(), out.stdout
    path.chmod(0o644)
    return path


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _complete(box: Sandbox, line: str) -> list[str]:
    """Completions for LINE from a fresh bash that loads only the installed completion file, the
    way bash-completion's loader does on the first TAB (it sources
    /usr/share/bash-completion/completions/<command>)."""
    script = r'''
if [ -f /usr/share/bash-completion/bash_completion ]; then
    . /usr/share/bash-completion/bash_completion
    _completion_loader capyctl          # the lazy loader finds the file by the command's name
else
    . /usr/share/bash-completion/completions/capyctl
fi
complete -p capyctl >&2
COMP_LINE="$1"; COMP_POINT=${#COMP_LINE}
read -r -a COMP_WORDS <<< "$COMP_LINE"
[ "${COMP_LINE: -1}" = " " ] && COMP_WORDS+=("")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
COMP_TYPE=9
_python_argcomplete capyctl "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}"
'''
    out = box.sh("bash", "--norc", "--noprofile", "-c", script, "complete-test", line, timeout=60)
    assert "_python_argcomplete" in out.stderr and "capyctl" in out.stderr, out.stderr
    return [w.strip() for w in out.stdout.splitlines() if w.strip()]


def _environment_versions(box: Sandbox, python: str) -> dict[str, Version]:
    """Every distribution in the environment of PYTHON, but CapyCTL itself, as pip freeze --all lists them."""
    code = ("import importlib.metadata as m\n"
            "for d in m.distributions(): print(d.metadata['Name'], d.version)\n")
    found = {}
    for line in box.sh(python, "-c", code).stdout.splitlines():
        name, version = line.split()
        if canonicalize_name(name) != "capyctl":
            found[canonicalize_name(name)] = Version(version)
    return found


def _locked_for(box: Sandbox, python: str) -> dict[str, Version]:
    """What lock/ pins for the installed package's Python: its runtime.txt and build.txt."""
    minor = box.sh(python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])").stdout.strip()
    return locked_versions(LOCK / "build.txt", LOCK / f"py{minor}" / "runtime.txt")


def test_deb_installs_serves_completes_and_purges(clean_machine: None, deb: Path, sandbox: Sandbox) -> None:
    installed = False
    try:
        # No network: python3, systemd and adduser, the package's dependencies, are installed.
        out = sandbox.sh("apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=120",
                         str(deb), check=False)
        installed = True
        assert out.returncode == 0, f"apt-get install failed:\n{out.stdout}\n{out.stderr}"
        assert "ok installed" in sandbox.sh("dpkg-query", "-W", "-f=${Status}", "capyctl").stdout
        # The package's environment holds exactly the releases the lock pins for its Python.
        assert _environment_versions(sandbox, "/opt/capyctl/bin/python") == _locked_for(sandbox, "/usr/bin/python3")

        # postinst enabled and started the sockets, not the daemon.
        assert sandbox.sh("systemctl", "is-active", "capyctl.socket", check=False).stdout.strip() == "active", \
            sandbox.sh("systemctl", "status", "capyctl.socket", check=False).stdout
        assert sandbox.sh("systemctl", "is-enabled", "capyctl.socket", check=False).stdout.strip() == "enabled"
        assert sandbox.active_state("capyctl.service") == "inactive"

        # The first connection to 127.0.0.1:8000 starts capyctl.service, which answers it.
        reply = sandbox.http_get("http://127.0.0.1:8000/health")
        assert reply.returncode == 0 and reply.stdout.startswith("200 "), (
            f"GET /health through capyctl.socket failed:\n{reply.stdout}\n{reply.stderr}\n"
            f"--- journalctl -u capyctl.service ---\n{sandbox.journal('capyctl.service')}")
        _wait_for(lambda: sandbox.active_state("capyctl.service") == "active", 30, "capyctl.service to be active")
        # The daemon says it serves the socket systemd passed it, not one it bound itself.
        assert "serving OpenAI endpoint on systemd socket" in sandbox.journal("capyctl.service")

        # The CLI from the package, as a user would run it.
        help_out = sandbox.sh("capyctl", "--help")
        assert help_out.stdout.startswith("usage: capyctl")
        assert sandbox.sh("capyctl", "--version").stdout.strip() == f"capyctl {_version()}"
        # It reaches the daemon through the management socket capyctl-api.socket made.
        listed = sandbox.sh("capyctl", "list", "deployments", "--json", check=False)
        assert listed.returncode == 0, f"{listed.stdout}\n{listed.stderr}\n{sandbox.journal('capyctl.service')}"

        # Bash completion in a new shell.
        assert "list" in _complete(sandbox, "capyctl li")
        assert set(_complete(sandbox, "capyctl list ")) >= {"deployments", "engines", "keys"}
        # The argcomplete protocol itself, through the installed entry point (fd 8 carries the answer).
        protocol = sandbox.sh("bash", "-c", 'capyctl 8>&1 9>/dev/null >/dev/null 2>&1', env={
            **CLEAN_ENV, "_ARGCOMPLETE": "1", "COMP_LINE": "capyctl li", "COMP_POINT": "10",
            "_ARGCOMPLETE_IFS": "\n"})
        assert "list" in protocol.stdout.split()

        # Purge: stops the daemon and the sockets, removes every file and the state.
        out = sandbox.sh("apt-get", "remove", "--purge", "-y", "-o", "DPkg::Lock::Timeout=120", "capyctl",
                         check=False)
        assert out.returncode == 0, f"apt-get remove --purge failed:\n{out.stdout}\n{out.stderr}"
        installed = False
        status = sandbox.sh("dpkg-query", "-W", "-f=${Status}", "capyctl", check=False).stdout
        assert "installed" not in status.replace("not-installed", ""), status
        assert _leftovers() == []
        assert not os.path.exists("/var/lib/capyctl")
        for unit in ("capyctl.service", "capyctl.socket", "capyctl-api.socket"):
            assert sandbox.active_state(unit) in ("inactive", ""), unit
        assert "not-found" in sandbox.sh("systemctl", "show", "-P", "LoadState", "capyctl.socket").stdout
        refused = sandbox.http_get("http://127.0.0.1:8000/health", timeout=5)
        assert refused.returncode != 0 and "refused" in refused.stderr.lower(), refused
    finally:
        if installed:
            # A failed step left the package behind: purge it from the host side (no systemd
            # there, so the maintainer scripts skip systemctl) to leave the machine as it was.
            subprocess.run(["dpkg", "--purge", "capyctl"], capture_output=True, text=True)


def test_install_sh_installs_again_and_uninstalls(clean_machine: None, deb: Path, sandbox: Sandbox) -> None:
    # `deb` built the wheelhouse: install.sh installs offline from it, as documented.
    installer = [str(REPO / "install.sh"), "--wheelhouse", str(WHEELHOUSE)]
    try:
        first = sandbox.sh(*installer, timeout=600, check=False)
        assert first.returncode == 0, f"install.sh failed:\n{first.stdout}\n{first.stderr}"
        assert os.path.islink("/usr/bin/capyctl") and os.readlink("/usr/bin/capyctl") == "/opt/capyctl/bin/capyctl"
        for unit in ("capyctl.service", "capyctl.socket"):
            assert os.path.isfile(f"/etc/systemd/system/{unit}"), unit
        assert os.path.isfile("/usr/share/bash-completion/completions/capyctl")
        assert sandbox.sh("systemctl", "is-active", "capyctl.socket", check=False).stdout.strip() == "active"
        assert Path("/var/lib/capyctl").is_dir()

        # Idempotent: a second run upgrades in place and leaves the same result.
        second = sandbox.sh(*installer, timeout=600, check=False)
        assert second.returncode == 0, f"install.sh (second run) failed:\n{second.stdout}\n{second.stderr}"
        assert "upgrading the environment" in second.stderr
        assert sandbox.sh("capyctl", "--version").stdout.strip() == f"capyctl {_version()}"
        reply = sandbox.http_get("http://127.0.0.1:8000/health")
        assert reply.returncode == 0 and reply.stdout.startswith("200 "), (
            f"{reply.stdout}\n{reply.stderr}\n{sandbox.journal('capyctl.service')}")

        # Uninstall keeps the state unless --purge.
        marker = Path("/var/lib/capyctl/keep-me")
        marker.write_text("state\n")
        out = sandbox.sh(str(REPO / "install.sh"), "--uninstall", check=False)
        assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
        assert _leftovers() == []
        assert marker.exists()
        assert "not-found" in sandbox.sh("systemctl", "show", "-P", "LoadState", "capyctl.socket").stdout
        out = sandbox.sh(str(REPO / "install.sh"), "--uninstall", "--purge", check=False)
        assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
        assert not Path("/var/lib/capyctl").exists()
    finally:
        if _leftovers() or Path("/var/lib/capyctl").exists():
            subprocess.run([str(REPO / "install.sh"), "--uninstall", "--purge"], capture_output=True, text=True)


def test_deb_tree_is_relocated_to_its_final_paths(deb: Path, scratch: Path) -> None:
    tree = scratch / "extracted"
    _run(["dpkg-deb", "-x", str(deb), str(tree)])
    control = _run(["dpkg-deb", "-f", str(deb), "Depends"]).stdout
    assert "python3 (>= 3.11)" in control and "systemd" in control
    assert (tree / "opt/capyctl/bin/capyctl").read_text().splitlines()[0] == "#!/opt/capyctl/bin/python"
    assert os.readlink(tree / "usr/bin/capyctl") == "/opt/capyctl/bin/capyctl"
    for unit in ("capyctl.service", "capyctl.socket"):
        assert (tree / "lib/systemd/system" / unit).is_file()
    assert "/opt/capyctl/bin/capyctl" in (tree / "lib/systemd/system/capyctl.service").read_text()
    assert (tree / "usr/share/doc/capyctl/quickstart.md").is_file()
    # The dashboard's static files are package data: installed with the package, served at /ui/.
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        assert list(tree.glob(f"opt/capyctl/lib/python3*/site-packages/capyctl/api/ui/{name}")), name
    # Nothing in the package names the directory it was built in.
    # (build.sh stages into mktemp's /tmp/tmp.XXXXXXXXXX/root.)
    grep = subprocess.run(["grep", "-rlIE", r"/tmp/tmp\.[A-Za-z0-9]+/root", str(tree / "opt")],
                          capture_output=True, text=True)
    assert grep.stdout == "", grep.stdout
    # Byte-code names its final source path (tracebacks point at real files).
    code = ("import marshal, sys, glob\n"
            "pyc = glob.glob(sys.argv[1] + '/opt/capyctl/lib/python3*/site-packages/capyctl/__pycache__/"
            "__init__.cpython-*.pyc')[0]\n"
            "print(marshal.loads(open(pyc, 'rb').read()[16:]).co_filename)\n")
    filename = _run(["/usr/bin/python3", "-c", code, str(tree)]).stdout.strip()
    assert filename.startswith("/opt/capyctl/lib/python3") and filename.endswith("/capyctl/__init__.py")


def test_committed_bash_completion_is_what_argcomplete_generates() -> None:
    out = _run([sys.executable, str(REPO / "scripts" / "gen-docs"), "--print", "bash-completion"])
    assert (REPO / "packaging" / "bash-completion" / "capyctl").read_text() == out.stdout, \
        "packaging/bash-completion/capyctl is stale: run .venv/bin/python scripts/gen-docs"


def test_rpm_builds(scratch: Path) -> None:
    if shutil.which("rpmbuild") is None:
        missing("rpmbuild is not installed; apt-get install rpm")
    if os.geteuid() != 0 and not os.access(WHEELHOUSE.parent, os.W_OK):
        missing(f"needs root to write the wheel cache {WHEELHOUSE}")
    out = _run([str(REPO / "packaging" / "rpm" / "build.sh"), "--out", str(scratch / "rpm"),
                "--wheelhouse", str(WHEELHOUSE)])
    rpm = Path(out.stdout.strip().splitlines()[-1])
    assert rpm.name == f"capyctl-{_version()}-1.x86_64.rpm" and rpm.is_file()
    files = _run(["rpm", "-qpl", str(rpm)]).stdout.splitlines()
    for expected in ("/opt/capyctl/bin/capyctl", "/usr/bin/capyctl", "/usr/lib/systemd/system/capyctl.service",
                     "/usr/lib/systemd/system/capyctl.socket", "/usr/share/bash-completion/completions/capyctl"):
        assert expected in files, expected
    requires = _run(["rpm", "-qp", "--requires", str(rpm)]).stdout
    assert "python3 >= 3.11" in requires and "systemd" in requires
