"""``capyctl bench``: the benchmark client as a subcommand of the capyctl CLI.

The integrator calls :func:`add_bench_parser` from capyctl/cli/__init__.py; the subcommand
takes the same options as ``capyctl-bench`` and runs :func:`capyctl.bench._core.run_from_args`.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..config import Paths
from ._core import build_parser, run_from_args


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to ``subparsers``; the parsed namespace's ``func(args)`` runs it and returns the exit code."""
    parser = subparsers.add_parser("bench", help="measure an OpenAI-compatible endpoint (TTFT, tokens/s, wake)",
                                   description="Measure time to first token, decode and prompt tokens/s, "
                                               "concurrent streams, wake against cold start and /v1/systemone.")
    build_parser(parser)
    for action in parser._actions:
        if action.dest == "api_socket":
            # capyctl has a global --api-socket with the same dest: a subparser default would
            # overwrite the value given before 'bench', so this one only sets it when given.
            action.default = argparse.SUPPRESS
    parser.set_defaults(func=_run)
    return parser


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "api_socket", None) is None:
        default = Paths.from_env().api_socket
        args.api_socket = str(default) if default.exists() else None
    return run_from_args(args)
