"""The door's limits against the real daemon (issue 45, part 3; capyctl/proxy/_door.py): half-sent
request heads are closed at the head deadline, one address past its cap is refused alone, and
keyed clients are served while a flood of half heads from many addresses holds every slot it may.

The daemon runs as in every integration test (capyhost.py: systemd as PID 1 in a sandbox, the
settings of units/capyctl.service), with a configuration file that shortens the head deadline and
makes the caps small. No engine is needed: ``GET /health`` needs no key, and ``GET /v1/models``
checks one. Client addresses are told apart by binding the clients' sockets to other loopback
addresses. What the daemon does at the deadline is awaited as the event it is (the answer and the
close), never timed.
"""

from __future__ import annotations

import collections
import json
import socket
import threading
import time

import pytest

from .capyhost import CapyHost, running_host

pytestmark = [pytest.mark.sandbox]

CONFIG = """\
# /etc/capyctl/config.yaml of these tests: a short head deadline, small caps
door:
  head_timeout: 1s
  connections_max: 40
  per_address_max: 8
  keyed_reserve: 8
"""
PER_ADDRESS_MAX, UNKEYED_MAX = 8, 32
GUARD_S = 30.0  # a socket's timeout: only reached when the behaviour under test is broken
HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"  # no blank line: never whole
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
ATTACK_ADDRESSES = [f"127.0.1.{n}" for n in range(1, 9)]
ATTACK_MAX = 5000  # connections the attack opens at most
ATTACK_MAX_S = 120.0
ATTACK_HELD = 64  # the attack's sockets kept open (8 addresses, at most 8 each in the daemon)
ATTACK_UNDER_WAY = 4 * UNKEYED_MAX  # connections opened before the keyed clients start
KEYED_REQUESTS = 20


@pytest.fixture(scope="module")
def host():
    with running_host(config=CONFIG) as h:
        yield h


def connect(port: int, source: str = "127.0.0.1", timeout: float = GUARD_S) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


def parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one answer."""
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole answer on a kept-alive connection (by its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    status, headers, body = parse(data)
    while len(body) < int(headers.get("content-length", "0")):
        body += sock.recv(65536)
    return status, headers, body


def read_to_close(sock: socket.socket) -> bytes:
    """All the daemon sends until it closes (a reset after its answer, where bytes of ours were still
    unread at its close, ends it as well)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        if not data:
            raise
    return data


def door_answer(data: bytes) -> tuple[int, str]:
    """The status and code of an answer the door closed the connection with."""
    status, headers, body = parse(data)
    assert headers.get("connection") == "close", data
    return status, json.loads(body)["error"]["code"]


def test_a_half_head_is_answered_408_and_closed_at_the_deadline(host: CapyHost) -> None:
    with connect(host.port) as sock:
        sock.sendall(HALF_HEAD)
        data = read_to_close(sock)  # the daemon's close is the event awaited
    assert door_answer(data) == (408, "request_head_timeout"), data


def test_past_the_per_address_cap_only_that_address_is_refused(host: CapyHost) -> None:
    kept = [connect(host.port, "127.0.0.2") for _ in range(PER_ADDRESS_MAX)]
    try:
        for sock in kept:  # each answered, then idle: kept alive, not cut at the head deadline
            sock.sendall(HEALTH)
            assert read_answer(sock)[0] == 200
        with connect(host.port, "127.0.0.2") as sock:
            sock.sendall(HEALTH)
            data = read_to_close(sock)
        assert door_answer(data) == (503, "too_many_connections_from_address"), data
        with connect(host.port, "127.0.0.3") as sock:
            sock.sendall(HEALTH)
            assert read_answer(sock)[0] == 200
    finally:
        for sock in kept:
            sock.close()


class HalfHeads(threading.Thread):
    """One client without a key opening connections from ATTACK_ADDRESSES, a half head on each, as
    fast as the daemon takes them, until told to stop (or ATTACK_MAX, or ATTACK_MAX_S)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.held: collections.deque[socket.socket] = collections.deque()
        self.opened = 0
        self.failed = 0
        self.under_way = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        until = time.monotonic() + ATTACK_MAX_S
        while not self.stop.is_set() and self.opened < ATTACK_MAX and time.monotonic() < until:
            try:
                sock = connect(self.port, ATTACK_ADDRESSES[self.opened % len(ATTACK_ADDRESSES)], timeout=5.0)
                sock.sendall(HALF_HEAD)
            except OSError:
                self.failed += 1
                continue
            self.held.append(sock)
            self.opened += 1
            while len(self.held) > ATTACK_HELD:
                self.held.popleft().close()
            if self.opened >= ATTACK_UNDER_WAY:
                self.under_way.set()
            time.sleep(0.002)


def test_keyed_requests_are_served_during_an_attack_of_half_heads(host: CapyHost) -> None:
    key = host.create_key("--name", "door")
    models = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    attack = HalfHeads(host.port)
    with connect(host.port) as kept_alive:
        kept_alive.sendall(models)  # keyed before the attack
        assert read_answer(kept_alive)[0] == 200
        attack.start()
        try:
            assert attack.under_way.wait(GUARD_S), f"the attack opened {attack.opened}, {attack.failed} failed"
            answers = []
            for _ in range(KEYED_REQUESTS):
                with connect(host.port) as sock:  # a new connection: it must find room
                    sock.sendall(models)
                    answers.append(read_answer(sock)[0])
                kept_alive.sendall(models)
                answers.append(read_answer(kept_alive)[0])
            opened_meanwhile = attack.opened
        finally:
            attack.stop.set()
            attack.join(GUARD_S)
    print(f"\nattack: {attack.opened} half heads opened ({attack.failed} failed); keyed answers: {answers}")
    assert answers == [200] * (2 * KEYED_REQUESTS), answers
    assert opened_meanwhile > ATTACK_UNDER_WAY  # (the keyed requests ran while the attack went on)
    # Every half head the attack still held was closed by the door: pushed out for newer ones, or
    # at the head deadline.
    endings = collections.Counter()
    for sock in attack.held:
        with sock:
            sock.settimeout(GUARD_S)
            endings[door_answer(read_to_close(sock))] += 1
    assert set(endings) <= {(503, "too_many_connections"), (408, "request_head_timeout")}, endings
    assert endings[(408, "request_head_timeout")] >= 1, endings
