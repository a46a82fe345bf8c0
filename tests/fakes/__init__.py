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
VLLM_VERSION = "0.9.1"
SGLANG_VERSION = "0.4.6.post5"


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


def make_fake_vllm_venv(root: Path, version: str = VLLM_VERSION) -> Path:
    """A venv-shaped directory whose ``bin/vllm serve ...`` runs fake_vllm.py with the same arguments."""
    _venv_skeleton(root, "vllm", version)
    _write_exec(root / "bin" / "vllm",
                f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE_VLLM))} \"$@\"\n")
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


def start_plan(plan, key: str, port: int, log_path: Path | None = None) -> ServerProcess:
    """Run a LaunchPlan as the controller's unit would: the 0600 environment file's variables and
    the non-secret environment set, ``${KEY_ENV}`` in argv expanded by "systemd" (here)."""
    secret = plan.secret_file_environment(key)
    env = {**plan.environment, **secret}
    return start_server(expand_key_reference(plan.argv, secret), port, env=env, log_path=log_path)
