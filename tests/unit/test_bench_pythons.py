"""proxy_hop.py's and proxy_vs_nginx.py's --other-python (issue 57): the CapyCTL proxy and aiohttp's
bare relay measured under another interpreter as well, each such interpreter known by its
major.minor, refused where it cannot run them or where two would bear the same name."""

from __future__ import annotations

import platform
import stat
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.benchmarks import load_benchmark

REPO = Path(__file__).resolve().parents[2]
proxy_vs_nginx = load_benchmark("proxy_vs_nginx")
proxy_hop = load_benchmark("proxy_hop")


def _interpreter(folder: Path, name: str, body: str) -> str:
    """A stand-in for an interpreter: a shell script that answers the probe with ``body``."""
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize("benchmark", [proxy_hop, proxy_vs_nginx], ids=["proxy_hop", "proxy_vs_nginx"])
def test_other_python_is_repeatable_and_empty_by_default(benchmark):
    parser = benchmark.arguments()
    assert parser.parse_args([]).other_python == []
    args = parser.parse_args(["--other-python", "/a/python", "--json", "x.json", "--other-python", "/b/python"])
    assert args.other_python == ["/a/python", "/b/python"]


def test_each_other_python_is_known_by_its_minor_version(tmp_path):
    args = tmp_path / "args"
    fake = _interpreter(tmp_path, "python3.13", f'printf "%s\\n" "$@" > {args}\necho "3.13.2 3.14.5"')
    assert proxy_vs_nginx.other_pythons([fake], own="3.11.7") == {
        "3.13": {"executable": fake, "version": "3.13.2", "aiohttp": "3.14.5"}}
    # The probe imports the two scripts the interpreter is to run, from this checkout's benchmarks/.
    assert args.read_text().splitlines() == ["-c", proxy_vs_nginx.PROBE, str(REPO / "benchmarks")]
    assert proxy_vs_nginx.other_pythons([], own="3.11.7") == {}


def test_the_probe_runs_on_a_real_interpreter_with_the_proxys_imports():
    found = proxy_vs_nginx.other_pythons([sys.executable], own="2.7.18")
    version = platform.python_version()
    assert found == {".".join(version.split(".")[:2]): {"executable": sys.executable, "version": version,
                                                        "aiohttp": aiohttp.__version__}}


def test_an_other_python_of_the_benchmarks_own_minor_or_twice_the_same_is_refused(tmp_path):
    same = _interpreter(tmp_path, "same", 'echo "3.11.9 3.14.5"')
    with pytest.raises(SystemExit, match=r"is Python 3\.11\.9, the minor version running this benchmark \(3\.11\.7\)"):
        proxy_vs_nginx.other_pythons([same], own="3.11.7")
    first, second = (_interpreter(tmp_path, f"py{n}", f'echo "3.13.{n} 3.14.5"') for n in (0, 1))
    with pytest.raises(SystemExit, match=rf"{second} is Python 3\.13\.1, as --other-python {first} is"):
        proxy_vs_nginx.other_pythons([first, second], own="3.11.7")


def test_an_other_python_that_cannot_run_the_proxy_is_refused_with_why(tmp_path):
    bare = _interpreter(tmp_path, "bare", "echo \"ModuleNotFoundError: No module named 'aiohttp'\" >&2\nexit 1")
    with pytest.raises(SystemExit, match="cannot run the proxy there: ModuleNotFoundError: No module named 'aiohttp'"):
        proxy_vs_nginx.other_pythons([bare], own="3.11.7")
    mute = _interpreter(tmp_path, "mute", "exit 3")
    with pytest.raises(SystemExit, match="cannot run the proxy there: exit status 3"):
        proxy_vs_nginx.other_pythons([mute], own="3.11.7")
    with pytest.raises(SystemExit, match=f"--other-python {tmp_path}/absent: "):
        proxy_vs_nginx.other_pythons([str(tmp_path / "absent")], own="3.11.7")


def test_the_relay_runs_under_the_python_it_is_given():
    command = proxy_vs_nginx.relay_command("/v/bin/python", "http://127.0.0.1:9", "launch", 8123)
    assert command == ["/v/bin/python", str(REPO / "benchmarks" / "_aiohttp_relay.py"), "--upstream",
                       "http://127.0.0.1:9", "--launch-key", "launch", "--port", "8123"]
