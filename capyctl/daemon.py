"""Wires the parts together: store, systemd client, controller, proxy, management API.

Lifecycle in the manner of uvicorn: configuration (capyctl.config), the server (this
module's ``Daemon``), and the process glue (``run_standalone`` / ``run_service``) that
handles signals and sd_notify.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Callable

from aiohttp import web

from . import descriptors, eventloop
from .api import build_api
from .bodies import BodyBudget
from .config import DaemonConfig
from .controller import Controller
from .errors import CapyError
from .proxy import DoorSettings, KeyGrant, build_app, listen_sockets_from_systemd, metrics_text, serve, token_digest
from .store import Store

log = logging.getLogger("capyctl")


# A verified key is remembered so that a request costs a dict lookup instead of a SQLite query
# on the event loop (benchmarks/proxy_hop.py profile); forgotten at once when this process
# creates or revokes a key, and after KEY_CACHE_SECONDS in case another process changed the
# database. Only valid keys are remembered, so random tokens cannot fill it.
KEY_CACHE_SECONDS = 5.0
KEY_CACHE_MAX = 4096


class StoreKeys:
    """The proxy's KeyVerifier backed by the state store (hashed keys, constant-time compare)."""

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self._clock = clock
        # digest(token) -> (Store.keys_generation, when verified, grant): never the token itself.
        self._verified: dict[bytes, tuple[int, float, KeyGrant]] = {}

    def verify(self, token: str) -> KeyGrant | None:
        digest = token_digest(token)
        generation, now = self.store.keys_generation, self._clock()
        known = self._verified.get(digest)
        if known is not None and known[0] == generation and now - known[1] < KEY_CACHE_SECONDS:
            return known[2]
        record = self.store.verify_key(token)
        if record is None:
            self._verified.pop(digest, None)
            return None
        grant = KeyGrant(record.name, record.models)
        if len(self._verified) >= KEY_CACHE_MAX:
            self._verified.clear()
        self._verified[digest] = (generation, now, grant)
        return grant


def sd_notify(message: str) -> bool:
    """sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(path)
        sock.sendall(message.encode())
    return True


class Daemon:
    def __init__(self, config: DaemonConfig, *, no_auth: bool = False) -> None:
        self.config = config
        self.no_auth = no_auth
        self.store: Store | None = None
        self.systemd = None
        self.controller: Controller | None = None
        self._runners: list[web.AppRunner] = []
        # Request bodies held in memory, one budget for the proxy and the management API.
        self.bodies = BodyBudget(config.bodies_memory_max)
        # The client connection cap that fits the descriptor limit (set by start; the door enforces it).
        self.connections: descriptors.ConnectionPlan | None = None

    async def start(self, sockets: dict[str, socket.socket] | None = None) -> None:
        from .systemd import SystemdClient
        # First: a limit that cannot hold even a few connections refuses the start before anything runs.
        door = self.door_settings()
        paths = self.config.paths
        paths.state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        self.store = Store(paths.database)
        self.systemd = await SystemdClient.connect(self.config.bus_address)
        self.controller = Controller(self.config, self.store, self.systemd)
        await self.controller.start()
        sockets = sockets or {}
        keys = None if self.no_auth else StoreKeys(self.store)
        # wait_progress is read per request, so that a reload (config_file.apply) turns it on or off.
        proxy = build_app(self.controller, keys, wait_progress=lambda: self.config.wait_progress,
                          bodies=self.bodies)
        if "openai" in sockets:
            self._runners.append(await serve(proxy, sock=sockets["openai"], door=door))
        else:
            self._runners.append(await serve(proxy, host_port=self.config.listen, door=door))
        from .api import Credentials
        api = build_api(self.controller, self.store,
                        Credentials(paths.credentials_dir, admin_token_path=self.config.admin_token_file),
                        metrics_text=lambda: metrics_text(proxy), bodies=self.bodies)
        api_sock = sockets.get("api") or self._bind_api_socket(paths.api_socket)
        self._runners.append(await serve(api, sock=api_sock))
        log.info("serving OpenAI endpoint on %s and management API on %s",
                 "systemd socket" if "openai" in sockets else self.config.listen, paths.api_socket)

    def door_settings(self) -> DoorSettings:
        """The proxy's connection limits, from the configuration file's ``door:``, the cap lowered
        to what the descriptor limit holds (``self.connections``; descriptors.plan_connections warns
        or refuses), the keyed share with it. Without keys (--no-auth) no connection is ever keyed,
        so none of the cap is kept for keyed ones."""
        from . import config_file
        file = self.config.file if self.config.file is not None else config_file.ConfigFile()
        door = DoorSettings(**file.door.model_dump())
        self.connections = plan = descriptors.plan_connections(door.connections_max)
        if plan.lowered:
            door = dataclasses.replace(door, connections_max=plan.connections_max,
                                       keyed_reserve=door.keyed_reserve * plan.connections_max // plan.asked,
                                       per_address_max=min(door.per_address_max, plan.connections_max))
        return dataclasses.replace(door, keyed_reserve=0) if self.no_auth else door

    @staticmethod
    def _bind_api_socket(path: Path) -> socket.socket:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # a stale socket from a daemon that died
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)  # 0660: root and the capyctl group
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        sock.listen(64)
        sock.setblocking(False)
        return sock

    def reload(self) -> dict:
        """Read the configuration file again (SIGHUP, ``systemctl reload capyctl``) and apply what
        can change live. A file that does not validate is refused whole: the daemon keeps running
        with its old configuration. Answers what was applied and what needs a restart."""
        from . import config_file
        config = self.config
        if config.config_path is None:
            return {"reloaded": False, "applied": [], "restart_needed": [], "error": None}
        try:
            new = config_file.load_config(config.config_path, required=config.config_required)
        except config_file.ConfigError as exc:
            for line in str(exc).splitlines():
                log.error("reload refused, keeping the running configuration: %s", line)
            return {"reloaded": False, "applied": [], "restart_needed": [], "error": exc.to_dict()}
        old = config.file or config_file.ConfigFile()
        applied, restart = config_file.changes(old, new)
        listen = config.listen
        admin_token_file = config.admin_token_file
        config_file.apply(config, new, config.overrides or config_file.Overrides())
        # What the running daemon cannot change stays as it started until a restart.
        config.listen, config.admin_token_file = listen, admin_token_file
        self.bodies.limit = config.bodies_memory_max
        config_file.set_log_level(config.log_level)
        if self.controller is not None:
            self.controller.reconfigured()
        log.info("reloaded %s: %s", config.config_path,
                 f"applied {', '.join(applied)}" if applied else "no live setting changed")
        if restart:
            log.warning("reload: %s changed in %s and takes effect at the next restart "
                        "(systemctl restart capyctl.service)", ", ".join(restart), config.config_path)
        return {"reloaded": True, "applied": applied, "restart_needed": restart, "error": None}

    async def stop(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        if self.controller:
            await self.controller.close()
        if self.systemd:
            await self.systemd.close()
        if self.store:
            self.store.close()


async def _main(config: DaemonConfig, *, no_auth: bool, sockets: dict | None) -> None:
    daemon = Daemon(config, no_auth=no_auth)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def reload() -> None:
        sd_notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            result = daemon.reload()
        finally:
            sd_notify("READY=1\nSTATUS=serving")
        if result["error"]:
            sd_notify("STATUS=serving; the last reload was refused: the configuration file is invalid "
                      "(see the journal)")
    loop.add_signal_handler(signal.SIGHUP, reload)
    await daemon.start(sockets)
    eventloop.freeze_startup_objects()
    sd_notify("READY=1\nSTATUS=serving")
    try:
        await stop.wait()
    finally:
        sd_notify("STOPPING=1")
        # Engine units keep serving: they live in capyctl.slice, and the next daemon adopts them.
        await daemon.stop()


def _logging(level: str = "info") -> None:
    level = level.upper()
    # Under systemd, journald adds the time; in a terminal, show it.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("INVOCATION_ID") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr)


def _run(config: DaemonConfig, *, no_auth: bool) -> int:
    _logging(config.log_level)
    # A shell or a bare systemd-run starts us with the soft default (1024), far under what the
    # connection caps need; capyctl.service sets LimitNOFILE= (soft and hard) itself.
    soft, hard = descriptors.raise_soft_limit()
    log.debug("file descriptor limit: %d (hard %d)", soft, hard)
    # Sockets passed by systemd (capyctl.socket, capyctl-api.socket) win over binding our own.
    sockets = listen_sockets_from_systemd()
    try:
        eventloop.run(_main(config, no_auth=no_auth, sockets=sockets))  # uvloop where installed
    except CapyError as exc:
        log.error("%s", exc)
        return 1
    return 0


def _configure(config_flag: str | None, *, listen: str | None = None,
               bus_address: str | None = None) -> DaemonConfig | None:
    """Flags, then the environment, then the configuration file, then the defaults."""
    from . import config_file
    path, required = config_file.config_path(config_flag)
    try:
        return config_file.build_config(path=path, required=required, bus_address=bus_address,
                                        overrides=config_file.Overrides.from_env(listen=listen))
    except config_file.ConfigError as exc:
        _logging()
        for line in str(exc).splitlines():
            log.error("%s: %s", exc.code, line)
        return None


def run_standalone(*, listen: str | None = None, no_auth: bool = False, bus_address: str | None = None,
                   config: str | None = None) -> int:
    """``capyctl start standalone``: binds HOST:PORT and the API socket itself unless systemd passed them."""
    settings = _configure(config, listen=listen, bus_address=bus_address)
    return 1 if settings is None else _run(settings, no_auth=no_auth)


def run_service(*, bus_address: str | None = None, config: str | None = None) -> int:
    """The system service: sockets come from capyctl.socket and capyctl-api.socket."""
    settings = _configure(config, bus_address=bus_address)
    return 1 if settings is None else _run(settings, no_auth=False)
