"""Multi-node group logic, run against real fake-member processes on loopback.

The driver here starts tests/fakes/fake_sglang.py members (SGLang 0.5.23's multi-node launch,
with tests/fakes/fake_multinode.py's rendezvous for torch.distributed) as local processes; in
CapyCTL the driver starts systemd units on the member hosts. Ordering, health and failure rules
are the group's, so they are what these tests pin down.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from capyctl.controller._group import GroupFailed, GroupMember, MemberLaunch, ModelGroup, multinode_flags
from capyctl.controller._lifecycle import DeploymentState

FAILED, PARKED, READY, STOPPED = (DeploymentState.FAILED, DeploymentState.PARKED, DeploymentState.READY,
                                  DeploymentState.STOPPED)
from capyctl.errors import CapyError

FAKE = Path(__file__).resolve().parents[1] / "fakes" / "fake_sglang.py"
# What the SGLang adapter passes besides the multi-node flags: --tp-size is the total across the
# nodes, which SGLang asserts nnodes divides (arg_groups/validation_hook.py).
MEMBER_ARGS = ["--model-path", "m", "--served-model-name", "big", "--tp-size", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalDriver:
    """Members as local processes of the fake engine; records what the group asked, in order."""

    def __init__(self, *, unreachable_head_for_rank: int | None = None) -> None:
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.stderr: dict[int, bytes] = {}
        self.http_port = free_port()  # the head's; each worker serves its dummy /health on its own
        self.worker_ports: dict[int, int] = {}
        self.events: list[str] = []
        self.unreachable_head_for_rank = unreachable_head_for_rank

    async def start(self, launch: MemberLaunch) -> None:
        flags = list(launch.flags)
        if launch.rank == self.unreachable_head_for_rank:
            flags[flags.index("--dist-init-addr") + 1] = f"127.0.0.1:{free_port()}"  # nobody listens there
        if not launch.is_head:
            self.events.append(f"head health before rank {launch.rank}: {await self.head_status()}")
        port = self.http_port if launch.is_head else self.worker_ports.setdefault(launch.rank, free_port())
        self.procs[launch.rank] = await asyncio.create_subprocess_exec(
            sys.executable, str(FAKE), *MEMBER_ARGS, *flags, "--port", str(port), "--join-timeout", "2",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        self.events.append(f"start {launch.rank}")

    async def stop(self, launch: MemberLaunch) -> None:
        self.events.append(f"stop {launch.rank}")
        proc = self.procs.get(launch.rank)
        if proc is not None and proc.returncode is None:
            proc.terminate()  # the process this driver started, by its handle
            await proc.wait()

    async def accepting(self, launch: MemberLaunch) -> bool:
        try:
            _, writer = await asyncio.open_connection(launch.head_address, launch.dist_port)
        except OSError:
            return False
        writer.close()  # the head drops a connection that sends no JOIN
        self.events.append("head accepting")
        return True

    async def head_status(self, port: int | None = None) -> int | None:
        """The status of GET /health on the head (or ``port``); None when nothing answers."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
                async with s.get(f"http://127.0.0.1:{port or self.http_port}/health") as r:
                    return r.status
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def healthy(self, launch: MemberLaunch) -> bool:
        return await self.head_status() == 200

    async def wait_exit(self, launch: MemberLaunch) -> str:
        proc = self.procs[launch.rank]
        err = await proc.stderr.read()
        rc = await proc.wait()
        self.stderr[launch.rank] = err
        last = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return f"exited with status {rc}: {last[0]}"

    async def _post(self, path: str) -> None:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{self.http_port}{path}", json={"tags": ["weights", "kv_cache"]}) as r:
                # SGLang answers the release and the resume 200 with a null body (entrypoints/http_server.py).
                if r.status != 200 or await r.text() != "null":
                    raise CapyError(f"{path} answered {r.status}", code="engine_error")

    async def park(self, launch: MemberLaunch) -> None:
        self.events.append("park head")
        await self._post("/release_memory_occupation")

    async def wake(self, launch: MemberLaunch) -> None:
        self.events.append("wake head")
        await self._post("/resume_memory_occupation")

    def running(self) -> dict[int, bool]:
        return {rank: proc.returncode is None for rank, proc in self.procs.items()}

    async def cleanup(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


MEMBERS = [GroupMember(host="node-a", address="127.0.0.1"), GroupMember(host="node-b", address="127.0.0.1")]


@pytest.fixture
async def driver():
    d = LocalDriver()
    yield d
    await d.cleanup()


def make_group(driver: LocalDriver, **kw) -> ModelGroup:
    return ModelGroup(name="big", engine="sglang", members=MEMBERS, driver=driver, dist_port=free_port(),
                      start_timeout=30, poll_interval=0.05, **kw)


async def test_starts_head_first_and_is_ready_only_when_every_rank_joined(driver: LocalDriver) -> None:
    group = make_group(driver)
    await group.start()
    assert group.state == READY
    # The head's rendezvous port listened before the worker started; its HTTP port did not, as
    # SGLang's head serves only once every rank joined (entrypoints/engine.py _launch_subprocesses).
    assert driver.events[:4] == ["start 0", "head accepting", "head health before rank 1: None", "start 1"]
    assert await driver.head_status() == 200
    assert await driver.head_status(driver.worker_ports[1]) == 200  # the worker's dummy health server
    assert driver.running() == {0: True, 1: True}
    await group.stop()
    assert group.state == STOPPED
    assert driver.events[-2:] == ["stop 1", "stop 0"]  # workers first
    assert driver.running() == {0: False, 1: False}


async def test_members_get_the_engine_multinode_flags(driver: LocalDriver) -> None:
    group = make_group(driver)
    head, worker = group.launches
    addr = f"127.0.0.1:{group.dist_port}"
    assert list(head.flags) == ["--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr]
    assert list(worker.flags) == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr]


def test_vllm_workers_are_headless_and_bad_topologies_refused() -> None:
    assert multinode_flags("vllm", nnodes=2, rank=1, head_address="10.0.0.1", dist_port=29500) == [
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500", "--headless"]
    assert "--headless" not in multinode_flags("vllm", nnodes=2, rank=0, head_address="10.0.0.1", dist_port=1)
    assert multinode_flags("sglang", nnodes=2, rank=0, head_address="fd00::1", dist_port=5)[-1] == "[fd00::1]:5"
    with pytest.raises(CapyError) as err:
        multinode_flags("llamacpp", nnodes=2, rank=0, head_address="h", dist_port=1)
    assert err.value.code == "multinode_unsupported"
    with pytest.raises(CapyError) as err:
        multinode_flags("sglang", nnodes=2, rank=2, head_address="h", dist_port=1)
    assert err.value.code == "invalid_topology"
    with pytest.raises(CapyError):
        ModelGroup(name="x", engine="sglang", members=MEMBERS[:1], driver=LocalDriver(), dist_port=1)


async def test_killed_worker_fails_the_group_and_stops_the_head(driver: LocalDriver) -> None:
    group = make_group(driver)
    await group.start()
    driver.procs[1].send_signal(signal.SIGKILL)
    failure = await asyncio.wait_for(group.wait_failed(), 30)
    assert isinstance(failure, GroupFailed)
    assert failure.code == "group_member_failed"
    assert failure.detail["member"] == "node-b" and failure.detail["rank"] == 1
    assert f"status {-signal.SIGKILL}" in failure.detail["reason"]
    # wait_failed returns only once every member is stopped: a deployment reported failed must
    # hold nothing (the federation test once saw the head still deactivating).
    assert group.state == FAILED
    assert driver.running() == {0: False, 1: False}
    with pytest.raises(GroupFailed):
        await group.park()


async def test_worker_that_cannot_reach_the_head_fails_the_start() -> None:
    driver = LocalDriver(unreachable_head_for_rank=1)
    try:
        group = make_group(driver)
        with pytest.raises(GroupFailed) as err:
            await group.start()
        assert err.value.detail["member"] == "node-b"
        assert "cannot reach the head" in err.value.detail["reason"]
        assert group.state == FAILED
        assert driver.running() == {0: False, 1: False}
    finally:
        await driver.cleanup()


async def test_fake_worker_alone_exits_with_an_error() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(FAKE), *MEMBER_ARGS, "--port", str(free_port()), "--nnodes", "2", "--node-rank", "1",
        "--dist-init-addr", f"127.0.0.1:{free_port()}", "--join-timeout", "0.5", stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert b"cannot reach the head" in err


async def test_park_by_stop_and_wake_restarts_the_whole_group(driver: LocalDriver) -> None:
    group = make_group(driver)
    await group.start()
    await group.park()
    assert group.state == PARKED
    assert driver.running() == {0: False, 1: False}
    await group.wake()
    assert group.state == READY
    assert driver.running() == {0: True, 1: True}
    assert await driver.head_status() == 200
    # A worker exit after the wake is still watched.
    driver.procs[1].send_signal(signal.SIGKILL)
    failure = await asyncio.wait_for(group.wait_failed(), 30)
    assert failure.detail["rank"] == 1
    await group.stop()


async def test_park_in_place_goes_through_the_head(driver: LocalDriver) -> None:
    group = make_group(driver, park_in_place=True)
    await group.start()
    await group.park()
    assert group.state == PARKED and driver.events[-1] == "park head"
    assert driver.running() == {0: True, 1: True}
    async with aiohttp.ClientSession() as s:
        # SGLang's /health says nothing of the release: 200, empty (http_server.py health_generate;
        # launched without --enable-memory-saver, the release paused nothing and generation runs).
        async with s.get(f"http://127.0.0.1:{driver.http_port}/health") as r:
            assert r.status == 200 and await r.text() == ""
        async with s.get(f"http://127.0.0.1:{driver.http_port}/fake/stats") as r:  # the fake's own record
            assert (await r.json())["released_tags"] == ["kv_cache", "weights"]
    with pytest.raises(CapyError) as err:
        await group.park()
    assert err.value.code == "conflict"
    await group.wake()
    assert group.state == READY and driver.events[-1] == "wake head"
    await group.stop()
    assert driver.running() == {0: False, 1: False}
