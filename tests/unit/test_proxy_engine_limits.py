"""The proxy's bound on connections open to one engine at once (capyctl/proxy/_engine_limits.py)."""

from __future__ import annotations

import asyncio

from capyctl.proxy import _engine_limits
from capyctl.proxy._engine_limits import EngineConnectionLimits
from capyctl.proxy.router import Upstream


def upstream(limit: int | None, base_url: str = "http://a.smol.engine") -> Upstream:
    return Upstream("smol", base_url, "k", "llama.cpp", connections_max=limit)


async def _run(limits: EngineConnectionLimits, target: Upstream, count: int) -> tuple[int, list[int]]:
    """``count`` exchanges at once, each held until all have asked; the most inside at once and
    the order they entered in."""
    inside = most = 0
    entered: list[int] = []
    release = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal inside, most
        async with limits.exchange(target):
            inside += 1
            most = max(most, inside)
            entered.append(i)
            await release.wait()
            inside -= 1

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    inside_at_once = min(count, target.connections_max or count)
    while len(entered) < inside_at_once or (target.connections_max is not None and limits.users(target) < count):
        await asyncio.sleep(0)
    release.set()
    await asyncio.gather(*tasks)
    return most, entered


def test_at_most_the_bound_is_inside_and_the_rest_enter_in_arrival_order():
    limits = EngineConnectionLimits()
    most, entered = asyncio.run(_run(limits, upstream(2), 7))
    assert most == 2 and entered == list(range(7))
    assert limits.users(upstream(2)) == 0


def test_an_engine_without_a_bound_lets_every_exchange_in():
    most, _ = asyncio.run(_run(EngineConnectionLimits(), upstream(None), 7))
    assert most == 7


def test_a_cancelled_wait_gives_its_place_up(monkeypatch):
    async def scenario() -> int:
        limits = EngineConnectionLimits()
        target = upstream(1)
        held = asyncio.Event()
        done = asyncio.Event()

        async def holder() -> None:
            async with limits.exchange(target):
                held.set()
                await done.wait()

        first = asyncio.create_task(holder())
        await held.wait()

        async def waiter() -> None:
            async with limits.exchange(target):
                pass

        waiting = asyncio.create_task(waiter())
        while limits.users(target) < 2:
            await asyncio.sleep(0)
        waiting.cancel()  # the client went away while waiting for a connection
        await asyncio.gather(waiting, return_exceptions=True)
        after_cancel = limits.users(target)
        done.set()
        await first
        async with limits.exchange(target):  # the bound is whole again
            pass
        return after_cancel

    assert asyncio.run(scenario()) == 1


def test_bounds_of_launches_nobody_uses_are_forgotten(monkeypatch):
    monkeypatch.setattr(_engine_limits, "KEPT_MAX", 3)

    async def scenario() -> int:
        limits = EngineConnectionLimits()
        for i in range(10):
            async with limits.exchange(upstream(1, f"http://l{i}.smol.engine")):
                pass
        return limits.kept

    assert asyncio.run(scenario()) <= 3
