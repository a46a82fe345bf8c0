"""The prompt cache across a park, its pure parts: what makes a saved cache stale, the budget a
save is held to, and the host RAM planned for llama-server's --cache-ram (issue 33). The engine's
side runs against a real llama-server in tests/integration/test_prompt_cache_park.py."""

from __future__ import annotations

import asyncio
import os

import pytest

from capyctl.controller import _prompt_cache as prompt_cache
from capyctl.engines import RestoredPromptCache, SavedPromptCache
from capyctl.engines.llamacpp import LlamaCppAdapter, cache_ram_bytes
from capyctl.errors import CapyError, EngineError
from capyctl.spec import DeploymentSpec

MIB = 1 << 20


def spec(**fields) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "m", "engine": "llama.cpp", "model": {"path": "/m.gguf"}, **fields})


def test_a_cache_is_stale_when_the_model_engine_or_args_changed(tmp_path):
    model, engine = tmp_path / "m.gguf", tmp_path / "llama-server"
    model.write_bytes(b"weights")
    engine.write_bytes(b"binary")
    saved = prompt_cache.identity(str(model), str(engine), ["-c", "2048"])
    assert prompt_cache.stale_reason(saved, prompt_cache.identity(str(model), str(engine), ["-c", "2048"])) is None
    assert "engine_args" in prompt_cache.stale_reason(saved, prompt_cache.identity(str(model), str(engine), []))
    engine.write_bytes(b"another build")
    assert "engine binary" in prompt_cache.stale_reason(saved, prompt_cache.identity(str(model), str(engine),
                                                                                     ["-c", "2048"]))
    # Same size, same bytes, written again: a new file as far as anyone can tell cheaply.
    replacement = tmp_path / "m.new"
    replacement.write_bytes(b"weights")
    os.replace(replacement, model)
    assert "model file" in prompt_cache.stale_reason(saved, prompt_cache.identity(str(model), str(engine),
                                                                                  ["-c", "2048"]))
    # A model that could not be read at the park is never trusted.
    assert "model file" in prompt_cache.stale_reason({"model": None}, {"model": None})


class FakeAdapter:
    """Stands in for an engine adapter: writes its files as an engine would, or fails."""

    def __init__(self, directory, sizes=(100,), fail: Exception | None = None):
        self.directory, self.sizes, self.fail = directory, sizes, fail
        self.restored: tuple[str, ...] = ()

    async def save_prompt_cache(self, session, base_url, key, budget):
        if self.fail:
            raise self.fail
        files = []
        for i, size in enumerate(self.sizes):
            (self.directory / f"capyctl-slot-{i}.bin").write_bytes(b"x" * size)
            files.append(f"capyctl-slot-{i}.bin")
        return SavedPromptCache(tuple(files), tokens=10 * len(files), bytes=sum(self.sizes), seconds=0.01,
                                seconds_per_token=0.005)

    async def restore_prompt_cache(self, session, base_url, key, files):
        if self.fail:
            raise self.fail
        self.restored = files
        return RestoredPromptCache(tokens=10 * len(files), bytes=100, seconds=0.002)


def run(coro):
    return asyncio.run(coro)


def test_a_save_over_its_disk_budget_is_dropped_at_once(tmp_path):
    adapter = FakeAdapter(tmp_path, sizes=(600, 600))
    record = run(prompt_cache.save(adapter, None, "http://e", None, budget=1000, timeout=5, directory=str(tmp_path),
                                   identity_now={}))
    assert record["state"] == "dropped" and "prompt_cache.disk" in record["why"]
    assert list(tmp_path.iterdir()) == []
    assert prompt_cache.pending_files({"prompt_cache": record}) == []


def test_a_restore_removes_the_files_and_counts_the_time_saved(tmp_path):
    adapter = FakeAdapter(tmp_path, sizes=(100, 200))
    ident = {"model": [1, 2, 3], "engine": [4, 5, 6], "engine_args": []}
    saved = run(prompt_cache.save(adapter, None, "http://e", None, budget=1000, timeout=5, directory=str(tmp_path),
                                  identity_now=ident))
    assert saved["state"] == "saved" and prompt_cache.pending_files({"prompt_cache": saved}) == saved["files"]
    result = run(prompt_cache.restore(adapter, None, "http://e", None, saved, timeout=5, directory=str(tmp_path),
                                      identity_now=ident))
    assert result["state"] == "restored" and adapter.restored == tuple(saved["files"])
    assert result["seconds_saved"] == pytest.approx(20 * 0.005 - 0.002)
    assert list(tmp_path.iterdir()) == []


def test_a_stale_or_failing_restore_loses_only_the_cache(tmp_path):
    saved = run(prompt_cache.save(FakeAdapter(tmp_path), None, "http://e", None, budget=1000, timeout=5,
                                  directory=str(tmp_path), identity_now={"model": [1], "engine": [2], "engine_args": []}))
    adapter = FakeAdapter(tmp_path)
    stale = run(prompt_cache.restore(adapter, None, "http://e", None, saved, timeout=5, directory=str(tmp_path),
                                     identity_now={"model": [9], "engine": [2], "engine_args": []}))
    assert stale["state"] == "refused" and adapter.restored == () and list(tmp_path.iterdir()) == []

    saved = run(prompt_cache.save(FakeAdapter(tmp_path), None, "http://e", None, budget=1000, timeout=5,
                                  directory=str(tmp_path), identity_now={"model": [1], "engine": [2], "engine_args": []}))
    failing = FakeAdapter(tmp_path, fail=EngineError("restore failed: HTTP 400", code="prompt_cache_restore_failed"))
    failed = run(prompt_cache.restore(failing, None, "http://e", None, saved, timeout=5, directory=str(tmp_path),
                                      identity_now=saved["identity"]))
    assert failed["state"] == "failed" and "HTTP 400" in failed["why"] and list(tmp_path.iterdir()) == []
    # A save that fails leaves the park standing, and says why.
    record = run(prompt_cache.save(failing, None, "http://e", None, budget=1000, timeout=5, directory=str(tmp_path),
                                   identity_now={}))
    assert record["state"] == "failed" and "HTTP 400" in record["why"]


def test_cache_ram_is_two_contexts_cut_to_what_resources_ram_leaves(monkeypatch):
    from capyctl.engines import llamacpp
    from capyctl.engines._gpu_layers import GgufLayout
    layout = GgufLayout(file_size=100 * MIB, block_count=30, kv_bytes_per_token=16 * 1024, context_length=8192)
    monkeypatch.setattr(llamacpp, "gguf_layout", lambda path: layout)
    kv_4096 = 64 * MIB  # 4096 tokens (llama.cpp.DEFAULT_CONTEXT) of 16 KiB
    assert cache_ram_bytes(spec(), "/m.gguf") == 2 * kv_4096
    assert cache_ram_bytes(spec(engine_args=["-c", "2048"]), "/m.gguf") == kv_4096
    # resources.ram leaves 400 - 100 (weights) - 64 (KV) - 128 (runtime) = 108 MiB.
    assert cache_ram_bytes(spec(resources={"ram": "400MiB"}), "/m.gguf") == 108 * MIB
    assert cache_ram_bytes(spec(resources={"ram": "256MiB"}), "/m.gguf") == 0
    assert cache_ram_bytes(spec(prompt_cache={"ram": "50MiB"}), "/m.gguf") == 50 * MIB
    assert cache_ram_bytes(spec(prompt_cache={"ram": "1GiB"}, resources={"ram": "400MiB"}), "/m.gguf") == 108 * MIB
    # The user's own --cache-ram is what the engine will hold, so that is what is planned.
    assert cache_ram_bytes(spec(engine_args=["--cache-ram", "300"]), "/m.gguf") == 300 * MIB
    with pytest.raises(CapyError) as refused:
        LlamaCppAdapter().check_task(spec(engine_args=["--cache-ram", "-1"]))
    assert refused.value.code == "prompt_cache_unbounded"


def test_vllm_and_sglang_host_caches_given_in_engine_args_are_planned():
    from capyctl.engines.sglang import SglangAdapter
    from capyctl.engines.vllm import VllmAdapter
    vllm = VllmAdapter()
    assert vllm.prompt_cache_ram(spec(engine="vllm"), None) == 0
    assert vllm.prompt_cache_ram(spec(engine="vllm", engine_args=["--kv-offloading-size", "4"]), None) == 4 << 30
    assert vllm.prompt_cache_ram(spec(engine="vllm", engine_args=["--kv-offloading-size=0.5"]), None) == 512 * MIB
    # LMCache keeps those bytes in its own server, not in vLLM's process.
    assert vllm.prompt_cache_ram(spec(engine="vllm", engine_args=["--kv-offloading-size", "4",
                                                                  "--kv-offloading-backend", "lmcache"]), None) == 0
    sglang = SglangAdapter()
    assert sglang.prompt_cache_ram(spec(engine="sglang", engine_args=["--hicache-size", "3"]), None) == 0  # HiCache off
    hicache = spec(engine="sglang", tensor_parallel=2, resources={"gpus": 2},
                   engine_args=["--enable-hierarchical-cache", "--hicache-size", "3"])
    assert sglang.prompt_cache_ram(hicache, None) == 2 * 3 * 10**9  # a pool per rank, in GB
    with pytest.raises(CapyError) as refused:
        sglang.check_task(spec(engine="sglang", engine_args=["--enable-hicache"]))
    assert refused.value.code == "prompt_cache_unbounded"
