"""The scripts of benchmarks/ as modules, for the unit tests of their pure parts.

benchmarks/ is no package: each script puts its folder on sys.path and imports its neighbours by
their bare names (``from bench_summary import p99``). A test loads one with ``load_benchmark``,
which registers it in sys.modules under that same bare name before running it: its dataclasses
look their module up there, and a neighbour's later ``import bench_summary`` gets this very module.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as the module ``name``, loaded once: the one sys.modules has when it
    came from that file (a test loaded it, or a benchmark imported it), else run now."""
    path = BENCHMARKS / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"no benchmark at {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if sys.modules.get(name) is module:
            del sys.modules[name]
        raise
    return module
