"""The CLI's surface: every command documents itself, list commands speak JSON, and a CLI
pointed at no daemon says so clearly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from capyctl.cli import build_parser


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "capyctl", *args], capture_output=True, text=True, env=env)


def _commands(parser=None, prefix=()):
    import argparse
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _commands(sub, (*prefix, name))


def test_every_command_has_a_description_and_help():
    commands = list(_commands())
    assert len(commands) > 15
    for path, sub in commands:
        text = sub.format_help()
        assert sub.description or sub.format_usage(), path
        assert "usage: capyctl " + " ".join(path) in text, path


def test_top_level_help_reads_like_a_man_page():
    out = run("--help")
    assert out.returncode == 0
    for section in ("examples:", "environment:", "files:", "exit status:", "see also:"):
        assert section in out.stdout


@pytest.mark.parametrize("args", [("list", "deployments"), ("status", "deployment", "x"), ("key", "list")])
def test_no_daemon_is_a_clear_error(tmp_path, args):
    out = run("--api-socket", str(tmp_path / "none.sock"), *args)
    assert out.returncode == 1
    assert "is CapyCTL running?" in out.stderr and "(daemon_unreachable)" in out.stderr


def test_validate_json(tmp_path):
    good = tmp_path / "m.yaml"
    good.write_text("name: a\nengine: vllm\nmodel: {hf: org/model}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: a\nengine: vllm\n")
    out = run("validate", "--file", str(good), "--file", str(bad), "--json")
    assert out.returncode == 2
    results = json.loads(out.stdout)
    assert results[0]["valid"] is True and results[1]["valid"] is False
    assert results[1]["detail"]["problems"][0] == {"field": "model", "line": 1, "message": "is required"}


def test_argcomplete_completes_commands():
    import os
    env = {**os.environ, "_ARGCOMPLETE": "1", "COMP_LINE": "capyctl list ", "COMP_POINT": "13",
           "_ARGCOMPLETE_IFS": "\n"}
    # The argcomplete protocol: candidates come back on fd 8.
    out = subprocess.run(["bash", "-c", f'"{sys.executable}" -m capyctl 8>&1 9>/dev/null >/dev/null 2>&1'],
                         env=env, capture_output=True, text=True)
    words = set(out.stdout.split())
    assert {"deployments", "engines", "keys", "hosts"} <= words and "validate" not in words
