"""The TensorFold adapter against TensorFold's documented command line and routes, and against the
fake TensorFold (tests/fakes/fake_tensorfold.py) launched from build_launch's own argv and
environment as a subprocess (stopped by its PID)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from capyctl.engines import LaunchContext, adapter_for
from capyctl.errors import CapyError, EngineError
from capyctl.spec import DeploymentSpec, EngineSpec
from tests.fakes import fake_tensorfold, free_port, make_fake_tensorfold_venv, start_plan, start_server

KEY = "per-launch-key-5e0b"
ADAPTER = adapter_for("tensorfold")


def model_dir(tmp_path: Path, model_type: str = "qwen3_5") -> Path:
    path = tmp_path / f"model-{model_type}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def make_ctx(tmp_path: Path, *, gpus: list[int] | None = None, model_type: str = "qwen3_5", dev: bool = True,
             engine_path: str = "/opt/tf", port: int = 41234, **spec) -> LaunchContext:
    model = model_dir(tmp_path, model_type)
    dep = DeploymentSpec.model_validate({"name": "decider", "engine": "tf", "model": {"path": str(model)}, **spec})
    engine = EngineSpec(kind="engine", name="tf", type="tensorfold", path=engine_path)
    return LaunchContext(deployment=dep, engine=engine, model_path=str(model), port=port, gpu_indices=gpus or [],
                         dev_controls=dev)


# ---------------------------------------------------------------- the launch line

def test_serve_takes_the_model_positionally_as_tensorfold_parses_it(tmp_path):
    ctx = make_ctx(tmp_path)
    plan = ADAPTER.build_launch(ctx)
    assert plan.argv[:3] == ["/opt/tf/bin/tensorfold", "serve", ctx.model_path]
    assert "--model" not in plan.argv
    # The fake's parser follows src/tensorfold/cli_args.py: this line parses...
    args = fake_tensorfold.build_parser().parse_args(plan.argv[1:])
    assert (args.model, args.host, args.port, args.name) == (ctx.model_path, "127.0.0.1", 41234, "decider")
    assert plan.served_model == "decider"  # --name: the id the proxy sends
    # ...and the line this adapter used to write does not: argparse exits 2.
    with pytest.raises(SystemExit) as exited:
        fake_tensorfold.build_parser().parse_args(["serve", "--model", ctx.model_path, "--host", "127.0.0.1",
                                                   "--port", "41234"])
    assert exited.value.code == 2


@pytest.mark.parametrize("gpus", [[], [0]])
def test_keys_travel_in_the_environment_file_never_argv(tmp_path, gpus):
    plan = ADAPTER.build_launch(make_ctx(tmp_path, gpus=gpus))
    secret = plan.secret_file_environment(KEY)
    assert secret["TENSORFOLD_API_KEY"] == KEY  # docs/api.md: TENSORFOLD_API_KEY
    assert all(KEY not in arg and "${" not in arg for arg in plan.argv)
    assert "--api-key" not in plan.argv and KEY not in plan.environment.values()
    # The sleep token only where sleep is on, and then the same per-launch secret.
    assert secret.get("TENSORFOLD_SLEEP_TOKEN") == (KEY if gpus else None)
    assert plan.environment["TENSORFOLD_NO_UPDATE_CHECK"] == "1"


def test_capabilities_are_the_routes_tensorfold_serves():
    caps = ADAPTER.capabilities(EngineSpec(kind="engine", name="tf", type="tensorfold", path="/opt/tf"))
    # docs/api.md's route table; decisions, not a native /v1/systemone; /tokenize and /v1/tokenize both.
    assert caps == {"chat", "completions", "tools", "decisions", "messages", "tokenize", "tokenize_v1", "responses",
                    "responses_get", "responses_delete"}
    assert ADAPTER.unix_socket is False  # it binds (host, port) only


def test_tensor_parallel_on_one_host_is_refused(tmp_path):
    with pytest.raises(CapyError) as err:
        ADAPTER.build_launch(make_ctx(tmp_path, gpus=[0, 1], tensor_parallel=2, resources={"gpus": 2}))
    assert err.value.code == "tensor_parallel_unsupported" and err.value.status == 400


# ---------------------------------------------------------------- when it parks in place

@pytest.mark.parametrize("case, gpus, model_type, dev, spec, in_place", [
    ("one GPU, a family with a sleep adapter", [0], "qwen3_5", True, {}, True),
    ("Nemotron-H", [3], "nemotron_h", True, {}, True),
    ("CPU launch", [], "qwen3_5", True, {}, False),
    ("family without a sleep adapter", [0], "llama", True, {}, False),
    ("host without development controls", [0], "qwen3_5", False, {}, False),
    ("park: stop", [0], "qwen3_5", True, {"park": "stop"}, False),
])
def test_sleep_mode_only_where_the_prototype_runs(tmp_path, case, gpus, model_type, dev, spec, in_place):
    ctx = make_ctx(tmp_path, gpus=gpus, model_type=model_type, dev=dev, **spec)
    plan = ADAPTER.build_launch(ctx)
    assert ADAPTER.park_method(ctx) == ("in_place" if in_place else "stop"), case
    assert ("--enable-sleep-mode" in plan.argv) == in_place, case
    assert ("TENSORFOLD_SLEEP_TOKEN" in plan.secret_environment) == in_place, case


def test_a_users_own_sleep_flag_is_trusted_and_not_repeated(tmp_path):
    ctx = make_ctx(tmp_path, gpus=[0], model_type="some_new_family", engine_args=["--enable-sleep-mode"])
    plan = ADAPTER.build_launch(ctx)
    assert ADAPTER.park_method(ctx) == "in_place"
    assert plan.argv.count("--enable-sleep-mode") == 1 and "TENSORFOLD_SLEEP_TOKEN" in plan.secret_environment


@pytest.mark.parametrize("spec, method", [
    ({"resources": {"gpus": 1}}, "in_place"), ({}, "stop"), ({"resources": {"gpus": 1}, "park": "stop"}, "stop"),
])
def test_park_method_from_the_deployment_alone(spec, method):
    dep = DeploymentSpec.model_validate({"name": "d", "engine": "tf", "model": {"path": "/m"}, **spec})
    assert ADAPTER.park_method(dep) == method


# ---------------------------------------------------------------- against the fake TensorFold

@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


def launch(tmp_path: Path, *, gpus: list[int] | None = None, model_type: str = "qwen3_5", **spec):
    venv = make_fake_tensorfold_venv(tmp_path / "tf-env")
    port = free_port()
    ctx = make_ctx(tmp_path, gpus=gpus, model_type=model_type, engine_path=str(venv), port=port, **spec)
    plan = ADAPTER.build_launch(ctx)
    return plan, start_plan(plan, KEY, port, log_path=tmp_path / "tensorfold.log")


async def wait_health(session, server):
    for _ in range(300):
        assert server.proc.poll() is None, "the fake TensorFold exited"
        if await ADAPTER.health(session, server.base_url, KEY):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the fake TensorFold never became healthy")


async def chat(session, base_url, key=KEY, **extra):
    body = {"model": "decider", "messages": [{"role": "user", "content": "say hi"}], **extra}
    async with session.post(base_url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json()


async def test_cpu_launch_serves_with_its_key_and_parks_by_stopping(tmp_path, session):
    plan, server = launch(tmp_path)
    try:
        await wait_health(session, server)
        status, body = await chat(session, server.base_url)
        assert status == 200 and body["model"] == "decider"
        assert (await chat(session, server.base_url, key="wrong"))[0] == 401
        async with session.get(server.base_url + "/health") as r:  # open, and terse with keys set
            assert r.status == 200 and await r.json() == {"status": "ok"}
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline  # ps shows no key
        assert await ADAPTER.is_parked(session, server.base_url, KEY) is False
        with pytest.raises(EngineError) as err:  # no sleep mode: the controller stops the unit instead
            await ADAPTER.park(session, server.base_url, KEY, 1)
        assert err.value.code == "park_unsupported"
    finally:
        server.stop()


async def test_gpu_launch_sleeps_and_wakes_in_place(tmp_path, session):
    plan, server = launch(tmp_path, gpus=[0])
    try:
        await wait_health(session, server)
        assert plan.environment["CUDA_VISIBLE_DEVICES"] == "0"
        await ADAPTER.park(session, server.base_url, KEY, 1)  # level 1 asked: TensorFold has only level 2
        assert await ADAPTER.is_parked(session, server.base_url, KEY) is True
        status, body = await chat(session, server.base_url)
        assert status == 503 and body["error"]["code"] == "model_not_ready"
        assert await ADAPTER.health(session, server.base_url, KEY)  # the process stays healthy asleep
        await ADAPTER.park(session, server.base_url, KEY, 2)  # a repeat is idempotent

        await ADAPTER.wake(session, server.base_url, KEY, 1)
        assert await ADAPTER.is_parked(session, server.base_url, KEY) is False
        assert (await chat(session, server.base_url))[0] == 200
        async with session.get(server.base_url + "/fake/stats") as r:
            stats = await r.json()
        assert (stats["sleep_calls"], stats["wake_calls"], stats["level"]) == (1, 1, None)
    finally:
        server.stop()


async def test_sleep_routes_take_only_the_sleep_token(tmp_path, session):
    venv = make_fake_tensorfold_venv(tmp_path / "tf-env")
    port = free_port()
    # An API key and a different sleep token, to show the two are separate credentials.
    server = start_server([str(venv / "bin" / "tensorfold"), "serve", str(model_dir(tmp_path)), "--port", str(port),
                           "--enable-sleep-mode"], port,
                          env={"TENSORFOLD_API_KEY": "api-key", "TENSORFOLD_SLEEP_TOKEN": "sleep-token",
                               "CUDA_VISIBLE_DEVICES": "0"})
    try:
        await server.wait_healthy()
        with pytest.raises(EngineError) as err:
            await ADAPTER.park(session, server.base_url, "api-key", 2)
        assert err.value.detail["status"] == 401 and "invalid_sleep_token" in err.value.message
        await ADAPTER.park(session, server.base_url, "sleep-token", 2)
        assert await ADAPTER.is_parked(session, server.base_url, "sleep-token") is True
        # lifecycle_http.py admin (TensorFold 12cd226a): a level but 2, or a query on the other routes, is 400.
        sleep = {"Authorization": "Bearer sleep-token"}
        async with session.post(server.base_url + "/sleep", params={"level": "1"}, headers=sleep) as r:
            assert r.status == 400 and await r.json() == {"error": {
                "message": "this runtime supports sleep level 2 only", "code": "unsupported_sleep_level",
                "type": "invalid_request_error"}}
        async with session.get(server.base_url + "/is_sleeping", params={"verbose": "1"}, headers=sleep) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_lifecycle_query"
    finally:
        server.stop()


async def test_a_failed_reload_stays_asleep_and_a_retry_wakes(tmp_path, session):
    plan, server = launch(tmp_path, gpus=[0])
    try:
        await wait_health(session, server)
        await ADAPTER.park(session, server.base_url, KEY, 2)
        async with session.post(server.base_url + "/fake/fail_next_wake") as r:
            assert r.status == 200
        with pytest.raises(EngineError) as err:
            await ADAPTER.wake(session, server.base_url, KEY, 2)
        assert err.value.code == "wake_failed" and err.value.detail["status"] == 503
        assert await ADAPTER.is_parked(session, server.base_url, KEY) is True
        await ADAPTER.wake(session, server.base_url, KEY, 2)
        assert (await chat(session, server.base_url))[0] == 200
    finally:
        server.stop()


@pytest.mark.parametrize("env, model_type, reason", [
    ({"CUDA_VISIBLE_DEVICES": "", "TENSORFOLD_SLEEP_TOKEN": "t"}, "qwen3_5", "one CUDA device"),
    ({"CUDA_VISIBLE_DEVICES": "0", "TENSORFOLD_SLEEP_TOKEN": "t"}, "llama", "no sleep adapter"),
    ({"CUDA_VISIBLE_DEVICES": "0", "TENSORFOLD_SLEEP_TOKEN": ""}, "qwen3_5", "TENSORFOLD_SLEEP_TOKEN"),
])
def test_the_fake_refuses_sleep_where_tensorfold_does(tmp_path, monkeypatch, env, model_type, reason):
    # Why the adapter must not add --enable-sleep-mode on a CPU launch or for another family.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(fake_tensorfold.StartupError, match=reason):
        fake_tensorfold.load(["serve", str(model_dir(tmp_path, model_type)), "--enable-sleep-mode"])


def test_the_fake_refuses_a_key_file_others_can_read(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORFOLD_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# keys\nclient: k1\nk2\n")
    keys.chmod(0o644)
    with pytest.raises(fake_tensorfold.StartupError, match="other users"):
        fake_tensorfold.load(["serve", str(model_dir(tmp_path)), "--api-key-file", str(keys)])
    keys.chmod(0o600)
    _, engine = fake_tensorfold.load(["serve", str(model_dir(tmp_path)), "--api-key-file", str(keys)])
    assert engine.api_keys == ["k1", "k2"]
