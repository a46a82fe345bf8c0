"""Engine ports: leases each deployment a loopback port on the host its engine runs on, so that
no two engines there are given the same one."""

from __future__ import annotations

import socket

from ..errors import CapyError
from ._hosts import LOCAL, HostRegistry


class PortLeases:
    """The port each deployment's engine listens on, per host (a remote host is asked for free ones)."""

    def __init__(self, hosts: HostRegistry) -> None:
        self._hosts = hosts
        self._ports: dict[str, tuple[str, int]] = {}  # deployment -> (host, engine port there)

    async def lease(self, name: str, host: str = LOCAL) -> int:
        """A loopback port for the engine on ``host`` (asked of the host itself when remote)."""
        if name in self._ports and self._ports[name][0] == host:
            return self._ports[name][1]
        used = {port for h, port in self._ports.values() if h == host}
        if host != LOCAL:
            port = await self._hosts.free_port(host, used)
            self._ports[name] = (host, port)
            return port
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in used:
                self._ports[name] = (host, port)
                return port
        raise CapyError("no free loopback port for the engine", code="no_port")

    def claim(self, name: str, port: int | None, host: str = LOCAL) -> None:
        """Record the port an adopted engine already listens on."""
        if port:
            self._ports[name] = (host, port)

    def release(self, name: str) -> None:
        self._ports.pop(name, None)

    async def free_port_on(self, host: str) -> int:
        """A port free on ``host`` now, leased to no deployment (a multi-node group's rendezvous)."""
        return await self._hosts.free_port(host, set())
