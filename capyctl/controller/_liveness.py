"""Liveness of a ready engine: one that hangs is noticed within a bounded time.

The unit watch (D-Bus) sees an engine that exits; nothing saw one that stops answering while its
process lives (SIGSTOPped, deadlocked, a scheduler stuck on a GPU): every request to it waited
for the request timeout. While a deployment is READY, its engine's health route is probed on
loopback every few seconds; after ``timeouts.unresponsive`` with no successful probe the actor
fails the deployment (``engine_unresponsive``) and stops its unit. systemd sends SIGCONT right
after SIGTERM (systemd src/core/unit.c, unit_kill_context: kill_and_sigcont), so a stopped
process gets the SIGTERM; what is left after a short grace (HUNG_STOP_GRACE_S) gets SIGKILL.

Not probed: starting, waking, parking (each has its own timeout) and parked engines. Time the
daemon itself was not looking (its event loop blocked or late) is not counted against the
engine: a probe whose timer fired late, or a pause that overslept, is discounted; so is a probe
the daemon could not even make for want of file descriptors (capyctl/descriptors.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from ..descriptors import is_shortage
from ..errors import CapyError
from ._lifecycle import Command

log = logging.getLogger("capyctl.controller")

# One probe is one loopback GET; no answer within this is a failed probe. SGLang's /health
# generates one token and polls for it every second (sglang/srt/entrypoints/http_server.py
# health_generate, SGLang 0.5.23), so a probe must allow well over a second.
PROBE_TIMEOUT_MAX_S = 5.0
PROBE_INTERVAL_MAX_S = 5.0
PROBE_INTERVAL_MIN_S = 0.2
# A pause or probe that ran this much longer than asked means the daemon's own event loop was
# busy or blocked: that round says nothing about the engine.
LAG_TOLERANCE_S = 1.0

# The error code of a deployment the watchdog failed (what a client and `capyctl status` see).
UNRESPONSIVE_CODE = "engine_unresponsive"
# A hung engine gets this long after SIGTERM (and SIGCONT) to exit before SIGKILL, not the full
# timeouts.stop: its requests in flight wait for that exit. Seen here: llama-server SIGSTOPped
# with a stream in flight, then SIGTERMed and SIGCONTed, logged "cleaning up before exit..." and
# sometimes never exited (its clean_up stops the HTTP server, which waits for the stream's
# handler; tools/server/server.cpp, llama.cpp 11434), so it held the request until SIGKILL.
HUNG_STOP_GRACE_S = 3.0


def probe_interval(deadline: float) -> float:
    """Seconds between probes: six probes fit in the deadline, at most one every 5 s."""
    return min(PROBE_INTERVAL_MAX_S, max(PROBE_INTERVAL_MIN_S, deadline / 6))


def probe_timeout(deadline: float) -> float:
    return min(PROBE_TIMEOUT_MAX_S, deadline)


def hung_stop_grace(stop_timeout: float) -> float:
    return min(stop_timeout, HUNG_STOP_GRACE_S)


def detection_bound(deadline: float) -> float:
    """Latest a hang is declared after the engine's last answer (daemon lag aside): the silent
    time reaches the deadline within one more pause and probe."""
    return deadline + probe_interval(deadline) + probe_timeout(deadline)


class Watchdog:
    """Probes until the engine has been silent for ``deadline`` seconds, then returns.

    ``probe`` answers True when the engine is healthy. ``clock`` and ``sleep`` are injectable so
    a test can run the logic on a fake clock.
    """

    def __init__(self, probe: Callable[[], Awaitable[bool]], deadline: float, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        self.probe = probe
        self.deadline = deadline
        self.interval = probe_interval(deadline)
        self.timeout = probe_timeout(deadline)
        self.clock = clock
        self.sleep = sleep
        self.silent = 0.0  # seconds without an answer, daemon lag discounted
        self.discounted = 0  # rounds not counted because the daemon was late

    async def _probe_once(self) -> bool | None:
        """True: the engine answered; False: it did not; None: the daemon could not ask (it is
        out of file descriptors), which says nothing of the engine."""
        try:
            return bool(await asyncio.wait_for(self.probe(), timeout=self.timeout))
        except asyncio.TimeoutError:
            return False
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a probe that cannot even be made is a failed probe, not a crash
            if is_shortage(exc):  # (logged where it was met: capyctl/descriptors.py)
                return None
            log.debug("liveness probe raised", exc_info=True)
            return False

    async def watch(self) -> float:
        """Return the silent seconds once they reach the deadline; never returns while the
        engine answers."""
        previous = self.clock()
        while True:
            await self.sleep(self.interval)
            woke = self.clock()
            ok = await self._probe_once()
            now = self.clock()
            lag = max(0.0, (woke - previous) - self.interval) + max(0.0, (now - woke) - self.timeout)
            if ok:
                self.silent = 0.0
            elif ok is None or lag > LAG_TOLERANCE_S:
                self.discounted += 1  # the daemon was not looking: neither success nor silence
            else:
                self.silent += now - previous
                if self.silent >= self.deadline:
                    return self.silent
            previous = now


class Liveness:
    """The watchdog of one deployment: it runs while the deployment is READY and, when the
    engine stays silent, asks the actor (through its command queue) to fail it.

    The verdict is kept per launch, so the proxy can tell a request whose engine CapyCTL cut
    why its connection broke (:meth:`verdict`)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._task: asyncio.Task | None = None
        self._launch: str | None = None
        self._verdicts: dict[str, CapyError] = {}

    def follow(self, ready: bool) -> None:
        """Called on every state change: watch while the deployment is ready, stop otherwise."""
        launch = self.actor.launch_id
        if ready:
            if self._task is None or self._task.done() or self._launch != launch:
                self.stop()
                self._launch = launch
                self._task = asyncio.create_task(self._run(launch), name=f"liveness:{self.actor.name}")
        else:
            self.stop()

    def stop(self) -> None:
        if self._task is not None and not self._task.done() and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None

    async def _run(self, launch: str | None) -> None:
        actor = self.actor
        deadline = actor.spec.timeouts.unresponsive
        adapter = actor.controller.adapter(actor.spec)

        async def probe() -> bool:
            # The same check the start waits for, through the controller's session.
            return await adapter.health(actor.controller.http, actor.upstream().base_url, actor.key)

        try:
            silent = await Watchdog(probe, deadline).watch()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("deployment %s: the liveness watchdog failed", actor.name)
            return
        log.warning("deployment %s: the engine did not answer its health check for %.1fs", actor.name, silent)
        actor.submit(Command.ENGINE_UNRESPONSIVE, launch_id=launch, silent=silent)

    def condemn(self, launch: str | None, silent: float) -> CapyError:
        """Record the verdict on ``launch`` (before its unit is stopped) and return it."""
        error = CapyError(
            f"the engine of {self.actor.name!r} did not answer its health check for {silent:.1f}s "
            f"(timeouts.unresponsive is {self.actor.spec.timeouts.unresponsive:g}s); CapyCTL stopped it",
            code=UNRESPONSIVE_CODE, status=502)
        if launch is not None:
            if len(self._verdicts) > 16:  # verdicts matter only to requests of recent launches
                self._verdicts.clear()
            self._verdicts[launch] = error
        return error

    def verdict(self, launch: str | None) -> CapyError | None:
        return self._verdicts.get(launch) if launch is not None else None
