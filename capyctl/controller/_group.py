"""A model that spans several machines: one engine member per host, run as one unit of work.

Multi-node engines have a head (rank 0) that opens a rendezvous port and serves the API,
and workers that join it. The order matters: a worker started before the head listens
fails to connect, so the head starts first, workers follow once its rendezvous port
accepts connections, and the group is ready when the head answers its health check (the
engines answer only once every rank has joined). Any member that exits fails the whole
group: the others are stopped and the failure names the member and its reason.

This module is pure asyncio logic. Starting a unit on a host, probing it and waiting for
it to exit are the ``MemberDriver``'s job (systemd over SSH in the controller, local
processes in the tests), so the ordering and failure rules are tested without SSH.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ..errors import CapyError
from ._lifecycle import DeploymentState

log = logging.getLogger(__name__)

__all__ = ["GroupFailed", "GroupMember", "MemberDriver", "MemberLaunch", "ModelGroup", "multinode_flags"]



class GroupFailed(CapyError):
    """A member of a multi-node group failed; ``detail`` holds ``member`` (host), ``rank`` and ``reason``."""

    code = "group_member_failed"
    status = 502


@dataclass(frozen=True)
class GroupMember:
    """One member: the host it runs on and the address other members reach that host at."""

    host: str
    address: str


@dataclass(frozen=True)
class MemberLaunch:
    """What one member is started with; ``flags`` are the engine's multi-node arguments."""

    member: GroupMember
    rank: int
    nnodes: int
    head_address: str
    dist_port: int
    flags: tuple[str, ...]

    @property
    def is_head(self) -> bool:
        return self.rank == 0


def multinode_flags(engine: str, *, nnodes: int, rank: int, head_address: str, dist_port: int) -> list[str]:
    """The engine's own arguments for one member of an ``nnodes`` group.

    SGLang: ``--nnodes N --node-rank R --dist-init-addr HEAD:PORT`` on every node.
    vLLM (multiprocessing executor, no Ray): ``--nnodes N --node-rank R --master-addr HEAD
    --master-port PORT`` on every node, and ``--headless`` on workers, which run no API server.
    """
    if nnodes < 2 or not 0 <= rank < nnodes:
        raise CapyError(f"rank {rank} of a {nnodes}-node group is not valid", code="invalid_topology", status=400)
    host = f"[{head_address}]" if ":" in head_address else head_address
    if engine == "sglang":
        # SGLang 0.5.23: sglang/srt/arg_groups/fields/parallel.py (--nnodes, --node-rank,
        # --dist-init-addr); the address is parsed by utils/network.py NetworkAddress.parse, which
        # needs IPv6 bracketed. The adapter passes --tp-size as the total across the nodes.
        return ["--nnodes", str(nnodes), "--node-rank", str(rank), "--dist-init-addr", f"{host}:{dist_port}"]
    if engine == "vllm":
        # vLLM 0.32.0: vllm/engine/arg_utils.py (--nnodes, --node-rank, --master-addr, --master-port;
        # nnodes > 1 needs the default mp backend), vllm/entrypoints/launchers/cli_args.py (--headless,
        # honoured only by `vllm serve`, entrypoints/cli/serve.py run_headless: the vLLM adapter
        # launches group members that way). The address goes unbracketed: vLLM brackets an IPv6
        # master_addr itself (utils/network_utils.py get_tcp_uri).
        flags = ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", head_address,
                 "--master-port", str(dist_port)]
        return flags + (["--headless"] if rank else [])
    raise CapyError(f"engine {engine!r} has no multi-node mode CapyCTL can drive", code="multinode_unsupported",
                    status=400)


class MemberDriver(Protocol):
    """How a group reaches its members; every method may raise CapyError."""

    async def start(self, launch: MemberLaunch) -> None:
        """Start the member (returns once it is launched, not once it is healthy)."""

    async def stop(self, launch: MemberLaunch) -> None:
        """Stop the member and return when it is gone; a member already gone is no error."""

    async def accepting(self, launch: MemberLaunch) -> bool:
        """For the head: does its rendezvous port (head_address:dist_port) accept connections?"""

    async def healthy(self, launch: MemberLaunch) -> bool:
        """For the head: does the engine answer its health check (every rank joined)?"""

    async def wait_exit(self, launch: MemberLaunch) -> str:
        """Return when the member has exited, with a sentence saying why (status, last log lines)."""

    async def park(self, launch: MemberLaunch) -> None:
        """Release the group's memory through the head's API (engines that park in place)."""

    async def wake(self, launch: MemberLaunch) -> None:
        """Take the memory back through the head's API."""


@dataclass
class ModelGroup:
    """One multi-node deployment; call its methods from one task (the deployment's actor).

    ``members[0]`` is the head. ``park_in_place`` True parks through the head's API
    (vLLM sleep, SGLang memory release, which reach every rank); False parks by stopping
    every member and wakes by starting the group again.
    """

    name: str
    engine: str
    members: Sequence[GroupMember]
    driver: MemberDriver
    dist_port: int
    park_in_place: bool = False
    start_timeout: float = 600.0
    stop_timeout: float = 60.0
    poll_interval: float = 0.2
    state: DeploymentState = field(default=DeploymentState.STOPPED, init=False)
    failure: GroupFailed | None = field(default=None, init=False)
    _watchers: list[asyncio.Task] = field(default_factory=list, init=False, repr=False)
    _failed: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    # Set once the members of a failed group are stopped: "failed" then means nothing runs.
    _down: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _expect_exit: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.members) < 2:
            raise CapyError(f"group {self.name!r} needs at least two members", code="invalid_topology", status=400)
        head = self.members[0].address
        n = len(self.members)
        self.launches = [
            MemberLaunch(member=m, rank=r, nnodes=n, head_address=head, dist_port=self.dist_port,
                         flags=tuple(multinode_flags(self.engine, nnodes=n, rank=r, head_address=head,
                                                     dist_port=self.dist_port)))
            for r, m in enumerate(self.members)]

    @property
    def head(self) -> MemberLaunch:
        return self.launches[0]

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Head first, workers once the head listens, ready once the head is healthy.

        Raises GroupFailed (after stopping every member) when a member exits or a step
        times out.
        """
        if self.state == DeploymentState.READY:
            return
        self.state = DeploymentState.STARTING
        self.failure = None
        self._failed.clear()
        self._down.clear()
        self._expect_exit = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout
        try:
            await self._start_member(self.head)
            await self._wait_for(lambda: self.driver.accepting(self.head), deadline,
                                 "the head to open its rendezvous port")
            for launch in self.launches[1:]:
                await self._start_member(launch)
            await self._wait_for(lambda: self.driver.healthy(self.head), deadline,
                                 f"all {len(self.launches)} members to join")
        except BaseException as exc:
            await self._fail_from(exc)
            raise self.failure if self.failure and not isinstance(exc, asyncio.CancelledError) else exc
        self._raise_if_failed()
        self.state = DeploymentState.READY

    async def stop(self) -> None:
        """Stop every member, workers first (a head that loses workers may log errors, not the reverse)."""
        if self.state == DeploymentState.STOPPED:
            return
        self.state = DeploymentState.STOPPING
        await self._stop_all()
        self.state = DeploymentState.STOPPED

    async def park(self) -> None:
        self._raise_if_failed()
        if self.state != DeploymentState.READY:
            raise CapyError(f"group {self.name!r} is {self.state}, not ready", code="conflict", status=409)
        self.state = DeploymentState.PARKING
        if self.park_in_place:
            try:
                await self.driver.park(self.head)
            except BaseException as exc:
                await self._fail_from(exc)
                raise self.failure or exc
            self._raise_if_failed()
        else:
            await self._stop_all()
        self.state = DeploymentState.PARKED

    async def wake(self) -> None:
        self._raise_if_failed()
        if self.state != DeploymentState.PARKED:
            raise CapyError(f"group {self.name!r} is {self.state}, not parked", code="conflict", status=409)
        if not self.park_in_place:
            await self.start()
            return
        self.state = DeploymentState.WAKING
        try:
            await self.driver.wake(self.head)
        except BaseException as exc:
            await self._fail_from(exc)
            raise self.failure or exc
        self._raise_if_failed()
        self.state = DeploymentState.READY

    async def wait_failed(self) -> GroupFailed:
        """Return the failure once the group has failed and its members are stopped (for the
        actor's watch loop: a deployment reported failed holds no member any more)."""
        await self._failed.wait()
        await self._down.wait()
        assert self.failure is not None
        return self.failure

    # -- internals -------------------------------------------------------------------------------

    async def _start_member(self, launch: MemberLaunch) -> None:
        self._raise_if_failed()
        try:
            await self.driver.start(launch)
        except CapyError as exc:
            self._record(launch, f"could not be started: {exc.message}")
            raise self.failure from exc  # type: ignore[misc]
        self._watchers.append(asyncio.create_task(self._watch(launch), name=f"group {self.name} rank {launch.rank}"))

    async def _watch(self, launch: MemberLaunch) -> None:
        try:
            reason = await self.driver.wait_exit(launch)
        except CapyError as exc:
            reason = f"could not be watched: {exc.message}"
        if self._expect_exit:
            return
        self._record(launch, reason)
        # Fail the whole group at once: a group missing a rank cannot serve, and the survivors
        # would otherwise hang in their collectives holding GPU memory.
        if self.state not in (DeploymentState.STARTING, DeploymentState.WAKING):  # start()/wake() clean up themselves
            await self._stop_all(keep_state=True)
            self.state = DeploymentState.FAILED
            self._down.set()

    def _record(self, launch: MemberLaunch, reason: str) -> None:
        if self.failure is not None:
            return  # the first failure is the cause; the others follow from it
        role = "head" if launch.is_head else "worker"
        self.failure = GroupFailed(
            f"group {self.name!r}: the {role} on host {launch.member.host!r} (rank {launch.rank}) failed: {reason}",
            detail={"group": self.name, "member": launch.member.host, "rank": launch.rank, "reason": reason})
        log.warning("%s", self.failure)
        self._failed.set()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def _wait_for(self, probe, deadline: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._raise_if_failed()
            try:
                if await probe():
                    return
            except CapyError as exc:
                log.debug("group %s: probe failed while waiting for %s: %s", self.name, what, exc)
            if loop.time() >= deadline:
                raise CapyError(f"group {self.name!r}: timed out waiting for {what}", code="group_start_timeout",
                                status=504)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._failed.wait(), self.poll_interval)

    async def _fail_from(self, exc: BaseException) -> None:
        if self.failure is None and isinstance(exc, CapyError):
            self.failure = GroupFailed(f"group {self.name!r} failed to start: {exc.message}",
                                       detail={"group": self.name, "member": None, "rank": None,
                                               "reason": exc.message, "code": exc.code})
            self._failed.set()
        await self._stop_all(keep_state=True)
        self.state = DeploymentState.FAILED
        self._down.set()

    async def _stop_all(self, keep_state: bool = False) -> None:
        self._expect_exit = True
        current = asyncio.current_task()
        for task in self._watchers:
            if task is not current:
                task.cancel()
        for task in self._watchers:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._watchers = []
        errors = []
        for launch in reversed(self.launches):
            try:
                await asyncio.wait_for(self.driver.stop(launch), self.stop_timeout)
            except (CapyError, asyncio.TimeoutError) as exc:
                errors.append(f"rank {launch.rank} on {launch.member.host}: {exc}")
        if errors:
            log.error("group %s: members that did not stop: %s", self.name, "; ".join(errors))
            if not keep_state:
                raise CapyError(f"group {self.name!r}: some members did not stop: {'; '.join(errors)}",
                                code="group_stop_failed")
