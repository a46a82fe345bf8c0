"""The SGLang adapter against SGLang 0.5.23's source, through tests/fakes/fake_sglang.py.

Launch flags (memory saver with the weights' CPU backup, --tp-size as the total across nodes,
--mem-fraction-static), the key in a 0600 --config YAML instead of argv, and park/wake that
releases every tag once and resumes only what it released: real SGLang kills the whole server
on a release with a request running, a second release, a resume of a tag not released, or
generation on released memory, and the fake does too.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import yaml

from capyctl.controller._group import multinode_flags
from capyctl.engines import LaunchContext, adapter_for
from capyctl.engines.sglang import PARK_TAGS, SglangAdapter
from capyctl.errors import CapyError, EngineError
from capyctl.spec import DeploymentSpec, EngineSpec
from tests.fakes import free_port, make_fake_sglang_venv, start_plan
from tests.fakes.fake_sglang import build_parser, merge_config

# All digits with a leading zero: unquoted in YAML it would load as an (octal) int, not this string.
KEY = "0" + "7" * 63
KEY_REF = "${CAPYCTL_ENGINE_KEY}"
SECRETS = "/var/lib/capyctl/secrets"


def deployment(**kw) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "chat-small", "engine": "sglang", "model": {"path": "/models/m"},
                                          **kw})


def engine(path: str = "/opt/engine") -> EngineSpec:
    return EngineSpec.model_validate({"kind": "engine", "name": "e1", "type": "sglang", "path": path})


def ctx(dep: DeploymentSpec | None = None, **kw) -> LaunchContext:
    kw.setdefault("secret_dir", SECRETS)
    return LaunchContext(deployment=dep or deployment(), engine=engine(), model_path="/models/m", port=41234, **kw)


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# -- build_launch ------------------------------------------------------------------------------

def test_parking_in_place_launches_with_the_memory_saver_and_the_weights_cpu_backup():
    argv = SglangAdapter().build_launch(ctx()).argv
    assert "--enable-memory-saver" in argv and "--enable-weights-cpu-backup" in argv
    for c in (ctx(dev_controls=False), ctx(deployment(park="stop"))):
        argv = SglangAdapter().build_launch(c).argv
        assert "--enable-memory-saver" not in argv and "--enable-weights-cpu-backup" not in argv


def test_tensor_parallel_is_tp_size_and_the_total_across_nodes():
    dep = deployment(tensor_parallel=4, resources={"gpus": 4})
    argv = SglangAdapter().build_launch(ctx(dep, gpu_indices=[0, 1, 2, 3])).argv
    assert flag_value(argv, "--tp-size") == "4" and "--tp" not in argv
    # Two nodes of two GPUs each: SGLang runs tp_size // nnodes ranks per node.
    argv = SglangAdapter().build_launch(ctx(dep, gpu_indices=[0, 1], nnodes=2)).argv
    assert flag_value(argv, "--tp-size") == "4"
    with pytest.raises(CapyError) as err:
        SglangAdapter().build_launch(ctx(dep, gpu_indices=[0], nnodes=2))
    assert err.value.code == "gpu_count_mismatch"
    with pytest.raises(CapyError) as err:  # SGLang asserts tp_size % nnodes == 0 (validation_hook.py)
        SglangAdapter().build_launch(ctx(deployment(tensor_parallel=3), gpu_indices=[0, 1], nnodes=2))
    assert err.value.code == "invalid_topology"
    assert "--tp-size" not in SglangAdapter().build_launch(ctx()).argv  # tp 1: SGLang's default


def test_the_key_is_in_a_config_file_not_in_argv():
    plan = SglangAdapter().build_launch(ctx())
    path = flag_value(plan.argv, "--config")
    assert path == f"{SECRETS}/chat-small.sglang.yaml"
    assert "--api-key" not in plan.argv and KEY_REF not in plan.argv
    assert plan.secret_environment == {}
    assert list(plan.secret_files) == ["chat-small.sglang.yaml"]
    assert all(KEY not in text for text in plan.secret_files.values())  # a template, no key yet
    (text,) = plan.secret_file_contents(KEY).values()
    assert yaml.safe_load(text) == {"api-key": KEY}  # a string, leading zero and all


def test_the_config_file_gives_sglangs_parser_the_key(tmp_path):
    c = ctx(secret_dir=str(tmp_path))
    plan = SglangAdapter().build_launch(c)
    for name, text in plan.secret_file_contents(KEY).items():
        (tmp_path / name).write_text(text)
    parser = build_parser()  # the fake's flags are SGLang's names; unknown flags exit 2 as in SGLang
    args = parser.parse_args(merge_config(parser, plan.argv[3:]))
    assert args.api_key == KEY and args.enable_memory_saver and args.enable_weights_cpu_backup
    assert args.model == "/models/m" and args.port == 41234 and args.served_model_name == "chat-small"


def test_without_a_secret_dir_the_launch_is_refused_rather_than_leak_the_key():
    with pytest.raises(CapyError) as err:
        SglangAdapter().build_launch(ctx(secret_dir=None))
    assert err.value.code == "secret_dir_missing"


@pytest.mark.parametrize("args", [["--config", "/tmp/mine.yaml"], ["--api-key", "x"], ["--api-key=x"]])
def test_engine_args_cannot_take_the_key_route(args):
    with pytest.raises(CapyError) as err:
        SglangAdapter().build_launch(ctx(deployment(engine_args=args)))
    assert err.value.code == "engine_args_conflict"


def test_gpu_memory_fraction_becomes_mem_fraction_static():
    argv = SglangAdapter().build_launch(ctx(gpu_memory_fraction=0.45)).argv
    assert flag_value(argv, "--mem-fraction-static") == "0.45"
    assert flag_value(SglangAdapter().build_launch(ctx(gpu_memory_fraction=0.123456)).argv,
                      "--mem-fraction-static") == "0.1234"  # rounded down, never above the plan
    assert "--mem-fraction-static" not in SglangAdapter().build_launch(ctx()).argv
    user = SglangAdapter().build_launch(ctx(deployment(engine_args=["--mem-fraction-static", "0.3"]),
                                            gpu_memory_fraction=0.45)).argv
    assert user.count("--mem-fraction-static") == 1 and flag_value(user, "--mem-fraction-static") == "0.3"


def test_multinode_flags_are_sglangs():
    assert multinode_flags("sglang", nnodes=2, rank=1, head_address="10.0.0.1", dist_port=5000) == [
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000"]
    assert multinode_flags("sglang", nnodes=2, rank=0, head_address="fd00::1", dist_port=5000)[-1] == "[fd00::1]:5000"
    plan = SglangAdapter().build_launch(ctx(deployment(tensor_parallel=2), gpu_indices=[0], nnodes=2))
    parser = build_parser()
    args = parser.parse_args([*plan.argv[3:], "--api-key", "k",
                              *multinode_flags("sglang", nnodes=2, rank=1, head_address="h", dist_port=1)])
    assert (args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr) == (2, 2, 1, "h:1")


def test_sglang_serves_on_tcp_only():
    assert adapter_for("sglang").unix_socket is False
    assert SglangAdapter().build_launch(ctx(socket_path="/run/x.sock")).socket_path is None


# -- against the fake --------------------------------------------------------------------------

@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


def launch(tmp_path: Path, adapter: SglangAdapter | None = None, **spec):
    venv = make_fake_sglang_venv(tmp_path / "sglang-env")
    eng = EngineSpec(kind="engine", name="sglang-fake", type="sglang", path=str(venv))
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700, exist_ok=True)
    dep = DeploymentSpec(name="tiny", engine=eng.name, model={"path": str(model_dir)}, **spec)
    port = free_port()
    c = LaunchContext(deployment=dep, engine=eng, model_path=str(model_dir), port=port, secret_dir=str(secrets))
    adapter = adapter or SglangAdapter()
    plan = adapter.build_launch(c)
    server = start_plan(plan, KEY, port, log_path=tmp_path / "sglang.log", secret_dir=secrets)
    return adapter, plan, server


async def wait_health(session, server):
    for _ in range(300):
        assert server.proc.poll() is None, "the fake SGLang exited"
        try:
            async with session.get(server.base_url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("the fake SGLang never became healthy")


async def chat(session, base_url, key=KEY, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "say hi"}], **extra}
    async with session.post(base_url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json()


async def stats(session, base_url):
    async with session.get(base_url + "/fake/stats") as r:
        return await r.json()


def exit_status(server, timeout: float = 10) -> int:
    return server.proc.wait(timeout)


async def test_park_and_wake_release_every_tag_and_keep_the_weights(tmp_path, session):
    adapter, plan, server = launch(tmp_path)
    try:
        await wait_health(session, server)
        status, reference = await chat(session, server.base_url)
        assert status == 200
        await adapter.park(session, server.base_url, KEY, 1)
        s = await stats(session, server.base_url)
        assert s["released_tags"] == sorted(PARK_TAGS) == s["paused_regions"]  # cuda_graph included
        assert adapter.released_tags(server.base_url, KEY) == set(PARK_TAGS)
        await adapter.wake(session, server.base_url, KEY, 1)
        status, answer = await chat(session, server.base_url)
        assert status == 200
        # Without --enable-weights-cpu-backup the resumed weights are uninitialised memory.
        assert answer["choices"][0]["message"] == reference["choices"][0]["message"]
        s = await stats(session, server.base_url)
        assert (s["release_calls"], s["resume_calls"], s["released_tags"], s["weights_lost"]) == (1, 1, [], False)
    finally:
        server.stop()


async def test_the_adapter_never_releases_twice_nor_resumes_what_it_did_not_release(tmp_path, session):
    adapter, plan, server = launch(tmp_path)
    try:
        await wait_health(session, server)
        await adapter.park(session, server.base_url, KEY, 1)
        await adapter.park(session, server.base_url, KEY, 1)  # a second release would kill SGLang
        await adapter.wake(session, server.base_url, KEY, 1)
        await adapter.wake(session, server.base_url, KEY, 1)  # nothing released: nothing to resume
        assert server.proc.poll() is None
        s = await stats(session, server.base_url)
        assert (s["release_calls"], s["resume_calls"]) == (1, 1)
        assert (await chat(session, server.base_url))[0] == 200

        # A daemon restarted while the engine was parked in place has no record: it resumes what
        # CapyCTL's one release released.
        await adapter.park(session, server.base_url, KEY, 1)
        await SglangAdapter().wake(session, server.base_url, KEY, 1)
        assert server.proc.poll() is None and (await chat(session, server.base_url))[0] == 200
    finally:
        server.stop()


async def test_the_key_guards_the_routes_and_stays_out_of_the_command_line(tmp_path, session):
    adapter, plan, server = launch(tmp_path)
    try:
        await wait_health(session, server)  # /health needs no key
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
        assert KEY not in cmdline and "--config" in cmdline
        config = tmp_path / "secrets" / "tiny.sglang.yaml"
        assert config.stat().st_mode & 0o777 == 0o600
        assert (await chat(session, server.base_url))[0] == 200
        assert (await chat(session, server.base_url, key="wrong"))[0] == 401
        with pytest.raises(EngineError) as err:  # release/resume are ADMIN_OPTIONAL: the api key guards them
            await adapter.park(session, server.base_url, None, 1)
        assert err.value.detail["status"] == 401
        assert adapter.released_tags(server.base_url, None) is None
    finally:
        server.stop()


async def test_a_deep_park_rereads_the_weights_on_wake(tmp_path, session):
    """park_tier deep: the memory saver without the CPU backup, so the resumed weights region is fresh
    memory and the answers garbage until the adapter re-reads the checkpoint (update_weights_from_disk)."""
    adapter, plan, server = launch(tmp_path, park_tier="deep")
    try:
        assert "--enable-memory-saver" in plan.argv and "--enable-weights-cpu-backup" not in plan.argv
        await wait_health(session, server)
        status, before = await chat(session, server.base_url)
        assert status == 200
        await adapter.park(session, server.base_url, KEY, 2)
        await adapter.wake(session, server.base_url, KEY, 2, model_path=str(tmp_path / "model"))
        status, after = await chat(session, server.base_url)
        assert status == 200 and after["choices"][0]["message"] == before["choices"][0]["message"]
        s = await stats(session, server.base_url)
        assert (s["release_calls"], s["resume_calls"], s["update_weights_calls"], s["weights_lost"]) == (1, 1, 1, False)

        # A host_backed wake (level 1) of the same launch does not re-read them: SGLang answers garbage.
        await adapter.park(session, server.base_url, KEY, 2)
        await adapter.wake(session, server.base_url, KEY, 1)
        status, garbage = await chat(session, server.base_url)
        assert status == 200 and garbage["choices"][0]["message"] != before["choices"][0]["message"]
        assert (await stats(session, server.base_url))["weights_lost"] is True
    finally:
        server.stop()


async def test_a_release_with_a_request_running_kills_sglang(tmp_path, session):
    """Why the controller drains first: the adapter cannot save a release that races a request."""
    adapter, plan, server = launch(tmp_path)
    try:
        await wait_health(session, server)
        running = asyncio.create_task(chat(session, server.base_url, max_tokens=10, fake_token_delay=0.2))

        async def request_running() -> None:
            while (await stats(session, server.base_url))["in_flight"] != 1:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(request_running(), 10)  # a TimeoutError fails the test: never got there
        assert (await stats(session, server.base_url))["in_flight"] == 1 and not running.done()
        with pytest.raises(EngineError) as err:
            await adapter.park(session, server.base_url, KEY, 1)
        assert err.value.code == "engine_unreachable"
        assert adapter.released_tags(server.base_url, KEY) is None
        with pytest.raises(aiohttp.ClientError):
            await running  # the running request died with the server
        assert exit_status(server) == -9
        assert "should be called only when server is idle" in (tmp_path / "sglang.log").read_text()
    finally:
        server.stop()
