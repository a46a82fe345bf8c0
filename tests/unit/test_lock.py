"""The committed lock (lock/, written by scripts/lock) against pyproject.toml and this venv.

pyproject.toml keeps ranges; lock/py3.X/*.txt pin one release of everything for each supported
Python. These tests fail when the two disagree (a range no pin meets, a pin nothing asks for any
more), when a pin has no hash, and when the interpreter running the suite holds other versions
than its lock (scripts/setup makes .venv from the lock).
"""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.locks import LOCK, read_lock

ROOT = Path(__file__).resolve().parents[2]
PYTHONS = ("3.11", "3.12", "3.13")
# Each lock file, and the extras of pyproject.toml it resolves on top of the dependencies.
EXTRAS = {"runtime": (), "test": ("test",), "bench": ("test", "bench")}
PYPROJECT = "capyctl (pyproject.toml)"


def environment(python: str, extra: str = "") -> dict[str, str]:
    """The marker environment scripts/lock resolves for: Linux, CPython, this Python."""
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64",
            "platform_python_implementation": "CPython", "implementation_name": "cpython", "extra": extra}


def wanted(python: str, kind: str) -> list[Requirement]:
    """pyproject.toml's requirements that apply to `kind`'s lock for `python`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = [("", project["dependencies"])]
    groups += [(extra, project["optional-dependencies"][extra]) for extra in EXTRAS[kind]]
    return [req for extra, reqs in groups for req in map(Requirement, reqs)
            if req.marker is None or req.marker.evaluate(environment(python, extra))]


LOCKS = [(python, kind) for python in PYTHONS for kind in EXTRAS]


@pytest.mark.parametrize(("python", "kind"), LOCKS)
def test_each_range_of_pyproject_is_met_by_the_lock(python: str, kind: str) -> None:
    pins = read_lock(LOCK / f"py{python}" / f"{kind}.txt")
    unmet = [f"{req} (locked: {pins[canonicalize_name(req.name)].version if canonicalize_name(req.name) in pins else 'absent'})"
             for req in wanted(python, kind)
             if canonicalize_name(req.name) not in pins
             or not req.specifier.contains(pins[canonicalize_name(req.name)].version, prereleases=True)]
    assert not unmet, f"lock/py{python}/{kind}.txt does not meet pyproject.toml (run scripts/lock): {unmet}"


@pytest.mark.parametrize(("python", "kind"), LOCKS)
def test_each_pin_is_asked_for(python: str, kind: str) -> None:
    """A pin stays only while pyproject.toml, or another pin of the same file, needs it."""
    pins = read_lock(LOCK / f"py{python}" / f"{kind}.txt")
    direct = {canonicalize_name(req.name) for req in wanted(python, kind)}
    stale = []
    for name, pin in pins.items():
        parents = [v for v in pin.via if not v.startswith("-c ")]
        if not parents or any(v == PYPROJECT and name not in direct for v in parents) \
                or any(v != PYPROJECT and canonicalize_name(v) not in pins for v in parents):
            stale.append(f"{name} (via {pin.via})")
    assert not stale, f"lock/py{python}/{kind}.txt pins what nothing asks for (run scripts/lock): {stale}"


@pytest.mark.parametrize("path", sorted(LOCK.glob("**/*.txt")), ids=lambda p: str(p.relative_to(LOCK)))
def test_every_pin_has_its_hashes(path: Path) -> None:
    pins = read_lock(path)
    assert pins, f"{path} pins nothing"
    assert [name for name, pin in pins.items() if not pin.hashes] == []


@pytest.mark.parametrize("python", PYTHONS)
def test_each_lock_keeps_the_pins_of_the_one_it_narrows(python: str) -> None:
    """The tests run the versions the packages ship: test.txt keeps runtime.txt's pins, bench.txt
    test.txt's, and build.txt (installed beside test.txt) agrees with it on what both hold."""
    runtime, test, bench = (read_lock(LOCK / f"py{python}" / f"{k}.txt") for k in ("runtime", "test", "bench"))
    build = read_lock(LOCK / "build.txt")
    for narrower, wider in ((runtime, test), (test, bench), ({n: p for n, p in build.items() if n in test}, test)):
        assert {n: p.version for n, p in narrower.items()} == {n: wider[n].version for n in narrower}


def test_the_door_s_aiohttp_range_stops_at_the_minor_release_it_was_tested_on() -> None:
    """The door drives aiohttp's RequestHandler (an internal interface): no open-ended range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    aiohttp = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "aiohttp")
    locked = read_lock(LOCK / "py3.11" / "runtime.txt")["aiohttp"].version
    upper = [s for s in aiohttp.specifier if s.operator == "<"]
    assert upper and Version(upper[0].version) == Version(f"{locked.major}.{locked.minor + 1}")


def installed() -> dict[str, Version]:
    """Every distribution this interpreter can import from, but CapyCTL itself."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name != "capyctl":
            found.setdefault(name, Version(dist.version))
    return found


def test_the_interpreter_running_the_suite_holds_exactly_its_lock() -> None:
    """What scripts/setup installed is the lock: `pip freeze` of .venv equals lock/py3.X/test.txt
    (bench.txt once scripts/bench added its extra), with build.txt and models.txt beside it."""
    python = "%d.%d" % sys.version_info[:2]
    if sys.prefix == sys.base_prefix:
        pytest.fail(f"the suite runs on {sys.executable}, not in a virtual environment: make one with scripts/setup venv")
    extra = {**read_lock(LOCK / "build.txt"), **read_lock(LOCK / "models.txt")}
    have = installed()
    for kind in ("test", "bench"):
        want = {n: p.version for n, p in {**extra, **read_lock(LOCK / f"py{python}" / f"{kind}.txt")}.items()}
        if have == want:
            return
    want = {n: p.version for n, p in {**extra, **read_lock(LOCK / f"py{python}" / "test.txt")}.items()}
    differ = sorted(f"{n}: {have.get(n, 'absent')} installed, {want.get(n, 'not locked')} locked"
                    for n in have.keys() | want.keys() if have.get(n) != want.get(n))
    raise AssertionError(f"{sys.prefix} differs from lock/py{python}/test.txt (scripts/setup venv makes it anew): {differ}")
