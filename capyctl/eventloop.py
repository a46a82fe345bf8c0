"""The event loop CapyCTL's daemon runs on: uvloop where it is installed, asyncio's own otherwise.

uvloop's transports and selector are C (libuv): the proxy's CPU per small request measured well
lower with it (benchmarks/proxy_hop.py; docs/benchmarks.md, "Figures behind design choices").
It is a dependency on the platforms it has wheels for; ``CAPYCTL_EVENT_LOOP=asyncio`` forces the
pure-Python loop (to compare, or where uvloop misbehaves).
"""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Callable, Coroutine, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None (asyncio's default loop)."""
    if os.environ.get("CAPYCTL_EVENT_LOOP", "auto") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def loop_name() -> str:
    return "uvloop" if loop_factory() is not None else "asyncio"


def run(main: Coroutine[object, object, T]) -> T:
    """``asyncio.run`` on the loop :func:`loop_factory` chooses."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


def freeze_startup_objects() -> None:
    """Once the daemon is wired and serving: collect, then move every object alive now (modules,
    the app, pydantic schemas) out of the cyclic collector's sight.

    They live as long as the process, yet every full collection walked them all: a pause far
    longer than a young generation's, which some request waits out (benchmarks/proxy_hop.py;
    docs/benchmarks.md, "Full collections"). Objects made later are collected as before; frozen
    ones are still freed by reference counting, only a cycle among them would stay (gc.freeze's
    documentation).
    """
    gc.collect()
    gc.freeze()
