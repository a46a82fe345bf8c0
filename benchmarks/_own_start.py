"""The engine's own start, by hand: a deployment's unit command line run directly, exec to its first
answer: the baseline a wake or a swap through CapyCTL is measured against in the same run
(contention.py, kv_park.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def engine_own_start(launch_command: dict[str, Any], out: Path, runs: int, prompt: str,
                     batch: int = 0) -> dict[str, list[float]]:
    """The engine's own start, by hand: the deployment's unit command line run directly (no unit,
    no proxy, no key; capyctl/recipes/_runner.py's launch_direct), exec to the first answer of the
    benchmark's request (an 8-token chat of ``prompt``). Two ways, each ``runs`` times: ``one``, that
    request asked again at once while it is refused or loading; ``batch`` (when ``batch`` > 0),
    /health polled as CapyCTL polls it, then ``batch`` of those requests at once, as a swap's turn
    gets them (the first of them answered)."""
    import concurrent.futures
    import io
    import urllib.error
    import urllib.request

    from capyctl.recipes._runner import StepLog, launch_direct, stop_direct
    body = json.dumps({"model": "x", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                       "temperature": 0}).encode()

    def ask(port: int) -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            r.read()

    def healthy(port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def until(proc: Any, started: float, attempt: Any) -> None:
        while not attempt():
            if proc.poll() is not None or time.perf_counter() - started > 120:
                raise RuntimeError(f"the engine started by hand did not serve (exit {proc.poll()})")
            time.sleep(0.005)

    def one_request(proc: Any, port: int, started: float) -> None:
        def attempt() -> bool:
            try:
                ask(port)
                return True
            except (OSError, urllib.error.URLError):
                return False
        until(proc, started, attempt)

    def many_at_once(proc: Any, port: int, started: float) -> None:
        until(proc, started, lambda: healthy(port))
        with concurrent.futures.ThreadPoolExecutor(batch) as pool:
            waiting = [pool.submit(ask, port) for _ in range(batch)]
            next(concurrent.futures.as_completed(waiting)).result()

    figures: dict[str, list[float]] = {"one": [], "batch": []}
    for _ in range(runs):
        for kind, serve in (("one", one_request), ("batch", many_at_once))[:2 if batch else 1]:
            started = time.perf_counter()
            proc, port = launch_direct(launch_command, out, 120.0, StepLog(stream=io.StringIO()))
            try:
                serve(proc, port, started)
                figures[kind].append(time.perf_counter() - started)
            finally:
                stop_direct(proc)
    return figures
