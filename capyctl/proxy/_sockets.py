"""Listening sockets: the ones systemd passes (socket activation), or one we bind."""

from __future__ import annotations

import fcntl
import os
import socket
from typing import MutableMapping, Sequence

from aiohttp import web
from aiohttp.log import access_logger

from ..errors import CapyError
from ._door import DoorSite
from ._door_settings import DoorSettings

SD_LISTEN_FDS_START = 3
# Idle kept-alive client connections are closed after this long (aiohttp's own default,
# RequestHandler's keepalive_timeout in aiohttp/web_protocol.py, is about an hour).
KEEPALIVE_S = 75.0
# aiohttp's server is the one HTTP/1.1 parser facing clients; its limits on a request head, set
# here so that they are stated, not inherited: a request line and a header line (name and value,
# for the first header; the value alone for the others: aiohttp/_http_parser.pyx,
# cb_on_header_field and cb_on_header_value) of at most HEAD_LINE_MAX bytes, at most HEADERS_MAX
# header lines; past them, aiohttp's parser refuses the head (400, connection closed). These are
# aiohttp's own defaults (RequestHandler, aiohttp/web_protocol.py). The body's limit is the app's
# client_max_size (build_app's max_body).
HEAD_LINE_MAX = 8190
HEADERS_MAX = 128


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

    aiohttp's web server reads every request. Handlers are cancelled when their client
    disconnects (handler_cancellation), which is how a client that goes away leaves its queue
    slot and stops its upstream request. With ``door`` (the daemon's proxy), connections come in
    through the door (_door.DoorSite), held to its limits; without it (the management API, a
    test's app), through aiohttp's own sites.
    """
    if (sock is None) == (host_port is None):
        raise CapyError("Give either a socket or a HOST:PORT to serve on.", code="invalid_listen_address",
                        status=400)
    # No access log: aiohttp's would format and write one line per request (to the journal, under
    # the daemon's INFO logging), a cost on every request for what /metrics already counts.
    # CAPYCTL_ACCESS_LOG=1 turns it on for debugging.
    access_log = access_logger if os.environ.get("CAPYCTL_ACCESS_LOG") == "1" else None
    # (Its keyword arguments reach each connection's RequestHandler: aiohttp/web_runner.py
    # AppRunner._make_server, then web_app.py Application._make_handler and web_server.py Server.)
    keepalive = door.keepalive_timeout if door is not None else KEEPALIVE_S
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout,
                           access_log=access_log, keepalive_timeout=keepalive, max_line_size=HEAD_LINE_MAX,
                           max_field_size=HEAD_LINE_MAX, max_headers=HEADERS_MAX)
    await runner.setup()
    try:
        site: web.BaseSite
        if door is not None:
            host, port = _split_host_port(host_port or "") if sock is None else ("", 0)
            site = DoorSite(runner, door, sock=sock, host=host, port=port)
        elif sock is not None:
            site = web.SockSite(runner, sock)
        else:
            host, port = _split_host_port(host_port or "")
            site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
