"""Just enough of the GGUF format to read a model's string metadata (architecture, name)."""

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


def read_metadata(path: str, wanted: set[str]) -> dict[str, object]:
    """The values of the ``wanted`` keys: numbers, booleans and strings as such, arrays of numbers
    as lists (some models give ``<arch>.attention.head_count_kv`` per layer); other arrays are
    skipped. Stops reading once all are found."""
    found: dict[str, object] = {}
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version = _u32(f)
        if version < 2:
            raise ValueError(f"{path} is GGUF version {version}; only 2 and later are read")
        _u64(f)  # tensor count
        for _ in range(_u64(f)):
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
