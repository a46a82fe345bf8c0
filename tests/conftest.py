"""Shared fixtures. Keep this small: fixtures of one area live next to its tests."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from tests.sandbox.sandbox import Sandbox, can_boot

NEEDS_ROOT = "needs root and unshare to boot systemd in private namespaces"


@pytest.fixture
def sandbox_factory() -> Iterator[Callable[..., Sandbox]]:
    """Boot as many sandboxes as a test needs; all are stopped at teardown.

    A boot takes about half a second here, so function scope is cheap enough.
    """
    if not can_boot():
        pytest.skip(NEEDS_ROOT)
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
