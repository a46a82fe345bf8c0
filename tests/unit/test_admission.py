"""Requests at one deployment's door (capyctl/controller/_admission.py): the limits on how many
may wait, and the bound on a wait at a closed door, checked against the real Controller and actor.

The engine's start is held at a gate the test opens, so a request is known to be waiting for
the wake when the next one comes: no timing is measured. The mutation check (scripts/mutation,
docs/testing.md) found that no unit test would notice these change: the queue limits were
checked only by the sandboxed integration tests (tests/integration/test_lifecycle.py), and the
turns tests end every wait at a closed door by opening it.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from capyctl.config import DaemonConfig
from capyctl.controller._actor import DeploymentActor
from capyctl.controller._proof import WakeProof
from capyctl.controller._turns import RoomWaitTimeout
from capyctl.errors import QueueFull
from capyctl.spec import parse_manifest
from tests.controllers import RecordingSystemd, vllm_controller

GiB = 1 << 30
HANG_GUARD = 20.0  # only a broken limit waits this long: the request it should refuse waits instead


class _Gate:
    """The engine's health check: ``starting`` is set once a wake waits on it, and it passes
    once ``open`` is set."""

    def __init__(self) -> None:
        self.starting = asyncio.Event()
        self.open = asyncio.Event()


@pytest.fixture
async def gated(tmp_path, monkeypatch):
    """A Controller over two fake 80 GiB cards, whose engines become healthy when the test says."""
    from tests.fakes.fake_nvml import FakeDevice, FakeNvml

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([
        FakeDevice("NVIDIA H100 80GB HBM3", f"GPU-h100-{i}", minor=i, total=80 * GiB) for i in range(2)]))
    gate = _Gate()

    async def healthy(self, progress, timeout):
        gate.starting.set()
        await gate.open.wait()

    async def proven(self, *args, **kwargs):
        return None

    monkeypatch.setattr(DeploymentActor, "_wait_healthy", healthy)
    monkeypatch.setattr(WakeProof, "check", proven)
    monkeypatch.setattr(WakeProof, "after_requests", lambda self, seconds: None)
    monkeypatch.setenv("CAPYCTL_ARM_PARKED", "0")
    async with vllm_controller(tmp_path, RecordingSystemd(), DaemonConfig()) as (ctl, model):
        yield ctl, model, gate


async def _deploy(ctl, model, name: str, extra: str = ""):
    return await ctl.deploy(parse_manifest(
        f"name: {name}\nengine: vllm\nmodel: {{path: {model}}}\n"
        f"resources: {{gpus: 1, gpu_memory: 50GiB, ram: 2GiB}}\npark: stop\n{extra}"))


async def _served(ctl, name: str) -> None:
    async with ctl.acquire(name):
        pass


async def _refused(ctl, name: str) -> QueueFull:
    with pytest.raises(QueueFull) as caught:
        await asyncio.wait_for(_served(ctl, name), HANG_GUARD)
    return caught.value


async def test_a_request_past_its_deployments_queue_is_refused_at_once_and_the_first_still_served(gated):
    ctl, model, gate = gated
    a = await _deploy(ctl, model, "a", "queue: 1\n")
    first = asyncio.create_task(_served(ctl, "a"))
    await gate.starting.wait()  # the first request's wake is under way: it waits, the queue is full
    assert a.waiting == 1
    refused = await _refused(ctl, "a")
    assert (refused.status, refused.retry_after) == (429, 5.0)  # not ready: come back after a wake
    assert "1 requests waiting" in refused.message
    assert a.waiting == 1  # the refused one was never counted
    gate.open.set()
    await asyncio.wait_for(first, HANG_GUARD)
    assert (a.state, a.waiting, a.in_flight) == ("ready", 0, 0)


async def test_the_daemons_queue_limit_counts_the_requests_waiting_for_every_deployment(gated):
    ctl, model, gate = gated
    ctl.config.queue_total = 1
    await _deploy(ctl, model, "a")
    b = await _deploy(ctl, model, "b")
    first = asyncio.create_task(_served(ctl, "a"))
    await gate.starting.wait()
    refused = await _refused(ctl, "b")  # b has no request waiting: a's fills the daemon's queue
    assert "across all deployments" in refused.message and refused.retry_after == 5.0
    assert b.waiting == 0
    gate.open.set()
    await asyncio.wait_for(first, HANG_GUARD)
    await asyncio.wait_for(_served(ctl, "b"), HANG_GUARD)  # nothing waits now: b is let in


async def test_a_request_held_at_a_closed_door_past_its_bound_gets_503_and_the_deployment_stays_ready(gated):
    ctl, model, gate = gated
    gate.open.set()
    ctl.config.swap_wait_max = 0.0  # the bound is then the wake's timeout alone: 50 ms
    a = await _deploy(ctl, model, "a", "timeouts: {wake: 0.05}\n")
    await ctl.wake("a")
    a.requests.close_door(ctl.admission_ticket())  # another deployment's turn: later tickets wait
    with pytest.raises(RoomWaitTimeout) as caught:
        await asyncio.wait_for(_served(ctl, "a"), HANG_GUARD)
    assert (caught.value.code, caught.value.status, caught.value.retry_after) == ("room_wait_timeout", 503, 1.0)
    assert "kept yielding its turn to others past this request's wait bound" in caught.value.message
    assert (a.state, a.waiting, a.in_flight) == ("ready", 0, 0)
    a.requests.open_door()
    await asyncio.wait_for(_served(ctl, "a"), HANG_GUARD)
