"""The operator's surface (issue 15): the configuration file and its reload, the verbs
inspect, drain/uncordon, engine detect and READY as ready/desired, and the metrics the
controller hands the proxy.

The verbs run through the real CLI against the management API as the daemon builds it (a
real Controller and Store) on a unix socket; its systemd client has no units, so nothing is
launched (tests/integration/test_config_service.py boots the packaged service for real).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from aiohttp import web

from capyctl import config_file
from capyctl.api import build_api
from capyctl.cli import main as cli_main
from capyctl.config import DaemonConfig, Paths
from capyctl.controller import Controller
from capyctl.daemon import Daemon
from capyctl.errors import CapyError
from capyctl.proxy._metrics import ProxyMetrics
from capyctl.proxy.router import DurationCounts, MemoryGauge
from capyctl.spec import DeploymentSpec, EngineSpec
from capyctl.store import Store
from tests.fakes import VLLM_VERSION, make_fake_sglang_venv, make_fake_vllm_venv
from tests.unit.test_proxy import parse_metrics

GOOD = """\
# the daemon's settings
listen: 127.0.0.1:8001
log_level: WARNING
ram_budget: 6GiB
queue:
  total: 100
  per_deployment: 3
idle_park_after: 10m
admin_token_file: /etc/capyctl/admin.token
hosts:
  local:
    dev_controls: false
"""


# ---------------------------------------------------------------- the configuration file

def test_a_config_file_sets_every_setting(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(GOOD)
    config = config_file.build_config(path=path, required=True, overrides=config_file.Overrides())
    assert config.listen == "127.0.0.1:8001" and config.log_level == "warning"
    assert (config.queue_total, config.queue_per_deployment) == (100, 3)
    assert config.idle_park_after == 600.0 and config.host_ram_budget == 6 << 30
    assert config.ram_reserve_for(16 << 30) == 10 << 30  # a budget leaves the rest to the host
    assert config.admin_token_file == Path("/etc/capyctl/admin.token")
    assert config.dev_controls("local") is False and config.dev_controls("gpu-2") is True


def test_unknown_keys_and_bad_values_name_file_field_and_line(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("listen: 127.0.0.1:8001\nqueue:\n  total: 10\n  per_deployement: 3\nlog_level: loud\n"
                    "hosts:\n  local:\n    dev_control: false\n")
    with pytest.raises(config_file.ConfigError) as caught:
        config_file.load_config(path, required=True)
    lines = str(caught.value).splitlines()
    assert lines == [f"{path}:4: queue.per_deployement: is not a known field",
                     f"{path}:5: log_level: Input should be 'debug', 'info', 'warning' or 'error'",
                     f"{path}:8: hosts.local.dev_control: is not a known field"]
    assert caught.value.code == "invalid_config"
    path.write_text("ram_reserve: 1GiB\nram_budget: 8GiB\n")
    with pytest.raises(config_file.ConfigError, match="give ram_reserve or ram_budget, not both"):
        config_file.load_config(path, required=True)
    path.write_text("listen: [\n")
    with pytest.raises(config_file.ConfigError, match="YAML syntax error"):
        config_file.load_config(path, required=True)


def test_flags_then_environment_then_file_then_defaults(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("listen: 127.0.0.1:8001\nlog_level: warning\n")
    env = {"CAPYCTL_LISTEN": "127.0.0.1:8002", "CAPYCTL_LOG_LEVEL": "DEBUG", "CAPYCTL_CONFIG": str(path)}
    assert config_file.config_path(None, env) == (path, True)
    assert config_file.config_path("/other.yaml", env) == (Path("/other.yaml"), True)
    assert config_file.config_path(None, {}) == (Path("/etc/capyctl/config.yaml"), False)
    from_env = config_file.build_config(path=path, required=True, overrides=config_file.Overrides.from_env(env))
    assert (from_env.listen, from_env.log_level) == ("127.0.0.1:8002", "debug")
    flag = config_file.build_config(path=path, required=True,
                                    overrides=config_file.Overrides.from_env(env, listen="127.0.0.1:8003"))
    assert flag.listen == "127.0.0.1:8003"
    only_file = config_file.build_config(path=path, required=True, overrides=config_file.Overrides.from_env({}))
    assert (only_file.listen, only_file.log_level) == ("127.0.0.1:8001", "warning")
    # The default file may be absent (the defaults apply); a file asked for must exist.
    absent = tmp_path / "absent.yaml"
    assert config_file.build_config(path=absent, required=False, overrides=config_file.Overrides()).queue_total == 256
    with pytest.raises(config_file.ConfigError, match="no such file"):
        config_file.build_config(path=absent, required=True, overrides=config_file.Overrides())


def test_reload_applies_live_settings_and_names_those_needing_a_restart(tmp_path: Path, caplog) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("listen: 127.0.0.1:8001\nqueue:\n  total: 50\n")
    config = config_file.build_config(path=path, required=True, overrides=config_file.Overrides())
    daemon = Daemon(config)
    path.write_text("listen: 127.0.0.1:9999\nlog_level: debug\nqueue:\n  total: 7\nidle_park_after: 30s\n")
    with caplog.at_level(logging.INFO, logger="capyctl"):
        result = daemon.reload()
    assert result["reloaded"] and result["restart_needed"] == ["listen"]
    assert set(result["applied"]) == {"log_level", "queue", "idle_park_after"}
    assert (config.queue_total, config.idle_park_after, config.log_level) == (7, 30.0, "debug")
    assert config.listen == "127.0.0.1:8001"  # the listener stays until a restart
    assert "listen changed" in caplog.text and "next restart" in caplog.text
    logging.getLogger().setLevel(logging.WARNING)


def test_a_broken_file_at_reload_is_refused_and_the_old_settings_kept(tmp_path: Path, caplog) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("queue:\n  total: 50\n")
    config = config_file.build_config(path=path, required=True, overrides=config_file.Overrides())
    daemon = Daemon(config)
    path.write_text("queue:\n  total: 7\n  totl: 8\n")
    with caplog.at_level(logging.ERROR, logger="capyctl"):
        result = daemon.reload()
    assert not result["reloaded"] and result["error"]["code"] == "invalid_config"
    assert config.queue_total == 50
    assert f"{path}:3: queue.totl: is not a known field" in caplog.text


def test_validate_config_cli(tmp_path: Path, capsys) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text("queue:\n  everything: 1\n")
    assert cli_main(["validate", "config", str(good)]) == 0
    assert "valid configuration" in capsys.readouterr().out
    assert cli_main(["validate", "config", str(bad)]) == 2
    assert f"{bad}:2: queue.everything: is not a known field" in capsys.readouterr().err
    assert cli_main(["validate", "config", str(bad), "--json"]) == 2
    answer = json.loads(capsys.readouterr().out)
    assert answer["valid"] is False and answer["detail"]["problems"][0]["line"] == 2


# ---------------------------------------------------------------- the verbs, through the CLI

class NoUnits:
    async def list_units(self, pattern: str):
        return []


@pytest.fixture
async def api(tmp_path: Path):
    paths = Paths(state_dir=tmp_path / "state", runtime_dir=tmp_path / "run")
    paths.state_dir.mkdir()
    paths.runtime_dir.mkdir()
    store = Store(paths.database)
    store.put_engine(EngineSpec(kind="engine", name="llama", type="llama.cpp", path="/usr/bin/true", version="1"))
    config = DaemonConfig(paths=paths)
    controller = Controller(config, store, NoUnits())
    await controller.start()
    runner = web.AppRunner(build_api(controller, store))
    await runner.setup()
    await web.UnixSite(runner, str(paths.api_socket)).start()
    try:
        yield controller, str(paths.api_socket)
    finally:
        await runner.cleanup()
        await controller.close()
        store.close()


async def cli(socket_path: str, *argv: str) -> int:
    # The CLI is synchronous: run it off the event loop that serves the API.
    return await asyncio.to_thread(cli_main, ["--api-socket", socket_path, *argv])


async def _deploy(controller: Controller, name: str, **fields) -> None:
    spec = DeploymentSpec.model_validate({"name": name, "engine": "llama", "model": {"path": "/m.gguf"}, **fields})
    await controller.deploy(spec)


async def test_list_deployments_shows_ready_as_ready_over_desired(api, capsys) -> None:
    controller, sock = api
    await _deploy(controller, "small")
    assert await cli(sock, "list", "deployments") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["NAME", "STATE", "READY"]
    assert out[1].split()[:3] == ["small", "stopped", "0/1"]
    from capyctl.cli import _ready
    assert _ready({"state": "ready", "members": {"ready": 2, "desired": 2}}) == "2/2"
    assert _ready({"state": "starting", "members": {"ready": 0, "desired": 2}}) == "0/2"


async def test_inspect_deployment_engine_and_host(api, capsys) -> None:
    controller, sock = api
    await _deploy(controller, "small", idle_park_after="5m")
    assert await cli(sock, "inspect", "deployment", "small", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["spec"]["engine"] == "llama" and d["revisions"][0]["revision"] == 1
    assert d["idle_park_after"] == 300.0 and d["members"] == {"ready": 0, "desired": 1}
    assert await cli(sock, "inspect", "engine", "llama", "--json") == 0
    e = json.loads(capsys.readouterr().out)
    assert (e["type"], e["deployments"]) == ("llama.cpp", ["small"])
    assert await cli(sock, "inspect", "host", "local", "--json") == 0
    h = json.loads(capsys.readouterr().out)
    assert h["cordoned"] is False and h["dev_controls"] is True and h["inventory"]["ram_total"] > 0
    assert "small" in h["placeable"]
    assert await cli(sock, "inspect", "deployment", "small") == 0  # for people: key: value lines
    assert "idle_park_after: 300.0" in capsys.readouterr().out
    assert await cli(sock, "inspect", "engine", "nope") == 1
    assert "engine_not_found" in capsys.readouterr().err


async def test_drain_cordons_the_host_until_uncordon(api, capsys) -> None:
    controller, sock = api
    await _deploy(controller, "small")
    assert await cli(sock, "drain", "host", "local") == 0
    assert "cordoned" in capsys.readouterr().out
    # Kept in the store (a restarted daemon keeps the host closed) and refused at admission,
    # before any wake: the deployment does not fail for it.
    assert "local" in controller.store.cordons()
    with pytest.raises(CapyError) as caught:
        async with controller.acquire("small"):
            pass
    assert caught.value.code == "host_cordoned" and caught.value.status == 503
    assert controller.get("small").state == "stopped"
    assert await cli(sock, "inspect", "host", "local", "--json") == 0
    assert json.loads(capsys.readouterr().out)["cordoned"] is True
    assert await cli(sock, "uncordon", "host", "local") == 0
    assert "takes placements again" in capsys.readouterr().out
    assert controller.store.cordons() == {} and controller.placement_error(controller.get("small")) is None
    assert await cli(sock, "drain", "host", "nowhere") == 1
    assert "host" in capsys.readouterr().err


async def test_engine_detect_finds_installs(tmp_path: Path, capsys) -> None:
    make_fake_vllm_venv(tmp_path / "engines" / "vllm")
    make_fake_sglang_venv(tmp_path / "engines" / "deeper" / "sglang")
    (tmp_path / "engines" / "empty-venv").mkdir()
    (tmp_path / "engines" / "empty-venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert await asyncio.to_thread(cli_main, ["engine", "detect", str(tmp_path / "engines"), "--json"]) == 0
    found = {e["type"]: e for e in json.loads(capsys.readouterr().out)}
    assert set(found) == {"vllm", "sglang"}
    assert found["vllm"]["version"] == VLLM_VERSION
    assert found["vllm"]["path"] == str(tmp_path / "engines" / "vllm")
    assert await asyncio.to_thread(cli_main, ["engine", "detect", str(tmp_path / "engines")]) == 0
    assert f"capyctl engine add {tmp_path / 'engines' / 'vllm'}" in capsys.readouterr().out


# ---------------------------------------------------------------- metrics

def test_metrics_expose_wakes_evictions_and_memory_per_card_and_deployment() -> None:
    metrics = ProxyMetrics()
    metrics.record(deployment="a", route="/v1/chat/completions", status=200, seconds=0.02)
    wakes = DurationCounts()
    for seconds in (0.3, 4.0, 700.0):
        wakes.observe(seconds)
    memory = [MemoryGauge("gpu:local:0", "gpu", "local", 0, capacity=80 << 30, available=None,
                          reserved=10 << 30, held={"a": 9 << 30}),
              MemoryGauge("ram:local", "ram", "local", None, capacity=60 << 30, available=50 << 30,
                          reserved=0, held={"a": 1 << 30})]
    stats = {"a": {"queue_depth": 2, "in_flight": 1, "wakes": 3, "parks": 2, "evictions": 1, "ready": 1}}
    samples = parse_metrics(metrics.render(stats, {"a": wakes}, memory).decode())
    a = frozenset({("deployment", "a")})
    assert samples[("capyctl_evictions_total", a)] == 1 and samples[("capyctl_wakes_total", a)] == 3
    assert samples[("capyctl_queue_depth", a)] == 2 and samples[("capyctl_ready", a)] == 1
    assert samples[("capyctl_wake_duration_seconds_bucket", a | {("le", "0.5")})] == 1
    assert samples[("capyctl_wake_duration_seconds_bucket", a | {("le", "600.0")})] == 2
    assert samples[("capyctl_wake_duration_seconds_bucket", a | {("le", "+Inf")})] == 3
    assert samples[("capyctl_wake_duration_seconds_count", a)] == 3
    card = frozenset({("host", "local"), ("gpu", "0")})
    assert samples[("capyctl_gpu_memory_capacity_bytes", card)] == 80 << 30
    assert samples[("capyctl_deployment_gpu_memory_bytes", card | a)] == 9 << 30
    # Not measured: left out, never shown as 0.
    assert ("capyctl_gpu_memory_available_bytes", card) not in samples
    assert samples[("capyctl_deployment_ram_bytes", frozenset({("host", "local")}) | a)] == 1 << 30
    assert not any(name.endswith("_created") for name, _ in samples)


def test_each_proxy_has_its_own_registry() -> None:
    first, second = ProxyMetrics(), ProxyMetrics()
    first.record(deployment="a", route="/v1/models", status=200, seconds=0.001)
    key = ("capyctl_requests_total", frozenset({("deployment", "a"), ("route", "/v1/models"), ("status", "200")}))
    assert parse_metrics(first.render({}).decode())[key] == 1
    assert key not in parse_metrics(second.render({}).decode())
