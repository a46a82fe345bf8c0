"""Shared fixtures. Keep this small: fixtures of one area live next to its tests."""

from __future__ import annotations

import os
import subprocess
import uuid
from typing import Callable, Iterator

import pytest

from tests.components import missing
from tests.sandbox.sandbox import Sandbox, can_boot

NEEDS_ROOT = "needs root and unshare to boot systemd in private namespaces"


@pytest.fixture
def sandbox_factory() -> Iterator[Callable[..., Sandbox]]:
    """Boot as many sandboxes as a test needs; all are stopped at teardown.

    A boot takes about half a second here, so function scope is cheap enough.
    """
    if not can_boot():
        missing(NEEDS_ROOT)
    booted: list[Sandbox] = []

    def boot(name: str | None = None, **kw: object) -> Sandbox:
        sb = Sandbox(name, **kw)  # type: ignore[arg-type]
        booted.append(sb)
        return sb.start()

    yield boot
    errors = []
    for sb in reversed(booted):
        try:
            sb.stop()
        except Exception as exc:  # stop every sandbox even if one fails
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def sandbox(sandbox_factory: Callable[..., Sandbox]) -> Sandbox:
    """One freshly booted systemd sandbox (see tests/sandbox/capy-sandbox)."""
    return sandbox_factory()


@pytest.fixture
def netns() -> Iterator[str]:
    """A network namespace of the test's own, with loopback up; deleted afterwards."""
    if os.geteuid() != 0:
        missing("needs root to create network namespaces")
    name = f"capytest-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


# Modules whose async tests run on uvloop's loop too, the daemon's (capyctl/eventloop.py): code that
# implements asyncio protocols, where uvloop's transports differ from asyncio's (they subclass none
# of asyncio's classes, and read a peer's close in the same batch as its last bytes).
_ON_UVLOOP_TOO = {"test_proxy_wire.py", "test_proxy_engine_side.py", "test_proxy_door.py"}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable]:
    import asyncio

    if item.path.name in _ON_UVLOOP_TOO:
        import uvloop
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
