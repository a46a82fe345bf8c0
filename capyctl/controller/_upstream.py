"""Where the proxy sends a deployment's requests (proxy/router.py ``Upstream``).

The proxy asks on every request, and the engine's kind is a store read (a SELECT and a validated
spec, slow next to an engine's token steps), so an Upstream is kept for as long as what it is
made of stays the same: one per launch and address.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..proxy.connector import socket_base_url
from ..proxy.router import Upstream


class RoutedDeployment(Protocol):
    """What an Upstream is made of (DeploymentActor provides it)."""

    controller: Any
    liveness: Any
    launch_id: str | None
    host: str
    socket_path: str | None  # the engine serves on a unix socket (its path on its host)
    key: str | None
    capabilities: frozenset[str]
    served_model: str | None

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> Any: ...
    def engine_address(self) -> tuple[int | None, str | None]: ...  # (port, unix socket) from here


class UpstreamCache:
    def __init__(self, deployment: RoutedDeployment) -> None:
        self._deployment = deployment
        self._cached: tuple[tuple, Any, Upstream] | None = None

    def get(self) -> Upstream:
        d = self._deployment
        made_of = (d.launch_id, d.host, d.engine_address(), d.key, d.capabilities, d.served_model)
        cached = self._cached
        if cached is not None and cached[0] == made_of and cached[1] is d.spec:
            return cached[2]
        upstream = self._make(made_of[2])
        self._cached = (made_of, d.spec, upstream)
        return upstream

    def _make(self, address: tuple[int | None, str | None]) -> Upstream:
        d = self._deployment
        launch = d.launch_id
        port, unix_socket = address
        kind = d.controller.engine_kind(d.spec)
        common = dict(deployment=d.name, host=d.host, api_key=d.key, engine=kind,
                      capabilities=d.capabilities, served_model=d.served_model,
                      connections_max=d.controller.engine_connections_max(kind, d.spec),
                      verdict=lambda: d.liveness.verdict(launch))
        if d.socket_path is not None:
            return Upstream(base_url=socket_base_url(d.name, launch or "none"), unix_socket=unix_socket, **common)
        return Upstream(base_url=f"http://127.0.0.1:{port}", **common)
