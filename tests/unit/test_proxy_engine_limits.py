"""The proxy's bound on connections open to one engine at once (capyctl/proxy/_engine_limits.py).

Through its one method, ``acquire``, as capyctl/proxy/_upstream.py calls it: what waits and what
enters is seen in the order tasks get in; what the limits keep, in the semaphores they hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import types
from typing import AsyncIterator

from capyctl.proxy import _engine_limits
from capyctl.proxy._engine_limits import EngineConnectionLimits
from capyctl.proxy.router import Upstream


def upstream(limit: int | None, base_url: str = "http://a.smol.engine") -> Upstream:
    return Upstream("smol", base_url, "k", "llama.cpp", connections_max=limit)


@contextlib.asynccontextmanager
async def exchange(limits: EngineConnectionLimits, target: Upstream) -> AsyncIterator[None]:
    """One of ``target``'s connections held for the exchange inside, as _upstream.py holds one."""
    release = await limits.acquire(target)
    try:
        yield
    finally:
        release()


async def entering_at_once(limits: EngineConnectionLimits, target: Upstream, count: int) -> int:
    """How many of ``count`` exchanges asking now get a connection without waiting (all are let
    go again): the room left under the bound."""
    tasks = [asyncio.create_task(limits.acquire(target)) for _ in range(count)]
    # Each task's first step runs before this one resumes (the loop's ready queue is first in,
    # first out): it got a connection, or it waits for one.
    await asyncio.sleep(0)
    got = [task.result() for task in tasks if task.done()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for release in got:
        release()
    return len(got)


async def waited_and_cancelled(limits: EngineConnectionLimits, target: Upstream) -> None:
    """An exchange that asks for one of ``target``'s connections, waits in line, and is cancelled
    there (its task, and the frames its cancellation holds, dropped on return)."""
    async def waiter() -> None:
        async with exchange(limits, target):
            pass

    waiting = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # (its first step: in line for a connection)
    assert not waiting.done()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


def semaphores_held(limits: EngineConnectionLimits) -> int:
    """The asyncio.Semaphore objects ``limits`` holds, through its attributes and what they hold
    (containers, dataclasses; not classes, modules or functions): one per engine bound it keeps."""
    found, seen, todo = 0, set(), [limits]
    while todo:
        thing = todo.pop()
        if id(thing) in seen or isinstance(thing, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(thing))
        if type(thing) is asyncio.Semaphore:
            found += 1
        else:
            todo.extend(gc.get_referents(thing))
    return found


async def _run(limits: EngineConnectionLimits, target: Upstream, count: int) -> tuple[int, list[int]]:
    """``count`` exchanges at once, each held until all have asked; the most inside at once and
    the order they entered in."""
    inside = most = 0
    asked: list[int] = []
    entered: list[int] = []
    release = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal inside, most
        asked.append(i)  # (acquire does not yield before it gets in or waits in line)
        async with exchange(limits, target):
            inside += 1
            most = max(most, inside)
            entered.append(i)
            await release.wait()
            inside -= 1

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    while len(asked) < count:  # each one inside, or in line for a connection
        await asyncio.sleep(0)
    release.set()
    await asyncio.gather(*tasks)
    return most, entered


def test_at_most_the_bound_is_inside_and_the_rest_enter_in_arrival_order():
    async def scenario() -> tuple[int, list[int], int]:
        limits = EngineConnectionLimits()
        most, entered = await _run(limits, upstream(2), 7)
        return most, entered, await entering_at_once(limits, upstream(2), 3)

    most, entered, room = asyncio.run(scenario())
    assert most == 2 and entered == list(range(7))
    assert room == 2  # every exchange gave its connection back, and the bound still holds


def test_an_engine_without_a_bound_lets_every_exchange_in():
    most, _ = asyncio.run(_run(EngineConnectionLimits(), upstream(None), 7))
    assert most == 7


def test_a_cancelled_wait_gives_its_place_up(monkeypatch):
    monkeypatch.setattr(_engine_limits, "KEPT_MAX", 1)  # each launch new to the limits forgets those unused

    async def scenario() -> tuple[int, int]:
        limits = EngineConnectionLimits()
        target = upstream(1)
        held = asyncio.Event()
        done = asyncio.Event()

        async def holder() -> None:
            async with exchange(limits, target):
                held.set()
                await done.wait()

        first = asyncio.create_task(holder())
        await held.wait()
        await waited_and_cancelled(limits, target)  # the client went away while waiting for a connection
        done.set()
        await first
        room = await entering_at_once(limits, target, 2)  # the bound is whole again, and still one
        # Nobody uses the target's bound now: the next launch's bound takes its place.
        async with exchange(limits, upstream(1, "http://other.smol.engine")):
            pass
        return room, semaphores_held(limits)

    room, kept = asyncio.run(scenario())
    assert room == 1
    assert kept == 1  # the other launch's: the target's forgotten, not held by the wait that left


def test_bounds_of_launches_nobody_uses_are_forgotten_and_those_in_use_kept(monkeypatch):
    monkeypatch.setattr(_engine_limits, "KEPT_MAX", 3)

    async def scenario() -> tuple[int, int]:
        limits = EngineConnectionLimits()
        target = upstream(1, "http://held.smol.engine")
        async with exchange(limits, target):
            for i in range(10):
                async with exchange(limits, upstream(1, f"http://l{i}.smol.engine")):
                    pass
            kept = semaphores_held(limits)
            room = await entering_at_once(limits, target, 1)  # its bound was not forgotten in use
        return kept, room

    kept, room = asyncio.run(scenario())
    assert kept <= 3 and room == 0
