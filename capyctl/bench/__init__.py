"""capyctl-bench: the benchmark client for any OpenAI-compatible CapyCTL endpoint.

The whole client lives in :mod:`capyctl.bench._core`, standard library only, so that
benchmarks/capyctl_bench.py can be a generated single-file copy of it that runs anywhere
(see :func:`standalone_source`). Console script: ``capyctl-bench = "capyctl.bench:main"``.
"""

from __future__ import annotations

from pathlib import Path

from ._core import (BenchConfig, BenchError, Control, Endpoint, StreamResult, build_parser, interleave, main,
                    make_prompt, render_markdown, run_benchmark, run_benchmarks, run_streams, stream_chat,
                    summarize, write_report)

__all__ = [
    "BenchConfig", "BenchError", "Control", "Endpoint", "StreamResult", "build_parser", "interleave", "main",
    "make_prompt", "render_markdown", "run_benchmark", "run_benchmarks", "run_streams", "standalone_source",
    "stream_chat", "summarize", "write_report",
]

_STANDALONE_HEADER = ("# Generated from capyctl/bench/_core.py by `python -m capyctl.bench --write-standalone "
                      "PATH`;\n# edit that file and regenerate this one (tests/unit/test_bench_standalone.py "
                      "checks they agree).\n")


def standalone_source() -> str:
    """The text of the single-file copy: the core, with a header that says where it comes from."""
    return _STANDALONE_HEADER + (Path(__file__).parent / "_core.py").read_text()
