"""The proxy's backpressure against the real daemon (issue 32): a client that pipelines requests
and never reads its answers fills its own kernel buffers, not the daemon's memory, and the
daemon keeps answering everyone else.

The daemon runs as in every integration test (capyhost.py: systemd as PID 1 in a sandbox, the
settings of units/capyctl.service); no engine is needed, since ``GET /openapi.json`` (tens of KiB
an answer, about 40 bytes a request) and ``GET /health`` need no key. Before the fix the daemon
read up to a MiB of the flood ahead and wrote every answer to it into the client's transport,
unsent: some 30 KiB held for each 40-byte request, as fast as it could make answers. The kernel's
buffers take the flood faster than the daemon answers it, so its RSS is watched for a while after
the sending stops, not read once.

That the daemon keeps answering everyone else is checked without a time bound a loaded machine
could break: ``GET /health`` is answered while the flood is held (its timeout is a hang guard), and
the daemon spends little CPU time in the watch, as one that paused its reading does (one that
worked through the flood's answers would be busy the whole watch, whatever else ran beside it).
"""

from __future__ import annotations

import os
import select
import socket
import time

import pytest

from .capyhost import CapyHost, running_host

pytestmark = [pytest.mark.sandbox]

FLOOD_REQUEST = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
FLOOD_BYTES = 4 * 1024 * 1024  # sent at most
CLIENT_RCVBUF = 4096  # the flooding client's receive buffer: it takes almost nothing back
STALL_S = 3.0  # sending made no progress this long: the daemon stopped reading
RSS_GROWTH_MAX_KIB = 32 * 1024
# The daemon's RSS is watched this long once the sending stopped. Before the fix it grew by about
# 10 MiB a second here (an /openapi.json answer takes some ms to make), past the limit in 4 s.
WATCH_S = 10.0
HEALTH_HANG_GUARD_S = 60.0
# The daemon's CPU time in the watch, at most: a paused daemon spends some ms on its pollers.
CPU_IN_WATCH_MAX_S = WATCH_S / 4


@pytest.fixture
def host():
    with running_host() as h:
        yield h


def vm_rss_kib(host: CapyHost, pid: int) -> int:
    """VmRSS of ``pid`` (a PID of the sandbox's namespace), in KiB."""
    status = host.sh("cat", f"/proc/{pid}/status").stdout
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1])


def cpu_seconds(host: CapyHost, pid: int) -> float:
    """The user and system CPU time ``pid`` has used (/proc/PID/stat, fields 14 and 15), in seconds."""
    fields = host.sh("cat", f"/proc/{pid}/stat").stdout.rsplit(")", 1)[1].split()  # from field 3
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ask(port: int, request: bytes, timeout: float) -> tuple[bytes, float]:
    """The whole answer to one request on a new connection (closed after it), and how long it took."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.settimeout(timeout)
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data, time.monotonic() - started


def flood(port: int) -> tuple[socket.socket, int]:
    """A connection that pipelines FLOOD_REQUEST and never reads, until FLOOD_BYTES are sent or
    sending made no progress for STALL_S. Returned open, with the bytes sent."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Before connect: the window it advertises is set at the handshake.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    stream = FLOOD_REQUEST * (65536 // len(FLOOD_REQUEST))
    sent, offset = 0, 0
    last_progress = time.monotonic()
    while sent < FLOOD_BYTES:
        now = time.monotonic()
        if now - last_progress >= STALL_S:
            break
        _, writable, _ = select.select([], [sock], [], max(0.0, STALL_S - (now - last_progress)))
        if not writable:
            continue
        try:
            n = sock.send(stream[offset:offset + FLOOD_BYTES - sent])
        except BlockingIOError:
            continue
        if n:
            sent += n
            offset = (offset + n) % len(FLOOD_REQUEST)  # the stream repeats the request: stay in step
            last_progress = time.monotonic()
    return sock, sent


def test_a_client_that_pipelines_and_never_reads_holds_no_daemon_memory(host: CapyHost) -> None:
    pid = host.daemon_pid()
    # Answer each route once first, so that what a first answer loads is in the "before".
    for path in ("/openapi.json", "/health"):
        answer, _ = ask(host.port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode(), 10)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    before = vm_rss_kib(host, pid)

    sock, sent = flood(host.port)
    try:
        try:
            health, took = ask(host.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                               HEALTH_HANG_GUARD_S)
        except OSError as exc:  # socket.timeout included
            health, took = f"no answer: {exc!r}".encode(), float("inf")
        cpu_before = cpu_seconds(host, pid)
        after, watch_until = before, time.monotonic() + WATCH_S
        while time.monotonic() < watch_until:
            after = max(after, vm_rss_kib(host, pid))
            time.sleep(0.2)
        cpu = cpu_seconds(host, pid) - cpu_before
    finally:
        sock.close()
    growth = after - before
    print(f"\nflood: {sent} bytes sent ({sent // len(FLOOD_REQUEST)} requests); daemon VmRSS {before} KiB before, "
          f"at most {after} KiB in the {WATCH_S:g} s after (+{growth / 1024:.1f} MiB), {cpu:.2f} s of CPU; "
          f"/health in {took:.3f} s")
    assert growth < RSS_GROWTH_MAX_KIB, (
        f"the daemon's RSS grew by {growth / 1024:.1f} MiB ({before} -> {after} KiB) while a client that never "
        f"reads pipelined {sent} bytes of requests: it held the answers instead of pausing its reading")
    assert health.startswith(b"HTTP/1.1 200 "), f"GET /health during the flood: {health[:200]!r} after {took:.3f} s"
    assert cpu <= CPU_IN_WATCH_MAX_S, (
        f"the daemon used {cpu:.2f} s of CPU in the {WATCH_S:g} s after a client that never reads pipelined "
        f"{sent} bytes of requests: it was still working through them instead of pausing its reading")

