"""A descriptor shortage against the real daemon and the real llama-server (issue 45): the keyed
request the daemon cannot forward for want of a file descriptor gets the daemon's own
``503 out_of_file_descriptors``, never ``502 engine_unreachable``, and the deployment stays
``ready`` and serves again once descriptors are back.

The daemon runs as in every integration test (capyhost.py: systemd as PID 1 in a sandbox, the
settings of units/capyctl.service, LimitNOFILE= included). The shortage is made from outside with
prlimit(1): the daemon's soft RLIMIT_NOFILE is lowered to its lowest free descriptor number, so it
can open none, while the client's connection, opened before, still reaches it. No chat request
came before, so the proxy keeps no idle engine connection it could reuse.
"""

from __future__ import annotations

import http.client
import json

import pytest

from .capyhost import CapyHost

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

UNIT = "capyctl-smollm2.service"
# A descriptor the daemon closes between the lowering and the request (a health probe's
# connection, say) leaves one free: the shortage is made again and the request sent again.
TRIES = 5


def open_descriptors(host: CapyHost, pid: int) -> set[int]:
    return {int(name) for name in host.sh("ls", f"/proc/{pid}/fd").stdout.split()}


def limits(host: CapyHost, pid: int) -> tuple[int, int]:
    """The daemon's (soft, hard) RLIMIT_NOFILE."""
    line = next(line for line in host.sh("cat", f"/proc/{pid}/limits").stdout.splitlines()
                if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def starve(host: CapyHost, pid: int, hard: int) -> None:
    """No descriptor left to the daemon: its soft limit at its lowest free descriptor number."""
    in_use = open_descriptors(host, pid)
    lowest_free = next(n for n in range(len(in_use) + 1) if n not in in_use)
    host.sh("prlimit", f"--pid={pid}", f"--nofile={lowest_free}:{hard}")


def chat(conn: http.client.HTTPConnection, key: str) -> tuple[int, dict[str, str], dict]:
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 4, "temperature": 0})
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())


def test_a_descriptor_shortage_is_the_daemons_own_503_and_the_deployment_stays_ready(capyhost, smollm2) -> None:
    path = capyhost.write_manifest("smollm2", f"name: smollm2\nengine: llama\nmodel:\n  path: {smollm2}\n")
    capyhost.cli("deploy", "model", "--file", str(path), "--activate", "--wait")
    key = capyhost.create_key("--name", "fd")
    pid = capyhost.daemon_pid()
    soft, hard = limits(capyhost, pid)
    assert soft == hard == 16384  # units/capyctl.service's LimitNOFILE=, as the sandbox passes it

    conn = http.client.HTTPConnection("127.0.0.1", capyhost.port, timeout=120)
    try:
        conn.request("GET", "/health")  # the connection is open (and kept) before the shortage
        health = conn.getresponse()
        assert health.status == 200 and health.read()
        answers = []
        try:
            for _ in range(TRIES):
                starve(capyhost, pid, hard)
                answers.append(chat(conn, key))
                if answers[-1][0] != 200:
                    break
        finally:
            capyhost.sh("prlimit", f"--pid={pid}", f"--nofile={soft}:{hard}")
        status, headers, body = answers[-1]
        assert (status, body["error"]["code"]) == (503, "out_of_file_descriptors"), answers
        assert headers["retry-after"] == "1" and "not at fault" in body["error"]["message"]

        # Descriptors back: the same deployment answers, on the same engine unit.
        status, _, body = chat(conn, key)
        assert status == 200 and body["choices"], body
    finally:
        conn.close()
    state = capyhost.cli_json("status", "deployment", "smollm2")
    assert state["state"] == "ready", state
    assert capyhost.unit_property(UNIT, "ActiveState") == "active"
    journal = capyhost.daemon_journal(400)
    assert "ran out of file descriptors" in journal
    assert "did not answer its health check" not in journal
