"""The runner's log of what it did: every command, its time and outcome, with progress as it goes."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence, TextIO


class RecipeRunError(Exception):
    """A run that failed (exit 1), or that this machine cannot do (``unavailable``: exit 3, a clean stop)."""

    def __init__(self, message: str, *, code: str, unavailable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.unavailable = unavailable

    def __str__(self) -> str:
        return f"{self.message} ({self.code})"


@dataclass
class Step:
    name: str
    command: str | None
    started_at: float
    seconds: float | None = None
    ok: bool | None = None
    detail: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "command": self.command, "started_at": self.started_at,
                "seconds": None if self.seconds is None else round(self.seconds, 3), "ok": self.ok,
                "detail": self.detail}


@dataclass
class StepLog:
    """Steps in the order they ran; each line of progress goes to ``stream`` with the run's clock."""

    stream: TextIO = field(default_factory=lambda: sys.stderr)
    steps: list[Step] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)

    def say(self, message: str) -> None:
        print(f"capyctl recipe [{time.monotonic() - self.began:6.1f}s] {message}", file=self.stream, flush=True)

    @contextmanager
    def step(self, name: str, command: str | None = None) -> Iterator[Step]:
        step = Step(name, command, time.time())
        self.steps.append(step)
        self.say(name + (f": {command}" if command else ""))
        t0 = time.perf_counter()
        try:
            yield step
        except BaseException as exc:
            step.ok, step.seconds = False, time.perf_counter() - t0
            step.detail = step.detail or str(exc)[:500]
            raise
        step.seconds = time.perf_counter() - t0
        step.ok = True if step.ok is None else step.ok
        self.say(f"{name}: done in {step.seconds:.2f}s" + (f" ({step.detail})" if step.detail else ""))

    def run(self, name: str, argv: Sequence[str], *, shown: Sequence[str] | None = None, cwd: Path | None = None,
            env: dict[str, str] | None = None, timeout: float = 3600, echo: bool = False) -> str:
        """Run a command as a step; its stdout. ``shown`` is the command as the report gives it (a
        user's ``capyctl ...`` rather than this interpreter's path). With ``echo`` its stderr lines
        are passed on as progress while it runs (a deploy's own progress, a build's)."""
        text = shlex.join(shown or argv)
        with self.step(name, text) as step:
            stdout, stderr, code = _run(argv, cwd=cwd, env=env, timeout=timeout,
                                        echo=(lambda line: self.say(f"  {line}")) if echo else None)
            if code != 0:
                tail = stderr.strip().splitlines()[-8:]
                step.detail = f"exit {code}: " + " | ".join(tail)
                raise RecipeRunError(f"{text} exited {code}: {' | '.join(tail)[-600:]}", code="step_failed")
            return stdout


def _run(argv: Sequence[str], *, cwd: Path | None, env: dict[str, str] | None, timeout: float,
         echo: Any) -> tuple[str, str, int]:
    try:
        proc = subprocess.Popen(list(argv), cwd=cwd, env={**os.environ, **(env or {})}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        return "", str(exc), 127
    err_lines: list[str] = []
    out_chunks: list[str] = []

    def pump_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_lines.append(line)
            if echo:
                echo(line.rstrip())

    def pump_stdout() -> None:
        assert proc.stdout is not None
        out_chunks.append(proc.stdout.read())

    readers = [threading.Thread(target=pump_stderr, daemon=True), threading.Thread(target=pump_stdout, daemon=True)]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = 124
        err_lines.append(f"\ntimed out after {timeout:.0f}s")
    for reader in readers:
        reader.join(5)
    return "".join(out_chunks), "".join(err_lines), code
