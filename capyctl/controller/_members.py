"""The controller's MemberDriver: each member of a multi-node group is a transient unit
``capyctl-<deployment>.service`` in its own host's systemd (local, or over SSH).

The head (rank 0) serves the API on its host's loopback, reached through an SSH-forwarded
port like any remote engine; workers serve nothing and only join the head's rendezvous port,
which listens on the head host's address so the other hosts can reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Callable

from ..engines._tiers import TIER_SLEEP_LEVEL
from ..config import engine_credentials_dir
from ..errors import CapyError
from ._confine import engine_location
from ._keys import new_engine_key
from ._group import GroupFailed, GroupMember, MemberLaunch, ModelGroup
from ._hosts import LOCAL, parse_target
from ._lifecycle import DeploymentState
from ._memory import cpu_fields, gpu_order_environment

from ._services import GroupOwner


def member_address(ctl, host: str) -> str:
    """The address other hosts reach ``host`` at: its SSH address, or for the local host the
    one given in CAPYCTL_ADVERTISE_ADDRESS."""
    if host == LOCAL:
        address = os.environ.get("CAPYCTL_ADVERTISE_ADDRESS")
        if not address:
            raise CapyError("a multi-node member on the local host needs CAPYCTL_ADVERTISE_ADDRESS, the address "
                            "the other hosts reach this one at", code="advertise_address_missing", status=400)
        return address
    return parse_target(ctl.host_address(host))[1]


def group_members(actor: GroupOwner) -> list[GroupMember]:
    return [GroupMember(h, member_address(actor.controller, h)) for h in actor.spec.hosts[:actor.spec.nodes]]


class UnitMembers:
    """MemberDriver over systemd units; one per deployment, owned by its actor."""

    def __init__(self, actor: GroupOwner) -> None:
        self.actor = actor
        self.ports: dict[int, int] = {}  # rank -> engine port on its host
        self.head_local_port: int | None = None
        self.secret_files: dict[int, list[str]] = {}  # rank -> its secret files' names  # the head's API, reachable from the daemon

    @property
    def ctl(self):
        return self.actor.controller

    def unit_state_key(self, launch: MemberLaunch) -> str:
        return f"{self.actor.name}#rank{launch.rank}"

    def secret_name(self, launch: MemberLaunch) -> str:
        return f"{self.actor.name}.rank{launch.rank}"

    async def start(self, launch: MemberLaunch) -> None:
        from ..engines import LaunchContext
        from ..systemd import TransientUnit

        actor, ctl, host = self.actor, self.ctl, launch.member.host
        engine = ctl.engine_for(actor.spec)
        adapter = ctl.adapter(actor.spec)
        systemd = ctl.systemd_on(host)
        existing = await systemd.unit_state(actor.unit)
        if existing is not None and existing.is_running:
            await systemd.stop_unit(actor.unit, actor.spec.timeouts.stop)  # a member a dead daemon left behind
        port = await ctl.lease_port(self.unit_state_key(launch), host)
        self.ports[launch.rank] = port
        resolved = await ctl.resolve_model(actor.spec, engine, lambda _m: None)
        # The cards the plan gave this member on its host (tensor_parallel / nnodes of them), and
        # its share of each; the engine reads tensor_parallel as the total across the nodes.
        gpu_indices = list(ctl.gpus_for(actor, launch.rank))
        gpu_fraction, gpu_budget = ctl.launch_memory(actor, launch.rank)
        cores = ctl.cores_for(actor, launch.rank)
        ctx = LaunchContext(deployment=actor.spec, engine=engine, model_path=resolved.path, port=port,
                            gpu_indices=gpu_indices, cpu_threads=ctl.cpu_threads(actor.spec, host, cores),
                            cores=cores,
                            gpu_memory_fraction=gpu_fraction, gpu_memory_budget=gpu_budget,
                            nnodes=launch.nnodes, secret_dir=engine_credentials_dir(actor.unit),
                            dev_controls=ctl.dev_controls(host))
        plan = adapter.build_launch(ctx)
        if launch.is_head:
            actor.key = new_engine_key()
            actor.model_path = resolved.path
            actor.capabilities = adapter.capabilities(engine, deployment=actor.spec, model_path=resolved.path)
            actor.served_model = plan.served_model
        # One key file per member: hosts may share a filesystem, and one member's write must never
        # truncate a file another member's systemd is reading at exec time.
        # Every member's files hold the same key, each written whole (temporary file, then rename).
        credentials, encrypted = await ctl.launch_credentials_on(host, self.secret_name(launch), actor.key,
                                                                 plan.secret_file_contents(actor.key))
        self.secret_files[launch.rank] = sorted(plan.secret_files)
        devices = ctl.gpu_device_nodes(host, gpu_indices)
        confined = await ctl.engine_confinement(host, actor.name, engine_location(engine), resolved.path, devices)
        unit = TransientUnit(
            name=actor.unit,
            description=(f"CapyCTL deployment {actor.name} (rev {actor.revision.revision}, {engine.type}, "
                         f"rank {launch.rank} of {launch.nnodes})"),
            argv=[*plan.argv, *launch.flags],
            environment={**confined.environment, **plan.environment, **gpu_order_environment(gpu_indices),
                         **actor.spec.env},
            credentials=credentials, encrypted_credentials=encrypted,
            credential_environment=plan.credential_environment(), **confined.unit_fields(), working_directory="/",
            memory_max=actor.spec.resources.ram, **cpu_fields(actor.spec, cores),
            tasks_max=actor.spec.resources.tasks_max, devices=devices,
            markers={"deployment": actor.name, "revision": str(actor.revision.revision),
                     "launch": actor.launch_id or "", "port": str(port), "rank": str(launch.rank)})
        await systemd.start_transient(unit)

    async def stop(self, launch: MemberLaunch) -> None:
        host = launch.member.host
        if launch.is_head and self.head_local_port is not None and host != LOCAL:
            with contextlib.suppress(CapyError):
                await self.ctl.cancel_forward(host, self.head_local_port)
            self.head_local_port = None
        with contextlib.suppress(CapyError):
            await self.ctl.systemd_on(host).stop_unit(self.actor.unit, self.actor.spec.timeouts.stop)
        self.ctl.release_port(self.unit_state_key(launch))
        with contextlib.suppress(CapyError):  # the member's key file goes with it
            await self.ctl.remove_secret_key_on(host, self.secret_name(launch))
        await self.ctl.remove_secret_files_on(host, self.secret_files.pop(launch.rank, []))

    async def accepting(self, launch: MemberLaunch) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(launch.head_address, launch.dist_port), 2)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        return True

    async def _head_url(self, launch: MemberLaunch) -> str:
        host, port = launch.member.host, self.ports[launch.rank]
        if host == LOCAL:
            return f"http://127.0.0.1:{port}"
        if self.head_local_port is None:
            self.head_local_port = await self.ctl.forward_port(host, port)
        return f"http://127.0.0.1:{self.head_local_port}"

    async def healthy(self, launch: MemberLaunch) -> bool:
        url = await self._head_url(launch)
        return await self.ctl.adapter(self.actor.spec).health(self.ctl.http, url, self.actor.key)

    async def wait_exit(self, launch: MemberLaunch) -> str:
        from ..systemd import failure_message
        systemd = self.ctl.systemd_on(launch.member.host)
        async for st in systemd.watch(self.actor.unit):
            if st.active_state in ("failed", "inactive"):
                return failure_message(st)
        return "its unit disappeared"

    async def park(self, launch: MemberLaunch) -> None:
        adapter = self.ctl.adapter(self.actor.spec)
        await adapter.park(self.ctl.http, await self._head_url(launch), self.actor.key, TIER_SLEEP_LEVEL.get(self.actor.park_tier, 1))

    async def wake(self, launch: MemberLaunch) -> None:
        adapter = self.ctl.adapter(self.actor.spec)
        await adapter.wake(self.ctl.http, await self._head_url(launch), self.actor.key, TIER_SLEEP_LEVEL.get(self.actor.park_tier, 1))


class GroupUnits:
    """A multi-node deployment's group as its actor drives it: the ModelGroup (_group.py) over
    UnitMembers, made at its first wake (and again after one failed), and the watch that reports
    a member's failure through ``on_failed``. It changes no state of the deployment."""

    def __init__(self, owner: GroupOwner, on_failed: Callable[[GroupFailed], None]) -> None:
        self._owner = owner
        self._on_failed = on_failed
        self._group: ModelGroup | None = None
        self._members: UnitMembers | None = None
        self._watch: asyncio.Task | None = None

    @property
    def exists(self) -> bool:
        return self._group is not None

    @property
    def head_host(self) -> str:
        return self._group.head.member.host

    @property
    def head_port(self) -> int:
        return self._members.ports[0]

    @property
    def head_local_port(self) -> int | None:
        """The local end of the SSH forward to a remote head's API."""
        return self._members.head_local_port if self._members is not None else None

    @property
    def size(self) -> int:
        return len(self._group.launches)

    @property
    def parked_in_place(self) -> bool:
        return self._group.state == DeploymentState.PARKED and self._group.park_in_place

    async def prepare(self) -> None:
        """Make the group where there is none, or the last one failed."""
        if self._group is not None and self._group.state != DeploymentState.FAILED:
            return
        owner, ctl, spec = self._owner, self._owner.controller, self._owner.spec
        members = group_members(owner)
        self._members = UnitMembers(owner)
        in_place = ctl.adapter(spec).park_method(spec) == "in_place"
        self._group = ModelGroup(owner.name, ctl.engine_kind(spec), members, self._members,
                                 dist_port=await ctl.free_port_on(members[0].host),
                                 park_in_place=in_place and spec.park == "auto",
                                 start_timeout=spec.timeouts.start, stop_timeout=spec.timeouts.stop)

    async def start(self) -> None:
        """Head first, workers once it listens (ModelGroup.start)."""
        await self._group.start()

    async def wake(self, timeout: float) -> None:
        await asyncio.wait_for(self._group.wake(), timeout=timeout)

    def watch(self) -> None:
        """Report the group's failure once its members are stopped."""
        if self._watch is not None and not self._watch.done():
            return
        group = self._group

        async def watch() -> None:
            failure = await group.wait_failed()
            if group is self._group:
                self._on_failed(failure)

        self._watch = asyncio.create_task(watch(), name=f"group:{self._owner.name}")

    async def park(self, timeout: float) -> bool:
        """Park in place through the head, else stop every member and keep the group for the
        next wake to start; whether it parked in place."""
        if self._group.park_in_place:
            await asyncio.wait_for(self._group.park(), timeout=timeout)
            return True
        self._cancel_watch()
        await self._group.park()
        return False

    async def stop(self) -> None:
        """Stop every member and forget the group (the next wake makes a new one)."""
        group, self._group = self._group, None
        self._cancel_watch()
        await group.stop()

    def _cancel_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
