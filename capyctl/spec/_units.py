"""Parsers for the human quantities a manifest carries: sizes and durations."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_size(value: object) -> int:
    """``8GiB``, ``512M`` (binary, as systemd reads it), ``2GB`` (decimal), or a number of bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 8GiB, 512M or a number of bytes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            number, prefix, binary, b = m.groups()
            prefix = prefix.lower()
            # "2GB" is decimal; "2G" and "2GiB" are binary, as in systemd's MemoryMax=.
            base = 1000 if (b and not binary and prefix) else 1024
            return int(float(number) * base ** _POWERS[prefix])
    raise ValueError(f"expected a size such as 8GiB, 512M or a number of bytes, got {value!r}")


def parse_duration(value: object) -> float:
    """``90s``, ``10m``, ``1h30m``, ``250ms``, or a number of seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, 10m or a number of seconds")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        parts = _DURATION_RE.findall(text)
        if parts and _DURATION_RE.sub("", text).strip() == "":
            return sum(float(n) * _SECONDS[u.lower()] for n, u in parts)
        try:
            return parse_duration(float(text))
        except ValueError:
            pass
    raise ValueError(f"expected a duration such as 30s, 10m or a number of seconds, got {value!r}")


Size = Annotated[int, BeforeValidator(parse_size), PlainSerializer(lambda v: v, return_type=int)]
Duration = Annotated[float, BeforeValidator(parse_duration)]
