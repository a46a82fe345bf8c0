"""TransientUnit -> D-Bus properties, and the pure helpers. No systemd needed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capyctl.errors import SystemdError
from capyctl.systemd import SystemdClient, TransientUnit, UnitState, failure_reason
from capyctl.systemd._security import parse_exposure
from capyctl.systemd._units import (bus_path_escape, cpu_mask, escape_dollars, markers_from_environment,
                                    parse_cpu_list)


def props(unit: TransientUnit) -> dict[str, object]:
    return {name: variant.value for name, variant in unit.properties()}


def signatures(unit: TransientUnit) -> dict[str, str]:
    return {name: variant.signature for name, variant in unit.properties()}


def engine(**kw: object) -> TransientUnit:
    base: dict[str, object] = dict(name="capyctl-qwen3-4b.service",
                                   description="CapyCTL deployment qwen3-4b (rev 3, vllm)",
                                   argv=["/opt/vllm/bin/vllm", "serve", "--api-key", "${CAPYCTL_ENGINE_KEY}"])
    base.update(kw)
    return TransientUnit(**base)  # type: ignore[arg-type]


def test_basic_properties() -> None:
    p = props(engine(environment={"HF_HOME": "/var/lib/capyctl/hf"}, environment_file="/var/lib/capyctl/secrets/k.env",
                     working_directory="/var/lib/capyctl", memory_max=8 << 30, memory_high=7 << 30,
                     cpu_quota=2.5, tasks_max=512, markers={"deployment": "qwen3-4b", "revision": "3"}))
    assert p["ExecStart"] == [["/opt/vllm/bin/vllm",
                               ["/opt/vllm/bin/vllm", "serve", "--api-key", "${CAPYCTL_ENGINE_KEY}"], False]]
    assert p["Slice"] == "capyctl.slice"
    assert p["Restart"] == "no"
    assert p["Type"] == "exec"
    assert p["MemoryMax"] == 8 << 30 and p["MemoryHigh"] == 7 << 30
    assert p["CPUQuotaPerSecUSec"] == 2_500_000
    assert p["TasksMax"] == 512
    assert p["EnvironmentFiles"] == [["/var/lib/capyctl/secrets/k.env", False]]
    assert p["Environment"] == ["HF_HOME=/var/lib/capyctl/hf", "CAPYCTL_MARKER_DEPLOYMENT=qwen3-4b",
                                "CAPYCTL_MARKER_REVISION=3"]
    assert markers_from_environment(p["Environment"]) == {"deployment": "qwen3-4b", "revision": "3"}  # type: ignore[arg-type]


def test_unset_limits_are_not_sent() -> None:
    p = props(engine())
    for absent in ("MemoryMax", "MemoryHigh", "CPUQuotaPerSecUSec", "TasksMax", "EnvironmentFiles",
                   "DevicePolicy", "DeviceAllow", "AllowedCPUs", "CPUAffinity", "CPUWeight"):
        assert absent not in p


def test_gpu_devices_closed_policy_with_control_nodes() -> None:
    p = props(engine(devices=["/dev/nvidia1"]))
    assert p["DevicePolicy"] == "closed"
    allowed = [path for path, _ in p["DeviceAllow"]]  # type: ignore[attr-defined]
    assert allowed == ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert "PrivateDevices" not in p  # it would hide the GPU nodes
    assert props(engine())["PrivateDevices"] is True


def test_hardening_can_be_turned_off_but_is_on_by_default() -> None:
    on = props(engine())
    assert on["NoNewPrivileges"] is True and on["ProtectSystem"] == "strict"
    assert on["ProtectHome"] == "read-only" and on["PrivateTmp"] is True
    assert "NoNewPrivileges" not in props(engine(hardening=False))


def test_signatures_match_systemd_bus_api() -> None:
    sig = signatures(engine(memory_max=1, allowed_cpus="0-1", cpu_weight=50, devices=["/dev/nvidia0"],
                            environment_file="/x.env", read_write_paths=["/var/lib/capyctl/cache"]))
    assert sig["ExecStart"] == "a(sasb)"
    assert sig["RestrictNamespaces"] == "t"
    assert sig["AllowedCPUs"] == sig["CPUAffinity"] == "ay" and sig["DeviceAllow"] == "a(ss)"
    assert sig["CPUWeight"] == "t"
    assert sig["EnvironmentFiles"] == "a(sb)" and sig["ReadWritePaths"] == "as"


@pytest.mark.parametrize("bad", [
    dict(name="qwen"), dict(argv=["vllm", "serve"]), dict(argv=[]),
    dict(environment={"BAD-NAME": "x"}), dict(markers={"Deployment": "x"}),
    dict(environment_file="relative.env"), dict(devices=["nvidia0"]), dict(cpu_quota=0),
    dict(allowed_cpus="3-1"), dict(cpu_weight=0),
])
def test_invalid_units_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(SystemdError) as err:
        engine(**bad).properties()
    assert err.value.code == "invalid_unit"


def test_dollar_escaping() -> None:
    assert escape_dollars("--key=${CAPYCTL_ENGINE_KEY}") == "--key=${CAPYCTL_ENGINE_KEY}"
    assert escape_dollars("cost $5 and $HOME") == "cost $$5 and $$HOME"
    assert escape_dollars("$${A}") == "$$${A}"


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_unescaped_dollars_roundtrip(text: str) -> None:
    # systemd turns "$$" into "$": with no ${NAME} inside, the argument comes back unchanged.
    escaped = escape_dollars(text)
    if "${" not in text:
        assert escaped.replace("$$", "$") == text


def test_cpu_lists_and_masks() -> None:
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert cpu_mask([0, 1, 2, 3, 6]) == bytes([0b01001111])
    assert cpu_mask([9]) == bytes([0, 0b10])


def test_bus_path_escape_matches_systemd() -> None:
    # dbus_2esocket as `busctl tree org.freedesktop.systemd1` lists it; a leading digit is escaped too.
    assert bus_path_escape("capyctl-x.service") == "capyctl_2dx_2eservice"
    assert bus_path_escape("dbus.socket") == "dbus_2esocket"
    assert bus_path_escape("0abc") == "_30abc"


def state(**kw: object) -> UnitState:
    base: dict[str, object] = dict(name="capyctl-x.service", active_state="failed", sub_state="failed",
                                   load_state="loaded")
    base.update(kw)
    return UnitState(**base)  # type: ignore[arg-type]


def test_failure_reasons() -> None:
    assert failure_reason(state(result="oom-kill")) == "out_of_memory"
    # cgroup v1 with systemd 252: the memcg OOM kill is reported as SIGKILL.
    assert failure_reason(state(result="signal", exec_main_code=2, exec_main_status=9,
                                memory_max=1 << 30)) == "out_of_memory"
    assert failure_reason(state(result="signal", exec_main_code=2, exec_main_status=9)) == "signal"
    assert failure_reason(state(result="signal", exec_main_code=2, exec_main_status=11,
                                memory_max=1 << 30)) == "signal"
    assert failure_reason(state(result="exit-code", exec_main_status=1)) == "exit_code"
    assert failure_reason(state(result="timeout")) == "timeout"
    assert failure_reason(state(result="start-limit-hit")) == "start_limit"
    assert failure_reason(state(result="success", active_state="inactive")) == "none"


def test_parse_exposure() -> None:
    assert parse_exposure("  ...\n→ Overall exposure level for capyctl-a.service: 2.0 OK 🙂\n") == (2.0, "OK")
    with pytest.raises(SystemdError):
        parse_exposure("nothing here")


async def test_connect_to_a_dead_address_is_dbus_unavailable(tmp_path: Path) -> None:
    with pytest.raises(SystemdError) as err:
        await SystemdClient.connect(f"unix:path={tmp_path}/no-bus-here")
    assert err.value.code == "dbus_unavailable"


def test_least_privilege_properties() -> None:
    unit = engine(argv=["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"],
                  dynamic_user=True, private_users=True, protect_home="tmpfs",
                  bind_read_only_paths=["/root/.pyenv/versions/3.11.7"], temporary_file_systems=["/var/lib/capyctl"],
                  inaccessible_paths=["/run/capyctl"], supplementary_groups=["render"],
                  credentials={"engine-key": "/var/lib/capyctl/secrets/qwen3-4b.key"},
                  credential_environment={"VLLM_API_KEY": "engine-key"}, cache_directory="capyctl-engine/qwen3-4b")
    p, sig = props(unit), signatures(unit)
    assert p["DynamicUser"] is True and p["PrivateUsers"] is True and p["ProtectHome"] == "tmpfs"
    assert p["LoadCredential"] == [["engine-key", "/var/lib/capyctl/secrets/qwen3-4b.key"]]
    assert p["BindReadOnlyPaths"] == [["/root/.pyenv/versions/3.11.7", "/root/.pyenv/versions/3.11.7", False, 16384]]
    assert p["TemporaryFileSystem"] == [["/var/lib/capyctl", "ro"]]
    assert p["InaccessiblePaths"] == ["-/run/capyctl"]  # "-": absent on this host is fine
    assert p["CacheDirectory"] == ["capyctl-engine/qwen3-4b"] and p["SupplementaryGroups"] == ["render"]
    # dbus-execute.c (systemd 252) reads exactly these signatures for transient units.
    assert (sig["LoadCredential"], sig["BindReadOnlyPaths"], sig["TemporaryFileSystem"], sig["InaccessiblePaths"],
            sig["CacheDirectory"], sig["DynamicUser"]) == ("a(ss)", "a(ssbt)", "a(ss)", "as", "as", "b")
    # The key is in no property: the credential shell reads it from the credentials directory.
    (path, argv, _), = p["ExecStart"]
    assert path == "/bin/sh" and argv[:2] == ["/bin/sh", "-c"]
    assert argv[3:] == ["capyctl-credentials", "/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "EnvironmentFiles" not in p and all("VLLM_API_KEY" not in e for e in p["Environment"])


def test_credential_shell_exports_only_the_named_variables(tmp_path: Path) -> None:
    import subprocess
    (tmp_path / "engine-key").write_text("k-123\n")
    unit = engine(argv=["/usr/bin/env"], credentials={"engine-key": "/x"},
                  credential_environment={"VLLM_API_KEY": "engine-key", "CAPYCTL_ENGINE_KEY": "engine-key"})
    # systemd turns "$$" back into "$"; then the command runs as systemd would run it.
    argv = [a.replace("$$", "$") for a in props(unit)["ExecStart"][0][1]]  # type: ignore[index]
    out = subprocess.run(argv, env={"CREDENTIALS_DIRECTORY": str(tmp_path), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert "VLLM_API_KEY=k-123" in out and "CAPYCTL_ENGINE_KEY=k-123" in out
    assert not any(line.startswith("capyctl_value=") for line in out)
    # A credential that is not there stops the start instead of running the engine keyless.
    missing = subprocess.run(argv, env={"CREDENTIALS_DIRECTORY": str(tmp_path / "none"), "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "VLLM_API_KEY" not in missing.stdout


@pytest.mark.parametrize("bad", [
    dict(credentials={"a/b": "/x"}),
    dict(credentials={"k": "relative"}),
    dict(credentials={"k": "/x"}, credential_environment={"A": "other"}),
    dict(bind_read_only_paths=["/a:/b"]),
    dict(cache_directory="/abs"),
    dict(protect_home="no"),
])
def test_invalid_least_privilege_fields_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(SystemdError) as err:
        engine(**bad).properties()
    assert err.value.code == "invalid_unit"
