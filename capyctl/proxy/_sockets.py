"""Listening sockets: the ones systemd passes (socket activation), or one we bind."""

from __future__ import annotations

import fcntl
import os
import socket
from typing import MutableMapping, Sequence

from aiohttp import web
from aiohttp.log import access_logger

from ..errors import CapyError
from ._app import STATE
from . import _client_side
from ._door import DoorSettings, DoorSite

SD_LISTEN_FDS_START = 3


def listen_sockets_from_systemd(names: Sequence[str] = ("openai", "api"), *,
                                env: MutableMapping[str, str] | None = None) -> dict[str, socket.socket]:
    """The sockets systemd passed to this process, by name; empty when it passed none.

    Reads LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES as sd_listen_fds(3) documents them.
    Plain os/socket rather than pystemd: the protocol is three environment variables
    and consecutive fds from 3, and pystemd would add a C build (libsystemd-dev) to
    the proxy's dependencies for it. When LISTEN_FDNAMES is absent (FileDescriptorName=
    unset in an older unit), the fds take ``names`` in order; fds beyond those are
    named "fd<N>". The variables are removed afterwards so that child processes never
    mistake them for their own, and each fd is made close-on-exec.
    """
    env = os.environ if env is None else env
    pid, count = env.get("LISTEN_PID"), env.get("LISTEN_FDS")
    if not pid or not count:
        return {}
    try:
        if int(pid) != os.getpid():
            return {}  # meant for another process (we were started by the one they were for)
        n_fds = int(count)
    except ValueError:
        raise CapyError(f"LISTEN_PID={pid!r} / LISTEN_FDS={count!r} are not numbers.",
                        code="bad_socket_activation", status=500) from None
    fd_names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else list(names)
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(key, None)
    sockets: dict[str, socket.socket] = {}
    for index in range(n_fds):
        fd = SD_LISTEN_FDS_START + index
        name = fd_names[index] if index < len(fd_names) and fd_names[index] else f"fd{fd}"
        if name in sockets:
            raise CapyError(f"systemd passed two sockets named {name!r}.", code="bad_socket_activation",
                            status=500)
        fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
        sock = socket.socket(fileno=fd)  # family and type come from the fd itself
        sock.setblocking(False)
        sockets[name] = sock
    return sockets


def _split_host_port(host_port: str) -> tuple[str, int]:
    host, sep, port = host_port.rpartition(":")
    if not sep or not port.isdigit():
        raise CapyError(f"'{host_port}' is not HOST:PORT.", code="invalid_listen_address", status=400)
    return host.strip("[]") or "127.0.0.1", int(port)


async def serve(app: web.Application, *, sock: socket.socket | None = None,
                host_port: str | None = None, shutdown_timeout: float = 10.0,
                door: DoorSettings | None = None) -> web.AppRunner:
    """Start serving ``app`` on a passed socket or on HOST:PORT; the caller cleans the runner up.

    Handlers are cancelled when their client disconnects (handler_cancellation), which is
    how a client that goes away leaves its queue slot and stops its upstream request. ``door``:
    the proxy's connections are aiohttp's, held to those limits (_door.DoorSite, as the daemon
    serves it); without it, the proxy's own front serves them (_client_side) until it is removed.
    """
    if (sock is None) == (host_port is None):
        raise CapyError("Give either a socket or a HOST:PORT to serve on.", code="invalid_listen_address",
                        status=400)
    # No access log: aiohttp's would format and write one line per request (to the journal, under
    # the daemon's INFO logging), a cost on every request for what /metrics already counts.
    # CAPYCTL_ACCESS_LOG=1 turns it on for debugging.
    access_log = access_logger if os.environ.get("CAPYCTL_ACCESS_LOG") == "1" else None
    # Idle kept-alive connections close after KEEPALIVE_S in aiohttp's server as in the front.
    keepalive = door.keepalive_timeout if door is not None else _client_side.KEEPALIVE_S
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout,
                           access_log=access_log, keepalive_timeout=keepalive)
    await runner.setup()
    try:
        host, port = _split_host_port(host_port or "") if sock is None else ("", 0)
        site: web.BaseSite
        if STATE in app and door is not None:  # the proxy, its connections held to the door's limits
            site = DoorSite(runner, door, sock=sock, host=host, port=port)
        elif STATE in app:  # the proxy: its connections are the front's (_client_side), capped
            site = _client_side.FrontSite(runner, sock=sock, host=host, port=port, shutdown_timeout=shutdown_timeout)
        elif sock is not None:
            site = web.SockSite(runner, sock)
        else:
            site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
