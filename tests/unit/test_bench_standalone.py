"""benchmarks/capyctl_bench.py is the generated single-file copy of capyctl/bench/_core.py and
must run with nothing but the standard library."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capyctl.bench import standalone_source

REPO = Path(__file__).resolve().parents[2]
STANDALONE = REPO / "benchmarks" / "capyctl_bench.py"


def test_standalone_copy_is_the_generated_core():
    assert STANDALONE.read_text() == standalone_source(), (
        "benchmarks/capyctl_bench.py is stale: run "
        "`.venv/bin/python -m capyctl.bench --write-standalone benchmarks/capyctl_bench.py`")


def test_standalone_imports_only_the_standard_library():
    tree = ast.parse(STANDALONE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import would tie the copy to the package"
            imported.add((node.module or "").split(".")[0])
    # matplotlib is the one optional import, inside write_charts behind ImportError.
    outside = imported - set(sys.stdlib_module_names) - {"__future__", "matplotlib"}
    assert not outside, f"non-standard imports: {sorted(outside)}"


def test_standalone_runs_without_site_packages():
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    # -I: no user site, no PYTHONPATH, not the checkout; -S: no site-packages at all.
    out = subprocess.run([python, "-I", "-S", str(STANDALONE), "--help"], capture_output=True, text=True,
                         cwd="/", timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--base-url" in out.stdout and "--api-socket" in out.stdout


def test_standalone_refuses_an_unknown_section_with_a_clear_message():
    out = subprocess.run([sys.executable, "-I", str(STANDALONE), "--model", "m", "--skip", "nonsense",
                          "--base-url", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "unknown section(s) nonsense" in out.stderr


@pytest.mark.parametrize("text", ["", "0,1", "a,b"])
def test_bad_integer_lists_are_usage_errors(text):
    out = subprocess.run([sys.executable, "-I", str(STANDALONE), "--model", "m", "--concurrency", text],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--concurrency" in out.stderr
