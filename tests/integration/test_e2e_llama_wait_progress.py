"""A streamed request to a parked model hears of its wake (issue 31, point 3): the daemon in
the systemd sandbox, the real llama-server, and the official ``openai`` and ``anthropic``
clients, which must read the whole stream past the proxy's SSE comments; and a reload with
``wait_progress: false`` turns the comments off."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import anthropic
import openai
import pytest

from tests.components import missing, require_root
from tests.unit.test_proxy_wait_progress import tapped

from .capyhost import CapyHost, llama_server_path

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

MESSAGES = [{"role": "user", "content": "Count to five."}]


def manifest(model_path: str) -> str:
    return f"name: smollm2\nengine: llama\nmodel:\n  path: {model_path}\n"


def parked(capyhost) -> int:
    """Park smollm2; its count of wakes so far."""
    capyhost.cli("park", "deployment", "smollm2")
    status = capyhost.cli_json("status", "deployment", "smollm2")
    assert status["state"] == "parked"
    return status["wakes"]


def woke_once_more(capyhost, wakes: int) -> None:
    status = capyhost.cli_json("status", "deployment", "smollm2")
    assert status["state"] == "ready" and status["wakes"] == wakes + 1


def raw_stream(base_url: str, key: str) -> list[tuple[float, bytes]]:
    """A streamed chat answer's lines, each with the time it arrived (urllib undoes the chunked framing)."""
    request = urllib.request.Request(
        base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}",
                                                    "Content-Type": "application/json"},
        data=json.dumps({"model": "smollm2", "messages": MESSAGES, "max_tokens": 16, "stream": True}).encode())
    lines = []
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/event-stream")
        while line := answer.readline():
            lines.append((time.monotonic(), line))
    return lines


def test_streams_through_a_wake_carry_comments_the_clients_skip(capyhost, smollm2):
    path = capyhost.write_manifest("smollm2", manifest(smollm2))
    capyhost.cli("deploy", "model", "--file", str(path), "--activate", "--wait")
    key = capyhost.create_key("--name", "wait-progress")

    # On the wire: the wake's comments come first, each a ": " line and a blank line, then the
    # engine's events to [DONE].
    wakes = parked(capyhost)
    lines = raw_stream(capyhost.base_url, key)
    woke_once_more(capyhost, wakes)
    said = [(at, line) for at, line in lines if line.startswith(b":")]
    assert any(line.startswith(b": waking") for _, line in said), lines[:10]
    first_event = next(i for i, (_, line) in enumerate(lines) if line.startswith(b"data:"))
    assert all(line.startswith(b":") or line == b"\n" for _, line in lines[:first_event])
    assert not any(line.startswith(b":") for _, line in lines[first_event:])
    for (before, _), (after, _) in zip(said, said[1:]):  # at most one a second
        assert after - before >= 0.9, said
    assert lines[-2][1] == b"data: [DONE]\n"

    # The official clients read the stream whole, through a relay that records what they were sent.
    wakes = parked(capyhost)
    text, wire = asyncio.run(openai_stream(capyhost.base_url, key))
    woke_once_more(capyhost, wakes)
    assert text.strip() and b"\r\n: waking" in wire

    wakes = parked(capyhost)
    kinds, text, wire = asyncio.run(anthropic_stream(capyhost.base_url, key))
    woke_once_more(capyhost, wakes)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert text.strip() and b"\r\n: waking" in wire


async def openai_stream(base_url: str, key: str) -> tuple[str, bytes]:
    async with tapped(base_url) as (url, wire):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        try:
            stream = await client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16,
                                                          stream=True)
            chunks = [chunk async for chunk in stream]
        finally:
            await client.close()
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)  # the last chunk came
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), bytes(wire)


async def anthropic_stream(base_url: str, key: str) -> tuple[list[str], str, bytes]:
    async with tapped(base_url) as (url, wire):
        client = anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0, timeout=120)
        try:
            async with client.messages.stream(model="smollm2", max_tokens=16, messages=MESSAGES) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_message()
        finally:
            await client.close()
    return kinds, "".join(block.text for block in final.content if block.type == "text"), bytes(wire)


@pytest.fixture
def configured_host():
    """A sandboxed daemon that reads its configuration file (CAPYCTL_CONFIG), llama-server as 'llama'."""
    require_root()
    if llama_server_path() is None:
        missing("llama-server is not built; run scripts/build-llama-server (scripts/test does)")
    host = CapyHost()
    config = host.root / "config.yaml"
    host.env["CAPYCTL_CONFIG"] = str(config)
    host.boot()  # (it empties host.root: the file is written after)
    try:
        config.write_text("wait_progress: true\n")
        host.start_daemon()
        host.cli("engine", "add", llama_server_path(), "--name", "llama")
        yield host, config
    finally:
        try:
            print(host.daemon_journal(200))
        finally:
            host.teardown()


def test_a_reload_turns_the_comments_off(configured_host, smollm2):
    host, config = configured_host
    host.cli("deploy", "model", "--file", str(host.write_manifest("smollm2", manifest(smollm2))),
             "--activate", "--wait")
    key = host.create_key("--name", "wait-progress")
    wakes = parked(host)
    assert any(line.startswith(b": waking") for _, line in raw_stream(host.base_url, key))
    woke_once_more(host, wakes)

    config.write_text("wait_progress: false\n")
    host.sh("systemctl", "kill", "--signal=HUP", "capytest-daemon.service")  # what systemctl reload sends
    deadline = time.monotonic() + 30
    while "applied wait_progress" not in host.daemon_journal(50):
        assert time.monotonic() < deadline, host.daemon_journal(50)
        time.sleep(0.2)
    wakes = parked(host)
    lines = raw_stream(host.base_url, key)
    woke_once_more(host, wakes)
    assert lines[0][1].startswith(b"data:") and not any(line.startswith(b":") for _, line in lines)
    assert lines[-2][1] == b"data: [DONE]\n"
